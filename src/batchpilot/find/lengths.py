"""The finder over sequence lengths: real searches at two or three lengths, a table for every length.

``find_batch_size_for(..., lengths=...)`` lands here. Each fitted length is a full search
(:func:`batchpilot.find.front.find_batch_size_for`) on the example batch trimmed to it, so the answer
at the longest length is verified by real trials; the memory lines of those searches fit the
2-D model of :mod:`batchpilot.policy.lengths`, which answers the lengths between.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .._progress import stage
from ..core.seqbatch import length_batch_fn
from ..memory.units import format_bytes
from ..policy.lengths import LengthBudget, LengthFit, check_lengths, choose_fit_lengths, fit_lengths
from ..policy.search import BatchSizeError, least_squares_line
from .notes import note_length_search
from .result import BatchPlan

__all__ = ["LengthPlan", "find_per_length"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, repr=False)
class LengthPlan(BatchPlan):
    """A :class:`~batchpilot.find.result.BatchPlan` at the longest length, with the answer at every length.

    Its own fields (``batch_size``, ``trials``, ``fit``...) are the search at the longest
    length, verified by real trials, except ``seconds`` and ``compilations``, which count every
    length's search; pass it as the engine's ``start=`` to size each step by its length.

    Attributes:
        per_length: ``{length: largest micro-batch}`` for the lengths asked for.
        length_fit: the 2-D memory model (:class:`~batchpilot.policy.lengths.LengthFit`).
        length_plans: the search at each fitted length.
        seq_dim: the sequence dimension the example batch was trimmed on (``None``: a function built it).
    """

    per_length: dict[int, int] = field(default_factory=dict)
    length_fit: LengthFit | None = None
    length_plans: dict[int, BatchPlan] = field(default_factory=dict)
    seq_dim: int | None = 1

    @property
    def max_length(self) -> int:
        return max(self.length_plans)

    def budget(self, max_batch_size: int | None = None) -> LengthBudget:
        """The per-length budget, verified at every fitted length (capped at ``max_batch_size``)."""
        assert self.length_fit is not None
        verified = {L: _fitting(p) for L, p in self.length_plans.items() if _fitting(p) > 0}
        capped = {L for L, p in self.length_plans.items() if L in verified and p.stop_reason == "max_batch_size"}
        return LengthBudget(fit=self.length_fit, limit_bytes=self.limit_bytes, verified=verified,
                            max_batch_size=max_batch_size, capped=capped)

    def describe(self) -> str:
        """A few lines: the answer at each length, the limit, the 2-D memory model, the searches, what would raise it."""
        table = ", ".join(f"{L}: {b}" for L, b in sorted(self.per_length.items()))
        lines = [f"batch size by length on {self.device}: {table or '(no lengths asked)'}",
                 f"  {self.limit_text()}"]
        if self.length_fit is not None:
            f = self.length_fit
            lines.append(f"  memory model: peak = F(L) + b x P(L), P(L) = {format_bytes(f.per_sample[0])} + "
                         f"{format_bytes(f.per_sample[1])} x L + {f.per_sample[2]:.3g} B x L^2 per sample, "
                         f"from searches at lengths {', '.join(map(str, sorted(self.length_plans)))}")
        trials = sum(p.num_trials for p in self.length_plans.values())
        ooms = sum(p.num_ooms for p in self.length_plans.values())
        lines.append(f"  at the longest, {self.max_length}: batch {self.batch_size}, {self.reason or self.stop_reason}")
        lines.append(f"  search: {len(self.length_plans)} searches ({self.strategy}), {trials} trials, {ooms} OOM, "
                     f"{self.seconds:.1f}s")
        raise_it = self.to_raise()
        if raise_it:
            lines.append(f"  to raise it: {raise_it}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"LengthPlan(per_length={self.per_length}, limit_bytes={self.limit_bytes}, memory={self.memory!r}, "
                f"target={self.target}, device={self.device!r}, lengths_searched={sorted(self.length_plans)}, "
                f"trials={sum(p.num_trials for p in self.length_plans.values())})")

    def to_dict(self) -> dict[str, Any]:
        out = BatchPlan.to_dict(dataclasses.replace(self, length_plans={}, length_fit=None, per_length={}))
        for key in ("per_length", "length_fit", "length_plans"):
            out.pop(key, None)
        out["per_length"] = [{"length": L, "batch_size": b} for L, b in sorted(self.per_length.items())]
        out["length_fit"] = None if self.length_fit is None else self.length_fit.to_dict()
        out["fitted_lengths"] = sorted(self.length_plans)
        out["length_trials"] = {str(L): p.num_trials for L, p in sorted(self.length_plans.items())}
        return out


def _fitting(plan: BatchPlan) -> int:
    return int(plan.largest_fitting or plan.batch_size)


def find_per_length(find: Callable[..., BatchPlan], model: Any, batch: Any, *, lengths: Any,
                    seq_dim: int | None = None, **kwargs: Any) -> LengthPlan:
    """Search at two or three of ``lengths`` and fit the 2-D model; see ``find_batch_size_for(lengths=)``.

    Raises:
        ValueError: bad ``lengths`` (fewer than two, or not positive ints), a missing ``seq_dim``,
            an example batch shorter than the longest length.
        BatchSizeError: a search measured no memory line (raise ``max_batch_size``).
    """
    asked = check_lengths(lengths)
    if len(asked) < 2:
        raise ValueError(
            f"lengths={tuple(asked)}: give two or three lengths (or more, for a longer table) to separate the "
            f"per-token cost from the attention's L² cost, e.g. lengths=({max(1, asked[0] // 4)}, {asked[0]})"
        )
    fitted = choose_fit_lengths(asked)
    at_length = length_batch_fn(batch, asked, seq_dim=seq_dim)
    functional = callable(batch) and not isinstance(batch, torch.Tensor)
    # the dim a compiled model sees change between the searches (a function's batches: only if declared)
    token_dim = seq_dim if functional else (seq_dim or 1)
    plans: dict[int, BatchPlan] = {}
    for i, L in enumerate(sorted(fitted, reverse=True)):  # the longest first: a nothing-fits fails fastest there
        try:
            with stage(f"length {L} ({i + 1} of {len(fitted)})"):
                plans[L] = find(model, at_length(L), seq_dim=token_dim, **kwargs)
        except Exception as exc:
            note_length_search(exc, L, sorted(plans))
            raise
        logger.info("length %d: batch %d in %d trials", L, plans[L].batch_size, plans[L].num_trials)
    lines = {}
    for L, p in plans.items():
        if p.fit is None:
            raise BatchSizeError(
                f"the search at length {L} measured fewer than two batch sizes, so no memory line; raise "
                "max_batch_size or max_trials"
            )
        lines[L] = _line(p)
    fit = fit_lengths(lines)
    top = plans[fitted[-1]]
    base = {f.name: getattr(top, f.name) for f in dataclasses.fields(BatchPlan)}
    base["seconds"] = sum(p.seconds for p in plans.values())
    base["compilations"] = sum(p.compilations for p in plans.values())
    out = LengthPlan(**base, length_fit=fit, length_plans=plans,
                     seq_dim=None if functional else (seq_dim or 1))
    options = kwargs.get("options")
    budget = out.budget(None if options is None else options.max_batch_size)
    out.per_length = budget.table(asked)
    return out


def _line(plan: BatchPlan) -> tuple[float, float]:
    """``(fixed, per_sample)`` at one length: least squares over the search's measured sizes from 2 up.

    The search's own line runs through the two trials nearest its boundary, often one sample
    apart, where a few KB of noise in one peak (a cycle freed a step later) tilted the slope by
    a fifth and the fit over three lengths by as much at a fourth. Every measured size but 1
    (which may take another path) spreads that over the whole search.
    """
    pts = {t.batch_size: float(t.peak_bytes) for t in plan.trials
           if t.measured and t.batch_size >= 2 and t.peak_bytes is not None}
    if len(pts) < 3:
        assert plan.fit is not None
        return (plan.fit.fixed_bytes, plan.fit.bytes_per_sample)
    return least_squares_line(dict(sorted(pts.items())))
