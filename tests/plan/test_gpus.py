"""Named GPUs, CUDA accounting constants and the caching-allocator model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.plan.gpus import (
    CUBLAS_WORKSPACE_DEFAULT,
    CUBLAS_WORKSPACE_HOPPER,
    GPUS,
    CachingAllocatorModel,
    CudaAccounting,
    gpu_spec,
    known_gpus,
)

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def test_every_gpu_has_a_capacity_and_a_source():
    for name, spec in GPUS.items():
        assert spec.name == name and spec.capacity > 8 * GiB and spec.source
        nominal = int(name.rsplit("-", 1)[1].removesuffix("GB"))
        assert 0.95 * nominal * 1e9 <= spec.capacity <= 1.1 * nominal * GiB, name
    assert GPUS["H200-141GB"].capacity == 143771 * MiB
    assert GPUS["H100-80GB"].blas_workspace == CUBLAS_WORKSPACE_HOPPER == 32 * MiB
    assert GPUS["A100-80GB"].blas_workspace == CUBLAS_WORKSPACE_DEFAULT == 8519680
    assert known_gpus() == tuple(GPUS)


@pytest.mark.parametrize("name", ["H100-80GB", "h100-80gb", "H100 80GB", "h100_80GB"])
def test_lookup_ignores_case_and_separators(name):
    assert gpu_spec(name) is GPUS["H100-80GB"]


def test_unknown_gpu_lists_the_known_names():
    with pytest.raises(ValueError, match="unknown GPU 'GTX1080'") as info:
        gpu_spec("GTX1080")
    assert all(name in str(info.value) for name in GPUS)


@pytest.mark.parametrize("name, meant", [
    ("H100", ["H100-80GB"]),  # the name without its memory: the table keys a model by it
    ("a100", ["A100-40GB", "A100-80GB"]),
    ("4090", ["RTX4090-24GB"]),
    ("H10-80GB", ["H100-80GB", "A100-80GB"]),  # a typo: difflib's closest
    ("mi300", ["MI300X-192GB"]),
])
def test_an_unknown_gpu_close_to_known_ones_suggests_them_instead_of_the_list(name, meant):
    with pytest.raises(ValueError) as info:
        gpu_spec(name)
    message = str(info.value)
    assert message.startswith(f"unknown GPU {name!r}; did you mean {' or '.join(map(repr, meant))}? ")
    assert "known GPUs" not in message and "80GiB" in message


def test_for_gpu_takes_the_workspace_and_overrides():
    acc = CudaAccounting.for_gpu("h200-141gb", context=100 * MiB)
    assert acc.blas_workspace == 32 * MiB and acc.context == 100 * MiB
    assert acc.handles(training=True) == 2 and acc.handles(training=False) == 1
    assert CudaAccounting(blas_handles=3).handles(training=False) == 3


@pytest.mark.parametrize(
    "field, value",
    [("min_block", 0), ("context", -1), ("blas_workspace", -5), ("extra", -1), ("blas_handles", -1),
     ("small_segment", 512 * KiB), ("large_segment", 8 * MiB)],
)
def test_accounting_rejects_impossible_values(field, value):
    with pytest.raises(ValueError, match=field):
        CudaAccounting(**{field: value})


def test_block_and_segment_sizes_follow_the_allocator():
    acc = CudaAccounting()
    assert [acc.block_size(n) for n in (0, 1, 511, 512, 513, 4096)] == [0, 512, 512, 512, 1024, 4096]
    assert acc.segment_size(512) == 2 * MiB  # small pool
    assert acc.segment_size(1 * MiB) == 2 * MiB
    assert acc.segment_size(1 * MiB + 512) == 20 * MiB  # large, below 10 MiB
    assert acc.segment_size(10 * MiB - 512) == 20 * MiB
    assert acc.segment_size(10 * MiB) == 10 * MiB  # own segment, 2 MiB multiples
    assert acc.segment_size(11 * MiB) == 12 * MiB


def test_small_blocks_share_a_two_mib_segment_and_are_cached():
    alloc = CachingAllocatorModel(CudaAccounting())
    alloc.malloc("a", 100)
    alloc.malloc("b", 1000)
    assert alloc.allocated == 512 + 1024 and alloc.reserved == 2 * MiB
    alloc.free("a")
    alloc.free("b")
    assert alloc.allocated == 0 and alloc.reserved == 2 * MiB  # cached, not returned
    alloc.malloc("c", 1536)  # the merged free block serves it
    assert alloc.reserved == 2 * MiB and alloc.peak_allocated == 1536
    alloc.malloc("zero", 0)
    alloc.free("zero")
    assert alloc.allocated == 1536


def test_large_blocks_split_only_when_the_rest_is_over_one_mib():
    alloc = CachingAllocatorModel(CudaAccounting())
    alloc.malloc("a", 19 * MiB + 100)  # own 20 MiB segment; 0.99 MiB left: not split
    assert alloc.reserved == 20 * MiB and alloc.allocated == 20 * MiB
    alloc.malloc("b", 3 * MiB)  # a 20 MiB segment, split: 17 MiB cached
    assert alloc.reserved == 40 * MiB and alloc.allocated == 23 * MiB
    alloc.malloc("c", 16 * MiB)  # fits the cached 17 MiB block, unsplit
    assert alloc.reserved == 40 * MiB and alloc.allocated == 40 * MiB
    alloc.free("a")
    alloc.malloc("d", 2 * MiB)  # best fit: the 20 MiB block is the only free one
    assert alloc.reserved == 40 * MiB and alloc.allocated == 22 * MiB


def test_a_cached_block_too_small_means_a_new_segment():
    alloc = CachingAllocatorModel(CudaAccounting())
    alloc.malloc("a", 12 * MiB)
    alloc.free("a")
    alloc.malloc("b", 14 * MiB)
    assert alloc.reserved == 26 * MiB and alloc.peak_reserved == 26 * MiB


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30 * MiB)), min_size=1, max_size=60))
def test_allocator_model_invariants(ops):
    acc = CudaAccounting()
    alloc = CachingAllocatorModel(acc)
    live: dict[int, int] = {}
    for i, (free, size) in enumerate(ops):
        if free and live:
            key = next(iter(live))
            alloc.free(key)
            del live[key]
        else:
            alloc.malloc(i, size)
            live[i] = acc.block_size(size)
        assert sum(live.values()) <= alloc.allocated <= alloc.reserved
        assert alloc.allocated <= alloc.peak_allocated and alloc.reserved == alloc.peak_reserved
    for key in list(live):
        alloc.free(key)
    assert alloc.allocated == 0


def test_every_gpu_has_a_speed_with_its_source():
    for name, spec in GPUS.items():
        assert spec.tflops is not None and spec.tflops > 0, name
        assert "TFLOPS" in spec.tflops_source and ("data sheet" in spec.tflops_source
                                                   or "whitepaper" in spec.tflops_source), name
    assert GPUS["A6000-48GB"].capacity == 48 * GiB and GPUS["RTX2080Ti-11GB"].capacity == 11 * GiB
    assert gpu_spec("rtx 2080 ti 11gb") is GPUS["RTX2080Ti-11GB"]
