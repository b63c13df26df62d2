"""Exact storage tracking on the CPU: a dispatch mode that counts the bytes of every live tensor storage.

:class:`StorageTracker` counts (and, with a capacity, limits) the storages operators return;
:func:`active_tracker` and :func:`untracked` find and pause the running ones. The counting itself
(:class:`StorageLedger`) and the helpers for what a dispatch mode does not see by itself (tensor
subclasses, in-place storage resizes) are shared with the planner's counter
(:mod:`batchpilot.plan.planner`), so that the two agree to the byte.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..core.compiled import eager_while_tracked
from .units import format_bytes

__all__ = [
    "StorageLedger",
    "StorageTracker",
    "active_tracker",
    "untracked",
    "view_extent",
    "tensor_leaves",
    "tensor_storages",
    "wraps_subclass",
    "watch_storage_resizes",
    "tensors_of",
]


class StorageLedger:
    """The live bytes of a set of storages, and their peak: the one ledger of the tracker and the planner.

    A storage is new the first time it is charged, and a weakref then releases it when the
    storage is freed (``on_release(key, nbytes)`` hears it); charged again at another size
    (``resize_``, or a wider view of host data) it changes by the difference. A storage charged
    through views (:meth:`charge_view`) is *host data*, charged by the part the widest view
    covers -- all of it, when a view spans the whole storage -- and stays host data until it is
    charged whole by :meth:`charge`; :meth:`forget_host` drops it. The peak moves only at
    :meth:`bump_peak`, so a caller charging several storages for one operator raises it once,
    after all of them.

    Args:
        lock: held while a freed storage is released (the weakref callback may run on any
            thread); the caller holds it around its own calls.
        on_release: called with the storage's key and bytes after it was released.
    """

    def __init__(self, *, lock: contextlib.AbstractContextManager | None = None,
                 on_release: Callable[[int, int], None] | None = None) -> None:
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._host: set[int] = set()
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._on_release = on_release

    def size(self, key: int) -> int | None:
        """The bytes charged for the storage ``id(storage) == key``; ``None`` when it is not in the ledger."""
        return self._sizes.get(key)

    def is_host(self, key: int) -> bool:
        """Whether that storage is host data, charged through the views read of it (:meth:`charge_view`)."""
        return key in self._host

    def charge(self, st: torch.UntypedStorage, nbytes: int) -> int:
        """Charge ``st`` ``nbytes``, as memory of its own (no host data); the change in live bytes."""
        self._host.discard(id(st))
        return self._set(st, nbytes)

    def _set(self, st: torch.UntypedStorage, nbytes: int) -> int:
        key = id(st)
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._release(k))
            old = 0
        self._sizes[key] = nbytes
        self.live += nbytes - old
        return nbytes - old

    def charge_view(self, st: torch.UntypedStorage, view: torch.Tensor) -> None:
        """Charge host data ``st`` by the bytes ``view`` covers; a wider view later charges up to it.

        A view spanning the whole storage charges all of it and leaves it host data: what it is
        does not depend on how much of it was read. A storage charged whole by :meth:`charge`
        (a step's own memory) is left as it is.
        """
        key = id(st)
        old = self._sizes.get(key)
        if old is not None and key not in self._host:
            return
        covered = min(st.nbytes(), view_extent(view))
        if old is None or covered > old:
            self._set(st, covered)
            self._host.add(key)

    def make_host(self, st: torch.UntypedStorage) -> int:
        """Count ``st`` as host data from now on, charged by the views read of it; the bytes released.

        A storage charged whole (made while a tracker ran: a loader's stacked batch), or host
        data charged by the views read so far, drops to nothing charged, and its next views
        charge what they cover. Unseen, it is left as it is.
        """
        key = id(st)
        old = self._sizes.get(key)
        if old is None:
            return 0
        self._sizes[key] = 0
        self._host.add(key)
        self.live -= old
        return old

    @property
    def host_bytes(self) -> int:
        """Bytes charged for host data (storages charged through views)."""
        return sum(self._sizes.get(key, 0) for key in self._host)

    def forget_host(self) -> int:
        """Drop every storage of host data from the ledger (no release is heard); the bytes dropped."""
        freed = 0
        for key in list(self._host):
            freed += self._sizes.pop(key, 0)
            self._refs.pop(key, None)
        self._host.clear()
        self.live -= freed
        return freed

    def bump_peak(self) -> bool:
        """Raise the peak to the live bytes; whether it rose."""
        if self.live > self.peak:
            self.peak = self.live
            return True
        return False

    def reset_peak(self) -> None:
        self.peak = self.live

    def _release(self, key: int) -> None:
        with self._lock:
            self._refs.pop(key, None)
            self._host.discard(key)
            nbytes = self._sizes.pop(key, None)
            if nbytes is None:
                return
            self.live -= nbytes
            if self._on_release is not None:
                self._on_release(key, nbytes)


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
    dispatch-level tracker. Fake tensors (``FakeTensorMode``, such as DTensor's sharding
    propagation makes at the full unsharded shape) own no memory and are never counted.

    A collective (``c10d``'s operators: FSDP2's all-gathers and reduce-scatters, DDP's
    all-reduces) runs on uncounted copies of its tensors, to completion, and its results are
    copied back: gloo's worker thread holds a collective's tensors until it is done with the work,
    a moment that varies from run to run, and a counted buffer it dropped last would leave the
    count at that moment instead of when this thread let go of it, so the peak of a sharded step
    would vary with it. Point-to-point operators and barriers run as they are (waiting on a
    ``recv`` before the matching ``send`` could hang). A storage still freed on another thread
    (one the code under the tracker hands to a thread of its own) races with this thread's next
    allocations: the peak is reproducible only to within :attr:`foreign_release_bytes`, the
    largest of them.

    :meth:`paused` (or :func:`untracked` for every running tracker) switches
    the counting off for a block, e.g. for copies kept in host memory that are
    not device memory.

    ``torch.compile``'d code runs eagerly while a tracker runs (the eager program is what it
    counts) and is left compiled afterwards (:func:`batchpilot.core.compiled.eager_while_tracked`).

    With ``host_data=False`` data from outside the step is never charged, views or not: what is
    measured is the memory a step adds to a process that already holds that data (a host's real
    memory, where ``X[:8]`` of a resident ``X`` costs nothing more).
    """

    def __init__(self, device: torch.device | str = "cpu", capacity: int | None = None, *,
                 host_data: bool = True) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.capacity = capacity
        self.host_data = host_data
        self._lock = threading.Lock()
        self._ledger = StorageLedger(lock=self._lock, on_release=self._released)
        self._home = threading.get_ident()
        self.foreign_release_bytes = 0
        # the open track_peak regions (probes.PeakMeasurement), whose peak_bytes this raises
        self._windows: list[Any] = []
        self._timelines: list[list[int]] = []
        # per thread: another thread's operators are still device memory while one thread pauses
        self._pause = threading.local()
        self._eager: list[contextlib.AbstractContextManager] = []
        self._resizes: list[contextlib.AbstractContextManager] = []

    # -- bookkeeping ------------------------------------------------------
    @property
    def live(self) -> int:
        """Bytes of the live storages counted."""
        return self._ledger.live

    @property
    def peak(self) -> int:
        """The most :attr:`live` has been since the start or :meth:`reset_peak`."""
        return self._ledger.peak

    @property
    def host_view_bytes(self) -> int:
        """The part of :attr:`live` that is host data seen through views (see :meth:`forget_host_views`)."""
        with self._lock:
            return self._ledger.host_bytes

    @contextlib.contextmanager
    def window(self, region: Any) -> Iterator[Any]:
        """Raise ``region.peak_bytes`` to :attr:`live` at every new peak while the block runs.

        ``region`` is a :class:`~batchpilot.memory.probes.PeakMeasurement` (what
        :func:`~batchpilot.memory.probes.track_peak` yields): its ``extra["foreign_release_bytes"]``
        is raised to the largest storage another thread released meanwhile.
        """
        self._windows.append(region)
        try:
            yield region
        finally:
            self._windows.remove(region)

    def _released(self, key: int, nbytes: int) -> None:
        if threading.get_ident() == self._home:
            return
        self.foreign_release_bytes = max(self.foreign_release_bytes, nbytes)
        for w in self._windows:
            w.extra["foreign_release_bytes"] = max(nbytes, w.extra.get("foreign_release_bytes", 0))

    def charged(self, t: torch.Tensor) -> int | None:
        """The bytes counted for ``t``'s storage, ``None`` when uncounted.

        Less than the storage's size for host data seen through views.
        """
        st = self._storage(t)
        return None if st is None else self._ledger.size(id(st))

    def _bump_peak(self) -> None:
        self._ledger.bump_peak()
        for w in self._windows:
            if self.live > w.peak_bytes:
                w.peak_bytes = self.live
        for timeline in self._timelines:
            # a change of the live bytes, not every operator: reading one more row of host data
            # per sample (a loader's per-index fetch) changes nothing, and must not make the
            # timelines of two batch sizes differ in length
            if not timeline or timeline[-1] != self.live:
                timeline.append(self.live)

    def _storage(self, t: Any) -> torch.UntypedStorage | None:
        # fake tensors own no memory; they reach this mode from a FakeTensorMode beneath it (fake
        # modes run after user modes), e.g. DTensor's sharding propagation at the full unsharded shape
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device != self.device:
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested tensors own no plain storage
            return None

    def _add_storages(self, storages: Iterable[torch.UntypedStorage]) -> None:
        with self._lock:
            for st in storages:
                # new, or resized in place, or host data now tracked whole
                self._ledger.charge(st, st.nbytes())
            self._bump_peak()

    def forget_host_views(self) -> int:
        """Stop charging host data seen through views (a dataset's slices); the bytes released.

        Such data is charged by the widest view read so far, as if that part were on the device.
        A device holds only the current batch: between runs of a step (trials of a search) the
        charge is dropped, so each run pays for its own slice and not for the widest one before it.
        """
        with self._lock:
            return self._ledger.forget_host()

    def treat_as_host(self, *objs: Any) -> int:
        """Count the tensors of ``objs`` as host data: only the views read of them are charged; the bytes released.

        Data a caller holds outside the step (the global batch handed to a training step, cut there
        into micro-batches) would be in host memory, with only the micro-batch running on a device;
        made while this tracker ran (a ``DataLoader`` stacking it), it was charged whole as memory
        of the device. Called again once the step is over, it releases what the step's views were
        charged. ``objs`` as for :meth:`track`.
        """
        freed = 0
        with self._lock:
            for obj in objs:
                for t in tensors_of(obj):
                    for st in tensor_storages(t):
                        if _on(st, t, self.device):
                            freed += self._ledger.make_host(st)
        return freed

    def track(self, *objs: Any) -> StorageTracker:
        """Count tensors that already exist: modules, optimizers, tensors, or containers of them."""
        storages = []
        for obj in objs:
            for t in tensors_of(obj):
                storages += [st for st in tensor_storages(t) if _on(st, t, self.device)]
        self._add_storages(storages)
        return self

    def reset_peak(self) -> None:
        with self._lock:
            self._ledger.reset_peak()

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[int]]:
        """Record the live bytes each time an operator in the block changes them: its timeline.

        Two runs of one step at different batch sizes give a :class:`~batchpilot.search.TensorModel`.
        """
        timeline: list[int] = []
        with self._lock:
            self._timelines.append(timeline)
        try:
            yield timeline
        finally:
            with self._lock:
                self._timelines.remove(timeline)

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
        if getattr(func, "namespace", None) == "c10d" and func.__name__.split(".")[0] not in _UNSTAGED:
            return self._collective(func, args, kwargs)
        # tensors from outside the step (unseen, or host data seen through a view so far)
        host = [t for t in tensor_leaves((args, kwargs)) if self._is_host(t)]
        host_keys = {id(self._storage(t)) for t in host}
        out = func(*args, **kwargs)
        fresh: dict[int, torch.UntypedStorage] = {}
        grown = []
        views = []
        for t in tensor_leaves(out):
            st = self._storage(t)
            if st is None:
                continue
            key = id(st)
            old = self._ledger.size(key)
            if key in host_keys:
                views.append(t)  # a view of host data (a slice of a dataset): charged by what it covers
            elif old is None:
                fresh[key] = st
            elif old != st.nbytes():
                grown.append(st)
        request = sum(st.nbytes() for st in fresh.values())
        request += sum(st.nbytes() - self._ledger.size(id(st)) for st in grown)
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
        if (views or read) and self.host_data:
            self._charge_host_views([*views, *read])
        return out

    def _collective(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run a collective on uncounted copies of this device's tensors to completion; copy the results back.

        The copies are made inside this mode's handler, where the mode is off, so they are
        neither counted nor limited, and nor is what the backend makes of them: whichever thread
        frees them, the count does not move. The tensors the operator returns are the ones it
        wrote (its outputs, in place); they go back into the caller's tensors, which only the
        caller holds, so they leave the count when it lets go of them. The caller gets a work that
        is already done, whose future holds its own tensors: waiting on gloo's work again would
        run gloo's copy-out (a reduce-scatter splits a tensor of its own) under this mode.
        """
        from torch.distributed.distributed_c10d import Work

        originals: dict[int, torch.Tensor] = {}

        def stage(t: Any) -> Any:
            if self._storage(t) is None:
                return t
            copy = t.clone()
            originals[id(copy)] = t
            return copy

        restored: set[int] = set()

        def restore(t: Any) -> Any:
            original = originals.get(id(t)) if isinstance(t, torch.Tensor) else None
            if original is None:
                return t
            if id(t) not in restored:  # the work's future and the operator return the same tensors
                original.copy_(t)
                restored.add(id(t))
            return original

        staged_args, staged_kwargs = tree_map(stage, (args, kwargs))
        if not originals:  # nothing on this device: the collective is not this tracker's
            return func(*args, **kwargs)
        out = func(*staged_args, **staged_kwargs)
        leaves, spec = tree_flatten(out)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "wait"):
                work = Work.unbox(leaf)
                work.wait()
                try:
                    value = work.get_future().value()
                except RuntimeError:  # a work without a future
                    value = None
                done: torch.futures.Future = torch.futures.Future()
                done.set_result(tree_map(restore, value))
                leaves[i] = torch._C._distributed_c10d._create_work_from_future(done).boxed()
        return tree_unflatten([restore(leaf) for leaf in leaves], spec)

    def _is_host(self, t: Any) -> bool:
        st = self._storage(t)
        return st is not None and (self._ledger.size(id(st)) is None or self._ledger.is_host(id(st)))

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
                if st is not None:
                    self._ledger.charge_view(st, t)
            self._bump_peak()

    # -- storages resized in place (FSDP2 frees and re-allocates unsharded parameters so) -----
    def _pre_resize(self, st: torch.UntypedStorage, nbytes: int) -> None:
        if getattr(self._pause, "depth", 0) or st.device != self.device:
            return
        grow = nbytes - (self._ledger.size(id(st)) or 0)
        if self.capacity is not None and grow > 0 and self.live + grow > self.capacity:
            raise torch.OutOfMemoryError(
                f"batchpilot emulated capacity exceeded on {self.device}: tried to allocate "
                f"{format_bytes(grow)} ({grow} bytes) in UntypedStorage.resize_ with {self.live} bytes live; "
                f"capacity {format_bytes(self.capacity)} ({self.capacity} bytes)"
            )

    def _post_resize(self, st: torch.UntypedStorage, nbytes: int) -> None:
        if st.device != self.device:
            return
        with self._lock:
            if self._ledger.size(id(st)) is None and (getattr(self._pause, "depth", 0) or nbytes == 0):
                return
            self._ledger.charge(st, nbytes)
            self._bump_peak()

    def __enter__(self) -> StorageTracker:
        # dynamo skips frames under a dispatch mode and never compiles them again: compiled
        # models run eagerly while tracked instead (batchpilot.core.compiled)
        eager = eager_while_tracked()
        eager.__enter__()
        self._eager.append(eager)
        self._home = threading.get_ident()
        _ACTIVE.append(self)
        resizes = watch_storage_resizes(self._post_resize, self._pre_resize)
        resizes.__enter__()
        self._resizes.append(resizes)
        try:
            return super().__enter__()
        except BaseException:
            _ACTIVE.remove(self)
            self._resizes.pop().__exit__(None, None, None)
            self._eager.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            self._resizes.pop().__exit__(None, None, None)
            self._eager.pop().__exit__(None, None, None)


_ACTIVE: list[StorageTracker] = []

#: ``c10d`` operators run as they are: point-to-point ones (a blocking ``recv`` issued before this
#: rank's ``send`` would hang both) and barriers (no data)
_UNSTAGED = frozenset({"send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_"})


# ---------------------------------------------------------------------------
# Tensor subclasses and in-place storage resizes: what a dispatch mode does not see by itself


def wraps_subclass(types: Iterable[type]) -> bool:
    """Whether an operator's ``types`` include a wrapper subclass (``DTensor``) that desugars it.

    A dispatch mode runs before tensor subclasses; returning ``NotImplemented`` for such an
    operator lets the subclass run it as operators on its inner tensors, which the mode sees.
    """
    return any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results: nested tuples, lists and dict values.

    What ``tree_flatten(tree)[0]`` filtered to tensors gives for the containers an ATen operator
    takes and returns (a ``torch.return_types`` result is a tuple), at a fifth of its cost: the
    dispatch modes call it twice for every operator a tracked step runs, and torch's general
    pytree walk was a third of a tracked step's time on CPU.
    """
    if isinstance(tree, torch.Tensor):
        return [tree]
    out: list[torch.Tensor] = []
    _collect_tensors(tree, out)
    return out


def _collect_tensors(tree: Any, out: list[torch.Tensor]) -> None:
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (tuple, list)) else ()
    for x in items:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list, dict)):
            _collect_tensors(x, out)


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


#: a hook on a storage resized in place: ``hook(storage, new size in bytes)``
ResizeHook = Callable[[torch.UntypedStorage, int], None]

#: ``(before, after)`` pairs of ``f(storage, nbytes)`` around every resize (``before`` may raise)
_RESIZE_WATCHERS: list[tuple[ResizeHook | None, ResizeHook]] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_
_resize_lock = threading.Lock()


def _watched_resize(st: torch.UntypedStorage, size: int) -> Any:
    watchers = list(_RESIZE_WATCHERS)
    for before, _ in watchers:
        if before is not None:
            before(st, int(size))
    out = _ORIGINAL_RESIZE(st, size)
    for _, after in watchers:
        after(st, int(size))
    return out


def _patch_resize() -> None:
    """``UntypedStorage.resize_`` is not a dispatched operator: watch it while anyone listens."""
    with _resize_lock:
        torch.UntypedStorage.resize_ = _watched_resize if _RESIZE_WATCHERS else _ORIGINAL_RESIZE


@contextlib.contextmanager
def watch_storage_resizes(after: ResizeHook, before: ResizeHook | None = None) -> Iterator[None]:
    """Call ``before(storage, nbytes)`` (which may raise, refusing it) and ``after(storage, nbytes)`` around every storage resize.

    FSDP2 allocates and frees its unsharded parameters with ``UntypedStorage.resize_``, which no
    dispatch mode sees; :class:`StorageTracker` and the planner's counter listen here.
    """
    hooks = (before, after)
    _RESIZE_WATCHERS.append(hooks)
    _patch_resize()
    try:
        yield
    finally:
        _RESIZE_WATCHERS.remove(hooks)
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


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors ``obj`` holds: a tensor and its gradient; a module's parameters, their gradients
    and its buffers; an optimizer's state; those of a dict's values or a sequence's items; those of
    any other object's ``state_dict()`` (a ``GradScaler``). A tensor may come more than once."""
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
            yield from tensors_of(state)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from tensors_of(v)
    elif hasattr(obj, "state_dict") and callable(obj.state_dict):  # GradScaler and friends
        yield from tensors_of(obj.state_dict())
