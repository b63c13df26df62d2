"""Hugging Face ``Trainer``: size the batch before the Trainer is built; train and evaluate through OOMs.

- :func:`configure_batch_size` runs batchpilot's finder on the model with the optimizer the
  ``Trainer`` will build (on every rank under ``torchrun``, agreeing on the smallest answer) and
  sets ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` of the
  ``TrainingArguments`` for a global batch, rescaling ``learning_rate`` by rule when the global
  batch is not the one it was tuned for.
- :class:`ResilientTrainer` (or :class:`ResilientTrainerMixin` for another ``Trainer`` subclass)
  takes each optimizer step's whole per-device batch in one ``training_step`` and runs it through
  :class:`batchpilot.Engine`: an OOM drops the partial gradients and re-splits the same batch into
  smaller micro-batches. No loop restart: ``global_step``, the LR schedule and the data order are
  those of the run without the OOM. An OOM during evaluation shrinks the evaluation batch only.
- :func:`continuous_batching_config` (from :mod:`batchpilot.integrations.continuous`) sizes the paged
  KV cache of ``model.generate_batch`` for the memory limit that binds the process, verified by a
  real run in it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..core.batch import BatchLayout, SplitFn, batch_size_of
from ..dist.distributed import find_batch_size_distributed
from ..dist.front import find_batch_size_for
from ..find.options import FindOptions
from ..memory.oom import attempt, free_memory
from ..policy.microbatch import accum_steps, balanced_sizes
from ..train.batching import scale_lr
from ..train.engine import Engine, EngineConfig, StepResult
from ._common import BatchSetup, DeferredOptimizer, SizingOptions, choose_batches, lr_rule_for, require_installed

# before .continuous, which needs transformers too: the message names the module the user imported.
# Checked, not imported: the Trainer stack (accelerate, datasets, scipy, ... some 2,000 modules and
# over a GiB of address space) is loaded by what uses it -- configure_batch_size and ResilientTrainer
# -- and not by continuous_batching_config, which a process sized tight calls.
require_installed("transformers", "batchpilot.integrations.transformers")

from .continuous import ContinuousBatchingPlan, continuous_batching_config, size_continuous_batching  # noqa: E402

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

__all__ = [
    "configure_batch_size", "ResilientTrainerMixin", "ResilientTrainer", "hf_loss",
    "continuous_batching_config", "size_continuous_batching", "ContinuousBatchingPlan",
]

logger = logging.getLogger(__name__)


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a Hugging Face model returns for a batch with labels: ``model(**batch).loss``.

    Raises:
        ValueError: the model returned no loss (no ``labels`` in the batch?).
    """
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "the model returned no loss for the example batch: give it labels (the collator's 'labels' key), "
            "or pass loss_fn(model, batch) returning the loss"
        )
    return loss


def configure_batch_size(
    args: TrainingArguments,
    model: nn.Module,
    data: Any,
    *,
    global_batch_size: int | None = None,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    data_collator: Callable[[list], Any] | None = None,
    lr_base_size: int | None = None,
    lr_rule: str = "none",
    options: FindOptions | None = None,
    shared: str | list[str] | None = None,
    split_fn: SplitFn | None = None,
    **overrides: Any,
) -> BatchSetup:
    """Size ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` before the Trainer is built.

    Trials are real training steps of ``model`` on ``args.device`` with the optimizer the
    ``Trainer`` would create (``Trainer.get_optimizer_cls_and_kwargs(args)``, built for the search
    and dropped after it) under the mixed precision ``args`` asks for; the model comes back
    unchanged. Under ``torchrun`` every rank searches on its own device and all take the smallest
    answer. With ``global_batch_size`` the per-device batch is the largest divisor of
    ``global / world`` that fits, and ``gradient_accumulation_steps`` makes up the rest; without it
    the per-device batch is the largest that fits and the accumulation is kept. By default only
    the batch sizes change, as with the Trainer's own ``auto_find_batch_size``; with ``lr_rule``
    (``"auto"``, ``"linear"``, ``"sqrt"``) ``args.learning_rate`` is rescaled when the global
    batch (``per_device × world × accumulation``) is not ``lr_base_size``. ``args`` is changed
    in place, and the setup is also left on ``args.batchpilot_setup``: a :class:`ResilientTrainer`
    built on these ``args`` starts its micro-batches at the finder's answer rather than at the
    divisor a plain ``Trainer`` needs (its engine cuts a smaller last micro-batch, so it need not
    divide the batch).

    Args:
        args: the ``TrainingArguments`` to fill in.
        model: the model, on any device (it is moved to ``args.device``, as the Trainer would).
        data: an example batch (a dict of tensors, as the collator gives; its samples are repeated
            to any size), a function ``batch_size -> batch``, or a dataset (its first samples are
            collated by ``data_collator`` at each trial's size, so padding is as in training).
        global_batch_size: samples per optimizer step over all ranks to hold fixed.
        loss_fn: ``loss_fn(model, batch)``; default :func:`hf_loss` (``model(**batch).loss``).
        data_collator: for a dataset ``data``; default ``transformers.default_data_collator``.
        lr_base_size: the global batch ``args.learning_rate`` was tuned for; default the global
            batch ``args`` describe before sizing.
        lr_rule: ``"none"`` (default: the learning rate is left as configured), ``"auto"`` (sqrt
            for Adam-like optimizers, linear otherwise), ``"linear"`` or ``"sqrt"``.
        options: the finder's options (:class:`batchpilot.FindOptions`); ``max_batch_size`` is
            also capped at the per-rank batch and the dataset's length.
        shared, split_fn: the batch rules of :mod:`batchpilot.core.batch`.
        **overrides: other options: the fields of :class:`batchpilot.FindOptions` (``target``,
            ``capacity``, ``strategy``, ``max_batch_size``, ``steps_per_trial``, ...), each in place
            of ``options``'s value.

    Returns:
        The :class:`~batchpilot.integrations.BatchSetup` written into ``args``.

    Raises:
        ValueError: invalid options (``BatchSizeError`` for a keyword that is no finder option),
            ``auto_find_batch_size`` set, DataParallel over several GPUs in
            one process (use ``torchrun``), DeepSpeed or FSDP (their sharded state is not what the
            trials measure), or a global batch that does not divide by the world size.
        batchpilot.policy.search.NothingFitsError: not even one sample fits (on some rank).
    """
    opts = SizingOptions(global_batch_size=global_batch_size, lr_base_size=lr_base_size, lr_rule=lr_rule,
                         find=FindOptions.build(options, **overrides))
    _check_args(args, "configure_batch_size")
    if args.auto_find_batch_size:
        raise ValueError("configure_batch_size sizes the batch itself: set auto_find_batch_size=False")
    world = args.world_size  # under torchrun this sets up the process group, as the Trainer would
    accum = args.gradient_accumulation_steps
    lr_base = opts.lr_base_size or args.per_device_train_batch_size * world * accum
    device = args.device
    model.to(device)
    from transformers import Trainer

    opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = opt_cls([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
    amp = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    batch, limit = _example(data, data_collator, world)
    per_rank = None if opts.global_batch_size is None else opts.global_batch_size // world
    caps = [c for c in (per_rank, limit) if c is not None]
    try:
        plan = find_batch_size_for(
            model, batch, optimizer=optimizer, loss_fn=loss_fn or hf_loss, amp=amp, scaler=scaler,
            shared=shared, split_fn=split_fn, search=find_batch_size_distributed if world > 1 else None,
            device=device, options=opts.finder_options(min(caps) if caps else None),
        )
    finally:
        del optimizer, scaler
        free_memory(device)
    micro, accum, per_rank, sizes = choose_batches(
        plan.batch_size, world_size=world, global_batch_size=opts.global_batch_size, accum_steps=accum,
        whole_micro_batches=True,
    )
    new_global = per_rank * world
    lr = args.learning_rate
    factor = 1.0
    if new_global != lr_base and opts.lr_rule != "none":
        lr = scale_lr(args.learning_rate, new_global, lr_base_size=lr_base, rule=opts.lr_rule, optimizer=opt_cls)
        factor = lr / args.learning_rate
    args.per_device_train_batch_size = micro
    args.gradient_accumulation_steps = accum
    args.learning_rate = lr
    setup = BatchSetup(
        micro_batch_size=micro, accum_steps=accum, world_size=world, global_batch_size=new_global,
        per_rank_batch_size=per_rank, micro_batch_sizes=sizes, found_batch_size=plan.batch_size,
        limited_by_rank=plan.limited_by_rank, lr_base_size=lr_base, lr_rule=lr_rule_for(opts.lr_rule, opt_cls),
        lr_factor=factor, learning_rates=(lr,), plan=plan,
    )
    # for ResilientTrainerMixin: TrainingArguments hold equal micro-batches only, which cannot say
    # "22 + 22 + 21 for a batch of 65", the fewest that fit, which its engine runs; the found size
    # travels with args, and the log says both
    args.batchpilot_setup = setup
    engine = choose_batches(_first_micro_batch(args), world_size=world, global_batch_size=new_global,
                            accum_steps=1, whole_micro_batches=False)[3]
    logger.info("batchpilot: %s in the TrainingArguments (a Trainer's equal micro-batches); a ResilientTrainer on "
                "them runs %s", setup.describe(), setup.with_micro_batches(engine).describe())
    return setup


def _counted(sizes: list[int]) -> str:
    """Micro-batch sizes as a reader counts them: ``10 x 10``, or ``22 x 15 + 13 x 14``."""
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return " + ".join(f"{n} x {size}" for size, n in sorted(counts.items(), reverse=True))


class ResilientTrainerMixin:
    """A ``Trainer`` mixin whose training and evaluation survive out-of-memory errors.

    Put it before the ``Trainer`` class: ``class MyTrainer(ResilientTrainerMixin, SFTTrainer)``.
    The arguments keep their meaning: the global batch is ``per_device_train_batch_size × world ×
    gradient_accumulation_steps``. The mixin has the dataloader give each optimizer step's
    per-device batch in one piece (``per_device_train_batch_size × gradient_accumulation_steps``
    samples, accumulation 1, on a copy of ``args``), and ``training_step`` runs it through
    :class:`batchpilot.Engine`, starting at micro-batches of the ``per_device_train_batch_size``
    given, or of the finder's answer when :func:`configure_batch_size` sized these ``args`` (its
    ``args.batchpilot_setup``, used while ``per_device_train_batch_size × gradient_accumulation_steps``
    is still the per-rank batch it chose): the fewest micro-batches of at most that size, balanced
    (65 under 32: 22 + 22 + 21; ``TrainingArguments`` can only say equal ones, 13 × 5). Each
    step's are in ``batchpilot_last_step.micro_batch_sizes``, and the engine logs its split. An
    OOM drops the partial gradients, shrinks the micro-batch and reruns the same batch.
    The loss of each micro-batch is the Trainer's own ``compute_loss`` (with ``num_items_in_batch``
    over the whole batch), so the gradients equal those of the run without the OOM. The Trainer's
    loop clips, steps the optimizer and the LR scheduler and counts ``global_step`` as usual.

    An OOM in ``evaluate`` or ``predict`` finds the largest evaluation batch that fits (the finder
    on the first evaluation batch) and evaluates again; ``per_device_train_batch_size`` is not
    touched.

    Args (keyword, besides the Trainer's):
        engine_config: :class:`batchpilot.EngineConfig` (growth, memory pressure).
        shared, split_fn: the batch rules of :mod:`batchpilot.core.batch`.

    Raises:
        ValueError: ``fp16`` (its GradScaler belongs to Accelerate's backward, which the engine's
            micro-batches do not go through: use ``bf16``), ``auto_find_batch_size``, DeepSpeed,
            FSDP, DataParallel over several GPUs in one process, or LOMO optimizers.
    """

    def __init__(self, *args: Any, engine_config: EngineConfig | None = None,
                 shared: str | list[str] | None = None, split_fn: SplitFn | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        targs = self.args
        who = type(self).__name__
        _check_args(targs, who)
        for flag, fix in (("fp16", "use bf16=True (or fp32)"), ("auto_find_batch_size", "remove it")):
            if getattr(targs, flag):
                raise ValueError(f"{who} cannot run with {flag}=True: {fix}")
        if "lomo" in str(targs.optim).lower():
            raise ValueError(f"{who} cannot run LOMO optimizers: they step inside the backward")
        self._batchpilot_micro = _first_micro_batch(targs)
        per_step = targs.per_device_train_batch_size * targs.gradient_accumulation_steps
        runs = _counted(balanced_sizes(per_step, accum_steps(per_step, self._batchpilot_micro)))
        asked = _counted([targs.per_device_train_batch_size] * targs.gradient_accumulation_steps)
        if runs != asked:
            # what the engine runs, said in the arguments' terms: the fewest micro-batches of at most
            # configure_batch_size's answer, balanced, where the arguments can only say equal ones
            logger.info("%s: each per-device batch of %d runs as %s, not the arguments' %s (micro-batches of at "
                        "most %d, configure_batch_size's answer, the fewest that fit)", who, per_step, runs, asked,
                        self._batchpilot_micro)
        # One optimizer step's batch in one piece, on a copy: the caller's arguments are untouched.
        # After the Trainer's own set-up, so that any Trainer subclass's signature is kept.
        merged = copy.copy(targs)
        merged.per_device_train_batch_size = targs.per_device_train_batch_size * targs.gradient_accumulation_steps
        merged.gradient_accumulation_steps = 1
        self.args = merged
        self._train_batch_size = merged.train_batch_size
        self.accelerator.gradient_accumulation_steps = 1
        self._batchpilot_config = engine_config
        self._batchpilot_layout = BatchLayout.of(shared, split_fn)
        self.batchpilot_engine: Engine | None = None
        self.batchpilot_last_step: StepResult | None = None
        self._batchpilot_context: tuple[int, Any] | None = None

    # ------------------------------------------------------------------ training
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        engine = self._batchpilot_engine(model)
        self._batchpilot_context = (batch_size_of(inputs, self._batchpilot_layout), num_items_in_batch)
        try:
            result = engine.step(inputs)
        finally:
            self._batchpilot_context = None
        self.batchpilot_last_step = result
        return result.loss_tensor

    def _batchpilot_engine(self, model: nn.Module) -> Engine:
        engine = self.batchpilot_engine
        if engine is not None and engine.model is model:
            return engine
        per_rank = self.args.per_device_train_batch_size
        start = min(self._batchpilot_micro, per_rank)
        state = None if engine is None else engine.state_dict()
        engine = Engine(model, DeferredOptimizer(self), self._batchpilot_loss, global_batch_size=per_rank * self.args.world_size,
                        start=start, config=self._batchpilot_config,
                        shared=self._batchpilot_layout.shared if self._batchpilot_layout else None,
                        split_fn=self._batchpilot_layout.split_fn if self._batchpilot_layout else None)
        if state is not None:  # the model was re-wrapped (a resumed run): keep the micro-batch
            engine.load_state_dict(state)
        self.batchpilot_engine = engine
        return engine

    def _batchpilot_loss(self, model: nn.Module, micro_batch: Any) -> torch.Tensor:
        """The Trainer's loss for one micro-batch, weighted so that the engine's sum is the batch's loss."""
        n, num_items = self._batchpilot_context
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, micro_batch, num_items_in_batch=num_items)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if self._loss_is_a_share(num_items):
            # already this micro-batch's share of the batch's loss (summed over tokens and divided by
            # num_items_in_batch); the engine weights a mean by size / n, which this undoes
            return loss * (n / batch_size_of(micro_batch, self._batchpilot_layout))
        return loss

    def _loss_is_a_share(self, num_items: Any) -> bool:
        # the Trainer's own test (training_step): normalised over the whole batch, or a mean of this one
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool((self.model_accepts_loss_kwargs and num_items is not None) or self.compute_loss_func is not None)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        if isinstance(eval_dataset if eval_dataset is not None else self.eval_dataset, dict):
            # the Trainer evaluates each dataset through this method
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        return self._batchpilot_eval(lambda: super(ResilientTrainerMixin, self).evaluate(
            eval_dataset, ignore_keys, metric_key_prefix), lambda: self.get_eval_dataloader(eval_dataset))

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> Any:
        return self._batchpilot_eval(lambda: super(ResilientTrainerMixin, self).predict(
            test_dataset, ignore_keys, metric_key_prefix), lambda: self.get_test_dataloader(test_dataset))

    def _batchpilot_eval(self, run: Callable[[], Any], loader: Callable[[], Any]) -> Any:
        while True:
            out = attempt(run, device=self.args.device)
            if out.ok:
                return out.result
            self._shrink_eval_batch(loader, out.message)

    def _shrink_eval_batch(self, loader: Callable[[], Any], message: str) -> None:
        """After an evaluation OOM at batch b: the largest evaluation batch under b that fits."""
        failed = self.args.per_device_eval_batch_size
        if failed <= 1:
            raise torch.OutOfMemoryError(
                f"evaluation runs out of memory at 1 sample per device ({message}); evaluation cannot be made "
                "smaller: free memory (eval_accumulation_steps moves predictions to the CPU) or use a larger device"
            )
        if self.args.world_size > 1:
            logger.warning("evaluation OOM under %d ranks: the other ranks may be waiting in the evaluation loop's "
                           "gather; this rank evaluates again at a smaller batch", self.args.world_size)
        self._drop_eval_loaders()
        example = next(iter(loader()))
        model = self.accelerator.unwrap_model(self.model)
        # the user chose the evaluation batch: shrink it only as far as memory requires, not to the
        # throughput objective's (eval default) smaller, about-as-fast size
        plan = find_batch_size_for(model, example, mode="eval", loss_fn=_forward, max_batch_size=failed - 1,
                                   objective="memory", device=self.args.device, shared=self._batchpilot_layout.shared
                                   if self._batchpilot_layout else None)
        del example
        self._drop_eval_loaders()
        self.args.per_device_eval_batch_size = plan.batch_size
        logger.warning("evaluation ran out of memory at %d samples per device (%s); evaluating again at %d "
                       "(the training batch is unchanged)", failed, message, plan.batch_size)

    def _drop_eval_loaders(self) -> None:
        if hasattr(self, "_eval_dataloaders"):
            self._eval_dataloaders = {}


def _resilient_trainer() -> type:
    """:class:`ResilientTrainer`, defined on first use: subclassing ``Trainer`` imports the Trainer stack."""
    from transformers import Trainer

    class ResilientTrainer(ResilientTrainerMixin, Trainer):
        """``transformers.Trainer`` with :class:`ResilientTrainerMixin`: OOMs in training and evaluation are survived."""

    ResilientTrainer.__module__, ResilientTrainer.__qualname__ = __name__, "ResilientTrainer"  # pickled by name
    return ResilientTrainer


def __getattr__(name: str) -> Any:
    # ``ResilientTrainer`` (module attribute, ``from ... import ResilientTrainer``): made once, then a global
    if name == "ResilientTrainer":
        cls = globals()[name] = _resilient_trainer()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# ---------------------------------------------------------------------------


def _forward(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


def _first_micro_batch(args: TrainingArguments) -> int:
    """The engine's first micro-batch: the finder's answer from :func:`configure_batch_size`, else the arguments'.

    ``configure_batch_size`` writes the largest *divisor* of the per-rank batch that fits, which a
    plain Trainer's equal micro-batches need; the engine cuts balanced micro-batches that need not
    be equal, so it starts at what fits (on a per-rank batch of 65 where 32 fit: 22 + 22 + 21, not
    5 of 13). Arguments
    changed since (another per-rank batch or world size) are the caller's choice and win.
    """
    per_device = args.per_device_train_batch_size
    setup = getattr(args, "batchpilot_setup", None)
    if not isinstance(setup, BatchSetup) or setup.found_batch_size is None:
        return per_device
    if (per_device, setup.per_rank_batch_size, setup.world_size) != (
            setup.micro_batch_size, per_device * args.gradient_accumulation_steps, args.world_size):
        return per_device
    return max(per_device, min(setup.found_batch_size, setup.per_rank_batch_size))


def _check_args(args: TrainingArguments, who: str) -> None:
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError(f"{who} does not run with DeepSpeed or FSDP: their sharded gradients and optimizer state "
                         "are not what the trials measure or the engine accumulates")
    if args.n_gpu > 1:
        raise ValueError(f"{who} does not run DataParallel over {args.n_gpu} GPUs in one process: launch one "
                         "process per GPU with torchrun")


def _example(data: Any, collator: Callable[[list], Any] | None, world: int) -> tuple[Any, int | None]:
    """The finder's batch (an example or ``b -> batch``) and the per-rank dataset length, if known."""
    rows = isinstance(data, list) and bool(data) and isinstance(data[0], Mapping)  # a list of examples
    if isinstance(data, (Mapping, tuple)) or (isinstance(data, list) and not rows) or callable(data):
        return data, None
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise ValueError(f"data must be an example batch, a function batch_size -> batch, or a dataset; got "
                         f"{type(data).__name__}")
    if collator is None:
        from transformers import default_data_collator as collator
    n = len(data)
    if n == 0:
        raise ValueError("the dataset is empty")

    def batch(b: int) -> Any:
        return collator([data[i % n] for i in range(b)])

    return batch, max(1, -(-n // world))
