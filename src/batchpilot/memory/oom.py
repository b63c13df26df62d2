"""Recognise out-of-memory errors on every backend, read what they say, and recover.

Recovery must happen *outside* the ``except`` block: while the exception is
alive its traceback holds every frame of the failed attempt, and with them the
activations that filled the memory. :func:`attempt` makes that the easy path.
:func:`parse_oom_message` reads the allocator's figures out of the message
(:class:`OOMReport`), so that every OOM bounds the memory the step needed.
"""

from __future__ import annotations

import gc
import logging
import math
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Generic, TypeVar

import torch

from .._checks import check_int
from .host import address_space_bytes, rlimit_as_bytes, trim_host_memory

__all__ = [
    "is_oom", "is_fatal_device_error", "is_onednn_failure", "recover_onednn", "free_memory", "attempt", "Attempt",
    "OOMReport", "parse_oom_message",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# cuDNN cannot get the workspace it asked for; the cure is the same as for an OOM
_CUDNN_WORKSPACE = "cudnn_status_not_supported. this error may appear if you passed in a non-contiguous input"
# Substrings that identify an OOM raised as a plain RuntimeError.
_OOM_MESSAGES = (
    # MPS: RuntimeError("MPS backend out of memory (MPS allocated: ...)")
    "mps backend out of memory",
    # CPU: c10's DefaultCPUAllocator when malloc/posix_memalign fails (RLIMIT_AS, cgroup, overcommit off)
    "defaultcpuallocator: can't allocate memory",
    # CPU: NNPACK's scratch allocation fails this way under the same limits
    "posix_memalign failed:cannot allocate memory",
    # CPU: C++'s operator new failing inside an operator (a container of a kernel under RLIMIT_AS), which
    # pybind11 and c10 re-raise as a RuntimeError with what() as the whole message
    "std::bad_alloc",
    # CUDA on torch builds that still raise RuntimeError rather than OutOfMemoryError
    "cuda out of memory",
    _CUDNN_WORKSPACE,
    # XPU / HIP allocators on older builds
    "xpu out of memory",
    "hip out of memory",
)

# oneDNN (CPU convolutions, matmuls) reports a failed allocation of its JIT code or scratch buffers
# as a plain failure to create a primitive, which also means "not implemented": only host memory
# pressure at the moment it was raised says which (see _host_memory_is_short)
_ONEDNN_MESSAGES = ("could not create a primitive", "could not create a memory")
#: within this much of RLIMIT_AS (or of strict overcommit's commit limit), or 1/32 of it if larger,
#: a oneDNN creation failure is taken for an allocation failure. Measured here: oneDNN fails so
#: with under 2 MiB of address space left; its scratch buffers for a large batch are bigger.
_SHORT_BYTES = 128 * 2**20

# Errors after which the device context is unusable: retrying only hides the real bug.
_FATAL_MESSAGES = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
)


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for device errors that must never be retried (the context is corrupt)."""
    msg = str(exc).lower()
    return any(m in msg for m in _FATAL_MESSAGES)


def is_oom(exc: BaseException) -> bool:
    """Return True when ``exc`` means the device ran out of memory.

    Recognises ``torch.OutOfMemoryError`` (CUDA, HIP, XPU and batchpilot's
    emulated capacity), MPS's and the CPU allocator's ``RuntimeError`` messages,
    and cuDNN's out-of-workspace ``CUDNN_STATUS_NOT_SUPPORTED``. oneDNN's
    ``could not create a primitive`` counts only when memory is its cause: when it is
    raised with the process within reach of its address-space limit (``RLIMIT_AS``, or the
    commit limit under strict overcommit), where a failed mapping of its JIT code or scratch
    buffers is what it reports; call this where it was raised, before the failed step's
    memory is let go. A ``RuntimeError`` raised ``from`` an OOM counts as that OOM: DTensor's
    dispatch re-raises an error from its sharding propagation so ("Sharding propagation failed
    for ..."). Errors that leave the device unusable (illegal memory access), and
    errors marked ``retryable = False`` (an aborted FSDP step that quotes its OOM), are never OOM.
    """
    seen: set[int] = set()
    while isinstance(exc, BaseException) and id(exc) not in seen:
        if is_fatal_device_error(exc):
            return False
        if getattr(exc, "retryable", True) is False:
            # e.g. batchpilot.dist.fsdp.CollectiveOOMError: it quotes an OOM, but its process group is gone
            return False
        if _is_oom_itself(exc):
            return True
        if not isinstance(exc, RuntimeError):
            return False
        # a wrapper (DTensor's "Sharding propagation failed for ...") keeps the OOM as its cause
        seen.add(id(exc))
        exc = exc.__cause__
    return False


def _is_oom_itself(exc: BaseException) -> bool:
    """:func:`is_oom` for one retryable exception, its cause aside."""
    # CUDA, HIP, XPU and the emulated capacity all raise this type
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        if any(m in msg for m in _OOM_MESSAGES):
            return True
        if any(m in msg for m in _ONEDNN_MESSAGES):
            global _onednn_ran_out
            # once oneDNN failed to map its JIT code, it creates no new primitive again in this
            # process however much memory is free (measured with oneDNN 3.12): every later
            # creation failure is that OOM's after-effect, which recover_onednn() ends
            if _onednn_ran_out or _host_memory_is_short():
                _onednn_ran_out = True
                return True
    return False


#: oneDNN failed to create a primitive for want of memory in this process (see is_oom)
_onednn_ran_out = False


def is_onednn_failure(exc: BaseException) -> bool:
    """True for oneDNN's failure to create a primitive (which :func:`is_oom` takes for an OOM near a limit)."""
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _ONEDNN_MESSAGES)


def recover_onednn() -> bool:
    """After oneDNN ran out of memory creating a primitive, turn its CPU kernels off; True if this call did.

    oneDNN 3.12 creates no new primitive in a process where a creation once failed for want of
    memory, even with the memory back: convolutions at any new shape then fail. PyTorch's own
    kernels take over (``torch.backends.mkldnn.enabled = False``): slower, and with their own
    memory needs, but the job goes on. Logged once as a warning.
    """
    if not _onednn_ran_out or not torch.backends.mkldnn.enabled:
        return False
    torch.backends.mkldnn.enabled = False
    logger.warning("oneDNN ran out of memory creating a kernel and creates none since (a oneDNN limitation): its "
                   "CPU kernels are off for the rest of this process (torch.backends.mkldnn.enabled = False); "
                   "PyTorch's own kernels run instead, slower and with other memory needs")
    return True


def _host_memory_is_short() -> bool:
    """True when this process can map little more: near ``RLIMIT_AS``, or near the commit limit under
    strict overcommit (the two ways a host allocation fails instead of the process being killed).

    Cheap reads only: at the edge of the limit even opening a file can fail for want of memory,
    which under ``RLIMIT_AS`` is itself the answer.
    """
    rlimit = rlimit_as_bytes()
    if rlimit is not None:
        mapped = address_space_bytes()
        if mapped is None or rlimit - mapped < max(_SHORT_BYTES, rlimit // 32):
            return True
    commit = _commit_room()
    return commit is not None and commit[0] < max(_SHORT_BYTES, commit[1] // 32)


def _commit_room() -> tuple[int, int] | None:
    """``(CommitLimit - Committed_AS, CommitLimit)`` under strict overcommit (mode 2), else ``None``."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            if f.read().strip() != "2":
                return None
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields["CommitLimit"] - fields["Committed_AS"], fields["CommitLimit"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def free_memory(device: torch.device | str | None = None, *, generation: int = 2) -> None:
    """Collect garbage and release the backend's cached blocks; never raises.

    On CPU the C library's freed heap is handed back to the OS (``malloc_trim``), so that the
    resident size measures what is live again.

    Args:
        device: the device whose cache to release; ``None`` releases every
            backend that is initialised.
        generation: the oldest garbage-collector generation to collect. A full collection
            (2) walks every object of the process, which once torch.compile's modules are
            loaded takes a second on a busy machine; the garbage of one step is young (1).
    """
    gc.collect(generation)
    kind = torch.device(device).type if device is not None else None
    if kind in (None, "cpu"):
        trim_host_memory()
    for name in ("cuda", "xpu", "mps"):
        if kind is not None and kind != name:
            continue
        mod = getattr(torch, name, None)
        if mod is None:
            continue
        try:
            # is_initialized avoids creating a context just to empty it
            check = getattr(mod, "is_initialized", None) or mod.is_available
            if check():
                mod.empty_cache()
        except Exception as exc:  # a broken context must not turn recovery into a crash
            logger.debug("empty_cache on %s failed: %s", name, exc)


# ---------------------------------------------------------------------------
# What the allocator says: every OOM bounds the memory the step needed

_BACKENDS = ("cuda", "hip", "xpu", "mps", "cpu", "emulated")
_NUMBER = r"(\d+(?:\.\d+)?) ?(bytes|[KMGT]i?B)\b"
# c10's format_size prints "N bytes" up to 1 KiB, then two decimals of KiB / MiB / GiB
# (GiB above 1 GiB). The MPS allocator's own copy (before it used c10's) prints "KB" /
# "MB" / "GB" but divides by 1024 just the same: every unit in these messages is binary.
_UNITS = {"bytes": 1, "KiB": 2**10, "KB": 2**10, "MiB": 2**20, "MB": 2**20,
          "GiB": 2**30, "GB": 2**30, "TiB": 2**40, "TB": 2**40}


@dataclass(frozen=True)
class OOMReport:
    """The figures an out-of-memory message states, in bytes; ``None`` where it states none.

    Attributes:
        backend: who ran out: ``"cuda"``, ``"hip"``, ``"xpu"``, ``"mps"``, ``"cpu"``, or
            ``"emulated"`` (batchpilot's capacity on a :class:`~batchpilot.memory.tracker.StorageTracker`).
        device: the device the message names (``"cuda:0"``, ``"mps"``, ``"cpu"``), if any.
            ROCm builds name HIP devices ``cuda``, as torch does.
        requested_bytes: the allocation that failed. CUDA/HIP/XPU: the segment the caching
            allocator asked the driver for (the tensor rounded up: 2 MiB for up to 1 MiB,
            20 MiB below 10 MiB, else to a multiple of 2 MiB); MPS: the aligned buffer;
            CPU: the exact ``malloc`` size; emulated: the new storages of one operator.
        total_bytes: the device's capacity as the message states it.
        free_bytes: free device memory according to the driver when it failed.
        process_bytes: device memory this process holds, PyTorch's and everything else
            (CUDA context, library workspaces): NVML's figure on CUDA; Metal's
            ``currentAllocatedSize`` on MPS ("MPS allocated" + "other allocations").
        allocated_bytes: bytes of live tensors as PyTorch's allocator counts them.
        reserved_bytes: bytes PyTorch's allocator holds from the driver, cached but
            unallocated blocks included (MPS: its heaps).
        limit_bytes: a cap below the device: the per-process memory fraction ("allowed"),
            MPS's high watermark ("max allowed"), cudaMallocAsync's "PyTorch limit", or the
            emulated capacity.
        live_bytes: emulated only: tracked bytes live when the operator failed.
        rounding_bytes: the most one figure may be off. PyTorch prints two decimals of
            KiB/MiB/GiB, so a GiB figure is within 5.4 MB of the true count, and a figure
            summed from two printed ones (reserved, MPS's process) within the sum of
            theirs. 0 when every figure is an exact byte count (CPU, emulated).

    Raises:
        ValueError: an unknown backend, or a figure that is not a non-negative int.
    """

    backend: str
    device: str | None = None
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    limit_bytes: int | None = None
    live_bytes: int | None = None
    rounding_bytes: int = 0

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"unknown OOM backend {self.backend!r}; use one of {', '.join(_BACKENDS)}")
        if self.device is not None and not isinstance(self.device, str):
            raise ValueError(f"device must be a string like 'cuda:0' or None, got {self.device!r}")
        check_int("OOMReport.rounding_bytes", self.rounding_bytes, minimum=0)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_bytes") and f.name != "rounding_bytes" and value is not None:
                check_int(f"OOMReport.{f.name}", value, minimum=0, hint=" (bytes, or None when not stated)")

    @property
    def peak_basis(self) -> str | None:
        """What :attr:`min_peak_bytes` counts: the figure the backend runs out of.

        ``"live"`` (emulated: tracked bytes, what the emulated capacity limits),
        ``"process"`` (CUDA/HIP with NVML's line: all device memory of the process, the
        CUDA context included; MPS: Metal's allocated size, which its watermark limits),
        ``"reserved"`` (CUDA/HIP/XPU caching allocator: what a memory fraction limits, and
        a lower bound on the process's memory otherwise), ``"allocated"``
        (cudaMallocAsync: what its limit counts), ``"request"`` (CPU: nothing else stated).
        ``None`` when the message states no figure at all.
        """
        return self._peak()[0]

    @property
    def min_peak_bytes(self) -> int | None:
        """A lower bound on the peak the failed step needed, counted as :attr:`peak_basis` says.

        When it failed, the step held the basis figure and asked for ``requested_bytes``
        more, so its peak was at least their sum, less the message's rounding:

        - emulated: ``live + requested``, exact;
        - CUDA/HIP: ``reserved + requested`` with a memory fraction (the allocator refuses
          when that sum passes ``limit_bytes``); else ``process + requested`` when NVML
          reports the process (it frees its cache before giving up, so what it still held
          was in use or fragmented), else ``reserved + requested``;
          cudaMallocAsync: ``allocated + requested``;
        - XPU: ``reserved + requested`` (no per-process figure);
        - MPS: ``process + requested``: "MPS allocated" + "other allocations" + the buffer,
          the sum its high watermark compares with ``limit_bytes``;
        - CPU: ``requested`` alone. The allocator states nothing else; what the process
          already held must be read from the process.

        ``None`` when the message states no figure.
        """
        return self._peak()[1]

    def _peak(self) -> tuple[str | None, int | None]:
        if self.backend == "emulated":
            basis, held = "live", self.live_bytes
        elif self.backend == "mps":
            basis, held = "process", self.process_bytes
        elif self.backend == "cpu":
            basis, held = "request", None
        elif self.limit_bytes is not None and self.reserved_bytes is not None:
            basis, held = "reserved", self.reserved_bytes  # a memory fraction caps what the allocator reserves
        else:
            basis, held = next(((b, v) for b, v in (("process", self.process_bytes), ("reserved", self.reserved_bytes),
                                                    ("allocated", self.allocated_bytes)) if v is not None),
                               ("request", None))
        terms = [v for v in (held, self.requested_bytes) if v is not None]
        if not terms:
            return None, None
        if held is None:
            basis = "request"
        return basis, max(0, sum(terms) - len(terms) * self.rounding_bytes)


def _size(pattern: str, text: str) -> tuple[int, int] | None:
    """The size ``pattern``'s two groups (number, unit) match in ``text``: (bytes, most it may be off).

    ``None`` when nothing matches or the number is not a plain finite byte count.
    """
    m = re.search(pattern, text)
    if m is None:
        return None
    number, unit = m.group(1), m.group(2)
    scale = _UNITS[unit]
    if scale == 1:
        return (int(number), 0) if number.isdigit() and len(number) <= 19 else None
    value = float(number) * scale
    if not math.isfinite(value) or value >= 2**63:
        return None
    return round(value), math.ceil(scale * 0.005)  # two decimals: half a hundredth of the unit


def _exact(digits: str | None) -> tuple[int, int] | None:
    """An exact byte count printed as digits; ``None`` for more digits than any int64 holds."""
    return None if digits is None or len(digits) > 19 else (int(digits), 0)


def _sum(a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    return None if a is None or b is None else (a[0] + b[0], a[1] + b[1])


def _device_index(kind: str, text: str, pattern: str) -> str | None:
    m = re.search(pattern, text)
    return f"{kind}:{m.group(1)}" if m else None


def _caching_allocator(text: str) -> dict[str, tuple[int, int] | None]:
    """CUDA / HIP / XPU caching allocator, every format since PyTorch 1.0.

    2.1 and later: "Tried to allocate R. GPU d has a total capacity of T of which F is
    free. [Process p has X memory in use. ][Including non-PyTorch memory, this process has
    P memory in use. ][L allowed; ]Of the allocated memory A is allocated by PyTorch,
    [with G allocated in private pools (e.g., CUDA Graphs), ]and U is reserved by PyTorch
    but unallocated." (2.1 spelled "capacty"; early XPU has no "of which F is free").
    Before: "Tried to allocate R (GPU d; T total capacity; A already allocated; F free;
    [L allowed; ]V reserved in total by PyTorch)", and in 1.0-1.3 "...; U cached)".
    """
    allocated = _size(r"Of the allocated memory " + _NUMBER, text) or _size(_NUMBER + r" already allocated", text)
    unallocated = _size(_NUMBER + r" is reserved by PyTorch but unallocated", text) or _size(_NUMBER + r" cached\)", text)
    return {
        "requested_bytes": _size(r"Tried to allocate " + _NUMBER, text),
        "total_bytes": _size(r"total capac(?:i)?ty of " + _NUMBER, text) or _size(_NUMBER + r" total capacity", text),
        "free_bytes": _size(r"of which " + _NUMBER + r" is free", text) or _size(_NUMBER + r" free;", text),
        # NVML lists every process on the device; only "this process" is ours
        "process_bytes": _size(r"this process has " + _NUMBER + r" memory in use", text),
        "limit_bytes": _size(_NUMBER + r" allowed;", text),
        "allocated_bytes": allocated,
        "reserved_bytes": _size(_NUMBER + r" reserved in total by PyTorch", text) or _sum(allocated, unallocated),
    }


def _malloc_async(text: str) -> dict[str, tuple[int, int] | None]:
    """cudaMallocAsync (``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``): one figure a line."""
    return {
        "requested_bytes": _size(r"Requested\s*: " + _NUMBER, text),
        "allocated_bytes": _size(r"Currently allocated\s*: " + _NUMBER, text),
        "total_bytes": _size(r"Device limit\s*: " + _NUMBER, text),
        "free_bytes": _size(r"Free \(according to CUDA\)\s*: " + _NUMBER, text),
        "limit_bytes": _size(r"memory fraction\)\s*: " + _NUMBER, text),
    }


def _mps(text: str) -> dict[str, tuple[int, int] | None]:
    """"MPS backend out of memory (MPS allocated: H, other allocations: O[, max allowed: L]).
    Tried to allocate R on private|shared pool." H is the allocator's heaps; H + O is
    Metal's ``currentAllocatedSize``, the figure its high watermark L limits."""
    heaps = _size(r"MPS allocated: " + _NUMBER, text)
    return {
        "reserved_bytes": heaps,
        "process_bytes": _sum(heaps, _size(r"other allocations: " + _NUMBER, text)),
        "limit_bytes": _size(r"max allowed: " + _NUMBER, text),
        "requested_bytes": _size(r"Tried to allocate " + _NUMBER, text),
    }


def parse_oom_message(message: str) -> OOMReport | None:
    """Read the figures out of an out-of-memory message; ``None`` if it is not one.

    Every message :func:`is_oom` recognises gives a report (with no figures for those
    that state none: cuDNN's workspace error, NNPACK's ``posix_memalign``, ``std::bad_alloc``), and so do
    the CPU allocator's Windows/Android wording and cudaMallocAsync's message. A number
    that does not read as a size leaves its field ``None``; parsing never raises.
    Pure: no torch, no device.

    Example::

        >>> r = parse_oom_message("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        ...     "capacity of 79.25 GiB of which 1.50 GiB is free. Including non-PyTorch memory, this "
        ...     "process has 77.50 GiB memory in use. Of the allocated memory 70.00 GiB is allocated by "
        ...     "PyTorch, and 6.50 GiB is reserved by PyTorch but unallocated.")
        >>> r.min_peak_bytes + 2 * r.rounding_bytes == 79.5 * 2**30, r.peak_basis
        (True, 'process')
    """
    if not isinstance(message, str):
        return None
    text = message
    low = text.lower()
    if any(m in low for m in _FATAL_MESSAGES):
        return None
    backend, device = None, None
    figures: dict[str, tuple[int, int] | None] = {}
    emulated = re.search(r"batchpilot emulated capacity exceeded on (.+?): tried to allocate .*?\((\d+) bytes\) "
                         r"in .+ with (\d+) bytes live; capacity .*?\((\d+) bytes\)", text)
    header = re.search(r"\b(CUDA|HIP|XPU) out of memory", text, re.IGNORECASE)
    if emulated:
        backend, device = "emulated", emulated.group(1)
        figures = {"requested_bytes": _exact(emulated.group(2)), "live_bytes": _exact(emulated.group(3)),
                   "limit_bytes": _exact(emulated.group(4))}
    elif "mps backend out of memory" in low:
        backend, device, figures = "mps", "mps", _mps(text)
    elif header:
        backend = header.group(1).lower()
        device = _device_index("xpu" if backend == "xpu" else "cuda", text, r"GPU\s+(\d+)")
        figures = _caching_allocator(text)
    elif re.search(r"Allocation on device \d+ would exceed allowed memory", text):
        backend = "cuda"
        device = _device_index("cuda", text, r"Allocation on device (\d+)")
        figures = _malloc_async(text)
    elif "defaultcpuallocator: can't allocate memory" in low or "defaultcpuallocator: not enough memory" in low:
        backend, device = "cpu", "cpu"
        m = re.search(r"you tried to allocate (\d+) bytes", text)
        figures = {"requested_bytes": _exact(m.group(1) if m else None)}
    elif "posix_memalign failed:cannot allocate memory" in low or "std::bad_alloc" in low:
        backend, device = "cpu", "cpu"  # NNPACK's workspace, C++'s operator new: no size stated
    elif _CUDNN_WORKSPACE in low:
        backend = "cuda"  # cuDNN's workspace: no figures
    if backend is None:
        return None
    values = {k: v[0] for k, v in figures.items() if v is not None}
    rounding = max((v[1] for v in figures.values() if v is not None), default=0)
    return OOMReport(backend=backend, device=device, rounding_bytes=rounding, **values)


@dataclass
class Attempt(Generic[T]):
    """Outcome of :func:`attempt`: the result, or the OOM's message (never the exception).

    Attributes:
        result: what ``fn`` returned; ``None`` after an OOM.
        oom: the call ran out of memory.
        message: the OOM message's first line.
        report: the figures of the whole OOM message (:func:`parse_oom_message`); ``None``
            without an OOM or when the message states none that it recognises.
        mapped_bytes: the process's address space when the error was raised, its memory still
            held (what ``RLIMIT_AS`` compares with: a CPU allocator's failure asked for
            ``report.requested_bytes`` on top of it); ``None`` without an OOM or off Linux.
    """

    result: T | None = None
    oom: bool = False
    message: str = ""
    report: OOMReport | None = None
    mapped_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return not self.oom


def attempt(
    fn: Callable[..., T],
    *args: Any,
    device: torch.device | str | None = None,
    on_oom: Callable[[], None] | None = None,
    **kwargs: Any,
) -> Attempt[T]:
    """Call ``fn``; on OOM return ``Attempt(oom=True)`` after freeing memory.

    Only the message of the OOM is kept, so nothing of the failed attempt stays
    reachable; ``on_oom`` (e.g. ``optimizer.zero_grad``) and :func:`free_memory`
    run after the ``except`` block has released the traceback. The whole message
    is parsed into ``Attempt.report`` (cudaMallocAsync states its figures on later
    lines). Any other error propagates untouched.
    """
    message = None
    try:
        return Attempt(result=fn(*args, **kwargs))
    except BaseException as exc:
        if not is_oom(exc):
            raise
        mapped = address_space_bytes()  # before the frames let go of the failed attempt's memory
        onednn = is_onednn_failure(exc)
        text = str(exc)
        message = text.splitlines()[0] if text else type(exc).__name__
    # Outside the except: the exception and its frames are gone now.
    report = parse_oom_message(text)
    if on_oom is not None:
        on_oom()
    free_memory(device)
    if onednn:
        recover_onednn()
    logger.debug("recovered from OOM: %s", message)
    return Attempt(oom=True, message=message, report=report, mapped_bytes=mapped)
