"""Uneven ranks: each rank's share of one global batch, from its speed and its memory; torch-free.

Data-parallel ranks that are not alike (two 48 GB cards beside two 11 GB ones, a rank that
also runs the evaluator) finish a step when their slowest rank does. A rank that processes
``n`` samples at ``s`` samples/s takes ``n / s`` seconds, so the step is shortest when every
share is proportional to its rank's speed; memory bounds only the *micro*-batch, not the share:
a rank whose share is larger than what fits runs it as several micro-batches (accumulation),
and every rank still runs exactly one optimizer step (one gradient all-reduce) per global batch.

* :func:`split_shares` -- integer shares summing to the global batch, proportional to speed
  (the largest share no longer than it must be: it minimises the slowest rank's time), each
  between a floor (1: every rank holds a sample) and an optional cap.
* :func:`balanced_total` -- the largest global batch that every rank takes in one micro-batch
  with shares proportional to speed (the plan when no global batch is given).
* :func:`rank_shares` -- the whole per-rank plan: share, micro-batch, accumulation, and the
  time each rank needs relative to the others.
* :func:`check_shares`, :func:`equal_shares` -- shares a user gives (or weights), and the equal split.
* :class:`ShareBalancer` -- the runtime decision: every rank's measured step times (the same
  numbers on every rank) in, new shares out once a window of steps says they are faster beyond
  the noise; a move the real steps after it do not confirm is undone and held.

The same functions serve the planner (speeds from the GPU table or the user) and the runtime
split (speeds measured per rank): pass samples/s or any figure proportional to it. They are
deterministic (ties go to the lowest rank), so every rank that calls them with the same
arguments gets the same split without a collective.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from .._checks import check_int, positive_int
from .evidence import NOISE_Z
from .microbatch import accum_steps

__all__ = ["RankShare", "check_speeds", "split_shares", "balanced_total", "rank_shares", "step_seconds",
           "check_shares", "equal_shares", "ShareBalancer", "ShareDecision", "shrunk_rates"]


def check_speeds(speeds: Any, ranks: int | None = None, *, error: type[Exception] = ValueError) -> tuple[float, ...]:
    """``speeds`` as a tuple of positive finite floats, one per rank (``ranks`` of them when given).

    Raises:
        ValueError (or ``error``): not a sequence of positive finite numbers, or the wrong length.
    """
    try:
        values = tuple(float(s) for s in speeds)
    except (TypeError, ValueError):
        raise error(f"speeds must be a sequence of positive numbers (samples/s or proportional), got {speeds!r}") from None
    if not values:
        raise error("speeds is empty: give one speed per rank")
    bad = [s for s in values if not (math.isfinite(s) and s > 0)]
    if bad:
        raise error(f"speeds must be positive and finite, got {bad[0]!r} in {list(values)}")
    if ranks is not None and len(values) != ranks:
        raise error(f"{len(values)} speeds for {ranks} ranks: give one speed per rank")
    return values


def _bounds(name: str, values: Sequence[int | None] | None, ranks: int, default: int | None,
            minimum: int) -> list[int | None]:
    if values is None:
        return [default] * ranks
    values = list(values)
    if len(values) != ranks:
        raise ValueError(f"{len(values)} {name} for {ranks} ranks: give one per rank (None for no bound)")
    return [None if v is None else check_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(values)]


def split_shares(total: int, speeds: Sequence[float], *, caps: Sequence[int | None] | None = None,
                 floors: Sequence[int] | None = None) -> list[int]:
    """``total`` samples over the ranks, as nearly proportional to ``speeds`` as integers allow.

    The split minimises the slowest rank's time ``max(share / speed)`` and, among such splits,
    hands the samples left after rounding down to the ranks that would finish them soonest
    (ties: the lowest rank). ``split_shares(512, [3, 1]) == [384, 128]``;
    ``split_shares(10, [1, 1, 1]) == [4, 3, 3]``.

    Args:
        total: the global batch (samples, or any unit the speeds are per second of).
        speeds: one positive figure per rank, proportional to its samples/s.
        caps: per rank, the most samples it may take (``None``: no cap), e.g. its micro-batch
            times an accumulation limit; a capped rank's excess goes to the others by speed.
        floors: per rank, the fewest samples it takes (default 1: a rank with nothing to do
            could not run its backward, and every rank must run the same collectives).

    Raises:
        ValueError: ``total`` is not a positive int, the floors add up to more than ``total`` or the
            caps to less, a cap below its floor, or bad speeds.
    """
    total = positive_int("total", total)
    speeds = check_speeds(speeds)
    n = len(speeds)
    lo = [int(v) for v in _bounds("floors", floors, n, 1, 0)]  # type: ignore[arg-type]
    hi = _bounds("caps", caps, n, None, 1)
    for i, (a, b) in enumerate(zip(lo, hi)):
        if b is not None and b < a:
            raise ValueError(f"caps[{i}] = {b} is below floors[{i}] = {a}")
    if sum(lo) > total:
        raise ValueError(f"a global batch of {total} cannot give {n} ranks at least {lo} samples each: "
                         f"make it at least {sum(lo)}, or use fewer ranks")
    if all(b is not None for b in hi) and sum(hi) < total:  # type: ignore[arg-type]
        raise ValueError(f"the ranks can take at most {sum(hi)} samples together (caps {hi}), fewer than "  # type: ignore[arg-type]
                         f"the global batch of {total}: lower it, or raise the caps (more accumulation)")
    level = _water_level(total, speeds, lo, hi)
    shares = [_clamp(math.floor(s * level), a, b) for s, a, b in zip(speeds, lo, hi)]
    # rounding down leaves fewer than n samples over (or, through the floors, a few too many)
    while sum(shares) < total:
        i = min((i for i in range(n) if hi[i] is None or shares[i] < hi[i]),  # type: ignore[operator]
                key=lambda i: ((shares[i] + 1) / speeds[i], i))
        shares[i] += 1
    while sum(shares) > total:
        i = max((i for i in range(n) if shares[i] > lo[i]), key=lambda i: (shares[i] / speeds[i], -i))
        shares[i] -= 1
    return shares


def _clamp(x: float, lo: int, hi: int | None) -> int:
    x = max(lo, int(x))
    return x if hi is None else min(hi, x)


def _water_level(total: int, speeds: Sequence[float], lo: Sequence[int], hi: Sequence[int | None]) -> float:
    """The time ``t`` at which ``sum(clamp(speed * t, floor, cap)) == total`` (bisection; exact enough to round)."""

    def taken(t: float) -> float:
        return sum(min(b, max(a, s * t)) if b is not None else max(a, s * t) for s, a, b in zip(speeds, lo, hi))

    low, high = 0.0, total / min(speeds) + 1.0
    for _ in range(200):
        mid = (low + high) / 2
        if taken(mid) < total:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return low


def balanced_total(speeds: Sequence[float], max_micro: Sequence[int]) -> list[int]:
    """The largest shares that every rank takes in one micro-batch, proportional to speed.

    The rank with the least memory per unit of speed sets the pace: at its largest micro-batch
    it runs for ``t = max_micro / speed`` and every other rank takes ``speed × t`` samples
    (rounded down, at least 1, at most its own ``max_micro``). Their sum is the global batch.
    ``balanced_total([3, 1], [800, 170]) == [510, 170]``.

    Raises:
        ValueError: bad speeds, or a ``max_micro`` that is not a positive int per rank.
    """
    speeds = check_speeds(speeds)
    micro = [positive_int(f"max_micro[{i}]", m) for i, m in enumerate(max_micro)]
    if len(micro) != len(speeds):
        raise ValueError(f"{len(micro)} micro-batch sizes for {len(speeds)} speeds: give one per rank")
    pace = min(m / s for m, s in zip(micro, speeds))
    # a relative tolerance: the pacing rank's speed x pace is its max_micro up to float rounding
    return [max(1, min(m, math.floor(s * pace * (1 + 1e-9)))) for m, s in zip(micro, speeds)]


def step_seconds(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """The step's time in the speeds' unit: the slowest rank's ``share / speed``."""
    return max(n / s for n, s in zip(shares, check_speeds(speeds, len(shares))))


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a global batch.

    Attributes:
        rank: its index.
        share: samples of the global batch it processes per optimizer step.
        micro_batch: the largest micro-batch of its split (the share in ``accumulation``
            micro-batches that differ by at most one sample).
        accumulation: micro-batches per optimizer step; ranks may differ, the optimizer steps
            and the gradient all-reduce per step do not.
        max_micro_batch: the largest micro-batch its memory allows.
        speed: its speed figure, as given.
        time: ``share / speed`` over the slowest rank's: 1.0 for the rank that sets the pace.
    """

    rank: int
    share: int
    micro_batch: int
    accumulation: int
    max_micro_batch: int
    speed: float
    time: float


def rank_shares(total: int | None, speeds: Sequence[float], max_micro: Sequence[int], *,
                caps: Sequence[int | None] | None = None) -> list[RankShare]:
    """Each rank's share, micro-batch and accumulation for a global batch of ``total``.

    ``total=None``: the largest global batch that every rank takes in one micro-batch
    (:func:`balanced_total`). Otherwise the shares are :func:`split_shares` and each rank runs
    its share in ``ceil(share / max_micro)`` balanced micro-batches.

    Raises:
        ValueError: as :func:`split_shares` and :func:`balanced_total`.
    """
    speeds = check_speeds(speeds)
    micro = [positive_int(f"max_micro[{i}]", m) for i, m in enumerate(max_micro)]
    if len(micro) != len(speeds):
        raise ValueError(f"{len(micro)} micro-batch sizes for {len(speeds)} speeds: give one per rank")
    shares = balanced_total(speeds, micro) if total is None else split_shares(total, speeds, caps=caps)
    slowest = step_seconds(shares, speeds)
    out = []
    for i, (n, s, m) in enumerate(zip(shares, speeds, micro)):
        k = accum_steps(n, m)
        out.append(RankShare(rank=i, share=n, micro_batch=accum_steps(n, k), accumulation=k, max_micro_batch=m,
                             speed=s, time=(n / s) / slowest))
    return out


def equal_shares(total: int, world: int) -> tuple[int, ...]:
    """``total`` over ``world`` ranks as evenly as integers allow, the larger shares first (``10, 3`` -> ``4, 3, 3``)."""
    q, r = divmod(int(total), int(world))
    return tuple(q + 1 if i < r else q for i in range(world))


def check_shares(shares: Sequence[int], total: int, world: int) -> tuple[int, ...]:
    """``shares`` as a tuple of ``world`` positive ints summing to ``total``.

    A list whose sum differs from ``total`` is read as weights (``[3, 1]`` of 64 -> ``48, 16``).

    Raises:
        ValueError: not one positive int per rank, or ``total`` below one sample per rank.
    """
    items = list(shares)
    if len(items) != world and world == 1:
        raise ValueError(
            f"shares={items!r} splits the global batch over {len(items)} ranks, but this process is a world of "
            "one (world size 1): uneven shares need a process group of several ranks (e.g. torchrun "
            f"--nproc-per-node={len(items) if len(items) > 1 else 2}, one share per rank); in a single process "
            "leave shares out (its one rank takes the whole global batch)"
        )
    if len(items) != world or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in items):
        raise ValueError(
            f"shares must be one positive int per rank ({world} ranks), got {items!r}: e.g. shares=[3, 1] "
            "(weights, scaled to the global batch) or shares=\"auto\""
        )
    if sum(items) == total:
        return tuple(items)
    return tuple(split_shares(total, [float(s) for s in items]))


@dataclass(frozen=True)
class ShareDecision:
    """What :meth:`ShareBalancer.observe` decided.

    Attributes:
        shares: the shares from the next step on (the current ones when nothing changes).
        changed: whether they differ from the current ones.
        rates: the median samples/s per rank the decision used (empty before a full window).
        predicted: the predicted step time (the slowest rank's share over its rate) at ``shares``.
        reason: one line for the log.
    """

    shares: tuple[int, ...]
    changed: bool
    rates: tuple[float, ...] = ()
    predicted: float | None = None
    reason: str = ""


@dataclass
class ShareBalancer:
    """Shares proportional to each rank's measured samples/s, moved only when clearly faster, and checked.

    Each step, every rank reports the seconds it spent on its share (forward and backward of its
    micro-batches, no waiting on the others) and how many samples that was. After ``window``
    steps at the same shares the balancer takes each rank's median rate (one slow step is an
    anecdote, the median of ``window`` is a measurement) and splits the global batch in
    proportion to the rates. On a shared machine a rank's rate is stretched by whatever else ran
    on its cores at that moment, and that load moves, so the rule is the one for every choice
    taken from measured times (:mod:`batchpilot.policy.evidence`):

    * **Evidence beats the noise.** The shares move only when the predicted step time (the
      slowest rank's share / rate) falls by more than ``margin`` *and* by more than the noise
      of the rates: :data:`~batchpilot.policy.evidence.NOISE_Z` standard errors of a difference
      of two ranks' log median rates, each rank's scatter taken from the median absolute
      deviation of its per-step log rates (robust to one slow step).
    * **Checked on the real steps that follow.** The steps at the new shares are compared with
      the steps before the move (the window that moved them and up to three before it at the
      same shares, not that window alone: a window picked for looking lopsided is slower than
      usual by that choice alone; a move waits until two windows are measured), per step by
      what a step costs: the slowest rank's seconds.
      The move is kept when their median is lower by more than its noise (the same
      :data:`~batchpilot.policy.evidence.NOISE_Z` standard errors) and by half the ``margin``
      (the prediction had to clear all of it). Faster but within the noise: another window of
      real steps, up to three, where one standard error suffices (a gain that holds over three
      windows is no chance, and a truly slower rank's real gain is smaller than predicted, a
      step being the larger of two scattered times). Otherwise the balancer goes back to the previous shares, says so
      in the decision's reason, and holds them for ``hold`` windows, twice as long after each
      further revert in a row (up to eight times), or until :meth:`reset` (an OOM or another
      change of memory, new shares set by hand): the shares cannot oscillate, and a load that
      was wrongly blamed on a rank, or that has since left, cannot hold them for the rest of the run.
    * **Equal shares are the simple choice.** The split is made from the rates shrunk toward
      their common mean by their standard errors (:func:`shrunk_rates`): rates that differ by
      their noise alone split equally. A move toward equal shares (a smaller difference between
      the largest and the smallest share) needs one standard error of predicted gain instead of
      :data:`~batchpilot.policy.evidence.NOISE_Z`, and on the check it is kept unless its real
      steps are slower by a standard error: a move made for a load that then left comes back.

    A move that the real steps confirm is kept, and the windows that confirmed it are the next
    decision's baseline.

    Args:
        window: steps measured per decision (the first ``skip`` after a change are not counted).
        margin: fraction by which the predicted step time must fall to move the shares.
        skip: steps after each change whose times are left out (warm-up at the new sizes).
        minimum: the least share a rank may get.
        hold: windows the shares stay put after a reverted move (doubled for each revert in a row).

    Raises:
        ValueError: ``window`` < 3, ``margin`` outside [0, 1), ``skip`` < 0, ``minimum`` < 1 or ``hold`` < 1.
    """

    window: int = 8
    margin: float = 0.05
    skip: int = 1
    minimum: int = 1
    hold: int = 4
    _times: list[tuple[float, ...]] = field(default_factory=list, init=False, repr=False)
    _samples: list[tuple[int, ...]] = field(default_factory=list, init=False, repr=False)
    _skipped: int = field(default=0, init=False, repr=False)
    # after a move: (shares before it, shares moved to, the slowest rank's seconds per step before it)
    _check: tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]] | None = field(default=None, init=False,
                                                                                         repr=False)
    # after a reverted move: the reason the shares are held (nothing is measured while _held_for lasts)
    _held: str | None = field(default=None, init=False, repr=False)
    _held_for: int = field(default=0, init=False, repr=False)  # steps left in the hold
    _reverts: int = field(default=0, init=False, repr=False)  # reverted moves in a row (each doubles the hold)
    # the slowest rank's seconds per step at the current shares, the last few windows (the check's baseline)
    _history: list[float] = field(default_factory=list, init=False, repr=False)
    # every rank's samples/s in each of those steps (the rates a decision is taken from)
    _rate_history: list[tuple[float, ...]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.window, int) and self.window >= 3):
            raise ValueError(f"window must be an int >= 3 steps (a median of fewer is noise), got {self.window!r}")
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 1):
            raise ValueError(f"margin must be a fraction in [0, 1), got {self.margin!r}")
        if not (isinstance(self.skip, int) and self.skip >= 0):
            raise ValueError(f"skip must be an int >= 0, got {self.skip!r}")
        if not (isinstance(self.minimum, int) and self.minimum >= 1):
            raise ValueError(f"minimum must be an int >= 1, got {self.minimum!r}")
        if not (isinstance(self.hold, int) and self.hold >= 1):
            raise ValueError(f"hold must be an int >= 1 windows, got {self.hold!r}")

    @property
    def measured(self) -> int:
        """Steps in the current window."""
        return len(self._times)

    @property
    def held(self) -> bool:
        """A move was reverted: the shares stay as they are for ``hold`` windows (or until :meth:`reset`)."""
        return self._held is not None

    @property
    def on_trial(self) -> tuple[int, ...] | None:
        """While a move is checked on the real steps after it: the shares it left; else ``None``."""
        return None if self._check is None else self._check[0]

    def reset(self) -> None:
        """Start anew (a rank's memory or the shares changed from outside): a new window, no check, no hold."""
        self._restart()
        self._skipped = 0
        self._check = None
        self._held = None
        self._held_for = 0
        self._reverts = 0
        self._forget()

    def _restart(self) -> None:
        self._times.clear()
        self._samples.clear()

    def _forget(self) -> None:
        """The steps measured at the current shares no longer count (the shares or the load changed)."""
        self._history.clear()
        self._rate_history.clear()

    def observe(self, shares: Sequence[int], samples: Sequence[int], seconds: Sequence[float]) -> ShareDecision:
        """One step's per-rank ``samples`` and ``seconds`` at ``shares``; the shares of the next step.

        A step where some rank did not take its full share (an epoch's last batch) or reported
        no time is not counted.
        """
        current = tuple(int(s) for s in shares)
        if self._held is not None:
            self._held_for -= 1
            if self._held_for > 0:
                return ShareDecision(current, False, reason=self._held)
            self._held = None  # the hold is over: measure anew from here (the load may have moved)
            self._forget()
            self._skipped = 0
        if self._check is not None and self._check[1] != current:
            self._check = None  # the move was not taken up: nothing to check
            self._forget()
            self._skipped = 0
        full = tuple(int(n) for n in samples) == current
        if not full or not all(t > 0 for t in seconds):
            return ShareDecision(current, False, reason="step not counted (short batch or no time)")
        if self._skipped < self.skip:
            self._skipped += 1
            return ShareDecision(current, False, reason="warm-up step at new shares")
        self._times.append(tuple(float(t) for t in seconds))
        self._samples.append(current)
        if len(self._times) < self.window:
            return ShareDecision(current, False, reason=f"measuring ({len(self._times)} of {self.window} steps)")
        world = len(current)
        steps = tuple(max(t) for t in self._times)
        kept = _BASELINE_WINDOWS * self.window
        self._rate_history = (self._rate_history + [tuple(s[r] / t[r] for r in range(world))
                                                    for s, t in zip(self._samples, self._times)])[-kept:]
        self._restart()
        # the rates, like the baseline, from every step at these shares of the last few windows, not
        # only the window that would move them: a window picked for looking lopsided is slower than
        # usual by that choice alone, and more steps make a smaller noise a move has to beat
        per_step = [[v[r] for v in self._rate_history] for r in range(world)]
        rates = tuple(statistics.median(v) for v in per_step)
        errors = tuple(_median_error(v) for v in per_step)
        noise = NOISE_Z * math.sqrt(2.0) * max(errors)
        self._history = (self._history + list(steps))[-kept:]
        note = ""
        if self._check is not None:
            before_shares, moved, before = self._check
            after = self._history  # every step since the move
            then, now, error = statistics.median(before), statistics.median(after), _median_error(before, after)
            floor = -math.log(1 - self.margin / 2)
            last = len(after) >= _CHECK_WINDOWS * self.window
            # the last look, on three windows, asks one standard error: a move that stays faster
            # that long is no chance, and a truly slower rank's gain is cut by its max of two scatters
            bound = max((_LAST_Z if last else NOISE_Z) * error, floor)
            gain = math.log(then / now)
            if (gain > floor or gain > -NOISE_Z * error) and gain <= bound and not last:
                # faster, but not yet beyond the noise, or slower within it: more real steps tell (a
                # real gain that one window of scattered steps happened to hide is not thrown away)
                return ShareDecision(current, False, rates, step_seconds(current, rates),
                                     f"shares {list(current)} on trial: {now:.4g} s against {then:.4g} s before the "
                                     f"move over {len(after)} steps, within the noise of {1 - math.exp(-bound):.1%}")
            self._check = None
            simpler = _unevenness(moved) < _unevenness(before_shares)
            if not gain > bound and simpler and gain >= -_TOWARD_EQUAL_Z * error:
                # closer to equal shares and not slower by a standard error: the simpler split stays
                # (equal shares are what the ranks start from, and need no evidence to hold)
                self._reverts = 0
                note = (f"; the move to {list(moved)} kept: closer to equal shares and not slower beyond the noise "
                        f"({now:.4g} s against {then:.4g} s)")
            elif not gain > bound:
                self._reverts += 1
                windows = self.hold * 2 ** min(self._reverts - 1, _HOLD_DOUBLINGS)
                self._held_for = windows * self.window
                self._held = (f"shares {list(before_shares)} held after the move to {list(moved)} was reverted, "
                              f"for {windows} windows ({self._held_for} steps) or until a change of memory")
                return ShareDecision(
                    before_shares, True, rates, step_seconds(before_shares, rates),
                    f"shares {list(moved)} -> {list(before_shares)}: the move to {list(moved)} was not faster on real "
                    f"steps: {now:.4g} s against {then:.4g} s over {len(after)} steps (needed {1 - math.exp(-bound):.1%} "
                    f"less); held for {windows} windows ({self._held_for} steps) or until a change of memory")
            else:
                self._reverts = 0
                note = f"; the move to {list(moved)} was faster on real steps: {now:.4g} s against {then:.4g} s"
        decision = self.decide(current, rates, noise=noise, errors=errors)
        if decision.changed and len(self._history) < _BASELINE_LEAST * self.window:
            # the check needs a baseline it can tell a real gain from: one more window first
            return ShareDecision(current, False, rates, step_seconds(current, rates),
                                 f"shares {list(current)} kept until {_BASELINE_LEAST} windows are measured "
                                 f"(would move to {list(decision.shares)})")
        if decision.changed:
            self._check = (current, decision.shares, tuple(self._history))
            self._forget()
            self._skipped = 0  # warm-up at the new shares
        elif note:
            decision = replace(decision, reason=decision.reason + note)
        return decision

    def decide(self, current: Sequence[int], rates: Sequence[float], *, noise: float = 0.0,
               errors: Sequence[float] | None = None) -> ShareDecision:
        """The shares for per-rank ``rates`` (samples/s), or ``current`` when they are not clearly faster.

        ``noise``: how far (in log) the predicted step time's fall must go beyond chance, on top of
        ``margin`` (0: rates taken as exact). ``errors``: each rate's standard error (in log); the
        split is made from the rates shrunk toward their common mean by what the errors leave
        unexplained (:func:`shrunk_rates`), so that ranks whose rates differ by their noise
        alone get equal shares, not a split that follows the noise.
        """
        current = tuple(int(s) for s in current)
        total = sum(current)
        measured = tuple(float(r) for r in rates)  # what the decision reports
        if errors is not None:
            rates = shrunk_rates(rates, errors)
        proposal = tuple(split_shares(total, list(rates), floors=[self.minimum] * len(current)))
        now = max(s / r for s, r in zip(current, rates))
        then = max(s / r for s, r in zip(proposal, rates))
        rates_text = ", ".join(f"{r:.4g}" for r in measured)
        if _unevenness(proposal) < _unevenness(current):
            # toward equal shares, the split the ranks start from: the simpler choice needs less evidence
            noise *= _TOWARD_EQUAL_Z / NOISE_Z
        needed = max(-math.log(1 - self.margin), noise)
        if proposal != current and math.log(now / then) > needed:
            return ShareDecision(proposal, True, measured, then,
                                 f"shares {list(current)} -> {list(proposal)}: samples/s per rank {rates_text}, "
                                 f"predicted step {now:.4g}s -> {then:.4g}s")
        why = "" if proposal == current or now <= then else (
            f" (predicted {now:.4g}s -> {then:.4g}s at {list(proposal)}, within "
            f"{'the noise' if noise > -math.log(1 - self.margin) else 'the margin'} of {1 - math.exp(-needed):.1%})")
        return ShareDecision(current, False, measured, now,
                             f"shares {list(current)} kept: samples/s per rank {rates_text}{why}")


#: windows at the same shares whose steps make the check's baseline
_BASELINE_WINDOWS = 4
#: windows at the same shares measured before a move (the fewest the check's baseline holds)
_BASELINE_LEAST = 2
#: windows of real steps after a move, at most, before the check decides (fewer when clear)
_CHECK_WINDOWS = 3
#: standard errors the real gain must exceed at the check's last look
_LAST_Z = 1.0
#: standard errors a predicted gain must exceed when it moves the shares toward equal
_TOWARD_EQUAL_Z = 1.0
#: a hold doubles with each reverted move in a row, this many times at most
_HOLD_DOUBLINGS = 3


def _unevenness(shares: Sequence[int]) -> int:
    """How far ``shares`` are from equal shares of the same total: the largest difference of two ranks."""
    return max(shares) - min(shares)


def shrunk_rates(rates: Sequence[float], errors: Sequence[float]) -> tuple[float, ...]:
    """``rates`` with each one's distance from their (geometric) mean shrunk by its noise.

    Rank ``r``'s log rate is moved toward the mean log rate by the factor ``max(0, 1 - v_r /
    d_r^2)``, ``d_r`` its distance from the mean and ``v_r`` that distance's variance from the
    ranks' standard errors (positive-part James-Stein, one rank at a time): a distance no
    larger than the noise is taken as none, one many times the noise almost whole. Split by the
    raw medians, alike ranks on a busy machine get a split that follows whichever rank's window
    happened to be slower (an unbiased but noisy estimate: half the time on the wrong side);
    shrunk, they stay together, and a truly slower rank still gets most of its share.
    """
    logs = [math.log(r) for r in rates]
    mid = statistics.fmean(logs)
    n, pooled = len(logs), sum(e * e for e in errors)
    out = []
    for r, v, e in zip(rates, logs, errors):
        d = v - mid
        # the variance of a rank's distance from the mean of n log rates (its own error and, through
        # the mean, everyone's): two ranks' distance is half their difference
        var = e * e * (1 - 2 / n) + pooled / (n * n)
        factor = max(0.0, 1.0 - var / (d * d)) if d else 0.0
        out.append(float(r) if e == 0 else math.exp(mid + factor * d))  # exact rates stay exact
    return tuple(out)


def _median_error(*groups: Sequence[float]) -> float:
    """The standard error of a median of log values (of a difference of medians, for two groups).

    The scatter is the median absolute deviation of ``log(x)`` about each group's median (scaled
    to a normal standard deviation, pooled), robust to the odd slow step; a median of ``n``
    values has about ``1.2533 / sqrt(n)`` of it.
    """
    deviations: list[float] = []
    for g in groups:
        logs = [math.log(x) for x in g]
        mid = statistics.median(logs)
        deviations += [abs(v - mid) for v in logs]
    sigma = 1.4826 * statistics.median(deviations)
    return 1.2533 * sigma * math.sqrt(sum(1 / len(g) for g in groups))
