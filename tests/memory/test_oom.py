"""OOM recognition, the allocator's figures, recovery outside the except block, real allocator failures."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from batchpilot.memory.oom import OOMReport, attempt, free_memory, is_fatal_device_error, is_oom, parse_oom_message
from batchpilot.memory.probes import emulate_capacity

from conftest import run_helper

OOM_CASES = [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (torch.cuda.OutOfMemoryError("HIP out of memory. Tried to allocate 20.00 MiB"), True),
    (RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB)"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"), True),
    (RuntimeError("posix_memalign failed:Cannot allocate memory (12)"), True),
    (RuntimeError("std::bad_alloc"), True),
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


def _raised(exc: BaseException, cause: BaseException | None) -> BaseException:
    """``exc`` as ``raise exc from cause`` leaves it."""
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


def test_an_oom_re_raised_from_inside_dtensor_dispatch_is_an_oom():
    # DTensor re-raises its sharding propagation's errors as RuntimeError(f"{e}\n\nSharding
    # propagation failed for ...") from e: a real emulated OOM stays an OOM through that
    with emulate_capacity(1000), pytest.raises(torch.OutOfMemoryError) as raised:
        torch.empty(10_000)
    emulated = raised.value
    wrapped = _raised(RuntimeError(f"{emulated}\n\nSharding propagation failed for aten.addcdiv_.default"), emulated)
    assert is_oom(wrapped)
    twice = _raised(RuntimeError("while tracing"), wrapped)
    assert is_oom(twice)
    cuda = _raised(RuntimeError("Sharding propagation failed"), torch.OutOfMemoryError("CUDA out of memory."))
    assert is_oom(cuda)


def test_only_an_oom_cause_makes_a_wrapper_an_oom():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_oom(_raised(RuntimeError("Sharding propagation failed"), ValueError("shapes do not match")))
    assert not is_oom(_raised(ValueError("bad batch"), oom))  # not a wrapper: the user's error keeps its type
    try:
        try:
            raise oom
        except torch.OutOfMemoryError:
            raise RuntimeError("unrelated") from None  # raised while handling it, not from it
    except RuntimeError as unrelated:
        assert unrelated.__context__ is oom and not is_oom(unrelated)
    try:
        try:
            raise oom
        except torch.OutOfMemoryError:
            raise RuntimeError("unrelated")  # noqa: B904 (the implicit context is the point)
    except RuntimeError as unrelated:
        assert unrelated.__context__ is oom and not is_oom(unrelated)
    assert not is_oom(_raised(RuntimeError("CUDA error: an illegal memory access was encountered"), oom))
    retired = _raised(RuntimeError("rank 1 ran out of memory"), oom)
    retired.retryable = False  # e.g. CollectiveOOMError: its process group is gone
    assert not is_oom(retired)
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a  # a cycle ends the walk
    assert not is_oom(a)


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


def test_onednn_creation_failure_is_an_oom_only_near_a_memory_limit(monkeypatch):
    from batchpilot.memory import oom

    err = RuntimeError("could not create a primitive")
    monkeypatch.setattr(oom, "_onednn_ran_out", False)  # this process's record, put back after the test
    monkeypatch.setattr(oom, "_host_memory_is_short", lambda: False)
    assert not is_oom(err)  # "not implemented" says the same: without memory pressure it propagates
    monkeypatch.setattr(oom, "_host_memory_is_short", lambda: True)
    assert is_oom(err) and is_oom(RuntimeError("could not create a memory object"))
    assert not is_oom(RuntimeError("could not execute a primitive"))
    # once it ran out, oneDNN creates nothing again: every later creation failure is that OOM's
    monkeypatch.setattr(oom, "_host_memory_is_short", lambda: False)
    assert is_oom(err)


def test_onednn_creation_failure_at_a_real_address_space_limit_is_recovered():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    out = json.loads(run_helper("onednn_oom.py").stdout.strip().splitlines()[-1])
    assert out["far_is_oom"] is False
    assert out["near_oom"] and out["near_message"] == "could not create a primitive", out
    assert out["after_ok"] and not out["onednn_on"], out  # on PyTorch's own kernels from then on


def test_real_cpu_allocator_oom_recovers_without_leaking():
    out = json.loads(run_helper("oom_recover.py").stdout.strip().splitlines()[-1])
    assert "DefaultCPUAllocator: can't allocate memory" in out["real_message"]
    assert out["real_is_oom"] is True
    # every cycle: the huge batch fails with a real OOM, the small one then trains
    assert out["cycles"] == [[True, True]] * 20
    assert abs(out["rss_last"] - out["rss_first"]) < 8 * 2**20, out


# ---------------------------------------------------------------------------
# parse_oom_message: one real-format message per backend and version, filled with numbers.
# The strings are PyTorch's (c10/cuda/CUDACachingAllocator.cpp, CUDAMallocAsyncAllocator.cpp,
# c10/xpu/XPUCachingAllocator.cpp, aten/src/ATen/mps/MPSAllocator.mm, c10/core/impl/alloc_cpu.cpp)
# and batchpilot's own (memory.StorageTracker).

KiB, MiB, GiB = 2**10, 2**20, 2**30
R_GIB, R_MIB = 5368710, 5243  # half a hundredth of the unit, rounded up: what two printed decimals hide

HINT_21 = (" If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
           "to avoid fragmentation.  See documentation for Memory Management  "
           "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")

PARSE_CASES = {
    "cuda-2.4+ nvml": (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.25 GiB of which 1.50 GiB "
        "is free. Process 4242 has 512.00 MiB memory in use. Including non-PyTorch memory, this process has 77.25 GiB "
        "memory in use. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 6.50 GiB is reserved by "
        "PyTorch but unallocated." + HINT_21,
        dict(backend="cuda", device="cuda:0", requested_bytes=2 * GiB, total_bytes=int(79.25 * GiB),
             free_bytes=int(1.5 * GiB), process_bytes=int(77.25 * GiB), allocated_bytes=70 * GiB,
             reserved_bytes=int(76.5 * GiB), rounding_bytes=2 * R_GIB),
        ("process", int(79.25 * GiB) - 2 * 2 * R_GIB),
    ),
    "cuda-2.4+ fraction, private pools": (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity of 23.50 GiB of which 10.25 GiB "
        "is free. Including non-PyTorch memory, this process has 12.75 GiB memory in use. 12.00 GiB allowed; Of the "
        "allocated memory 11.50 GiB is allocated by PyTorch, with 256.00 MiB allocated in private pools (e.g., CUDA "
        "Graphs), and 492.00 MiB is reserved by PyTorch but unallocated." + HINT_21,
        dict(backend="cuda", device="cuda:1", requested_bytes=20 * MiB, total_bytes=int(23.5 * GiB),
             free_bytes=int(10.25 * GiB), process_bytes=int(12.75 * GiB), limit_bytes=12 * GiB,
             allocated_bytes=int(11.5 * GiB), reserved_bytes=int(11.5 * GiB) + 492 * MiB,
             rounding_bytes=R_GIB + R_MIB),
        # the fraction caps what the allocator reserves: the bound counts reserved, not the process
        ("reserved", int(11.5 * GiB) + 512 * MiB - 2 * (R_GIB + R_MIB)),
    ),
    "cuda-2.1 'capacty', no nvml, C++ stack": (
        "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacty of 23.69 GiB of which 7.11 GiB is "
        "free. Of the allocated memory 16.01 GiB is allocated by PyTorch, and 7.47 MiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting max_split_size_mb to avoid "
        "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF\n"
        "Exception raised from malloc at ../c10/cuda/CUDACachingAllocator.cpp:1238 (most recent call first):\n"
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f in libc10.so)",
        dict(backend="cuda", device="cuda:0", requested_bytes=8 * GiB, total_bytes=round(23.69 * GiB),
             free_bytes=round(7.11 * GiB), allocated_bytes=round(16.01 * GiB),
             reserved_bytes=round(16.01 * GiB) + round(7.47 * MiB), rounding_bytes=R_GIB + R_MIB),
        ("reserved", round(16.01 * GiB) + round(7.47 * MiB) + 8 * GiB - 2 * (R_GIB + R_MIB)),
    ),
    "cuda-1.4..2.0": (
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity; 70.00 GiB already allocated; "
        "1.00 GiB free; 75.00 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting "
        "max_split_size_mb to avoid fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF",
        dict(backend="cuda", device="cuda:0", requested_bytes=2 * GiB, total_bytes=round(79.15 * GiB),
             allocated_bytes=70 * GiB, free_bytes=GiB, reserved_bytes=75 * GiB, rounding_bytes=R_GIB),
        ("reserved", 77 * GiB - 2 * R_GIB),
    ),
    "cuda-1.x fraction": (
        "CUDA out of memory. Tried to allocate 512.00 MiB (GPU 3; 15.75 GiB total capacity; 3.50 GiB already "
        "allocated; 11.25 GiB free; 4.00 GiB allowed; 3.75 GiB reserved in total by PyTorch)",
        dict(backend="cuda", device="cuda:3", requested_bytes=512 * MiB, total_bytes=int(15.75 * GiB),
             allocated_bytes=int(3.5 * GiB), free_bytes=int(11.25 * GiB), limit_bytes=4 * GiB,
             reserved_bytes=int(3.75 * GiB), rounding_bytes=R_GIB),
        ("reserved", int(4.25 * GiB) - 2 * R_GIB),
    ),
    "cuda-1.0..1.3 'cached' (= reserved - allocated)": (
        "CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total capacity; 8.50 GiB already "
        "allocated; 9.25 MiB free; 1.25 GiB cached)",
        dict(backend="cuda", device="cuda:0", requested_bytes=int(12.5 * MiB), total_bytes=round(10.92 * GiB),
             allocated_bytes=int(8.5 * GiB), free_bytes=int(9.25 * MiB), reserved_bytes=int(9.75 * GiB),
             rounding_bytes=2 * R_GIB),
        ("reserved", int(9.75 * GiB) + int(12.5 * MiB) - 2 * 2 * R_GIB),
    ),
    "hip-2.x (ROCm, no process line, nothing free)": (
        "HIP out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 63.98 GiB of which 0 bytes is "
        "free. Of the allocated memory 63.50 GiB is allocated by PyTorch, and 40.25 MiB is reserved by PyTorch but "
        "unallocated." + HINT_21,
        dict(backend="hip", device="cuda:0", requested_bytes=20 * MiB, total_bytes=round(63.98 * GiB), free_bytes=0,
             allocated_bytes=int(63.5 * GiB), reserved_bytes=int(63.5 * GiB) + int(40.25 * MiB),
             rounding_bytes=R_GIB + R_MIB),
        ("reserved", int(63.5 * GiB) + int(60.25 * MiB) - 2 * (R_GIB + R_MIB)),
    ),
    "cuda cudaMallocAsync": (
        "Allocation on device 0 would exceed allowed memory. (out of memory)\n"
        "Currently allocated     : 9.50 GiB\n"
        "Requested               : 640.00 MiB\n"
        "Device limit            : 11.50 GiB\n"
        "Free (according to CUDA): 7.00 MiB\n"
        "PyTorch limit (set by user-supplied memory fraction)\n"
        "                        : 10.00 GiB",
        dict(backend="cuda", device="cuda:0", allocated_bytes=int(9.5 * GiB), requested_bytes=640 * MiB,
             total_bytes=int(11.5 * GiB), free_bytes=7 * MiB, limit_bytes=10 * GiB, rounding_bytes=R_GIB),
        ("allocated", int(9.5 * GiB) + 640 * MiB - 2 * R_GIB),
    ),
    "xpu-2.5+": (
        "XPU out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 64.00 GiB of which 512.00 MiB "
        "is free. 32.00 GiB allowed; Of the allocated memory 30.50 GiB is allocated by PyTorch, and 1.25 GiB is "
        "reserved by PyTorch but unallocated. Please use `empty_cache` to release all unoccupied cached memory.",
        dict(backend="xpu", device="xpu:0", requested_bytes=GiB, total_bytes=64 * GiB, free_bytes=512 * MiB,
             limit_bytes=32 * GiB, allocated_bytes=int(30.5 * GiB), reserved_bytes=int(31.75 * GiB),
             rounding_bytes=2 * R_GIB),
        ("reserved", int(32.75 * GiB) - 2 * 2 * R_GIB),
    ),
    "xpu-2.3 (no free figure)": (
        "XPU out of memory. Tried to allocate 1.00 GiB. GPU 2 has a total capacity of 64.00 GiB. Of the allocated "
        "memory 60.00 GiB is allocated by PyTorch, and 2.50 GiB is reserved by PyTorch but unallocated. Please use "
        "`empty_cache` to release all unoccupied cached memory.",
        dict(backend="xpu", device="xpu:2", requested_bytes=GiB, total_bytes=64 * GiB, allocated_bytes=60 * GiB,
             reserved_bytes=int(62.5 * GiB), rounding_bytes=2 * R_GIB),
        ("reserved", int(63.5 * GiB) - 2 * 2 * R_GIB),
    ),
    "xpu IPEX": (
        "XPU out of memory. Tried to allocate 2.00 GiB (GPU  0; 15.50 GiB total capacity; 12.00 GiB already "
        "allocated; 13.50 GiB reserved in total by PyTorch)",
        dict(backend="xpu", device="xpu:0", requested_bytes=2 * GiB, total_bytes=int(15.5 * GiB),
             allocated_bytes=12 * GiB, reserved_bytes=int(13.5 * GiB), rounding_bytes=R_GIB),
        ("reserved", int(15.5 * GiB) - 2 * R_GIB),
    ),
    "mps c10 units, watermark": (
        "MPS backend out of memory (MPS allocated: 17.75 GiB, other allocations: 1.25 GiB, max allowed: 20.00 GiB). "
        "Tried to allocate 1.50 GiB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit "
        "for memory allocations (may cause system failure).",
        dict(backend="mps", device="mps", reserved_bytes=int(17.75 * GiB), process_bytes=19 * GiB,
             limit_bytes=20 * GiB, requested_bytes=int(1.5 * GiB), rounding_bytes=2 * R_GIB),
        ("process", int(20.5 * GiB) - 2 * 2 * R_GIB),
    ),
    "mps legacy 'GB' (divided by 1024)": (
        "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.25 GB, max allowed: 18.13 GB). "
        "Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper "
        "limit for memory allocations (may cause system failure).",
        dict(backend="mps", device="mps", reserved_bytes=17 * GiB, process_bytes=int(18.25 * GiB),
             limit_bytes=round(18.13 * GiB), requested_bytes=256 * MiB, rounding_bytes=2 * R_GIB),
        ("process", int(18.5 * GiB) - 2 * 2 * R_GIB),
    ),
    "mps no watermark, shared pool": (
        "MPS backend out of memory (MPS allocated: 30.00 GB, other allocations: 512.00 MB). Tried to allocate "
        "4.00 GB on shared pool.",
        dict(backend="mps", device="mps", reserved_bytes=30 * GiB, process_bytes=30 * GiB + 512 * MiB,
             requested_bytes=4 * GiB, rounding_bytes=R_GIB + R_MIB),
        ("process", 34 * GiB + 512 * MiB - 2 * (R_GIB + R_MIB)),
    ),
    "cpu linux (posix_memalign)": (
        "[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 1073741825 bytes. Error code 12 (Cannot allocate memory)",
        dict(backend="cpu", device="cpu", requested_bytes=GiB + 1),
        ("request", GiB + 1),
    ),
    "cpu windows / android / mimalloc": (
        "DefaultCPUAllocator: not enough memory: you tried to allocate 68719476736 bytes.",
        dict(backend="cpu", device="cpu", requested_bytes=64 * GiB),
        ("request", 64 * GiB),
    ),
    "cpu before 2.0": (
        "DefaultCPUAllocator: not enough memory: you tried to allocate 123 bytes. Buy new RAM!",
        dict(backend="cpu", device="cpu", requested_bytes=123),
        ("request", 123),
    ),
    "cpu NNPACK workspace (no size)": (
        "posix_memalign failed:Cannot allocate memory (12)",
        dict(backend="cpu", device="cpu"),
        (None, None),
    ),
    "cudnn workspace (no figures)": (
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
        dict(backend="cuda"),
        (None, None),
    ),
    "batchpilot emulated": (
        "batchpilot emulated capacity exceeded on cpu: tried to allocate 4.00 MiB (4194304 bytes) in aten.mm.default "
        "with 1048577 bytes live; capacity 4.50 MiB (4718592 bytes)",
        dict(backend="emulated", device="cpu", requested_bytes=4 * MiB, live_bytes=MiB + 1, limit_bytes=4718592),
        ("live", 5 * MiB + 1),
    ),
    "batchpilot emulated, indexed device": (
        "batchpilot emulated capacity exceeded on cuda:1: tried to allocate 512 bytes (512 bytes) in "
        "aten.add.Tensor with 0 bytes live; capacity 100 bytes (100 bytes)",
        dict(backend="emulated", device="cuda:1", requested_bytes=512, live_bytes=0, limit_bytes=100),
        ("live", 512),
    ),
}


@pytest.mark.parametrize("name", list(PARSE_CASES))
def test_parse_oom_message_table(name):
    message, fields, (basis, min_peak) = PARSE_CASES[name]
    report = parse_oom_message(message)
    assert report == OOMReport(**fields)  # every field, the unstated ones None
    assert report.peak_basis == basis
    assert report.min_peak_bytes == min_peak


def test_rounded_figures_bound_the_exact_ones():
    # what format_size prints for exact byte counts, and what the report makes of it
    exact = {"requested": 2_147_483_000, "process": 82_000_000_000}
    message = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.25 GiB of which "
               "0 bytes is free. Including non-PyTorch memory, this process has 76.37 GiB memory in use. Of the "
               "allocated memory 70.00 GiB is allocated by PyTorch, and 6.00 GiB is reserved by PyTorch but unallocated.")
    assert f"{exact['requested'] / GiB:.2f}" == "2.00" and f"{exact['process'] / GiB:.2f}" == "76.37"
    r = parse_oom_message(message)
    assert abs(r.requested_bytes - exact["requested"]) <= r.rounding_bytes
    assert abs(r.process_bytes - exact["process"]) <= r.rounding_bytes
    assert r.min_peak_bytes <= exact["requested"] + exact["process"]  # a lower bound, whatever the rounding hid


@pytest.mark.parametrize("message", [
    "",
    "mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)",
    "out of memory",
    "CUDA error: an illegal memory access was encountered",
    # a corrupt context is never an OOM, whatever else the message says
    "CUDA out of memory. Tried to allocate 2.00 GiB. CUDA error: an illegal memory access was encountered",
    "CUDA error: device-side assert triggered",
    "Expected all tensors to be on the same device, but found cuda:0 and cpu",
])
def test_messages_that_are_not_ooms_give_none(message):
    assert parse_oom_message(message) is None


@pytest.mark.parametrize("exc,expected", OOM_CASES, ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_every_message_is_oom_accepts_gives_a_report(exc, expected):
    assert (parse_oom_message(str(exc)) is not None) is expected


@pytest.mark.parametrize("message,unreadable", [
    ("CUDA out of memory. Tried to allocate nan GiB. GPU 0 has a total capacity of 1.2.3 GiB of which -5.00 GiB "
     "is free. Including non-PyTorch memory, this process has " + "9" * 400 + " GiB memory in use. Of the allocated "
     "memory 1e5 GiB is allocated by PyTorch, and 2.00 ZiB is reserved by PyTorch but unallocated.",
     ("requested_bytes", "total_bytes", "free_bytes", "process_bytes", "allocated_bytes", "reserved_bytes")),
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate " + "1" * 40 + " bytes.", ("requested_bytes",)),
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate -8 bytes.", ("requested_bytes",)),
    ("MPS backend out of memory (MPS allocated: lots, other allocations: 1.00 GB). Tried to allocate 1.5 bytes on "
     "private pool.", ("reserved_bytes", "process_bytes", "requested_bytes")),
    ("batchpilot emulated capacity exceeded on cpu: tried to allocate 1 bytes (" + "7" * 30 + " bytes) in op with 3 "
     "bytes live; capacity 9 bytes (9 bytes)", ("requested_bytes",)),
])
def test_malformed_numbers_leave_their_field_empty(message, unreadable):
    report = parse_oom_message(message)  # never raises
    assert report is not None
    for name in unreadable:
        assert getattr(report, name) is None, name


@pytest.mark.parametrize("fields,match", [
    (dict(backend="tpu"), "unknown OOM backend 'tpu'; use one of cuda, hip, xpu, mps, cpu, emulated"),
    (dict(backend="cuda", requested_bytes=-1), "requested_bytes must be >= 0"),
    (dict(backend="cuda", free_bytes=1.5), "free_bytes must be an int"),
    (dict(backend="cpu", live_bytes=True), "live_bytes must be an int"),
    (dict(backend="cpu", rounding_bytes=None), "rounding_bytes must be an int"),
    (dict(backend="cpu", device=0), "device must be a string"),
])
def test_oom_report_validates_its_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        OOMReport(**fields)


def test_attempt_reports_the_whole_message_but_keeps_its_first_line():
    def fails():
        raise torch.OutOfMemoryError(PARSE_CASES["cuda cudaMallocAsync"][0])

    out = attempt(fails)
    assert out.message == "Allocation on device 0 would exceed allowed memory. (out of memory)"
    assert out.report == OOMReport(**PARSE_CASES["cuda cudaMallocAsync"][1])  # figures from the later lines
    assert attempt(lambda: 3).report is None


def test_attempt_reports_a_real_emulated_oom_exactly():
    with emulate_capacity(64 * 1024):
        held = torch.ones(1000)  # 4000 bytes live when the next one fails
        out = attempt(torch.ones, 20_000)
    assert out.oom and held.numel() == 1000
    r = out.report
    assert (r.backend, r.device, r.requested_bytes, r.live_bytes, r.limit_bytes) == ("emulated", "cpu", 80_000, 4000, 65536)
    assert (r.peak_basis, r.min_peak_bytes) == ("live", 84_000)


def test_real_cpu_allocator_oom_reports_the_size_that_failed():
    out = json.loads(run_helper("oom_report.py").stdout.strip().splitlines()[-1])
    assert out["oom"] and "DefaultCPUAllocator: can't allocate memory" in out["message"]
    assert out["report"]["backend"] == "cpu"
    assert out["report"]["requested_bytes"] == out["size"]
    assert (out["peak_basis"], out["min_peak_bytes"]) == ("request", out["size"])
