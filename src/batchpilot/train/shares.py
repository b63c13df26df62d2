"""Uneven shares of one global batch across data-parallel ranks, as a part of the engine.

``Engine(..., global_batch_size=G, shares=[3, 1])`` (or ``shares="auto"``) gives each rank its own
share of the global batch instead of ``G // world``. :class:`RankShares` owns what that needs:

* the shares (the same tuple on every rank) and this rank's;
* one small all-reduce per attempt (:meth:`RankShares.exchange`) that tells every rank how
  many samples each rank brought, how many micro-batches each needs (FSDP runs the largest
  count on every rank, since its forward and backward run collectives), each rank's time on its
  share in the last step and its micro-batch;
* the weights that make the update the one of a single process on the whole global batch: a
  mean loss's micro-batch of ``size`` samples is weighted ``size × world / total`` (DDP and FSDP
  then divide the summed gradients by ``world``), a ``(sum, count)`` loss is divided by a
  rank-independent constant and normalised by the global count after the sync, as with equal
  shares;
* with ``"auto"``, :class:`~batchpilot.policy.shares.ShareBalancer` on the times every rank has
  seen: the same decision on every rank, adopted after the step in which it was made.

Details and measurements: ``docs/uneven.md``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from ..policy.microbatch import accum_steps, balanced_sizes
from ..policy.shares import ShareBalancer, check_shares, equal_shares, split_shares
from .retry import BatchDoesNotFitError

__all__ = ["RankShares", "SharesSpec"]

logger = logging.getLogger(__name__)

#: ``"auto"``, or one share (or weight) per rank
SharesSpec = Any

_SLOTS = 4  # samples, micro-batches, seconds, micro-batch: one slot per rank each


class RankShares:
    """This rank's share of the global batch, and the agreement that keeps uneven shares exact and in step.

    Args:
        spec: ``"auto"`` or one positive int per rank (shares summing to ``global_batch_size``,
            or weights scaled to it).
        global_batch_size: samples per optimizer step over all ranks.
        world: data-parallel ranks.
        rank: this rank.
        coordinator: the engine's coordinator (its ``sum_over_ranks`` carries the exchange).
        lockstep: every rank must run the same number of micro-batches (FSDP).
        balancer: the ``"auto"`` balancer (default :class:`~batchpilot.policy.shares.ShareBalancer()`).

    Attributes:
        shares: the shares of the next step, one per rank.
        auto: the shares follow the measured speeds.
        total: samples of the current step over all ranks (after :meth:`exchange`).
        counts: samples each rank brought to the current step.
        accum: micro-batches every rank runs in the current attempt (``lockstep``), else ``None``.
        rebalances: times the shares moved.
        reason: why the shares are what they are.

    Raises:
        ValueError: ``spec`` is neither ``"auto"`` nor one positive int per rank, or the global
            batch is smaller than the number of ranks.
    """

    def __init__(self, spec: SharesSpec, *, global_batch_size: int, world: int, rank: int, coordinator: Any,
                 lockstep: bool = False, balancer: ShareBalancer | None = None) -> None:
        if global_batch_size < world:
            raise ValueError(f"global_batch_size={global_batch_size} cannot give each of {world} ranks a sample; "
                             f"use at least {world}")
        self.world, self.rank = int(world), int(rank)
        self.global_batch_size = int(global_batch_size)
        self.coordinator = coordinator
        self.lockstep = bool(lockstep)
        if isinstance(spec, str):
            if spec != "auto":
                raise ValueError(f'shares must be "auto" or one positive int per rank, got {spec!r}')
            self.auto = True
            self.shares = equal_shares(global_batch_size, world)
            self.reason = "equal until the ranks' speeds are measured"
        else:
            self.auto = False
            self.shares = check_shares(spec, global_batch_size, world)
            self.reason = f"given: shares={list(spec)}"
        self.balancer = (balancer if balancer is not None else ShareBalancer()) if self.auto else None
        self.total = global_batch_size
        self.counts: tuple[int, ...] = self.shares
        self.accum: int | None = None
        self.rebalances = 0
        self._seconds = 0.0  # this rank's time on its share in the last step (0: not measured)
        self._last_counts: tuple[int, ...] | None = None
        self._pending: tuple[int, ...] | None = None
        self._pending_reason = ""

    @property
    def own(self) -> int:
        """This rank's share: the samples :meth:`Engine.step` takes here."""
        return self.shares[self.rank]

    @property
    def norm(self) -> float:
        """The rank-independent constant a ``(sum, count)`` loss is divided by before the sync."""
        return self.global_batch_size / self.world

    # ------------------------------------------------------------------ per attempt
    def exchange(self, samples: int, micro: int, *, first: bool) -> None:
        """Agree (one all-reduce) on every rank's samples and micro-batch count; feed the balancer.

        ``first``: the step's first attempt, which carries the time of the last step. Every
        rank calls it before each attempt, outside any ``except`` block.
        """
        world, r = self.world, self.rank
        k = accum_steps(samples, micro)
        values = torch.zeros(_SLOTS * world, dtype=torch.float64)
        values[r] = samples
        values[world + r] = k
        values[2 * world + r] = self._seconds if first else 0.0
        values[3 * world + r] = micro
        summed = self.coordinator.sum_over_ranks(values).tolist()
        counts = tuple(int(round(v)) for v in summed[:world])
        self.counts, self.total = counts, sum(counts)
        self.accum = max(int(round(v)) for v in summed[world:2 * world]) if self.lockstep else None
        seconds = summed[2 * world:3 * world]
        if first and self.balancer is not None and self._last_counts is not None and self._pending is None:
            decision = self.balancer.observe(self.shares, self._last_counts, seconds)
            if decision.changed:
                self._pending, self._pending_reason = decision.shares, decision.reason
            elif decision.rates:
                logger.info("%s", decision.reason)
        if first:
            self._seconds = 0.0

    def cut(self, samples: int, micro: int) -> list[int]:
        """This rank's micro-batch sizes: balanced under ``micro``; under ``lockstep``, the agreed count.

        A rank with fewer samples than the agreed count runs the extra micro-batches at zero
        weight (size 0: one sample whose loss is multiplied by 0), so that its collectives pair up.
        """
        if not self.lockstep or self.accum is None:
            return balanced_sizes(samples, accum_steps(samples, micro))
        k = self.accum
        real = min(k, samples)
        return balanced_sizes(samples, real) + [0] * (k - real)

    def mean_weight(self, size: int) -> float:
        """The weight of a mean loss over ``size`` samples: ``size × world / total`` (DDP and FSDP divide by world)."""
        return size * self.world / self.total

    # ------------------------------------------------------------------ per step
    def record(self, seconds: float, samples: int) -> None:
        """This rank spent ``seconds`` on its ``samples`` (the step's successful attempt, no waiting)."""
        self._seconds = float(seconds)
        self._last_counts = self.counts

    def on_oom(self, *, hopeless: bool, message: str) -> None:
        """An OOM was agreed: a rank's micro-batch moves, so the speeds are measured anew.

        ``hopeless``: this rank ran out at a micro-batch of one sample. The ranks agree on it
        (one all-reduce, only after an OOM), so that every rank raises together rather than the
        others waiting in the next step's collective for a rank that has left.

        Raises:
            BatchDoesNotFitError: on the other ranks, when a rank cannot fit one sample (that
                rank raises its own from the micro-batch's shrink).
        """
        flags = torch.zeros(self.world, dtype=torch.float64)
        flags[self.rank] = 1.0 if hopeless else 0.0
        stuck = [r for r, v in enumerate(self.coordinator.sum_over_ranks(flags).tolist()) if v > 0]
        if stuck and not hopeless:
            raise BatchDoesNotFitError(
                f"rank {stuck[0]} ran out of memory at a micro-batch of 1 sample ({message}); every rank stops: "
                "give that rank a smaller model or more memory (amp='bf16'), or leave it out of the job"
            )
        self._seconds = 0.0
        self._last_counts = None
        if self.balancer is not None:
            self.balancer.reset()

    def commit(self) -> bool:
        """After a step: adopt shares decided during it; True when they changed."""
        if self._pending is None:
            return False
        old, self.shares = self.shares, self._pending
        self.reason = self._pending_reason
        self._pending = None
        self._last_counts = None
        self.rebalances += 1
        logger.info("%s", self.reason)
        return old != self.shares

    def set_shares(self, shares: Sequence[int], reason: str = "") -> None:
        """Use ``shares`` from the next step on (call it on every rank alike).

        Raises:
            ValueError: as the constructor's ``spec``.
        """
        self.shares = check_shares(shares, self.global_batch_size, self.world)
        self.reason = reason or f"set: shares={list(shares)}"
        self._pending = None
        self._last_counts = None
        if self.balancer is not None:
            self.balancer.reset()

    def resize(self, global_batch_size: int) -> None:
        """A new global batch: the shares keep their proportions."""
        self.global_batch_size = int(global_batch_size)
        self.shares = tuple(split_shares(global_batch_size, [float(s) for s in self.shares]))
        self.total = global_batch_size
        if self.balancer is not None:
            self.balancer.reset()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``shares``, ``auto``, ``world_size`` and ``global_batch_size`` (plain ints and a bool)."""
        return {"shares": list(self.shares), "auto": self.auto, "world_size": self.world,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved shares when they were ``"auto"`` on as many ranks for the same global batch.

        Given shares stay the constructor's; a different world or global batch starts from the
        constructor's split (``"auto"``: measured anew).
        """
        if not self.auto or state.get("world_size") != self.world or state.get("global_batch_size") != self.global_batch_size:
            return
        self.shares = check_shares(list(state["shares"]), self.global_batch_size, self.world)
        self.reason = f"resumed from a checkpoint at shares {list(self.shares)}"
