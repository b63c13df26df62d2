"""Speed: a step-time model and the choices made on it, all torch-free.

A timed trial is a batch size and the seconds one step takes there. :func:`fit_time` fits
``T(b) = fixed + per_sample × b``; :func:`choose_fastest` applies the throughput objective (the
smallest batch whose samples/s is within a tolerance of the best); :class:`ThroughputSearch`
names the next batch size to time; :func:`choose_split` nominates a split of a per-rank batch
into micro-batches by the predicted time of the whole step, and :class:`SplitCheck` keeps it
only if paired real steps confirm it. Why and how: ``docs/speed.md``, ``docs/internals.md#speed``.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .._checks import positive_int
from .microbatch import accum_steps, balanced_sizes

__all__ = [
    "OBJECTIVES",
    "SPEED_TOLERANCE",
    "check_objective",
    "check_speed_tolerance",
    "monotone_times",
    "TimeFit",
    "fit_time",
    "TimeCurve",
    "SpeedChoice",
    "choose_fastest",
    "ThroughputSearch",
    "timed_fits",
    "decisive_sizes",
    "spare_size",
    "search_throughput",
    "SplitChoice",
    "split_seconds",
    "choose_split",
    "SPLIT_CHECK_PAIRS",
    "SplitCheck",
]

logger = logging.getLogger(__name__)

#: ``"memory"``: the largest batch that fits; ``"throughput"``: the smallest that is about as fast.
OBJECTIVES = ("memory", "throughput")
#: DeepSpeed's autotuner stops growing the micro-batch once throughput gains less than 5%.
SPEED_TOLERANCE = 0.05
#: Pairs of real steps (the split, the fewest micro-batches) that must all favour a timed split
#: before it is kept: with no real difference each pair favours either side about as often, so
#: four in a row happen by chance about one time in sixteen, and a pair against it ends the check
#: at once. An even count: each side runs first in as many pairs (a load that only rises from a
#: quiet start favours whichever step runs first).
SPLIT_CHECK_PAIRS = 4


def check_objective(objective: Any, *, error: type[Exception] = ValueError) -> str:
    """``objective`` if it is one of :data:`OBJECTIVES`.

    Raises:
        ValueError (or ``error``): any other value; the message lists the choices.
    """
    if objective not in OBJECTIVES:
        raise error(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}: "
                    "'memory' for the largest batch that fits, 'throughput' for the smallest about as fast")
    return objective


def check_speed_tolerance(value: Any, *, error: type[Exception] = ValueError) -> float:
    """``value`` as a float in [0, 0.5): the share of the best samples/s one may give up.

    Raises:
        ValueError (or ``error``): not a number in that range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 0.5:
        raise error(f"speed_tolerance must be a fraction in [0, 0.5), got {value!r}; 0.05 gives up at most 5% "
                    "of the best samples/s for a smaller batch")
    return float(value)


def monotone_times(points: Mapping[int, float]) -> dict[int, float]:
    """Step times made non-decreasing in the batch size, by the faster larger batches.

    A step on more samples does not take less time, and load from other processes only ever
    adds time: a size measured slower than a larger one was slowed down, and the larger one's
    time bounds it. ``{8: 0.1, 16: 0.3, 32: 0.2}`` becomes ``{8: 0.1, 16: 0.2, 32: 0.2}``.
    Non-positive times are dropped.
    """
    out: dict[int, float] = {}
    bound = math.inf
    for b in sorted(points, reverse=True):
        t = float(points[b])
        if t > 0:
            bound = min(bound, t)
            out[int(b)] = bound
    return dict(sorted(out.items()))


@dataclass(frozen=True, kw_only=True)
class TimeFit:
    """``seconds per step ≈ fixed_seconds + seconds_per_sample × batch_size``.

    ``fixed_seconds`` is what a step costs whatever its size (kernel launches, the optimizer
    step, Python); ``seconds_per_sample`` the rest. Samples/s then saturate at
    ``1 / seconds_per_sample``.
    """

    fixed_seconds: float
    seconds_per_sample: float

    def predict(self, batch_size: int) -> float:
        return self.fixed_seconds + self.seconds_per_sample * batch_size

    def samples_per_second(self, batch_size: int) -> float:
        t = self.predict(batch_size)
        return batch_size / t if t > 0 else math.inf

    def knee(self, samples_per_second: float) -> float | None:
        """The smallest batch size this line gives ``samples_per_second`` at; ``None`` if it never does.

        ``b / (fixed + per_sample × b) >= s`` holds from ``b = s × fixed / (1 - s × per_sample)``.
        """
        room = 1.0 - samples_per_second * self.seconds_per_sample
        if room <= 0:
            return None
        return samples_per_second * self.fixed_seconds / room


def fit_time(points: Mapping[int, float]) -> TimeFit | None:
    """The line ``fixed + per_sample × b`` through ``{batch size: seconds}``; ``None`` for fewer than two sizes.

    Least squares on the *relative* error (step times span orders of magnitude, and a
    millisecond matters at batch 1, not at batch 4096) of :func:`monotone_times`, with both
    coefficients kept at or above zero: a negative fixed cost becomes 0 (time proportional to the batch), a
    negative slope 0 (the step is fixed cost only).

    Example: ``fit_time({1: 0.011, 10: 0.02, 100: 0.11})`` is ``0.01 + 0.001 × b``.
    """
    pts = [(float(b), t) for b, t in monotone_times(points).items()]
    if len(pts) < 2:
        return None
    w = [1.0 / (t * t) for _, t in pts]
    s0 = sum(w)
    s1 = sum(wi * b for wi, (b, _) in zip(w, pts))
    s2 = sum(wi * b * b for wi, (b, _) in zip(w, pts))
    t0 = sum(wi * t for wi, (_, t) in zip(w, pts))
    t1 = sum(wi * b * t for wi, (b, t) in zip(w, pts))
    det = s0 * s2 - s1 * s1
    slope = (s0 * t1 - s1 * t0) / det
    fixed = (t0 - slope * s1) / s0
    if fixed < 0:
        fixed, slope = 0.0, t1 / s2
    if slope < 0:
        fixed, slope = t0 / s0, 0.0
    return TimeFit(fixed_seconds=fixed, seconds_per_sample=slope)


class TimeCurve:
    """Step seconds at any batch size, from measured ``{batch size: seconds}``.

    Between measured sizes (:func:`monotone_times`): the straight line between their times (a
    curve that bends, e.g. one whose samples/s fall at large batches, is followed where it was
    measured). Outside them: the slope of :func:`fit_time` from the nearest measured point.
    Sizes less than ``spacing`` apart (as a ratio) are one point, the faster per sample: the
    difference between two nearly equal sizes is noise, and a line through them would turn it
    into a slope.

    Raises:
        ValueError: fewer than two measured sizes, ``spacing`` below 1.
    """

    def __init__(self, points: Mapping[int, float], *, spacing: float = 1.125) -> None:
        if not spacing >= 1:
            raise ValueError(f"spacing must be at least 1, got {spacing!r}")
        kept: dict[int, float] = {}
        for b, t in monotone_times(points).items():
            last = max(kept) if kept else None
            if last is not None and b < spacing * last:
                if t / b < kept[last] / last:
                    del kept[last]
                    kept[b] = t
                continue
            kept[b] = t
        self.points = kept
        fit = fit_time(self.points)
        if fit is None:
            raise ValueError(f"a time curve needs two measured batch sizes or more, got {sorted(self.points)}")
        self.fit = fit
        self.sizes = list(self.points)

    @property
    def smallest(self) -> int:
        return self.sizes[0]

    def __call__(self, batch_size: int) -> float:
        pts, sizes = self.points, self.sizes
        if batch_size in pts:
            return pts[batch_size]
        if batch_size < sizes[0]:
            return max(0.0, pts[sizes[0]] - self.fit.seconds_per_sample * (sizes[0] - batch_size))
        if batch_size > sizes[-1]:
            return pts[sizes[-1]] + self.fit.seconds_per_sample * (batch_size - sizes[-1])
        hi = next(b for b in sizes if b > batch_size)
        lo = sizes[sizes.index(hi) - 1]
        return pts[lo] + (pts[hi] - pts[lo]) * (batch_size - lo) / (hi - lo)


@dataclass(frozen=True, kw_only=True)
class SpeedChoice:
    """What :func:`choose_fastest` picked, and against what."""

    batch_size: int
    samples_per_second: float
    best_batch_size: int
    best_samples_per_second: float
    tolerance: float

    @property
    def reason(self) -> str:
        if self.batch_size == self.best_batch_size:
            return f"fastest measured: {self.samples_per_second:,.0f} samples/s at batch {self.batch_size}"
        return (f"smallest within {self.tolerance:.0%} of the fastest: {self.samples_per_second:,.0f} samples/s "
                f"at batch {self.batch_size}, {self.best_samples_per_second:,.0f} at {self.best_batch_size}")


def choose_fastest(points: Mapping[int, float], tolerance: float = SPEED_TOLERANCE) -> SpeedChoice | None:
    """The smallest batch whose samples/s is within ``tolerance`` of the best of ``points``.

    ``points`` maps batch sizes (all of which fit) to seconds per step, read through
    :func:`monotone_times`; ``None`` when empty.
    On a curve that saturates this is its knee; on one that falls at large batches, a size at
    or below the peak. Example, seconds ``{8: 0.1, 16: 0.12, 32: 0.2, 64: 0.39}`` (80, 133,
    160, 164 samples/s) and 5%: 32 (within 5% of 164), not 64.
    """
    sps = {b: b / t for b, t in monotone_times(points).items()}
    if not sps:
        return None
    best = max(sps, key=lambda b: (sps[b], -b))
    floor = (1.0 - tolerance) * sps[best]
    chosen = min(b for b, s in sps.items() if s >= floor)
    return SpeedChoice(batch_size=chosen, samples_per_second=sps[chosen], best_batch_size=best,
                       best_samples_per_second=sps[best], tolerance=tolerance)


@dataclass(frozen=True, kw_only=True)
class ThroughputSearch:
    """Which batch size to time next, so that :func:`choose_fastest` lands on the knee or the peak.

    It starts where the memory search ended (its timed trials, the largest fitting size
    ``highest`` among them) and probes sizes below ``highest`` only:

    1. **The peak.** Once a larger size measured slower than the fastest one (the curve
       falls), a measured neighbour of the fastest size that is more than ``ladder`` times
       larger or smaller, and slower by more than half the ``tolerance``, has the geometric
       mean of the two timed: the peak may lie in between.
    2. **The knee.** The answer ``a`` (smallest size within ``tolerance`` of the best) is
       bracketed from below by the largest measured size under it, ``L`` (too slow). While
       ``a - L`` is more than ``resolution × a``, a size inside is timed: where the fitted
       line ``T(b) = α + β b`` reaches the tolerance (if that lies inside the bracket and
       not within ``resolution`` of ``a``; ``a × (1 - resolution)`` when it does, which
       certifies ``a``), else the geometric mean of ``L`` and ``a``.

    Example, ``T(b) = 0.05 + 0.001 b`` after a memory search timed 1, 14 and 2841 (982.7
    samples/s at 2841): 703 (where the line reaches 95% of that; it does), 616 (certifying
    703: too slow) — the answer 703, in 2 more trials (``tests/policy/test_speed.py``).

    Raises:
        ValueError: ``tolerance`` outside [0, 0.5), ``resolution`` outside (0, 0.5) or
            ``ladder`` not above 1.
    """

    tolerance: float = SPEED_TOLERANCE
    resolution: float = 0.125
    ladder: float = 2.0

    def __post_init__(self) -> None:
        check_speed_tolerance(self.tolerance)
        if not 0 < self.resolution < 0.5:
            raise ValueError(f"resolution must be in (0, 0.5), got {self.resolution!r}")
        if not self.ladder > 1:
            raise ValueError(f"ladder must be above 1, got {self.ladder!r}")

    def next_size(self, points: Mapping[int, float], *, lowest: int, highest: int) -> int | None:
        """The next batch size to time in ``[lowest, highest]``, or ``None`` when the choice is made.

        Args:
            points: ``{batch size: seconds per step}`` of the timed trials that fit.
            lowest: the smallest size allowed (``min_batch_size``).
            highest: the largest size that fits (the memory search's answer).
        """
        pts = {b: t for b, t in points.items() if lowest <= b <= highest and t > 0}
        choice = choose_fastest(pts, self.tolerance)
        if choice is None:
            return None
        sizes = sorted(pts)
        probe = self._peak_gap(monotone_times(pts), choice)
        if probe is None:
            probe = self._knee(pts, sizes, choice, lowest)
        if probe is None or probe in pts:
            return None
        return probe

    def _peak_gap(self, times: Mapping[int, float], choice: SpeedChoice) -> int | None:
        sizes, best = list(times), choice.best_batch_size
        if best == sizes[-1]:
            return None  # no sign of a fall: the knee search below covers the rest
        i = sizes.index(best)
        # a neighbour about as fast says the curve is flat in between: no peak to look for there
        slow = (1.0 - self.tolerance / 2) * choice.best_samples_per_second
        gaps = []
        for other in sizes[i + 1:i + 2] + sizes[max(0, i - 1):i]:  # the neighbours above and below
            if other / times[other] < slow:
                lo, hi = min(best, other), max(best, other)
                gaps.append((hi / lo, lo, hi))
        for ratio, lo, hi in sorted(gaps, reverse=True):
            mid = math.isqrt(lo * hi)
            if ratio > self.ladder and lo < mid < hi:
                return mid
        return None

    def _knee(self, pts: Mapping[int, float], sizes: list[int], choice: SpeedChoice, lowest: int) -> int | None:
        a = choice.batch_size
        below = [b for b in sizes if b < a]
        low = below[-1] if below else lowest - 1  # every measured size under a is too slow
        if a - low <= max(1.0, self.resolution * a):
            return None
        fit = fit_time(pts)
        knee = None if fit is None else fit.knee((1.0 - self.tolerance) * choice.best_samples_per_second)
        if knee is not None and low < knee < a:
            guess = math.ceil(knee)
            if guess >= a * (1 - self.resolution):
                guess = math.ceil(a * (1 - self.resolution))  # the line agrees with a: certify it
        else:
            guess = math.isqrt(max(low, lowest) * a) if low >= 1 else (lowest + a) // 2
        return min(max(guess, low + 1), a - 1)


def timed_fits(trials: Iterable[Any], upto: int | None = None) -> dict[int, float]:
    """``{batch size: seconds per step}`` of the trials (:class:`~batchpilot.policy.search.Trial`) that fitted
    and were timed.

    ``upto``: only sizes at most this.
    """
    return {t.batch_size: t.step_seconds for t in trials
            if t.fits and t.step_seconds and (upto is None or t.batch_size <= upto)}


def decisive_sizes(points: Mapping[int, float], tolerance: float = SPEED_TOLERANCE) -> list[int]:
    """The sizes the throughput choice rests on: the answer, the size under it, the fastest and the largest.

    Measured at different times on a shared machine, their times carry different noise; timing
    them again, in turn, is what makes the comparison fair (:func:`search_throughput`). The
    largest (the memory answer) is among them because a slow first measurement there reads
    as a curve that falls, and sends the search after a peak that is not there.
    """
    choice = choose_fastest(points, tolerance)
    if choice is None:
        return []
    below = [b for b in points if b < choice.batch_size]
    return sorted({choice.batch_size, choice.best_batch_size, max(points), *([max(below)] if below else [])})


def spare_size(points: Mapping[int, float], tolerance: float = SPEED_TOLERANCE, spacing: float = 1.125) -> int | None:
    """A size between the throughput answer and the largest, where the time line puts half the ``tolerance``.

    The answer of :func:`choose_fastest` sits at the tolerance's edge by construction, so on a
    noisy clock the evidence seldom clears it (:func:`~batchpilot.policy.evidence.decide_throughput`),
    and the next candidate would be the largest. This size gives up half as much: timed beside
    the others, it is the smaller batch that noise of up to about a quarter of the tolerance per
    round still lets through. ``None`` without a line, or when it lies within ``spacing`` (a ratio)
    of the answer or the largest.
    """
    choice = choose_fastest(points, tolerance)
    fit = fit_time(points)
    if choice is None or fit is None:
        return None
    knee = fit.knee((1.0 - tolerance / 2) * choice.best_samples_per_second)
    top = max(points)
    if knee is None or not choice.batch_size * spacing < knee < top / spacing:
        return None
    return math.ceil(knee)


def search_throughput(
    trials: list[Any], run_trial: Callable[[int], Any], *, lowest: int, highest: int,
    tolerance: float = SPEED_TOLERANCE, max_trials: int = 25, on_trial: Callable[[Any], None] | None = None,
    retime: Callable[[int], float | None] | None = None, rounds: int = 3,
    settled: Callable[[list[dict[int, float]]], bool] | None = None, max_rounds: int = 6,
) -> list[dict[int, float]] | None:
    """Time the sizes :class:`ThroughputSearch` asks for below ``highest``, appending each trial to ``trials``.

    ``trials`` are the memory search's (``highest`` the largest that fitted); ``run_trial`` runs
    one more and returns its :class:`batchpilot.policy.search.Trial`. When the search is done, and
    ``retime`` is given (the fastest of a fresh visit's timed steps at a size, or ``None``),
    the :func:`decisive_sizes` and the :func:`spare_size` (a trial first) are visited ``rounds``
    more times, in turn, and each trial's
    ``step_seconds`` becomes the median over its visits; if that changes the choice, the
    search goes on from there (three times at most). Stops early when ``trials`` holds
    ``max_trials`` (logged: the answer may then be larger than the knee).

    With ``settled`` (whether the rounds so far decide the answer), more rounds follow while they
    do not, up to ``max_rounds``: on a noisy clock more evidence rather than a guess.

    Returns the last re-timing's rounds, ``[{batch size: seconds}, ...]`` in the order they ran
    (the evidence :func:`~batchpilot.policy.evidence.decide_throughput` decides on), or ``None``
    without ``retime`` or before any re-timing.
    """
    search = ThroughputSearch(tolerance=tolerance)
    visits: list[dict[int, float]] | None = None
    for _ in range(3):
        while (b := search.next_size(timed_fits(trials), lowest=lowest, highest=highest)) is not None:
            if any(t.batch_size == b for t in trials):  # tried, but not timed (e.g. over the target)
                break
            if len(trials) >= max_trials:
                logger.warning("the throughput search stopped at max_trials=%d; raise it for a closer answer",
                               max_trials)
                return visits
            trial = run_trial(b)
            trials.append(trial)
            if on_trial is not None:
                on_trial(trial)
        points = timed_fits(trials, upto=highest)
        before = choose_fastest(points, tolerance)
        if retime is None or before is None:
            return visits
        sizes = decisive_sizes(points, tolerance)
        spare = spare_size(points, tolerance)
        if spare is not None and all(t.batch_size != spare for t in trials) and len(trials) < max_trials:
            trial = run_trial(spare)
            trials.append(trial)
            if on_trial is not None:
                on_trial(trial)
            if trial.fits and trial.step_seconds:
                sizes = sorted({*sizes, spare})
        by_size = {t.batch_size: t for t in trials if t.fits and t.step_seconds}
        seen = {b: [by_size[b].step_seconds] for b in sizes}
        visits = []
        r = 0
        while r < rounds or (settled is not None and r < max_rounds and not settled(visits)):
            visits.append({})
            for b in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                seconds = retime(b)
                if seconds is not None:
                    seen[b].append(seconds)
                    visits[-1][b] = seconds
            r += 1
        for b in sizes:
            # each visit's fastest step, then the median over visits: a size timed in a quiet
            # moment is not favoured over one timed under load
            by_size[b].step_seconds = statistics.median(seen[b])
        after = choose_fastest(timed_fits(trials, upto=highest), tolerance)
        if after is None or (after.batch_size, after.best_batch_size) == (before.batch_size, before.best_batch_size):
            return visits
    return visits


def split_seconds(total: int, parts: int, step_time: Callable[[int], float]) -> float:
    """Predicted seconds of ``total`` samples in ``parts`` balanced micro-batches (sizes differ by at most 1).

    Raises:
        ValueError: ``parts`` is not in ``[1, total]``.
    """
    if not 1 <= parts <= total:
        raise ValueError(f"{total} samples cannot be split into {parts} micro-batches")
    q, r = divmod(total, parts)
    return r * step_time(q + 1) + (parts - r) * step_time(q)


@dataclass(frozen=True, kw_only=True)
class SplitChoice:
    """How :func:`choose_split` splits a per-rank batch, and why.

    Attributes:
        total: samples in the per-rank batch.
        largest_fitting: the largest micro-batch that fits (the memory bound).
        micro_batch_size: the largest micro-batch of the split.
        accum_steps: micro-batches per step.
        seconds: predicted seconds of the forward and backward passes of the whole step,
            or ``None`` without timing.
        fewest_seconds: the same for the split with the fewest micro-batches.
        reason: one line that says why.
    """

    total: int
    largest_fitting: int
    micro_batch_size: int
    accum_steps: int
    seconds: float | None
    fewest_seconds: float | None
    reason: str

    @property
    def sizes(self) -> list[int]:
        return balanced_sizes(self.total, self.accum_steps)

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "accum_steps": self.accum_steps,
                "largest_fitting": self.largest_fitting, "predicted_seconds": self.seconds,
                "fewest_seconds": self.fewest_seconds, "reason": self.reason}


def choose_split(
    total: int, largest_fitting: int, *, step_time: Callable[[int], float] | None = None,
    smallest: int = 1, margin: float = SPEED_TOLERANCE,
) -> SplitChoice:
    """Split ``total`` samples into micro-batches of at most ``largest_fitting``, by predicted step time.

    Fewest micro-batches first, then the smallest equal sizes that achieve it: 256 with at most
    200 per micro-batch is 128 + 128 (the same two passes as 200 + 56, a smaller peak, no
    ragged tail). With ``step_time`` (seconds of one micro-batch's forward and backward at a
    size, e.g. a :class:`TimeCurve`), more and smaller micro-batches (down to ``smallest``,
    the smallest size measured) are chosen only when predicted faster by more than
    ``margin``: on a linear ``T(b) = α + β b`` the whole step costs ``k α + β total`` and the
    fewest micro-batches always win; on a curve whose samples/s fall at large sizes they do not.

    Raises:
        ValueError: ``total`` or ``largest_fitting`` is not a positive int, or ``margin`` is
            outside [0, 0.5).
    """
    positive_int("total", total)
    positive_int("largest_fitting", largest_fitting)
    check_speed_tolerance(margin)
    fit = min(largest_fitting, total)
    k0 = accum_steps(total, fit)
    m0 = -(-total // k0)
    head = f"fewest micro-batches of at most {fit}, balanced"
    if step_time is None:
        return SplitChoice(total=total, largest_fitting=fit, micro_batch_size=m0, accum_steps=k0, seconds=None,
                           fewest_seconds=None, reason=f"{head} (not timed)")
    base = split_seconds(total, k0, step_time)
    best_k, best = k0, base
    k = k0
    while k <= total:
        micro = -(-total // k)
        if micro < smallest:
            break
        t = split_seconds(total, k, step_time)
        if t < best:
            best_k, best = k, t
        if micro == 1:
            break
        k = -(-total // (micro - 1))  # the next count whose micro-batch is smaller
    if best_k != k0 and best < (1 - margin) * base:
        micro = -(-total // best_k)
        return SplitChoice(total=total, largest_fitting=fit, micro_batch_size=micro, accum_steps=best_k,
                           seconds=best, fewest_seconds=base,
                           reason=f"measured faster: {best_k} micro-batches predicted {best:.3g} s, the fewest "
                                  f"({k0} of at most {fit}) {base:.3g} s")
    return SplitChoice(total=total, largest_fitting=fit, micro_batch_size=m0, accum_steps=k0, seconds=base,
                       fewest_seconds=base,
                       reason=f"{head}: predicted {base:.3g} s, no split into more timed {margin:.0%} faster")


class SplitCheck:
    """Real steps decide whether a split into more micro-batches than the fewest is kept.

    :func:`choose_split` only *nominates* a split: its times are one figure per size (the fastest
    of a trial's timed steps), each measured at another moment, and on a shared machine a
    moment's load stretches one size and not the next (a batch-1 trial has been seen 0.3 s in
    one run and 3.4 s in another). Both splits train the same update, so the engine's first
    steps measure them for free, in **pairs of adjacent steps**, one at the nominated split and
    one at the fewest micro-batches, in the order ``S F, F S, S F, F S`` (:attr:`arm` says
    which runs next; the alternation keeps a trend in the load from favouring either side).

    Noise model: a step's time is its cost times a load factor (≥ 1) that drifts over seconds.
    Two adjacent steps share most of it, so their ratio ``r = split / fewest`` cancels it and
    what remains is noise about the true ratio, as often above it as below.

    Rule (the simplest choice unless the evidence beats the noise): a pair with ``r ≥ 1`` (the
    split not faster) ends the check at once for the fewest micro-batches; after ``pairs``
    pairs that all favour the split, it is kept if their median ``r`` is below ``1 - margin``,
    else the fewest. With no real difference all ``pairs`` pairs favour the split by chance
    about ``2**-pairs`` of the time (one in sixteen for 4), and the median rule still asks for
    the margin; a split truly slower is kept far less often, one 1.5 times slower practically never. The verdict is final: the check never runs again, so the split cannot flip-flop.

    Example, ``pairs=3, margin=0.05``: split times 1.0, 2.1, 1.1 against the fewest's 1.5, 3.0,
    1.6 (ratios 0.67, 0.70, 0.69): kept. Split 3.0 against fewest 2.0 in the first pair (1.5):
    the fewest, after two steps.

    Args:
        split: the nominated split (more micro-batches than ``fewest``).
        fewest: the fewest micro-batches' split of the same batch.
        pairs: pairs of steps that must favour the split.
        margin: the median ratio must be below ``1 - margin``.

    Raises:
        ValueError: ``split`` does not have more micro-batches than ``fewest``, or of another
            batch; ``pairs`` is not a positive int; ``margin`` outside [0, 0.5).
    """

    def __init__(self, *, split: SplitChoice, fewest: SplitChoice, pairs: int = SPLIT_CHECK_PAIRS,
                 margin: float = SPEED_TOLERANCE) -> None:
        if split.total != fewest.total or split.accum_steps <= fewest.accum_steps:
            raise ValueError(f"a split check compares a split into more micro-batches with the fewest of the same "
                             f"batch, got {split.accum_steps} of {split.total} against {fewest.accum_steps} of "
                             f"{fewest.total}")
        self.split = split
        self.fewest = fewest
        self.pairs = positive_int("pairs", pairs)
        self.margin = check_speed_tolerance(margin)
        #: seconds of each step observed, in order (the arms alternate as :attr:`arm` says)
        self.seconds: list[float] = []
        #: ``"split"`` or ``"fewest"`` once decided, else ``None``
        self.verdict: str | None = None

    def _arm_of(self, i: int) -> str:
        first, second = ("split", "fewest") if (i // 2) % 2 == 0 else ("fewest", "split")
        return first if i % 2 == 0 else second

    @property
    def arm(self) -> str | None:
        """Which split the next step runs: ``"split"`` or ``"fewest"``; ``None`` once decided."""
        return None if self.verdict is not None else self._arm_of(len(self.seconds))

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch of :attr:`arm` (``None`` once decided)."""
        arm = self.arm
        return None if arm is None else (self.split if arm == "split" else self.fewest).micro_batch_size

    def ratios(self) -> list[float]:
        """``split / fewest`` of each complete pair."""
        out = []
        for p in range(len(self.seconds) // 2):
            a, b = self.seconds[2 * p], self.seconds[2 * p + 1]
            s, f = (a, b) if self._arm_of(2 * p) == "split" else (b, a)
            out.append(s / f if f > 0 else math.inf)
        return out

    def observe(self, seconds: float) -> str | None:
        """The time of the step that ran :attr:`arm`; returns the verdict once there is one.

        Raises:
            ValueError: after the verdict, or a negative time.
        """
        if self.verdict is not None:
            raise ValueError(f"the split check has decided ({self.verdict}); it observes no more steps")
        if not seconds >= 0:
            raise ValueError(f"a step time must be a non-negative number of seconds, got {seconds!r}")
        self.seconds.append(float(seconds))
        ratios = self.ratios()
        if len(self.seconds) % 2 == 0:
            if ratios[-1] >= 1:
                self.verdict = "fewest"
            elif len(ratios) >= self.pairs:
                self.verdict = "split" if statistics.median(ratios) < 1 - self.margin else "fewest"
        return self.verdict

    def _arm_seconds(self, arm: str) -> float:
        return statistics.median(t for i, t in enumerate(self.seconds) if self._arm_of(i) == arm)

    @property
    def reason(self) -> str:
        """One line: what the real steps showed against the prediction (empty before the verdict)."""
        if self.verdict is None:
            return ""
        ratios = self.ratios()
        split, fewest = self.split, self.fewest
        real = (f"{self._arm_seconds('split'):.3g} s against {self._arm_seconds('fewest'):.3g} s on "
                f"{len(ratios)} pair{'s' if len(ratios) > 1 else ''} of real steps")
        if self.verdict == "split":
            return (f"{split.reason}; confirmed: {real} (median ratio {statistics.median(ratios):.2f}, "
                    f"every pair faster)")
        predicted = ("" if split.seconds is None or split.fewest_seconds is None else
                     f", predicted {split.seconds:.3g} s against {split.fewest_seconds:.3g} s")
        why = "a pair not faster" if ratios[-1] >= 1 else f"median ratio {statistics.median(ratios):.2f}, " \
                                                          f"not {1 - self.margin:.2f} or less"
        return (f"fewest micro-batches of at most {fewest.largest_fitting}, balanced: the timed split into "
                f"{split.accum_steps} of {split.micro_batch_size}{predicted}, was not faster on real steps: {real} "
                f"({why})")
