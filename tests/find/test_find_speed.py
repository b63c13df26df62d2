"""The finder's timed trials and the throughput objective, on a fake clock (deterministic).

Each test's step really trains a small model under an emulated capacity (memory is real and
exact) and moves :data:`batchpilot.find.timing.clock` forward by a step-time curve written in plain
Python, so the times, and every choice made on them, are known exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from batchpilot.app.report import SCHEMAS, plan_record, to_json
from batchpilot.core.batch import make_batch_fn
from batchpilot.find import timing
from batchpilot.find.finder import find_batch_size
from batchpilot.find.trials import TrialRunner as _TrialRunner
from batchpilot.find.front import find_batch_size_for
from batchpilot.find.snapshot import StateSnapshot
from batchpilot.memory.gauge import Gauge
from batchpilot.memory.tracker import active_tracker
from batchpilot.policy.search import BatchSizeError, SearchSpace
from batchpilot.policy.speed import ThroughputSearch, choose_fastest

from test_find import CAPACITY, assert_same_state, setup, state_of


def linear(b: int) -> float:
    """A step with a fixed 10 ms and 1 ms per sample: samples/s saturate at 1000."""
    return 0.01 + 0.001 * b


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timing, "clock", fake)  # the wall clock (accelerators, several CPU threads)
    monkeypatch.setattr(timing, "thread_clock", fake)  # the thread's CPU time (a one-thread CPU)
    return fake


def clocked_step(model, optimizer, batch, clock, curve=linear):
    """A real training step that also advances the fake clock by ``curve(b)``; records whether a tracker saw it."""
    make, loss_fn = make_batch_fn(batch), nn.CrossEntropyLoss()
    seen = []

    def step(b: int) -> None:
        x, y = make(b)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        clock.now += curve(b)
        # was the step under the dispatch-mode tracker (memory) or set aside (timed)?
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        seen.append((b, bool(_get_current_dispatch_mode_stack())))

    return step, seen


def test_fitting_trials_are_timed_outside_the_tracker_and_the_answer_is_unchanged(clock):
    model, opt, batch = setup("mlp")
    before = state_of(model, opt)
    step, seen = clocked_step(model, opt, batch, clock)
    plan = find_batch_size(step, restore=(model, opt), capacity=CAPACITY, max_batch_size=4096)
    assert_same_state(before, state_of(model, opt))
    trials_seen = list(seen)
    untimed = find_batch_size(step, restore=(model, opt), capacity=CAPACITY, max_batch_size=4096, timed_steps=0)
    # memory decides, as before: the same trials and answer with and without timing
    assert [t.batch_size for t in plan.trials] == [t.batch_size for t in untimed.trials]
    assert plan.batch_size == untimed.batch_size == plan.largest_fitting and plan.objective == "memory"
    assert all(t.step_seconds is None for t in untimed.trials)
    for t in plan.trials:
        if t.fits:
            assert t.step_seconds == pytest.approx(linear(t.batch_size), abs=1e-12)
            assert t.samples_per_second == pytest.approx(t.batch_size / linear(t.batch_size))
        else:  # an over-target size is never chosen: not timed
            assert t.step_seconds is None and t.samples_per_second is None
    # per fitting trial: 2 memory steps under the tracker, then 1 timed step without it
    fits = [t.batch_size for t in plan.trials if t.fits]
    assert [b for b, tracked in trials_seen if not tracked] == fits
    assert sum(tracked for _, tracked in trials_seen) == 2 * len(plan.trials)
    assert plan.time_fit.fixed_seconds == pytest.approx(0.01)
    assert plan.time_fit.seconds_per_sample == pytest.approx(0.001)
    assert plan.samples_per_second == pytest.approx(plan.batch_size / linear(plan.batch_size))
    assert plan.reason.startswith("the largest that fits")


def test_throughput_objective_picks_the_knee_and_memory_stays_a_hard_limit(clock):
    model, opt, batch = setup("mlp")
    before = state_of(model, opt)
    step, _ = clocked_step(model, opt, batch, clock)
    plan = find_batch_size(step, restore=(model, opt), capacity=CAPACITY, max_batch_size=4096,
                           objective="throughput")
    assert_same_state(before, state_of(model, opt))
    largest = plan.largest_fitting
    memory = find_batch_size(step, restore=(model, opt), capacity=CAPACITY, max_batch_size=4096)
    assert largest == memory.batch_size  # the memory search is the same search
    n_memory = memory.num_trials
    extra = plan.trials[n_memory:]
    # the extra trials are smaller sizes, each one fitted and was timed (3 timed steps each)
    assert extra and all(t.batch_size < largest and t.fits and t.step_seconds for t in extra)
    # the answer: the knee of the saturating curve, where samples/s reach 95% of the best
    best = largest / linear(largest)
    b = plan.batch_size
    assert b / linear(b) >= 0.95 * best
    slower = [t.batch_size for t in plan.trials if t.fits and t.batch_size < b]
    assert slower and max(slower) / linear(max(slower)) < 0.95 * best
    assert b - max(slower) <= 0.125 * b  # bracketed to within the search's resolution
    assert b < 0.5 * largest and plan.objective == "throughput" and "within 5%" in plan.reason
    # the same choice as the pure search replayed on the same curve
    points = {t.batch_size: linear(t.batch_size) for t in plan.trials[:n_memory] if t.fits}
    search = ThroughputSearch()
    while (nxt := search.next_size(points, lowest=1, highest=largest)) is not None:
        points[nxt] = linear(nxt)
    assert choose_fastest(points).batch_size == b
    # the JSON record carries the speed of every timed trial and the fit
    rec = json.loads(to_json(plan_record(plan)))
    assert rec["objective"] == "throughput" and rec["largest_fitting"] == largest and rec["batch_size"] == b
    assert rec["samples_per_second"] == pytest.approx(b / linear(b))
    assert set(rec["time_fit"]) == SCHEMAS["time_fit"]
    assert all(set(t) == SCHEMAS["trial"] for t in rec["trials"])


def test_a_tolerance_of_zero_takes_the_fastest_and_wider_ones_smaller(clock):
    model, opt, batch = setup("mlp")
    step, _ = clocked_step(model, opt, batch, clock)
    kw = dict(restore=(model, opt), capacity=CAPACITY, max_batch_size=200, objective="throughput")
    exact = find_batch_size(step, speed_tolerance=0.0, **kw)
    wide = find_batch_size(step, speed_tolerance=0.2, **kw)
    assert exact.largest_fitting == 200 and exact.stop_reason == "max_batch_size"
    assert exact.batch_size == exact.largest_fitting  # a saturating curve is fastest at its largest size
    assert wide.batch_size < find_batch_size(step, **kw).batch_size < exact.batch_size


def test_eval_defaults_to_throughput_and_training_to_memory(clock):
    model, opt, batch = setup("cnn")
    train = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY)
    evaluate = find_batch_size_for(model, batch, mode="eval", capacity=CAPACITY)
    assert (train.objective, evaluate.objective) == ("memory", "throughput")
    assert train.batch_size == train.largest_fitting
    assert evaluate.batch_size <= evaluate.largest_fitting
    assert find_batch_size_for(model, batch, mode="eval", capacity=CAPACITY, objective="memory").objective == "memory"


@pytest.mark.parametrize("options,match", [
    (dict(objective="fastest"), "objective must be one of"),
    (dict(speed_tolerance=0.5), "speed_tolerance must be a fraction"),
    (dict(objective="throughput", timed_steps=0), "timed_steps must be a positive int"),
    (dict(timed_steps=-1), "timed_steps must be >= 0"),
])
def test_bad_speed_options_fail_before_any_trial(options, match):
    calls = []
    with pytest.raises(BatchSizeError, match=match):
        find_batch_size(calls.append, capacity=CAPACITY, **options)
    assert calls == []


# ---------------------------------------------------------------------------
# an accelerator's timing path, with the device stubbed


class StubGauge(Gauge):
    """A device whose figures are set by the test; every synchronize is recorded."""

    kind = "device"

    def __init__(self, events: list, peak: int) -> None:
        super().__init__(torch.device("cuda", 0))
        self.events, self._peak, self.retries = events, peak, 0

    def capacity(self) -> int:
        return 1 << 30

    def current(self) -> int:
        return 0

    def peak(self) -> int:
        return self._peak

    def reset(self) -> None:
        pass

    def synchronize(self) -> None:
        self.events.append("sync")

    def alloc_retries(self) -> int:
        return self.retries


def stub_runner(events: list, durations: list[float], *, peak: int, steps: int, timed_steps: int, clock):
    gauge = StubGauge(events, peak)

    def step(b: int) -> None:
        events.append(f"step {b}")
        clock.now += durations.pop(0)
        gauge.retries += 1  # the allocator retried once per step: thrashing, reported per trial

    runner = _TrialRunner(step, torch.device("cuda", 0), gauge, steps, [], StateSnapshot([]), timed_steps=timed_steps)
    runner.space = SearchSpace(limit_bytes=1000, capacity_bytes=2000)
    return runner


def test_on_an_accelerator_each_timed_step_is_synchronised_and_the_warm_up_left_out(clock):
    events = []
    # 2 memory steps (the first warms up), then 2 more to reach timed_steps=3; the warm-up is the
    # fastest here only so that counting it would show
    runner = stub_runner(events, [2.0, 4.0, 3.0, 5.0], peak=800, steps=2, timed_steps=3, clock=clock)
    trial = runner(8)
    assert trial.fits and trial.step_seconds == 3.0  # the fastest timed step; the warm-up is not one
    assert trial.alloc_retries == 4
    steps = [i for i, e in enumerate(events) if e == "step 8"]
    assert len(steps) == 4
    # the warm-up is not timed; every timed step has the device synchronised right before and after
    assert steps[0] == 0
    for i in steps[1:]:
        assert events[i - 1] == "sync" and events[i + 1] == "sync", events


def test_an_over_target_trial_is_not_timed_further(clock):
    events = []
    runner = stub_runner(events, [9.0, 4.0, 3.0, 5.0], peak=1500, steps=2, timed_steps=3, clock=clock)
    trial = runner(8)
    assert trial.outcome == "over_target" and trial.step_seconds is None
    assert events.count("step 8") == 2  # the memory steps only
