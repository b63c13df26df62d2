"""What a CUDA GPU offers (named GPUs) and how its caching allocator accounts for memory.

The constants follow PyTorch's ``CUDACachingAllocator.cpp`` and ``CUDABlasHandlePool.cpp``;
what is not modelled: ``docs/internals.md#gpus``.
"""

from __future__ import annotations

import bisect
import difflib
import logging
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CudaAccounting",
    "GpuSpec",
    "GPUS",
    "gpu_spec",
    "known_gpus",
    "CachingAllocatorModel",
]

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# torch's default cuBLAS workspace per (handle, stream), CUDABlasHandlePool.cpp
# parseChosenWorkspaceSize(): ":4096:2:16:8" = 4096 KiB x 2 + 16 KiB x 8, and
# 4096 KiB x 8 = 32 MiB on compute capability 9.x / 10.x / 12.x (Hopper, Blackwell).
# On ROCm the hipBLAS default is 32 MiB, 128 MiB on gfx94x / gfx95x (MI300).
CUBLAS_WORKSPACE_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8
CUBLAS_WORKSPACE_HOPPER = 4096 * KiB * 8
HIPBLAS_WORKSPACE_MI300 = 128 * MiB


@dataclass(kw_only=True)
class CudaAccounting:
    """How device memory differs from the sum of live tensor bytes on CUDA.

    The allocator fields are the caching allocator's compile-time constants;
    change them only to model a patched allocator. ``blas_workspace``,
    ``blas_handles``, ``context`` and ``extra`` are estimates to calibrate
    against a real card (the GPU validation benchmark does that).

    Attributes:
        min_block: every block is rounded up to a multiple of this
            (``kMinBlockSize`` = 512 B).
        small_size: requests up to this size come from the small pool
            (``kSmallSize`` = 1 MiB).
        small_segment: the small pool reserves segments of this size
            (``kSmallBuffer`` = 2 MiB).
        large_segment: a large request below ``min_large_alloc`` reserves a
            segment of this size (``kLargeBuffer`` = 20 MiB).
        min_large_alloc: from this size on, a request reserves its own
            segment, rounded up to ``round_large`` (``kMinLargeAlloc`` = 10 MiB).
        round_large: rounding of large segments (``kRoundLarge`` = 2 MiB).
        blas_workspace: bytes of one cuBLAS workspace, allocated through the
            caching allocator on the first matrix product of each
            (handle, stream) and kept; it counts in ``max_memory_allocated``.
        blas_handles: cuBLAS handles that run matrix products: ``None`` means
            2 for training (the Python thread and the autograd engine's
            device thread each hold one) and 1 for inference.
        context: the CUDA context, kernel images and library handles: device
            memory outside the allocator, not in ``max_memory_reserved``.
            Driver- and GPU-dependent (about 300-600 MiB with lazy module
            loading); 512 MiB is an estimate.
        extra: further bytes to add to the allocated peak (e.g. a cuDNN
            workspace or NCCL buffers you know of).
    """

    min_block: int = 512
    small_size: int = 1 * MiB
    small_segment: int = 2 * MiB
    large_segment: int = 20 * MiB
    min_large_alloc: int = 10 * MiB
    round_large: int = 2 * MiB
    blas_workspace: int = CUBLAS_WORKSPACE_DEFAULT
    blas_handles: int | None = None
    context: int = 512 * MiB
    extra: int = 0

    def __post_init__(self) -> None:
        for name in ("min_block", "small_size", "small_segment", "large_segment", "min_large_alloc", "round_large"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CudaAccounting.{name} must be positive, got {getattr(self, name)}")
        for name in ("blas_workspace", "context", "extra"):
            if getattr(self, name) < 0:
                raise ValueError(f"CudaAccounting.{name} must be >= 0 bytes, got {getattr(self, name)}")
        if self.blas_handles is not None and self.blas_handles < 0:
            raise ValueError(f"CudaAccounting.blas_handles must be >= 0 or None, got {self.blas_handles}")
        if self.small_segment < self.small_size:
            raise ValueError(
                f"CudaAccounting.small_segment ({self.small_segment}) must hold the largest small "
                f"request (small_size = {self.small_size})"
            )
        if self.large_segment < self.min_large_alloc:
            raise ValueError(
                f"CudaAccounting.large_segment ({self.large_segment}) must be >= min_large_alloc "
                f"({self.min_large_alloc})"
            )

    @classmethod
    def for_gpu(cls, name: str, **overrides: Any) -> CudaAccounting:
        """Accounting with the named GPU's cuBLAS workspace, plus ``overrides``.

        Raises:
            ValueError: unknown GPU name (the message lists the known ones).
        """
        spec = gpu_spec(name)
        return cls(**{"blas_workspace": spec.blas_workspace, **overrides})

    def handles(self, training: bool) -> int:
        """cuBLAS handles, each with one workspace, that a step uses."""
        if self.blas_handles is not None:
            return self.blas_handles
        return 2 if training else 1

    def block_size(self, nbytes: int) -> int:
        """Bytes the allocator hands out for a request (0 stays 0: no allocation)."""
        if nbytes <= 0:
            return 0
        return -(-nbytes // self.min_block) * self.min_block

    def segment_size(self, block: int) -> int:
        """Bytes reserved from the driver when no cached block fits ``block``."""
        if block <= self.small_size:
            return self.small_segment
        if block < self.min_large_alloc:
            return self.large_segment
        return -(-block // self.round_large) * self.round_large


# ---------------------------------------------------------------------------
# Named GPUs


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """A GPU the planner can size for.

    Attributes:
        name: the key, e.g. ``"H100-80GB"``.
        capacity: bytes of device memory the planner plans against.
        blas_workspace: torch's default cuBLAS / hipBLAS workspace on this
            architecture (bytes per handle).
        source: where ``capacity`` comes from.
        tflops: peak dense FP16 tensor-core TFLOPS with FP32 accumulate (what autocast's
            matrix products use), the speed figure a mixed cluster's shares are split by;
            ``None`` where the table has none (give speeds yourself).
        tflops_source: where ``tflops`` comes from.
    """

    name: str
    capacity: int
    blas_workspace: int
    source: str
    tflops: float | None = None
    tflops_source: str = ""


_NOMINAL = "vendor data sheet: {} GB {}, taken as GiB (the chips are binary-sized); the driver reports slightly less"


def _nominal(name: str, gib: int, memory: str, workspace: int, tflops: float, tflops_source: str,
             note: str = "") -> GpuSpec:
    return GpuSpec(name=name, capacity=gib * GiB, blas_workspace=workspace,
                   source=_NOMINAL.format(gib, memory) + note, tflops=tflops, tflops_source=tflops_source)


# Speeds: peak dense FP16 tensor TFLOPS with FP32 accumulate, the figure that bounds autocast's
# matrix products. Data sheets quote it "with sparsity" (twice the dense figure) for Ampere and
# later; the dense half is taken. GeForce cards run FP32 accumulation at half their FP16-accumulate
# rate, which their whitepapers list separately. A peak is a ceiling: memory-bound layers narrow
# the real ratio between two cards, so measured samples/s (speeds=) give a tighter split.
_DS = "vendor data sheet: {} TFLOPS dense FP16 tensor"
_SPARSE = "vendor data sheet: {} TFLOPS FP16 tensor with sparsity, dense half taken"

# Capacities are the marketed size unless measured. For an exact plan on a card
# you have, pass torch.cuda.get_device_properties(i).total_memory as capacity.
GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        _nominal("V100-16GB", 16, "HBM2", CUBLAS_WORKSPACE_DEFAULT, 125.0, _DS.format("125 (SXM2; PCIe: 112)")),
        _nominal("V100-32GB", 32, "HBM2", CUBLAS_WORKSPACE_DEFAULT, 125.0, _DS.format("125 (SXM2; PCIe: 112)")),
        _nominal("T4-16GB", 16, "GDDR6", CUBLAS_WORKSPACE_DEFAULT, 65.0,
                 "vendor data sheet: 65 TFLOPS mixed precision (FP16/FP32)",
                 "; with ECC on (the default) 1/16 is reserved, about 15 GiB usable"),
        _nominal("RTX2080Ti-11GB", 11, "GDDR6", CUBLAS_WORKSPACE_DEFAULT, 53.8,
                 "NVIDIA Turing whitepaper: 53.8 TFLOPS FP16 tensor with FP32 accumulate (reference clocks; "
                 "Founders Edition 56.9; 107.6 with FP16 accumulate)"),
        _nominal("A10-24GB", 24, "GDDR6", CUBLAS_WORKSPACE_DEFAULT, 125.0, _SPARSE.format("250")),
        _nominal("RTX3090-24GB", 24, "GDDR6X", CUBLAS_WORKSPACE_DEFAULT, 71.0,
                 "NVIDIA Ampere GA102 whitepaper: 71 TFLOPS FP16 tensor with FP32 accumulate (142 with FP16 "
                 "accumulate)"),
        _nominal("A6000-48GB", 48, "GDDR6", CUBLAS_WORKSPACE_DEFAULT, 154.8,
                 "vendor data sheet (RTX A6000): 309.7 TFLOPS tensor with sparsity, dense half taken; "
                 "FP32 accumulate at full rate on this professional card"),
        _nominal("RTX4090-24GB", 24, "GDDR6X", CUBLAS_WORKSPACE_DEFAULT, 165.2,
                 "NVIDIA Ada whitepaper: 165.2 TFLOPS FP16 tensor with FP32 accumulate (330.3 with FP16 "
                 "accumulate)"),
        _nominal("L4-24GB", 24, "GDDR6", CUBLAS_WORKSPACE_DEFAULT, 121.0, _SPARSE.format("242")),
        _nominal("A100-40GB", 40, "HBM2", CUBLAS_WORKSPACE_DEFAULT, 312.0, _DS.format("312")),
        _nominal("A100-80GB", 80, "HBM2e", CUBLAS_WORKSPACE_DEFAULT, 312.0, _DS.format("312")),
        _nominal("L40S-48GB", 48, "GDDR6", CUBLAS_WORKSPACE_DEFAULT, 362.0, _SPARSE.format("733")),
        _nominal("H100-80GB", 80, "HBM3", CUBLAS_WORKSPACE_HOPPER, 989.0,
                 _SPARSE.format("1979 (SXM; PCIe: 1513)")),
        GpuSpec(
            name="H200-141GB", capacity=143771 * MiB, blas_workspace=CUBLAS_WORKSPACE_HOPPER,
            source="nvidia-smi total (143771 MiB) on an H200 lent to this project; the data sheet says 141 GB HBM3e",
            tflops=989.0, tflops_source=_SPARSE.format("1979 (SXM)"),
        ),
        _nominal("MI300X-192GB", 192, "HBM3", HIPBLAS_WORKSPACE_MI300, 1307.4,
                 "vendor data sheet: 1307.4 TFLOPS peak FP16 dense (2614.9 with sparsity)"),
    )
}


def _normalise(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


_BY_KEY = {_normalise(name): spec for name, spec in GPUS.items()}


def known_gpus() -> tuple[str, ...]:
    """The names :func:`gpu_spec` accepts."""
    return tuple(GPUS)


def gpu_spec(name: str) -> GpuSpec:
    """Look up a named GPU; case, spaces, ``-`` and ``_`` do not matter.

    Raises:
        ValueError: unknown name; the message suggests the closest known names (``H100`` is
            ``H100-80GB``), or lists them all when none is close.
    """
    spec = _BY_KEY.get(_normalise(str(name)))
    if spec is None:
        near = _closest_gpus(str(name))
        hint = (f"did you mean {' or '.join(repr(n) for n in near)}?" if near
                else f"known GPUs: {', '.join(GPUS)}.")
        raise ValueError(f"unknown GPU {name!r}; {hint} Or give the capacity in bytes or as a size such as '80GiB'")
    return spec


def _closest_gpus(name: str, n: int = 3) -> tuple[str, ...]:
    """Up to ``n`` known names that ``name`` is most likely meant as, best first.

    Known names that start with ``name`` come first (``A100`` is ``A100-40GB`` or ``A100-80GB``:
    the table keys a model by its memory), then those that contain it (``4090``), then
    :mod:`difflib`'s close matches (``H10-80GB``).
    """
    key = _normalise(name)
    if not key:
        return ()
    started = [spec.name for k, spec in _BY_KEY.items() if k.startswith(key)]
    started += [spec.name for k, spec in _BY_KEY.items() if key in k[1:]]
    similar = [_BY_KEY[k].name for k in difflib.get_close_matches(key, _BY_KEY, n=n, cutoff=0.7)]
    return tuple(dict.fromkeys(started + similar))[:n]


# ---------------------------------------------------------------------------
# Caching allocator model


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = field(default=None, repr=False)
    next: _Block | None = field(default=None, repr=False)
    small: bool = False

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocatorModel:
    """Replay allocations and frees through a model of the CUDA caching allocator.

    Best fit over cached free blocks (smallest that fits, then lowest
    address), a block split when the remainder is worth keeping (>= 512 B in
    the small pool, > 1 MiB in the large pool), neighbours merged on free,
    segments never returned to the driver (no ``empty_cache``). Segment
    creation order stands in for device addresses. ``allocated`` and
    ``reserved`` mirror ``memory_allocated`` / ``memory_reserved``, with peaks.
    """

    def __init__(self, accounting: CudaAccounting) -> None:
        self.acc = accounting
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._blocks: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[Any, _Block] = {}
        self._segments = 0

    def malloc(self, key: Any, nbytes: int) -> None:
        """Allocate ``nbytes`` under ``key`` (a later :meth:`free` names it)."""
        size = self.acc.block_size(nbytes)
        if size == 0:  # zero-byte tensors take no allocation
            return
        small = size <= self.acc.small_size
        block = self._take_free(small, size)
        if block is None:
            seg = self.acc.segment_size(size)
            block = _Block(segment=self._segments, offset=0, size=seg, small=small)
            self._segments += 1
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if remaining >= self.acc.min_block if small else remaining > self.acc.small_size:
            rest = _Block(segment=block.segment, offset=block.offset + size, size=remaining,
                          prev=block, next=block.next, small=small)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._put_free(rest)
        block.free = False
        self._live[key] = block
        # an unsplit block counts whole in allocated_bytes, as in the real allocator
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Any) -> None:
        """Return the block allocated under ``key`` to the cache (unknown keys are ignored)."""
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._drop_free(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._put_free(block)

    def _take_free(self, small: bool, size: int) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None
        key = pool.pop(i)
        return self._blocks.pop(key)

    def _put_free(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self._free[block.small], key)
        self._blocks[key] = block

    def _drop_free(self, block: _Block) -> None:
        key = block.key()
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, key)
        del pool[i]
        del self._blocks[key]
