"""A region's peak on any device, an emulated capacity, and each device's allocated-bytes gauge.

The figures come from a :class:`~batchpilot.memory.gauge.Gauge` (:mod:`batchpilot.memory.gauge`,
the one memory-figure abstraction). On accelerators :func:`track_peak` reads the caching
allocator's allocated bytes; on CPU a :class:`~batchpilot.memory.tracker.StorageTracker`, a
dispatch mode that counts the bytes of every live tensor storage exactly. :func:`emulate_capacity`
makes a device behave like a smaller one and :func:`emulated_capacity` says which capacity an
emulation running now gives it: the one place the finder and the engine learn it from.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from .gauge import AllocatorGauge
from .tracker import StorageTracker, active_tracker
from .units import format_bytes, parse_bytes, resolve_device

__all__ = ["get_probe", "PeakMeasurement", "track_peak", "emulate_capacity", "emulated_capacity", "EMULATED_DEVICES"]

#: the device types :func:`emulate_capacity` can give a capacity of their own: a storage tracker on
#: CPU, the caching allocator's memory fraction on CUDA
EMULATED_DEVICES = ("cpu", "cuda")


_GAUGES: dict[torch.device, AllocatorGauge] = {}


def get_probe(device: torch.device | str | int | None = None) -> AllocatorGauge:
    """The allocated-bytes :class:`~batchpilot.memory.gauge.AllocatorGauge` of ``device`` (one per device).

    Its ``capacity()`` follows an emulation running for the device (:func:`emulate_capacity`).

    Raises:
        ValueError: unknown device string (see :func:`resolve_device`).
    """
    dev = resolve_device(device)
    gauge = _GAUGES.get(dev)
    if gauge is None:
        gauge = _GAUGES[dev] = AllocatorGauge(dev)
    return gauge


def emulated_capacity(device: torch.device | str | int | None = None) -> int | None:
    """The capacity an emulation running now gives ``device``, or ``None`` when none does.

    On CPU: the capacity of the running :class:`~batchpilot.memory.tracker.StorageTracker`
    (``None`` for a tracker without one, as :func:`track_peak` starts); elsewhere the one
    :func:`emulate_capacity` set.

    Raises:
        ValueError: unknown device string (see :func:`resolve_device`).
    """
    dev = resolve_device(device)
    if dev.type == "cpu":
        tr = active_tracker(dev)
        return None if tr is None else tr.capacity
    gauge = _GAUGES.get(dev)
    return None if gauge is None else gauge.emulated


# ---------------------------------------------------------------------------
# Regions


@dataclass
class PeakMeasurement:
    """Bytes allocated at the start and end of a region and the peak inside it."""

    device: torch.device
    start_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0
    capacity: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def track_peak(device: torch.device | str | int | None = None, *, track: Iterable[Any] = (),
               host_data: bool = True) -> Iterator[PeakMeasurement]:
    """Measure the peak allocated bytes of a region on any device.

    On CPU a :class:`StorageTracker` is started unless one is running already;
    ``track`` names the modules / optimizers / tensors that exist before the
    region so that they count (a running tracker is told about them too).
    ``host_data`` is the started tracker's (:class:`StorageTracker`): ``False`` leaves data
    from outside the region uncharged, as it is in a host's real memory that already holds it.
    The result is filled in when the region ends, also when it raises.
    """
    dev = resolve_device(device)
    gauge = get_probe(dev)
    m = PeakMeasurement(device=dev, capacity=gauge.capacity())
    if dev.type == "cpu":
        tr = active_tracker(dev)
        own = tr is None
        if own:
            tr = StorageTracker(dev, host_data=host_data)
        tr.track(*track)
        m.start_bytes = m.peak_bytes = tr.live
        m.extra["foreign_release_bytes"] = 0  # StorageTracker.foreign_release_bytes, for this region
        with tr.window(m):
            try:
                if own:
                    with tr:
                        yield m
                else:
                    yield m
            finally:
                m.end_bytes = tr.live
        return
    gauge.reset()  # after the queued kernels
    m.start_bytes = gauge.current()
    try:
        yield m
    finally:
        gauge.synchronize()
        m.peak_bytes = gauge.peak()
        m.end_bytes = gauge.current()


@contextlib.contextmanager
def emulate_capacity(
    capacity: int | str, device: torch.device | str | int | None = "cpu", *, track: Iterable[Any] = ()
) -> Iterator[AllocatorGauge]:
    """Make ``device`` behave like one with ``capacity`` bytes.

    On CPU, a :class:`StorageTracker` with that capacity raises
    ``torch.OutOfMemoryError`` when live tensors would exceed it (``track``:
    the tensors that already exist, e.g. the model and optimizer). On CUDA the
    caching allocator is capped with ``set_per_process_memory_fraction``, which
    raises the real CUDA OOM. Yields the device's gauge (:func:`get_probe`), whose
    ``capacity()`` reports the emulated size, as :func:`emulated_capacity` does.

    Raises:
        ValueError: capacity not positive, larger than the device, or an
            unsupported device.
    """
    cap = parse_bytes(capacity)
    dev = resolve_device(device)
    gauge = get_probe(dev)
    if dev.type == "cpu":
        tr = active_tracker(dev)
        if tr is None:
            with StorageTracker(dev, capacity=cap) as tr:
                tr.track(*track)
                yield gauge
            return
        previous = tr.capacity
        tr.capacity = cap
        tr.track(*track)
        try:
            yield gauge
        finally:
            tr.capacity = previous
        return
    if dev.type != "cuda":
        raise ValueError(f"emulated capacity is supported on cpu and cuda, not {dev.type}")
    total = int(torch.cuda.get_device_properties(dev).total_memory)
    if cap > total:
        raise ValueError(f"capacity {format_bytes(cap)} exceeds the device's {format_bytes(total)}")
    previous = gauge.emulated
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    gauge.emulated = cap
    try:
        yield gauge
    finally:
        torch.cuda.set_per_process_memory_fraction((previous or total) / total, dev)
        gauge.emulated = previous
