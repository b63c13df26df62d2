"""Timing a step: synchronised on both sides, and with the CPU storage tracker set aside."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from batchpilot.find import timing
from batchpilot.memory.probes import emulate_capacity
from batchpilot.memory.tracker import StorageTracker, active_tracker


def test_a_timed_step_is_synchronised_before_and_after(monkeypatch):
    events, now = [], [0.0]

    def clock():
        events.append(("clock", now[0]))
        return now[0]

    def step():
        events.append(("step",))
        now[0] += 0.25

    monkeypatch.setattr(timing, "clock", clock)
    seconds = timing.timed(step, lambda: events.append(("sync",)))
    assert seconds == 0.25
    # queued work before the step is waited for before the clock starts, all of the step's own after
    assert events == [("sync",), ("clock", 0.0), ("step",), ("sync",), ("clock", 0.25)]


def test_a_one_thread_cpu_step_is_timed_by_its_cpu_time_anything_else_by_the_wall_clock(monkeypatch):
    monkeypatch.setattr(timing, "clock", wall := lambda: 1.0)
    monkeypatch.setattr(timing, "thread_clock", cpu := lambda: 2.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert timing.step_clock(torch.device("cpu")) is cpu  # preemption by other processes does not count
        assert timing.step_clock(torch.device("cuda", 0)) is wall
        torch.set_num_threads(2)
        assert timing.step_clock(torch.device("cpu")) is wall  # other threads' work is in the wall time only
    finally:
        torch.set_num_threads(threads)
    assert timing.timed(lambda: None, lambda: None, cpu) == 0.0


def test_the_tracker_is_set_aside_and_put_back():
    with emulate_capacity(1024):
        tracker = active_tracker("cpu")
        with timing.outside_trackers() as clear:
            assert clear and _get_current_dispatch_mode_stack() == []  # operators run at full speed
            x = torch.empty(4096)  # 16 KiB past a 1 KiB device: neither counted nor refused
            assert tracker.live == 0
        assert _get_current_dispatch_mode_stack() == [tracker] and active_tracker("cpu") is tracker
        del x
        try:
            torch.empty(4096)
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("the emulated capacity is enforced again after the block")
    with timing.outside_trackers() as clear:  # nothing running: nothing in the way
        assert clear


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_users_own_mode_is_left_alone():
    with StorageTracker(), Recorder() as rec:
        with timing.outside_trackers() as clear:
            assert not clear
            torch.ones(3) + 1
        assert rec.calls > 0 and active_tracker("cpu") is not None
