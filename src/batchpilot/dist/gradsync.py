"""Averaging gradients over data-parallel ranks, and broadcasting buffers, by hand.

With a deferred sync every micro-batch runs under DDP's ``no_sync``, so the coordinator
averages the gradients here once no rank ran out of memory (packed small gradients, large ones
in place). Every rank must call these in the same order, outside any ``except`` block.
Details: ``docs/internals.md#gradsync``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["all_reduce_gradients", "broadcast_buffers", "syncs_buffers"]

# Gradients smaller than this are packed into flat buckets: for them a collective's fixed
# latency outweighs the bytes. Larger ones are all-reduced in place, which needs no copy, so
# the sync's extra memory is at most one bucket of small gradients.
_PACK_BELOW = 2**20


def _noop() -> None:
    return None


def all_reduce_gradients(
    params: list[torch.Tensor], world: int, group: Any = None, *,
    bucket_cap_bytes: int, on_collective: Callable[[], None] | None = None,
    extra: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Average the (dense) gradients of ``params`` over the ``world`` ranks of ``group``.

    Gradients under 1 MiB go in packed buckets of at most ``bucket_cap_bytes`` (the first one
    with a presence flag per parameter); larger ones are all-reduced in place. ``params`` must
    not be empty and must be the same parameters, in the same order, on every rank.

    ``extra``, a 1-D float tensor of the same length on every rank, is summed over ranks in the
    first collective when that bucket is fp32 or fp64 (a few values more in an existing
    all-reduce), else in an fp32 all-reduce of its own. Returns that sum (``None`` without it).
    """
    count = on_collective or _noop
    small = [p for p in params if _nbytes(p) < _PACK_BELOW]
    large = [p for p in params if _nbytes(p) >= _PACK_BELOW]
    buckets = _buckets(small, bucket_cap_bytes) or [[]]
    # The first collective also carries one presence flag per parameter, so every rank knows
    # which gradients exist anywhere before the in-place all-reduces below (which must pair up).
    count()
    anchor = buckets[0][0] if buckets[0] else params[0]
    ride = extra is not None and anchor.dtype in (torch.float32, torch.float64)
    present, summed = _all_reduce_packed(buckets[0], world, group, flags_for=params, extra=extra if ride else None)
    if extra is not None and not ride:
        # low-precision buckets would round the values (bf16) or overflow them (fp16)
        count()
        summed = extra.detach().to(torch.float32).clone()
        dist.all_reduce(summed, group=group)
    works = []
    for bucket in buckets[1:]:
        count()
        _all_reduce_packed(bucket, world, group, present=present)
    for p in large:
        if not present[id(p)]:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # another rank has this gradient: ours is zero
        else:
            # dividing first keeps fp16 sums in range, as DDP's gradient pre-division does
            p.grad.div_(world)
        count()
        works.append(dist.all_reduce(p.grad, group=group, async_op=True))
    for work in works:
        work.wait()
    return summed


def broadcast_buffers(
    buffers: list[torch.Tensor], group: Any = None, *,
    bucket_cap_bytes: int, on_collective: Callable[[], None] | None = None,
) -> None:
    """Overwrite ``buffers`` with the group's rank 0's values, one broadcast per bucket."""
    count = on_collective or _noop
    for bucket in _buckets(buffers, bucket_cap_bytes):
        count()
        _broadcast_bucket(bucket, group)


def syncs_buffers(model: nn.Module) -> bool:
    """Whether ``model`` is a DDP wrapper that broadcasts rank 0's buffers before its forward."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return False
    return bool(getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", False)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(tensors: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, at most ``cap_bytes`` per bucket.

    Every rank holds the same parameters in the same order, so the buckets pair up.
    """
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        last = buckets[-1] if buckets else None
        if last is None or size + _nbytes(t) > cap_bytes or (t.dtype, t.device) != (last[0].dtype, last[0].device):
            buckets.append([t])
            size = _nbytes(t)
        else:
            last.append(t)
            size += _nbytes(t)
    return buckets


def _all_reduce_packed(
    params: list[torch.Tensor], world: int, group: Any, *,
    flags_for: list[torch.Tensor] = (), present: dict[int, bool] | None = None,
    extra: torch.Tensor | None = None,
) -> tuple[dict[int, bool], torch.Tensor | None]:
    """Average the gradients of ``params`` over ranks with one all-reduce of a flat copy.

    With ``flags_for``, the buffer ends with one presence flag per parameter listed there
    (1 where this rank has its gradient; summed over ranks, non-zero where any rank has it),
    and the result is ``{id(param): present on some rank}``; otherwise ``present`` must be
    that mapping from an earlier call. A gradient that is ``None`` here but present elsewhere
    is created. ``extra`` values ride after the flags and come back summed over ranks. The
    copy is allocated after the backward, when the step's activations are gone.
    """
    anchor = params[0] if params else flags_for[0]
    # flags ride in the bucket's own dtype: a sum of 0s and 1s is non-zero exactly when one was 1
    dtype = anchor.dtype if anchor.is_floating_point() else torch.float32
    numels = [p.numel() for p in params]
    tail = 0 if extra is None else extra.numel()
    flat = torch.empty(sum(numels) + len(flags_for) + tail, dtype=dtype, device=anchor.device)
    offset = 0
    for p, n in zip(params, numels):
        view = flat.narrow(0, offset, n)
        if p.grad is None:
            view.zero_()
        else:
            torch.div(p.grad.reshape(-1), world, out=view)
        offset += n
    if flags_for:
        flags = torch.tensor([p.grad is not None for p in flags_for], dtype=dtype)
        flat.narrow(0, offset, len(flags_for)).copy_(flags)
    if extra is not None:
        flat.narrow(0, offset + len(flags_for), tail).copy_(extra.detach().reshape(-1))
    dist.all_reduce(flat, group=group)
    if flags_for:
        present = {id(p): v != 0 for p, v in zip(flags_for, flat.narrow(0, offset, len(flags_for)).tolist())}
    assert present is not None
    summed = None if extra is None else flat.narrow(0, offset + len(flags_for), tail).to(extra.dtype, copy=True)
    offset = 0
    for p, n in zip(params, numels):
        view = flat.narrow(0, offset, n).view_as(p)
        offset += n
        if p.grad is not None:
            p.grad.copy_(view)
        elif present[id(p)]:
            p.grad = view.clone()
    return present, summed


def _broadcast_bucket(buffers: list[torch.Tensor], group: Any) -> None:
    """Overwrite ``buffers`` with rank 0's values, in one broadcast."""
    with torch.no_grad():
        flat = torch.cat([b.reshape(-1) for b in buffers])
        # the group's rank 0, which DDP treats as authoritative
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for b in buffers:
            b.copy_(flat.narrow(0, offset, b.numel()).view_as(b))
            offset += b.numel()
