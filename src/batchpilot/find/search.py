"""One search of the finder as an object: :class:`Search` owns its state and runs its phases.

:func:`~batchpilot.find.finder.find_batch_size` resolves the options, runs a :class:`Search` and
returns its plan. A search's trials run in a :class:`~batchpilot.find.trials.TrialRunner`; which
sizes it tries, when it stops and where a failed verification steps down to are the policies of
:mod:`batchpilot.policy.search`; the capacity each trial proves is the :class:`CapacityLearner`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .._progress import Progress
from ..core.compiled import CompileCounter, compiled_floor, is_compiled
from ..memory.gauge import Gauge, gauge_for
from ..memory.host import malloc_threshold_held, physical_bytes
from ..memory.oom import free_memory
from ..memory.probes import EMULATED_DEVICES, emulate_capacity, emulated_capacity
from ..memory.units import format_bytes, resolve_device
from ..policy.search import (
    OOM,
    OVER_TARGET,
    BatchSizeError,
    NothingFitsError,
    SearchResult,
    SearchSpace,
    TensorModel,
    Trial,
    doubtful,
    fit_line,
    make_policy,
    run_search,
    step_down,
)
from ..policy.evidence import decide_throughput
from ..policy.speed import choose_fastest, fit_time, search_throughput, timed_fits
from .options import FindOptions
from .result import BatchPlan, MemoryFit, trial_line
from .snapshot import StateSnapshot
from .trials import ProgramChanged, TrialRunner, warm_up

__all__ = ["CapacityLearner", "Checked", "Found", "Search", "limit_for", "memory_line"]

# the finder's logger, for every line of a search: the name users configure (docs/find.md)
logger = logging.getLogger(__package__ + ".finder")

#: predict's relative tolerance on real memory (see ``tolerance``)
_REAL_TOLERANCE = 0.02
#: a snapshot this share of the headroom or more goes to disk on a real CPU (``snapshot="auto"``)
_SPILL_SHARE = 0.05


class Search:
    """One search of the finder, from its first trial to the answer run again, with the state put back.

    Its state is what a search owns: the options, the gauge (the memory that fails and its limit),
    the search space (limit, capacity, bounds: revised by what each trial proves, and the one the
    trial runner judges by), the trial runner, the capacity learner and the snapshot of the
    state. Its methods are the phases of a search: :meth:`search` (the policy's trials),
    :meth:`below_floor` (a compiled step that fitted nowhere from its floor up, tried at the
    minimum), :meth:`verify` (the answer run again in the state the search leaves) and :meth:`run`,
    which runs them in order and answers a :class:`~batchpilot.find.result.BatchPlan`.
    """

    def __init__(self, step: Callable[[int], Any], cfg: FindOptions, *, device: torch.device | str | int | None = None,
                 restore: Iterable[Any] = (), lockstep: Any = None) -> None:
        if lockstep is not None and cfg.objective == "throughput":
            # its extra timings run on each rank alone: sharded ranks would wait in each other's collectives
            raise BatchSizeError("objective='throughput' is not available for ranks in lockstep (FSDP2); "
                                 "use objective='memory' and let the engine split the batch by speed")
        self.step, self.cfg, self.lockstep = step, cfg, lockstep
        self.device = resolve_device(device)
        # before anything is measured: on a terminal its first line is written now
        self.progress = Progress(f"finding the batch size on {self.device}", enabled=cfg.progress, logger=logger)
        self.targets = [o for o in restore if o is not None]
        self.emulating = cfg.capacity is not None and self.device.type in EMULATED_DEVICES
        # called inside the caller's own emulate_capacity: measure against that emulation
        ambient = None if self.emulating else emulated_capacity(self.device)
        self.gauge = gauge_for(self.device, emulated_capacity=cfg.capacity if self.emulating else ambient)
        self.tolerance = cfg.tolerance if cfg.tolerance is not None else (
            0.0 if self.gauge.limit.tracked else _REAL_TOLERANCE)
        self.started = time.perf_counter()
        self.compiles = CompileCounter()
        self.compiled = is_compiled(*self.targets)
        # a tracker (an emulated CPU capacity) runs compiled code eagerly: batchpilot.core.compiled
        self.run_compiled = self.compiled and not self.gauge.limit.tracked
        # on a host the tensors are modelled from two tiny trials (a tracker cannot see inside compiled
        # code, and ranks in lockstep must not each follow a model of their own)
        self.modelled = self.gauge.host and not self.run_compiled and lockstep is None
        self.policy = make_policy(cfg.strategy, first_guess=cfg.first_guess, max_batch_size=cfg.max_batch_size,
                                  tolerance=self.tolerance, modelled=self.modelled)
        if self.compiled and not self.run_compiled:
            logger.warning("the model is compiled, but under an emulated CPU capacity its trials run eagerly (a "
                           "dispatch-mode tracker cannot see inside compiled kernels): this is the eager program's "
                           "batch; leave capacity= out to measure the compiled program on real memory")
        # a compiled trial at 1 would compile a graph of its own: start at 2, try 1 only if 2 fails
        self.floor = compiled_floor(cfg.min_batch_size, cfg.max_batch_size) if self.run_compiled \
            else cfg.min_batch_size
        self.base: int | None = None  # on a host, what the process holds before the first trial
        self.space: SearchSpace | None = None
        self.runner: TrialRunner | None = None
        self.learner: CapacityLearner | None = None
        self.snapshot: StateSnapshot | None = None
        self.spill = False
        self.verified: list[Trial] = []  # the trials of verify()

    def run(self) -> BatchPlan:
        """Search, verify, answer; the state is put back (also on error) before the plan is built."""
        held = self._hold()
        try:
            with contextlib.ExitStack() as stack:
                if self.emulating:
                    stack.enter_context(emulate_capacity(self.cfg.capacity, self.device, track=self.targets))
                self._prepare()
                found = self._find()
        finally:
            self.snapshot.restore()
            self.snapshot.close()
            free_memory(self.device)
            held.close()
        return self._plan(found)

    def _hold(self) -> contextlib.ExitStack:
        """Hold glibc's threshold on a host and take the snapshot; what :meth:`run` closes after the snapshot."""
        held = contextlib.ExitStack()  # closed after the snapshot is freed
        if self.gauge.host:
            # before anything is measured: what a step needs must not depend on the sizes run before it
            # (a threshold the user fixed high comes back after the search)
            held.enter_context(malloc_threshold_held())
        try:
            free_memory(self.device)
            self.spill = _spill(self.cfg.snapshot, self.gauge, self.targets)
            self.snapshot = StateSnapshot(self.targets, spill=self.spill)
        except BaseException:
            held.close()
            raise
        return held

    def _prepare(self) -> None:
        """The first space (limit from the capacity), the runner and the learner; a compiled step compiled."""
        cfg, gauge = self.cfg, self.gauge
        cap = cfg.capacity if cfg.capacity is not None else gauge.capacity()
        # on a host the margin is taken on what the job can still grow into, not on the
        # runtime, libraries and model already resident: see host_limit
        self.base = int(gauge.current()) if gauge.host else None
        space = SearchSpace(limit_bytes=limit_for(cfg.target, cap, self.base), capacity_bytes=cap,
                            min_batch_size=self.floor, max_batch_size=cfg.max_batch_size)
        if self.lockstep is not None:
            space = self.lockstep.agree_space(space)  # one search for every rank: the smallest device
        self._announce(space, cap)
        progress = self.progress  # not self: a runner that referred back to its search would keep the
        # snapshot's copies alive in a reference cycle after the search, until a collection
        self.runner = TrialRunner(self.step, self.device, gauge, cfg.steps_per_trial, self.targets, self.snapshot,
                                  self.lockstep, breakdown=not self.run_compiled, timed_steps=cfg.timed_steps,
                                  model=self.modelled, on_start=lambda b: progress.start(f"batch {b}"))
        self._use(space)
        self.learner = CapacityLearner(cfg.target, estimated=gauge.limit.estimated, base=self.base)
        if self.run_compiled:
            warm_up(self.step, self.floor, device=self.device, after=self.snapshot.restore)  # compile before measuring

    def _announce(self, space: SearchSpace, cap: int) -> None:
        """The search's header: strategy, memory, limit and what binds it (log and progress)."""
        base, target = self.base, self.cfg.target
        header = "strategy {}, {} memory, limit {} ({}{})".format(
            self.policy.name, self.gauge.kind, format_bytes(space.limit_bytes),
            f"{100 * target:.0f}% of {format_bytes(cap)}" if base is None else
            f"{format_bytes(base)} in use + {100 * target:.0f}% of the {format_bytes(cap - base)} left",
            f", bound by {self.gauge.limit.binding}" if self.gauge.limit.binding else "")
        logger.info("finding the batch size on %s: %s", self.device, header)
        self.progress.note(f"  {header}")
        if self.gauge.host:
            _warn_host_share(space, self.cfg, self.gauge.limit.binding)

    def _use(self, space: SearchSpace) -> None:
        """``space`` from now on: the search's, and the one its runner judges (and refuses) trials by."""
        self.space = space
        self.runner.space = space

    def _report(self, t: Trial) -> None:
        _log_trial(t, len(self.runner.done), self.space)
        self.progress.done(trial_line(t, self.space.limit_bytes))

    def _revise(self, space: SearchSpace, trial: Trial) -> SearchSpace:
        """After each trial: the capacity it proves, then the tensor model it builds or refutes."""
        revised = self.runner.modelled(self.learner(space, trial) or space, trial)
        self._use(revised)  # later trials are judged, and refused, against the revised space
        return revised

    def _find(self) -> Found:
        """The search, below the floor if nothing fitted, the objective's choice, and its verification."""
        cfg = self.cfg
        result = self.search()
        if result.batch_size is None and result.stop_reason == "nothing_fits" and self.floor > cfg.min_batch_size:
            result = self.below_floor(result)
        rounds = None
        if cfg.objective == "throughput" and result.batch_size is not None:
            rounds = search_throughput(result.trials, self.runner, lowest=cfg.min_batch_size,
                                       highest=result.batch_size, tolerance=cfg.speed_tolerance,
                                       max_trials=cfg.max_trials, on_trial=self._report, retime=self.runner.retime,
                                       settled=lambda v: _settled(v, cfg.speed_tolerance))
        answer, reason = _answer(result.trials, result.batch_size, result.stop_reason, cfg, rounds)
        found = Found(result=result, batch_size=answer, largest=result.batch_size,
                      stop_reason=result.stop_reason, reason=reason)
        if answer is None or self.lockstep is not None:
            return found
        checked = self.verify(answer)
        self.verified = checked.trials
        if checked.batch_size == answer:
            return found
        return dataclasses.replace(
            found, batch_size=checked.batch_size, largest=checked.batch_size, stop_reason="verification",
            reason=("the largest that ran again after the search (its answer no longer fitted in the state the "
                    "search left)") if checked.batch_size is not None else "")

    def search(self) -> SearchResult:
        """:func:`run_search` with the policy; started over (``max_trials`` in all) when a trial changes the program."""
        earlier: list[Trial] = []
        while True:
            try:
                result = run_search(self.policy, self.space, self.runner,
                                    max_trials=max(1, self.cfg.max_trials - len(earlier)),
                                    on_trial=self._report, revise=self._revise)
            except ProgramChanged as changed:
                self._report(changed.trial)
                earlier = list(self.runner.done)  # counted against max_trials, not searched on
                self._use(dataclasses.replace(self.space, tensors=None))
                logger.info("searching again from the start: the trials so far ran other kernels")
                continue
            self._use(result.space or self.space)
            return result  # the runner keeps every trial, ``earlier`` ones included, for the plan

    def below_floor(self, result: SearchResult) -> SearchResult:
        """Nothing fitted from the compiled floor up: try ``min_batch_size`` too (one more compilation)."""
        minimum = self.cfg.min_batch_size
        low = dataclasses.replace(self.space, min_batch_size=minimum, max_batch_size=minimum)
        self._use(low)
        again = run_search(self.policy, low, self.runner, max_trials=1, on_trial=self._report, revise=self._revise)
        self._use(again.space or low)
        return SearchResult(batch_size=again.batch_size, trials=[*result.trials, *again.trials],
                            stop_reason="boundary" if again.batch_size is not None else again.stop_reason,
                            space=self.space)

    def verify(self, answer: int) -> Checked:
        """Run ``answer`` again in the state the search leaves, when the search left room for doubt.

        The answer must have run after the last thing that could change what it needs: an OOM
        (on real memory it can leave allocator caches, JIT code and fragmented heap behind, and a
        caching allocator's freed blocks) after the answer's last run, or an answer whose peak came
        within the tolerance of the capacity. Such an answer is run again, after the restore; if it
        no longer fits the finder steps down -- along the memory line, by at least the shortfall
        the failure shows (:func:`~batchpilot.policy.search.step_down`) -- and runs that size, until one fits.
        """
        trials = list(self.runner.done)
        if self.gauge.limit.tracked or not doubtful(answer, trials, self.space, self.tolerance):
            return Checked(answer, [])
        free_memory(self.device)  # a caching allocator's blocks go back first: the state training starts from
        done: list[Trial] = []
        b: int | None = answer
        tried: set[int] = set()
        while b is not None:
            tried.add(b)
            t = self.runner(b)
            self._report(t)
            done.append(t)
            revised = self.learner(self.space, t)
            if revised is not None:
                self._use(revised)
            if t.outcome == OOM or (t.measured and t.peak_bytes > self.space.limit_bytes):
                if t.measured:
                    t.outcome = OVER_TARGET
                b = step_down(b, [*trials, *done], self.space, self.tolerance, self.cfg.min_batch_size, tried,
                              len(done))
                continue
            logger.info("batch %d ran again after the search%s", b, "" if b == answer else f" (not {answer})")
            return Checked(b, done)
        return Checked(None, done)

    def _plan(self, found: Found) -> BatchPlan:
        """The answer as a :class:`BatchPlan`, logged once; or the error that nothing fits."""
        cfg, space, result, trials = self.cfg, self.space, found.result, list(self.runner.done)
        if found.batch_size is None:
            raise _nothing_fits(trials, space, self.device, "nothing_fits" if self.verified else result.stop_reason,
                                target=cfg.target, base=self.base)
        line = memory_line(result.trials, space.limit_bytes, self.base)
        plan = BatchPlan(
            batch_size=found.batch_size, target=float(cfg.target), capacity=int(space.capacity_bytes),
            limit_bytes=space.limit_bytes, strategy=self.policy.name, device=str(self.device), trials=trials,
            fit=None if line is None else MemoryFit(fixed_bytes=line[0], bytes_per_sample=line[1]),
            seconds=time.perf_counter() - self.started, stop_reason=found.stop_reason,
            steps_per_trial=cfg.steps_per_trial, first_guess=cfg.first_guess, memory=self.gauge.kind,
            tensor_fit=_tensor_line(result.trials, space.tensors, found.batch_size) if self.gauge.host else None,
            binding_limit=self.gauge.limit.binding, snapshot_bytes=self.snapshot.nbytes,
            snapshot_seconds=self.snapshot.seconds, snapshot_on_disk=self.spill, compiled=self.compiled,
            compiled_trials=self.run_compiled, compilations=self.compiles.count, objective=cfg.objective,
            speed_tolerance=cfg.speed_tolerance, largest_fitting=found.largest, verified=bool(self.verified),
            base_bytes=self.base, time_fit=fit_time(timed_fits(result.trials)), reason=found.reason,
        )
        if result.stop_reason == "max_trials":
            logger.warning("stopped after %d trials before reaching the boundary; batch size %d may be low",
                           plan.num_trials, plan.batch_size)
        if plan.stop_reason == "plateau":
            logger.warning("batch size %d: %s", plan.batch_size, plan.reason)
        # the answer explained, once: what the integrations and the engine leave in a configured log
        logger.info("%s%s", plan.describe(), f"\n  {plan.compilations} graph(s) compiled" if self.compiled else "")
        self.progress.note(f"  batch size {plan.batch_size} after {plan.num_trials} trials, {plan.num_ooms} OOM, "
                           f"{plan.seconds:.1f}s")
        return plan


@dataclass(frozen=True)
class Found:
    """What a search settled on: its result, the answer (``None``: nothing fits), the largest that fitted, why."""

    result: SearchResult
    batch_size: int | None
    largest: int | None
    stop_reason: str
    reason: str


@dataclass(frozen=True)
class Checked:
    """What :meth:`Search.verify` settled on (``None``: nothing ran) and the trials it ran."""

    batch_size: int | None
    trials: list[Trial]


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
        fits = [t.batch_size for t in trials if t.fits]
        # the level is known to start after the last fit below it, not at the smallest size seen on it
        below = max((b for b in fits if b < largest), default=0)
        memory = (f"memory stopped growing somewhere between {below} and {largest} (the same peak from {largest} "
                  f"up to {max(fits)}, the largest tried; does the step read fewer samples than it is asked for?): "
                  "set max_batch_size (e.g. your dataset's length)")
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



def limit_for(target: float, capacity: int, base: int | None) -> int:
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


def _spill(choice: str, gauge: Gauge, targets: list[Any]) -> bool:
    if choice != "auto":
        return choice == "disk"
    if not gauge.limit.spills:
        return False  # a file would not leave the figure more room (Limit.spills)
    # the share of what the job may still grow into, not of the whole process
    return StateSnapshot.objects_nbytes(targets) >= _SPILL_SHARE * max(1, gauge.capacity() - gauge.current())


class CapacityLearner:
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
        return dataclasses.replace(space, capacity_bytes=capacity, limit_bytes=limit_for(self.target, capacity, self.base))


def memory_line(trials: list[Trial], limit: int, base: int | None) -> tuple[float, float] | None:
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

    Trials after the model's two run their large size untracked (:meth:`TrialRunner._warm_size <batchpilot.find.trials.TrialRunner>`),
    so the model, not their tensor bytes, says what the tensors take near the answer.
    """
    if model is not None and answer is not None:
        fixed, per_sample = max(model.lines, key=lambda line: line[0] + line[1] * answer)
        return MemoryFit(fixed_bytes=fixed, bytes_per_sample=per_sample)
    pts = [t for t in trials if t.measured and t.tensor_bytes is not None]
    proxies = [Trial(batch_size=t.batch_size, outcome=t.outcome, peak_bytes=t.tensor_bytes) for t in pts]
    line = fit_line(proxies)
    return None if line is None else MemoryFit(fixed_bytes=line[0], bytes_per_sample=line[1])



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


def _nothing_fits(trials: list[Trial], space: SearchSpace, device: torch.device, reason: str, *,
                  target: float, base: int | None) -> NothingFitsError:
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
    cap = space.capacity_bytes
    # on a host the target is taken on the room left after what the process held before the search
    share = f"{target:.0%} of the capacity" if base is None else \
        f"{format_bytes(base)} in use + {target:.0%} of the {format_bytes(max(0, cap - base))} left of the capacity"
    msg = (
        f"nothing fits on {device}: batch size {smallest.batch_size} {what}, over the limit "
        f"{format_bytes(space.limit_bytes)} = {share} {format_bytes(cap)} ({cap} bytes); use a smaller model, "
        "mixed precision or activation checkpointing, a larger target, or a device with more memory"
    )
    return NothingFitsError(msg, batch_size=smallest.batch_size, peak_bytes=smallest.peak_bytes,
                            limit_bytes=space.limit_bytes, capacity_bytes=space.capacity_bytes)

