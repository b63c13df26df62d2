"""The planner's FSDP2 part: shard the fake model over a fake process group of N ranks.

:func:`batchpilot.plan.planner.plan_batch_size` (``world_size=N, sharding="fsdp2"``) runs the step of
rank 0 of N on fake tensors: ``fully_shard`` over a fake process group, whose collectives move no
data. Every rank holds the same bytes (FSDP2 pads each shard to the same size), so rank 0's peak
is every rank's. Details: ``docs/internals.md#fsdp``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.utils._python_dispatch import _disable_current_modes

from ..core.sharding import all_fsdp_param_groups, fsdp_param_groups, is_fsdp, shard_model
from .result import PlanningError

__all__ = ["SHARDINGS", "ShardFn", "FakeShards", "fake_process_group"]

#: ``sharding=`` values the planner knows
SHARDINGS = ("fsdp2",)

#: ``shard_fn(model, mesh)`` applying ``fully_shard`` your way (default: each block, then the root)
ShardFn = Callable[[nn.Module, Any], Any]


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A process group of ``world_size`` ranks that is only this one (rank 0); yields a 1-D CPU mesh.

    Raises:
        PlanningError: a process group is already initialised in this process (plan before
            ``init_process_group``, or in a separate process).
    """
    if dist.is_initialized():
        raise PlanningError(
            "planning for N ranks needs a fake process group, and this process already runs a real one; "
            "plan before init_process_group (or in another process: batchpilot plan --fsdp --world-size N)"
        )
    # registers the "fake" backend: a process group whose collectives move no data
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        with _disable_current_modes():  # the mesh is a real (small) tensor, never a fake one
            mesh = init_device_mesh("cpu", (world_size,))
        yield mesh
    finally:
        dist.destroy_process_group()


class FakeShards:
    """The sharded fake model's hooks for the planner's counter: what each storage is."""

    def __init__(self, model: nn.Module, mesh: Any, fake_mode: Any, shard_fn: ShardFn | None) -> None:
        with fake_mode:
            if shard_fn is None:
                shard_model(model, mesh=mesh)
            else:
                shard_fn(model, mesh)
        if not is_fsdp(model):
            raise ValueError("shard_fn did not call fully_shard on the model; apply it to the blocks and the root")
        self.model = model
        self.counter: Any = None
        for m in model.modules():
            if hasattr(m, "set_custom_all_gather") and fsdp_param_groups(m):
                m.set_custom_all_gather(_MarkingAllGather(self))
                m.set_custom_reduce_scatter(_MarkingReduceScatter(self))

    def attach(self, counter: Any) -> list[Any]:
        """Mark unsharded gradients for ``counter``; returns hook handles to remove after the steps.

        Unsharded parameters exist from the first forward on, so a forward hook registers their
        gradient hooks then (before any backward).
        """
        self.counter = counter
        hooked: set[int] = set()
        handles: list[Any] = []

        def mark(p: torch.Tensor) -> None:
            counter.mark(p.grad, "gradients")

        def after_forward(*_: Any) -> None:
            for group in all_fsdp_param_groups(self.model):
                for fp in group.fsdp_params:
                    up = getattr(fp, "_unsharded_param", None)
                    if up is not None and id(up) not in hooked and up.requires_grad:
                        hooked.add(id(up))
                        handles.append(up.register_post_accumulate_grad_hook(mark))

        handles.append(self.model.register_forward_hook(after_forward))
        return handles


def _marking(base: type) -> type:
    class Marking(base):  # type: ignore[misc,valid-type]
        def __init__(self, shards: FakeShards) -> None:
            self.shards = shards

        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            t = super().allocate(size, dtype=dtype, device=device)
            counter = self.shards.counter
            if counter is not None:
                counter.mark(t, "communication")
            return t

    return Marking


_MarkingAllGather = _marking(DefaultAllGather)
_MarkingReduceScatter = _marking(DefaultReduceScatter)
