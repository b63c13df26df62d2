"""FSDP2 (``fully_shard``) in the engine and the finder: every rank in lockstep, OOMs survived.

FSDP2 all-gathers parameters inside forward and reduce-scatters gradients inside backward, so
ranks must run the same sizes in the same order. :class:`FSDPCoordinator` is the engine's hook
(chosen by itself for a sharded model): it counts FSDP's collectives, and a rank that runs out
of memory *replays* its attempt at one sample per micro-batch, issuing exactly the collectives
its peers still wait in; then all ranks agree, shrink and retry. Where even that cannot run, the
process group is aborted and every rank raises :class:`CollectiveOOMError` naming the rank.
:func:`find_batch_size_fsdp` runs the finder's trials in the same lockstep.
Details: ``docs/internals.md#fsdp``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.ranks import is_distributed
from ..core.sharding import fsdp_modules, fsdp_param_groups, fsdp_roots, is_fsdp, reset_fsdp_state
from ..find.finder import find_batch_size
from ..find.options import FindOptions
from ..find.result import BatchPlan
from ..memory.oom import Attempt, attempt, free_memory
from ..memory.units import resolve_device
from ..policy.search import FIT, OOM, OVER_TARGET, REFUSED, SearchSpace, Trial
from .distributed import DistributedCoordinator, all_reduce_ints

try:  # FSDP2 is public from torch 2.6
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch
    AllGather = ReduceScatter = object  # type: ignore[assignment,misc]

__all__ = [
    "CollectiveOOMError",
    "FSDPCoordinator",
    "find_batch_size_fsdp",
]

logger = logging.getLogger(__name__)

#: store keys of the hang guard (the process group's own store, which outlives an aborted group)
_FAILURE_KEY = "batchpilot/fsdp/failure"
_ACK_KEY = "batchpilot/fsdp/acks"


class CollectiveOOMError(RuntimeError):
    """A rank ran out of memory where its peers wait for it in a collective, and could not rejoin them.

    Raised on every rank (the one that ran out and those that waited), after the process group
    was aborted so that no rank waits forever.

    Attributes:
        rank: the rank that ran out of memory.
        micro_batch_size: the micro-batch (or trial batch) it ran out at.
        step: the engine step (``None`` in the finder).
        retryable: ``False``: :func:`batchpilot.memory.oom.is_oom` says no although the message quotes an
            OOM, so nothing retries a step whose process group is gone.
    """

    retryable = False

    def __init__(self, message: str, rank: int = -1, micro_batch_size: int = 0, step: int | None = None) -> None:
        super().__init__(message)
        self.rank, self.micro_batch_size, self.step = rank, micro_batch_size, step

    def __reduce__(self) -> tuple:  # pickles with its fields (multiprocessing, error files)
        return type(self), (str(self), self.rank, self.micro_batch_size, self.step)


# ---------------------------------------------------------------------------
# Counting FSDP's collectives, and skipping the ones already issued when replaying


class _Ledger:
    """How many collectives this attempt has issued; in a replay, the first ``skip`` run locally."""

    def __init__(self) -> None:
        self.issued = 0
        self.skip = 0
        self.kind: str | None = None  # the collective being prepared (allocate -> call)

    def begin(self) -> None:
        self.issued, self.skip, self.kind = 0, 0, None

    def enter(self) -> bool:
        """Count one collective; False when it is one the peers already ran with this rank."""
        self.issued += 1
        self.kind = None
        return self.issued > self.skip


class _LedgerAllGather(AllGather):
    def __init__(self, inner: Any, ledger: _Ledger) -> None:
        self.inner, self.ledger = inner, ledger

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.ledger.kind = "all-gather"
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        if not self.ledger.enter():
            output_tensor.zero_()  # a replay: the peers have this one; any finite values do
            return None
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)


class _LedgerReduceScatter(ReduceScatter):
    def __init__(self, inner: Any, ledger: _Ledger) -> None:
        self.inner, self.ledger = inner, ledger

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.ledger.kind = "reduce-scatter"
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if not self.ledger.enter():
            output_tensor.zero_()
            return None
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                          async_op=async_op)


def _install_ledger(model: nn.Module, ledger: _Ledger) -> int:
    """Route every FSDP module's all-gather and reduce-scatter through ``ledger``; their group size.

    Raises:
        ValueError: per-parameter meshes (several param groups in one module), or HSDP, whose
            all-reduce cannot be counted.
    """
    sizes = set()
    for m in fsdp_modules(model):
        groups = fsdp_param_groups(m)
        if not groups:
            continue
        if len(groups) > 1:
            raise ValueError(
                f"{type(m).__name__} has parameters on {len(groups)} meshes (shard_placement_fn); "
                "batchpilot's FSDP support needs one mesh per fully_shard module"
            )
        group = groups[0]
        if group._is_hsdp:
            raise ValueError(
                "HSDP (a 2-D replicate x shard mesh) is not supported by batchpilot's FSDP support yet: "
                "its all-reduce is not routed through FSDP's custom comm hooks; shard over a 1-D mesh"
            )
        ag, rs = group._all_gather_comm, group._reduce_scatter_comm
        if not isinstance(ag, _LedgerAllGather):
            m.set_custom_all_gather(_LedgerAllGather(ag, ledger))
        else:
            ag.ledger = ledger
        if not isinstance(rs, _LedgerReduceScatter):
            m.set_custom_reduce_scatter(_LedgerReduceScatter(rs, ledger))
        else:
            rs.ledger = ledger
        sizes.add(group.mesh_info.shard_mesh_size)
    if len(sizes) > 1:
        raise ValueError(f"fully_shard modules shard over different numbers of ranks {sorted(sizes)}; use one mesh")
    return sizes.pop() if sizes else 1


# ---------------------------------------------------------------------------
# The engine's coordinator


@dataclass(kw_only=True)
class FSDPCoordinator(DistributedCoordinator):
    """Keep ``fully_shard`` ranks in lockstep inside :class:`batchpilot.train.engine.Engine`.

    The engine picks it by itself for a model with ``fully_shard`` modules. Every micro-batch but
    the last runs with ``set_requires_gradient_sync(False)``; the last one's backward
    reduce-scatters the accumulated gradients (FSDP averages over the ranks, as DDP does). The
    agreements are :class:`~batchpilot.dist.distributed.DistributedCoordinator`'s: one all-reduce after
    each attempt carries the OOM vote and the next micro-batch, and one before each step checks
    that every rank brought a batch of the same size.

    When a rank runs out of memory in the middle of an attempt, its peers are inside, or about to
    enter, an FSDP collective it will not reach. It resets FSDP's state and *replays* the attempt
    with one sample per micro-batch: FSDP's collectives move parameters and gradients, whose
    sizes do not depend on the batch, so the replay issues the same sequence; the ones already
    issued are run locally (counted by the custom comm hooks), the rest pair with the peers'. Then
    every rank reaches the agreement, drops the gradients, shrinks and retries the same batch.
    If the replay itself runs out of memory (the unsharded parameters of one block do not fit),
    the rank records what happened in the process group's store, aborts the process group and
    raises :class:`CollectiveOOMError`. A watchdog thread on every other rank reads the record
    within ``guard_poll`` seconds and logs the error naming that rank and size (the failing rank
    waits up to ``guard_wait`` seconds for every peer to have done so before it raises, so that no
    launcher stops a peer before it said why); each peer's pending collective then fails — at once
    on NCCL (the abort), when the failed process exits on gloo (whose sockets close only then), at
    the latest at the process group's timeout — and raises the same error.

    Args:
        group: the agreement's process group; ``None`` is the default group, which must span the
            ranks the model is sharded over.
        guard_poll: seconds between the watchdog's looks at the store (one small request each);
            0 turns the watchdog off (the peers then report only when their collective fails).
        guard_wait: the most seconds a rank that cannot rejoin waits for its peers' reports.

    Attributes:
        replays: attempts this rank replayed after running out of memory itself.

    Raises:
        ValueError: ``guard_poll`` or ``guard_wait`` negative; (at :meth:`bind`) the model is
            sharded over a mesh the coordinator does not support or over another number of ranks.
    """

    defer_grad_sync: bool = field(default=False, init=False)
    lockstep = True  # FSDP's forward and backward run collectives: trials and attempts in lockstep
    guard_poll: float = 1.0
    guard_wait: float = 10.0
    replays: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("guard_poll", "guard_wait"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self._model: nn.Module | None = None
        self._roots: list[nn.Module] = []
        self._ledger = _Ledger()
        self._sync: bool | None = None
        self._store: Any = None

    # -- set-up ---------------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> None:
        """Attach to the sharded ``model`` (the engine calls this): count its collectives.

        Raises:
            ValueError: ``model`` has no ``fully_shard`` module, uses HSDP or per-parameter
                meshes, or is sharded over another number of ranks than the coordinator's group.
        """
        if not is_fsdp(model):
            raise ValueError("FSDPCoordinator needs a model with fully_shard modules; for DDP or a plain "
                             "model use batchpilot.dist.distributed.DistributedCoordinator")
        if self._model is model:
            return
        mesh_size = _install_ledger(model, self._ledger)
        if mesh_size != self.world_size:
            raise ValueError(
                f"the model is sharded over {mesh_size} ranks but the coordinator's group has "
                f"{self.world_size}; pass FSDPCoordinator(group=...) with the group of the FSDP mesh"
            )
        self._model, self._roots = model, fsdp_roots(model)
        self._sync = None
        if is_distributed():
            # kept: the hang guard writes here after the process group is gone
            self._store = dist.distributed_c10d._get_default_store()
            if self.world_size > 1 and self.guard_poll > 0 and self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, args=(self.rank,), daemon=True,
                                                  name="batchpilot-fsdp-guard")
                self._watchdog.start()

    def close(self) -> None:
        """Stop the watchdog thread (it is a daemon: leaving it running is harmless)."""
        self._stop.set()

    # -- the engine's hooks ---------------------------------------------------------------------
    def set_gradient_sync(self, sync: bool) -> None:
        """Whether the next backward reduce-scatters (the last micro-batch) or accumulates."""
        if sync is not self._sync:
            for root in self._roots:
                root.set_requires_gradient_sync(sync)
            self._sync = sync

    def agree_batch(self, samples: int) -> None:
        """Check that every rank brought a batch of ``samples`` rows (one all-reduce).

        Ranks with different batch sizes would run different numbers of micro-batches, and
        FSDP's collectives would pair across them and wait forever.

        Raises:
            ValueError: on every rank, when the sizes differ.
        """
        if self.world_size == 1:
            return
        self.collectives += 1
        low, high = all_reduce_ints([samples, -samples], "min", group=self.group)
        if low != -high:
            raise ValueError(
                f"the ranks brought batches of {low} to {-high} samples to this step (this rank {samples}); "
                "under FSDP every rank must take the same number: give each rank its share of one global "
                "batch (batchpilot.train.data.ElasticBatchSampler or DistributedSampler, which pad to equal shares)"
            )

    def attempt(self, run: Callable[[], Any], replay: Callable[[], Any], *, device: torch.device,
                on_oom: Callable[[], None] | None, micro_batch_size: int, step: int | None = None) -> Attempt:
        """Run one attempt; after an OOM here, replay it so that the peers' collectives complete.

        ``replay`` must run the same micro-batches at one sample each. Returns the attempt's
        outcome (the replay's is discarded); the caller then agrees as usual.

        Raises:
            CollectiveOOMError: the replay ran out of memory too (the process group is aborted).
        """
        self.count_collectives()
        outcome = attempt(run, device=device, on_oom=None)
        if not outcome.oom:
            return outcome
        issued = self.rejoin(replay, device=device, on_oom=on_oom, batch_size=micro_batch_size, step=step,
                             message=outcome.message or "")
        if issued is not None:
            logger.info("out of memory at micro-batch %d after %d FSDP collectives; replayed the rest at "
                        "one sample per micro-batch so that no rank waits", micro_batch_size, issued)
        return outcome

    def count_collectives(self) -> None:
        """Count FSDP's collectives from here: an attempt (or a finder's trial) begins."""
        self._ledger.begin()

    def rejoin(self, replay: Callable[[], Any], *, device: torch.device, on_oom: Callable[[], None] | None,
               batch_size: int, step: int | None = None, message: str = "") -> int | None:
        """After an OOM since :meth:`count_collectives`: reset FSDP, and replay so that the peers' collectives complete.

        ``replay`` issues the attempt's collectives at one sample per micro-batch; those this rank
        issued before it ran out run locally. ``on_oom`` drops what the attempt left (its gradients).

        Returns:
            The collectives issued before the OOM, or ``None`` alone (nothing to replay).

        Raises:
            CollectiveOOMError: the replay ran out of memory too (the process group is aborted).
        """
        ledger = self._ledger
        issued, kind = ledger.issued, ledger.kind
        self._clean(on_oom, device)
        if self.world_size == 1:
            return None
        ledger.skip, ledger.issued = issued, 0
        again = attempt(replay, device=device, on_oom=None)
        ledger.skip = 0
        self._clean(on_oom, device)
        if again.oom:
            self._give_up(batch_size, step, issued, kind, message, again.message or "")
        self.replays += 1
        return issued

    @property
    def model(self) -> nn.Module | None:
        """The sharded model :meth:`bind` attached to, or ``None`` before."""
        return self._model

    def explain(self, exc: BaseException) -> BaseException | None:
        """The error to raise instead of ``exc`` when a peer's failure caused it, else ``None``.

        A peer that could not rejoin aborted the process group after recording why; the
        collective this rank waited in then fails with a transport error, which is explained
        here (the original is chained).
        """
        if isinstance(exc, CollectiveOOMError) or self._store is None:
            return None
        record = self._failure_record()
        if record is None:
            return None
        return CollectiveOOMError(
            self._peer_message(record, self.rank), rank=int(record["rank"]),
            micro_batch_size=int(record["micro_batch_size"]), step=record.get("step"),
        )

    @staticmethod
    def _peer_message(record: dict[str, Any], rank: int) -> str:
        return (f"rank {record['rank']} ran out of memory at {record['at']}{record['message']}, and could not "
                f"rejoin the collectives this rank {rank} was waiting in. {record['advice']}")

    def find_batch_size(self, step: Callable[..., Any], *, restore: Iterable[Any] = (),
                        replay: Callable[[int], Any] | None = None, **options: Any) -> BatchPlan:
        """:func:`find_batch_size_fsdp` with this coordinator (the engine's ``"auto"`` start).

        Records :attr:`limited_by_rank`, as :meth:`DistributedCoordinator.find_batch_size` does.
        """
        plan = find_batch_size_fsdp(step, restore=restore, coordinator=self, replay=replay, **options)
        self.limited_by_rank = plan.limited_by_rank
        return plan

    def sync_gradients(self, model: nn.Module) -> None:
        """Nothing to do: FSDP reduce-scatters in the last micro-batch's backward."""
        return None

    # -- recovery ---------------------------------------------------------------------------------
    def _clean(self, on_oom: Callable[[], None] | None, device: torch.device) -> None:
        if self._model is not None:
            reset_fsdp_state(self._model)
        self._sync = None  # reset_iter_state leaves the flags; set them again before the next backward
        if on_oom is not None:
            on_oom()
        free_memory(device)

    def _give_up(self, micro: int, step: int | None, issued: int, kind: str | None, message: str,
                 replay_message: str) -> None:
        rank = self.rank
        where = (f"while preparing FSDP's {kind}, collective {issued + 1} of the attempt" if kind
                 else f"after {issued} FSDP collectives of the attempt")
        at = f"micro-batch {micro} (step {step}, {where})" if step is not None else \
            f"the finder's trial at batch size {micro} ({where})"
        advice = ("Even one sample per micro-batch does not fit next to the unsharded parameters of a "
                  "block: shard more finely (fully_shard each block), use mixed precision "
                  "(MixedPrecisionPolicy(param_dtype=torch.bfloat16)) or a larger device")
        first = f": {message}" if message else ""
        record = {"rank": rank, "micro_batch_size": micro, "step": step, "at": at, "message": first,
                  "advice": advice}
        text = (f"rank {rank} ran out of memory at {at}{first}, and again when replaying the attempt at one "
                f"sample per micro-batch ({replay_message}); its peers wait for it in a collective, so the "
                f"process group was aborted. {advice}")
        logger.error("%s", text)
        peers = self.world_size - 1
        self._stop.set()  # this rank's own watchdog has nothing to report
        if self._store is not None:
            self._store.set(_FAILURE_KEY, json.dumps(record))  # first: the peers read it when they fail
        if is_distributed():
            # NCCL fails the peers' pending collectives now; gloo closes its sockets at this process's exit
            dist.distributed_c10d._abort_process_group()
        if self._store is not None and peers > 0:
            # each peer's watchdog logs the error and acknowledges; only then may this process exit
            # (the launcher stops the peers as soon as it does)
            deadline = time.monotonic() + self.guard_wait
            while time.monotonic() < deadline and self._store.add(_ACK_KEY, 0) < peers:
                time.sleep(0.02)
        raise CollectiveOOMError(text, rank=rank, micro_batch_size=micro, step=step)

    def _watch(self, rank: int) -> None:
        """The watchdog: log a peer's failure as soon as it is recorded, while this rank still waits."""
        while not self._stop.wait(self.guard_poll):
            record = self._failure_record()
            if record is None or int(record["rank"]) == rank:
                continue
            logger.error("%s", self._peer_message(record, rank))
            try:
                self._store.add(_ACK_KEY, 1)
            except Exception:  # the store's host is gone: nobody waits for the acknowledgement
                pass
            return

    def _failure_record(self) -> dict[str, Any] | None:
        try:
            if not self._store.check([_FAILURE_KEY]):
                return None
            return json.loads(self._store.get(_FAILURE_KEY))
        except Exception:  # no store to ask: nothing to explain
            return None


# ---------------------------------------------------------------------------
# The finder in lockstep

_OUTCOMES = {FIT: 0, OVER_TARGET: 1, OOM: 2, REFUSED: 3}
_NONE = -1


class _Lockstep:
    """The finder's hooks (``find_batch_size(..., lockstep=)``): same trial everywhere, agreed after each."""

    def __init__(self, coordinator: FSDPCoordinator, replay: Callable[[int], Any], device: torch.device) -> None:
        self.coord, self.replay, self.device = coordinator, replay, device
        self.own_limit = 0
        #: per batch size, the rank with the least room under its own limit
        self.tightest: dict[int, int] = {}

    def agree_space(self, space: SearchSpace) -> SearchSpace:
        """The smallest capacity and limit over ranks: one search for all of them."""
        self.own_limit = space.limit_bytes
        cap, limit = all_reduce_ints([space.capacity_bytes, space.limit_bytes], "min", group=self.coord.group)
        return dataclasses.replace(space, capacity_bytes=cap, limit_bytes=limit)

    def agree_refusal(self, refused: bool) -> bool:
        """A trial one rank refuses (predicted to get it killed) is run by none."""
        return bool(all_reduce_ints([int(refused)], "max", group=self.coord.group)[0])

    def begin(self) -> None:
        self.coord.count_collectives()

    def recover(self, batch_size: int) -> None:
        """After an OOM here: reset FSDP and replay the trial at one sample, for the peers' collectives.

        Raises:
            CollectiveOOMError: the replay ran out of memory too.
        """
        self.coord.rejoin(lambda: self.replay(batch_size), device=self.device, on_oom=None, batch_size=batch_size)

    def agree_trial(self, trial: Trial, space: SearchSpace) -> Trial:
        """The trial as all ranks saw it: the worst outcome and the largest peak, in one all-reduce."""
        coord = self.coord
        world, rank = coord.world_size, coord.rank
        peak = trial.peak_bytes or 0
        if world == 1:
            self.tightest[trial.batch_size] = 0
            return trial
        room = self.own_limit - peak if trial.outcome != OOM else -(2**40)
        values = [
            _OUTCOMES[trial.outcome],
            peak,
            _NONE if trial.start_bytes is None else trial.start_bytes,
            _NONE if trial.tensor_bytes is None else trial.tensor_bytes,
            -(trial.bound_bytes if trial.bound_bytes is not None else 2**62),
            rank if trial.outcome == OOM else _NONE,
            int(trial.seconds * 1e6),
            # the least room under a rank's own limit, and the lowest rank that had it (MAX of -room)
            (-room) * world + (world - 1 - rank),
        ]
        outcome, peak, start, tensor, bound, oom_rank, micros, tight = all_reduce_ints(values, "max",
                                                                                       group=coord.group)
        self.tightest[trial.batch_size] = world - 1 - tight % world
        kind = {v: k for k, v in _OUTCOMES.items()}[outcome]
        if kind in (FIT, OVER_TARGET):
            kind = FIT if peak <= space.limit_bytes else OVER_TARGET
        message = trial.message
        if kind == OOM and trial.outcome != OOM:
            message = f"rank {oom_rank} ran out of memory"
        return Trial(
            batch_size=trial.batch_size, outcome=kind, peak_bytes=peak if peak or kind != OOM else None,
            start_bytes=None if start == _NONE else start, seconds=micros / 1e6, message=message,
            tensor_bytes=None if tensor == _NONE else tensor, bound_bytes=None if -bound >= 2**62 else -bound,
            rank=oom_rank if kind == OOM and oom_rank != _NONE else None,
        )


def find_batch_size_fsdp(
    step: Callable[[int], Any],
    *,
    restore: Iterable[Any] = (),
    coordinator: FSDPCoordinator | None = None,
    replay: Callable[[int], Any] | None = None,
    **options: Any,
) -> BatchPlan:
    """:func:`~batchpilot.find.finder.find_batch_size` for a ``fully_shard`` model, every rank in lockstep.

    Each trial runs the same batch size on every rank (FSDP's collectives pair up only so), and
    one all-reduce after it gives every rank the same view: the worst outcome and the largest
    peak. The capacity searched against is the smallest over ranks. A rank that runs out of
    memory in a trial replays it at one sample so that its peers' collectives complete (see
    :class:`FSDPCoordinator`). The sharded parameters and the optimizer's sharded state are
    snapshotted and restored bit for bit, as for any model. The answer is the same on every
    rank; ``plan.limited_by_rank`` is the rank with the least room under its own limit at that size.

    Args:
        step: ``step(batch_size)`` running one training step of the sharded model (its forward
            runs FSDP's collectives: call it on every rank).
        restore: as for :func:`~batchpilot.find.finder.find_batch_size`; the sharded model is taken from
            here when ``coordinator`` is not bound yet.
        coordinator: an :class:`FSDPCoordinator`; default a new one on the default group.
        replay: ``replay(batch_size)`` running the collectives of one step of a trial at
            ``batch_size`` with one sample; it runs ``steps_per_trial`` times, as the trial's step
            does. Default ``step(min_batch_size)``.
        **options: any other keyword of :func:`~batchpilot.find.finder.find_batch_size`: ``device``,
            ``target``, ``options`` and the fields of :class:`~batchpilot.find.options.FindOptions`.

    Raises:
        ValueError: no ``fully_shard`` model was given (in ``restore``) to an unbound coordinator.
        CollectiveOOMError: a rank could not rejoin after an OOM (on every rank).
        NothingFitsError, BatchSizeError: as :func:`~batchpilot.find.finder.find_batch_size`, on every rank.
    """
    items = [o for o in restore if o is not None]
    coord = coordinator if coordinator is not None else FSDPCoordinator()
    if coord.model is None:
        models = [o for o in items if isinstance(o, nn.Module) and is_fsdp(o)]
        if not models:
            raise ValueError("find_batch_size_fsdp needs the fully_shard model in restore=(model, optimizer)")
        coord.bind(models[0])
    device = options.pop("device", None)
    if options.get("target", 0) is None:  # find_batch_size's "the options' target"
        del options["target"]
    opts = FindOptions.build(options.pop("options", None), **options)
    steps, smallest = opts.steps_per_trial, opts.min_batch_size
    one_step = replay if replay is not None else (lambda _batch_size: step(smallest))

    def replay_trial(batch_size: int) -> None:
        # every step of the trial: the peers ran them all, whichever step this rank ran out in
        for _ in range(steps):
            one_step(batch_size)

    lockstep = _Lockstep(coord, replay_trial, resolve_device(device))
    try:
        plan = find_batch_size(step, device=device, restore=items, lockstep=lockstep, options=opts)
    except Exception as exc:
        explained = coord.explain(exc)
        if explained is None:
            raise
        raise explained from exc  # a peer could not rejoin: say which, not only that a socket closed
    return dataclasses.replace(plan, limited_by_rank=lockstep.tightest.get(plan.batch_size))
