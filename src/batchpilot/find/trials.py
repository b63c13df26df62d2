"""One trial of the finder: the user's step run at a batch size under the gauge, and the state put back.

:class:`TrialRunner` runs a trial's steps (the first warms up, the last is the steady state), measures
the peak of the memory that fails (:mod:`batchpilot.memory.gauge`) and, on a host, the tensor bytes
under a tracker; it recovers from an OOM, restores the snapshot and returns a
:class:`~batchpilot.policy.search.Trial`. What the steps measured travels in a :class:`StepsRecord`.
:func:`warm_up` runs a compiled step once, unmeasured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..core.compiled import CompileCounter
from ..memory.gauge import Gauge
from ..memory.oom import Attempt, attempt, free_memory, is_oom
from ..memory.probes import track_peak
from ..memory.tracker import active_tracker
from ..memory.units import format_bytes
from ..policy.search import FIT, OOM, OVER_TARGET, REFUSED, SearchSpace, TensorModel, Trial, predict_peak
from .notes import note_trial_error
from .snapshot import StateSnapshot
from .timing import outside_trackers, step_clock, timed

__all__ = ["ProgramChanged", "StepsRecord", "TrialRunner", "warm_up"]

logger = logging.getLogger(__name__)

#: a trial whose first step's tensor peak is this far off the model's drops the model
_MODEL_ERROR = 0.02
#: trials predicted within this share of a limit that kills are refused
_KILL_MARGIN = 0.02


@dataclass
class StepsRecord:
    """What one trial's steps measured, filled in as each is known (an OOM leaves the rest unset)."""

    measure: Any = None  #: the tracker's peak (``track_peak``'s measure) when the steps ran under one
    start_bytes: int | None = None  #: bytes in use as the last step started, gradients aside
    times: list[float] = field(default_factory=list)  #: the timed steps' seconds
    peak: int | None = None  #: the gauge's peak, read when the trial ends


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



class ProgramChanged(Exception):
    """A trial changed the program the search measures (oneDNN's kernels turned off after its OOM)."""

    def __init__(self, trial: Trial) -> None:
        super().__init__(f"the program changed at batch {trial.batch_size}")
        self.trial = trial



class TrialRunner:
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
            raise ProgramChanged(trial)
        return trial

    def _agreed(self, batch_size: int) -> Trial:
        trial = self._run(batch_size)
        if self.lockstep is not None:
            # the same trial on every rank, then one view of it everywhere: the same next size
            trial = self.lockstep.agree_trial(trial, self.space)
        return trial

    def _run(self, batch_size: int) -> Trial:
        refused = self._refusal(batch_size)
        if refused is not None:
            return refused
        if self.on_start is not None:
            self.on_start(batch_size)
        if self.gauge.host:
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
        record = StepsRecord()
        if self.lockstep is not None:
            self.lockstep.begin()
        # the restore runs after the OOM's traceback is gone, before memory is released
        # not an OOM: the step's own error leaves with its type and _user_step's note (the search restores)
        with _gc_paused(self.gauge.limit.tracked):
            outcome = attempt(self._steps, batch_size, record, device=self.device,
                              on_oom=functools.partial(self._put_back, batch_size, record))
        if not outcome.oom:
            self._put_back(batch_size, record, oom=False)
        end = None if base is None else int(self.gauge.current())
        return self._trial(batch_size, outcome, record, base=base, end=end,
                           seconds=time.perf_counter() - began, retries=retries)

    def _refusal(self, batch_size: int) -> Trial | None:
        """The trial refused at ``batch_size`` (by this rank, or by any rank in lockstep), or ``None``: run it."""
        refused = self._refuse(batch_size)
        if self.lockstep is not None and self.lockstep.agree_refusal(refused is not None) and refused is None:
            refused = Trial(batch_size=batch_size, outcome=REFUSED, peak_bytes=0, start_bytes=None)
        return refused

    def _steps(self, batch_size: int, record: StepsRecord) -> None:
        """The trial's steps at ``batch_size``; what they measure goes into ``record`` as it is known."""
        # on CPU a storage tracker counts every operator from Python during the memory steps:
        # their times say nothing about the step, so the timed steps come after, without it
        tracked = self.device.type == "cpu" and self.breakdown
        read = step_clock(self.device)
        one_step = functools.partial(_user_step, self.step, batch_size)
        if self.gauge.host and tracked:
            self._host_steps(batch_size, one_step, record, read)
            return
        with track_peak(self.device, track=self.targets) if tracked else contextlib.nullcontext() as m:
            record.measure = m
            for i in range(self.steps):
                if i == self.steps - 1:
                    record.start_bytes = self._steady_bytes()
                if i == 0 or tracked:  # the first step warms up (kernels, optimizer state)
                    one_step()
                else:
                    record.times.append(timed(one_step, self.gauge.synchronize, read))
        self._time_steps(record.times, one_step, tracked, read)

    def _put_back(self, batch_size: int, record: StepsRecord, oom: bool = True) -> None:
        """Read the trial's peak into ``record``, then put the state back (after an OOM, or after the steps)."""
        # the peak first: the restore allocates too. On a real CPU the trial's freed heap goes
        # back to the OS before the restore maps its copies (under RLIMIT_AS that mapping
        # counts, and right after a trial at the boundary there is no room for it otherwise)
        self.gauge.synchronize()
        record.peak = int(self.gauge.peak())
        self.gauge.close()
        if oom and self.lockstep is not None:
            self.lockstep.recover(batch_size)  # the collectives the other ranks still wait in
        if self.gauge.host:
            free_memory(self.device, generation=1)
        self.snapshot.restore()

    def _trial(self, batch_size: int, outcome: Attempt, record: StepsRecord, *, base: int | None,
               end: int | None, seconds: float, retries: int | None) -> Trial:
        """The trial's record from what its steps measured: fits, over the target, or an OOM (bounded if it can be)."""
        start = base if base is not None else record.start_bytes
        m = record.measure
        tensor_bytes = int(m.peak_bytes) if self.gauge.host and m is not None else None
        if outcome.oom:
            kind = OOM
            bound = self.gauge.limit.oom_bound(outcome)
            peak_bytes = bound if bound is not None else record.peak
        else:
            kind = FIT if record.peak <= self.space.limit_bytes else OVER_TARGET
            bound = None
            peak_bytes = record.peak
        after = self.gauge.alloc_retries()
        times = record.times
        return Trial(batch_size=batch_size, outcome=kind, peak_bytes=int(peak_bytes), start_bytes=start,
                     seconds=seconds, message=outcome.message if outcome.oom else None, tensor_bytes=tensor_bytes,
                     bound_bytes=bound, step_seconds=min(times) if kind == FIT and times else None,
                     alloc_retries=None if retries is None or after is None else after - retries, end_bytes=end)

    def _host_steps(self, batch_size: int, one_step: Callable[[], None], record: StepsRecord,
                    read: Callable[[], float]) -> None:
        """A trial's steps on a host: the first under a tracker (its tensor peak, the model's check),
        the rest as they run in training, timed; the first two sizes record both steps' timelines.
        Once those two show a step's state does not grow with the batch, a trial's first step runs
        at the smaller of them, untracked (:meth:`_warm_size`)."""
        recording = self._model and len(self._timelines) < 2 and batch_size not in self._timelines
        warm = None if recording else self._warm_size(batch_size)
        if warm is not None:
            # untracked: the peak is the kernel's figure, and the steps at batch_size are timed
            record.start_bytes = self._steady_bytes()
            if self.steps == 1:
                one_step()  # a trial of one step: its first, as a tracked one would run it
            else:
                _user_step(self.step, warm)
                for _ in range(self.steps - 1):
                    record.times.append(timed(one_step, self.gauge.synchronize, read))
            self._time_steps(record.times, one_step, False, read)
            return
        lines: list[list[int]] = []
        # the data the step slices (a dataset tensor) is already in the process's real memory: a
        # slice of it adds nothing there, and a model that charged it per sample would read the
        # real bytes per tensor byte far below 1 (the dataset's row bytes against the activations')
        with track_peak(self.device, track=self.targets, host_data=False) as m:
            tracker = active_tracker(self.device)
            record.measure = m
            for i in range(self.steps if recording else 1):
                if recording and i == self.steps - 1:
                    self._carried[batch_size] = tracker.live - tracker.host_view_bytes
                with tracker.recording() as timeline:
                    one_step()
                lines.append(timeline)
                if i == 0:
                    first_peak = m.peak_bytes
        m.peak_bytes = first_peak  # the first step's: what the model's check compares
        record.start_bytes = self._steady_bytes()
        for _ in range(len(lines), self.steps):
            record.times.append(timed(one_step, self.gauge.synchronize, read))
        if recording and lines:
            self._timelines[batch_size] = (lines[0], lines[-1])
        self._time_steps(record.times, one_step, False, read)
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

