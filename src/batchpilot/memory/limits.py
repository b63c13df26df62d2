"""Kinds of memory limit: what fails under each, and what a search may conclude from it.

A :class:`Limit` is one kind of limit a device or a process runs under. It answers the questions
the finder, the engine and the reports ask, so that none of them compares names:

* :attr:`~Limit.name` -- the figure that fails (``BatchPlan.memory``, ``StepResult.memory``, the
  ``"memory"`` of the CLI's JSON), :attr:`~Limit.binding` -- on a host, the limit's own name
  (``BatchPlan.binding_limit``, :attr:`HostLimits.binding`), :attr:`~Limit.label` -- a phrase for
  a report line;
* :attr:`~Limit.tracked` -- the figure is a storage tracker's exact count of tensor bytes;
  :attr:`~Limit.host` -- it is the host process's real memory;
* :attr:`~Limit.estimated` -- the capacity is an estimate, which a trial that runs above it raises;
* :attr:`~Limit.kills` -- past it the process is killed rather than an allocation failing;
* :attr:`~Limit.spills` -- a search's restore snapshot may go to a file to leave it more room;
* :meth:`~Limit.oom_bound` -- what an OOM's message proves the failed step needed.

The kinds: :data:`TENSORS` (an emulated capacity), :data:`DEVICE` (CUDA / HIP), :data:`ALLOCATED`
(MPS, XPU), and on a real CPU the :class:`HostLimit` kinds :data:`ADDRESS_SPACE` (``RLIMIT_AS``),
:data:`CGROUP` (a container) and :data:`RESIDENT` (the RAM). :func:`host_limits` reads every host
limit at one moment; the binding one is the one with the least headroom. A new kind of host limit
is a :class:`HostLimit` whose :meth:`~HostLimit.read` says its size and figure now, added with
:func:`register`: from then on it competes for binding, and the gauge, the finder and the reports
follow it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .host import (
    address_space_bytes, address_space_peak, available_bytes, cgroup_limit_and_use, resident_bytes, rlimit_as_bytes,
)

__all__ = [
    "Limit", "HostLimit", "HostLimits", "host_limits", "register", "unregister", "host_kinds", "limit_named",
    "TENSORS", "DEVICE", "ALLOCATED", "ADDRESS_SPACE", "CGROUP", "RESIDENT",
]


@dataclass(frozen=True, kw_only=True)
class Limit:
    """One kind of memory limit and what follows from it for a search.

    Attributes:
        name: the figure that fails under this limit, as reports name it (``"tensors"``,
            ``"device"``, ``"address_space"`` ...): ``BatchPlan.memory``, ``StepResult.memory``.
        label: the figure in words, for a summary ("address space", "resident memory").
        binding: on a host, the limit's own name (``"rlimit_as"``, ``"cgroup"``, ``"physical"``):
            ``BatchPlan.binding_limit`` and :attr:`HostLimits.binding`; ``None`` off a host.
        host: the figure is the host process's real memory (its address space, resident set or
            container charge), not a device allocator's count.
        tracked: the figure is a :class:`~batchpilot.memory.tracker.StorageTracker`'s count of
            tensor bytes: exact, the same for the same step, and blind inside compiled kernels.
        estimated: the capacity is an estimate of what the limit allows: a trial that runs to a
            peak above it without failing proves the capacity is at least that peak.
        kills: going over the limit kills the process instead of failing an allocation, so a
            trial predicted past it is not run.
        spills: a search's restore snapshot may be written to a file to leave this figure room.
            Not where the figure does not count the snapshot (an accelerator's or an emulation's
            copies are host memory it does not see), nor under ``RLIMIT_AS``, where a file mapped
            back in costs address space too, and right after a trial at the boundary there may
            be none.
    """

    name: str
    label: str
    binding: str | None = None
    host: bool = False
    tracked: bool = False
    estimated: bool = False
    kills: bool = False
    spills: bool = False

    def oom_bound(self, outcome: Any) -> int | None:
        """What an OOM proves the failed step needed, in this limit's figure; ``None`` when it proves nothing.

        ``outcome`` is the :class:`~batchpilot.memory.oom.Attempt` of the failed step. The
        allocator's own figures where it states them
        (:attr:`~batchpilot.memory.oom.OOMReport.min_peak_bytes`: the process's device memory plus
        the request on CUDA, the live bytes plus the request under emulation). A CPU allocator
        states only the request, which bounds nothing here: what the process held is not in the
        message (:data:`ADDRESS_SPACE` reads it from the process).
        """
        report = getattr(outcome, "report", None)
        if report is None or report.min_peak_bytes is None:
            return None
        if report.peak_basis == "request":
            return None  # a request alone bounds nothing: what the process held is not stated
        return int(report.min_peak_bytes)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, kw_only=True)
class HostLimit(Limit):
    """A limit on the host process's real memory: its size and its figure are read from the OS.

    A kind of its own overrides :meth:`read` (and :meth:`figure` where the figure alone is cheaper
    to read) and is added with :func:`register`. The built-in kinds read their figures through
    :func:`host_limits`'s fields instead (:meth:`reading`).
    """

    host: bool = True

    def read(self) -> tuple[int, int] | None:
        """``(limit bytes, figure bytes now)`` from the OS; ``None`` where this limit is not set."""
        return None

    def reading(self, limits: HostLimits) -> tuple[int, int] | None:
        """``(limit bytes, figure bytes)`` of this limit in the reading ``limits``; ``None`` if not set there."""
        return limits.others.get(self.binding or self.name)

    def figure(self) -> int | None:
        """The figure this limit counts, now; ``None`` where it cannot be read."""
        now = self.read()
        return None if now is None else now[1]

    def window_peak(self, hwm: int, start: tuple[int, int, int], now: int) -> int:
        """The figure's peak in a window, from the resident high-water mark ``hwm`` since it began.

        ``start`` is ``(figure, resident set, VmPeak)`` when the window began and ``now`` the
        figure now. Linux keeps a resettable high-water mark of the resident set only, so a
        figure other than the resident set peaks at its start plus the resident growth (new
        memory is mapped and written together).
        """
        figure, resident, _ = start
        return max(figure + max(0, hwm - resident), now)


@dataclass(frozen=True, kw_only=True)
class _AddressSpace(HostLimit):
    """``RLIMIT_AS``: the mapped address space, freed heap that stays mapped, JIT code and thread arenas included."""

    def reading(self, limits: HostLimits) -> tuple[int, int] | None:
        if limits.rlimit_as_bytes is None or limits.address_space_bytes is None:
            return None
        return limits.rlimit_as_bytes, limits.address_space_bytes

    def figure(self) -> int | None:
        return address_space_bytes()

    def window_peak(self, hwm: int, start: tuple[int, int, int], now: int) -> int:
        # the kernel's VmPeak is not resettable: exact when the window rose above every earlier
        # peak, otherwise the estimate from the resident growth, which cannot pass it
        figure, resident, vm_peak = start
        now_peak = address_space_peak()
        if now_peak is not None and now_peak > vm_peak:
            return now_peak
        grown = figure + max(0, hwm - resident)
        return max(min(grown, vm_peak) if vm_peak else grown, now)

    def oom_bound(self, outcome: Any) -> int | None:
        # an allocation past RLIMIT_AS fails when what is mapped plus the request passes it:
        # the mapping is read from the process as the error is raised (Attempt.mapped_bytes)
        report = getattr(outcome, "report", None)
        if report is not None and report.backend == "cpu":
            mapped = getattr(outcome, "mapped_bytes", None)
            if report.requested_bytes and mapped is not None:
                return mapped + report.requested_bytes
            return None
        return super().oom_bound(outcome)


@dataclass(frozen=True, kw_only=True)
class _Cgroup(HostLimit):
    """A memory cgroup: its working set (charge less the page cache the kernel reclaims before it kills)."""

    def reading(self, limits: HostLimits) -> tuple[int, int] | None:
        if limits.cgroup_limit_bytes is None:
            return None
        return limits.cgroup_limit_bytes, limits.cgroup_used_bytes or limits.resident_bytes

    def figure(self) -> int | None:
        return host_limits().cgroup_used_bytes


@dataclass(frozen=True, kw_only=True)
class _Resident(HostLimit):
    """No limit but the RAM: the resident set against what it holds plus what is available."""

    def reading(self, limits: HostLimits) -> tuple[int, int] | None:
        return limits.resident_bytes + max(0, limits.available_bytes), limits.resident_bytes

    def figure(self) -> int | None:
        return resident_bytes()

    def window_peak(self, hwm: int, start: tuple[int, int, int], now: int) -> int:
        return hwm  # the kernel's high-water mark is the figure's own


#: an emulated capacity: a storage tracker's tensor bytes on CPU (the emulation raises past it)
TENSORS = Limit(name="tensors", label="tensor bytes (emulated capacity)", tracked=True)
#: CUDA / HIP: reserved bytes plus everything outside PyTorch, what cudaMalloc runs out of
DEVICE = Limit(name="device", label="device memory (reserved + outside PyTorch)")
#: MPS, XPU (and any device's plain figure): the allocator's allocated bytes
ALLOCATED = Limit(name="allocated", label="allocated memory")
#: RLIMIT_AS: an allocation past it fails (and raises); a file mapped back in costs address space too
ADDRESS_SPACE = _AddressSpace(name="address_space", binding="rlimit_as", label="address space")
#: a container's memory cgroup: past it the kernel kills; the working set only estimates its charge
CGROUP = _Cgroup(name="cgroup", binding="cgroup", label="the container's memory",
                 estimated=True, kills=True, spills=True)
#: no limit but the RAM: the resident set; past it the OOM killer, not an error
RESIDENT = _Resident(name="resident", binding="physical", label="resident memory",
                     estimated=True, kills=True, spills=True)

# in the order ties are broken: the RAM first, then a container, then RLIMIT_AS, then registered kinds
_BUILT_IN = (RESIDENT, CGROUP, ADDRESS_SPACE)
_HOST: list[HostLimit] = list(_BUILT_IN)
_DEVICE = (TENSORS, DEVICE, ALLOCATED)


def host_kinds() -> tuple[HostLimit, ...]:
    """The host limit kinds that compete for binding, built-in and registered."""
    return tuple(_HOST)


def register(limit: HostLimit) -> HostLimit:
    """Add a kind of host limit: from now on :func:`host_limits` reads it and it may bind.

    Raises:
        TypeError: ``limit`` is not a :class:`HostLimit`.
        ValueError: its ``name`` or ``binding`` is already taken.
    """
    if not isinstance(limit, HostLimit):
        raise TypeError(f"register() takes a HostLimit (a host limit kind with a read()), got {type(limit).__name__}")
    key = limit.binding or limit.name
    for known in (*_HOST, *_DEVICE):
        if limit.name == known.name or key == (known.binding or known.name):
            raise ValueError(f"a limit kind named {limit.name!r} / {key!r} is already registered ({known!r}); "
                             "give the new kind names of its own")
    _HOST.append(limit)
    return limit


def unregister(limit: HostLimit) -> None:
    """Remove a kind added with :func:`register` (the built-in kinds stay).

    Raises:
        ValueError: ``limit`` is built in or was not registered.
    """
    if limit in _BUILT_IN or limit not in _HOST:
        raise ValueError(f"{limit.name!r} is not a registered limit kind; only kinds added with register() go")
    _HOST.remove(limit)


def limit_named(name: str) -> Limit | None:
    """The kind whose :attr:`~Limit.name` is ``name`` (a plan's ``memory``), built-in or registered; ``None`` if none is."""
    return next((kind for kind in (*_DEVICE, *_HOST) if kind.name == name), None)


@dataclass(frozen=True, kw_only=True)
class HostLimits:
    """What limits this process's memory, read at one moment.

    Attributes:
        resident_bytes: this process's resident set now.
        cgroup_limit_bytes: the smallest memory limit of this process's cgroup and its
            ancestors (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), or ``None``.
        cgroup_used_bytes: that cgroup's working set (usage less inactive page cache, which the
            kernel reclaims before it kills), this process included.
        rlimit_as_bytes: the soft ``RLIMIT_AS``, or ``None`` when unlimited.
        address_space_bytes: this process's mapped address space now (``VmSize``).
        available_bytes: the machine's ``MemAvailable``.
        others: ``{binding name: (limit bytes, figure bytes)}`` of the kinds added with
            :func:`register` that are set now.
    """

    resident_bytes: int
    cgroup_limit_bytes: int | None = None
    cgroup_used_bytes: int | None = None
    rlimit_as_bytes: int | None = None
    address_space_bytes: int | None = None
    available_bytes: int = 0
    others: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def _readings(self) -> Iterator[tuple[HostLimit, tuple[int, int]]]:
        for kind in _HOST:
            now = kind.reading(self)
            if now is not None:
                yield kind, now

    def headrooms(self) -> dict[str, int]:
        """How much more this process can hold before each limit, by binding name."""
        return {kind.binding or kind.name: size - used for kind, (size, used) in self._readings()}

    @property
    def limit(self) -> HostLimit:
        """The kind of limit that binds first: the one with the least headroom."""
        return min(self._readings(), key=lambda r: r[1][0] - r[1][1])[0]

    @property
    def binding(self) -> str:
        """The name of the limit that binds first: ``"cgroup"``, ``"rlimit_as"``, ``"physical"`` or a registered one's."""
        kind = self.limit
        return kind.binding or kind.name

    @property
    def capacity_bytes(self) -> int:
        """The resident size this process can reach: what it holds now plus the tightest headroom."""
        return self.resident_bytes + max(0, min(self.headrooms().values()))

    @property
    def kills(self) -> bool:
        """True when going over the binding limit kills the process rather than raising."""
        return self.limit.kills


def host_limits() -> HostLimits:
    """What limits this process's memory now (a handful of small file reads)."""
    limit, used = cgroup_limit_and_use()
    others = {}
    for kind in _HOST:
        now = None if kind in _BUILT_IN else kind.read()
        if now is not None:
            others[kind.binding or kind.name] = now
    return HostLimits(
        resident_bytes=resident_bytes(), cgroup_limit_bytes=limit, cgroup_used_bytes=used,
        rlimit_as_bytes=rlimit_as_bytes(), address_space_bytes=address_space_bytes(), available_bytes=available_bytes(),
        others=others,
    )
