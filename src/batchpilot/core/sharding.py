"""The sharded model: which modules ``fully_shard`` (FSDP2) wrapped, sharding a model, resetting it.

Shared by the planner (:mod:`batchpilot.plan.fsdp` shards a fake model the same way) and the
FSDP coordinator (:mod:`batchpilot.dist.fsdp`), which resets a sharded model after an OOM.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from .ranks import group_size, is_distributed

__all__ = ["all_fsdp_param_groups", "fsdp_modules", "fsdp_param_groups", "fsdp_roots", "is_fsdp", "sharded_over_ranks", "reset_fsdp_state",
           "reshard_fsdp", "shard_blocks", "shard_model"]


def _fsdp_module_type() -> type | None:
    """FSDP2's ``FSDPModule``, or ``None`` on torch < 2.6.

    Imported on first use, not with this module: ``torch.distributed.fsdp`` takes seconds to
    load, and a plain training script never needs it.
    """
    try:  # FSDP2 is public from torch 2.6
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return None
    return FSDPModule


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that were given to ``fully_shard``, in order."""
    kind = _fsdp_module_type()
    return [] if kind is None else [m for m in model.modules() if isinstance(m, kind)]


def is_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules was given to ``fully_shard``.

    The one answer to "is this FSDP2?" for every layer (the engine, the finder, the coordinators).
    """
    kind = _fsdp_module_type()
    return kind is not None and any(isinstance(m, kind) for m in model.modules())


def sharded_over_ranks(model: nn.Module) -> bool:
    """A ``fully_shard`` (FSDP2) model in a process group of more than one rank: its ranks must run
    every trial of a search together (one rank's OOM would leave the others in a collective)."""
    return group_size() > 1 and is_fsdp(model)


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost ``fully_shard`` modules of ``model`` (itself, when it was sharded last)."""
    kind = _fsdp_module_type()
    if kind is None:
        return []
    roots: list[nn.Module] = []
    inside: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, kind) and not any(name.startswith(p) for p in inside):
            roots.append(m)
            inside.append(f"{name}." if name else "")
    return roots


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks :func:`shard_model` shards by default, in order.

    The entries of the first ``nn.ModuleList`` or ``nn.Sequential`` (breadth first) with two or
    more entries that hold parameters: the transformer blocks of a GPT, the layers of an MLP.
    Empty when there is none (then only the root is sharded).
    """
    queue = [model]
    while queue:
        m = queue.pop(0)
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            blocks = [c for c in m.children() if any(True for _ in c.parameters())]
            if len(blocks) >= 2:
                return blocks
        queue += list(m.children())
    return []


def shard_model(model: nn.Module, *, mesh: Any = None, blocks: Iterable[nn.Module] | None = None,
                **fully_shard_kwargs: Any) -> nn.Module:
    """``fully_shard`` each block, then the whole model, as torchtitan does; returns ``model``.

    Args:
        mesh: a 1-D ``DeviceMesh``; default one over every rank of the default process group, on
            the current accelerator (CUDA) or the CPU.
        blocks: the modules to shard one by one; default :func:`shard_blocks`.
        **fully_shard_kwargs: passed to ``fully_shard`` (``mp_policy``, ``reshard_after_forward``).

    Raises:
        RuntimeError: no process group is initialised and no ``mesh`` is given.
    """
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        if not is_distributed():
            raise RuntimeError("shard_model needs a process group (torchrun and init_process_group) or a mesh")
        from torch.distributed.device_mesh import init_device_mesh

        kind = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(kind, (group_size(),))
    for block in (shard_blocks(model) if blocks is None else blocks):
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of one ``fully_shard`` module (one per mesh), oldest torch first.

    torch 2.13 keeps a list (``_fsdp_param_groups``, one group per mesh); torch 2.11 one group or
    ``None`` (``_fsdp_param_group``): the H200 image runs 2.11, CI 2.13.
    """
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def all_fsdp_param_groups(model: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of every ``fully_shard`` module of ``model`` (:func:`fsdp_param_groups` of each)."""
    groups = []
    for m in fsdp_modules(model):
        groups += fsdp_param_groups(m)
    return groups


def reshard_fsdp(model: nn.Module) -> None:
    """Register the sharded parameters of every ``fully_shard`` module of ``model``, freeing unsharded ones.

    A forward without backward (generation, evaluation under ``no_grad``) leaves the root's
    parameters unsharded, registered in its place; a copy taken then would point at storage
    FSDP frees at its next reshard. No collective runs.
    """
    for m in fsdp_modules(model):
        m.reshard()


def reset_fsdp_state(model: nn.Module) -> None:
    """Put a sharded model back between steps after a forward or backward failed half way.

    ``reset_iter_state()`` on each root reshards every parameter and clears FSDP's per-step
    bookkeeping; the gradients a no-sync micro-batch left unsharded (which that call keeps) are
    dropped too, so the retry accumulates from nothing. No collective runs.
    """
    for root in fsdp_roots(model):
        # before the first forward FSDP has not lazily initialised (it decides the root there):
        # nothing ran, nothing to reset, and reset_iter_state() would raise AttributeError
        if root._get_fsdp_state()._is_root is not None:
            root.reset_iter_state()
    for group in all_fsdp_param_groups(model):
        for p in group.fsdp_params:
            # gradients of no-sync micro-batches, waiting for the next reduce-scatter
            p.unsharded_accumulated_grad = None
            unsharded = getattr(p, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
