"""Recognise out-of-memory errors on every backend and recover from them.

Recovery must happen *outside* the ``except`` block: while the exception is
alive its traceback holds every frame of the failed attempt, and with them the
activations that filled the memory. :func:`attempt` makes that the easy path.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import torch

from .host import trim_host_memory

__all__ = ["is_oom", "is_fatal_device_error", "free_memory", "attempt", "Attempt"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Substrings that identify an OOM raised as a plain RuntimeError.
_OOM_MESSAGES = (
    # MPS: RuntimeError("MPS backend out of memory (MPS allocated: ...)")
    "mps backend out of memory",
    # CPU: c10's DefaultCPUAllocator when malloc/posix_memalign fails (RLIMIT_AS, cgroup, overcommit off)
    "defaultcpuallocator: can't allocate memory",
    # CPU: NNPACK's scratch allocation fails this way under the same limits
    "posix_memalign failed:cannot allocate memory",
    # CUDA on torch builds that still raise RuntimeError rather than OutOfMemoryError
    "cuda out of memory",
    # cuDNN cannot get the workspace it asked for; the cure is the same as for an OOM
    "cudnn_status_not_supported. this error may appear if you passed in a non-contiguous input",
    # XPU / HIP allocators on older builds
    "xpu out of memory",
    "hip out of memory",
)

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
    and cuDNN's out-of-workspace ``CUDNN_STATUS_NOT_SUPPORTED``. Errors that leave
    the device unusable (illegal memory access) are never OOM.
    """
    if not isinstance(exc, BaseException) or is_fatal_device_error(exc):
        return False
    # CUDA, HIP, XPU and the emulated capacity all raise this type
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _OOM_MESSAGES)
    return False


def free_memory(device: torch.device | str | None = None) -> None:
    """Collect garbage and release the backend's cached blocks; never raises.

    On CPU the C library's freed heap is handed back to the OS (``malloc_trim``), so that the
    resident size measures what is live again.

    Args:
        device: the device whose cache to release; ``None`` releases every
            backend that is initialised.
    """
    gc.collect()
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


@dataclass
class Attempt(Generic[T]):
    """Outcome of :func:`attempt`: the result, or the OOM's message (never the exception)."""

    result: T | None = None
    oom: bool = False
    message: str = ""

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
    run after the ``except`` block has released the traceback. Any other error
    propagates untouched.
    """
    message = None
    try:
        return Attempt(result=fn(*args, **kwargs))
    except BaseException as exc:
        if not is_oom(exc):
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # Outside the except: the exception and its frames are gone now.
    if on_oom is not None:
        on_oom()
    free_memory(device)
    logger.debug("recovered from OOM: %s", message)
    return Attempt(oom=True, message=message)
