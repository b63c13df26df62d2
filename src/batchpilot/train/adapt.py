"""The engine's micro-batch: its first split, growth after clean steps, shrinking on pressure and OOM.

:class:`MicroBatcher` owns the micro-batch an engine runs and why: the pure
:class:`~batchpilot.policy.microbatch.MicroBatchPolicy` (the one home of the size), the
:class:`~batchpilot.policy.microbatch.PeakFit` memory model the growth consults, the initial
:class:`~batchpilot.policy.speed.SplitChoice`, and the agreement with the other ranks through
the coordinator. The engine calls it at fixed points of a step:

1. before the first step, :meth:`MicroBatcher.start` (or, sizing by length, :meth:`MicroBatcher.size_for`
   before every step);
2. after each attempt, :meth:`MicroBatcher.agree_failed` or :meth:`MicroBatcher.agree_clean`
   (this rank's outcome, one agreement with the others; the next micro-batch is decided there);
3. after an agreed OOM, :meth:`MicroBatcher.shrink_after_oom`;
4. after each step, while :attr:`MicroBatcher.checking` (a split nominated by time is being
   checked on real steps), :meth:`MicroBatcher.observe_step` with the step's timed passes;
5. when the global batch changes, :meth:`MicroBatcher.resize`.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import torch

from ..dist.coordinator import Coordinator
from ..find.result import BatchPlan
from ..memory.units import format_bytes
from ..policy.microbatch import MicroBatchPolicy, PeakFit, accum_steps
from ..policy.speed import SplitCheck, SplitChoice, TimeCurve, choose_split
from .retry import BatchDoesNotFitError

__all__ = ["MicroBatcher", "alloc_retries"]

logger = logging.getLogger(__name__)


def alloc_retries(device: torch.device) -> int | None:
    """CUDA's count of allocations that failed and succeeded after the allocator freed its cache; else ``None``."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    # cudaMalloc failed, the allocator freed its cache and retried: thrashing just below an OOM
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class MicroBatcher:
    """The micro-batch of an engine, and the decisions that move it.

    Args:
        fixed: a fixed micro-batch (nothing adapts), or ``None`` for ``"auto"``.
        device: where the steps run (CUDA's allocator retries count as pressure).
        coordinator: the agreement with the other ranks.
        capacity: the step's capacity in bytes (read only when a decision needs it).
        target: fraction of ``capacity`` a grown micro-batch's predicted peak may use.
        high_water: a peak above ``high_water × capacity`` shrinks the next micro-batch.
        adapt: grow after clean steps and shrink on pressure; ``False`` keeps only the OOM shrink.
        grow_after, backoff, max_wait: the policy's growth wait (:class:`MicroBatchPolicy`).
        split_by_time: split the first per-rank batch by the finder's timed trials
            (:func:`~batchpilot.policy.speed.choose_split`), kept only if the first real steps
            confirm it (:class:`~batchpilot.policy.speed.SplitCheck`); else into the fewest micro-batches.
        split_margin: how much faster (a fraction) a split with more micro-batches must be predicted.

    Attributes:
        policy: the growth and shrink policy (``None`` before the first micro-batch of ``"auto"``).
        fit: the memory model over micro-batches.
        split: the initial split (``None`` before the first step, and for a fixed micro-batch).
        check: the real steps' check of a split nominated by time (``None`` when there was none
            to check, and after memory moved the micro-batch during it); its ``verdict`` once decided.
        reason: why the micro-batch is what it is (empty before the first step).
    """

    def __init__(
        self, *, fixed: int | None, device: torch.device, coordinator: Coordinator, capacity: Callable[[], int],
        target: float, high_water: float, adapt: bool, grow_after: int, backoff: float, max_wait: int | None,
        split_by_time: bool, split_margin: float,
    ) -> None:
        self.fixed = fixed
        self.device = device
        self.coordinator = coordinator
        self.target = target
        self.high_water = high_water
        self.adapt = adapt
        self.grow_after = grow_after
        self.backoff = backoff
        self.max_wait = max_wait
        self.split_by_time = split_by_time
        self.split_margin = split_margin
        self.policy: MicroBatchPolicy | None = None
        self.fit = PeakFit()
        self.split: SplitChoice | None = None
        self.check: SplitCheck | None = None
        self.reason = "" if fixed is None else f"fixed: micro_batch_size={fixed}"
        self._capacity = capacity
        self._pending_reason: str | None = None  # why the policy's next size, until the ranks agree on it
        self._futile_warned = False
        self._alloc_retries = alloc_retries(device)
        self._micro_cap: tuple[int, int] | None = None  # (memory's micro-batch, what a rebase made of it)

    @property
    def micro(self) -> int | None:
        """The micro-batch of the next step: the fixed one, the policy's, or ``None`` before the first step."""
        if self.fixed is not None:
            return self.fixed
        return None if self.policy is None else self.policy.micro

    # ------------------------------------------------------------------ the first micro-batch
    def adopt_fit(self, plan: BatchPlan, in_use: int) -> None:
        """Use the finder's memory line as the prior until two sizes are measured; ``in_use``: bytes held now."""
        fit = plan.fit
        if fit is not None and fit.bytes_per_sample > 0:
            # the finder's line is absolute; the engine models the increase over what is in use
            fixed = max(0.0, float(fit.fixed_bytes) - in_use)
            self.fit.prior = (fixed, float(fit.bytes_per_sample))

    def start(self, per_rank: int, largest: int, plan: BatchPlan | None) -> None:
        """The first micro-batch of ``"auto"``: split ``per_rank`` under ``largest`` (or ``plan``'s bound); agreed."""
        self._choose_split(per_rank, largest, plan)
        policy = self.policy
        assert policy is not None
        agreed = self.coordinator.agree_micro_batch(policy.micro)
        if agreed < policy.micro:
            self.reason = f"agreed with the other ranks (a smaller rank proposed {agreed})"
        policy.adopt(agreed)
        if self.split_by_time and plan is not None:
            self._begin_check(per_rank, self.split.largest_fitting)

    def _begin_check(self, per_rank: int, largest: int) -> None:
        """Check a split nominated by time on the first real steps, if the ranks agreed on one (every rank alike)."""
        policy, split = self.policy, self.split
        assert policy is not None and split is not None
        # the fewest micro-batches every rank can run, agreed as the split was: the check, and
        # its collectives, then run on every rank or on none
        fewest = choose_split(per_rank, self.coordinator.agree_micro_batch(largest))
        if accum_steps(per_rank, policy.micro) <= fewest.accum_steps:
            return
        if policy.micro != split.micro_batch_size:  # another rank's smaller nomination
            k = accum_steps(per_rank, policy.micro)
            split = SplitChoice(total=per_rank, largest_fitting=fewest.largest_fitting, micro_batch_size=policy.micro,
                                accum_steps=k, seconds=None, fewest_seconds=None, reason=self.reason)
        self.check = SplitCheck(split=split, fewest=fewest, margin=self.split_margin)
        self.reason = self._checking_reason()

    @property
    def checking(self) -> bool:
        """True while the steps check a split nominated by time: the engine then times each step's passes."""
        return self.check is not None and self.check.verdict is None

    def _checking_reason(self) -> str:
        check = self.check
        assert check is not None and check.arm is not None
        n, total = len(check.seconds) + 1, 2 * check.pairs
        if check.arm == "split":
            return f"{check.split.reason}; checking it on real steps (step {n} of up to {total})"
        return (f"checking the timed split on real steps (step {n} of up to {total}): this step at the fewest "
                f"micro-batches, {check.fewest.accum_steps} of {check.fewest.micro_batch_size}")

    def observe_step(self, micro: int, samples: int, ooms: int, seconds: float) -> None:
        """A step ran ``samples`` in micro-batches of ``micro`` with ``ooms`` OOMs, its passes in ``seconds``: feed the check.

        The times are summed over the ranks first, so that every rank reaches the same verdict.
        An OOM (:meth:`shrink_after_oom` ends the check first), or memory pressure that moved the
        micro-batch, ends the check (memory decides from then on, the split nominated by time
        capping growth as before); a step run at
        another micro-batch (split in two for the noise scale), or on a short batch (an epoch's
        last), is not counted.
        """
        check, policy = self.check, self.policy
        if check is None or check.verdict is not None:
            return
        assert policy is not None
        if ooms or policy.micro != check.micro_batch_size:
            self.check = None
            logger.info("the check of the split by time stopped: memory moved the micro-batch to %d", policy.micro)
            return
        if micro != check.micro_batch_size or samples != check.split.total:
            return
        total = float(self.coordinator.sum_over_ranks(torch.tensor([float(seconds)], dtype=torch.float64))[0])
        verdict = check.observe(total)
        if verdict is None:
            policy.adopt(check.micro_batch_size)
            self.reason = self._checking_reason()
            return
        if verdict == "fewest":
            policy.ceiling = None  # the split is undone: growth may go where memory allows
            policy.adopt(check.fewest.micro_batch_size)
        else:
            policy.adopt(check.split.micro_batch_size)
        self.reason = check.reason
        logger.info("%s", check.reason)

    def _choose_split(self, per_rank: int, largest: int, plan: BatchPlan | None) -> None:
        """The initial micro-batch: :func:`~batchpilot.policy.speed.choose_split` under ``largest``, timed by the
        plan."""
        if plan is not None:
            # a throughput plan answers a smaller batch; the engine splits a fixed batch, so the
            # memory bound is what fits, and the split is chosen by time below. A memory plan's
            # answer is the bound (after a distributed search, the smallest rank's)
            bound = plan.largest_fitting if plan.objective == "throughput" and plan.largest_fitting else plan.batch_size
            largest = max(1, min(int(bound), per_rank))
        curve = None
        if plan is not None and self.split_by_time:
            try:
                curve = TimeCurve(plan.timed_points())
            except ValueError:  # fewer than two timed sizes: nothing to compare
                curve = None
        self.split = choose_split(per_rank, largest, step_time=curve, margin=self.split_margin,
                                  smallest=curve.smallest if curve is not None else 1)
        fewest = accum_steps(per_rank, largest)
        # a split chosen for speed caps growth there: growing back would undo it
        ceiling = self.split.micro_batch_size if self.split.accum_steps > fewest else None
        self._make_policy(per_rank, self.split.micro_batch_size, ceiling=ceiling)
        self.reason = self.split.reason

    def size_for(self, micro: int, reason: str, per_rank: int) -> int:
        """Take a micro-batch decided elsewhere (the length sizer's, for this step); returns the one adopted.

        The policy rounds it to an efficient size (:func:`~batchpilot.policy.microbatch.efficient_size`).
        """
        if self.policy is None:
            self._make_policy(per_rank, micro)
        else:
            self.policy.adopt(micro)
        self.reason = reason
        return self.policy.micro

    def _make_policy(self, limit: int, micro: int, ceiling: int | None = None) -> None:
        self.policy = MicroBatchPolicy(limit=limit, micro=micro, grow_after=self.grow_after, backoff=self.backoff,
                                       max_wait=self.max_wait, ceiling=ceiling)

    # ------------------------------------------------------------------ after an attempt
    def agree_failed(self) -> bool:
        """This rank's attempt ran out of memory: tell the others (True: some rank did, which is this one)."""
        assert self.policy is not None
        # this rank's proposal is unused when any rank ran out; send the current size
        return self.coordinator.agree(True, self.policy.micro)[0]

    def agree_clean(self, micro: int, *, peak: int, start_bytes: int, ooms: int,
                    observe: bool = True) -> tuple[bool, bool]:
        """This rank's attempt at ``micro`` succeeded; agree on the OOM and the next micro-batch: ``(any OOM, pressure)``.

        The attempt's ``peak`` (its bytes over ``start_bytes``) feeds the policy first, which
        proposes the next micro-batch. When another rank ran out of memory that decision is
        undone, so the retry shrinks from the same policy state on every rank. ``observe=False``
        leaves the policy as it is (a step sized by its own length); only the agreement runs.
        """
        policy = self.policy
        assert policy is not None
        before = policy.micro
        # the policy holds only numbers: a shallow copy is a full snapshot, and costs a microsecond
        saved = copy.copy(policy)
        pressure = self._adapt(micro, peak, start_bytes, ooms) if observe else False
        anyone, agreed = self.coordinator.agree(False, policy.micro)
        if anyone:
            self.policy = saved
            return True, False
        proposed, pending = policy.micro, self._pending_reason
        self._pending_reason = None
        policy.adopt(agreed)
        if policy.micro != before:
            if policy.micro < proposed:
                self.reason = f"agreed with the other ranks (a smaller rank proposed {policy.micro})"
            elif pending is not None:
                self.reason = pending
        return False, pressure

    def _adapt(self, micro: int, peak: int, start_bytes: int, ooms: int) -> bool:
        """Feed the attempt's outcome to the policy (its next micro-batch, not agreed yet). True on pressure."""
        policy = self.policy
        assert policy is not None
        if not self.adapt:
            if ooms == 0:
                policy.on_clean(None)
            return False
        capacity = self._capacity()
        self.fit.observe(micro, peak, start_bytes)
        retries = alloc_retries(self.device)
        thrashing = retries is not None and self._alloc_retries is not None and retries > self._alloc_retries
        self._alloc_retries = retries
        pressure = peak > self.high_water * capacity or thrashing
        # the next step begins where this attempt began (the gradients still held now are
        # freed by the optimizer step's zero_grad), so this attempt's start is the base
        max_fitting = self.fit.max_fitting(self.target * capacity, start_bytes)
        if pressure:
            self._relieve(micro, peak, capacity, thrashing, max_fitting, start_bytes)
        else:
            self._futile_warned = False
            if ooms == 0:
                before = policy.micro
                policy.on_clean(max_fitting)
                if policy.micro > before:
                    self._pending_reason = (f"grown from {before} after {self.grow_after} clean steps: "
                                            "the memory fit has room for fewer micro-batches")
                    predicted = self.fit.predict(policy.micro, start_bytes) or 0
                    logger.info("growing the micro-batch %d -> %d (predicted peak %s of %s)",
                                before, policy.micro, format_bytes(predicted), format_bytes(capacity))
        return pressure

    def _relieve(
        self, micro: int, peak: int, capacity: int, thrashing: bool, max_fitting: int | None, start: int
    ) -> None:
        """Shrink after a step above the high-water mark, unless shrinking cannot help."""
        policy = self.policy
        assert policy is not None
        # when the memory model says half the micro-batch peaks as high, shrinking only slows
        # training down: weights and optimizer state, not activations, fill the memory
        smaller = self.fit.predict(max(1, micro // 2), start)
        if smaller is not None and smaller > self.high_water * capacity and not policy.on_probation:
            if not self._futile_warned:  # once per episode, not every step
                self._futile_warned = True
                logger.warning(
                    "memory pressure at micro-batch %d (peak %s of %s) that a smaller micro-batch "
                    "would not relieve: fixed memory (weights, optimizer state) fills the device",
                    micro, format_bytes(peak), format_bytes(capacity),
                )
            return
        self._futile_warned = False
        before = policy.micro
        policy.on_pressure(max_fitting)
        if policy.micro != before:
            self._pending_reason = (f"shrunk from {before}: memory pressure ("
                                    + ("CUDA allocator retries" if thrashing else "peak over the high-water mark")
                                    + ")")
        logger.warning(
            "memory pressure at micro-batch %d (peak %s of %s%s); next micro-batch %d",
            micro, format_bytes(peak), format_bytes(capacity),
            ", allocator retries rising" if thrashing else "", policy.micro,
        )

    def shrink_after_oom(self, micro: int, message: str) -> None:
        """Every rank agreed on an OOM at ``micro``: halve (agreed), or raise at one sample.

        During the check of a split by time, the check ends and the nominated split carries on
        (or the halved size, if smaller).

        Raises:
            BatchDoesNotFitError: the OOM was at a micro-batch of 1.
        """
        policy = self.policy
        assert policy is not None
        # Halve (to an efficient size), without asking the memory model: its figures (peaks of
        # earlier steps, what the failed attempt left in use, a host's free memory) differ from run
        # to run, and near its boundary they flipped the same OOM between 32 -> 31 and 32 -> 16.
        # The model still grows the micro-batch back after clean steps, and shrinks on pressure.
        if policy.on_oom() is None:
            raise BatchDoesNotFitError(
                f"out of memory at a micro-batch of 1 sample on {self.device} (capacity "
                f"{format_bytes(self._capacity())}; {message}): the model, its gradients and optimizer "
                "state do not fit; use a smaller model, mixed precision (amp='bf16'), or a larger device"
            )
        reason = f"shrunk after an out-of-memory error at micro-batch {micro}"
        if self.checking:
            # the check's step at the fewest micro-batches ran out: the nominated split, which ran,
            # carries on (every rank agreed on the OOM, so every rank ends its check here)
            assert self.check is not None
            policy.adopt(min(policy.micro, self.check.split.micro_batch_size))
            self.check = None
            reason += ": the split by time carries on, unchecked"
        policy.adopt(self.coordinator.agree_micro_batch(policy.micro))
        self.reason = reason
        logger.warning(
            "out of memory at micro-batch %d; retrying the same %d samples at micro-batch %d",
            micro, policy.limit, policy.micro,
        )

    # ------------------------------------------------------------------ the global batch moved
    def resize(self, per_rank: int) -> None:
        """The per-rank batch is now ``per_rank``: the micro-batch stays what memory allowed, balanced anew."""
        policy = self.policy
        if policy is None or self.fixed is not None:
            return
        if self.checking:
            # the check compares splits of the old batch: the nominated split carries on, unchecked
            assert self.check is not None
            policy.adopt(self.check.split.micro_batch_size)
            self.check = None
        cap, made = self._micro_cap if self._micro_cap is not None else (policy.micro, policy.micro)
        if policy.micro != made:  # memory moved the micro-batch since the last rebase: it is the cap now
            cap = policy.micro
        policy.rebase(per_rank, cap)
        self._micro_cap = (cap, policy.micro)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``policy`` (its state, the micro-batch included; ``None`` before the first step and when fixed),
        ``fit`` (the memory model) and ``micro_cap`` (the micro-batch memory allowed at the last resize)."""
        return {
            "policy": None if self.policy is None else self.policy.state_dict(),
            "fit": self.fit.state_dict(),
            "micro_cap": None if self._micro_cap is None else list(self._micro_cap),
        }

    def load_state_dict(self, state: dict[str, Any], *, per_rank: int, same_world: bool) -> None:
        """Continue from :meth:`state_dict`'s keys in ``state``, for a per-rank batch of ``per_rank``.

        The saved micro-batch is clamped to ``per_rank``; a fixed micro-batch keeps its own. A
        state without a policy but with a top-level ``micro_batch_size`` (the engine's states of
        versions 1 and 2, a fixed engine's among them) starts the policy there with fresh counters.
        ``same_world``: saved on as many ranks, so the resize cap holds.
        """
        self.fit.load_state_dict(state["fit"])
        if self.fixed is not None:
            return
        policy = state.get("policy")
        saved = policy["micro"] if policy is not None else state.get("micro_batch_size")
        if saved is None:
            return
        self._make_policy(per_rank, min(int(saved), per_rank))
        self.check = None
        if policy is not None:
            self.policy.load_state_dict(policy)
        self.reason = f"resumed from a checkpoint at micro-batch {self.policy.micro}"
        cap = state.get("micro_cap")
        if cap is not None and same_world:
            self._micro_cap = (int(cap[0]), int(cap[1]))
