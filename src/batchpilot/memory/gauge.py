"""Figures of a device's memory: in use now, peak since a reset, capacity -- one :class:`Gauge` each.

The figure a decision is made on is the one that fails on the device (:func:`gauge_for`):

* an emulated capacity: the tensor bytes a :class:`~batchpilot.memory.tracker.StorageTracker` counts
  on CPU (:class:`TensorGauge`), or the caching allocator's reserved bytes under a CUDA memory
  fraction (:class:`DeviceGauge`);
* a real CPU: the figure the binding host limit counts (:class:`HostGauge`,
  :mod:`batchpilot.memory.limits`): the address space under ``RLIMIT_AS``, the container's charge
  under a memory cgroup, the resident set against the available RAM without either;
* a real CUDA / HIP device: reserved memory plus everything outside PyTorch (the context,
  other processes) against the device's total, which is what ``cudaMalloc`` runs out of;
* MPS and XPU: the allocator's allocated bytes against the recommended / total memory.

:class:`AllocatorGauge` is the plain "allocated bytes" figure of any device, the one
:func:`~batchpilot.memory.probes.track_peak` measures a region with and
:func:`~batchpilot.memory.probes.get_probe` returns. The finder and the engine measure through a
gauge, so every place that sizes a batch agrees on what "fits" means; what follows from the
figure (is the capacity exact, does going over it kill, what an OOM bounds) is its ``limit``'s.
"""

from __future__ import annotations

from typing import Any

import torch

from .host import ResidentPeak, address_space_peak, resident_bytes
from .limits import ALLOCATED, DEVICE, TENSORS, Limit, host_limits
from .tracker import active_tracker

__all__ = ["Gauge", "TensorGauge", "HostGauge", "DeviceGauge", "AllocatorGauge", "gauge_for"]


class Gauge:
    """One figure of a device's memory: in use now, its peak since :meth:`reset`, and the capacity.

    Attributes:
        limit: the kind of limit the figure is judged against (:mod:`batchpilot.memory.limits`):
            it says whether the capacity is exact, whether going over it kills, what an OOM bounds.
    """

    limit: Limit = ALLOCATED

    @property
    def kind(self) -> str:
        """The figure's name for reports: the limit's :attr:`~batchpilot.memory.limits.Limit.name`."""
        return self.limit.name

    @property
    def kills(self) -> bool:
        """Going over the capacity kills the process instead of raising (a container)."""
        return self.limit.kills

    @property
    def host(self) -> bool:
        """The figure is the host process's real memory (then ``limits`` says what limits it)."""
        return self.limit.host

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
        """Wait for the device's queued kernels: memory figures (and times) are only final after this."""
        if self.device.type == "cpu":
            return
        backend = getattr(torch, self.device.type)
        if self.device.type == "mps":
            backend.synchronize()
        else:
            backend.synchronize(self.device)

    def alloc_retries(self) -> int | None:
        """How often the allocator has freed its cache and retried an allocation; ``None`` if it does not say."""
        return None

    def close(self) -> None:
        """Release what the gauge holds between uses (nothing, for most)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class TensorGauge(Gauge):
    """Tensor bytes of the running :class:`~batchpilot.memory.tracker.StorageTracker` (CPU emulation)."""

    limit = TENSORS

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


class HostGauge(Gauge):
    """A real CPU: the figure that the limit binding this process counts, against that limit.

    The binding limit is the :class:`~batchpilot.memory.limits.HostLimit` with the least headroom
    when the gauge is made (:attr:`HostLimits.limit <batchpilot.memory.limits.HostLimits.limit>`):
    the address space under ``RLIMIT_AS``, a container's working set, the resident set against the
    available RAM, or a kind added with :func:`~batchpilot.memory.limits.register`. The limit reads
    its figure and its size; the gauge keeps the peak window. Linux keeps a resettable high-water
    mark of the resident set only, from which each kind works out its own figure's peak
    (:meth:`~batchpilot.memory.limits.HostLimit.window_peak`).

    Attributes:
        limits: the host's limits as last read (at creation and at each :meth:`capacity`).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._peak = ResidentPeak()
        self.limits = host_limits()
        self.limit = self.limits.limit
        self._start: tuple[int, int, int] | None = None  # (figure, resident, VmPeak) at reset

    @property
    def kills(self) -> bool:  # type: ignore[override]
        return self.limits.kills

    def capacity(self) -> int:
        self.limits = lim = host_limits()
        now = self.limit.reading(lim)
        return now[0] if now is not None else lim.resident_bytes + max(0, lim.available_bytes)

    def current(self) -> int:
        figure = self.limit.figure()
        return figure if figure is not None else resident_bytes()

    def peak(self) -> int:
        hwm = self._peak.peak()
        if self._start is None:
            return hwm
        return self.limit.window_peak(hwm, self._start, self.current())

    def reset(self) -> None:
        self._peak.reset()
        self._start = (self.current(), resident_bytes(), address_space_peak() or 0)

    def close(self) -> None:
        self._peak.close()


class DeviceGauge(Gauge):
    """CUDA / HIP: reserved bytes plus memory outside PyTorch, against the device's total.

    ``cudaMalloc`` fails when the device is full, whoever filled it: the caching allocator's
    reserved segments (cached blocks included), the CUDA context and any other process. The
    memory outside PyTorch is read at :meth:`reset` from ``mem_get_info`` (a driver call) as
    ``total - free - reserved``. Under an emulated capacity (a per-process memory fraction) the
    allocator refuses past ``fraction × total`` of *reserved* memory, so only that counts.
    """

    limit = DEVICE

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
    """The bytes the device's allocator has handed out, on any device.

    * an accelerator (CUDA, XPU, MPS): the caching allocator's allocated bytes and their peak,
      through ``torch.accelerator`` where the installed torch has its memory functions, the
      backend module otherwise; the capacity is the device's total (MPS: its recommended maximum);
    * a CPU: the tensor bytes of the running :class:`~batchpilot.memory.tracker.StorageTracker`
      (exact), and outside one the process's resident set (approximate), against what the
      tightest host limit lets the process reach (:attr:`HostLimits.capacity_bytes
      <batchpilot.memory.limits.HostLimits.capacity_bytes>`).

    The finder decides on this figure on MPS and XPU (:func:`gauge_for`); on every device it is
    what :func:`~batchpilot.memory.probes.track_peak` reports.

    Attributes:
        emulated: the capacity an emulation gives the device, reported by :meth:`capacity` in
            place of the real one; :func:`~batchpilot.memory.probes.emulate_capacity` sets it on
            the device's shared gauge (:func:`~batchpilot.memory.probes.get_probe`) while it runs.
    """

    def __init__(self, device: torch.device, emulated_capacity: int | None = None) -> None:
        super().__init__(device)
        self.emulated = emulated_capacity
        if device.type == "cpu":
            self._resident = ResidentPeak()
            return
        self._backend = getattr(torch, device.type)
        acc = getattr(torch, "accelerator", None)
        cur = acc.current_accelerator() if acc is not None and acc.is_available() else None
        # torch.accelerator's memory API (2.8+) only serves the current accelerator type
        self._acc = acc if cur is not None and cur.type == device.type and hasattr(acc, "max_memory_allocated") else None

    def _call(self, name: str, *alts: str) -> Any:
        idx = self.device.index if self.device.type != "mps" else None
        for owner, fn in ((self._acc, name), *((self._backend, a) for a in (name, *alts))):
            f = getattr(owner, fn, None) if owner is not None else None
            if f is not None:
                return f(idx) if idx is not None else f()
        raise NotImplementedError(f"{self.device.type} has no {name}")

    def capacity(self) -> int:
        if self.emulated is not None:
            return self.emulated
        if self.device.type == "cpu":
            tr = active_tracker(self.device)
            return tr.capacity if tr is not None and tr.capacity is not None else host_limits().capacity_bytes
        if self.device.type == "mps":
            return int(self._backend.recommended_max_memory())
        return int(self._backend.get_device_properties(self.device).total_memory)

    def current(self) -> int:
        if self.device.type == "cpu":
            tr = active_tracker(self.device)
            return tr.live if tr is not None else resident_bytes()
        return int(self._call("memory_allocated", "current_allocated_memory"))

    def peak(self) -> int:
        if self.device.type == "cpu":
            tr = active_tracker(self.device)
            return tr.peak if tr is not None else self._resident.peak()
        try:
            return int(self._call("max_memory_allocated"))
        except NotImplementedError:  # older MPS has no peak statistic
            return self.current()

    def reset(self) -> None:
        self.synchronize()
        if self.device.type == "cpu":
            tr = active_tracker(self.device)
            if tr is not None:
                tr.reset_peak()
            else:
                self._resident.reset()
            return
        try:
            self._call("reset_peak_memory_stats")
        except NotImplementedError:
            pass

    def close(self) -> None:
        if self.device.type == "cpu":
            self._resident.close()


def gauge_for(device: torch.device, *, emulated_capacity: int | None = None) -> Gauge:
    """The gauge whose figure fails on ``device``; with ``emulated_capacity``, the emulation's.

    A new gauge each call (a host gauge holds the peak window it measures). On CPU an emulated capacity means a :class:`~batchpilot.memory.tracker.StorageTracker` with that
    capacity is (or will be) running when the gauge is read.
    """
    if device.type == "cpu":
        return TensorGauge(device) if emulated_capacity is not None else HostGauge(device)
    if device.type == "cuda":
        return DeviceGauge(device, emulated_capacity)
    return AllocatorGauge(device, emulated_capacity)
