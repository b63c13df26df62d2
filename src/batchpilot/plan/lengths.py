"""The planner over sequence lengths: the largest batch at each length, for a device you don't have.

At two or three lengths (:func:`batchpilot.policy.lengths.choose_fit_lengths`) the planner
(:func:`batchpilot.plan.planner.plan_batch_size`, fake tensors) finds the exact boundary; the estimates
on either side of it give the memory line at that length, and the lines fit the 2-D model of
:mod:`batchpilot.policy.lengths`, which answers every other length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from ..core.seqbatch import length_batch_fn
from ..policy.lengths import LengthBudget, LengthFit, check_lengths, choose_fit_lengths, fit_lengths
from .planner import plan_batch_size
from .result import PlanResult

__all__ = ["LengthPlanResult", "plan_per_length"]


@dataclass(frozen=True, kw_only=True)
class LengthPlanResult:
    """The planner's answer per sequence length.

    Attributes:
        per_length: ``{length: largest batch}`` for every length asked.
        fit: the 2-D memory model.
        plans: the planner's exact search at each fitted length.
        seconds: wall time of all of it.
    """

    per_length: dict[int, int]
    fit: LengthFit
    plans: dict[int, PlanResult] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def longest(self) -> PlanResult:
        return self.plans[max(self.plans)]

    def to_dict(self) -> dict[str, Any]:
        return {"per_length": [{"length": L, "batch_size": b} for L, b in sorted(self.per_length.items())],
                "length_fit": self.fit.to_dict(), "fitted_lengths": sorted(self.plans), "seconds": self.seconds}


def _line(plan: PlanResult) -> tuple[float, float]:
    """``(fixed, per_sample)`` through the two evaluations nearest the boundary."""
    ev = plan.evaluations
    sizes = sorted(ev)
    if plan.batch_size in ev and plan.batch_size + 1 in ev:
        x, y = plan.batch_size, plan.batch_size + 1
    else:
        x, y = sizes[-2], sizes[-1]
    slope = (ev[y] - ev[x]) / (y - x)
    return ev[x] - slope * x, slope


def plan_per_length(model: nn.Module, sample: Any, *, lengths: Any, capacity: int | float | str,
                    seq_dim: int | None = 1, **kwargs: Any) -> LengthPlanResult:
    """The largest batch at each of ``lengths``, planned on fake tensors.

    Args:
        model, capacity, kwargs: as for :func:`batchpilot.plan.planner.plan_batch_size` (``target``,
            ``optimizer``, ``loss_fn``, ``device``, ``max_batch_size``...).
        sample: an example batch padded to the longest length (trimmed on ``seq_dim``), or a
            function ``(batch_size, length) -> batch``.
        lengths: the lengths to answer for (two or more).

    Raises:
        ValueError: fewer than two lengths, a length that is not a positive int, a missing
            ``seq_dim``, an example shorter than the longest length; as ``plan_batch_size``.
        batchpilot.plan.result.PlanningError: the step cannot run on fake tensors.
    """
    started = time.perf_counter()
    asked = check_lengths(lengths)
    if len(asked) < 2:
        raise ValueError(f"lengths={asked}: give two or three lengths (or more) to separate the per-token cost "
                         "from the attention's L² cost")
    at_length: Callable[[int], Any] = length_batch_fn(sample, asked, seq_dim=seq_dim)
    plans = {L: plan_batch_size(model, at_length(L), capacity=capacity, **kwargs)
             for L in sorted(choose_fit_lengths(asked), reverse=True)}
    lines = {L: _line(p) for L, p in plans.items() if len(p.evaluations) >= 2}
    fit = fit_lengths(lines)
    verified = {L: p.batch_size for L, p in plans.items() if p.batch_size > 0}
    top = plans[max(plans)]
    per_length = {L: 0 for L in asked}
    if verified:
        budget = LengthBudget(fit=fit, limit_bytes=top.limit, verified=verified,
                              max_batch_size=kwargs.get("max_batch_size"))
        per_length.update(budget.table(asked))
    return LengthPlanResult(per_length=per_length, fit=fit, plans=plans, seconds=time.perf_counter() - started)
