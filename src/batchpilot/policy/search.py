"""Pure integer search policies for the largest batch size under a memory limit.

Nothing here imports torch: a policy sees the trials so far (size, outcome ``fit`` /
``over_target`` / ``oom``, peak) and names the next size, so its sequence can be asserted on a
memory function written in plain Python. :func:`run_search` is the loop the finder and the
tests share. How ``predict`` reasons: ``docs/internals.md#search``.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Generator, Iterable, Literal, Mapping, Sequence

from .._checks import positive_int

__all__ = [
    "FIT",
    "OVER_TARGET",
    "OOM",
    "REFUSED",
    "Outcome",
    "BatchSizeError",
    "NothingFitsError",
    "DEFAULT_TARGET",
    "check_target",
    "Trial",
    "TensorModel",
    "SearchSpace",
    "SearchPolicy",
    "PredictPolicy",
    "PowerPolicy",
    "BinsearchPolicy",
    "DecayPolicy",
    "SecantPolicy",
    "GrowStepDownPolicy",
    "STRATEGIES",
    "make_policy",
    "decay_batch_step",
    "bracket",
    "fit_line",
    "least_squares_line",
    "predict_peak",
    "reclassify",
    "left_behind",
    "SearchResult",
    "run_search",
    "doubtful",
    "step_down",
    "below_by_excess",
]

FIT = "fit"
OVER_TARGET = "over_target"
OOM = "oom"
REFUSED = "refused"
Outcome = Literal["fit", "over_target", "oom", "refused"]
_OUTCOMES = (FIT, OVER_TARGET, OOM, REFUSED)


class BatchSizeError(ValueError):
    """A batch-size search cannot run as asked (bad target, bounds or strategy)."""


#: the fraction of the capacity a peak may use when no target is given: 60-80% leaves room for the
#: allocator's fragmentation and for other processes
DEFAULT_TARGET = 0.8


def check_target(value: Any, *, below: float | None = None, bound: str = "", reason: str = "") -> float:
    """``value`` as a target, the fraction of the capacity a peak may use: a number in (0, 1].

    The one check of a target, whichever door it came in by (``FindOptions``, the engine, the
    planner, the integrations, the command line). An entry point with a tighter bound of its own
    passes it as ``below`` (exclusive), named by ``bound`` with ``reason`` saying why: the engine's
    high-water mark, above which every grown micro-batch would count as memory pressure.

    Raises:
        BatchSizeError: not a number (a bool included), outside (0, 1], or not below ``below``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise BatchSizeError(
            f"target must be a fraction of device memory in (0, 1], got {value!r}; "
            "0.6-0.8 leaves room for fragmentation and other processes"
        )
    if below is not None and not value < below:
        why = f", {reason}" if reason else ""
        raise BatchSizeError(f"target {value} must be below {bound or 'the bound'} {below}{why}")
    return float(value)


class NothingFitsError(BatchSizeError, RuntimeError):
    """Not even the smallest allowed batch fits under the memory limit.

    It is a :class:`BatchSizeError` (so a ``ValueError``) because the inputs
    cannot be satisfied, and a ``RuntimeError`` because it is found by running.

    Attributes:
        batch_size: the smallest batch size tried.
        peak_bytes: its measured peak; for an OOM the bytes live when it failed
            (a lower bound), or ``None`` when no figure is available.
        limit_bytes: the memory limit (``target × capacity``; on a host ``base + target × (capacity − base)``).
        capacity_bytes: the device capacity.
    """

    def __init__(
        self, message: str, *, batch_size: int, peak_bytes: int | None, limit_bytes: int, capacity_bytes: int
    ) -> None:
        super().__init__(message)
        self.batch_size = batch_size
        self.peak_bytes = peak_bytes
        self.limit_bytes = limit_bytes
        self.capacity_bytes = capacity_bytes


@dataclass(kw_only=True)
class Trial:
    """One measured batch size.

    Attributes:
        batch_size: the batch size run (or refused).
        outcome: ``"fit"``, ``"over_target"``, ``"oom"``, or ``"refused"``: not run, because
            its predicted peak was over a limit past which the process would be killed.
        peak_bytes: the peak of the memory that fails (see the finder); for an OOM, a lower
            bound (what was in use when it failed, plus the request when the allocator said
            it) or ``None``; for a refused trial, the prediction.
        start_bytes: bytes in use at the start of the trial's last (steady-state)
            step that stay in use through it — the model, optimizer state and
            anything else alive, not gradients a step may free first; a floor
            under every batch size's peak. ``None`` if unknown.
        seconds: wall time of the trial.
        message: the first line of the OOM error, for an OOM.
        tensor_bytes: where the peak is the process's real memory, the peak of the tensors
            alone (exact, from a storage tracker); the rest is allocator overhead, kernel
            scratch and everything outside PyTorch. ``None`` otherwise.
        bound_bytes: for an OOM whose allocator said how much it asked for, the peak reached
            plus that request: the step needed at least this, and the real capacity is below it.
        step_seconds: the fastest of the trial's timed steps (device synchronised, the warm-up
            step left out), for a trial that fitted; ``None`` when none was timed. A size the
            throughput objective's choice rests on is visited again, side by side with the
            others, and keeps the median of its visits' fastest steps.
        alloc_retries: CUDA allocator retries during the trial (cudaMalloc failed, the cache was
            freed and the allocation retried: thrashing just below an OOM); ``None`` elsewhere.
        end_bytes: on real memory, the figure once the trial was put back (state restored, garbage
            collected, caches released): ``end_bytes - start_bytes`` is what the trial left behind
            (JIT code for a new shape, heap the allocator keeps). ``None`` elsewhere.
        rank: for ranks in lockstep (FSDP2), a rank that ran out of memory in an OOM trial (the
            highest, when several did); ``None`` otherwise.
    """

    batch_size: int
    outcome: Outcome
    peak_bytes: int | None = None
    start_bytes: int | None = None
    seconds: float = 0.0
    message: str | None = None
    tensor_bytes: int | None = None
    bound_bytes: int | None = None
    step_seconds: float | None = None
    alloc_retries: int | None = None
    end_bytes: int | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.outcome not in _OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(_OUTCOMES)}, got {self.outcome!r}")
        if self.outcome != OOM and self.peak_bytes is None:
            raise ValueError(f"a {self.outcome!r} trial needs its peak_bytes")

    @property
    def fits(self) -> bool:
        return self.outcome == FIT

    @property
    def measured(self) -> bool:
        """True when ``peak_bytes`` is the full peak (the trial ran to the end)."""
        return self.outcome in (FIT, OVER_TARGET)

    @property
    def samples_per_second(self) -> float | None:
        """``batch_size / step_seconds``, or ``None`` when the trial was not timed."""
        return self.batch_size / self.step_seconds if self.step_seconds else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_second": self.samples_per_second}


@dataclass(frozen=True)
class TensorModel:
    """A step's tensor bytes at any batch size, from the allocation timelines of two small ones.

    A storage tracker records the live tensor bytes after every allocation of a step. Run at
    two batch sizes, the same program allocates in the same order, each allocation affine in the
    batch size, so the live bytes at every moment are a line in ``b``, and the step's peak is the
    highest of those lines: ``peak(b) = max_i (fixed_i + per_sample_i × b)``. The upper envelope
    is exact where the timelines align, kinks included (the optimizer step's fixed peak giving way
    to the activations' growing one), so two trials at tiny sizes size the tensors at any size.

    Attributes:
        lines: ``(fixed_bytes, bytes_per_sample)`` of the envelope's lines, slope ascending.
    """

    lines: tuple[tuple[float, float], ...]

    @classmethod
    def from_timelines(cls, b1: int, t1: Sequence[int], b2: int, t2: Sequence[int]) -> TensorModel | None:
        """The envelope of two timelines at batch sizes ``b1 != b2``; ``None`` when they do not align."""
        if b1 == b2 or not t1 or len(t1) != len(t2):
            return None
        lines = [(x - (y - x) / (b2 - b1) * b1, (y - x) / (b2 - b1)) for x, y in zip(t1, t2)]
        return cls(lines=_upper_envelope(lines))

    @classmethod
    def union(cls, *models: TensorModel) -> TensorModel:
        """The model of the higher of several models at every size (e.g. a trial's two steps)."""
        return cls(lines=_upper_envelope([line for m in models for line in m.lines]))

    def __call__(self, b: float) -> float:
        return max(a + c * b for a, c in self.lines)

    def solve(self, bytes_: float) -> int | None:
        """The largest batch size whose modelled peak is at most ``bytes_``; ``None`` when not even 0
        fits, or when the memory does not grow with the batch."""
        if any(c <= 0 and a > bytes_ for a, c in self.lines) or self(0) > bytes_:
            return None
        growing = [(a, c) for a, c in self.lines if c > 0]
        if not growing:
            return None
        return min(int(math.floor((bytes_ - a) / c)) for a, c in growing)

    def to_dict(self) -> dict[str, Any]:
        return {"lines": [[a, c] for a, c in self.lines]}


def _upper_envelope(lines: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The lines that are the highest somewhere in ``b >= 0``, slope ascending (the convex hull trick)."""
    best: dict[float, float] = {}
    for a, c in lines:
        if c not in best or a > best[c]:
            best[c] = a
    hull: list[tuple[float, float]] = []
    for c, a in sorted(best.items()):
        while hull:
            a0, c0 = hull[-1]
            # the newer, steeper line overtakes the last one at x; drop the last if that is
            # at or before where the last one overtook its predecessor (or before b = 0)
            x = (a0 - a) / (c - c0)
            if len(hull) >= 2:
                a1, c1 = hull[-2]
                if x <= (a1 - a0) / (c0 - c1):
                    hull.pop()
                    continue
            elif x <= 0:
                hull.pop()
                continue
            break
        hull.append((a, c))
    return tuple(hull)


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What a policy searches: batch sizes in ``[min, max]`` under ``limit_bytes``.

    Raises:
        BatchSizeError: non-positive sizes, ``min > max`` or a limit above capacity.
    """

    limit_bytes: int
    capacity_bytes: int
    min_batch_size: int = 1
    max_batch_size: int | None = None
    #: the step's tensor bytes by batch size, once two small trials gave it (see ``PredictPolicy``)
    tensors: TensorModel | None = None

    def __post_init__(self) -> None:
        positive_int("min_batch_size", self.min_batch_size, error=BatchSizeError)
        if self.max_batch_size is not None:
            positive_int("max_batch_size", self.max_batch_size, error=BatchSizeError)
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise BatchSizeError(
                f"min_batch_size {self.min_batch_size} is larger than max_batch_size {self.max_batch_size}; "
                "lower min_batch_size or raise max_batch_size"
            )
        if not 0 < self.limit_bytes <= self.capacity_bytes:
            raise BatchSizeError(
                f"limit_bytes must be in (0, capacity_bytes={self.capacity_bytes}], got {self.limit_bytes}"
            )

    @property
    def upper(self) -> int | None:
        return self.max_batch_size


def bracket(trials: Iterable[Trial]) -> tuple[int | None, int | None]:
    """``(largest fitting size below the smallest failing one, smallest failing size)``.

    Either is ``None`` when no such trial exists. A fit above a failure (memory
    that is not monotone in the batch size) is ignored: the failure wins.
    """
    trials = list(trials)
    bad = [t.batch_size for t in trials if not t.fits]
    hi = min(bad) if bad else None
    good = [t.batch_size for t in trials if t.fits and (hi is None or t.batch_size < hi)]
    return (max(good) if good else None), hi


def _points(trials: Iterable[Trial]) -> dict[int, int]:
    """Batch size → measured peak, for the trials that ran to the end (latest wins)."""
    return {t.batch_size: t.peak_bytes for t in trials if t.measured}


def fit_line(trials: Sequence[Trial], limit_bytes: int | None = None) -> tuple[float, float] | None:
    """``(fixed_bytes, bytes_per_sample)`` of the line through the two measured trials nearest the boundary.

    Those are the largest fitting trial and the smallest measured one above
    it, or the two largest fitting trials; ``None`` with fewer than two
    measured sizes. Only trials that ran to the end count.
    """
    pts = _points(trials)
    if len(pts) < 2:
        return None
    lo, _ = bracket(trials)
    sizes = sorted(pts)
    if limit_bytes is not None:
        good = [b for b in sizes if pts[b] <= limit_bytes]
        lo = max(good) if good else lo
    if lo is None or lo not in pts:
        x, y = sizes[0], sizes[1]
    else:
        above = [b for b in sizes if b > lo]
        below = [b for b in sizes if b < lo]
        x, y = (lo, above[0]) if above else (below[-1], lo)
    slope = (pts[y] - pts[x]) / (y - x)
    return pts[x] - slope * x, slope


def least_squares_line(points: Mapping[float, float]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``{x: y}`` (two distinct ``x`` or more)."""
    n = len(points)
    mx, my = sum(points) / n, sum(points.values()) / n
    slope = sum((x - mx) * (y - my) for x, y in points.items()) / sum((x - mx) ** 2 for x in points)
    return my - slope * mx, slope


def predict_peak(trials: Sequence[Trial], b: int) -> int | None:
    """The peak a trial at ``b`` is expected to reach, from the measured trials; ``None`` if none.

    Below the largest measured size: the line through the measured sizes around ``b``. Above
    it: the line through the two largest measured sizes, but never less than the largest
    peak seen, and with a single measured size the proportional line through its start bytes
    (every added byte taken as per-sample: an overestimate for memory that grows linearly).
    """
    pts = _points(trials)
    if not pts:
        return None
    sizes = sorted(pts)
    if b in pts:
        return pts[b]
    below = [x for x in sizes if x < b]
    above = [x for x in sizes if x > b]
    if below and above:
        x0, x1 = below[-1], above[0]
    elif len(sizes) >= 2:
        x0, x1 = (sizes[-2], sizes[-1]) if not above else (sizes[0], sizes[1])
    else:
        t = next(t for t in trials if t.measured)
        start = t.start_bytes or 0
        return start + (t.peak_bytes - start) * b // t.batch_size
    slope = (pts[x1] - pts[x0]) / (x1 - x0)
    line = pts[x0] + slope * (b - x0)
    if not above:
        line = max(line, pts[sizes[-1]])
    return int(math.ceil(line))


def decay_batch_step(batch_size: int, num_intra_steps: int = 2, no_odd: bool = False) -> int:
    """The next smaller batch size of timm's decay schedule.

    Between consecutive powers of two it takes ``num_intra_steps`` equal steps:
    from 256 with the defaults, 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6,
    4, 3, 2, 1, then 0 (no batch left). ``no_odd`` rounds odd sizes down by one.

    Raises:
        ValueError: ``num_intra_steps`` is not positive.
    """
    if num_intra_steps < 1:
        raise ValueError(f"num_intra_steps must be at least 1, got {num_intra_steps}")
    if batch_size <= 1:
        return 0
    base = 1 << ((batch_size - 1).bit_length() - 1)  # largest power of two below batch_size
    step = max(base // num_intra_steps, 1)
    batch_size = base + ((batch_size - base - 1) // step) * step
    if no_odd and batch_size % 2:
        batch_size -= 1
    return batch_size


def _clamp(b: int, lo: int, hi: int | None) -> int:
    b = max(b, lo)
    return b if hi is None else min(b, hi)


def _check_start(start: int | None) -> None:
    """Reject a non-positive ``start`` (shared by the policies that take one)."""
    if start is not None:
        positive_int("start", start, error=BatchSizeError)


def _first_size(start: int | None, space: SearchSpace) -> int:
    """The first size to try: ``start`` (or ``min_batch_size``) inside the bounds."""
    return _clamp(start or space.min_batch_size, space.min_batch_size, space.upper)


class SearchPolicy(ABC):
    """Chooses the next batch size from the trials so far; ``None`` means stop.

    A policy keeps no state between calls: ``next_size`` is a function of the
    trials and the space alone, so a search can be replayed and tested.
    """

    name: ClassVar[str]
    #: True when the policy stops only at the exact boundary (b fits, b + 1 does not).
    exact: ClassVar[bool]
    #: True when the policy may ask for a size again (a verification runs an answer a second time).
    repeats: ClassVar[bool] = False

    @abstractmethod
    def next_size(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        """The batch size to try next, or ``None`` when the search is over."""

    def plateau(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        """The size past which the measured peak stopped growing, when the policy stops for it; else ``None``."""
        return None


@dataclass(kw_only=True)
class PowerPolicy(SearchPolicy):
    """Double from ``start`` until a size does not fit; keep the last that did.

    From 1: 1, 2, 4, 8, … — the answer is a power of two times ``start`` (or
    ``max_batch_size``), so it can sit anywhere between 50% and 100% of the
    true maximum. Like Lightning's ``mode="power"``. If ``start`` fails it
    halves until a size fits (not below ``min_batch_size``).

    Raises:
        BatchSizeError: ``start`` is not positive.
    """

    name: ClassVar[str] = "power"
    exact: ClassVar[bool] = False
    start: int | None = None

    def __post_init__(self) -> None:
        _check_start(self.start)

    def next_size(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        if not trials:
            return _first_size(self.start, space)
        last, (lo, hi) = trials[-1], bracket(trials)
        if last.fits:
            if hi is not None or last.batch_size == space.upper:
                return None
            return _clamp(last.batch_size * 2, space.min_batch_size, space.upper)
        if lo is not None or last.batch_size <= space.min_batch_size:
            return None
        return max(last.batch_size // 2, space.min_batch_size)


@dataclass(kw_only=True)
class BinsearchPolicy(SearchPolicy):
    """Double from ``start`` until a size fails, then bisect to the exact boundary.

    From 1 with a true maximum of 37: 1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37.
    Unlike Lightning's ``mode="binsearch"`` it does not stop early: it ends when
    b fits and b + 1 does not. If ``start`` itself fails it bisects down towards
    ``min_batch_size``.

    Raises:
        BatchSizeError: ``start`` is not positive.
    """

    name: ClassVar[str] = "binsearch"
    exact: ClassVar[bool] = True
    start: int | None = None

    def __post_init__(self) -> None:
        _check_start(self.start)

    def next_size(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        if not trials:
            return _first_size(self.start, space)
        lo, hi = bracket(trials)
        if hi is None:  # still growing
            if lo == space.upper:
                return None
            return _clamp(lo * 2, space.min_batch_size, space.upper)
        floor = space.min_batch_size - 1 if lo is None else lo
        if hi - floor <= 1:
            return None
        return (floor + hi + 1) // 2


@dataclass(kw_only=True)
class DecayPolicy(SearchPolicy):
    """Start at ``start`` and step down timm's :func:`decay_batch_step` schedule until one fits.

    From 256: 256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1. It never
    grows, so the answer is at most ``start``; a step below ``min_batch_size``
    tries ``min_batch_size`` instead.

    Raises:
        BatchSizeError: ``start`` or ``num_intra_steps`` is not positive.
    """

    name: ClassVar[str] = "decay"
    exact: ClassVar[bool] = False
    start: int = 256
    num_intra_steps: int = 2
    no_odd: bool = False

    def __post_init__(self) -> None:
        positive_int("start", self.start, error=BatchSizeError)
        positive_int("num_intra_steps", self.num_intra_steps, error=BatchSizeError)

    def next_size(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        if not trials:
            return _clamp(self.start, space.min_batch_size, space.upper)
        last = trials[-1]
        if last.fits:
            return None
        if last.batch_size <= space.min_batch_size:
            return None
        return max(decay_batch_step(last.batch_size, self.num_intra_steps, self.no_odd), space.min_batch_size)


@dataclass(kw_only=True)
class PredictPolicy(SearchPolicy):
    """Fit ``peak = fixed + per_sample × b`` to a few trials, jump to the answer, verify.

    The sequence:

    1. ``min_batch_size``, or ``first_guess`` when given (e.g. by the planner).
    2. A proportional guess from that one trial: all the bytes it added,
       ``peak - start``, are taken as per-sample, so
       ``b × (limit - start) / (peak - start)`` overestimates the cost of a
       sample and lands at or below the boundary (for an exact
       ``first_guess`` that is ``first_guess + 1``, its check).
    3. The line through the two measured trials nearest the boundary —
       interpolation between the last fit and the first failure when there is
       one, extrapolation from the two largest fits otherwise — gives the
       largest b under the limit, which is tried.
    4. It stops when the largest fitting b is *certified*: b + 1 failed, or
       three measured trials, b among them, lie exactly on one line that is
       over the limit at b + 1. Memory that is linear, convex (a kink where
       activations overtake the optimizer step) or linear with upward steps
       lies on or above such a line at b + 1, so the answer is exact without
       running b + 1; otherwise b + 1 is run.

    Guards against overshooting (the *ceiling*, the *flat start*, the midpoint after slow
    progress) keep the worst case logarithmic; they and the trials each shape of memory
    takes are in ``docs/internals.md#search``.

    With ``modelled=True`` (the finder on a host's real memory) and no ``first_guess`` it starts
    with two tiny sizes, from which the finder builds a :class:`TensorModel` of the step's tensor
    bytes at any size and puts it in the space. Real memory is then sized through it: a
    calibration trial where the tensors grow by a tenth of the room (more in a small one; unless
    two trials already differ by a twentieth of it) gives the real bytes per modelled tensor byte,
    and the next trial is the size the calibrated model puts just under the limit. A failure the model did not
    foresee (an OOM) hands the rest of the search to the line above; a space without a model
    (timelines that do not align, a model a trial contradicted) is searched the same way.

    Attributes:
        first_guess: a size to try first (e.g. from the planner).
        modelled: begin with the two tiny sizes of a tensor model and size through it.
        tolerance_bytes: how far off a line three peaks may be and still count
            as collinear, and the margin by which the line must exceed the
            limit at b + 1. 0 (exact) suits the CPU tracker; allocator
            rounding on accelerators makes exact collinearity rare, which
            only costs the b + 1 trial.
        rel_tolerance: stop once the largest fit is within this fraction of the
            boundary: bracketed that closely, or the line through the two largest
            fits puts the boundary there. 0 asks for the exact boundary. Real
            memory (a process's resident set, a GPU's reserved memory) moves by
            more than a sample between runs, so chasing the exact boundary there
            only buys OOMs; the finder uses 0.02 on it.

    Raises:
        BatchSizeError: ``first_guess`` not positive or ``tolerance_bytes`` negative.
    """

    name: ClassVar[str] = "predict"
    exact: ClassVar[bool] = True
    first_guess: int | None = None
    tolerance_bytes: int = 0
    rel_tolerance: float = 0.0
    modelled: bool = False

    def __post_init__(self) -> None:
        if self.first_guess is not None:
            positive_int("first_guess", self.first_guess, error=BatchSizeError)
        if self.tolerance_bytes < 0:
            raise BatchSizeError(f"tolerance_bytes must be non-negative, got {self.tolerance_bytes}")
        if not 0 <= self.rel_tolerance < 0.5:
            raise BatchSizeError(f"rel_tolerance must be in [0, 0.5), got {self.rel_tolerance}")

    # -- the policy -------------------------------------------------------
    def next_size(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        lo_b, up = space.min_batch_size, space.upper
        pair = self._pair(space)
        if not trials:
            return pair[0] if pair else _first_size(self.first_guess, space)
        if pair and len(trials) == 1 and trials[0].batch_size == pair[0] and trials[0].measured:
            return pair[1]
        level = self.plateau(trials, space)
        if level is not None:
            return self._narrow(level, trials, space)
        between = self._grew_once(trials, space)
        if between is not None:
            return between
        below = self._level_from_the_start(trials, space)
        if below is not None:
            return below
        if space.tensors is not None:
            sized = self._modelled(trials, space)
            if sized is not _CLASSIC:
                return sized
        lo, hi = bracket(trials)
        if hi is not None and hi <= lo_b:
            return None  # nothing fits
        upper = hi - 1 if hi is not None else up  # largest size still possibly fitting
        if lo is not None and (lo == upper or self.certified(lo, trials, space)):
            return None
        if lo is not None and self.rel_tolerance and self._close_enough(lo, hi, trials, space):
            return None
        floor = lo if lo is not None else lo_b - 1
        if hi is not None and any(_slow_progress(trials[:k], count=2) for k in range(3, len(trials) + 1)):
            # two slow guesses in a row, now or earlier in this search: the line keeps landing near the
            # failure (a step in the peak), and from then on bisecting is what converges
            return _midpoint(floor, upper, lo_b)
        guess = self._estimate(trials, space, lo, hi)
        if guess is None:
            return _midpoint(floor, upper, lo_b)
        if lo is not None and hi is not None and guess - lo <= max(1, (hi - lo) // 8) and self._flat_at(lo, trials):
            # the largest fit is on a flat stretch (a smaller fit peaked as high): memory is convex, so
            # the chord to the failure is a lower bound of the boundary, and near a kink it crept up
            # one sample per trial (33 trials where bisecting takes 20); halve the bracket instead
            return _midpoint(floor, upper, lo_b)
        if self.rel_tolerance and lo is not None:
            # aim a little under the line's answer: a line off by less than half the tolerance
            # then lands on a fit that is close enough, where aiming at it would fail half the time
            guess -= int(guess * self.rel_tolerance / 2)
        return _clamp(guess, floor + 1, upper)

    def _level(self, trials: Sequence[Trial], space: SearchSpace) -> tuple[dict[int, int], float]:
        """What each measured trial grew from its own start, less what it kept, and how far apart two may be and still count as level.

        Growth, not the peak: on real memory the process creeps up between trials by what each
        leaves behind, and a peak that creeps so is no growth with the batch. Less what the trial
        left behind: what a process sets up once (heap grown for good, by the first trial and the
        first large one) is in that one trial's growth only. How far apart is the measurement's
        own noise, not the search's tolerance (a share of the room, which on a large host is more
        than a whole step ever grows): the most a trial after the first left behind (heap kept,
        JIT code for a new shape), and ``rel_tolerance`` of the largest growth (page rounding and
        allocator slack scale with it).
        """
        measured = [t for t in trials if t.measured]
        grown = {t.batch_size: t.peak_bytes - (t.start_bytes or 0) - left_behind(t) for t in measured}
        left = [left_behind(t) for t in measured[1:]]
        noise = max([self.tolerance_bytes, self.rel_tolerance * max(grown.values(), default=0), *left])
        return grown, noise

    def _level_from_the_start(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        """``min_batch_size``, when every fit so far (from a first guess, over a doubling) peaked level.

        A level stretch is a flat start or a plateau; only a smaller size tells them apart (lower:
        a plateau, see :meth:`plateau`).
        """
        if space.upper is not None or space.tensors is not None or bracket(trials)[1] is not None:
            return None  # a tensor model tells a flat start by itself (plateau)
        pts, noise = self._level(trials, space)
        if len(pts) < 2 or min(pts) <= space.min_batch_size or max(pts) < 2 * min(pts):
            return None
        if max(pts.values()) - min(pts.values()) > noise:
            return None
        return space.min_batch_size

    def plateau(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        """The smallest size at the peak the largest fits share, when the peak grew and then stopped.

        Memory that grows with the batch grows at least as fast further on (convex: activations
        overtake a fixed peak, never the reverse). A peak that grew between two fits and then
        stays level, within the noise, at a larger one, where that growth would have added three
        times the noise, is a step that reads no more than some number of samples (``X[:b]`` of a
        dataset with fewer rows), if it grew over two fits below the level at least (one step up
        and then level can be an upward step before a flat start: :meth:`_grew_once` tries a size
        between): every larger size costs the same, and without a ``max_batch_size`` the search
        would climb without end. With one, or below a measured failure, the search ends as it
        does anyway: ``None``. A refused trial is a prediction, not a measurement: it does not
        stand in the way.

        With a tensor model (real memory on a host) the model says how much a step's tensors add
        between two sizes, a flat start included: real memory adds at least ``_MIN_RATIO`` of it.
        Fits whose growth stays level, within the noise, where the model says the tensors add
        over three times the noise, are the same plateau, however little the step grew below it
        (a small model's activations at the dataset's length can be less than the noise). The
        answer is then the smallest such fit above the model's two tiny sizes.
        """
        found = self._level_above_growth(trials, space)
        if found is None:
            return None
        pts, noise, sizes, level = found
        if space.tensors is not None:
            return self._modelled_plateau(sizes[level:], space, noise)
        a, p = sizes[level - 1], sizes[level]
        if not any(pts[a] - pts[x] > noise for x in sizes[:level - 1]):
            return None  # one step up, then level
        return p

    def _grew_once(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        """A size between the fits around a level that one step up reached (no tensor model), to tell a plateau
        from an upward step before a flat start; ``None`` when there is none to try.

        A plateau's memory grew gradually up to it: a size between shows a peak between the two.
        An upward step (a kernel's larger workspace) followed by a flat start shows one of the two.
        The geometric mean, so that a level found far past where it starts is told in one trial.
        """
        found = None if space.tensors is not None else self._level_above_growth(trials, space)
        if found is None:
            return None
        _, _, sizes, level = found
        a, p = sizes[level - 1], sizes[level]
        b = max(a + 1, min(p - 1, math.isqrt(a * p)))
        if not a < b < p or any(t.batch_size == b for t in trials):
            return None
        return b

    def _level_above_growth(self, trials: Sequence[Trial], space: SearchSpace
                            ) -> tuple[dict[int, int], float, list[int], int] | None:
        """``(growth by size, noise, sizes ascending, index of the level's first size)`` when the largest fits
        are level after growth that would have added three times the noise by the largest (or, with a
        tensor model, whatever the growth); ``None`` otherwise, or with a ``max_batch_size`` or a
        measured failure."""
        if space.upper is not None or bracket(t for t in trials if t.outcome != REFUSED)[1] is not None:
            return None
        pts, noise = self._level(trials, space)
        sizes = sorted(pts)
        if len(sizes) < 3:
            return None
        top = pts[sizes[-1]]
        level = len(sizes) - 1
        while level > 0 and abs(top - pts[sizes[level - 1]]) <= noise:
            level -= 1
        if space.tensors is not None:
            return pts, noise, sizes, level
        if len(sizes) - level < 2 or level == 0:
            return None  # no fit past the first one at the level, or no growth below it
        a, p = sizes[level - 1], sizes[level]
        grew = pts[p] - pts[a]
        if grew <= noise or grew * (sizes[-1] - p) <= 3 * noise * (p - a):
            return None
        return pts, noise, sizes, level

    def _modelled_plateau(self, level: Sequence[int], space: SearchSpace, noise: float) -> int | None:
        """The smallest of ``level`` (fits of one real growth, ascending) that the tensor model says should have grown."""
        model = space.tensors
        assert model is not None
        pair = self._pair(space)
        above = [b for b in level if pair is None or b > pair[1]]
        if len(above) < 2:
            return None
        p, top = above[0], above[-1]
        if _MIN_RATIO * (model(top) - model(p)) <= 3 * noise:
            return None  # the tensors add too little between them to tell a level from growth
        return p

    def _narrow(self, level: int, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        """A size between the plateau's ``level`` and the fit below it where the tensor model puts its start; else ``None``.

        The model says which size's tensors add what the level's real growth added over the fit
        below, and the noise more (real bytes per tensor byte taken as 1): the size then lands on
        the level, a little past its start, however the noise moved the growth read. Tried while
        the interval is wider than twice that size: a plateau found by a jump far past a dataset's
        length (a host's room is large) then ends near it, not at the jump.
        """
        model = space.tensors
        if model is None:
            return None
        pts, noise = self._level(trials, space)
        below = [b for b in pts if b < level]
        if not below:
            return None
        a = max(below)
        b = model.solve(model(a) + max(0, pts[level] - pts[a]) + noise)
        if b is None or not a < b < level or 2 * b > level or any(t.batch_size == b for t in trials):
            return None
        return b

    def _flat_at(self, b: int, trials: Sequence[Trial]) -> bool:
        """Whether a measured fit below ``b`` peaked as high as ``b`` (to ``tolerance_bytes``)."""
        pts = _points(trials)
        return b in pts and any(x < b and pts[b] - pts[x] <= self.tolerance_bytes for x in pts)

    def _pair(self, space: SearchSpace) -> tuple[int, int] | None:
        """The two tiny sizes a tensor model starts from (not 1: some programs take another path there)."""
        if not self.modelled or self.first_guess is not None:
            return None
        b1 = max(space.min_batch_size, 2)
        if space.upper is not None and space.upper < b1 + 1:
            return None
        return b1, b1 + 1

    def _modelled(self, trials: Sequence[Trial], space: SearchSpace) -> int | None | object:
        """The next size through the tensor model, ``None`` to stop, or ``_CLASSIC`` to go on by lines."""
        model = space.tensors
        assert model is not None
        pts = {t.batch_size: t for t in trials if t.measured}
        lo, hi = bracket(trials)
        if lo is None or lo not in pts:
            return _CLASSIC
        upper = hi - 1 if hi is not None else space.upper
        if lo == upper:
            return None
        room = max(1, space.capacity_bytes - (pts[lo].start_bytes or 0))
        # finer than what a trial leaves behind (JIT code for its shape) is noise, not memory; what
        # the latest trial left, not the most any did: the first large trial's one-time set-up (heap
        # grown for good) is left once, is in every later trial's start, and would otherwise stop
        # every search that ran it early that far short of the limit
        slack = max(self.rel_tolerance * room, left_behind(next(t for t in reversed(trials) if t.measured)))
        if pts[lo].peak_bytes >= space.limit_bytes - slack:
            return None  # within the tolerance of the limit
        if hi is not None and hi - lo <= max(1, int(lo * self.rel_tolerance)):
            return None  # bracketed closely enough
        # between the tolerance's floor and the limit; but where the limit lies within the tolerance
        # of the capacity (a target near 1), an answer above ``capacity - tolerance`` must run again
        # after the search (the finder's verification): aim below that line too, so that an answer
        # close enough needs no rerun (what an aim on the limit's side cost: docs/internals.md)
        top = min(space.limit_bytes, space.capacity_bytes - self.rel_tolerance * room)
        aim = (space.limit_bytes - slack + max(top, space.limit_bytes - slack)) / 2
        now = trials[-1].end_bytes  # where the next trial starts: the last one's leftovers included
        if hi is not None:
            # bracketed: the real bytes between the two, along the model; an OOM needed at least
            # the capacity (at least its bound when the allocator said how much it asked for)
            failed = pts.get(hi) or next(t for t in reversed(trials) if t.batch_size == hi)
            if failed.measured:
                b = _through(model, pts[lo], failed, aim, now)
            else:
                # an OOM needed more than the capacity, how much more only its bound tells: never
                # past the midpoint, so a second OOM at least halves the bracket
                failed = dataclasses.replace(failed, outcome=OVER_TARGET,
                                             peak_bytes=max(space.capacity_bytes, failed.peak_bytes or 0))
                b = _through(model, pts[lo], failed, aim, now)
                b = None if b is None else min(b, (lo + hi) // 2)
        else:
            top = max(pts, key=lambda b: (model(b), b))
            below = [b for b in pts if model(top) - model(b) >= _CALIBRATION * room]
            if not below:
                # no two trials far enough apart to tell real bytes per tensor byte: one where the
                # tensors grow by a tenth of the room (more in a small room, where what a trial leaves
                # behind is a larger share of it), far below the limit whatever the ratio: never more
                # than half of what ``lo`` left under it (its peak can be a fixed one, the optimizer
                # step's, that already takes much of a small room)
                grow = max(_PROBE * room, min(_SMALL_PROBE * room, _PROBE_BYTES))
                b = model.solve(model(lo) + min(grow, (space.limit_bytes - pts[lo].peak_bytes) / 2))
            else:
                # the nearest trial far enough below: real memory is not exactly affine in the tensors
                # at tiny sizes (heap, page rounding), and the answer is where the large ones are
                b = _through(model, pts[max(below, key=model)], pts[top], aim, now)
        if b is None:
            return _CLASSIC
        if b - lo <= max(0, int(lo * self.rel_tolerance)):
            return None  # a trial would gain less than the tolerance
        return _clamp(b, lo + 1, upper)

    def _close_enough(self, lo: int, hi: int | None, trials: Sequence[Trial], space: SearchSpace) -> bool:
        """With ``rel_tolerance``: ``lo`` is within it of the boundary (bracketed, or by the line)."""
        slack = max(1, int(lo * self.rel_tolerance))
        if hi is not None and hi - lo <= slack:
            return True
        pts = _points(trials)
        if lo not in pts:
            return False
        if hi is not None and hi in pts:
            boundary = _solve(lo, pts[lo], hi, pts[hi], space.limit_bytes)
        elif hi is None:
            goods = sorted(b for b in pts if b <= lo and pts[b] <= space.limit_bytes)
            boundary = _solve(goods[-2], pts[goods[-2]], lo, pts[lo], space.limit_bytes) if len(goods) >= 2 else None
        else:  # an OOM above: only the bracket can tell
            return False
        return boundary is not None and boundary <= lo + slack

    def certified(self, b: int, trials: Sequence[Trial], space: SearchSpace) -> bool:
        """True when three collinear measured trials, ``b`` among them, put ``b + 1`` over the limit."""
        pts = _points(trials)
        if b not in pts:
            return False
        others = [x for x in pts if x != b]
        tol, limit, pb = self.tolerance_bytes, space.limit_bytes, pts[b]
        for i, x in enumerate(others):
            for y in others[i + 1:]:
                dx = y - x
                dp = pts[y] - pts[x]
                # |line(b) - peak(b)| * |dx| <= tol * |dx|, in integers
                off = (pts[x] - pb) * dx + dp * (b - x)
                if abs(off) > tol * abs(dx):
                    continue
                # line(b + 1) - limit > tol, using line(b) = peak(b) up to tol
                if dx > 0 and (pb - limit - tol) * dx + dp > 0:
                    return True
                if dx < 0 and (pb - limit - tol) * dx + dp < 0:
                    return True
        return False

    def _estimate(self, trials: Sequence[Trial], space: SearchSpace, lo: int | None, hi: int | None) -> int | None:
        pts = _points(trials)
        limit, cap = space.limit_bytes, space.capacity_bytes
        by_size = {t.batch_size: t for t in trials}
        if lo is None:
            # nothing fits yet: scale the smallest failure down, at least halving after an OOM,
            # or follow the line through the two smallest measured failures
            guesses = [_proportional(by_size[hi], limit, cap)]
            if hi not in pts:
                guesses.append(hi // 2)
            measured = sorted(pts)
            if len(measured) >= 2:
                guesses.append(_solve(measured[0], pts[measured[0]], measured[1], pts[measured[1]], limit))
            guesses = [g for g in guesses if g is not None]
            return min(guesses) if guesses else None
        goods = sorted(b for b in pts if b <= lo and pts[b] <= limit)
        extrap = _solve(goods[-2], pts[goods[-2]], lo, pts[lo], limit) if len(goods) >= 2 else None
        if hi is not None and hi in pts:  # interpolate between the last fit and the first failure
            return _solve(lo, pts[lo], hi, pts[hi], limit)
        if hi is not None:
            # an OOM means the line was wrong by more than the headroom: take at most
            # the midpoint, or less where the failure counted at the capacity says so; and
            # no more than the ceiling, so after a flat-start jump's OOM the search climbs
            # as it would have without the jump instead of risking a second OOM
            failed_at = max(cap, by_size[hi].peak_bytes or 0)  # a refused trial's prediction, an OOM's bound
            guesses = [(lo + hi) // 2, _solve(lo, pts[lo], hi, failed_at, limit), extrap,
                       self._ceiling(by_size[lo], cap)]
            return min(g for g in guesses if g is not None)
        if len(goods) < 2:
            return _proportional(by_size[lo], limit, cap)
        # a steeper line may still overtake (activations outgrowing the optimizer step), but
        # none steeper than the proportional slope: where that one reaches the capacity (or
        # twice the size, when that is farther) is as far as no OOM is certain
        ceiling = self._ceiling(by_size[lo], cap)
        if extrap is None:
            return ceiling
        if extrap <= _FLAT * ceiling:
            return min(extrap, ceiling)
        # a flat start: the boundary lies between the ceiling and the line's answer (memory is
        # convex, so the line's answer is an upper bound), and that far apart the two fits sit
        # where the optimizer step outweighs the activations. The ceiling would land on the
        # transition, where no two trials share a line; the geometric mean of the two lands
        # past it in one jump, at the risk of one OOM, and halves the bracket's log-ratio
        return math.isqrt(ceiling * extrap)

    @staticmethod
    def _ceiling(t: Trial, cap: int) -> int:
        """Where the proportional slope through fit ``t`` reaches the capacity, or ``2 × b`` if farther."""
        return max(_proportional(t, cap, cap) or 0, 2 * t.batch_size)


#: the modelled search's calibration: two trials whose modelled tensors differ by this share of the
#: room tell the real bytes per tensor byte; a probe trial grows the tensors by ``_PROBE`` of the room,
#: and by at least ``_PROBE_BYTES`` (at most ``_SMALL_PROBE`` of the room) in a smaller room. What each
#: trial leaves or frees (glibc arenas, oneDNN code) is a larger share of a small probe's growth, and
#: the aim extrapolates that error. Real bytes per tensor byte are close to 1, so half the room stays
#: far from the limit (the measurements: docs/internals.md).
_CALIBRATION = 0.05
_PROBE = 0.1
_SMALL_PROBE, _PROBE_BYTES = 0.5, 128 * 2**20
#: real bytes per tensor byte is taken as at least this (allocator and page overhead never make it
#: much less than 1; a measurement below is noise)
_MIN_RATIO = 0.9
#: ``_modelled``'s answer "continue with the lines"
_CLASSIC = object()

#: A line whose answer is this many times the proportional ceiling marks a flat start:
#: its slope is under 1/16 of the proportional one, the peak barely grew with the batch.
_FLAT = 16


def _through(model: TensorModel, low: Trial, high: Trial, aim: float, now: int | None) -> int | None:
    """The size whose real peak reaches ``aim``, on the line through two trials with the model's tensors as x.

    Trials are compared by what they grew from their own start (the process's memory creeps up
    between trials by what each leaves behind). What a new shape costs once (JIT code, in its peak
    but no per-sample cost) is in both trials' growth and cancels in the difference; subtracting
    each trial's ``left_behind`` instead would add its noise (a trial's end can fall below its start
    as an earlier trial's leftovers are freed): measured on the reference transformer, 1.4 MB of it
    at the low trial made the ratio 1.05 instead of 1.006 and the aim 5% short. The new size starts
    from ``now``.
    """
    def grown(t: Trial) -> int:
        return t.peak_bytes - (t.start_bytes or 0)

    ratio = max(_MIN_RATIO, (grown(high) - grown(low)) / max(1.0, model(high.batch_size) - model(low.batch_size)))
    start = now if now is not None else (high.start_bytes or 0)
    expected = start + grown(high)  # the peak at high's size, starting now
    return model.solve(model(high.batch_size) + (aim - expected) / ratio)


def left_behind(t: Trial) -> int:
    """What a trial left in use once put back (``end_bytes - start_bytes``), 0 when unknown."""
    if t.end_bytes is None or t.start_bytes is None:
        return 0
    return max(0, t.end_bytes - t.start_bytes)


def _solve(x0: int, p0: int, x1: int, p1: int, limit: int) -> int | None:
    """Largest integer b with line(b) <= limit for the line through (x0, p0), (x1, p1); None if flat."""
    dp, dx = p1 - p0, x1 - x0
    if dx == 0 or dp * dx <= 0:  # not increasing: the line never reaches the limit
        return None
    if dx < 0:
        dp, dx = -dp, -dx
    return x0 + ((limit - p0) * dx) // dp


def _proportional(t: Trial, limit: int, cap: int) -> int | None:
    """Scale one trial's added bytes (all taken as per-sample) up or down to ``limit``."""
    start = t.start_bytes or 0
    peak = t.peak_bytes if t.measured else max(cap, t.peak_bytes or 0)
    if peak is None or peak <= start or limit <= start:
        return None
    return (t.batch_size * (limit - start)) // (peak - start)


def _midpoint(floor: int, upper: int | None, lo_b: int) -> int:
    if upper is None:
        return max(2 * floor, lo_b)
    return max((floor + upper + 1) // 2, lo_b)


def _slow_progress(trials: Sequence[Trial], count: int) -> bool:
    """True when each of the last ``count`` trials, run inside a bracket, left more than half of it."""
    if len(trials) <= count:
        return False
    for k in range(len(trials) - count, len(trials)):
        lo0, hi0 = bracket(trials[:k])
        if hi0 is None:
            return False
        lo1, hi1 = bracket(trials[: k + 1])
        f0 = lo0 if lo0 is not None else 0
        f1 = lo1 if lo1 is not None else 0
        # halving the bracket is progress, and so is doubling its floor: fits that climb
        # geometrically towards a distant failure (an OOM far past a flat start) reach it
        # in logarithmically many steps without a midpoint that would OOM again
        if 2 * (hi1 - f1) <= hi0 - f0 or (f0 > 0 and f1 >= 2 * f0):
            return False
    return True


@dataclass(kw_only=True)
class SecantPolicy(SearchPolicy):
    """The exact boundary of a cost that grows with the batch, in few evaluations: the planner's search.

    Evaluates ``cost(1)`` and ``cost(probe)``, jumps to where their line meets the limit, corrects
    the jump with up to three more secant steps (the slope at small batches is often off: another
    phase of the step peaks there), then narrows the bracket by interpolation, checking each
    landing point's neighbour, with a bisection step whenever a round fails to halve it. A cost
    linear in the batch takes four evaluations; the steps a CUDA allocator model adds cost a few
    more. Meant for cheap, noiseless costs (fake-tensor runs): it trusts every figure, and it
    needs ``space.max_batch_size``.

    Stateless like every policy: :meth:`next_size` replays the search over the trials so far
    (each trial's ``peak_bytes`` is the cost, its outcome whether it fits), and
    :meth:`boundary` reads the answer off them the same way.
    """

    name: ClassVar[str] = "secant"
    exact: ClassVar[bool] = True
    probe: int = 1024

    def next_size(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        return self._replay(trials, space)[0]

    def boundary(self, trials: Sequence[Trial], space: SearchSpace) -> int:
        """The largest size known to fit below the smallest known not to (0 when 1 does not fit)."""
        return self._replay(trials, space)[1]

    def _replay(self, trials: Sequence[Trial], space: SearchSpace) -> tuple[int | None, int]:
        """``(next size or None, the boundary so far)``: the search run again over ``trials``' figures."""
        if space.max_batch_size is None:
            raise BatchSizeError("the secant search needs a max_batch_size")
        known = {t.batch_size: t for t in trials}
        state = _Bracket()
        sizes = self._sizes(state, space.limit_bytes, space.max_batch_size)
        try:
            b = next(sizes)
            while b in known:
                b = sizes.send(known[b])
        except StopIteration:
            return None, state.lo
        return b, state.lo

    def _sizes(self, state: _Bracket, limit: int, most: int) -> Generator[int, Trial, None]:
        """The search as a generator: yields a size, is sent its trial; ``state.lo`` is the answer so far."""
        cost: dict[int, int] = {}

        def fits(b: int, t: Trial) -> bool:
            cost[b] = t.peak_bytes
            if t.fits:
                state.lo = max(state.lo, b)
            else:
                state.hi = min(state.hi, b)
            return t.fits

        state.lo, state.hi = 0, most + 1
        if not fits(1, (yield 1)):
            return
        state.lo = 1  # invariant: lo fits; hi does not (or lies past the maximum)
        if most == 1:
            return
        anchor = min(most, max(2, self.probe))
        fits(anchor, (yield anchor))
        line = (1, anchor)
        for _ in range(4):  # secant steps: exact on a line, quick on a convex curve
            if state.hi - state.lo <= 1:
                break
            a, b = line
            slope = (cost[b] - cost[a]) / (b - a)
            guess = most if slope <= 0 else a + math.floor((limit - cost[a]) / slope)
            guess = min(max(guess, state.lo + 1), state.hi - 1)
            if guess in cost:
                break
            fits(guess, (yield guess))
            line = (b, guess)
        stalled = False
        while state.hi - state.lo > 1:  # regula falsi inside the bracket, bisection when it stalls
            lo, hi = state.lo, state.hi
            interpolate = hi <= most and not stalled
            if hi > most:  # nothing has failed yet: double
                guess = 2 * lo
            elif stalled:
                guess = (lo + hi) // 2
            else:
                guess = lo + (limit - cost[lo]) * (hi - lo) // max(cost[hi] - cost[lo], 1)
            guess = min(max(guess, lo + 1), hi - 1)
            ok = fits(guess, (yield guess))
            if interpolate:  # an interpolated boundary is usually exact: check its other side
                neighbour = guess + 1 if ok else guess - 1
                if state.lo < neighbour < state.hi:
                    fits(neighbour, (yield neighbour))
            stalled = interpolate and (state.hi - state.lo) * 2 > hi - lo


@dataclass(kw_only=True)
class GrowStepDownPolicy(SearchPolicy):
    """Verify a predicted size by real runs: grow once into room left, step down when one fails.

    Continuous batching's cache (units are cache sectors) is sized by a prediction from one small
    run; this runs the prediction and judges each run by what it measured when its requests filled
    the cache (``fills``), else by the larger of that and the prediction (``probe_peak`` plus the
    ``footprint`` the account adds over ``probe_units``). A run that fits and filled the cache with
    at least ``grow`` of its size left grows once by the room over the slope (the larger of the
    account's and the one two filled runs measured). One that fails after a smaller one ran runs
    that smaller one again, as the last thing; one that ran over the limit steps down by the
    excess (:func:`below_by_excess`), one out of memory by ``step``. A failure bounds the answer
    from above: no growing after it. The search ends below ``floor`` or after ``rounds``.

    Each trial's ``peak_bytes`` is the run's measured growth; ``measured`` says it ran. ``units``
    is the size a request for ``n`` really gets (the cache rounds). Stateless like every policy:
    :meth:`next_size` replays the decisions over the trials, :meth:`answer` reads the result.
    """

    name: ClassVar[str] = "grow-step-down"
    exact: ClassVar[bool] = False
    repeats: ClassVar[bool] = True
    start: int
    limit: int
    floor: int
    ceiling: int
    probe_units: int
    probe_peak: int
    footprint: Callable[[int], int]
    units: Callable[[int], int]
    fills: Callable[[int], bool]
    grow: float = 0.05
    step: float = 0.15
    rounds: int = 6

    def next_size(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        return self._replay(trials)[0]

    def answer(self, trials: Sequence[Trial]) -> tuple[int, int] | None:
        """``(size, bytes it is expected to grow)`` of the last trial once it is the answer; else ``None``."""
        return self._replay(trials)[1]

    def _replay(self, trials: Sequence[Trial]) -> tuple[int | None, tuple[int, int] | None]:
        found: list[tuple[int, int]] = []
        sizes = self._sizes(found)
        try:
            b = next(sizes)
            for t in trials:
                if t.batch_size != b:
                    raise BatchSizeError(f"trial at {t.batch_size} where the {self.name} search asked for {b}")
                b = sizes.send(t)
        except StopIteration:
            return None, found[-1] if found else None
        return b, None

    def _sizes(self, found: list[tuple[int, int]]) -> Generator[int, Trial, None]:
        """The decisions as a generator: yields a size, is sent its trial; appends the answer to ``found``."""
        size = self.start
        best: tuple[int, int] | None = None  # (size, expected growth) of the largest that ran
        grown = False
        last = (self.probe_units, self.probe_peak, True)  # the last run that filled its cache
        for _ in range(self.rounds):
            t = yield size
            units, filled = self.units(size), self.fills(size)
            predicted = self.probe_peak + self.footprint(units) - self.footprint(self.probe_units)
            expected = t.peak_bytes if filled else max(predicted, t.peak_bytes)
            slope = max(1, self.footprint(size + 1) - self.footprint(size))
            if t.measured and last[2] and units != last[0]:
                slope = max(slope, math.ceil((t.peak_bytes - last[1]) / (units - last[0])))
            last = (units, t.peak_bytes, t.measured) if filled else last
            if t.measured and expected <= self.limit:
                best = (size, expected)
                room = math.floor((self.limit - expected) / slope)
                if grown or not filled or size >= self.ceiling or room < max(1, self.grow * size):
                    found.append((size, expected))
                    return
                grown, size = True, min(self.ceiling, size + room)
                continue
            if best is not None:  # a larger size did not fit after a smaller one ran: run that again, last
                again = yield best[0]
                if again.measured and again.peak_bytes <= self.limit:
                    found.append((best[0], max(best[1], again.peak_bytes)))
                    return
                # the step down below goes from the rerun: its outcome, and the growth expected of it
                size, expected, t, best = self.units(best[0]), best[1], again, None
            if t.measured:  # it ran, but took more than the limit: step down by the excess
                size = below_by_excess(size, expected - self.limit, slope)
            else:
                size = min(size - 1, math.floor(size * (1 - self.step)))
            grown = True
            if size < self.floor:
                return


@dataclass
class _Bracket:
    """:class:`SecantPolicy`'s bracket while it replays: ``lo`` fits, ``hi`` does not (or lies past the maximum)."""

    lo: int = 0
    hi: int = 0


STRATEGIES: dict[str, type[SearchPolicy]] = {
    p.name: p for p in (PredictPolicy, PowerPolicy, BinsearchPolicy, DecayPolicy)
}


def make_policy(strategy: str | SearchPolicy, *, first_guess: int | None = None,
                max_batch_size: int | None = None, tolerance: float = 0.0, modelled: bool = False) -> SearchPolicy:
    """Build a policy by name, seeding its first size.

    ``first_guess`` becomes predict's ``first_guess`` and the ``start`` of
    power, binsearch and decay. Decay without one starts at ``max_batch_size``,
    else at 256. ``tolerance`` is predict's ``rel_tolerance``, ``modelled`` its tensor-model
    start. A policy instance is returned unchanged.

    Raises:
        BatchSizeError: unknown strategy name (the message lists the known ones).
    """
    if isinstance(strategy, SearchPolicy):
        return strategy
    if strategy not in STRATEGIES:
        raise BatchSizeError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == PredictPolicy.name:
        return PredictPolicy(first_guess=first_guess, rel_tolerance=tolerance, modelled=modelled)
    if strategy == DecayPolicy.name:
        return DecayPolicy(start=first_guess or max_batch_size or 256)
    return STRATEGIES[strategy](start=first_guess)


@dataclass(kw_only=True)
class SearchResult:
    """What :func:`run_search` found.

    Attributes:
        batch_size: the largest size that fitted below the smallest failing one,
            or ``None`` when none fitted.
        trials: every trial, in order.
        stop_reason: ``"boundary"`` (b fits and b + 1 is known not to),
            ``"tolerance"`` (b is within the policy's relative tolerance of the boundary),
            ``"max_batch_size"``, ``"strategy"`` (an inexact policy stopped),
            ``"max_trials"``, ``"nothing_fits"``, or ``"plateau"``: without a ``max_batch_size``,
            the peak stopped growing with the batch (:meth:`PredictPolicy.plateau`), and
            ``batch_size`` is the smallest size measured at that peak.
        space: the space at the end (a ``revise`` hook may have lowered its capacity).
    """

    batch_size: int | None
    trials: list[Trial]
    stop_reason: str
    space: SearchSpace | None = None


def reclassify(trials: list[Trial], limit_bytes: int) -> None:
    """Re-judge measured trials against a new limit (fit / over the target), in place."""
    for t in trials:
        if t.measured:
            t.outcome = FIT if t.peak_bytes <= limit_bytes else OVER_TARGET


def run_search(
    policy: SearchPolicy,
    space: SearchSpace,
    run_trial: Callable[[int], Trial],
    *,
    max_trials: int = 25,
    on_trial: Callable[[Trial], None] | None = None,
    revise: Callable[[SearchSpace, Trial], SearchSpace | None] | None = None,
) -> SearchResult:
    """Ask ``policy`` for sizes and run them with ``run_trial`` until it stops.

    Args:
        policy: the search policy.
        space: the limit, capacity and size bounds.
        run_trial: measures one batch size and returns its :class:`Trial`.
        max_trials: stop after this many trials even if the policy would go on.
        on_trial: called with each trial as it completes (logging, progress).
        revise: called after each trial; a space it returns replaces the current one (an OOM
            that shows the real capacity is lower than assumed), and the measured trials are
            re-judged against its limit.

    Raises:
        BatchSizeError: ``max_trials`` is not positive, or the policy asked for
            a size outside the bounds or one it already tried.
    """
    positive_int("max_trials", max_trials, error=BatchSizeError)
    trials: list[Trial] = []
    stopped = False
    while len(trials) < max_trials:
        b = policy.next_size(trials, space)
        if b is None:
            stopped = True
            break
        if b < space.min_batch_size or (space.upper is not None and b > space.upper):
            raise BatchSizeError(f"policy {policy.name} asked for batch size {b} outside the bounds {space}")
        if not policy.repeats and any(t.batch_size == b for t in trials):
            raise BatchSizeError(f"policy {policy.name} asked for batch size {b} twice")
        trial = run_trial(b)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        if revise is not None:
            revised = revise(space, trial)
            if revised is not None and revised != space:
                space = revised
                reclassify(trials, space.limit_bytes)
    if not stopped and policy.next_size(trials, space) is None:
        stopped = True
    best, hi = bracket(trials)
    level = policy.plateau(trials, space) if stopped else None
    if level is not None:
        return SearchResult(batch_size=level, trials=trials, stop_reason="plateau", space=space)
    if best is None:
        reason = "nothing_fits" if stopped else "max_trials"
    elif not stopped:
        reason = "max_trials"
    elif best == space.upper:
        reason = "max_batch_size"
    elif not policy.exact:
        reason = "strategy"
    elif getattr(policy, "rel_tolerance", 0) and hi != best + 1:
        reason = "tolerance"
    else:
        reason = "boundary"
    return SearchResult(batch_size=best, trials=trials, stop_reason=reason, space=space)


# -- verification: an answer run again after the search, and where to go when it no longer fits

#: verification runs before the finder stops stepping down by the line and halves instead
_LINE_STEPS = 3


def doubtful(answer: int, trials: list[Trial], space: SearchSpace, tolerance: float) -> bool:
    """True when ``answer`` has not run since the last OOM, or ran within ``tolerance`` of the capacity.

    Such an answer is run again after the search (what an OOM leaves behind on real memory, or a
    peak that close to the capacity, can make it fail the next time).
    """
    last_run = max((i for i, t in enumerate(trials) if t.batch_size == answer and t.measured), default=-1)
    last_oom = max((i for i, t in enumerate(trials) if t.outcome == OOM), default=-1)
    if last_oom > last_run:
        return True
    if last_run < 0:
        return True
    t = trials[last_run]
    room = space.capacity_bytes - (t.start_bytes or 0)
    margin = max(1, int(tolerance * room), max((left_behind(x) for x in trials), default=0))
    return t.peak_bytes >= space.capacity_bytes - margin


def step_down(b: int, trials: list[Trial], space: SearchSpace, tolerance: float, floor: int,
              tried: set[int], attempts: int) -> int | None:
    """The next size to run below ``b``, which no longer fits: by the bytes per sample near it.

    The last run of ``b`` shows what it needs now (its peak, or more than the capacity after an
    OOM); the search's trials give the bytes one sample adds there. The step lands ``b``'s need
    a tolerance under the limit. After ``_LINE_STEPS`` failed steps the size halves instead.
    """
    if b <= floor:
        return None
    last = [t for t in trials if t.batch_size == b][-1]
    room = space.capacity_bytes - (last.start_bytes or 0)
    margin = max(tolerance * room, max((left_behind(t) for t in trials), default=0))
    # an OOM needed more than the capacity, and what it left behind is no longer free either
    need = last.peak_bytes if last.measured else max(space.capacity_bytes, last.peak_bytes or 0) + left_behind(last)
    searched = [t for t in trials if t.measured and t.batch_size != b]
    line = fit_line(searched, space.limit_bytes)
    guess = b - max(1, int(b * max(tolerance, 0.01)))
    if attempts <= _LINE_STEPS and line is not None and line[1] > 0:
        guess = min(guess, below_by_excess(b, need - (space.limit_bytes - margin / 2), line[1]))
    elif attempts > _LINE_STEPS:
        guess = min(guess, b // 2)
    guess = max(floor, guess)
    while guess in tried and guess > floor:
        guess -= 1
    return None if guess in tried else guess


def below_by_excess(size: int, excess: float, per_unit: float) -> int:
    """The size whose need is ``excess`` less than ``size``'s, at ``per_unit`` bytes a unit: at least one unit down.

    What a size that ran over its limit (or out of memory) steps down to: the finder's verification
    (:func:`step_down`, units are samples) and continuous batching's cache (units are cache sectors).
    """
    return size - max(1, math.ceil(excess / per_unit))
