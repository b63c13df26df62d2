"""Timing a step on a device: synchronised, by the right clock, with the CPU storage tracker out of the way.

An accelerator runs a step asynchronously: the host returns while kernels are queued, so a
step is timed from a synchronised device to a synchronised device, by the wall clock. On a
CPU running one intra-op thread the whole step (forward, the CPU autograd engine's backward,
the optimizer) runs in the calling thread, and its CPU time is what it costs: other processes
on a shared machine stretch the wall time several-fold and unevenly, not the CPU time. With
more threads the wall clock is the only honest one. A
:class:`~batchpilot.memory.tracker.StorageTracker` sees every operator from Python, which makes a
step 1.5 to 7 times slower on the reference models; timed steps run with it set aside
(:func:`outside_trackers`). Tests put fake clocks in :data:`clock` and :data:`thread_clock`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

__all__ = ["clock", "thread_clock", "step_clock", "timed", "outside_trackers"]

#: The wall clock; replace it (``monkeypatch``) for deterministic tests.
clock: Callable[[], float] = time.perf_counter
#: The calling thread's CPU time; replace it for deterministic tests.
thread_clock: Callable[[], float] = time.thread_time


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock a step on ``device`` is timed by: the thread's CPU time on a one-thread CPU, else the wall clock."""
    # read at each call: the module attributes are what tests replace
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return thread_clock
    return clock


def timed(fn: Callable[[], Any], synchronize: Callable[[], None], read: Callable[[], float] | None = None) -> float:
    """Seconds ``fn()`` takes on the device: ``synchronize``, read the clock, run, ``synchronize``, read it again.

    The first synchronisation keeps work queued before the step out of its time, the second
    puts all of the step's own work in it. ``read`` is the clock (default :data:`clock`).
    """
    read = read if read is not None else clock
    synchronize()
    began = read()
    fn()
    synchronize()
    return read() - began


@contextlib.contextmanager
def outside_trackers() -> Iterator[bool]:
    """Set aside the :class:`~batchpilot.memory.tracker.StorageTracker` modes on top of the dispatch stack.

    Yields whether every running dispatch mode was a tracker and is now set aside; with another
    mode on the stack (a user's) nothing is touched and it yields ``False``. Inside, operators
    run at full speed and are neither counted nor limited; storages freed inside still leave
    the count (their weakref callbacks fire), and what is created inside is unknown to the
    trackers afterwards, as with :meth:`StorageTracker.paused` (the finder restores its state
    after a trial, which registers the tensors it puts back).
    """
    # private since torch 2.0 and unchanged through 2.13: the only way to run at full speed
    # inside an active TorchDispatchMode without leaving its ``with`` block
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily

    from ..memory.tracker import StorageTracker

    stack = _get_current_dispatch_mode_stack()
    if not stack or not all(isinstance(m, StorageTracker) for m in stack):
        yield not stack
        return
    with contextlib.ExitStack() as popped:
        for _ in stack:
            popped.enter_context(_pop_mode_temporarily())
        yield True
