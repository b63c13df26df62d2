"""OOM recognition, recovery outside the except block, and a real allocator failure."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from batchpilot.oom import attempt, free_memory, is_fatal_device_error, is_oom

from conftest import run_helper

OOM_CASES = [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (torch.cuda.OutOfMemoryError("HIP out of memory. Tried to allocate 20.00 MiB"), True),
    (RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB)"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"), True),
    (RuntimeError("posix_memalign failed:Cannot allocate memory (12)"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                  "non-contiguous input."), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB"), True),
    (RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"), True),
    # The context is corrupt after these: retrying would hide the bug.
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (torch.OutOfMemoryError("CUDA error: an illegal memory access was encountered"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
    (ValueError("out of memory"), False),
    (MemoryError(), False),
    (KeyboardInterrupt(), False),
]


@pytest.mark.parametrize("exc,expected", OOM_CASES, ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_is_oom_table(exc, expected):
    assert is_oom(exc) is expected


def test_illegal_access_is_fatal():
    assert is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_fatal_device_error(torch.OutOfMemoryError("CUDA out of memory"))


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "mps", "xpu"])
def test_free_memory_safe_everywhere(device):
    free_memory(device)


def test_free_memory_survives_a_failing_cache_release(monkeypatch):
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("CUDA error: context is destroyed")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", boom)
    free_memory("cuda")
    assert calls == [1]


def _fails_with_activation(refs: list, size: int = 4_000_000) -> None:
    activation = torch.ones(size)
    refs.append(weakref.ref(activation.untyped_storage()))
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")


def test_traceback_pins_the_activation_inside_except():
    # Why recovery belongs outside the except block: the frame still holds the tensor here.
    refs: list = []
    try:
        _fails_with_activation(refs)
    except torch.OutOfMemoryError:
        gc.collect()
        assert refs[0]() is not None


def test_attempt_frees_the_failed_activation():
    refs: list = []
    cleaned = []
    result = attempt(_fails_with_activation, refs, on_oom=lambda: cleaned.append(refs[0]() is None))
    assert result.oom and not result.ok
    assert "out of memory" in result.message
    assert refs[0]() is None
    assert cleaned == [True]  # on_oom already runs after the traceback is gone


def test_attempt_returns_the_result():
    assert attempt(lambda a, b=0: a + b, 2, b=3).result == 5


def test_attempt_reraises_other_errors_untouched():
    err = ValueError("shape mismatch")

    def bad():
        raise err

    with pytest.raises(ValueError) as info:
        attempt(bad)
    assert info.value is err


def test_real_cpu_allocator_oom_recovers_without_leaking():
    out = json.loads(run_helper("oom_recover.py").stdout.strip().splitlines()[-1])
    assert "DefaultCPUAllocator: can't allocate memory" in out["real_message"]
    assert out["real_is_oom"] is True
    # every cycle: the huge batch fails with a real OOM, the small one then trains
    assert out["cycles"] == [[True, True]] * 20
    assert abs(out["rss_last"] - out["rss_first"]) < 8 * 2**20, out
