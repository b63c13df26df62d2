"""The agreements that keep data-parallel ranks in step, and the finder on every rank.

Every memory decision is one small all-reduce that every rank reaches, after its local work
has left any ``except`` block (MIN for a size, MAX for a failure); outside a process group each
agreement is the local value. Rank helpers live in :mod:`batchpilot.core.ranks`.
Details: ``docs/internals.md#distributed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
import logging
import os
import sys
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..core.ranks import default_device, group_size, is_distributed, known_rank, local_rank, rank, world_size
from ..core.sharding import is_fsdp
from ..find.finder import find_batch_size
from ..find.options import option_default
from ..find.result import BatchPlan
from ..memory.oom import is_oom
from ..policy.search import NothingFitsError
from .coordinator import LocalCoordinator
from .gradsync import all_reduce_gradients, broadcast_buffers, syncs_buffers

__all__ = [
    "is_distributed",
    "known_rank",
    "rank",
    "world_size",
    "local_rank",
    "default_device",
    "init_distributed",
    "all_reduce_int",
    "all_reduce_ints",
    "agree_min_with_rank",
    "DistributedCoordinator",
    "find_batch_size_distributed",
    "unwrap_model",
]

logger = logging.getLogger(__name__)

ReduceOp = Literal["min", "max", "sum"]

_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}

def init_distributed(
    *, backend: str | None = None, timeout: timedelta = timedelta(minutes=10)
) -> torch.device:
    """Join the process group torchrun describes (if any) and return this rank's device.

    Without ``$WORLD_SIZE`` (not launched by torchrun) nothing is initialised and the CPU or
    the first GPU is returned, so one script runs both ways. The backend defaults to NCCL on
    CUDA and gloo on CPU; CUDA ranks are pinned to ``cuda:<local_rank>`` first, because NCCL
    uses the current device.

    Args:
        backend: ``"gloo"``, ``"nccl"``...; ``None`` picks by device.
        timeout: How long a collective waits for the other ranks before failing. A rank that
            died or took another path then raises instead of hanging forever.

    Raises:
        ValueError: The torchrun environment variables are malformed.
    """
    device = default_device()
    if is_distributed() or "WORLD_SIZE" not in os.environ:
        return device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=timeout)
    logger.info("rank %d of %d joined the %s process group on %s", rank(), world_size(), backend, device)
    return device


# ---------------------------------------------------------------------------
# Collectives


def _collective_device(group: Any) -> torch.device:
    """Where a tensor for ``group``'s backend must live: CPU for gloo, the current GPU for NCCL."""
    config = str(dist.get_backend_config(group))  # e.g. "gloo", "cpu:gloo,cuda:nccl"
    if ":" in config:
        types = [part.split(":", 1)[0] for part in config.split(",")]
    else:
        types = {"gloo": ["cpu"], "mpi": ["cpu"], "nccl": ["cuda"], "xccl": ["xpu"]}.get(config, ["cpu"])
    if "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    return torch.device(kind, getattr(torch, kind).current_device())


def _refuse_inside_oom_handler(what: str) -> None:
    handled = sys.exc_info()[1]
    if handled is not None and is_oom(handled):
        # The rank that raised would wait here while its traceback pins the activations that
        # filled the memory, and the other ranks may be inside a different collective.
        raise RuntimeError(
            f"{what} called while an out-of-memory error is being handled; record the OOM, "
            "leave the except block (batchpilot.memory.oom.attempt does this), then agree"
        )


def all_reduce_int(value: int, op: ReduceOp = "min", *, group: Any = None) -> int:
    """Reduce one integer over all ranks; the local value when not distributed.

    Every rank must call it, in the same order as the other collectives. On NCCL the value
    travels through the current GPU and ``.item()`` waits for it: a host-device sync point.

    Args:
        value: This rank's integer (int64 range).
        op: ``"min"``, ``"max"`` or ``"sum"``.
        group: A process group; ``None`` is the default group.

    Raises:
        ValueError: ``op`` is not one of the three.
        RuntimeError: Called while an OOM exception is being handled (see the module docstring).
    """
    return all_reduce_ints([value], op, group=group)[0]


def all_reduce_ints(values: list[int], op: ReduceOp, *, group: Any = None) -> list[int]:
    """:func:`all_reduce_int` of several integers in one collective (one reduction for all of them)."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}")
    _refuse_inside_oom_handler("an agreement (all-reduce)")
    if group_size(group) == 1:
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(t, op=_OPS[op], group=group)
    return t.tolist()


def agree_min_with_rank(value: int, *, group: Any = None) -> tuple[int, int]:
    """The minimum of ``value`` over ranks and the lowest rank that holds it, in one all-reduce.

    Raises:
        RuntimeError: As :func:`all_reduce_int`.
    """
    lowest, who, _, _ = _agree_min_rank_max(value, group=group)
    return lowest, who


def _agree_min_rank_max(value: int, *, group: Any, flag: bool = False) -> tuple[int, int, int, int | None]:
    """``(min, lowest rank holding it, max, lowest flagged rank or None)`` of ``value`` over ranks, in one all-reduce.

    ``value × world + rank`` orders first by value, then by rank, so its minimum carries both;
    the minimum of ``-value`` is minus the maximum, and that of ``(not flag) × world + rank``
    the lowest flagged rank (``world`` or more when none is): one all-reduce MIN of three ints.
    """
    if not is_distributed():
        return int(value), rank(), int(value), (rank() if flag else None)
    world, me = group_size(group), dist.get_rank(group)
    encoded, negated, flagged = all_reduce_ints(
        [int(value) * world + me, -int(value), (0 if flag else world) + me], "min", group=group
    )
    # Python's floor division makes the decoding exact for negative values too.
    lowest, who = divmod(encoded, world)
    return lowest, who, -negated, (flagged if flagged < world else None)


# ---------------------------------------------------------------------------
# The engine's coordinator


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper; any other module unchanged.

    Calling the inner module runs no DDP hook and no collective (its reducer only acts on a
    backward that follows a forward through the wrapper), so probes and trials may run a
    different number of times on each rank.
    """
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@dataclass(kw_only=True)
class DistributedCoordinator(LocalCoordinator):
    """Keep ranks in step inside :class:`batchpilot.train.engine.Engine`: pass ``coordinator=`` it.

    With ``defer_grad_sync=True`` (the default and the safe choice) the engine runs every
    micro-batch under ``no_sync``; after the last one, :meth:`agree_oom` (an all-reduce of
    "this rank ran out of memory", which also names the lowest such rank) runs on every rank, and only if no rank failed does
    :meth:`sync_gradients` average the gradients. A rank that failed therefore never leaves
    another waiting inside a gradient all-reduce: all ranks drop their gradients, agree on the
    smaller micro-batch (all-reduce MIN, :meth:`agree_micro_batch`) and retry the same batch.
    A clean step agrees once: :meth:`agree` carries the OOM vote and the next micro-batch.

    The price is overlap: DDP all-reduces each gradient bucket while the rest of the last
    backward is still running; here the all-reduce starts after the whole backward. With
    ``defer_grad_sync=False`` the engine keeps DDP's overlapped all-reduce in the last
    micro-batch's backward, but an OOM on one rank while another is inside that backward
    cannot be agreed on: the collectives no longer pair up, and the job fails (at the latest at
    the process group's timeout). Use it only where OOMs are ruled out. (The engine's finder is
    safe either way: its trials run the module inside the wrapper, and
    :func:`find_batch_size_distributed` agrees on the answer.)

    Outside a process group (or with one rank) every agreement is the local value.

    Args:
        group: The process group; ``None`` is the default group.
        defer_grad_sync: See above.
        bucket_cap_mb: Gradients are all-reduced in flat buckets of at most this many MiB
            (DDP's default is 25): larger buckets mean fewer collectives, more extra memory.
        sync_buffers: After the gradients, broadcast module buffers (BatchNorm running
            statistics) from rank 0 when the DDP wrapper would (its ``forward_sync_buffers``).
            Under ``no_sync`` DDP stops doing so itself.

    Attributes:
        limited_by_rank: The rank whose proposal last set the agreed micro-batch below another
            rank's (the lowest such rank); while all ranks agree it keeps its value.
        oom_rank: The lowest rank that ran out of memory in the last agreement that found an OOM.
        remote_ooms: Attempts this rank retried because *another* rank ran out of memory.
        collectives: Collectives this coordinator has run (agreements, gradient buckets, buffers).

    Raises:
        ValueError: ``bucket_cap_mb`` is not a positive number.
    """

    group: Any = None
    defer_grad_sync: bool = True
    bucket_cap_mb: float = 25.0
    sync_buffers: bool = True
    limited_by_rank: int | None = field(default=None, init=False)
    oom_rank: int | None = field(default=None, init=False)
    remote_ooms: int = field(default=0, init=False)
    collectives: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) or not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {self.bucket_cap_mb!r}")

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 2**20)

    @property
    def world_size(self) -> int:
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if is_distributed() else 0

    def agree_oom(self, oom: bool) -> bool:
        """True on every rank when any rank ran out of memory (all-reduce MIN); sets :attr:`oom_rank`.

        Raises:
            RuntimeError: Called while an OOM is being handled (inside its ``except`` block).
        """
        self.collectives += 1
        world = self.world_size
        # the lowest rank that ran out, or world or more when none did: one all-reduce MIN
        flagged = all_reduce_int((0 if oom else world) + self.rank, "min", group=self.group)
        anyone = flagged < world
        if anyone:
            self.oom_rank = flagged
        if anyone and not oom:
            self.remote_ooms += 1
            logger.info("another rank ran out of memory; dropping this rank's gradients too")
        return anyone

    def agree_micro_batch(self, size: int) -> int:
        """The smallest proposal over ranks (all-reduce MIN); records :attr:`limited_by_rank`.

        Raises:
            RuntimeError: As :meth:`agree_oom`.
        """
        self.collectives += 1
        agreed, who, largest, _ = _agree_min_rank_max(int(size), group=self.group)
        return self._record(size, agreed, who, largest)

    def agree(self, oom: bool, size: int) -> tuple[bool, int]:
        """:meth:`agree_oom` and :meth:`agree_micro_batch` in one all-reduce (MIN of three ints).

        The engine calls it once per attempt of an ``"auto"`` step, so a clean step costs one
        agreement besides the gradient sync.

        Returns:
            ``(True, size)`` when any rank ran out of memory (the proposals are then unused),
            else ``(False, the smallest proposal)``.

        Raises:
            RuntimeError: As :meth:`agree_oom`.
        """
        self.collectives += 1
        agreed, who, largest, flagged = _agree_min_rank_max(int(size), group=self.group, flag=oom)
        if flagged is not None:
            self.oom_rank = flagged
            if not oom:
                self.remote_ooms += 1
                logger.info("another rank ran out of memory; dropping this rank's gradients too")
            return True, int(size)
        return False, self._record(size, agreed, who, largest)

    def _record(self, size: int, agreed: int, who: int, largest: int) -> int:
        if agreed < largest or self.limited_by_rank is None:
            # when every rank proposes the same size, the rank that last limited it still does
            self.limited_by_rank = who
        if agreed != size:
            logger.debug("micro-batch %d -> %d (limited by rank %d)", size, agreed, who)
        return agreed

    def total_count(self, count: Any) -> Any:
        """Sum a ``(sum, count)`` loss's count over ranks; a tensor stays a tensor.

        Raises:
            RuntimeError: As :meth:`agree_oom`.
        """
        if self.world_size == 1:
            return count
        _refuse_inside_oom_handler("total_count")
        self.collectives += 1
        if isinstance(count, torch.Tensor):
            total = count.detach().to(device=_collective_device(self.group), dtype=torch.float64).reshape(1)
            dist.all_reduce(total, group=self.group)
            return total.to(count.device, count.dtype).reshape(count.shape)
        if isinstance(count, int):
            return all_reduce_int(count, "sum", group=self.group)
        total = torch.tensor([float(count)], dtype=torch.float64, device=_collective_device(self.group))
        dist.all_reduce(total, group=self.group)
        return float(total.item())

    def sync_gradients(self, model: nn.Module) -> None:
        """Average every gradient over ranks, then (as DDP would) broadcast rank 0's buffers.

        Called by the engine after :meth:`agree_oom` returned False. Gradients of 1 MiB
        or more are all-reduced where they lie (no extra memory); smaller ones are packed into
        flat buckets of at most ``bucket_cap_mb``, the only memory this needs. A parameter whose gradient is ``None`` on some ranks counts as zero there; it
        stays ``None`` only if it is ``None`` on every rank, as under DDP with
        ``find_unused_parameters=True``.

        Raises:
            ValueError: A gradient is sparse.
            RuntimeError: As :meth:`agree_oom`.
        """
        self._sync(model, None)

    def sync_gradients_and_sum(self, model: nn.Module, values: torch.Tensor) -> torch.Tensor:
        """:meth:`sync_gradients`, and ``values`` (1-D, float) summed over ranks in its first collective.

        The engine sends the gradient noise scale's local norms this way: a few values more in
        an all-reduce that runs anyway (one of their own when the first bucket is fp16/bf16).

        Raises:
            ValueError, RuntimeError: As :meth:`sync_gradients`.
        """
        summed = self._sync(model, values)
        return values if summed is None else summed

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (1-D, float) summed over ranks, in an all-reduce of their own.

        Raises:
            RuntimeError: As :meth:`agree_oom`.
        """
        if self.world_size == 1:
            return values
        _refuse_inside_oom_handler("sum_over_ranks")
        self.collectives += 1
        summed = values.detach().to(device=_collective_device(self.group), dtype=torch.float32, copy=True)
        dist.all_reduce(summed, group=self.group)
        return summed.to(values.device)

    def find_batch_size(self, step: Callable[..., Any], *, restore: Iterable[Any] = (),
                        replay: Callable[[int], Any] | None = None, **options: Any) -> BatchPlan:
        """:func:`find_batch_size_distributed` over this coordinator's group (the engine's ``"auto"`` start).

        Records :attr:`limited_by_rank`: the agreement that follows sees equal proposals, and
        only the search knows which rank limited them. ``replay`` is not needed (ranks search alone).
        """
        plan = find_batch_size_distributed(step, restore=restore, group=self.group, **options)
        self.limited_by_rank = plan.limited_by_rank
        return plan

    def _sync(self, model: nn.Module, values: torch.Tensor | None) -> torch.Tensor | None:
        world = self.world_size
        if world == 1:
            return values
        _refuse_inside_oom_handler("sync_gradients")
        params = [p for p in unwrap_model(model).parameters() if p.requires_grad]
        if not params:
            return None if values is None else self.sum_over_ranks(values)
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError("sparse gradients are not supported by DistributedCoordinator.sync_gradients")
        summed = all_reduce_gradients(params, world, self.group, bucket_cap_bytes=self.bucket_cap_bytes,
                                      on_collective=self._count_collective, extra=values)
        if self.sync_buffers and syncs_buffers(model):
            broadcast_buffers(list(unwrap_model(model).buffers()), self.group,
                              bucket_cap_bytes=self.bucket_cap_bytes, on_collective=self._count_collective)
        return summed

    def _count_collective(self) -> None:
        self.collectives += 1


# ---------------------------------------------------------------------------
# The finder on every rank


def _min_batch_size(options: dict[str, Any]) -> int:
    """The smallest size a search with these keywords considers (an override, ``options=``'s, or the default)."""
    if "min_batch_size" in options:
        return int(options["min_batch_size"])
    base = options.get("options")
    return int(base.min_batch_size if base is not None else option_default("min_batch_size"))


# What a rank contributes to the agreement when its local search did not produce a size.
_NOTHING_FITS = 0
_FAILED = -1


@contextlib.contextmanager
def _forbid_wrapper_calls(wrappers: list[nn.Module]) -> Iterator[None]:
    """Fail a probe that runs the DDP wrapper's forward (its buffer broadcast is a collective)."""

    def refuse(module: nn.Module, args: Any) -> None:
        raise RuntimeError(
            "the step passed to find_batch_size_distributed called the DistributedDataParallel "
            "wrapper; ranks run different trials, so its collectives would not pair up. Call "
            "the inner module (ddp_model.module, or batchpilot.dist.distributed.unwrap_model) in the step"
        )

    handles = [w.register_forward_pre_hook(refuse) for w in wrappers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def find_batch_size_distributed(
    step: Callable[[int], Any],
    *,
    restore: Iterable[Any] = (),
    group: Any = None,
    agree: bool = True,
    **options: Any,
) -> BatchPlan:
    """Run :func:`~batchpilot.find.finder.find_batch_size` on every rank and agree on the smallest answer.

    Each rank searches on its own device with no collective in between (ranks may run different
    trials and OOM at different sizes); then one all-reduce MIN, after every local search has
    returned or failed, gives all ranks the same ``batch_size``, and ``limited_by_rank`` names
    the rank whose memory set it. The rest of the plan (trials, fit, capacity) is this rank's.

    The step must run the *unwrapped* model: ``ddp_model.module`` (see :func:`unwrap_model`),
    never the ``DistributedDataParallel`` wrapper, whose forward may broadcast buffers and whose
    backward all-reduces gradients. Wrappers passed in ``restore`` are unwrapped for the
    snapshot, and a step that calls one of them fails on every rank with a clear message.
    Outside a process group this is :func:`find_batch_size` with ``limited_by_rank=0``.

    Args:
        step: ``step(batch_size)`` running one training step of the unwrapped model.
        restore: As :func:`~batchpilot.find.finder.find_batch_size`; DDP wrappers are unwrapped.
        group: The process group; ``None`` is the default group.
        agree: ``False``: every rank keeps its own answer (uneven shares of a global batch, where
            each rank runs its own micro-batch); failures are still agreed on, so a rank where
            nothing fits stops every rank.
        **options: Any other keyword of :func:`~batchpilot.find.finder.find_batch_size` (``device``,
            ``target``, ``options``, and the fields of :class:`~batchpilot.find.options.FindOptions`:
            ``capacity``, ``strategy``, ``max_batch_size``...).

    Raises:
        NothingFitsError: Not even the smallest batch fits on some rank (on every rank; the
            message names the rank).
        ValueError: A model in ``restore`` is sharded with ``fully_shard`` (see
            :func:`batchpilot.dist.fsdp.find_batch_size_fsdp`).
        RuntimeError: The search failed on another rank (this rank re-raises its own error).
        BatchSizeError: Invalid options, as :func:`~batchpilot.find.finder.find_batch_size`.
    """
    items = [o for o in restore if o is not None]
    if any(isinstance(o, nn.Module) and is_fsdp(o) for o in items):
        raise ValueError(
            "the model is sharded with fully_shard (FSDP2): its forward runs collectives, so ranks "
            "cannot search alone; use batchpilot.dist.fsdp.find_batch_size_fsdp, which runs the trials in lockstep"
        )
    wrappers = [o for o in items if isinstance(o, nn.parallel.DistributedDataParallel)]
    targets = [unwrap_model(o) if isinstance(o, nn.Module) else o for o in items]
    plan: BatchPlan | None = None
    error: Exception | None = None
    try:
        with _forbid_wrapper_calls(wrappers):
            plan = find_batch_size(step, restore=targets, **options)
    except Exception as exc:  # every rank must reach the agreement below, failed or not
        error = exc
    # Outside the except block: the agreement is a collective every rank reaches.
    if plan is not None:
        mine = plan.batch_size
    else:
        mine = _NOTHING_FITS if isinstance(error, NothingFitsError) else _FAILED
    agreed, who = agree_min_with_rank(mine, group=group)
    if agreed > 0 and not agree:
        assert plan is not None
        return dataclasses.replace(plan, limited_by_rank=dist.get_rank(group) if is_distributed() else 0)
    if agreed > 0:
        assert plan is not None
        if agreed < plan.batch_size:
            logger.info("batch size %d here, %d agreed (limited by rank %d)", plan.batch_size, agreed, who)
        return dataclasses.replace(plan, batch_size=agreed, limited_by_rank=who)
    if error is not None and mine == agreed:
        raise error
    if agreed == _NOTHING_FITS:
        raise NothingFitsError(
            f"nothing fits on rank {who} (see its log); every rank must fit the batch, so the job "
            "cannot run there as configured: use a smaller model, mixed precision or a larger device",
            batch_size=_min_batch_size(options), peak_bytes=None,
            limit_bytes=plan.limit_bytes if plan is not None else 0,
            capacity_bytes=plan.capacity if plan is not None else 0,
        )
    raise RuntimeError(f"the batch-size search failed on rank {who} (see its error); stopping this rank too")
