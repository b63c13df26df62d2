"""Find the largest batch size whose training (or inference) step fits under a memory target.

:func:`find_batch_size` runs a user's step at the batch sizes a search policy
(:mod:`batchpilot.policy.search`) asks for, measures each trial's peak with the memory
probes, recovers from OOMs, and puts the model, optimizer and RNG state back
afterwards; its answer is a :class:`~batchpilot.find.result.BatchPlan`.
:func:`batchpilot.find.front.find_batch_size_for` builds the step from a model, an
optimizer, a loss and an example batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from .._progress import Progress
from ..core.compiled import CompileCounter, compiled_floor, is_compiled
from ..memory.gauge import Gauge, gauge_for
from ..memory.host import malloc_threshold_held, physical_bytes
from ..memory.oom import attempt, free_memory, is_oom
from ..memory.probes import EMULATED_DEVICES, emulate_capacity, emulated_capacity, track_peak
from ..memory.tracker import active_tracker
from ..memory.units import format_bytes, resolve_device
from ..policy.search import (
    FIT,
    OOM,
    OVER_TARGET,
    REFUSED,
    BatchSizeError,
    NothingFitsError,
    SearchPolicy,
    SearchResult,
    SearchSpace,
    TensorModel,
    Trial,
    fit_line,
    left_behind as _left_behind,
    make_policy,
    predict_peak,
    run_search,
)
from ..policy.evidence import decide_throughput
from ..policy.speed import choose_fastest, fit_time, search_throughput, timed_fits
from .notes import note_trial_error
from .options import FindOptions
from .result import BatchPlan, MemoryFit, trial_line
from .snapshot import StateSnapshot
from .timing import outside_trackers, step_clock, timed

__all__ = [
    "BatchSizeError",
    "NothingFitsError",
    "find_batch_size",
    "warm_up",
]

logger = logging.getLogger(__name__)


def find_batch_size(
    step: Callable[[int], Any],
    *,
    device: torch.device | str | int | None = None,
    target: float | None = None,
    restore: Iterable[Any] = (),
    options: FindOptions | None = None,
    lockstep: Any = None,
    **overrides: Any,
) -> BatchPlan:
    """Find the largest batch size whose step peaks at or under ``target × capacity`` (or the fastest one).

    Each trial calls ``step(batch_size)`` ``steps_per_trial`` times and measures the peak of
    the memory that fails on the device (:mod:`batchpilot.memory.gauge`); a peak over the limit
    counts as "does not fit" just like an OOM, which is recovered from. Before the first
    trial the objects in ``restore`` and the torch / numpy / python RNG states are
    snapshotted, and they are put back after every trial and when the search ends, also on
    error.

    What is measured: with ``capacity`` on CPU or CUDA the trials run under
    :func:`~batchpilot.memory.probes.emulate_capacity` (tensor bytes on CPU, reserved bytes on CUDA);
    without it, the device's real memory: on CPU the process's resident set against the
    tightest of its cgroup limit, ``RLIMIT_AS`` and the available RAM (with the tensor bytes
    alongside, per trial), on CUDA reserved memory plus everything outside PyTorch against
    the card's total. On a real CPU no trial is run whose predicted peak is over a limit that
    kills (a container's): it is recorded as ``"refused"``. An OOM lowers the capacity to
    what the failure proves, so the next trial lands under it.

    Speed: every trial that fits also times ``timed_steps`` steps after the warm-up step (the
    device synchronised around each, the fastest counts; on CPU with the storage tracker set
    aside, which slows every operator, and with one intra-op thread by the thread's CPU time,
    which other processes cannot stretch: :mod:`batchpilot.find.timing`), and ``plan.time_fit``
    fits ``T(b) = fixed + per_sample × b`` to them. ``objective="throughput"`` then times a
    few smaller sizes (:class:`~batchpilot.policy.speed.ThroughputSearch`), times the sizes the choice
    rests on again side by side, and answers the smallest fitting batch whose samples/s is
    within ``speed_tolerance`` of the fastest measured; memory stays a hard limit.

    Args:
        step: runs one full step (forward, backward, optimizer step) at a batch size.
        device: the device whose memory is measured; default the current accelerator, else CPU.
        target: fraction of the capacity the peak may use, in (0, 1]; ``None``: ``options``'s
            (default 0.8, :class:`~batchpilot.find.options.FindOptions`).
        restore: modules, optimizers, LR schedulers, GradScalers or tensors to
            snapshot and restore bit for bit; their tensors also count as
            memory in use at the start of each trial.
        options: the finder's options (:class:`~batchpilot.find.options.FindOptions`); default
            every option at its default.
        lockstep: ranks that must run the same trials (FSDP2): the agreement hooks of
            :func:`batchpilot.dist.fsdp.find_batch_size_fsdp`, which passes them; leave it ``None``.
        **overrides: other options: the fields of :class:`~batchpilot.find.options.FindOptions`
            (``capacity``, ``strategy``, ``min_batch_size``, ``max_batch_size``,
            ``steps_per_trial``, ``first_guess``, ``max_trials``, ``progress``, ``tolerance``,
            ``snapshot``, ``objective``, ``speed_tolerance``, ``timed_steps``), each in place of
            ``options``'s value.

    Returns:
        A :class:`BatchPlan`.

    Raises:
        BatchSizeError: invalid options, or a keyword that is no option (the closest named),
            raised before any trial.
        NothingFitsError: even ``min_batch_size`` does not fit; the message gives
            its peak and the capacity.
        Exception: any non-OOM error of ``step`` propagates unchanged, after the
            state is restored.
    """
    if target is not None:
        overrides["target"] = target
    cfg = FindOptions.build(options, **overrides).resolved()
    if lockstep is not None and cfg.objective == "throughput":
        # its extra timings run on each rank alone: sharded ranks would wait in each other's collectives
        raise BatchSizeError("objective='throughput' is not available for ranks in lockstep (FSDP2); "
                             "use objective='memory' and let the engine split the batch by speed")
    dev = resolve_device(device)
    # before anything is measured: on a terminal its first line is written now
    shown = Progress(f"finding the batch size on {dev}", enabled=cfg.progress, logger=logger)
    targets = [o for o in restore if o is not None]
    emulated = cfg.capacity is not None and dev.type in EMULATED_DEVICES
    # called inside the caller's own emulate_capacity: measure against that emulation
    ambient = None if emulated else emulated_capacity(dev)
    gauge = gauge_for(dev, emulated_capacity=cfg.capacity if emulated else ambient)
    tol = cfg.tolerance if cfg.tolerance is not None else (0.0 if gauge.limit.tracked else _REAL_TOLERANCE)
    started = time.perf_counter()
    compiles = CompileCounter()
    compiled = is_compiled(*targets)
    # a tracker (an emulated CPU capacity) runs compiled code eagerly: batchpilot.core.compiled
    run_compiled = compiled and not gauge.limit.tracked
    # on a host the tensors are modelled from two tiny trials (a tracker cannot see inside compiled
    # code, and ranks in lockstep must not each follow a model of their own)
    modelled = gauge.host and not run_compiled and lockstep is None
    policy = make_policy(cfg.strategy, first_guess=cfg.first_guess, max_batch_size=cfg.max_batch_size,
                         tolerance=tol, modelled=modelled)
    if compiled and not run_compiled:
        logger.warning("the model is compiled, but under an emulated CPU capacity its trials run eagerly (a "
                       "dispatch-mode tracker cannot see inside compiled kernels): this is the eager program's "
                       "batch; leave capacity= out to measure the compiled program on real memory")
    held = contextlib.ExitStack()  # closed in the finally below, after the snapshot is freed
    if gauge.host:
        # before anything is measured: what a step needs must not depend on the sizes run before it
        # (a threshold the user fixed high comes back after the search)
        held.enter_context(malloc_threshold_held())
    try:
        free_memory(dev)
        spill = _spill(cfg.snapshot, gauge, targets)
        snap = StateSnapshot(targets, spill=spill)
    except BaseException:
        held.close()
        raise
    verified: list[Trial] = []
    try:
        with contextlib.ExitStack() as stack:
            if emulated:
                stack.enter_context(emulate_capacity(cfg.capacity, dev, track=targets))
            cap = cfg.capacity if cfg.capacity is not None else gauge.capacity()
            # on a host the margin is taken on what the job can still grow into, not on the
            # runtime, libraries and model already resident: see host_limit
            base = int(gauge.current()) if gauge.host else None
            # a compiled trial at 1 would compile a graph of its own: start at 2, try 1 only if 2 fails
            floor = compiled_floor(cfg.min_batch_size, cfg.max_batch_size) if run_compiled else cfg.min_batch_size
            space = SearchSpace(
                limit_bytes=_limit(cfg.target, cap, base), capacity_bytes=cap,
                min_batch_size=floor, max_batch_size=cfg.max_batch_size,
            )
            if lockstep is not None:
                space = lockstep.agree_space(space)  # one search for every rank: the smallest device
            header = "strategy {}, {} memory, limit {} ({}{})".format(
                policy.name, gauge.kind, format_bytes(space.limit_bytes),
                f"{100 * cfg.target:.0f}% of {format_bytes(cap)}" if base is None else
                f"{format_bytes(base)} in use + {100 * cfg.target:.0f}% of the {format_bytes(cap - base)} left",
                f", bound by {gauge.limit.binding}" if gauge.limit.binding else "")
            logger.info("finding the batch size on %s: %s", dev, header)
            shown.note(f"  {header}")
            if gauge.host:
                _warn_host_share(space, cfg, gauge.limit.binding)
            trial_fn = _TrialRunner(step, dev, gauge, cfg.steps_per_trial, targets, snap, lockstep,
                                    breakdown=not run_compiled, timed_steps=cfg.timed_steps, model=modelled,
                                    on_start=lambda b: shown.start(f"batch {b}"))

            def report(t: Trial) -> None:
                _log_trial(t, len(trial_fn.done), trial_fn.space)
                shown.done(trial_line(t, trial_fn.space.limit_bytes))

            trial_fn.space = space
            learner = _CapacityLearner(cfg.target, estimated=gauge.limit.estimated, base=base)
            revise = lambda sp, t: _trial_space(trial_fn, trial_fn.modelled(learner(sp, t) or sp, t))  # noqa: E731
            if run_compiled:
                warm_up(step, floor, device=dev, after=snap.restore)  # compile before anything is measured
            result = _search(policy, space, trial_fn, cfg.max_trials, report, revise)
            space = result.space or space
            if result.batch_size is None and result.stop_reason == "nothing_fits" and floor > cfg.min_batch_size:
                result = _below_floor(result, policy, space, cfg.min_batch_size, trial_fn, report, revise)
                space = result.space or space
            rounds = None
            if cfg.objective == "throughput" and result.batch_size is not None:
                rounds = search_throughput(result.trials, trial_fn, lowest=cfg.min_batch_size,
                                           highest=result.batch_size, tolerance=cfg.speed_tolerance,
                                           max_trials=cfg.max_trials, on_trial=report, retime=trial_fn.retime,
                                           settled=lambda v: _settled(v, cfg.speed_tolerance))
            answer, reason = _answer(result.trials, result.batch_size, result.stop_reason, cfg, rounds)
            largest, stop_reason = result.batch_size, result.stop_reason
            if answer is not None and lockstep is None:
                checked = _verify(answer, trial_fn, learner, report, floor=cfg.min_batch_size, tolerance=tol)
                verified, space = checked.trials, trial_fn.space
                if checked.batch_size != answer:
                    answer, largest, stop_reason = checked.batch_size, checked.batch_size, "verification"
                    reason = "the largest that ran again after the search's last OOM" if answer is not None else ""
    finally:
        snap.restore()
        snap.close()
        free_memory(dev)
        held.close()
    if answer is None:
        raise _nothing_fits(list(trial_fn.done), space, dev, "nothing_fits" if verified else result.stop_reason)
    line = _memory_line(result.trials, space.limit_bytes, base)
    tensor_line = _tensor_line(result.trials, space.tensors, answer) if gauge.host else None
    plan = BatchPlan(
        batch_size=answer, target=float(cfg.target), capacity=int(space.capacity_bytes),
        limit_bytes=space.limit_bytes, strategy=policy.name, device=str(dev), trials=list(trial_fn.done),
        fit=None if line is None else MemoryFit(fixed_bytes=line[0], bytes_per_sample=line[1]),
        seconds=time.perf_counter() - started, stop_reason=stop_reason,
        steps_per_trial=cfg.steps_per_trial, first_guess=cfg.first_guess, memory=gauge.kind,
        tensor_fit=tensor_line, binding_limit=gauge.limit.binding,
        snapshot_bytes=snap.nbytes, snapshot_seconds=snap.seconds, snapshot_on_disk=spill,
        compiled=compiled, compiled_trials=run_compiled, compilations=compiles.count,
        objective=cfg.objective, speed_tolerance=cfg.speed_tolerance, largest_fitting=largest,
        verified=bool(verified), base_bytes=base,
        time_fit=fit_time(timed_fits(result.trials)), reason=reason,
    )
    if result.stop_reason == "max_trials":
        logger.warning("stopped after %d trials before reaching the boundary; batch size %d may be low",
                       plan.num_trials, plan.batch_size)
    if plan.stop_reason == "plateau":
        logger.warning("batch size %d: %s", plan.batch_size, plan.reason)
    # the answer explained, once: what the integrations and the engine leave in a configured log
    logger.info("%s%s", plan.describe(), f"\n  {plan.compilations} graph(s) compiled" if compiled else "")
    shown.note(f"  batch size {plan.batch_size} after {plan.num_trials} trials, {plan.num_ooms} OOM, "
               f"{plan.seconds:.1f}s")
    return plan


def warm_up(step: Callable[[int], Any], batch_size: int, *, device: torch.device, after: Callable[[], Any]) -> int:
    """Run ``step(batch_size)`` once, unmeasured, so dynamo compiles before any trial is measured.

    Compiling takes host memory and time that no trial should be charged for. ``after`` puts the
    state back (the finder's snapshot restore); it runs also when the step runs out of memory,
    which is left for the trials to find. Other errors propagate. Returns the graphs compiled.
    """
    counter = CompileCounter()
    outcome = attempt(_user_step, step, batch_size, device=device, on_oom=after)
    if not outcome.oom:
        after()
    logger.info("warm-up at batch %d: %d graph(s) compiled", batch_size, counter.count)
    return counter.count


def _user_step(step: Callable[[int], Any], batch_size: int) -> None:
    """``step(batch_size)``; an error other than an OOM leaves with its type and a note naming the batch size."""
    try:
        step(batch_size)
    except Exception as exc:
        if not is_oom(exc):  # an OOM is the trial's answer, caught by attempt()
            note_trial_error(exc, batch_size=batch_size)
        raise


class _ProgramChanged(Exception):
    """A trial changed the program the search measures (oneDNN's kernels turned off after its OOM)."""

    def __init__(self, trial: Trial) -> None:
        super().__init__(f"the program changed at batch {trial.batch_size}")
        self.trial = trial


def _search(policy: SearchPolicy, space: SearchSpace, runner: _TrialRunner, max_trials: int,
            report: Callable[[Trial], None], revise: Callable) -> SearchResult:
    """:func:`run_search`, started over (within ``max_trials`` in all) when a trial changes the program."""
    earlier: list[Trial] = []
    while True:
        try:
            result = run_search(policy, space, runner, max_trials=max(1, max_trials - len(earlier)),
                                on_trial=report, revise=revise)
        except _ProgramChanged as changed:
            report(changed.trial)
            earlier = list(runner.done)  # counted against max_trials, not searched on
            space = dataclasses.replace(runner.space or space, tensors=None)
            runner.space = space
            logger.info("searching again from the start: the trials so far ran other kernels")
            continue
        return result  # the runner keeps every trial, ``earlier`` ones included, for the plan


def _below_floor(result: SearchResult, policy: SearchPolicy, space: SearchSpace, minimum: int,
                 trial_fn: _TrialRunner, report: Callable[[Trial], None], revise: Callable) -> SearchResult:
    """Nothing fitted from the compiled floor up: try ``minimum`` too (one more compilation)."""
    low = dataclasses.replace(space, min_batch_size=minimum, max_batch_size=minimum)
    trial_fn.space = low
    again = run_search(policy, low, trial_fn, max_trials=1, on_trial=report, revise=revise)
    return SearchResult(batch_size=again.batch_size, trials=[*result.trials, *again.trials],
                        stop_reason="boundary" if again.batch_size is not None else again.stop_reason,
                        space=again.space or low)


# -- speed: the hook of batchpilot.policy.speed into the search -------------------------------------------


def _answer(trials: list[Trial], largest: int | None, stop_reason: str, cfg: FindOptions,
            rounds: list[dict[int, float]] | None = None) -> tuple[int | None, str]:
    """The batch size the objective picks among the trials, and why.

    With ``rounds`` (the throughput search's side-by-side re-timings) the throughput objective
    takes a smaller batch only on evidence beyond their noise
    (:func:`~batchpilot.policy.evidence.decide_throughput`), else the largest that fits.
    """
    if largest is None:
        return None, ""
    memory = f"the largest that fits ({stop_reason})"
    if stop_reason == "plateau":
        top = max(t.batch_size for t in trials if t.fits)
        memory = (f"memory did not grow past {largest} (the same peak up to {top}, the largest tried): "
                  "set max_batch_size")
    if cfg.objective == "memory":
        return largest, memory
    decision = decide_throughput(rounds, cfg.speed_tolerance) if rounds else None
    if decision is not None and decision.largest == largest:
        return decision.batch_size, decision.reason
    choice = choose_fastest(timed_fits(trials, upto=largest), cfg.speed_tolerance)
    if choice is None:  # e.g. no step could be timed without a tracker in the way
        return largest, f"{memory}: no trial was timed"
    return choice.batch_size, choice.reason


def _settled(rounds: list[dict[int, float]], tolerance: float) -> bool:
    """Whether the throughput search's rounds so far decide its answer (more rounds while only the noise stands)."""
    decision = decide_throughput(rounds, tolerance)
    return decision is None or decision.settled


def _limit(target: float, capacity: int, base: int | None) -> int:
    """The most a trial may peak at: ``target`` of the capacity, or on a host of what is left above ``base``.

    On a device (and under an emulated capacity) the margin is a share of the whole memory, as
    PyTorch's memory fraction is. On a host the process already holds its runtime, libraries,
    model and data (``base``, hundreds of MB before any step); a margin on the whole would be
    taken mostly from what the step can grow into, so there it is a share of the headroom:
    ``base + target × (capacity - base)``.
    """
    if base is None or base >= capacity:
        return max(1, int(target * capacity)) if base is None else max(1, capacity)
    return max(1, base + int(target * (capacity - base)))


@dataclass(frozen=True)
class _Checked:
    """What :func:`_verify` settled on (``None``: nothing ran) and the trials it ran."""

    batch_size: int | None
    trials: list[Trial]


#: verification runs before the finder stops stepping down by the line and halves instead
_LINE_STEPS = 3


def _verify(answer: int, runner: _TrialRunner, learner: _CapacityLearner, report: Callable[[Trial], None], *,
            floor: int, tolerance: float) -> _Checked:
    """Run ``answer`` again in the state the search leaves, when the search left room for doubt.

    The answer must have run after the last thing that could change what it needs: an OOM
    (on real memory it can leave allocator caches, JIT code and fragmented heap behind, and a
    caching allocator's freed blocks) after the answer's last run, or an answer whose peak came
    within ``tolerance`` of the capacity. Such an answer is run again, after the restore; if it
    no longer fits the finder steps down -- along the memory line, by at least the shortfall
    the failure shows -- and runs that size, until one fits.
    """
    trials = list(runner.done)
    if runner.gauge.limit.tracked or not _doubtful(answer, trials, runner.space, tolerance):
        return _Checked(answer, [])
    free_memory(runner.device)  # a caching allocator's blocks go back first: the state training starts from
    done: list[Trial] = []
    b: int | None = answer
    tried: set[int] = set()
    while b is not None:
        tried.add(b)
        t = runner(b)
        report(t)
        done.append(t)
        revised = learner(runner.space, t)
        if revised is not None:
            runner.space = revised
        if t.outcome == OOM or (t.measured and t.peak_bytes > runner.space.limit_bytes):
            if t.measured:
                t.outcome = OVER_TARGET
            b = _step_down(b, [*trials, *done], runner.space, tolerance, floor, tried, len(done))
            continue
        logger.info("batch %d ran again after the search%s", b, "" if b == answer else f" (not {answer})")
        return _Checked(b, done)
    return _Checked(None, done)


def _doubtful(answer: int, trials: list[Trial], space: SearchSpace, tolerance: float) -> bool:
    """True when ``answer`` has not run since the last OOM, or ran within ``tolerance`` of the capacity."""
    last_run = max((i for i, t in enumerate(trials) if t.batch_size == answer and t.measured), default=-1)
    last_oom = max((i for i, t in enumerate(trials) if t.outcome == OOM), default=-1)
    if last_oom > last_run:
        return True
    if last_run < 0:
        return True
    t = trials[last_run]
    room = space.capacity_bytes - (t.start_bytes or 0)
    margin = max(1, int(tolerance * room), max((_left_behind(x) for x in trials), default=0))
    return t.peak_bytes >= space.capacity_bytes - margin


def _step_down(b: int, trials: list[Trial], space: SearchSpace, tolerance: float, floor: int,
               tried: set[int], attempts: int) -> int | None:
    """The next size to verify below ``b``, which no longer fits: by the bytes per sample near it.

    The last run of ``b`` shows what it needs now (its peak, or more than the capacity after an
    OOM); the search's trials give the bytes one sample adds there. The step lands ``b``'s need
    a tolerance under the limit. After ``_LINE_STEPS`` failed steps the size halves instead.
    """
    if b <= floor:
        return None
    last = [t for t in trials if t.batch_size == b][-1]
    room = space.capacity_bytes - (last.start_bytes or 0)
    margin = max(tolerance * room, max((_left_behind(t) for t in trials), default=0))
    # an OOM needed more than the capacity, and what it left behind is no longer free either
    need = last.peak_bytes if last.measured else max(space.capacity_bytes, last.peak_bytes or 0) + _left_behind(last)
    searched = [t for t in trials if t.measured and t.batch_size != b]
    line = fit_line(searched, space.limit_bytes)
    guess = b - max(1, int(b * max(tolerance, 0.01)))
    if attempts <= _LINE_STEPS and line is not None and line[1] > 0:
        excess = need - (space.limit_bytes - margin / 2)
        guess = min(guess, b - max(1, math.ceil(excess / line[1])))
    elif attempts > _LINE_STEPS:
        guess = min(guess, b // 2)
    guess = max(floor, guess)
    while guess in tried and guess > floor:
        guess -= 1
    return None if guess in tried else guess


#: a trial whose first step's tensor peak is this far off the model's drops the model
_MODEL_ERROR = 0.02
#: predict's relative tolerance on real memory (see ``tolerance``)
_REAL_TOLERANCE = 0.02
#: a snapshot this share of the headroom or more goes to disk on a real CPU (``snapshot="auto"``)
_SPILL_SHARE = 0.05
#: trials predicted within this share of a limit that kills are refused
_KILL_MARGIN = 0.02


def _spill(choice: str, gauge: Gauge, targets: list[Any]) -> bool:
    if choice != "auto":
        return choice == "disk"
    if not gauge.limit.spills:
        return False  # a file would not leave the figure more room (Limit.spills)
    # the share of what the job may still grow into, not of the whole process
    return StateSnapshot.objects_nbytes(targets) >= _SPILL_SHARE * max(1, gauge.capacity() - gauge.current())


class _CapacityLearner:
    """Correct the capacity from what each trial proves.

    An OOM whose allocator said how much it asked for proves the real capacity is below the
    peak reached plus that request (``Trial.bound_bytes``). On a real CPU, where the capacity is
    an estimate (the headroom under ``RLIMIT_AS`` counts mapped address space, some of which
    becomes resident without a new mapping), a trial that completed with a peak above it proves
    the capacity is at least that peak. The limit follows as ``target × capacity``.
    """

    def __init__(self, target: float, estimated: bool, base: int | None = None) -> None:
        self.target, self.estimated, self.base = target, estimated, base
        self.below: int | None = None  # the lowest OOM bound: the capacity is under it

    def __call__(self, space: SearchSpace, trial: Trial) -> SearchSpace | None:
        cap = space.capacity_bytes
        if trial.outcome == OOM and trial.bound_bytes is not None:
            self.below = trial.bound_bytes if self.below is None else min(self.below, trial.bound_bytes)
            if self.below <= cap:
                new = self.below - 1
                logger.info("the OOM at batch %d shows the capacity is under %s, not %s", trial.batch_size,
                            format_bytes(self.below), format_bytes(cap))
                return self._space(space, new)
        elif self.estimated and trial.measured and trial.peak_bytes > cap:
            new = trial.peak_bytes if self.below is None else min(trial.peak_bytes, self.below - 1)
            if new > cap:
                logger.info("batch %d ran to %s without running out: the capacity is at least that, not %s",
                            trial.batch_size, format_bytes(new), format_bytes(cap))
                return self._space(space, new)
        return None

    def _space(self, space: SearchSpace, capacity: int) -> SearchSpace:
        return dataclasses.replace(space, capacity_bytes=capacity, limit_bytes=_limit(self.target, capacity, self.base))


def _memory_line(trials: list[Trial], limit: int, base: int | None) -> tuple[float, float] | None:
    """``plan.fit``: the line near the boundary through peaks measured from one baseline; ``None`` if not rising.

    On a host each trial starts a little higher than the last (what trials leave behind: JIT
    code per shape), so its peak is taken from the search's baseline. A line whose per-sample
    slope is not positive (real memory noisier than the samples between two trials) is no model
    of the memory; the plan then has none, and what sizes by it (the engine's ``start=plan``, the
    Accelerate drop-in's retry) measures instead.
    """
    if base is not None:
        trials = [dataclasses.replace(t, peak_bytes=t.peak_bytes - max(0, t.start_bytes - base))
                  if t.measured and t.start_bytes is not None else t for t in trials]
    line = fit_line(trials, limit)
    if line is not None and line[1] <= 0:
        logger.info("the measured peaks do not rise with the batch size near the boundary: no memory line")
        return None
    return line


def _tensor_line(trials: list[Trial], model: TensorModel | None = None, answer: int | None = None) -> MemoryFit | None:
    """``plan.tensor_fit``: the tensor model's line at the answer (exact, both steps), else the measured tensor peaks'.

    Trials after the model's two run their large size untracked (:meth:`_TrialRunner._warm_size`),
    so the model, not their tensor bytes, says what the tensors take near the answer.
    """
    if model is not None and answer is not None:
        fixed, per_sample = max(model.lines, key=lambda line: line[0] + line[1] * answer)
        return MemoryFit(fixed_bytes=fixed, bytes_per_sample=per_sample)
    pts = [t for t in trials if t.measured and t.tensor_bytes is not None]
    proxies = [Trial(batch_size=t.batch_size, outcome=t.outcome, peak_bytes=t.tensor_bytes) for t in pts]
    line = fit_line(proxies)
    return None if line is None else MemoryFit(fixed_bytes=line[0], bytes_per_sample=line[1])


def _trial_space(runner: _TrialRunner, space: SearchSpace | None) -> SearchSpace | None:
    if space is not None:
        runner.space = space  # later trials are judged, and refused, against the revised space
    return space


class _TrialRunner:
    """Runs one trial: the steps under the gauge (and a tracker for the breakdown), OOM recovery, the restore."""

    def __init__(self, step: Callable[[int], Any], device: torch.device, gauge: Gauge,
                 steps: int, targets: list[Any], snapshot: StateSnapshot, lockstep: Any = None, *,
                 breakdown: bool = True, timed_steps: int = 0, model: bool = False,
                 on_start: Callable[[int], None] | None = None) -> None:
        self.step, self.device, self.gauge, self.steps = step, device, gauge, steps
        self.on_start = on_start  # told each batch size as its trial starts (the progress display)
        # no breakdown tracker for a compiled step: under it the step would run eagerly
        self.breakdown = breakdown
        self.targets, self.snapshot, self.lockstep = targets, snapshot, lockstep
        self.timed_steps = timed_steps
        self.space: SearchSpace | None = None
        self.done: list[Trial] = []
        self._untimed_warned = False
        # the tensor model (host memory): the timelines of the first two sizes that ran, per step
        self._model = model and breakdown
        self._timelines: dict[int, tuple[list[int], list[int]]] = {}
        self._first_step: TensorModel | None = None
        # per recorded size: the tensor bytes one step hands the next (host data views aside)
        self._carried: dict[int, int] = {}

    def modelled(self, space: SearchSpace, trial: Trial) -> SearchSpace:
        """``space`` with the tensor model once two small trials gave one; without it once a trial contradicts it."""
        if not self._model:
            return space
        if space.tensors is None and len(self._timelines) >= 2:
            (b1, (f1, s1)), (b2, (f2, s2)) = list(self._timelines.items())[:2]
            first, steady = TensorModel.from_timelines(b1, f1, b2, f2), TensorModel.from_timelines(b1, s1, b2, s2)
            self._model = False  # built once, or never
            if first is None or steady is None:
                logger.info("the step allocates differently at batch %d and %d: searching on real peaks alone",
                            b1, b2)
                return space
            self._model, self._first_step = True, first
            model = TensorModel.union(first, steady)
            logger.info("tensor model from batch %d and %d: %s at batch %d", b1, b2, format_bytes(model(b2)), b2)
            return dataclasses.replace(space, tensors=model)
        if space.tensors is not None and trial.tensor_bytes is not None and self._first_step is not None:
            expected = self._first_step(trial.batch_size)
            if abs(trial.tensor_bytes - expected) > _MODEL_ERROR * max(expected, 1):
                logger.info("batch %d held %s of tensors where the model said %s: searching on real peaks alone",
                            trial.batch_size, format_bytes(trial.tensor_bytes), format_bytes(expected))
                self._model = False
                return dataclasses.replace(space, tensors=None)
        return space

    def __call__(self, batch_size: int) -> Trial:
        onednn = torch.backends.mkldnn.enabled
        trial = self._agreed(batch_size)
        if trial.outcome == OOM and batch_size == self.space.min_batch_size and onednn == torch.backends.mkldnn.enabled \
                and not any(t.outcome in (FIT, OVER_TARGET) for t in self.done):
            # the search would end here ("nothing fits"): an OOM at the smallest size is confirmed
            # first, so that one passing failure (memory another process held a moment, a rank's
            # fragmented cache) does not stop a job that fits. A real shortage fails again.
            logger.warning("batch size %d ran out of memory%s; running it once more before concluding that "
                           "nothing fits", batch_size, "" if trial.rank is None else f" on rank {trial.rank}")
            trial = self._agreed(batch_size)
        self.done.append(trial)
        if onednn and not torch.backends.mkldnn.enabled:
            # oneDNN ran out of memory and was turned off (memory.oom.recover_onednn): from now on
            # other kernels run, with memory of their own, and nothing measured so far holds
            self._model, self._timelines, self._first_step, self._carried = self.breakdown, {}, None, {}
            raise _ProgramChanged(trial)
        return trial

    def _agreed(self, batch_size: int) -> Trial:
        trial = self._run(batch_size)
        if self.lockstep is not None:
            # the same trial on every rank, then one view of it everywhere: the same next size
            trial = self.lockstep.agree_trial(trial, self.space)
        return trial

    def _run(self, batch_size: int) -> Trial:
        refused = self._refuse(batch_size)
        if self.lockstep is not None and self.lockstep.agree_refusal(refused is not None) and refused is None:
            refused = Trial(batch_size=batch_size, outcome=REFUSED, peak_bytes=0, start_bytes=None)
        if refused is not None:
            return refused
        if self.on_start is not None:
            self.on_start(batch_size)
        holder: list[Any] = []
        real = self.gauge.host
        # on CPU a storage tracker counts every operator from Python during the memory steps:
        # their times say nothing about the step, so the timed steps come after, without it
        tracked = self.device.type == "cpu" and self.breakdown
        times: list[float] = []
        read = step_clock(self.device)

        def one_step() -> None:
            _user_step(self.step, batch_size)

        record = self._model and len(self._timelines) < 2 and batch_size not in self._timelines

        def run() -> None:
            if real and tracked:
                self._host_steps(batch_size, one_step, holder, times, read, record)
                return
            with track_peak(self.device, track=self.targets) if tracked else contextlib.nullcontext() as m:
                holder.append(m)
                for i in range(self.steps):
                    if i == self.steps - 1:
                        holder.append(self._steady_bytes())
                    if i == 0 or tracked:  # the first step warms up (kernels, optimizer state)
                        one_step()
                    else:
                        times.append(timed(one_step, self.gauge.synchronize, read))
            self._time_steps(times, one_step, tracked, read)

        if real:
            # the last trial's garbage back to the OS: the resident peak then starts clean
            free_memory(self.device, generation=1)
        began = time.perf_counter()
        retries = self.gauge.alloc_retries()
        if self.gauge.limit.tracked:
            active_tracker(self.device).forget_host_views()  # each trial pays for its own slice of host data
        self.gauge.reset()
        # real memory keeps part of a step's memory resident (allocator caches) into the next,
        # so what is in use before the first step is the floor; the tracker's is exact per step
        base = None if self.gauge.limit.tracked else int(self.gauge.current())
        peaks: list[int] = []

        def put_back(oom: bool = True) -> None:
            # the peak first: the restore allocates too. On a real CPU the trial's freed heap goes
            # back to the OS before the restore maps its copies (under RLIMIT_AS that mapping
            # counts, and right after a trial at the boundary there is no room for it otherwise)
            self.gauge.synchronize()
            peaks.append(int(self.gauge.peak()))
            self.gauge.close()
            if oom and self.lockstep is not None:
                self.lockstep.recover(batch_size)  # the collectives the other ranks still wait in
            if real:
                free_memory(self.device, generation=1)
            self.snapshot.restore()

        if self.lockstep is not None:
            self.lockstep.begin()
        # the restore runs after the OOM's traceback is gone, before memory is released
        # not an OOM: the step's own error leaves with its type and _user_step's note (the search restores)
        with _gc_paused(self.gauge.limit.tracked):
            outcome = attempt(run, device=self.device, on_oom=put_back)
        if not outcome.oom:
            put_back(oom=False)
        end = None if base is None else int(self.gauge.current())
        peak = peaks[0]
        seconds = time.perf_counter() - began
        m = holder[0] if holder else None
        start = holder[1] if len(holder) > 1 else None
        if base is not None:
            start = base
        tensor_bytes = int(m.peak_bytes) if real and m is not None else None
        if outcome.oom:
            kind = OOM
            bound = self.gauge.limit.oom_bound(outcome)
            peak_bytes = bound if bound is not None else peak
        else:
            kind = FIT if peak <= self.space.limit_bytes else OVER_TARGET
            bound = None
            peak_bytes = peak
        after = self.gauge.alloc_retries()
        trial = Trial(batch_size=batch_size, outcome=kind, peak_bytes=int(peak_bytes), start_bytes=start,
                      seconds=seconds, message=outcome.message if outcome.oom else None, tensor_bytes=tensor_bytes,
                      bound_bytes=bound, step_seconds=min(times) if kind == FIT and times else None,
                      alloc_retries=None if retries is None or after is None else after - retries, end_bytes=end)
        return trial

    def _host_steps(self, batch_size: int, one_step: Callable[[], None], holder: list[Any], times: list[float],
                    read: Callable[[], float], record: bool) -> None:
        """A trial's steps on a host: the first under a tracker (its tensor peak, the model's check),
        the rest as they run in training, timed; the first two sizes record both steps' timelines.
        Once those two show a step's state does not grow with the batch, a trial's first step runs
        at the smaller of them, untracked (:meth:`_warm_size`)."""
        warm = None if record else self._warm_size(batch_size)
        if warm is not None:
            # untracked: the peak is the kernel's figure, and the steps at batch_size are timed
            holder.extend([None, self._steady_bytes()])
            if self.steps == 1:
                one_step()  # a trial of one step: its first, as a tracked one would run it
            else:
                _user_step(self.step, warm)
                for _ in range(self.steps - 1):
                    times.append(timed(one_step, self.gauge.synchronize, read))
            self._time_steps(times, one_step, False, read)
            return
        lines: list[list[int]] = []
        with track_peak(self.device, track=self.targets) as m:
            tracker = active_tracker(self.device)
            holder.append(m)
            for i in range(self.steps if record else 1):
                if record and i == self.steps - 1:
                    self._carried[batch_size] = tracker.live - tracker.host_view_bytes
                with tracker.recording() as timeline:
                    one_step()
                lines.append(timeline)
                if i == 0:
                    first_peak = m.peak_bytes
        m.peak_bytes = first_peak  # the first step's: what the model's check compares
        holder.append(self._steady_bytes())
        for _ in range(len(lines), self.steps):
            times.append(timed(one_step, self.gauge.synchronize, read))
        if record and lines:
            self._timelines[batch_size] = (lines[0], lines[-1])
        self._time_steps(times, one_step, False, read)

    def _warm_size(self, batch_size: int) -> int | None:
        """A size already run whose one step leaves the state a step at ``batch_size`` starts from; or ``None``.

        A trial's first step creates what a step creates once (an optimizer's moments, lazily
        built buffers); its later steps show the steady state that training runs in, and the
        peak that matters. When the two recorded sizes carried the same tensor bytes from one
        step into the next (nothing that grows with the batch outlives a step) and their
        timelines aligned (the same program at both), one step at the smaller leaves that state
        as a step at ``batch_size`` would: the trial's later steps then run at ``batch_size``
        after it, one large step fewer per trial -- most of a search's cost on a host. A trial of
        one step (``steps_per_trial=1``: a forward-only scorer) has nothing to warm and no later
        step for a kept tensor to weigh on: after the two recorded sizes it runs untracked, its
        peak its first step's either way (the tracker's dispatch of every operator from Python
        was most of such a trial's cost).
        """
        if self.steps == 1:
            return min(self._timelines) if len(self._timelines) >= 2 else None
        if self._first_step is None or not self._model or len(self._carried) < 2:
            return None
        if len(set(self._carried.values())) != 1:
            return None  # a step keeps something that grows with the batch: only steps at this size show it
        return min(self._carried)

    def retime(self, batch_size: int) -> float | None:
        """A warm-up step and ``timed_steps`` timed ones at a size that fitted; the fastest, or ``None``.

        For comparing sizes side by side (the throughput objective); memory is not measured
        again. The state is put back after, as after a trial.
        """
        tracked = self.device.type == "cpu"
        read = step_clock(self.device)
        times: list[float] = []

        def one_step() -> None:
            _user_step(self.step, batch_size)

        def run() -> None:
            with outside_trackers() if tracked else contextlib.nullcontext(True) as clear:
                if clear:
                    one_step()
                    times.extend(timed(one_step, self.gauge.synchronize, read) for _ in range(self.timed_steps))

        outcome = attempt(run, device=self.device, on_oom=self.snapshot.restore)
        if not outcome.oom:
            self.snapshot.restore()
        return None if outcome.oom or not times else min(times)

    def _time_steps(self, times: list[float], one_step: Callable[[], None], tracked: bool,
                    read: Callable[[], float]) -> None:
        """Time steps until ``timed_steps`` are, if the memory steps fitted (an over-target size is never chosen)."""
        missing = self.timed_steps - len(times)
        if missing <= 0 or self.lockstep is not None:  # ranks in lockstep: only steps every rank runs
            return
        self.gauge.synchronize()
        if self.gauge.peak() > self.space.limit_bytes:
            return
        with outside_trackers() if tracked else contextlib.nullcontext(True) as clear:
            if not clear:
                if not self._untimed_warned:
                    self._untimed_warned = True
                    logger.warning("trials are not timed: a dispatch mode other than batchpilot's tracker is "
                                   "running, and timing under it would measure the mode, not the step")
                return
            for _ in range(missing):
                times.append(timed(one_step, self.gauge.synchronize, read))

    def _refuse(self, batch_size: int) -> Trial | None:
        """A trial predicted over a limit past which the process is killed is not run."""
        if not self.gauge.kills:
            return None
        predicted = predict_peak(self.done, batch_size)
        if predicted is None:
            return None
        hard = int(self.space.capacity_bytes * (1 - _KILL_MARGIN))
        if predicted <= hard:
            return None
        logger.info("batch %d not run: its predicted peak %s is over the %s limit %s, past which the "
                    "process is killed", batch_size, format_bytes(predicted), self.gauge.limits.binding,
                    format_bytes(hard))
        return Trial(batch_size=batch_size, outcome=REFUSED, peak_bytes=int(predicted), start_bytes=None)

    def _steady_bytes(self) -> int:
        """Bytes in use as the last step starts, less gradients (a step may free them before its peak)."""
        self.gauge.synchronize()
        grads: dict[int, int] = {}
        for obj in self.targets:
            if isinstance(obj, nn.Module):
                for p in obj.parameters():
                    g = p.grad
                    if g is not None and g.device == self.device:
                        st = g.untyped_storage()
                        grads[id(st)] = st.nbytes()
        return max(0, int(self.gauge.current()) - sum(grads.values()))


@contextlib.contextmanager
def _gc_paused(pause: bool) -> Iterator[None]:
    """No automatic garbage collection during a trial counted tensor by tensor (``pause``), after one young one.

    Whether a reference cycle's tensors were freed in the middle of a step or after it depended on
    the collector's counters, which earlier work moves: the same trial then peaked higher or lower
    by that cycle, and a fit over lengths magnifies such a difference (docs/internals.md). With the
    collector paused the cycle counts until the trial ends,
    as when a step's garbage outlives it: the same trial, the same peak.
    """
    if not pause or not gc.isenabled():
        yield
        return
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


#: a search whose limit is over this share of the machine's RAM says so before its first trial
_MOST_OF_RAM = 0.5
_host_share_warned = False


def _warn_host_share(space: SearchSpace, cfg: FindOptions, binding: str) -> None:
    """Before a search on the host's real memory that may take most of the machine's RAM (and no max_batch_size): say so, and how to stop lower.

    A warning the first time in a process (a user who did not configure logging sees it), INFO after.
    """
    global _host_share_warned
    ram = physical_bytes()
    if not ram or cfg.max_batch_size is not None or space.limit_bytes < _MOST_OF_RAM * ram:
        return
    level = logging.INFO if _host_share_warned else logging.WARNING
    _host_share_warned = True
    logger.log(level, "this search measures the host's real memory: its trials may grow the process to %s, %.0f%% "
               "of the %s of RAM (limit: %.0f%% of what the %s limit leaves); pass max_batch_size= to stop lower, "
               "target= for a smaller share, or capacity= to size for a smaller device",
               format_bytes(space.limit_bytes), 100 * space.limit_bytes / ram, format_bytes(ram),
               100 * cfg.target, binding)


def _log_trial(t: Trial, index: int, space: SearchSpace) -> None:
    peak = "unknown" if t.peak_bytes is None else format_bytes(t.peak_bytes)
    if t.outcome == OOM:
        peak = f"OOM (at least {peak})" if t.peak_bytes is not None else "OOM"
    logger.info("trial %d: batch %d -> %s, peak %s, limit %s, %.2fs",
                index, t.batch_size, t.outcome, peak, format_bytes(space.limit_bytes), t.seconds)


def _nothing_fits(trials: list[Trial], space: SearchSpace, device: torch.device, reason: str) -> NothingFitsError:
    smallest = min(trials, key=lambda t: t.batch_size) if trials else None
    if smallest is None or reason == "max_trials":
        msg = f"no batch size fitted in {len(trials)} trials on {device}; raise max_trials"
        return NothingFitsError(msg, batch_size=space.min_batch_size, peak_bytes=None,
                                limit_bytes=space.limit_bytes, capacity_bytes=space.capacity_bytes)
    if smallest.outcome == OOM:
        seen = "" if smallest.peak_bytes is None else f" (with {format_bytes(smallest.peak_bytes)} already allocated)"
        where = "" if smallest.rank is None else f" on rank {smallest.rank}"
        what = f"ran out of memory{where}{seen}"
    else:
        what = f"peaked at {format_bytes(smallest.peak_bytes)} ({smallest.peak_bytes} bytes)"
    msg = (
        f"nothing fits on {device}: batch size {smallest.batch_size} {what}, over the limit "
        f"{format_bytes(space.limit_bytes)} = {space.limit_bytes / space.capacity_bytes:.0%} of the capacity "
        f"{format_bytes(space.capacity_bytes)} ({space.capacity_bytes} bytes); use a smaller model, "
        "mixed precision or activation checkpointing, a larger target, or a device with more memory"
    )
    return NothingFitsError(msg, batch_size=smallest.batch_size, peak_bytes=smallest.peak_bytes,
                            limit_bytes=space.limit_bytes, capacity_bytes=space.capacity_bytes)
