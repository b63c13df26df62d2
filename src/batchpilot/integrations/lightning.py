"""Lightning: size the batch at fit start on every rank, and train through out-of-memory errors.

- :class:`BatchSizeCallback` runs batchpilot's finder on each rank at ``on_fit_start``, agrees on
  the smallest answer, sets the dataloader's batch size the way Lightning's ``BatchSizeFinder``
  does (the ``batch_size`` attribute of the module, its ``hparams`` or the datamodule; dataloaders
  reloaded) and sets ``accumulate_grad_batches`` to hold a global batch; like ``BatchSizeFinder``
  it leaves the learning rate alone unless ``lr_rule`` asks for a rescaling.
- :class:`ResilientModule` is a ``LightningModule`` mixin whose training step is
  :meth:`batchpilot.Engine.step` under manual optimization: an OOM drops the partial gradients,
  shrinks the micro-batch and retries the same batch, so no step is lost.

What Lightning does not allow, and why, is in docs/integrations.md (Lightning).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Iterator

import torch

from ..core.batch import BatchLayout, SplitFn, batch_size_of, make_batch_fn
from ..core.loss import parse_loss
from ..dist.distributed import find_batch_size_distributed
from ..find.options import FindOptions
from ..find.result import BatchPlan
from ..policy.search import NothingFitsError
from ..train.batching import BatchConfig, rescale_lr
from ..train.engine import Engine, StepResult
from ._common import BatchSetup, SizingOptions, choose_batches, lr_rule_for, note_equal_shares, require

require("lightning", "batchpilot.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr  # noqa: E402

__all__ = ["BatchSizeCallback", "NothingFitsException", "ResilientModule"]

logger = logging.getLogger(__name__)



class NothingFitsException(NothingFitsError, MisconfigurationException):
    """Not even one sample fits: :class:`~batchpilot.policy.search.NothingFitsError` as Lightning raises what
    its user must fix (a ``MisconfigurationException``).

    Raised by :class:`BatchSizeCallback` and :class:`ResilientModule` in place of the finder's error,
    with its message and figures, from the integration's own hook: the traceback ends there, with
    one message, instead of going on through the finder's internals and the chained OOMs.
    """

    @classmethod
    def of(cls, exc: NothingFitsError, who: str) -> NothingFitsException:
        """``exc`` with its figures, the message prefixed by ``who`` (the class that searched)."""
        return cls(f"{who}: {exc}", batch_size=exc.batch_size, peak_bytes=exc.peak_bytes,
                   limit_bytes=exc.limit_bytes, capacity_bytes=exc.capacity_bytes)


# Lightning's precision plugins whose GradScaler owns the backward and the optimizer step: the
# engine's micro-batches cannot go through them (see ResilientModule)
_SCALED_PRECISION = ("16-mixed", "16")


class BatchSizeCallback(Callback):
    """Find the per-device batch at fit start, on any number of DDP ranks, and hold a global batch.

    At ``on_fit_start`` every rank runs batchpilot's finder on its own device (real training steps
    of the module on the first training batch, its samples repeated to each trial's size, all
    state put back) with no collective in between; then one all-reduce takes the smallest answer,
    so every rank trains the same batch. The answer is applied like Lightning's ``BatchSizeFinder``
    does: the ``batch_arg_name`` attribute is set on the module, its ``hparams`` or the datamodule,
    and the dataloaders are reloaded. With ``global_batch_size`` the callback also sets
    ``trainer.accumulate_grad_batches`` so that ``global = micro × world × accum``. With its
    defaults it changes only the batch size, as ``BatchSizeFinder`` does; with ``lr_rule="auto"``
    (or ``"linear"``, ``"sqrt"``) the learning rate of every optimizer (and its scheduler's base) is
    rescaled when the global batch differs from ``lr_base_size``. :attr:`setup` reports what was
    chosen.

    With a :class:`ResilientModule` the dataloader gives each rank its whole share of the global
    batch and the engine accumulates micro-batches of at most the size found (``accumulate_grad_batches``
    stays 1, as manual optimization requires); :attr:`setup` then holds the micro-batches the
    engine ran in its first step (which it logs), and until that step the fewest balanced ones
    under the size found, which the engine runs unless its timed trials chose a faster split.

    Args:
        global_batch_size: samples per optimizer step over all ranks to hold; ``None`` keeps
            ``accumulate_grad_batches`` and takes the largest micro-batch that fits.
        micro_batch_size: skip the search and use this per-device batch.
        lr_base_size: the global batch the learning rate was tuned for; default the module's batch
            size × world size × ``accumulate_grad_batches`` as configured before fit.
        lr_rule: ``"none"`` (default: the learning rate is left as configured), or ``"auto"`` (sqrt
            for Adam-like optimizers, linear otherwise), ``"linear"``, ``"sqrt"``.
        batch_arg_name: the attribute that holds the dataloader's batch size.
        options: the finder's options (:class:`batchpilot.FindOptions`); ``max_batch_size`` is also
            capped at the per-rank batch and the dataset's length.
        shared: dict keys of the batch that are not per-sample (see :mod:`batchpilot.core.batch`).
        split_fn: ``split_fn(batch, start, stop)`` for batches the rules cannot cut.
        **overrides: other options: the fields of :class:`batchpilot.FindOptions` (``target``,
            ``capacity``, ``strategy``, ``max_batch_size``, ``steps_per_trial``, ...), each in place
            of ``options``'s value.

    Raises:
        ValueError: invalid options, among them ``BatchSizeError`` for a keyword that is no finder
            option (at construction); at fit start, a module without the batch
            size attribute, a dataloader passed to ``fit()`` directly, several training dataloaders,
            a strategy other than single-device or DDP, or ``GradientAccumulationScheduler`` next
            to a global batch.
        NothingFitsException: not even one sample fits on some rank (on every rank); a
            :class:`~batchpilot.policy.search.NothingFitsError` and Lightning's ``MisconfigurationException``.
    """

    def __init__(
        self,
        *,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        lr_base_size: int | None = None,
        lr_rule: str = "none",  # Lightning's BatchSizeFinder changes only the batch size
        batch_arg_name: str = "batch_size",
        options: FindOptions | None = None,
        shared: str | list[str] | None = None,
        split_fn: SplitFn | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.options = SizingOptions(global_batch_size=global_batch_size, lr_base_size=lr_base_size, lr_rule=lr_rule,
                                     find=FindOptions.build(options, **overrides))
        if micro_batch_size is not None:
            from .._checks import positive_int

            positive_int("micro_batch_size", micro_batch_size)
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise ValueError(f"batch_arg_name must be an attribute name, got {batch_arg_name!r}")
        self.micro_batch_size = micro_batch_size
        self.batch_arg_name = batch_arg_name
        self.layout = BatchLayout.of(shared, split_fn)
        #: what was chosen at the last fit start (``None`` before); with a ResilientModule, what its first step ran
        self.setup: BatchSetup | None = None
        self._engine_pending = False  # a ResilientModule's first step is yet to report its micro-batches

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opts = self.options
        _check_strategy(trainer)
        resilient = isinstance(pl_module, ResilientModule)
        if not resilient and not pl_module.automatic_optimization and trainer.world_size > 1:
            raise ValueError(
                "BatchSizeCallback cannot run the trials of a manual-optimization module under DDP: its "
                "training_step calls manual_backward, which all-reduces through the DDP wrapper while other "
                "ranks run other trials; write compute_loss(batch) with batchpilot's ResilientModule instead"
            )
        if opts.global_batch_size is not None and _has_accumulation_scheduler(trainer):
            raise ValueError(
                "GradientAccumulationScheduler changes accumulate_grad_batches every epoch, so the global "
                "batch could not be held; remove it or leave global_batch_size=None"
            )
        name = self.batch_arg_name
        if not trainer.fit_loop._data_source.is_module():
            raise ValueError(
                "BatchSizeCallback cannot resize a dataloader passed to fit() directly: build it in the module's "
                f"or a datamodule's train_dataloader() from self.{name}"
            )
        if not lightning_hasattr(pl_module, name):
            raise ValueError(
                f"BatchSizeCallback sets the dataloader's batch size through an attribute {name!r} of the "
                f"module, its hparams or the datamodule, and none has one: add self.{name} = ... and use it "
                f"in train_dataloader(), or pass batch_arg_name="
            )
        world = trainer.world_size
        if opts.global_batch_size is not None:  # before the search: the error names the nearest valid ones
            BatchConfig(global_batch_size=opts.global_batch_size, world_size=world)
        configured = int(lightning_getattr(pl_module, name))
        accum = int(trainer.accumulate_grad_batches)
        lr_base = opts.lr_base_size or configured * world * accum
        loader = _train_loader(trainer)
        example = next(iter(loader))
        per_rank = None if opts.global_batch_size is None else opts.global_batch_size // max(world, 1)
        limit = _dataset_limit(loader, world)
        plan: BatchPlan | None = None
        if self.micro_batch_size is not None:
            found = self.micro_batch_size
        else:
            caps = [c for c in (per_rank, limit) if c is not None]
            try:
                plan = _search_batch_size(trainer, pl_module, example, opts, limit=min(caps) if caps else None,
                                         layout=self.layout)
            except NothingFitsError as exc:
                raise NothingFitsException.of(exc, type(self).__name__) from None
            found = plan.batch_size
            note_equal_shares(plan, world, "Lightning", "its DistributedSampler gives each rank as many samples")
        micro, accum, per_rank, sizes = choose_batches(
            found, world_size=world, global_batch_size=opts.global_batch_size, accum_steps=accum,
            whole_micro_batches=not resilient,
        )
        if resilient:
            # the engine accumulates inside each step: the dataloader gives the whole per-rank batch
            lightning_setattr(pl_module, name, per_rank)
            pl_module.batchpilot_start = plan if plan is not None else micro
            pl_module.batchpilot_global_batch_size = per_rank * world
        else:
            lightning_setattr(pl_module, name, micro)
            trainer.accumulate_grad_batches = accum
        _reload_dataloaders(trainer)
        global_ = per_rank * world
        factor, lrs = _rescale_optimizers(trainer, lr_base, global_, opts.lr_rule)
        self.setup = BatchSetup(
            micro_batch_size=micro, accum_steps=accum, world_size=world, global_batch_size=global_,
            per_rank_batch_size=per_rank, micro_batch_sizes=sizes,
            found_batch_size=None if plan is None else plan.batch_size,
            limited_by_rank=None if plan is None else plan.limited_by_rank,
            lr_base_size=lr_base, lr_rule=lr_rule_for(opts.lr_rule, trainer.optimizers[0] if trainer.optimizers else None),
            lr_factor=factor, learning_rates=tuple(lrs), plan=plan,
        )
        self._engine_pending = resilient
        if resilient:  # the engine decides its split at its first step, and the setup is logged then
            logger.info("batchpilot: global %d = world %d × %d per rank for ResilientModule's engine, in "
                        "micro-batches of at most %d", global_, world, per_rank, micro)
        else:
            logger.info("batchpilot: %s", self.setup.describe())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After a ResilientModule's first step: the setup holds the micro-batches its engine ran."""
        if not self._engine_pending or self.setup is None:
            return
        step = getattr(pl_module, "batchpilot_last_step", None)
        if not isinstance(step, StepResult) or not step.micro_batch_sizes:
            return
        self._engine_pending = False
        sizes = tuple(step.micro_batch_sizes)
        if sum(sizes) != self.setup.per_rank_batch_size:  # a short last batch of the epoch: not the set-up
            self._engine_pending = True
            return
        self.setup = self.setup.with_micro_batches(sizes)
        logger.info("batchpilot: %s", self.setup.describe())

    def state_dict(self) -> dict[str, Any]:
        return {} if self.setup is None else {"setup": self.setup.to_dict()}


class ResilientModule:
    """A ``LightningModule`` mixin whose training steps survive out-of-memory errors.

    Write ``compute_loss(self, batch)`` (the batch's mean loss, or a ``(sum, count)`` pair for a
    per-token mean) instead of ``training_step``, and put the mixin first::

        class Net(ResilientModule, L.LightningModule):
            def compute_loss(self, batch):
                x, y = batch
                return F.cross_entropy(self(x), y)

    Each training batch is one optimizer step: :class:`batchpilot.Engine` splits it into
    micro-batches that fit, accumulates their gradients and steps the optimizer once (through
    Lightning's optimizer wrapper, so ``global_step``, callbacks and loggers see every step). On an
    OOM it drops the partial gradients, shrinks the micro-batch and reruns the same batch: no sample
    lost, no step skipped, the same update. Under DDP the ranks agree on every OOM and the
    gradients are averaged once every rank succeeded. The micro-batch comes from
    :class:`BatchSizeCallback` when one runs, else from a search on the first batch, and grows back
    after clean steps when memory allows. The module runs under manual optimization.

    Class attributes:
        engine_options: keywords for :class:`batchpilot.Engine` (``grad_clip``, ``target``,
            ``config``, ``shared``, ``split_fn``); mixed precision comes from the Trainer's
            ``precision`` (``"bf16-mixed"``; ``"16-mixed"`` is refused: its GradScaler is
            Lightning's). LR schedulers from ``configure_optimizers`` are stepped by the mixin
            (interval ``"step"`` or ``"epoch"``, with their ``frequency``).

    Metrics: each step logs ``batchpilot/loss`` (the batch's loss, on the progress bar),
    ``batchpilot/micro_batch_size`` (the largest micro-batch of the step) and
    ``batchpilot/accum_steps`` (how many ran), names that leave the module's own ``self.log``
    calls free (``self.log("train_loss", loss)`` in ``compute_loss`` is yours).

    Attributes:
        batchpilot_engine: the engine, after the first training step.
        batchpilot_last_step: the :class:`batchpilot.StepResult` of the last step.

    Raises:
        NothingFitsException: without :class:`BatchSizeCallback`, the search on the first batch
            finds that not even one sample fits.
    """

    engine_options: dict[str, Any] = {}
    batchpilot_engine: Engine | None = None
    batchpilot_last_step: StepResult | None = None
    # set by BatchSizeCallback: the engine's first micro-batch and global batch
    batchpilot_start: BatchPlan | int | None = None
    batchpilot_global_batch_size: int | None = None
    _batchpilot_state: dict[str, Any] | None = None

    @property
    def automatic_optimization(self) -> bool:
        return False

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        if value:
            raise ValueError("ResilientModule trains under manual optimization: batchpilot's engine steps the "
                             "optimizer; remove automatic_optimization = True")

    def compute_loss(self, batch: Any) -> Any:
        """The loss of one micro-batch: a 0-dim mean, or ``(sum, count)``. Override it."""
        raise NotImplementedError(
            f"{type(self).__name__} uses ResilientModule: define compute_loss(self, batch) returning the batch's "
            "mean loss or a (sum, count) pair; the mixin's training_step runs it on each micro-batch"
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        engine = self.batchpilot_engine or self._batchpilot_build(batch)
        result = engine.step(batch)
        self.batchpilot_last_step = result
        if not result.skipped:
            self._batchpilot_step_schedulers("step")
        # under batchpilot's prefix: the module's own self.log("train_loss", ...) must not collide
        self.log("batchpilot/loss", result.loss_tensor, prog_bar=True, batch_size=result.samples)
        self.log("batchpilot/micro_batch_size", float(result.micro_batch_size), batch_size=result.samples)
        self.log("batchpilot/accum_steps", float(result.accum_steps), batch_size=result.samples)
        return result.loss_tensor

    def on_train_epoch_end(self) -> None:
        self._batchpilot_step_schedulers("epoch")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.batchpilot_engine is not None:
            checkpoint["batchpilot_engine"] = self.batchpilot_engine.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._batchpilot_state = checkpoint.get("batchpilot_engine")

    # ------------------------------------------------------------------ internals
    def _batchpilot_build(self, batch: Any) -> Engine:
        trainer = self.trainer
        _check_strategy(trainer)
        if str(trainer.precision) in _SCALED_PRECISION:
            raise ValueError(
                f"ResilientModule cannot train with precision={trainer.precision!r}: its GradScaler belongs to "
                "Lightning's own backward and optimizer step, which the engine's micro-batches do not go through; "
                "use precision='bf16-mixed' (or 32)"
            )
        optimizer = self.optimizers()
        if isinstance(optimizer, list):
            raise ValueError("ResilientModule steps one optimizer; configure_optimizers returned "
                             f"{len(optimizer)}")
        options = dict(self.engine_options)
        if "amp" in options:
            raise ValueError("engine_options may not set amp: set the Trainer's precision ('bf16-mixed') instead")
        world = trainer.world_size
        global_ = self.batchpilot_global_batch_size or batch_size_of(batch, BatchLayout.of(
            options.get("shared"), options.get("split_fn"))) * world
        start = self.batchpilot_start
        if start is None and self._batchpilot_state is None:
            # the engine's finder options: config.find, with the engine's target= (the engine refuses a clash)
            config = options.get("config")
            find = config.find if config is not None else FindOptions()
            if options.get("target") is not None:
                find = FindOptions.build(find, target=options["target"])
            try:
                start = _search_batch_size(
                    trainer, self, batch, SizingOptions(find=find), limit=global_ // world,
                    layout=BatchLayout.of(options.get("shared"), options.get("split_fn")),
                )
            except NothingFitsError as exc:
                raise NothingFitsException.of(exc, "ResilientModule") from None
        # the LightningOptimizer: its step() counts global_step and runs the callbacks' hooks
        engine = Engine(self, optimizer, lambda model, mb: model.compute_loss(mb), global_batch_size=global_,
                        start=start if self._batchpilot_state is None else None, **options)
        if self._batchpilot_state is not None:
            engine.load_state_dict(self._batchpilot_state)
            self._batchpilot_state = None
        self.batchpilot_engine = engine
        logger.info("ResilientModule: %s", engine.describe())
        return engine

    def _batchpilot_step_schedulers(self, interval: str) -> None:
        trainer = self.trainer
        for config in trainer.lr_scheduler_configs:
            if config.interval != interval:
                continue
            if config.reduce_on_plateau:
                raise ValueError("ResilientModule does not step ReduceLROnPlateau (it needs a monitored metric); "
                                 "step it yourself in on_validation_epoch_end")
            count = trainer.global_step if interval == "step" else trainer.current_epoch + 1
            if count % config.frequency == 0:
                config.scheduler.step()


# ---------------------------------------------------------------------------
# the search


def _search_batch_size(
    trainer: pl.Trainer, pl_module: pl.LightningModule, example: Any, options: SizingOptions, *,
    limit: int | None = None, layout: BatchLayout | None = None,
) -> BatchPlan:
    """batchpilot's finder on every rank, on real training steps of the module; all state put back.

    A trial step moves the batch with the module's transfer hooks, runs ``training_step`` (or a
    :class:`ResilientModule`'s ``compute_loss``) under the precision plugin's autocast with
    ``self.log`` silenced, then ``backward`` and each optimizer's ``step``. It calls the module
    itself, never the DDP wrapper (whose hooks would all-reduce while other ranks run other
    trials); ranks agree once, on the smallest answer, after all searches ended.

    Raises:
        batchpilot.policy.search.NothingFitsError: not even one sample fits on some rank.
    """
    optimizers = list(trainer.optimizers)  # the raw torch optimizers: their state is what a snapshot restores
    if not optimizers:
        raise ValueError("the module has no optimizer at fit start: configure_optimizers must return one")
    make = make_batch_fn(example, layout)
    strategy = trainer.strategy
    run = _trial_loss(pl_module)
    manual = run is None

    def step(b: int) -> None:
        batch = strategy.batch_to_device(make(b))
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        with strategy.precision_plugin.train_step_context(), _silenced(pl_module):
            if manual:  # a manual-optimization module does its own backward and step (one process)
                _call_training_step(pl_module, batch)
                return
            out = run(batch)
        loss, count, kind = parse_loss(out)
        if kind == "sum":
            loss = loss / (count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1))
        loss.backward()
        for opt in optimizers:
            opt.step()

    return find_batch_size_distributed(step, restore=(pl_module, *optimizers), device=strategy.root_device,
                                       options=options.finder_options(limit))


def _trial_loss(pl_module: pl.LightningModule) -> Any:
    """The loss of a trial batch: ``compute_loss``, ``training_step``'s loss, or ``None`` (manual)."""
    if isinstance(pl_module, ResilientModule):
        return pl_module.compute_loss
    if not pl_module.automatic_optimization:
        return None

    def loss(batch: Any) -> Any:
        out = _call_training_step(pl_module, batch)
        if isinstance(out, dict):
            out = out.get("loss")
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                "training_step returned no loss on the first training batch, so a trial cannot run; "
                "return the loss (or a dict with 'loss') for every batch"
            )
        return out

    return loss


def _call_training_step(pl_module: pl.LightningModule, batch: Any) -> Any:
    # as Lightning does: batch_idx only when training_step takes it
    params = inspect.signature(pl_module.training_step).parameters
    return pl_module.training_step(batch, 0) if len(params) >= 2 else pl_module.training_step(batch)


@contextlib.contextmanager
def _silenced(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` does nothing during trials: they are not training steps."""
    pl_module.log = lambda *a, **k: None  # type: ignore[method-assign]
    pl_module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict


# ---------------------------------------------------------------------------
# the Trainer's pieces (Lightning 2.x internals, kept here)


def _check_strategy(trainer: pl.Trainer) -> None:
    if not isinstance(trainer.strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise ValueError(
            f"batchpilot's Lightning integration runs with a single device or DDP, not {type(trainer.strategy).__name__}: "
            "FSDP and DeepSpeed shard the gradients and optimizer state, which the trials and the engine do not"
        )


def _has_accumulation_scheduler(trainer: pl.Trainer) -> bool:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    return any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks)


def _train_loader(trainer: pl.Trainer) -> Any:
    """The training dataloader as the fit loop will use it (distributed sampler included)."""
    trainer.fit_loop.setup_data()
    loader = trainer.train_dataloader
    if loader is None:
        raise ValueError("no training dataloader at fit start: return one from train_dataloader()")
    if isinstance(loader, (list, tuple, dict)):
        raise ValueError("BatchSizeCallback sizes one training dataloader; this module has several")
    return loader


def _dataset_limit(loader: Any, world: int) -> int | None:
    """Samples one rank sees per epoch, when the dataset has a length: no batch need be larger."""
    dataset = getattr(loader, "dataset", None)
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    return max(1, -(-n // max(world, 1)))


def _reload_dataloaders(trainer: pl.Trainer) -> None:
    """The fit loop rebuilds its dataloaders (with the new batch size) when it starts."""
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def _rescale_optimizers(trainer: pl.Trainer, base: int, global_: int, rule: str) -> tuple[float, list[float]]:
    """Rescale every optimizer (and the schedulers driving it) from ``base`` to ``global_``."""
    factor = 1.0
    lrs: list[float] = []
    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
    for opt in trainer.optimizers:
        if global_ != base and rule != "none":
            sched = [s for s in schedulers if getattr(s, "optimizer", None) is opt]
            factor = rescale_lr(opt, base, global_, rule=rule, scheduler=sched[0] if sched else None)
            for extra in sched[1:]:
                extra.base_lrs = [lr * factor for lr in extra.base_lrs]
        lrs += [float(g["lr"]) for g in opt.param_groups]
    return factor, lrs
