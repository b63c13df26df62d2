"""Device-generic memory probes, peak measurement and an emulated capacity.

On accelerators the figures come from the caching allocator (``torch.accelerator``
where the installed torch has the memory functions, the backend module otherwise).
On CPU they come from :class:`~batchpilot.memory.tracker.StorageTracker`, a dispatch mode that counts
the bytes of every live tensor storage exactly; outside a tracker a CPU probe falls back to
the process's resident set size, which is only approximate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from .host import ResidentPeak, host_limits, resident_bytes
from .tracker import StorageTracker, active_tracker
from .units import format_bytes, parse_bytes, resolve_device

__all__ = [
    "MemoryProbe",
    "get_probe",
    "CpuProbe",
    "HostProbe",
    "PeakMeasurement",
    "track_peak",
    "emulate_capacity",
]


class MemoryProbe:
    """Capacity, allocated bytes, peak since reset, and reset for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._capacity_override: int | None = None

    def capacity(self) -> int:
        raise NotImplementedError

    def allocated(self) -> int:
        raise NotImplementedError

    def peak(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued kernels: memory figures are only final after this."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class CpuProbe(MemoryProbe):
    """Exact tensor bytes inside a :class:`StorageTracker`; the process's real memory outside one.

    Outside a tracker the figures are the resident set (:mod:`batchpilot.memory.host`): ``allocated``
    is what the process holds, ``peak`` its high-water mark since :meth:`reset_peak`, and
    ``capacity`` what it can reach before the tightest limit (cgroup, ``RLIMIT_AS``, RAM).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._resident = ResidentPeak()

    def capacity(self) -> int:
        tr = active_tracker(self.device)
        if tr is not None and tr.capacity is not None:
            return tr.capacity
        return host_limits().capacity_bytes

    def allocated(self) -> int:
        tr = active_tracker(self.device)
        return tr.live if tr is not None else resident_bytes()

    def peak(self) -> int:
        tr = active_tracker(self.device)
        return tr.peak if tr is not None else self._resident.peak()

    def reset_peak(self) -> None:
        tr = active_tracker(self.device)
        if tr is not None:
            tr.reset_peak()
        else:
            self._resident.reset()


class HostProbe(CpuProbe):
    """The process's real memory (resident set, host limits), whether or not a tracker runs."""

    def capacity(self) -> int:
        return host_limits().capacity_bytes

    def allocated(self) -> int:
        return resident_bytes()

    def peak(self) -> int:
        return self._resident.peak()

    def reset_peak(self) -> None:
        self._resident.reset()


class AcceleratorProbe(MemoryProbe):
    """Caching-allocator statistics of a CUDA / XPU / MPS device."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.backend = getattr(torch, device.type)
        acc = getattr(torch, "accelerator", None)
        cur = acc.current_accelerator() if acc is not None and acc.is_available() else None
        # torch.accelerator's memory API (2.8+) only serves the current accelerator type
        self._acc = acc if cur is not None and cur.type == device.type and hasattr(acc, "max_memory_allocated") else None

    def _call(self, name: str, *alts: str) -> Any:
        idx = self.device.index if self.device.type != "mps" else None
        for owner, fn in ((self._acc, name), *((self.backend, a) for a in (name, *alts))):
            f = getattr(owner, fn, None) if owner is not None else None
            if f is not None:
                return f(idx) if idx is not None else f()
        raise NotImplementedError(f"{self.device.type} has no {name}")

    def capacity(self) -> int:
        if self._capacity_override is not None:
            return self._capacity_override
        if self.device.type == "mps":
            return int(self.backend.recommended_max_memory())
        return int(self.backend.get_device_properties(self.device).total_memory)

    def allocated(self) -> int:
        return int(self._call("memory_allocated", "current_allocated_memory"))

    def peak(self) -> int:
        try:
            return int(self._call("max_memory_allocated"))
        except NotImplementedError:  # older MPS has no peak statistic
            return self.allocated()

    def reset_peak(self) -> None:
        try:
            self._call("reset_peak_memory_stats")
        except NotImplementedError:
            pass

    def synchronize(self) -> None:
        if self.device.type == "mps":
            self.backend.synchronize()
        else:
            self.backend.synchronize(self.device)


_PROBES: dict[torch.device, MemoryProbe] = {}


def get_probe(device: torch.device | str | int | None = None) -> MemoryProbe:
    """The memory probe for ``device`` (one instance per device).

    Raises:
        ValueError: unknown device string (see :func:`resolve_device`).
    """
    dev = resolve_device(device)
    probe = _PROBES.get(dev)
    if probe is None:
        probe = CpuProbe(dev) if dev.type == "cpu" else AcceleratorProbe(dev)
        _PROBES[dev] = probe
    return probe


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
def track_peak(device: torch.device | str | int | None = None, *, track: Iterable[Any] = ()) -> Iterator[PeakMeasurement]:
    """Measure the peak allocated bytes of a region on any device.

    On CPU a :class:`StorageTracker` is started unless one is running already;
    ``track`` names the modules / optimizers / tensors that exist before the
    region so that they count (a running tracker is told about them too).
    The result is filled in when the region ends, also when it raises.
    """
    dev = resolve_device(device)
    probe = get_probe(dev)
    m = PeakMeasurement(device=dev, capacity=probe.capacity())
    if dev.type == "cpu":
        tr = active_tracker(dev)
        own = tr is None
        if own:
            tr = StorageTracker(dev)
        tr.track(*track)
        m.start_bytes = m.peak_bytes = tr.live
        tr._windows.append(m)
        try:
            if own:
                with tr:
                    yield m
            else:
                yield m
        finally:
            tr._windows.remove(m)
            m.end_bytes = tr.live
        return
    probe.synchronize()
    probe.reset_peak()
    m.start_bytes = probe.allocated()
    try:
        yield m
    finally:
        probe.synchronize()
        m.peak_bytes = probe.peak()
        m.end_bytes = probe.allocated()


@contextlib.contextmanager
def emulate_capacity(
    capacity: int | str, device: torch.device | str | int | None = "cpu", *, track: Iterable[Any] = ()
) -> Iterator[MemoryProbe]:
    """Make ``device`` behave like one with ``capacity`` bytes.

    On CPU, a :class:`StorageTracker` with that capacity raises
    ``torch.OutOfMemoryError`` when live tensors would exceed it (``track``:
    the tensors that already exist, e.g. the model and optimizer). On CUDA the
    caching allocator is capped with ``set_per_process_memory_fraction``, which
    raises the real CUDA OOM. Yields the device's probe, whose ``capacity()``
    reports the emulated size.

    Raises:
        ValueError: capacity not positive, larger than the device, or an
            unsupported device.
    """
    cap = parse_bytes(capacity)
    dev = resolve_device(device)
    probe = get_probe(dev)
    if dev.type == "cpu":
        tr = active_tracker(dev)
        if tr is None:
            with StorageTracker(dev, capacity=cap) as tr:
                tr.track(*track)
                yield probe
            return
        previous = tr.capacity
        tr.capacity = cap
        tr.track(*track)
        try:
            yield probe
        finally:
            tr.capacity = previous
        return
    if dev.type != "cuda":
        raise ValueError(f"emulated capacity is supported on cpu and cuda, not {dev.type}")
    total = probe.capacity() if probe._capacity_override is None else int(
        torch.cuda.get_device_properties(dev).total_memory
    )
    if cap > total:
        raise ValueError(f"capacity {format_bytes(cap)} exceeds the device's {format_bytes(total)}")
    previous = probe._capacity_override
    torch.cuda.set_per_process_memory_fraction(cap / total, dev)
    probe._capacity_override = cap
    try:
        yield probe
    finally:
        torch.cuda.set_per_process_memory_fraction((previous or total) / total, dev)
        probe._capacity_override = previous
