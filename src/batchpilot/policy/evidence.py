"""Choices from measured times that hold on a busy machine: a noise estimate, the simple choice by default, a check.

A time measured on a shared machine is the step's cost stretched by whatever else ran at that
moment. Two rules follow, for every choice taken from a time (``docs/speed.md#noise``):

* **Evidence beats the noise.** A choice other than the simple one (the memory-bound batch,
  the untimed batching) is taken only when the measurements favour it by more than their own
  scatter: :func:`decide_throughput` for the throughput objective, :func:`fit_overhead` for
  the scorer's batching.
* **Checked afterwards.** Where the work goes on after the choice, its real times are compared
  with what the choice predicted, and a disagreement beyond the noise goes back to the simple
  choice, once and for good (:class:`BatchingCheck`; the engine's split:
  :class:`~batchpilot.policy.speed.SplitCheck`).

The noise model: a time is ``cost × load``, the load a factor of at least one that drifts over
seconds. Times taken side by side share most of it, so their ratio cancels it; what remains
scatters about the true ratio, measured here as the standard deviation of the logarithm.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .._checks import positive_int
from .speed import fit_time

__all__ = [
    "NOISE_Z",
    "CHECK_CALLS",
    "log_spread",
    "ThroughputDecision",
    "decide_throughput",
    "OverheadFit",
    "fit_overhead",
    "BatchingCheck",
]

#: how many standard errors a difference must exceed to count as evidence (about 2.5% one-sided
#: under normal noise)
NOISE_Z = 2.0
#: real calls the scorer's timed batching is checked on before it is kept
CHECK_CALLS = 4


def log_spread(groups: Iterable[Sequence[float]]) -> tuple[float, int]:
    """The pooled standard deviation of ``log(x)`` about each group's mean, and its degrees of freedom.

    Each group holds repeated measurements of one quantity (positive); a group of one adds nothing.
    ``(0.0, 0)`` when no group has two values.

    Example: ``log_spread([[1.0, 1.1], [2.0, 2.2]])`` is about ``(0.067, 2)``.
    """
    ss, dof = 0.0, 0
    for g in groups:
        logs = [math.log(x) for x in g if x > 0]
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        ss += sum((v - mean) ** 2 for v in logs)
        dof += len(logs) - 1
    return (math.sqrt(ss / dof), dof) if dof else (0.0, 0)


@dataclass(frozen=True, kw_only=True)
class ThroughputDecision:
    """What :func:`decide_throughput` chose, and on what evidence.

    Attributes:
        batch_size: the answer.
        largest: the largest size timed (the memory-bound answer, the simple choice).
        ratios: ``{size: samples/s relative to largest}``, the geometric mean over the rounds.
        noise: the standard deviation of one round's log ratio (``inf``: not estimable).
        rounds: rounds of side-by-side timings.
        tolerance: the share of the best samples/s a smaller batch may give up.
        reason: one line that says why.
        settled: the point estimates answer the same (``False``: only the noise kept them from
            another answer, and more rounds may tell).
    """

    batch_size: int
    largest: int
    ratios: dict[int, float]
    noise: float
    rounds: int
    tolerance: float
    reason: str
    settled: bool = True


def decide_throughput(rounds: Sequence[Mapping[int, float]], tolerance: float, *,
                      z: float = NOISE_Z) -> ThroughputDecision | None:
    """The smallest batch within ``tolerance`` of the fastest *beyond the noise*; else the largest.

    ``rounds``: each round's ``{batch size: seconds per step}``, the sizes timed one after the
    other (side by side). Within a round every size is compared with the largest,
    ``q = (b / t_b) / (M / t_M)``; over the rounds, each size's mean ``log q`` has a standard
    error ``s / √n`` from the pooled scatter ``s`` (:func:`log_spread`). A size counts as faster
    than the largest only by its lower bound ``mean - z·se``, and a smaller size is taken only when
    its lower bound is within ``tolerance`` of the best such bound (the largest's is 0). With no
    scatter (a quiet clock) this is :func:`~batchpilot.policy.speed.choose_fastest`; with one round
    the noise is unknown and the answer is the largest.

    ``None`` when no size was timed.
    """
    sizes = sorted({b for r in rounds for b, t in r.items() if t and t > 0})
    if not sizes:
        return None
    M = sizes[-1]
    logs: dict[int, list[float]] = {b: [] for b in sizes[:-1]}
    for r in rounds:
        tm = r.get(M)
        if not tm or tm <= 0:
            continue
        for b in logs:
            tb = r.get(b)
            if tb and tb > 0:
                logs[b].append(math.log((b / tb) / (M / tm)))
    logs = {b: v for b, v in logs.items() if v}
    s, dof = log_spread([[math.exp(x) for x in v] for v in logs.values()])
    noise = s if dof else math.inf
    mean = {b: sum(v) / len(v) for b, v in logs.items()}
    lower = {b: mean[b] - (z * noise / math.sqrt(len(logs[b])) if noise > 0 else 0.0) for b in mean}
    best = max([0.0, *lower.values()])
    floor = best + math.log(1.0 - tolerance)
    ok = [b for b in sorted(lower) if lower[b] >= floor]
    chosen = ok[0] if ok else M
    top = max([0.0, *mean.values()])
    point = next((b for b in sorted(mean) if mean[b] >= top + math.log(1.0 - tolerance)), M)
    ratios = {b: math.exp(m) for b, m in mean.items()}
    ratios[M] = 1.0
    n = max((len(v) for v in logs.values()), default=1)
    spread = "unknown" if math.isinf(noise) else f"±{noise:.1%}"
    evidence = f"over {n} round{'s' if n != 1 else ''} side by side, noise {spread} per round"
    if chosen != M:
        reason = (f"smallest within {tolerance:.0%} of the fastest beyond the noise: batch {chosen} at "
                  f"{ratios[chosen]:.2f} of batch {M}'s samples/s ({evidence})")
    else:
        near = [b for b in sorted(mean) if mean[b] >= math.log(1.0 - tolerance)]
        if near:
            reason = (f"the largest that fits: no smaller size within {tolerance:.0%} of its samples/s beyond "
                      f"the noise (batch {near[0]} read {ratios[near[0]]:.2f}, {evidence})")
        else:
            reason = f"the largest that fits is the fastest measured ({evidence})"
    return ThroughputDecision(batch_size=chosen, largest=M, ratios=ratios, noise=noise, rounds=n,
                              tolerance=tolerance, reason=reason, settled=point == chosen)


@dataclass(frozen=True, kw_only=True)
class OverheadFit:
    """``seconds ≈ fixed + per_token × tokens`` for calls near one length, and how well it holds.

    Attributes:
        fixed: seconds a call costs whatever its size.
        per_token: seconds per padded token.
        noise: the standard deviation of ``log(seconds / predicted)`` over the calls (``n - 2``
            degrees of freedom).
        calls: the calls it rests on.
    """

    fixed: float
    per_token: float
    noise: float
    calls: int

    @property
    def overhead_tokens(self) -> float:
        """The fixed cost in tokens' worth of compute (``inf`` without a per-token cost)."""
        return math.inf if self.per_token <= 0 else self.fixed / self.per_token

    def predict(self, tokens: float) -> float:
        return self.fixed + self.per_token * tokens


def fit_overhead(times: Mapping[int, Sequence[float]], tolerance: float) -> OverheadFit | None:
    """The line through ``{padded tokens: [seconds of each call]}`` if it predicts the calls within ``tolerance``.

    The line goes through each token count's fastest call (load only adds time;
    :func:`~batchpilot.policy.speed.fit_time`); its noise is the scatter of every call about it.
    The scorer's timed batching keeps each batch within ``1 + tolerance`` of its requests' own
    cost by this line, which it can only do when the line predicts a call to better than that:
    ``None`` (the untimed batching, the simple choice) with fewer than three calls, fewer than two
    token counts, or a noise above ``tolerance``.
    """
    calls = [(tok, t) for tok, ts in times.items() for t in ts if t > 0]
    fastest = {tok: min(t for k, t in calls if k == tok) for tok in {k for k, _ in calls}}
    if len(calls) < 3 or len(fastest) < 2:
        return None
    fit = fit_time(fastest)
    if fit is None:
        return None
    resid = [math.log(t / fit.predict(tok)) for tok, t in calls if fit.predict(tok) > 0]
    if len(resid) < 3:
        return None
    noise = math.sqrt(sum(r * r for r in resid) / (len(resid) - 2))
    if noise > tolerance:
        return None
    return OverheadFit(fixed=fit.fixed_seconds, per_token=fit.seconds_per_sample, noise=noise, calls=len(calls))


@dataclass
class BatchingCheck:
    """Real calls decide whether a timed batching is kept: their times against the line that chose them.

    Each call batched by the measured line is observed with the seconds the line predicted for
    it. After ``calls`` calls the median ``log(real / predicted)`` decides: within
    ``log(1 + tolerance) + z · noise / √calls`` of zero the line holds (``"timed"``), else the
    batching goes back to the untimed rule (``"simple"``) for good -- a line that mispredicts the
    calls by more than the noise it was nominated with and more than the tolerance the batching
    promises cannot be trusted to trade a call against its padding.

    Raises:
        ValueError: ``calls`` not a positive int, ``noise`` negative, ``tolerance`` outside [0, 0.5).
    """

    noise: float
    tolerance: float
    calls: int = CHECK_CALLS
    z: float = NOISE_Z
    #: ``log(real / predicted)`` of each call observed
    logs: list[float] = field(default_factory=list)
    #: ``"timed"`` or ``"simple"`` once decided, else ``None``
    verdict: str | None = None

    def __post_init__(self) -> None:
        positive_int("calls", self.calls)
        if not self.noise >= 0:
            raise ValueError(f"noise must be a non-negative number, got {self.noise!r}")
        if not 0 <= self.tolerance < 0.5:
            raise ValueError(f"tolerance must be a fraction in [0, 0.5), got {self.tolerance!r}")

    @property
    def bound(self) -> float:
        """The largest median ``|log(real / predicted)|`` that keeps the timed batching."""
        return math.log(1.0 + self.tolerance) + self.z * self.noise / math.sqrt(self.calls)

    def observe(self, predicted: float, seconds: float) -> str | None:
        """One call's predicted and real seconds; returns the verdict once there is one.

        Raises:
            ValueError: after the verdict, or a non-positive time.
        """
        if self.verdict is not None:
            raise ValueError(f"the batching check has decided ({self.verdict}); it observes no more calls")
        if not (predicted > 0 and seconds > 0):
            raise ValueError(f"times must be positive seconds, got predicted {predicted!r}, real {seconds!r}")
        self.logs.append(math.log(seconds / predicted))
        if len(self.logs) >= self.calls:
            self.verdict = "timed" if abs(statistics.median(self.logs)) <= self.bound else "simple"
        return self.verdict

    @property
    def reason(self) -> str:
        """One line: what the real calls showed (empty before the verdict)."""
        if self.verdict is None:
            return ""
        ratio = math.exp(statistics.median(self.logs))
        real = (f"{len(self.logs)} real calls took {ratio:.2f}x the time the measured call overhead predicted "
                f"(noise ±{self.noise:.1%}; kept within {math.exp(self.bound):.2f}x either way)")
        if self.verdict == "timed":
            return f"batched by the measured call overhead: {real}"
        return f"batched by length alone (requests at least half as long as the first): {real}"
