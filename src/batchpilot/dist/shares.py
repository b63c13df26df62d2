"""Agreements for uneven shares: every rank keeps its own micro-batch, and all agree on every OOM.

With equal shares the ranks agree on one micro-batch (the smallest proposal). With uneven shares
of a global batch (:mod:`batchpilot.train.shares`) each rank runs the micro-batch its own memory
allows: :class:`OwnSizes` wraps the engine's coordinator for the micro-batch's part
(:class:`~batchpilot.train.adapt.MicroBatcher` and the ``"auto"`` start's search) so that the
OOM vote stays one collective every rank reaches, while the size agreed is each rank's own.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..find.result import BatchPlan
from .coordinator import Coordinator

__all__ = ["OwnSizes"]


class OwnSizes:
    """A coordinator's view for a micro-batch that is each rank's own.

    ``agree(oom, size)`` runs the coordinator's OOM vote (the same collective on every rank) and
    returns this rank's ``size``; ``agree_micro_batch(size)`` is ``size`` with no collective
    (every rank calls it at the same points, so none is needed); ``find_batch_size`` searches on
    each rank alone and keeps each rank's answer (under DDP: failures agreed; a ``lockstep``
    coordinator, FSDP, searches in lockstep and every rank starts from the common answer, which
    each then grows on its own memory); everything else is the coordinator's.

    Args:
        coordinator: the engine's coordinator.
    """

    def __init__(self, coordinator: Coordinator) -> None:
        self.inner = coordinator

    def __getattr__(self, name: str) -> Any:
        # only called for what this view does not define: the coordinator's members
        return getattr(self.inner, name)

    def agree_micro_batch(self, size: int) -> int:
        return int(size)

    def agree(self, oom: bool, size: int) -> tuple[bool, int]:
        return self.inner.agree_oom(oom), int(size)

    def find_batch_size(self, step: Callable[..., Any], *, restore: Iterable[Any] = (),
                        replay: Callable[[int], Any] | None = None, **options: Any) -> BatchPlan:
        inner = self.inner
        if inner.lockstep or inner.world_size == 1:
            return inner.find_batch_size(step, restore=restore, replay=replay, **options)
        from .distributed import find_batch_size_distributed  # on first use, as the engine does

        return find_batch_size_distributed(step, restore=restore, group=inner.group, agree=False, **options)

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return self.inner.sum_over_ranks(values)
