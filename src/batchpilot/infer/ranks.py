"""The one exchange between ranks of an inference call: every rank's sizing, or why it failed.

Scoring (:mod:`~batchpilot.infer.score`), generation (:mod:`~batchpilot.infer.generate`) and the
lm-eval adapter's groups each reach it once per call on every rank, also with nothing to bring or
after failing, so that no rank waits for another in a collective.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

__all__ = ["exchange"]


def exchange(agree: Callable[[Any], list[Any]], payload: Any, error: BaseException | None = None, *,
             what: str) -> list[Any]:
    """Every rank's ``payload`` through ``agree`` (an all-gather), once; the other ranks' that are not ``None``.

    Raises:
        BaseException: this rank's ``error``, after the exchange.
        RuntimeError: another rank failed: ``"{what} failed on rank R (...); stopping this rank too"``.
    """
    me = uuid.uuid4().hex
    failure = None if error is None else f"{type(error).__name__}: {error}"
    gathered = list(agree({"id": me, "payload": payload, "failed": failure}))
    if error is not None:
        raise error
    failed = [(r, s["failed"]) for r, s in enumerate(gathered) if s["failed"]]
    if failed:
        rank, why = failed[0]
        raise RuntimeError(f"{what} failed on rank {rank} ({why}); stopping this rank too")
    return [s["payload"] for s in gathered if s["id"] != me and s["payload"] is not None]
