"""Device-generic memory probes, peak measurement and an emulated capacity.

On accelerators the figures come from the caching allocator (``torch.accelerator``
where the installed torch has the memory functions, the backend module otherwise).
On CPU they come from :class:`StorageTracker`, a dispatch mode that counts the bytes
of every live tensor storage exactly; outside a tracker a CPU probe falls back to
the process's resident set size, which is only approximate.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten

from .compiled import eager_while_tracked
from .host import ResidentPeak, host_limits, resident_bytes

__all__ = [
    "parse_bytes",
    "format_bytes",
    "resolve_device",
    "MemoryProbe",
    "get_probe",
    "CpuProbe",
    "HostProbe",
    "StorageTracker",
    "active_tracker",
    "untracked",
    "PeakMeasurement",
    "track_peak",
    "emulate_capacity",
    "view_extent",
    "tensor_storages",
    "wraps_subclass",
    "watch_storage_resizes",
]

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_KNOWN_DEVICES = ("cpu", "cuda", "xpu", "mps")


def parse_bytes(size: int | float | str) -> int:
    """Parse a byte count: ``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"2G"``, ``"1.5GB"``.

    Binary units (KiB, MiB, GiB, TiB and the bare K, M, G, T) are powers of 1024,
    decimal ones (KB, MB, GB, TB) powers of 1000.

    Raises:
        ValueError: the size is not positive or the unit is unknown.
    """
    if isinstance(size, bool):
        raise ValueError(f"a memory size must be a number of bytes or a string like '2GiB', got {size!r}")
    if isinstance(size, (int, float)):
        value = int(size)
    else:
        m = _SIZE_RE.match(str(size))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {size!r} as a memory size; use bytes or a number with a unit "
                "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '2GiB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {size!r}")
    return value


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. ``'1.50 GiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def resolve_device(device: torch.device | str | int | None = None) -> torch.device:
    """Turn ``None`` / ``'cuda:1'`` / ``0`` into a ``torch.device``.

    ``None`` is the current accelerator if there is one, else the CPU.

    Raises:
        ValueError: the device type is not one of cpu, cuda, xpu, mps.
    """
    if device is None:
        acc = getattr(torch, "accelerator", None)
        cur = acc.current_accelerator() if acc is not None and acc.is_available() else None
        device = cur if cur is not None else "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"unknown device {device!r}; use one of {', '.join(_KNOWN_DEVICES)} "
            "optionally with an index, e.g. 'cuda:0'"
        ) from exc
    if dev.type not in _KNOWN_DEVICES:
        raise ValueError(f"unsupported device {device!r}; batchpilot measures {', '.join(_KNOWN_DEVICES)}")
    if dev.type != "cpu" and dev.index is None:
        backend = getattr(torch, dev.type)
        index = backend.current_device() if dev.type != "mps" and backend.is_available() else 0
        dev = torch.device(dev.type, index)
    return dev


# ---------------------------------------------------------------------------
# CPU: exact storage tracking


class StorageTracker(TorchDispatchMode):
    """Count the bytes of live tensor storages on one device, exactly.

    Every storage an operator returns is counted once (views share it) and
    released by a weakref callback when the storage is freed. Tensors that exist
    before the tracker starts are counted whole when :meth:`track` is given them
    (modules: parameters, buffers and gradients; optimizers: their state);
    otherwise, when an operator first reads them, by the bytes the view read
    covers: data from outside the step (``X[:8]`` of a dataset tensor ``X``)
    is host data, and only the part a step reads would be on a device.

    With ``capacity`` set, an operator whose new outputs would take the live
    bytes past it raises ``torch.OutOfMemoryError``: the CPU then behaves like a
    device of that size. Allocations made inside a kernel that never surface as
    tensors (scratch buffers) are invisible, as they are to every
    dispatch-level tracker.

    :meth:`paused` (or :func:`untracked` for every running tracker) switches
    the counting off for a block, e.g. for copies kept in host memory that are
    not device memory.

    ``torch.compile``'d code runs eagerly while a tracker runs (the eager program is what it
    counts) and is left compiled afterwards (:func:`batchpilot.compiled.eager_while_tracked`).
    """

    def __init__(self, device: torch.device | str = "cpu", capacity: int | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.capacity = capacity
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        # storages charged for less than their size: host data seen through views
        self._partial: set[int] = set()
        self._windows: list[PeakMeasurement] = []
        self._lock = threading.Lock()
        # per thread: another thread's operators are still device memory while one thread pauses
        self._pause = threading.local()
        self._eager: list[contextlib.AbstractContextManager] = []

    # -- bookkeeping ------------------------------------------------------
    def _release(self, key: int, _ref: Any) -> None:
        with self._lock:
            self._refs.pop(key, None)
            self._partial.discard(key)
            self.live -= self._sizes.pop(key, 0)

    def _bump_peak(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
        for w in self._windows:
            if self.live > w.peak_bytes:
                w.peak_bytes = self.live

    def _storage(self, t: Any) -> torch.UntypedStorage | None:
        if not isinstance(t, torch.Tensor) or t.device != self.device:
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested tensors own no plain storage
            return None

    def _add_storages(self, storages: Iterable[torch.UntypedStorage]) -> None:
        with self._lock:
            for st in storages:
                key = id(st)
                nbytes = st.nbytes()
                old = self._sizes.get(key)
                if old is None:
                    self._refs[key] = weakref.ref(st, lambda r, k=key: self._release(k, r))
                    self._sizes[key] = nbytes
                    self.live += nbytes
                elif old != nbytes:  # resize_ grew or shrank a storage in place (or host data now tracked whole)
                    self._sizes[key] = nbytes
                    self.live += nbytes - old
                self._partial.discard(key)
            self._bump_peak()

    def track(self, *objs: Any) -> StorageTracker:
        """Count tensors that already exist: modules, optimizers, tensors, or containers of them."""
        storages = []
        for obj in objs:
            for t in _tensors_of(obj):
                storages += [st for st in tensor_storages(t) if _on(st, t, self.device)]
        self._add_storages(storages)
        return self

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live

    @property
    def is_paused(self) -> bool:
        """True inside :meth:`paused` on the calling thread."""
        return getattr(self._pause, "depth", 0) > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[StorageTracker]:
        """Neither count nor limit the operators the calling thread runs in this block.

        Inside, new storages are not counted, ``capacity`` is not enforced and
        the peak (of the tracker and of every :func:`track_peak` window) does
        not move. Frees are still seen: a counted storage released inside
        leaves the count as usual. A tensor created inside is unknown to the
        tracker afterwards, like one made before the tracker started: it
        counts from the first operator that reads it outside a pause, or when
        given to :meth:`track`. Calls nest; :meth:`track` counts even while paused.

        Example::

            with tracker.paused():
                host_copy = weights.detach().clone()  # not device memory
        """
        self._pause.depth = getattr(self._pause, "depth", 0) + 1
        try:
            yield self
        finally:
            self._pause.depth -= 1

    # -- interception -----------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if wraps_subclass(types):
            # a DTensor (FSDP2's sharded parameters) runs its operator as operators on its local
            # tensors, which come back here: those hold the storages
            return NotImplemented
        if getattr(self._pause, "depth", 0):
            return func(*args, **kwargs)
        # tensors from outside the step (unseen, or host data seen through a view so far)
        host = [t for t in tree_flatten((args, kwargs))[0] if self._is_host(t)]
        host_keys = {id(self._storage(t)) for t in host}
        out = func(*args, **kwargs)
        fresh: dict[int, torch.UntypedStorage] = {}
        grown = []
        views = []
        for t in tree_flatten(out)[0]:
            st = self._storage(t)
            if st is None:
                continue
            key = id(st)
            old = self._sizes.get(key)
            if key in host_keys:
                views.append(t)  # a view of host data (a slice of a dataset): charged by what it covers
            elif old is None:
                fresh[key] = st
            elif old != st.nbytes():
                grown.append(st)
        request = sum(st.nbytes() for st in fresh.values())
        request += sum(st.nbytes() - self._sizes[id(st)] for st in grown)
        if self.capacity is not None and request > 0 and self.live + request > self.capacity:
            live, cap = self.live, self.capacity
            del out, fresh, grown
            raise torch.OutOfMemoryError(
                f"batchpilot emulated capacity exceeded on {self.device}: tried to allocate "
                f"{format_bytes(request)} ({request} bytes) in {func} with {live} bytes live; "
                f"capacity {format_bytes(cap)} ({cap} bytes)"
            )
        if fresh or grown:
            self._add_storages([*fresh.values(), *grown])
        # host data an operator read (not merely viewed) is charged by the view it read
        viewed = {id(self._storage(t)) for t in views}
        read = [t for t in host if id(self._storage(t)) not in viewed]
        if views or read:
            self._charge_host_views([*views, *read])
        return out

    def _is_host(self, t: Any) -> bool:
        st = self._storage(t)
        return st is not None and (id(st) not in self._sizes or id(st) in self._partial)

    def _charge_host_views(self, leaves: Iterable[Any]) -> None:
        """Count tensors that existed before the tracker by the bytes each view covers.

        A tensor the tracker has not seen is data from outside the step (a dataset tensor, a
        slice of it, a ``TensorDataset`` row a loader stacks): on a device only the part a step
        reads would be there, so ``X[:8]`` counts like ``X[:8].clone()`` and not like ``X``. A
        storage seen again through a wider view is charged up to that view (at most its size).
        """
        with self._lock:
            for t in leaves:
                st = self._storage(t)
                if st is None:
                    continue
                key = id(st)
                old = self._sizes.get(key)
                if old is not None and key not in self._partial:
                    continue
                size = st.nbytes()
                covered = min(size, view_extent(t))
                if old is None:
                    self._refs[key] = weakref.ref(st, lambda r, k=key: self._release(k, r))
                    self._sizes[key] = covered
                    self.live += covered
                    if covered < size:
                        self._partial.add(key)
                elif covered > old:
                    self._sizes[key] = covered
                    self.live += covered - old
                    if covered == size:
                        self._partial.discard(key)
            self._bump_peak()

    # -- storages resized in place (FSDP2 frees and re-allocates unsharded parameters so) -----
    def _pre_resize(self, st: torch.UntypedStorage, nbytes: int) -> None:
        if getattr(self._pause, "depth", 0) or st.device != self.device:
            return
        grow = nbytes - self._sizes.get(id(st), 0)
        if self.capacity is not None and grow > 0 and self.live + grow > self.capacity:
            raise torch.OutOfMemoryError(
                f"batchpilot emulated capacity exceeded on {self.device}: tried to allocate "
                f"{format_bytes(grow)} ({grow} bytes) in UntypedStorage.resize_ with {self.live} bytes live; "
                f"capacity {format_bytes(self.capacity)} ({self.capacity} bytes)"
            )

    def _post_resize(self, st: torch.UntypedStorage, nbytes: int) -> None:
        if st.device != self.device:
            return
        key = id(st)
        with self._lock:
            old = self._sizes.get(key)
            if old is None:
                if getattr(self._pause, "depth", 0) or nbytes == 0:
                    return
                self._refs[key] = weakref.ref(st, lambda r, k=key: self._release(k, r))
                old = 0
            self._sizes[key] = nbytes
            self._partial.discard(key)
            self.live += nbytes - old
            self._bump_peak()

    def __enter__(self) -> StorageTracker:
        # dynamo skips frames under a dispatch mode and never compiles them again: compiled
        # models run eagerly while tracked instead (batchpilot.compiled)
        eager = eager_while_tracked()
        eager.__enter__()
        self._eager.append(eager)
        _ACTIVE.append(self)
        _RESIZE_WATCHERS.append(self)
        _patch_resize()
        try:
            return super().__enter__()
        except BaseException:
            _ACTIVE.remove(self)
            _RESIZE_WATCHERS.remove(self)
            _patch_resize()
            self._eager.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            _RESIZE_WATCHERS.remove(self)
            _patch_resize()
            self._eager.pop().__exit__(None, None, None)


_ACTIVE: list[StorageTracker] = []


# ---------------------------------------------------------------------------
# Tensor subclasses and in-place storage resizes: what a dispatch mode does not see by itself


def wraps_subclass(types: Iterable[type]) -> bool:
    """Whether an operator's ``types`` include a wrapper subclass (``DTensor``) that desugars it.

    A dispatch mode runs before tensor subclasses; returning ``NotImplemented`` for such an
    operator lets the subclass run it as operators on its inner tensors, which the mode sees.
    """
    return any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types)


def tensor_storages(t: Any) -> list[torch.UntypedStorage]:
    """The storages that hold ``t``'s bytes: its own, or its inner tensors' for a ``DTensor``."""
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return [st for a in attrs for st in tensor_storages(getattr(t, a))]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse / nested tensors own no plain storage
        return []


def _on(st: torch.UntypedStorage, t: torch.Tensor, device: torch.device) -> bool:
    return st.device == device if hasattr(st, "device") else t.device == device


#: objects with ``_pre_resize(storage, nbytes)`` (may raise) and ``_post_resize(storage, nbytes)``
_RESIZE_WATCHERS: list[Any] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_
_resize_lock = threading.Lock()


def _watched_resize(st: torch.UntypedStorage, size: int) -> Any:
    watchers = list(_RESIZE_WATCHERS)
    for w in watchers:
        w._pre_resize(st, int(size))
    out = _ORIGINAL_RESIZE(st, size)
    for w in watchers:
        w._post_resize(st, int(size))
    return out


def _patch_resize() -> None:
    """``UntypedStorage.resize_`` is not a dispatched operator: watch it while anyone listens."""
    with _resize_lock:
        torch.UntypedStorage.resize_ = _watched_resize if _RESIZE_WATCHERS else _ORIGINAL_RESIZE


@contextlib.contextmanager
def watch_storage_resizes(watcher: Any) -> Iterator[None]:
    """Call ``watcher._pre_resize(storage, nbytes)`` / ``_post_resize`` around every storage resize.

    FSDP2 allocates and frees its unsharded parameters with ``UntypedStorage.resize_``, which no
    dispatch mode sees; :class:`StorageTracker` and the planner's counter listen here.
    """
    _RESIZE_WATCHERS.append(watcher)
    _patch_resize()
    try:
        yield
    finally:
        _RESIZE_WATCHERS.remove(watcher)
        _patch_resize()


def view_extent(t: torch.Tensor) -> int:
    """Bytes of storage a view spans, from its first element to its last."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * abs(step) for n, step in zip(t.shape, t.stride()))
    return span * t.element_size()


def active_tracker(device: torch.device | str = "cpu") -> StorageTracker | None:
    """The innermost :class:`StorageTracker` running for ``device``, if any."""
    dev = torch.device(device)
    for tr in reversed(_ACTIVE):
        if tr.device == dev:
            return tr
    return None


@contextlib.contextmanager
def untracked(device: torch.device | str | None = "cpu") -> Iterator[list[StorageTracker]]:
    """Pause every :class:`StorageTracker` running for ``device`` (``None``: every device).

    The public way to allocate memory that is not device memory while a
    tracker runs — a snapshot's host copies, say: nothing the calling thread
    allocates in the block is counted or limited (see
    :meth:`StorageTracker.paused`). Trackers started inside the block are not
    paused. Without a running tracker it does nothing. Yields the paused trackers.
    """
    dev = None if device is None else torch.device(device)
    trackers = [tr for tr in _ACTIVE if dev is None or tr.device == dev]
    with contextlib.ExitStack() as stack:
        for tr in trackers:
            stack.enter_context(tr.paused())
        yield trackers


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors_of(state)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors_of(v)
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):  # GradScaler and friends
        yield from _tensors_of(obj.state_dict())


# ---------------------------------------------------------------------------
# Probes


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

    Outside a tracker the figures are the resident set (:mod:`batchpilot.host`): ``allocated``
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
