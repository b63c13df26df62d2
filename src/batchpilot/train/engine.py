"""A training step that holds the global batch fixed and picks the micro-batch by itself.

``Engine.step(batch)`` splits this rank's share of one global batch into micro-batches that fit,
accumulates their gradients and steps the optimizer once. On an OOM it drops the partial
gradients, shrinks and reruns the same batch: no sample lost, the same update. It grows back
after clean steps with room to spare. How and why, in detail: ``docs/internals.md#engine``.

:class:`Engine` composes parts that each own their state and are called through what they
declare: the micro-batch and its policy (:class:`~batchpilot.train.adapt.MicroBatcher`), what a
retry puts back (:class:`~batchpilot.train.retry.RetryState`), the sizing by length
(:class:`~batchpilot.train.lengths.LengthSizer`), the gradient noise scale
(:class:`~batchpilot.train.noise.NoiseMeter`) and the agreement with other ranks
(:class:`~batchpilot.dist.coordinator.Coordinator`).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import torch
from torch import nn

from .._checks import positive_int as _positive_int
from ..core.amp import amp_dtype as _amp_dtype, autocast
from ..core.batch import BatchLayout, BatchSplitter, SplitFn
from ..core.compiled import CompileCounter, is_compiled, mark_batch_dynamic, no_single_tail
from ..core.loss import as_loss_fn, parse_loss
from ..core.model import model_device
from ..core.ranks import group_size
from ..core.sharding import is_fsdp
from ..dist.coordinator import Coordinator, LocalCoordinator, check_coordinator
from ..dist.shares import OwnSizes
from ..find.finder import find_batch_size
from ..find.options import FindOptions
from ..find.result import BatchPlan
from ..find.timing import step_clock
from ..memory.gauge import Gauge, gauge_for
from ..memory.host import trim_host_memory
from ..memory.probes import emulated_capacity
from ..memory.tracker import active_tracker
from ..memory.units import resolve_device
from ..policy.microbatch import MicroBatchPolicy, PeakFit, accum_steps, balanced_sizes
from ..policy.schedule import BatchSchedule
from ..policy.search import BatchSizeError, check_target
from ..policy.speed import SPEED_TOLERANCE, SplitChoice, check_speed_tolerance
from .adapt import MicroBatcher
from .batching import BatchConfig, rescale_lr, rescale_weight_decay, split_sizes
from .lengths import LengthConfig, LengthSizer, make_sizer
from .noise import NoiseConfig, NoiseMeter, NoiseSample, make_meter
from .retry import BatchDoesNotFitError, RetryState, fixed_oom_error
from .schedule import GlobalBatch
from .shares import RankShares, SharesSpec

__all__ = [
    "BatchDoesNotFitError",
    "Coordinator",
    "Engine",
    "EngineConfig",
    "LocalCoordinator",
    "StepResult",
]

logger = logging.getLogger(__name__)

# 4: each part's state under a key of its own ("global_batch", "micro_batch"); 1-3 were one flat dict.
# 3: the micro-batch is saved once, in "policy"; 2 and 1 also held it as "micro_batch_size".
# 2: global_batch_size is the global batch over all ranks and world_size is stored; in 1 it
# was the per-rank batch (which is all that loading uses of it).
_STATE_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)
#: the keys of versions 1-3 that are each part's state in version 4
_FLAT_KEYS = {
    "global_batch": ("global_batch_size", "world_size", "samples", "reference_batch_size", "last_batch_change",
                     "schedule"),
    "micro_batch": ("policy", "fit", "micro_cap", "micro_batch_size"),
}


@dataclass(kw_only=True)
class EngineConfig:
    """The engine's adaptive knobs.

    Attributes:
        grow_after: clean steps before the micro-batch may grow (doubles after a failed growth).
        backoff: factor by which ``grow_after``'s wait grows after a growth that ran out of memory.
        max_wait: cap on that wait, in steps; ``None`` for no cap.
        high_water: a step whose peak exceeds ``high_water × capacity`` shrinks the next one.
        adapt: grow after clean steps and shrink on pressure; ``False`` keeps only the OOM retry.
        capacity: bytes (or ``"24GiB"``) to plan against instead of the device's capacity.
        restore_buffers: on retry, put BatchNorm running statistics back as they were before the
            failed attempt (cost: one in-place copy of those buffers per step).
        restore_rng: on retry, restore the CPU (and device) RNG state, so dropout masks repeat.
        find: the finder's options (:class:`~batchpilot.find.options.FindOptions`) for the search
            when ``micro_batch_size="auto"`` and no ``start`` is given. Its ``capacity`` is
            ``capacity``'s when that is given (``find.capacity`` alone sizes the search only), its
            ``target`` the engine's ``target=`` (a different value in both raises); with
            ``split="time"`` its ``timed_steps=None`` is 3: the split is decided on those times.
        split: how ``micro_batch_size="auto"`` splits the per-rank batch under the largest
            micro-batch that fits: ``"time"``: the fewest micro-batches, balanced, unless the
            finder's timed trials predict more, smaller ones faster by ``split_margin``
            (:func:`batchpilot.policy.speed.choose_split`) and the first real steps, in pairs
            with the fewest, confirm it (:class:`batchpilot.policy.speed.SplitCheck`; else back
            to the fewest for good); ``"fewest"``: never by time.
        split_margin: how much faster (a fraction) a split with more micro-batches must be predicted,
            and measured on the real steps (their median ratio).

    Raises:
        ValueError: a value out of range; ``capacity`` unreadable or disagreeing with ``find.capacity``
            (:class:`~batchpilot.policy.search.BatchSizeError`, as ``FindOptions`` raises).
        TypeError: ``find`` is not a :class:`~batchpilot.find.options.FindOptions`.
    """

    grow_after: int = 50
    backoff: float = 2.0
    max_wait: int | None = None
    high_water: float = 0.95
    adapt: bool = True
    capacity: int | str | None = None
    restore_buffers: bool = True
    restore_rng: bool = True
    find: FindOptions = field(default_factory=FindOptions)
    split: Literal["time", "fewest"] = "time"
    split_margin: float = SPEED_TOLERANCE

    def __post_init__(self) -> None:
        _positive_int("grow_after", self.grow_after)
        if self.max_wait is not None:
            _positive_int("max_wait", self.max_wait)
        if not (isinstance(self.backoff, numbers.Real) and self.backoff >= 1):
            raise ValueError(f"backoff must be a number >= 1, got {self.backoff!r}")
        if not (isinstance(self.high_water, numbers.Real) and 0 < self.high_water <= 1):
            raise ValueError(f"high_water must be a fraction of capacity in (0, 1], got {self.high_water!r}")
        if not isinstance(self.find, FindOptions):
            raise TypeError(f"find must be a batchpilot.FindOptions, got {type(self.find).__name__}: "
                            "EngineConfig(find=FindOptions(max_trials=9))")
        if self.capacity is not None:
            # a door to the finder's options: FindOptions reads the size, and the search gets it too
            capacity = FindOptions.build(capacity=self.capacity).capacity
            if self.find.capacity is not None and self.find.capacity != capacity:
                raise BatchSizeError(
                    f"capacity={capacity} and find.capacity={self.find.capacity} disagree: give the capacity "
                    "once (capacity sizes the engine and its search; find.capacity alone, the search only)"
                )
            self.capacity = capacity
            self.find = FindOptions.build(self.find, capacity=capacity)
        if self.split not in ("time", "fewest"):
            raise ValueError(f"split must be 'time' or 'fewest', got {self.split!r}")
        self.split_margin = check_speed_tolerance(self.split_margin)


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What one :meth:`Engine.step` did.

    Attributes:
        loss_tensor: the loss over the whole batch (0-dim, detached, on the device), in the
            loss's dtype or float32 if that is narrower (a float64 model's loss stays float64);
            for ``(sum, count)`` losses this rank's sum over this rank's count.
        micro_batch_size: the micro-batch of the attempt that succeeded.
        accum_steps: micro-batches in that attempt on this rank (the last may be smaller).
        samples: samples in this rank's batch (dim 0); the global batch is ``world`` times that.
        ooms: OOMs retried within this step (on any rank).
        peak_bytes: peak memory of the step on this rank: the successful attempt, the gradient
            sync and the optimizer step, in the figure ``memory`` names.
        measured: ``peak_bytes`` is the figure the engine decides on (always: every device's
            figure is measured).
        memory: that figure's name, the kind of limit the step ran under
            (:attr:`batchpilot.memory.limits.Limit.name`: ``"tensors"`` inside a storage
            tracker or emulated capacity, ``"resident"`` on a CPU's real memory ...).
        seconds: wall time of the step (host time; the device may still be running).
        skipped: the optimizer step was skipped (see ``skip_reason``); the scheduler did not step.
        skip_reason: ``None``; ``"inf"``: fp16's ``GradScaler`` found inf/NaN gradients;
            ``"empty"``: a ``(sum, count)`` loss counted 0 elements over the whole global batch
            (all padding), so there was nothing to average (``loss`` is then nan).
        pressure: the peak the next micro-batch was decided on (see the module docstring) was
            above the high-water mark, or the CUDA allocator retried.
        next_micro_batch_size: the micro-batch the next step starts with.
        grad_norm: total gradient norm before clipping, when ``grad_clip`` is set.
        compilations: graphs dynamo compiled during the step (0 once a compiled model is warm:
            its batch dimension is dynamic, see :mod:`batchpilot.core.compiled`).
        micro_batch_reason: why the step ran at ``micro_batch_size`` (the initial split, an
            OOM, memory pressure, a growth, another rank).
        global_batch_size: the global batch of this step (over all ranks).
        next_global_batch_size: the global batch of the next step (a schedule may change it).
        noise: the gradient noise measurement of this step (:class:`batchpilot.train.noise.NoiseSample`),
            or ``None`` when nothing was measured (noise off, one micro-batch on one rank, a
            skipped step).
        length: with ``lengths=``, the batch's padded sequence length; else ``None``.
        micro_batch_sizes: the samples in each micro-batch of the attempt that succeeded.
        micro_batch_lengths: with ``lengths=``, each micro-batch's padded length (its own longest
            sample under length-aware splitting, else the batch's); else empty.
    """

    loss_tensor: torch.Tensor
    micro_batch_size: int
    accum_steps: int
    samples: int
    ooms: int
    peak_bytes: int
    measured: bool
    memory: str = "tensors"
    seconds: float
    skipped: bool = False
    skip_reason: str | None = None
    pressure: bool = False
    next_micro_batch_size: int = 0
    grad_norm: torch.Tensor | None = None
    compilations: int = 0
    micro_batch_reason: str = ""
    global_batch_size: int = 0
    next_global_batch_size: int = 0
    noise: NoiseSample | None = None
    length: int | None = None
    micro_batch_sizes: tuple[int, ...] = ()
    micro_batch_lengths: tuple[int, ...] = ()

    @property
    def loss(self) -> float:
        """The loss as a float; on an accelerator this waits for the step (a sync point)."""
        return float(self.loss_tensor)

    @property
    def noise_scale(self) -> float | None:
        """``B_simple`` in samples (the EMA after this step), or ``None``; a sync point on an accelerator."""
        return None if self.noise is None else self.noise.noise_scale


@dataclass
class _Accumulated:
    loss: torch.Tensor
    count: Any
    mode: str
    sizes: list[int]


@dataclass
class _Ran:
    """A step's passes that ran on every rank: their sums, the micro-batch and why, the OOMs before them."""

    acc: _Accumulated
    micro: int
    reason: str
    ooms: int
    pressure: bool
    #: seconds of the passes, when a split nominated by time is being checked on real steps; else None
    passes: float | None
    #: with uneven shares, the wall time of the passes that ran (what a rank's speed is measured by); else None
    share_seconds: float | None


class Engine:
    """Train on a fixed global batch with a micro-batch that adapts to the memory.

    Args:
        model: the module (optionally wrapped in ``DistributedDataParallel``).
        optimizer: its optimizer; the engine calls ``step`` once per global batch.
        loss_fn: ``loss_fn(model, micro_batch)`` returning the micro-batch's mean loss (0-dim
            tensor) or ``(sum, count)``; or a torch criterion (``nn.CrossEntropyLoss()``), which
            is applied as ``criterion(model(inputs), targets)`` to ``(inputs, targets)`` batches.
        global_batch_size: samples per optimizer step summed over all ranks (the true global
            batch). Each rank's :meth:`step` takes ``global_batch_size // world`` of them,
            ``world`` being ``coordinator.world_size``; in a world of one, all of them.
        micro_batch_size: ``"auto"`` (adapt; start from ``start``, else from the finder) or a
            fixed int (no adaptation; an OOM raises after the partial gradients are dropped);
            at most the per-rank batch.
        start: first micro-batch for ``"auto"``: an int, or the :class:`~batchpilot.find.result.BatchPlan`
            of a search already run (its batch size and memory fit are used, no trial runs); ``None`` runs
            :func:`~batchpilot.find.finder.find_batch_size` on the first batch (with several ranks
            :func:`~batchpilot.dist.distributed.find_batch_size_distributed`, on the module inside a
            DDP wrapper).
        device: where micro-batches go and memory is measured; default: the model's.
        amp: ``None``, ``"bf16"`` (autocast) or ``"fp16"`` (autocast and ``GradScaler``).
        grad_clip: clip the total gradient norm to this (unscaled first under fp16).
        target: fraction of capacity a grown micro-batch's predicted peak may use, and the finder's
            ``target``; ``None``: ``config.find.target`` (default 0.8). Give it once: a
            ``config.find.target`` other than its default that differs raises.
        scheduler: an LR scheduler whose ``step()`` takes no argument, stepped once per
            optimizer step (not on skipped fp16 steps). Checkpoint it yourself.
        coordinator: agreement with other ranks, and the world size; default
            :class:`~batchpilot.dist.distributed.DistributedCoordinator` when a process group of
            several ranks is initialised (``torchrun``), else :class:`LocalCoordinator`.
        shared: dict keys of the batch that are the same for every sample (see
            :mod:`batchpilot.core.batch`); they go whole to every micro-batch.
        split_fn: ``split_fn(batch, start, stop)`` cutting a batch into micro-batches your way.
        config: adaptive knobs, see :class:`EngineConfig`.
        noise: measure the gradient noise scale (:mod:`batchpilot.train.noise`): ``None``
            (default) only under a schedule that follows it; ``True`` (``NoiseConfig()``: mode
            ``every`` under such a schedule, else ``first``), a
            :class:`~batchpilot.train.noise.NoiseConfig`, or ``False``. Off by default: it costs
            one or two gradient norms per step (``benchmarks/overhead.py``).
        schedule: a global-batch schedule (:mod:`batchpilot.policy.schedule`), or its spec for
            :func:`~batchpilot.policy.schedule.parse_schedule` (``"adaptive"``); ``global_batch_size`` is
            then the batch the optimizer's LR is set for, and the engine moves to the
            schedule's batch from the first step, rescaling the LR (and the scheduler's base LRs)
            by the schedule's rule at every change. Give each step :attr:`per_rank_batch_size`
            samples: ``loader.set_batch_size(engine.per_rank_batch_size)`` after each step.
        lengths: size each step by its padded sequence length
            (:class:`~batchpilot.train.lengths.LengthConfig`; ``True`` for its defaults): the
            micro-batch comes from the memory model over (batch, length) before the step runs,
            and a length beyond the longest verified one is verified by a real search first.
            On by default when ``start`` is a :class:`~batchpilot.find.lengths.LengthPlan`.
        shares: uneven shares of the global batch over the ranks (:mod:`batchpilot.train.shares`):
            ``None`` (``global_batch_size // world`` each), one int per rank (``[48, 16]``, or
            weights such as ``[3, 1]`` scaled to the global batch), or ``"auto"``: equal at first,
            then in proportion to each rank's measured samples/s at its own micro-batch, moved in
            lockstep on every rank. Each rank keeps the micro-batch its own memory allows (an OOM
            shrinks only the rank that ran out; every rank retries), the update is the one of a
            single process on the whole global batch (mean and ``(sum, count)`` losses), and every
            rank runs one gradient sync per step. Feed each rank its share:
            ``loader.set_shares(engine.shares)`` after each step. Not with ``schedule``, ``noise``
            or ``lengths``. Details: ``docs/uneven.md``.

    Attributes:
        global_batch_size: samples per optimizer step over all ranks (read-only; a schedule or
            :meth:`set_global_batch_size` changes it between steps).
        world_size: data-parallel ranks, from the coordinator (read-only).
        per_rank_batch_size: ``global_batch_size // world_size``, what :meth:`step` takes (with
            ``shares=``, this rank's share).
        shares: each rank's samples of the next step (:attr:`per_rank_batch_size` on every rank
            without ``shares=``).
        rank_shares: the uneven shares' part (:class:`~batchpilot.train.shares.RankShares`), or ``None``.
        micro_batch_size: the micro-batch of the next step (``None`` before the first one).
        micro_batch_reason: why it is that size (empty before the first step).
        split: the initial split of the per-rank batch (:class:`~batchpilot.policy.speed.SplitChoice`),
            ``None`` before the first step and for a fixed micro-batch.
        batcher: the part that owns the micro-batch (:class:`~batchpilot.train.adapt.MicroBatcher`);
            ``micro_batch_size``, ``micro_batch_reason``, ``policy``, ``fit`` and ``split`` are its.
        retry: what a retry after an OOM puts back (:class:`~batchpilot.train.retry.RetryState`).

    Raises:
        ValueError: a batch size that is not a positive int, a global batch that does not
            divide by the world size (the message suggests the nearest that do), a fixed
            micro-batch larger than the per-rank batch, ``target`` outside (0, 1] or not below
            ``config.high_water`` (a :class:`~batchpilot.policy.search.BatchSizeError`), an unknown ``amp``, a ``start`` with a fixed micro-batch, a
            schedule that follows the noise scale with ``noise=False``, ``lengths`` with a fixed
            micro-batch, or an int ``start``.
        TypeError: ``loss_fn`` is not callable, ``noise`` or ``schedule`` of the wrong type, a
            ``coordinator`` that lacks a member of the :class:`~batchpilot.dist.coordinator.Coordinator`
            protocol.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Any,
        *,
        global_batch_size: int,
        micro_batch_size: int | Literal["auto"] = "auto",
        start: int | BatchPlan | None = None,
        device: torch.device | str | None = None,
        amp: str | torch.dtype | None = None,
        grad_clip: float | None = None,
        target: float | None = None,
        scheduler: Any = None,
        coordinator: Coordinator | None = None,
        config: EngineConfig | None = None,
        shared: str | Iterable[str] | None = None,
        split_fn: SplitFn | None = None,
        noise: bool | NoiseConfig | None = None,
        schedule: BatchSchedule | str | None = None,
        lengths: LengthConfig | bool | None = None,
        shares: SharesSpec | None = None,
    ) -> None:
        _positive_int("global_batch_size", global_batch_size)
        self._fsdp = is_fsdp(model)
        self.coordinator: Coordinator = coordinator if coordinator is not None else _default_coordinator(self._fsdp)
        check_coordinator(self.coordinator)
        self.layout = BatchLayout.of(shared, split_fn)
        # read once: a distributed coordinator asks the process group, and the world is fixed for a run
        self._world = _positive_int("coordinator.world_size", self.coordinator.world_size)
        #: uneven shares of the global batch (batchpilot.train.shares), or None: G // world on every rank
        self.rank_shares: RankShares | None = None if shares is None else self._rank_shares(
            shares, global_batch_size, schedule=schedule, noise=noise, lengths=lengths)
        #: the global batch, the batch the LR is set for, and the schedule that moves it (batchpilot.train.schedule)
        self.global_batch = GlobalBatch(global_batch_size, world_size=self._world, schedule=schedule,
                                        uneven=shares is not None)
        schedule = self.global_batch.schedule
        self.config = config if config is not None else EngineConfig()
        #: the finder's plan the first micro-batch came from (given as ``start`` or found on step 1)
        self.plan: BatchPlan | None = None
        start = self._micro_batch_mode(micro_batch_size, start)
        target = self._finder_target(target)
        if grad_clip is not None and not (isinstance(grad_clip, numbers.Real) and grad_clip > 0):
            raise ValueError(f"grad_clip must be a positive max norm, got {grad_clip!r}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = as_loss_fn(loss_fn)
        self.target = float(target)
        self.grad_clip = grad_clip
        self.scheduler = scheduler
        self.device = resolve_device(device if device is not None else model_device(model))
        self.amp_dtype = _amp_dtype(amp)
        if self._fsdp:
            self._bind_fsdp(model)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.amp_dtype is torch.float16 else None
        self._init_parts(model, optimizer, micro_batch_size, start, noise, schedule, lengths)
        self._warn_ddp_world()

    def _rank_shares(self, shares: SharesSpec, global_batch_size: int, *, schedule: Any, noise: Any,
                     lengths: Any) -> RankShares:
        """The uneven shares' part, once the features that cannot go with it are refused."""
        _refuse_with_shares(schedule=schedule, noise=noise, lengths=lengths)
        return RankShares(shares, global_batch_size=global_batch_size, world=self._world,
                          rank=self.coordinator.rank, coordinator=self.coordinator,
                          lockstep=self.coordinator.lockstep)

    def _micro_batch_mode(self, micro_batch_size: int | Literal["auto"], start: int | BatchPlan | None) -> int | None:
        """Set :attr:`fixed` (and :attr:`plan` from a plan given as ``start``); the checked first micro-batch."""
        if micro_batch_size == "auto":
            self.fixed = False
            if isinstance(start, BatchPlan):
                self.plan = start
                start = max(1, min(int(start.batch_size), self._per_rank))
            elif start is not None:
                _positive_int("start", start)
                if start > self._per_rank:
                    raise ValueError(
                        f"start={start} is larger than {self._share()}; the micro-batch can be at "
                        "most the batch one rank trains on"
                    )
        else:
            _positive_int("micro_batch_size", micro_batch_size, extra=' or "auto"')
            if micro_batch_size > self._per_rank:
                raise ValueError(
                    f"micro_batch_size={micro_batch_size} is larger than {self._share()}; use at "
                    f"most {self._per_rank}, or raise the global batch"
                )
            if start is not None:
                raise ValueError('start only applies to micro_batch_size="auto"')
            self.fixed = True
        return start

    def _finder_target(self, target: float | None) -> float:
        """``Engine(target=)`` or ``config.find``'s target, checked by ``FindOptions``, below the high-water mark."""
        find = self.config.find
        if target is not None and "target" in find.changed() and find.target != target:
            raise BatchSizeError(
                f"target={target} and config.find.target={find.target} disagree: give the target once "
                "(Engine(target=) is the finder's target too)"
            )
        # Engine(target=) is a door to the finder's options: FindOptions checks it, and the engine
        # adds its own bound, the high-water mark (a grown micro-batch aimed above it is pressure)
        find = find if target is None else FindOptions.build(find, target=target)
        target = check_target(find.target, below=self.config.high_water, bound="config.high_water",
                              reason="or every grown micro-batch would count as memory pressure")
        return target

    def _init_parts(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batch_size: int | Literal["auto"],
                    start: int | None, noise: bool | NoiseConfig | None, schedule: BatchSchedule | None,
                    lengths: LengthConfig | bool | None) -> None:
        """The engine's parts and per-step state: micro-batcher, gauges, retry state, noise meter, length sizer."""
        self.steps = 0
        cfg = self.config
        #: the micro-batch, its policy, memory fit and reasons (batchpilot.train.adapt)
        # with uneven shares each rank keeps the micro-batch its own memory allows (OOMs still agreed)
        sizes_by = self._sizes_by = self.coordinator if self.rank_shares is None else OwnSizes(self.coordinator)
        self.batcher = MicroBatcher(
            fixed=int(micro_batch_size) if self.fixed else None, device=self.device, coordinator=sizes_by,
            capacity=self._capacity, target=self.target, high_water=cfg.high_water, adapt=cfg.adapt,
            grow_after=cfg.grow_after, backoff=cfg.backoff, max_wait=cfg.max_wait,
            # the check of a split by time sums times over ranks when a rank checks; with uneven
            # shares ranks differ in what they would check, so none does
            split_by_time=cfg.split == "time" and self.rank_shares is None,
            split_margin=cfg.split_margin,
        )
        self._start = start
        self._gauges: dict[tuple, Gauge] = {}
        self._probe: Gauge = self._step_gauge()
        self._step_capacity: int | None = None
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        # compiled: micro-batches are marked dynamic and never end in one sample (batchpilot.core.compiled)
        self._compiled = is_compiled(model)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        #: what a retry puts back: running statistics and RNG (batchpilot.train.retry)
        self.retry = RetryState(model, self.device, buffers=cfg.restore_buffers, rng=cfg.restore_rng)
        self._last_scale: float | None = None
        # peak of the last gradient sync + optimizer step; it does not depend on the micro-batch
        self._apply_peak = 0
        # statistical efficiency: the noise scale (batchpilot.train.noise), which a schedule may follow
        self.noise_meter: NoiseMeter | None = make_meter(
            noise, world=self._world, deferred=self.coordinator.defer_grad_sync,
            follower=None if schedule is None or not schedule.reads_noise else schedule.describe(),
        )
        self._clip_covers_all = {id(p) for p in self._opt_params} == {id(p) for p in self._params}
        self._pending_noise: Any = None
        self._apply_schedule_change(self.global_batch.initial())
        #: sizes each step by its sequence length (batchpilot.train.lengths), or None
        self.lengths: LengthSizer | None = make_sizer(
            lengths, self.plan, start=self._start, fixed=self.fixed, search=self._length_search,
            layout=self.layout, per_rank=self._per_rank,
            param_bytes=sum(p.numel() * p.element_size() for p in self._params),
            target=self.target, high_water=cfg.high_water, world=self._world, group=self.coordinator.group,
        )

    def _warn_ddp_world(self) -> None:
        if self._ddp and self._world == 1 and group_size() > 1:
            logger.warning(
                "DDP over %d ranks but the coordinator given has a world of 1: an OOM on one rank "
                "is not agreed on, (sum, count) losses are normalised per rank, and "
                "global_batch_size=%d is what each rank trains (%d in all); leave coordinator= out "
                "to get batchpilot.dist.distributed.DistributedCoordinator", group_size(), self._global,
                self._global * group_size(),
            )

    # ------------------------------------------------------------------ public
    def step(self, batch: Any) -> StepResult:
        """Train on this rank's share of one global batch; step the optimizer once.

        ``batch`` holds up to :attr:`per_rank_batch_size` samples (``global_batch_size`` in a
        world of one). A smaller batch (the last of an epoch) is allowed: its loss is the mean
        over the samples it has, as in a plain loop with ``drop_last=False``.

        Raises:
            ValueError: the batch has no batch dimension, its tensors disagree on it, it is
                larger than :attr:`per_rank_batch_size`, or ``loss_fn`` returned something
                other than a 0-dim tensor or a ``(sum, count)`` pair.
            BatchDoesNotFitError: a micro-batch of 1 runs out of memory.
            batchpilot.policy.lengths.UnverifiedLengthError: with ``lengths=LengthConfig(beyond="error")``,
                a batch longer than the longest verified length. The batch's length cannot be
                read (a declared ``seq_dim`` it lacks, no ``attention_mask``) → ``ValueError``.
            torch.OutOfMemoryError: an OOM with a fixed ``micro_batch_size`` (on every rank when
                any rank ran out), after the partial gradients were dropped. An OOM in the
                optimizer step itself (e.g. Adam creating its state) is not retried either: a
                smaller micro-batch would not shrink it.
        """
        t0 = time.perf_counter()
        compiles = CompileCounter()
        split = BatchSplitter(batch, self.layout)
        tracker = active_tracker(self.device)
        if tracker is not None:
            # the global batch is data the caller holds, on a device's host: only the micro-batch
            # that runs is device memory (a loader may have stacked it while the tracker ran)
            tracker.treat_as_host(batch)
        n = split.size
        if n > self._per_rank:
            raise ValueError(self._too_large(n))
        probe = self._begin_step(split, n)
        try:
            ran = self._until_it_runs(split, n, probe, tracker=tracker, batch=batch)
            attempt_peak = probe.peak()
            probe.reset()
            grad_norm, skip_reason = self._apply(ran.acc)
        except BaseException as exc:
            probe.close()
            self._drop_grads()
            explained = self.coordinator.explain(exc)
            if explained is not None:
                raise explained from exc  # a peer's failure, told by the coordinator
            raise
        if tracker is not None:
            tracker.treat_as_host(batch)  # the step is over: its micro-batches leave the device
        self.steps += 1
        if ran.passes is not None:
            self.batcher.observe_step(ran.micro, n, ran.ooms, ran.passes)
        self._apply_peak = self._end_window(probe)
        peak = max(attempt_peak, self._apply_peak)
        noise = self._commit_noise(skip_reason)
        this_global = self._global
        self._count_step(n, ran)
        self._apply_schedule_change(self.global_batch.next_size(self.steps, lambda: self.noise_scale))
        return StepResult(
            loss_tensor=ran.acc.loss,
            micro_batch_size=ran.acc.sizes[0],
            accum_steps=len(ran.acc.sizes),
            samples=n,
            ooms=ran.ooms,
            peak_bytes=int(peak),
            measured=True,  # every device has a real figure (see StepResult.memory)
            memory=probe.kind,
            seconds=time.perf_counter() - t0,
            skipped=skip_reason is not None,
            skip_reason=skip_reason,
            pressure=ran.pressure,
            next_micro_batch_size=self.micro_batch_size,
            grad_norm=grad_norm,
            compilations=compiles.count,
            micro_batch_reason=ran.reason,
            global_batch_size=this_global,
            next_global_batch_size=self._global,
            noise=noise,
            length=None if self.lengths is None else self.lengths.length,
            micro_batch_sizes=tuple(ran.acc.sizes),
            micro_batch_lengths=() if self.lengths is None else tuple(self.lengths.widths),
        )

    def _count_step(self, n: int, ran: _Ran) -> None:
        """The samples a step trained on, counted; with uneven shares, its time recorded and new shares taken."""
        if self.rank_shares is None:
            self.global_batch.count(n)
        else:
            self.global_batch.count(n, total=self.rank_shares.total)
            if ran.ooms == 0:
                self.rank_shares.record(ran.share_seconds, n)
            if self.rank_shares.commit():
                self.batcher.resize(self._per_rank)

    def _begin_step(self, split: BatchSplitter, n: int) -> Gauge:
        """Before a step's passes: the batch agreed on, the micro-batch sized, the gauge reset, the state kept."""
        self.global_batch.check_loader(n)
        if self.rank_shares is None:
            self.coordinator.agree_batch(n)  # FSDP: every rank must run as many micro-batches, or collectives mispair
        if self.lengths is not None:
            self._size_by_length(split)  # before running: from the memory model at this length
        elif self.micro_batch_size is None:
            self._initialise(split)
        probe = self._probe = self._step_gauge()
        self._step_capacity = None
        if probe.host and not self.fixed:
            trim_host_memory()  # freed heap back to the OS, so the resident peak is this step's
        if not self.fixed:
            self.retry.snapshot()
        return probe

    @staticmethod
    def _end_window(probe: Gauge) -> int:
        """The step's last peak reading, then its window closed.

        Between steps the process runs the caller's own work (data, generation, evaluation), which a
        host gauge's resident-size sampler would otherwise go on polling every millisecond.
        """
        peak = probe.peak()
        probe.close()
        return peak

    def _until_it_runs(self, split: BatchSplitter, n: int, probe: Gauge, *, tracker: Any, batch: Any) -> _Ran:
        """The step's passes at the micro-batch; after an OOM on any rank, shrunk and run again, until they run."""
        fixed = self.fixed
        ooms = 0
        pressure = False
        while True:
            micro = min(self.micro_batch_size, n)
            reason = self.micro_batch_reason
            halved = micro if self.noise_meter is None else self.noise_meter.micro_batch(n, micro)
            if halved != micro:
                micro = halved
                reason = "; ".join(r for r in (reason, "split in two to measure the gradient noise scale") if r)
            if tracker is not None:
                tracker.treat_as_host(batch)  # an attempt that ran out held a larger micro-batch's views
            probe.reset()
            start_bytes = probe.current()
            # a split nominated by time is checked on real steps: their passes are timed as
            # the finder times a trial (a sync point on an accelerator, only while checking)
            read = step_clock(self.device) if self.batcher.checking else None
            if read is not None:
                probe.synchronize()
                began = read()
            if self.rank_shares is not None:
                # every rank's samples and micro-batches (FSDP runs the largest count on every rank)
                self.rank_shares.exchange(n, micro, first=ooms == 0)
                probe.synchronize()
                share_began = time.perf_counter()
            # attempt() frees memory outside its except block; the agreement runs on every rank
            outcome = self._attempt(split, micro)
            if self.rank_shares is not None:
                probe.synchronize()
                share_seconds = time.perf_counter() - share_began  # wall time: a shared core counts
            if read is not None:
                probe.synchronize()
                passes = read() - began
            if fixed:
                oom = self.coordinator.agree_oom(outcome.oom)
            else:
                oom, pressure = self._agree(outcome.oom, micro, start_bytes, ooms)
            if not oom:
                return _Ran(acc=outcome.result, micro=micro, reason=reason, ooms=ooms, pressure=pressure,
                            passes=passes if read is not None else None,
                            share_seconds=share_seconds if self.rank_shares is not None else None)
            message = _oom_message(outcome.message, self.coordinator)
            own_oom = outcome.oom
            del outcome
            # another rank's OOM leaves this rank's complete gradients unusable too
            self._drop_grads()
            ooms += 1
            if fixed:
                raise fixed_oom_error(micro, self.device, message)
            self.retry.restore()
            if self.lengths is not None:
                self.lengths.on_oom(self._capacity())
            if self.rank_shares is None:
                self.batcher.shrink_after_oom(micro, message)
            else:  # each rank's micro-batch is its own: the rank that ran out shrinks, the others retry theirs
                self.rank_shares.on_oom(hopeless=own_oom and micro <= 1, message=message)
                if own_oom:
                    self.batcher.shrink_after_oom(micro, message)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, summed over all ranks."""
        return self.global_batch.size

    @property
    def schedule(self) -> BatchSchedule | None:
        """The global-batch schedule (:mod:`batchpilot.policy.schedule`), or ``None``; the part's."""
        return self.global_batch.schedule

    @property
    def samples_seen(self) -> int:
        """Samples trained on so far, summed over all ranks."""
        return self.global_batch.samples

    @property
    def _global(self) -> int:
        return self.global_batch.size

    @property
    def _per_rank(self) -> int:
        return self.global_batch.per_rank if self.rank_shares is None else self.rank_shares.own

    @property
    def _count_norm(self) -> float:
        """What a ``(sum, count)`` loss is divided by before the sync: the same on every rank."""
        return self._per_rank if self.rank_shares is None else self.rank_shares.norm

    @property
    def shares(self) -> tuple[int, ...]:
        """Each rank's samples of the next step: the uneven shares, or ``global // world`` each.

        Feed each rank its share: ``loader.set_shares(engine.shares)`` after each step
        (:meth:`batchpilot.train.data.ElasticLoader.set_shares`) when they are uneven.
        """
        if self.rank_shares is None:
            return (self._per_rank,) * self._world
        return self.rank_shares.shares

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch of the next step (``None`` before the first one of ``"auto"``); the policy's."""
        return self.batcher.micro

    @property
    def micro_batch_reason(self) -> str:
        """Why the micro-batch is that size (empty before the first step)."""
        return self.batcher.reason

    @property
    def policy(self) -> MicroBatchPolicy | None:
        """The micro-batch's growth and shrink policy (``None`` before the first step and when fixed)."""
        return self.batcher.policy

    @property
    def fit(self) -> PeakFit:
        """The memory model over micro-batches that growth consults."""
        return self.batcher.fit

    @property
    def split(self) -> SplitChoice | None:
        """The initial split of the per-rank batch (``None`` before the first step and when fixed)."""
        return self.batcher.split

    @property
    def world_size(self) -> int:
        """Data-parallel ranks (the coordinator's world size when the engine was built)."""
        return self._world

    @property
    def per_rank_batch_size(self) -> int:
        """This rank's share of the global batch: what :meth:`step` takes.

        ``global_batch_size // world_size``, or with ``shares=`` this rank's share of the next step.
        """
        return self._per_rank

    @property
    def noise_scale(self) -> float | None:
        """``B_simple`` in samples from the EMAs, or ``None`` before a measurement (a sync point on an accelerator)."""
        return None if self.noise_meter is None else self.noise_meter.scale.noise_scale

    def set_global_batch_size(
        self, global_batch_size: int, *, lr_rule: str | None = "auto", scale_weight_decay: bool = False
    ) -> float:
        """Train on ``global_batch_size`` from the next step on; what a schedule calls at each change.

        The per-rank batch and the accumulation follow; the micro-batch stays what memory allowed
        (balanced over the new accumulation, at most the new per-rank batch). The LR (and the
        scheduler's base LRs) is rescaled by ``lr_rule`` (:func:`batchpilot.train.batching.rescale_lr`;
        ``None`` leaves it), the weight decay too with ``scale_weight_decay``
        (:func:`batchpilot.train.batching.rescale_weight_decay`). Feed the next step
        :attr:`per_rank_batch_size` samples (``ElasticLoader.set_batch_size`` keeps the data
        exactly-once). Call it on every rank alike.

        Returns:
            The factor the LR was multiplied by.

        Raises:
            ValueError: not a positive int, or not a multiple of the world size (the message
                names the nearest that are); an unknown ``lr_rule``.
        """
        if self.rank_shares is not None:
            raise ValueError(
                "set_global_batch_size with uneven shares is not supported: build a new Engine with the new "
                "global_batch_size (and shares=), or train with equal shares (shares=None)"
            )
        self.global_batch.check(global_batch_size)
        new, old = int(global_batch_size), self._global
        if new == old:
            return 1.0
        factor = 1.0
        if lr_rule is not None:
            factor = rescale_lr(self.optimizer, old, new, rule=lr_rule, scheduler=self.scheduler)
            if scale_weight_decay:
                rescale_weight_decay(self.optimizer, old, new, lr_factor=factor)
        self._resize(new)
        logger.info("global batch %d -> %d: %s", old, new, self.describe())
        return factor

    def _resize(self, new: int) -> None:
        self.global_batch.resize(new)
        self.batcher.resize(self._per_rank)

    @property
    def accum_steps(self) -> int | None:
        """Micro-batches per full per-rank batch at the current micro-batch (``None`` before the first step).

        ``ceil(per_rank / micro)``: when the micro-batch does not divide the per-rank batch, the
        last micro-batch is smaller.
        """
        return None if self.micro_batch_size is None else accum_steps(self._per_rank, self.micro_batch_size)

    @property
    def batch_config(self) -> BatchConfig | None:
        """``global = micro × world × accum`` as a :class:`~batchpilot.train.batching.BatchConfig`.

        ``None`` before the first step (no micro-batch yet) and whenever the micro-batch does not
        divide the per-rank batch: the engine then runs a smaller last micro-batch, which
        ``BatchConfig`` (exact division) cannot express. :meth:`describe` covers every case.
        """
        micro = self.micro_batch_size
        if micro is None or self._per_rank % micro or self.rank_shares is not None:
            return None  # uneven shares: no one micro × world × accum
        return BatchConfig(global_batch_size=self._global, micro_batch_size=micro, world_size=self._world)

    def describe(self) -> str:
        """One line for logs, e.g. ``global 256 = micro 32 × world 2 × accum 4: <why that micro-batch>``.

        When the micro-batch does not divide the per-rank batch: ``global 250 = world 2 × 125 per
        rank, micro 32 × accum 4 (1 of 32, 3 of 31)`` (balanced, ``"auto"``) or ``... (last
        micro-batch 29)`` (a fixed micro-batch); before the first step the micro-batch reads
        ``not chosen yet``. With ``"auto"`` the reason (:attr:`micro_batch_reason`) follows a colon.
        With the noise scale measured, its mode follows a semicolon (``; noise every (beta 0.95)``).
        """
        shares = "" if self.rank_shares is None else f"; shares: {self.rank_shares.reason}"
        return self._describe_batch() + shares + ("" if self.noise_meter is None else f"; {self.noise_meter.describe()}")

    def _describe_batch(self) -> str:
        why = f": {self.micro_batch_reason}" if self.micro_batch_reason and not self.fixed else ""
        config = self.batch_config
        if config is not None:
            return config.describe() + why
        head = f"global {self._global} = world {self._world} × {self._per_rank} per rank"
        if self.rank_shares is not None:
            head = f"global {self._global} = shares {list(self.rank_shares.shares)}, {self._per_rank} on this rank"
        micro = self.micro_batch_size
        if micro is None:
            return f"{head}, micro-batch not chosen yet"
        k = accum_steps(self._per_rank, micro)
        if self.fixed:
            sizes = f"last micro-batch {self._per_rank - (k - 1) * micro}"
        else:
            q, r = divmod(self._per_rank, k)
            sizes = f"{r} of {q + 1}, {k - r} of {q}"
        return f"{head}, micro {micro} × accum {k} ({sizes}){why}"

    def state_dict(self) -> dict[str, Any]:
        """The engine's own state: the step count, and each part's state under a key of its own.

        ``steps``; ``global_batch`` (:meth:`batchpilot.train.schedule.GlobalBatch.state_dict`: the
        global batch over all ranks, the ``world_size`` it was saved on, the samples seen and the
        schedule's counters); ``micro_batch`` (:meth:`batchpilot.train.adapt.MicroBatcher.state_dict`:
        ``micro_batch["policy"]["micro"]`` is the micro-batch, ``policy`` is ``None`` before the
        first step and for a fixed micro-batch); ``scaler`` (fp16's ``GradScaler``), ``noise``
        (:class:`~batchpilot.train.noise.NoiseMeter`) and ``lengths``
        (:class:`~batchpilot.train.lengths.LengthSizer`) and ``shares``
        (:meth:`batchpilot.train.shares.RankShares.state_dict`), each ``None`` when the part is off.
        Plain containers of numbers and strings: ``weights_only=True`` loads them. Model,
        optimizer and scheduler are the caller's to checkpoint.
        """
        return {
            "version": _STATE_VERSION,
            "steps": self.steps,
            "global_batch": self.global_batch.state_dict(),
            "micro_batch": self.batcher.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "noise": None if self.noise_meter is None else self.noise_meter.state_dict(),
            "lengths": None if self.lengths is None else self.lengths.state_dict(),
            "shares": None if self.rank_shares is None else self.rank_shares.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next step uses the saved micro-batch without probing.

        The batch sizes are this engine's: its global batch and world size (from the
        constructor) give the per-rank batch and so the accumulation. A state saved on another
        number of ranks keeps its micro-batch, clamped to the new per-rank batch (the growth
        counters start afresh then); a saved global batch other than this one is logged. A fixed
        ``micro_batch_size`` given to the constructor wins over the saved one. With ``lengths=``,
        the sizer continues from its saved model (no search again at a verified length); a state
        without it (saved before) leaves the sizer to fit on the first batch. States of versions
        3, 2 and 1 (one flat dict; in 1 ``global_batch_size`` was the per-rank batch) load too.

        Raises:
            ValueError: the state comes from an unknown version, or its "lengths" is not a sizer's state.
        """
        version = state.get("version")
        if version not in _READABLE_VERSIONS:
            raise ValueError(
                f"engine state version {version!r} is not one of {', '.join(map(str, _READABLE_VERSIONS))}"
            )
        state = _nested_state(state)
        if state.get("lengths") is not None:
            if self.lengths is not None:
                self.lengths.load_state_dict(state["lengths"])
            else:
                logger.warning("the engine state holds a sequence-length sizer's model; this engine has no "
                               "lengths= and ignores it")
        saved = state["global_batch"]
        saved_world = saved.get("world_size")
        resume_at = self.global_batch.load_state_dict(saved, per_rank_saved=version == 1)
        if resume_at is not None:
            # a schedule continues from the saved global batch, which the optimizer's LR is for
            if resume_at == self._global:
                self._resize(resume_at)
            else:
                self.set_global_batch_size(resume_at, lr_rule=self.schedule.lr_rule,
                                           scale_weight_decay=self.schedule.scale_weight_decay)
        if saved_world is not None and saved_world != self._world:
            logger.info("engine state saved on %d rank(s), resumed on %d: %d samples per rank",
                        saved_world, self._world, self._per_rank)
        self.steps = int(state["steps"])
        if self.noise_meter is not None and state.get("noise") is not None:
            self.noise_meter.load_state_dict(state["noise"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._last_scale = None
        if self.rank_shares is not None and state.get("shares") is not None:
            self.rank_shares.load_state_dict(state["shares"])
        self.batcher.load_state_dict(state["micro_batch"], per_rank=self._per_rank,
                                     same_world=saved_world in (None, self._world))

    # ------------------------------------------------------------------ schedule and noise
    def _commit_noise(self, skip_reason: str | None) -> NoiseSample | None:
        """Fold the step's measurement into the EMAs, unless the step was skipped (fp16 inf, all padding)."""
        pending, self._pending_noise = self._pending_noise, None
        if pending is None or skip_reason is not None:
            return None
        return self.noise_meter.commit(pending)

    def _apply_schedule_change(self, new: int) -> None:
        """Move to the global batch the schedule decided, rescaling the LR by its rule."""
        if new == self._global:
            return
        schedule = self.schedule
        self.set_global_batch_size(new, lr_rule=schedule.lr_rule, scale_weight_decay=schedule.scale_weight_decay)
        self.global_batch.mark_change(self.steps)

    # ------------------------------------------------------------------ setup
    def _initialise(self, split: BatchSplitter) -> None:
        start = self._start
        if start is None:
            start = self._find_start(split)
        elif self.plan is not None:
            self._adopt_fit(self.plan)
        self.batcher.start(self._per_rank, min(start, self._per_rank), self.plan)
        logger.info("%s", self.describe())

    def _size_by_length(self, split: BatchSplitter) -> None:
        """The sizer's micro-batch for this step's length, adopted by the policy."""
        assert self.lengths is not None
        sized = self.lengths.size_step(split, self._per_rank)
        self.lengths.start_step(self.batcher.size_for(sized.micro_batch_size, sized.reason, self._per_rank))

    def _length_search(self, split: BatchSplitter) -> BatchPlan:
        """The sizer's search at a length: a step's micro-batches accumulate, and no trial is timed."""
        plan = self._search(split, accumulating=True, timed_steps=0)
        if self.plan is None:
            self.plan = plan
        return plan

    def _share(self) -> str:
        """The per-rank batch in words, for error messages."""
        if self._world == 1:
            return f"global_batch_size={self._global}"
        return f"this rank's share {self._per_rank} (global_batch_size={self._global} over {self._world} ranks)"

    def _too_large(self, n: int) -> str:
        if self._global != self.global_batch.reference:
            return (
                f"the batch has {n} samples, more than this rank's {self._per_rank} of the global batch "
                f"{self._global} (it was {self.global_batch.reference}; a schedule or set_global_batch_size changed it): "
                "have the data loader follow the engine, loader.set_batch_size(engine.per_rank_batch_size) "
                "after each step"
            )
        if self._world == 1:
            return (
                f"the batch has {n} samples but global_batch_size is {self._global}; give the engine "
                "one global batch per step (a DataLoader with batch_size=global_batch_size), or raise "
                "global_batch_size"
            )
        return (
            f"the batch has {n} samples, more than {self._share()}; give each rank its "
            f"share per step (a sampler with batch_size=global_batch_size // {self._world}), or raise "
            "global_batch_size"
        )

    def _find_start(self, split: BatchSplitter) -> int:
        """The finder's micro-batch, probed on the first batch's samples; all state put back.

        Raises:
            batchpilot.policy.search.NothingFitsError: as :meth:`_search`.
        """
        plan = self._search(split)
        self.plan = plan
        self._adopt_fit(plan)
        return max(1, int(plan.batch_size))

    def _search(self, split: BatchSplitter, *, accumulating: bool = False, **overrides: Any) -> BatchPlan:
        """A finder search on ``split``'s samples (``overrides``: finder options); all state put back.

        ``accumulating``: a trial below the per-rank batch runs two micro-batches, so its peak
        holds the gradients a later micro-batch runs beside (sizing by length reuses the answer
        for every micro-batch of a step).

        Raises:
            batchpilot.policy.search.NothingFitsError: not even the smallest batch fits (with several
                ranks: on any rank; then it is raised on every rank, naming that rank).
        """
        # imported here, on first use: a plain training script does not load the distributed layer
        from ..dist.distributed import unwrap_model

        inner = unwrap_model(self.model)

        def trial(b: int, rounds: int = 1) -> None:
            # the module inside a DDP wrapper: no hook, no all-reduce, so ranks may run different
            # trials (a trial through the wrapper would synchronise with whatever the others run)
            sub = split.narrow(0, b)
            for r in range(rounds):
                self._accumulate(sub, b, use_scaler=False, model=inner, sync=r == rounds - 1)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        find = self.config.find
        # one search size: the batch at hand, within this rank's share and the options' own bound
        largest = min(split.size, self._per_rank, find.max_batch_size or split.size)
        decided = dict(target=self.target, max_batch_size=largest)
        if self.config.split == "time" and find.timed_steps is None:
            decided["timed_steps"] = 3  # the split is decided on these times: the fastest of three
        options = dict(device=self.device, options=FindOptions.build(find, **{**decided, **overrides}))
        if self.coordinator.lockstep:
            # FSDP: trials in lockstep on every rank (their forward runs collectives). A micro-batch
            # below the per-rank batch accumulates, and FSDP keeps the unsharded gradients between
            # micro-batches: such a trial runs two micro-batches so that its peak holds them
            def rounds(b: int) -> int:
                return 2 if b < self._per_rank else 1

            plan = self._sizes_by.find_batch_size(lambda b: trial(b, rounds(b)), restore=(self.model, self.optimizer),
                                                    replay=lambda b: trial(1, rounds(b)), **options)
        elif self._world > 1:
            # DistributedCoordinator: every rank searches alone, then one all-reduce MIN; a
            # nothing-fits on one rank is raised on all of them. The wrapper goes in `restore`: it
            # is unwrapped for the snapshot, and a loss_fn that calls it instead of its argument fails clearly.
            plan = self._sizes_by.find_batch_size(trial, restore=(self.model, self.optimizer), **options)
        elif accumulating:
            plan = find_batch_size(lambda b: trial(b, 2 if b < self._per_rank else 1),
                                   restore=(inner, self.optimizer), **options)
        else:
            plan = find_batch_size(trial, restore=(inner, self.optimizer), **options)
        return plan

    def _adopt_fit(self, plan: BatchPlan) -> None:
        """Use the finder's memory line as the prior until the engine has measured two sizes."""
        self.batcher.adopt_fit(plan, in_use=self._step_gauge().current())

    # ------------------------------------------------------------------ the step
    def _accumulate(
        self, split: BatchSplitter, micro: int, *, use_scaler: bool = True, model: nn.Module | None = None,
        sync: bool = True, replay: bool = False,
    ) -> _Accumulated:
        """Forward and backward over ``split`` in micro-batches of ``micro``; no optimizer step.

        ``model`` defaults to the engine's; the finder passes the module inside a DDP wrapper.
        ``sync=False`` keeps FSDP from reduce-scattering after the last micro-batch too.
        ``replay``: FSDP's replay after an OOM (:meth:`_attempt`): ``micro`` is 1, measured by
        nothing and cut without the sizer (whose exchanges with the other ranks would pair with
        their FSDP collectives), each sample trimmed to the failed attempt's shortest width.
        """
        meter = self.noise_meter if model is None and not replay else None  # trials and replays measure nothing
        own = model is None and not replay
        if model is None:
            model = self.model
        ddp = self._ddp and model is self.model
        n = split.size
        uneven = self.rank_shares if own or replay else None
        sizes, widths = self._micro_sizes(split, micro, own=own, uneven=uneven)
        last = len(sizes) - 1
        scaler = self.scaler if use_scaler else None
        if meter is not None:
            loss_scale = scaler.scale(torch.ones((), device=self.device)) if scaler is not None else None
            meter.begin(n=n, sizes=sizes, per_rank=self._per_rank, scale=loss_scale)
        total = None
        count: Any = 0
        mode = None
        start = 0
        for i, size in enumerate(sizes):
            mb = self._micro_batch(split, i, start, size, by_length=widths is not None, replay=replay)
            start += size
            # DDP all-reduces in the backward of the last micro-batch only, unless deferred;
            # FSDP reduce-scatters there (the coordinator switches it)
            quiet = ddp and (i < last or self.coordinator.defer_grad_sync)
            if self._fsdp:
                self.coordinator.set_gradient_sync(sync and i == last)
            if quiet and self.coordinator.defer_grad_sync:
                # DDP broadcasts its buffers in a forward that follows a synced one, and marks that done
                # only when the forward returns: a rank whose forward ran out of memory would broadcast
                # again in its retry, alone, and wait forever. The coordinator broadcasts them after the
                # gradients (sync_gradients), so the wrapper's own forward stays collective-free.
                model.require_forward_param_sync = False
            with model.no_sync() if quiet else contextlib.nullcontext():
                with self._autocast():
                    out = self.loss_fn(model, mb)
                loss, c, kind = parse_loss(out)
                if mode is None:
                    mode = kind
                elif kind != mode:
                    raise ValueError("loss_fn returned a mean for one micro-batch and (sum, count) for another")
                scaled, term = self._weighted(loss, kind, size, n, uneven)
                if kind == "sum" and size != 0:
                    count = count + c
                if scaler is not None:
                    scaled = scaler.scale(scaled)
                if meter is not None:
                    meter.before_backward(i, self._params)
                scaled.backward()
                if meter is not None:
                    meter.after_backward(i, size, c if kind == "sum" else None, self._params)
            del out, loss, scaled, mb
            # summed in the loss's own precision, at least float32: a float64 model's loss stays
            # float64, a bf16 / fp16 one (autocast) is not summed in 8 or 11 bits of mantissa
            term = term.to(torch.promote_types(term.dtype, torch.float32))
            total = term if total is None else total + term
        assert total is not None and mode is not None
        return _Accumulated(loss=total, count=count, mode=mode, sizes=sizes)

    def _micro_sizes(self, split: BatchSplitter, micro: int, *, own: bool,
                     uneven: RankShares | None) -> tuple[list[int], Any]:
        """The micro-batches ``split`` is cut into at ``micro``, and their widths when cut by length (else ``None``)."""
        n = split.size
        # "auto": balanced micro-batches (10 at 4 is 4 + 3 + 3, the same passes and peak as
        # 4 + 4 + 2, no ragged tail); a fixed micro-batch is cut as the user's own loop would
        sizes = split_sizes(n, micro) if self.fixed else balanced_sizes(n, accum_steps(n, micro))
        if uneven is not None:
            sizes = uneven.cut(n, micro)  # FSDP: the count every rank runs; size 0 is a weightless pass
        widths = None
        if self.lengths is not None and own:  # the engine's own step, not a finder trial
            sizes, widths = self.lengths.cut(split, micro, sizes)
        elif self._compiled:
            sizes = no_single_tail(sizes)  # a micro-batch of one would compile a graph of its own
        return sizes, widths

    def _micro_batch(self, split: BatchSplitter, i: int, start: int, size: int, *, by_length: bool,
                     replay: bool) -> Any:
        """Micro-batch ``i`` (``size`` samples from ``start``) on the device, as a pass runs it."""
        # length-aware: the micro-batch's samples, trimmed to their longest
        if size == 0:  # a pass at zero weight: its collectives pair with the other ranks' (FSDP)
            mb = split.slice(0, 1, self.device)
        else:
            mb = self.lengths.take(split, i, self.device) if by_length else split.slice(start, size, self.device)
        if replay and self.lengths is not None and self.lengths.widths:
            # (without split every micro-batch is sized at the longest rank's length, and this
            # rank's batch may be shorter)
            mb = self.lengths.trim(mb, min(*self.lengths.widths, self.lengths.width))
        if self._compiled:  # a new micro-batch size, or length, reuses the graph
            mark_batch_dynamic(mb, self.layout,
                               seq_dim=None if self.lengths is None else self.lengths.config.token_dim)
        return mb

    def _weighted(self, loss: torch.Tensor, kind: str, size: int, n: int,
                  uneven: RankShares | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's loss as its backward takes it (``scaled``) and as the step's loss sums it (``term``)."""
        if kind == "mean":
            # weight by sample count: uneven micro-batches still give the batch mean
            if uneven is not None:
                # uneven shares: by samples over the global batch, times world (the sync divides by it)
                return loss * uneven.mean_weight(size), (loss * (size / n)).detach()
            scaled = loss if size == n else loss * (size / n)
            return scaled, scaled.detach()
        # a rank-independent constant keeps magnitudes per-sample; the exact total
        # count divides the gradients once all micro-batches are done (_apply)
        scaled = loss / self._count_norm
        term = loss.detach()
        if size == 0:
            scaled, term = scaled * 0, term * 0
        return scaled, term

    def _apply(self, acc: _Accumulated) -> tuple[torch.Tensor | None, str | None]:
        """Synchronise and normalise the accumulated gradients, then step the optimizer once.

        Returns the gradient norm (when clipping) and why the optimizer step was skipped, if it was.
        """
        coord = self.coordinator
        meter = self.noise_meter
        # the noise scale's local norms, summed over ranks inside the gradient sync's collective
        values = None if meter is None else meter.local_values(self._params, acc.count if acc.mode == "sum" else None)
        if coord.defer_grad_sync:
            if values is None:
                coord.sync_gradients(self.model)
            else:
                values = coord.sync_gradients_and_sum(self.model, values)
        elif values is not None and self._world > 1:
            values = coord.sum_over_ranks(values)
        total = None
        if acc.mode == "sum":
            total = coord.total_count(acc.count)
            # a tensor count must be read to tell an empty batch: one sync per step, (sum, count) only
            if float(total) <= 0:
                # every element was padding on every rank: no gradient to average, so no step,
                # rather than 0 / 0 written into the parameters
                self.optimizer.zero_grad(set_to_none=True)
                acc.loss = torch.full_like(acc.loss, float("nan"))
                logger.warning("step %d: the (sum, count) loss counted no element in the whole global batch "
                               "(all padding?); the optimizer step is skipped", self.steps + 1)
                return None, "empty"
            grads = [p.grad for p in self._params if p.grad is not None]
            # DDP averaged over ranks; world × N / total undoes that and divides by the global count.
            # In float64: an integer count divided in the default dtype is a float32 factor, which
            # rounds a float64 model's gradients at 1e-8
            factor = self._world * self._count_norm / (total.double() if isinstance(total, torch.Tensor) else total)
            if grads:
                if isinstance(factor, torch.Tensor):
                    factor = factor.to(grads[0].device)
                torch._foreach_mul_(grads, factor)
            acc.loss = acc.loss / acc.count
        grad_norm = None
        skipped = False
        scaler = self.scaler
        if self.grad_clip is not None:
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            grad_norm = nn.utils.clip_grad_norm_(self._opt_params, self.grad_clip)
        if meter is not None:
            # before the optimizer step: the big batch's norm (clipping's, when it covers every gradient)
            self._pending_noise = meter.measure(self._params, values, total_count=total,
                                                grad_norm=grad_norm if self._clip_covers_all else None)
        if scaler is not None:
            if self._last_scale is None:
                self._last_scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            scale = scaler.get_scale()  # a sync point: the scale is a device tensor
            skipped = scale < self._last_scale
            self._last_scale = scale
        else:
            self.optimizer.step()
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, "inf" if skipped else None

    def _attempt(self, split: BatchSplitter, micro: int) -> Any:
        """One attempt at the batch, run by the coordinator (FSDP's replays it after an OOM)."""

        def replay() -> _Accumulated:
            # as many micro-batches as the attempt cut (the sizer's cut, agreed by every rank, when
            # sizing by length), of one sample each at the attempt's shortest width: FSDP's
            # collectives move parameters and gradients, whose sizes do not depend on the batch
            sizer = self.lengths
            count = len(sizer.sizes) if sizer is not None and sizer.sizes else accum_steps(split.size, micro)
            if self.rank_shares is not None and self.rank_shares.accum is not None:
                count = self.rank_shares.accum  # the count every rank agreed on (cut pads a short rank)
            return self._accumulate(split.narrow(0, min(count, split.size)), 1, replay=True)

        return self.coordinator.attempt(
            lambda: self._accumulate(split, micro), replay,
            device=self.device, on_oom=self._drop_grads, micro_batch_size=micro, step=self.steps + 1,
        )

    def _bind_fsdp(self, model: nn.Module) -> None:
        """Attach the coordinator to a ``fully_shard`` model, or refuse a coordinator that cannot run it."""
        if not self.coordinator.lockstep:
            raise ValueError(
                f"the model has fully_shard (FSDP2) modules, which {type(self.coordinator).__name__} cannot keep "
                "in step; leave coordinator= out, or pass batchpilot.dist.fsdp.FSDPCoordinator()"
            )
        if self.amp_dtype is torch.float16:
            raise ValueError(
                "amp='fp16' with fully_shard: GradScaler would decide on inf gradients per shard and the "
                "ranks would diverge; use amp='bf16' (or FSDP2's MixedPrecisionPolicy)"
            )
        self.coordinator.bind(model)

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device.type, self.amp_dtype)

    def _drop_grads(self) -> None:
        if self.noise_meter is not None:
            self.noise_meter.abort()
        self._pending_noise = None
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ adaptation
    def _step_gauge(self) -> Gauge:
        """The figure this step decides on: an emulation running around it, else the device's real memory."""
        dev = self.device
        if dev.type == "cpu":
            tracker = active_tracker(dev)
            key: tuple = ("tensors",) if tracker is not None else ("host",)
            emulated = None if tracker is None else (tracker.capacity or 0)
        else:
            emulated = emulated_capacity(dev)
            key = (dev.type, emulated)
        gauge = self._gauges.get(key)
        if gauge is None:
            gauge = self._gauges[key] = gauge_for(dev, emulated_capacity=emulated)
        return gauge

    def _capacity(self) -> int:
        if self.config.capacity is not None:
            return self.config.capacity
        if self._step_capacity is None:  # read once per step: on a real CPU it is a few file reads
            self._step_capacity = self._probe.capacity()
        return self._step_capacity

    def _agree(self, oom: bool, micro: int, start_bytes: int, ooms: int) -> tuple[bool, bool]:
        """Agree on the attempt's OOM and on the next micro-batch in one call; ``(any OOM, pressure)``.

        A rank whose attempt succeeded decides its next micro-batch first, on the peak the module
        docstring describes (sizing by length: the sizer learns from it instead), and proposes it.
        """
        if oom:
            return self.batcher.agree_failed(), False
        # the optimizer step has not run yet: its peak is the last step's
        peak = max(self._probe.peak(), self._apply_peak)
        if self.lengths is None:
            return self.batcher.agree_clean(micro, peak=peak, start_bytes=start_bytes, ooms=ooms)
        # the next step is sized by its own length: no growth here
        pressure = self.lengths.observe(peak, self._capacity())
        anyone, _ = self.batcher.agree_clean(micro, peak=peak, start_bytes=start_bytes, ooms=ooms, observe=False)
        return anyone, pressure and not anyone


def _refuse_with_shares(*, schedule: Any, noise: Any, lengths: Any) -> None:
    """Uneven shares do not combine (yet) with a schedule, the noise scale or sizing by length: say so early.

    Raises:
        ValueError: naming the option and how to train instead.
    """
    if schedule is not None:
        raise ValueError("shares= with a global-batch schedule is not supported: a schedule moves the global "
                         "batch and every rank's share with it; use shares=None with schedule=, or no schedule")
    if noise not in (None, False):
        raise ValueError("shares= with noise= is not supported: the gradient noise scale's small-batch norms "
                         "assume equal shares; use noise=False (or shares=None to measure it)")
    if lengths not in (None, False):
        raise ValueError("shares= with lengths= is not supported: sizing by length agrees one micro-batch over "
                         "ranks; use lengths=None with uneven shares")


def _nested_state(state: dict[str, Any]) -> dict[str, Any]:
    """An engine state in the layout of version 4: one written by versions 1-3 (one flat dict) regrouped by part."""
    if state.get("version") == _STATE_VERSION:
        return state
    flat = dict(state)
    parts = {part: {k: flat.pop(k) for k in keys if k in flat} for part, keys in _FLAT_KEYS.items()}
    return {**flat, **parts}


def _default_coordinator(fsdp: bool = False) -> Coordinator:
    """The distributed coordinator when a process group of several ranks is running, else the local one.

    Without it each rank of a ``torchrun`` job would train the whole global batch and average
    nothing: the silent world of one. A ``fully_shard`` model gets the FSDP coordinator on any
    number of ranks (it also resets FSDP's state after an OOM).
    """
    if fsdp:
        from ..dist.fsdp import FSDPCoordinator  # on first use, as distributed

        return FSDPCoordinator()
    if group_size() > 1:
        # imported here, on first use: a plain training script does not load the distributed layer
        from ..dist.distributed import DistributedCoordinator

        logger.info("a process group of %d ranks is running: using DistributedCoordinator()", group_size())
        return DistributedCoordinator()
    return LocalCoordinator()


def _oom_message(local: str | None, coordinator: Any) -> str:
    """What ran out, for this rank's log and error: with several ranks, which one (the lowest)."""
    if coordinator.world_size <= 1:
        return local or "out of memory"
    if local:
        return f"rank {coordinator.rank}: {local}"
    who = coordinator.oom_rank
    return "another rank ran out of memory" if who is None else f"rank {who} ran out of memory"
