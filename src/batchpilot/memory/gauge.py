"""The memory figure a decision is made on: the one that fails on this device.

* an emulated capacity: the tensor bytes a :class:`~batchpilot.memory.tracker.StorageTracker` counts
  on CPU, or the caching allocator's reserved bytes under a CUDA memory fraction;
* a real CPU: the process's resident set against what limits it (:mod:`batchpilot.memory.host`);
* a real CUDA / HIP device: reserved memory plus everything outside PyTorch (the context,
  other processes) against the device's total, which is what ``cudaMalloc`` runs out of;
* MPS and XPU: the allocator's allocated bytes against the recommended / total memory.

The finder and the engine measure through a :class:`Gauge`, so every place that sizes a batch
agrees on what "fits" means.
"""

from __future__ import annotations

import torch

from .host import ResidentPeak, host_limits, resident_bytes
from .probes import get_probe
from .tracker import active_tracker

__all__ = ["Gauge", "TensorGauge", "ResidentGauge", "DeviceGauge", "AllocatorGauge", "gauge_for"]


class Gauge:
    """One figure of a device's memory: in use now, its peak since :meth:`reset`, and the capacity.

    Attributes:
        kind: ``"tensors"``, ``"resident"``, ``"device"`` or ``"allocated"`` (for reports).
        kills: going over the capacity kills the process instead of raising (a container).
    """

    kind = "allocated"
    kills = False
    #: the figure is the host process's real memory (then ``limits`` says what limits it)
    host = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def capacity(self) -> int:
        raise NotImplementedError

    def current(self) -> int:
        raise NotImplementedError

    def peak(self) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        """Start a new peak window (after the device has finished its queued work)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        get_probe(self.device).synchronize()

    def alloc_retries(self) -> int | None:
        """How often the allocator has freed its cache and retried an allocation; ``None`` if it does not say."""
        return None

    def close(self) -> None:
        """Release what the gauge holds between uses (nothing, for most)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class TensorGauge(Gauge):
    """Tensor bytes of the running :class:`~batchpilot.memory.tracker.StorageTracker` (CPU emulation)."""

    kind = "tensors"

    def _tracker(self):  # noqa: ANN202
        tr = active_tracker(self.device)
        if tr is None:
            raise RuntimeError("TensorGauge needs a StorageTracker running for its device")
        return tr

    def capacity(self) -> int:
        tr = self._tracker()
        return tr.capacity if tr.capacity is not None else host_limits().capacity_bytes

    def current(self) -> int:
        return self._tracker().live

    def peak(self) -> int:
        return self._tracker().peak

    def reset(self) -> None:
        self._tracker().reset_peak()


class ResidentGauge(Gauge):
    """The process's resident set against the tightest host limit (cgroup, ``RLIMIT_AS``, RAM)."""

    kind = "resident"
    host = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._peak = ResidentPeak()
        self.limits = host_limits()

    @property
    def kills(self) -> bool:  # type: ignore[override]
        return self.limits.kills

    def capacity(self) -> int:
        self.limits = host_limits()
        return self.limits.capacity_bytes

    def current(self) -> int:
        return resident_bytes()

    def peak(self) -> int:
        return self._peak.peak()

    def reset(self) -> None:
        self._peak.reset()


class DeviceGauge(Gauge):
    """CUDA / HIP: reserved bytes plus memory outside PyTorch, against the device's total.

    ``cudaMalloc`` fails when the device is full, whoever filled it: the caching allocator's
    reserved segments (cached blocks included), the CUDA context and any other process. The
    memory outside PyTorch is read at :meth:`reset` from ``mem_get_info`` (a driver call) as
    ``total - free - reserved``. Under an emulated capacity (a per-process memory fraction) the
    allocator refuses past ``fraction × total`` of *reserved* memory, so only that counts.
    """

    kind = "device"

    def __init__(self, device: torch.device, emulated_capacity: int | None = None) -> None:
        super().__init__(device)
        self.emulated = emulated_capacity
        self.outside = 0

    def capacity(self) -> int:
        if self.emulated is not None:
            return self.emulated
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def _outside_now(self) -> int:
        if self.emulated is not None:
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, int(total) - int(free) - int(torch.cuda.memory_reserved(self.device)))

    def current(self) -> int:
        return int(torch.cuda.memory_reserved(self.device)) + self.outside

    def peak(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device)) + self.outside

    def reset(self) -> None:
        self.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.outside = self._outside_now()

    def alloc_retries(self) -> int | None:
        # cudaMalloc failed, the caching allocator freed its cache and retried: thrashing below an OOM
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))


class AllocatorGauge(Gauge):
    """The backend allocator's allocated bytes (MPS, XPU): what their probes report."""

    def __init__(self, device: torch.device, emulated_capacity: int | None = None) -> None:
        super().__init__(device)
        self.probe = get_probe(device)
        self.emulated = emulated_capacity

    def capacity(self) -> int:
        return self.emulated if self.emulated is not None else self.probe.capacity()

    def current(self) -> int:
        return self.probe.allocated()

    def peak(self) -> int:
        return self.probe.peak()

    def reset(self) -> None:
        self.probe.synchronize()
        self.probe.reset_peak()


def gauge_for(device: torch.device, *, emulated_capacity: int | None = None) -> Gauge:
    """The gauge whose figure fails on ``device``; with ``emulated_capacity``, the emulation's.

    On CPU an emulated capacity means a :class:`~batchpilot.memory.tracker.StorageTracker` with that
    capacity is (or will be) running when the gauge is read.
    """
    if device.type == "cpu":
        return TensorGauge(device) if emulated_capacity is not None else ResidentGauge(device)
    if device.type == "cuda":
        return DeviceGauge(device, emulated_capacity)
    return AllocatorGauge(device, emulated_capacity)
