"""The main job: train a real model on the bundled digits with every batchpilot piece switched on.

1. The engine (:class:`batchpilot.train.engine.Engine`) sizes its first micro-batch with the
   finder on the first batch, holds the global batch fixed, splits it into
   micro-batches, recovers from OOMs and grows the micro-batch back.
2. The finder's plan (``engine.plan``) goes into the run log.
3. The learning rate is scaled from ``lr_base`` at ``lr_base_size`` by rule
   (:func:`batchpilot.train.batching.scale_lr`); a cosine schedule decays it per step.
4. An elastic batch sampler (:class:`batchpilot.train.data.ElasticBatchSampler`) deals the epochs.
5. On CPU the device is an emulated one of ``capacity`` bytes (``emulate_capacity``: a real
   ``torch.OutOfMemoryError`` past it); on CUDA ``capacity`` caps the memory fraction.
   A *squeeze* lowers the capacity for a window of steps, as another job grabbing memory
   would: the engine runs out of memory, shrinks, and grows back when the memory returns.
6. The engine measures the gradient noise scale (:mod:`batchpilot.train.noise`, with the
   finite-population correction for the training split), and a batch schedule
   (:mod:`batchpilot.policy.schedule`) may move the global batch; the sampler follows it.

The run log is a plain dict (schema: :mod:`batchpilot.app.report`), written with the plot to
``out`` when given. Nothing here prints; progress goes to a tqdm bar on stderr.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..core.amp import AMP_MODES, amp_dtype, autocast
from ..core.loss import supervised_loss
from ..find.options import FindOptions, option_default
from ..memory.oom import is_oom
from ..memory.probes import emulate_capacity, get_probe, track_peak
from ..memory.units import format_bytes, parse_bytes, resolve_device
from ..policy.schedule import BatchSchedule, ConstantSchedule, LR_SCALE_RULES, parse_schedule
from ..policy.search import STRATEGIES, check_target
from ..train.batching import is_adaptive, scale_lr
from ..train.data import ElasticBatchSampler
from ..train.engine import Engine, EngineConfig, StepResult
from ..train.noise import NOISE_MODES, NoiseConfig
from . import report
from .datasets import DigitsSplit, load_digits
from .models import MLP, SmallCNN

__all__ = [
    "TrainConfig", "TrainResult", "JobError", "run_training", "call_model_factory", "check_model", "make_optimizer",
    "DEFAULT_CPU_CAPACITY", "OPTIMIZERS",
]

logger = logging.getLogger(__name__)

#: The emulated CPU device of the default run: the default CNN's finder answer is below the
#: default global batch (so the engine accumulates), and the default squeeze to half of it
#: forces an OOM mid-run.
DEFAULT_CPU_CAPACITY = 2 * 1024**2

OPTIMIZERS = ("sgd", "adam", "adamw")
_SCHEDULES = ("cosine", "none")
#: ``noise``: ``auto`` (``every`` under a schedule that follows the noise scale, else ``first``),
#: the engine's measurement mode, or ``off``.
NOISE_CHOICES = ("auto", *NOISE_MODES, "off")


class JobError(ValueError):
    """The configuration does not suit the data or the device; the message says what to change."""


@dataclass(kw_only=True)
class TrainConfig:
    """Everything the main job can be told; the defaults are the documented demo run.

    Attributes:
        model: ``"cnn"`` (SmallCNN on 1×8×8 images), ``"mlp"`` (on 64 flat features), or a
            model factory object (called with the ``num_classes`` / ``input_shape`` keywords
            its signature accepts; it sees flat features unless ``image_inputs``).
        image_inputs: feed a factory model ``1×8×8`` images instead of 64 features.
        epochs: passes over the training split.
        batch_size: the global batch: samples per optimizer step, held fixed (with a batch
            schedule: the batch the LR is tuned for, the ramp's final batch, adaptive's maximum).
        batch_schedule: ``constant``, ``ramp:START,INCR,SAMPLES`` or ``adaptive[:k=K,min=N,...]``
            (:func:`batchpilot.policy.schedule.parse_schedule`); the LR follows by ``lr_base_scale``.
        noise: how the engine measures the gradient noise scale: ``auto`` (``every`` under the
            adaptive schedule, else ``first``), ``first``, ``every`` or ``off``.
        scale_weight_decay: at each batch change rescale weight decay too, keeping AdamW's
            timescale ``B / (lr × wd × N)`` (Bergsma et al. 2025).
        grad_accum_steps: start at ``ceil(batch_size / grad_accum_steps)`` per micro-batch
            instead of asking the finder; the engine still adapts.
        optimizer: ``sgd`` (momentum 0.9), ``adam`` or ``adamw``.
        lr_base, lr_base_size, lr_base_scale: the LR is ``lr_base`` tuned for a global batch of
            ``lr_base_size``, scaled to ``batch_size`` by rule (``auto``: sqrt for Adam, linear
            for SGD).
        weight_decay: decoupled for AdamW, L2 otherwise.
        sched: ``cosine`` (decay to zero over the run, per step) or ``none``.
        clip_grad: clip the gradient norm to this; ``None`` for no clipping.
        amp: ``None``, ``"bf16"`` or ``"fp16"``.
        device: ``"cpu"``, ``"cuda"``, ...; ``None`` for the accelerator if there is one.
        target: fraction of the capacity the finder and the engine aim for.
        capacity: bytes or a size string (``"2MiB"``); ``"auto"``: :data:`DEFAULT_CPU_CAPACITY` on
            CPU and the whole device elsewhere; ``None``: the whole device.
        strategy: the finder's strategy.
        grow_after: clean steps before the engine tries a larger micro-batch.
        squeeze_at: the step (1-based) at which the capacity drops; ``None`` for no squeeze,
            ``"auto"`` for a third of the way into the run (only with a capacity).
        squeeze_steps: steps the squeeze lasts; ``None`` for a third of the run.
        squeeze_capacity: the capacity during the squeeze; ``None`` for half of ``capacity``.
        held_out: fraction of the digits kept for the accuracy.
        seed: seeds the split, the model, the shuffling.
        out: directory for ``run.json`` and ``run.png``; ``None`` writes nothing.
        plot: write ``run.png`` to ``out``.
        progress: show a tqdm bar on stderr.

    Raises:
        ValueError: a value out of range, with the option to fix.
    """

    model: str | Callable[..., nn.Module] = "cnn"
    image_inputs: bool = False
    epochs: int = 10
    batch_size: int = 128
    batch_schedule: str = "constant"
    noise: str = "auto"
    scale_weight_decay: bool = False
    grad_accum_steps: int | None = None
    optimizer: str = "adamw"
    lr_base: float = 0.01
    lr_base_size: int = 256
    lr_base_scale: str = "auto"
    weight_decay: float = 0.05
    sched: str = "cosine"
    clip_grad: float | None = None
    amp: str | None = None
    device: str | None = None
    # the finder's defaults, read from their one home
    target: float = option_default("target")
    capacity: int | str | None = "auto"
    strategy: str = option_default("strategy")
    grow_after: int = 10
    squeeze_at: int | str | None = "auto"
    squeeze_steps: int | None = None
    squeeze_capacity: int | str | None = None
    held_out: float = 0.2
    seed: int = 0
    out: Path | str | None = None
    plot: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "lr_base_size", "grow_after"):
            _positive(name, getattr(self, name))
        for name in ("grad_accum_steps", "squeeze_steps"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.grad_accum_steps is not None and self.grad_accum_steps > self.batch_size:
            raise ValueError(f"grad_accum_steps {self.grad_accum_steps} exceeds the global batch {self.batch_size}")
        if isinstance(self.model, str) and self.model not in ("cnn", "mlp"):
            raise ValueError(f"model must be 'cnn', 'mlp' or a factory, got {self.model!r}")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_base_scale", self.lr_base_scale, LR_SCALE_RULES)
        _choice("sched", self.sched, _SCHEDULES)
        _choice("noise", self.noise, NOISE_CHOICES)
        # parses batch_schedule and checks its bounds: a typo fails here, before any work
        self.schedule().initial(self.batch_size, 1)
        if self.noise == "off" and self.schedule().reads_noise:
            raise ValueError(f"batch_schedule {self.batch_schedule!r} follows the gradient noise scale; "
                             "it needs noise 'auto', 'first' or 'every', not 'off'")
        _choice("strategy", self.strategy, tuple(STRATEGIES))
        if self.amp is not None:
            _choice("amp", self.amp, AMP_MODES)
        if not (math.isfinite(self.lr_base) and self.lr_base > 0):
            raise ValueError(f"lr_base must be a finite number above 0, got {self.lr_base}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be 0 or more, got {self.weight_decay}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ValueError(f"clip_grad must be a positive max norm, got {self.clip_grad}")
        # the finder's check, and the engine's bound: it counts a peak above its high-water mark as
        # pressure, so a target at or above it would shrink every grown micro-batch again
        check_target(self.target, below=EngineConfig.high_water, bound="the engine's high-water mark",
                     reason="for training: the engine aims its grown micro-batches at the target too")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out must be a fraction in (0, 1), got {self.held_out}")
        if self.capacity not in (None, "auto"):
            self.capacity = parse_bytes(self.capacity)
        if self.squeeze_capacity is not None:
            self.squeeze_capacity = parse_bytes(self.squeeze_capacity)
        if isinstance(self.squeeze_at, str) and self.squeeze_at != "auto":
            raise ValueError(f"squeeze_at must be a step number, 'auto' or None, got {self.squeeze_at!r}")
        if isinstance(self.squeeze_at, int):
            _positive("squeeze_at", self.squeeze_at)
        if isinstance(self.capacity, int) and isinstance(self.squeeze_capacity, int) and self.squeeze_capacity >= self.capacity:
            raise ValueError(
                f"squeeze_capacity {format_bytes(self.squeeze_capacity)} must be below capacity "
                f"{format_bytes(self.capacity)}: a squeeze takes memory away"
            )

    def schedule(self) -> BatchSchedule:
        """``batch_schedule`` parsed, with the LR rule of ``lr_base_scale``.

        Raises:
            ValueError: the spec does not parse; the message lists the accepted spellings.
        """
        return parse_schedule(self.batch_schedule, lr_rule=self.lr_base_scale,
                              scale_weight_decay=self.scale_weight_decay)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-ready values (a factory is named by its qualified name)."""
        d = asdict(self)
        if callable(self.model):
            d["model"] = f"{getattr(self.model, '__module__', '?')}:{getattr(self.model, '__qualname__', '?')}"
        d["out"] = None if self.out is None else str(self.out)
        return d


@dataclass(kw_only=True)
class TrainResult:
    """The run log (a JSON-ready dict) and the files written."""

    log: dict[str, Any]
    json_path: Path | None = None
    plot_path: Path | None = None


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number, got {value!r}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


# ---------------------------------------------------------------------------
# Building blocks


def call_model_factory(factory: Callable[..., nn.Module], **offered: Any) -> nn.Module:
    """Call a user's model factory with the keyword arguments of ``offered`` its signature takes.

    A factory with ``**kwargs`` gets all of them.

    Raises:
        JobError: the factory raised, or returned something other than an ``nn.Module``.
    """
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some C callables have no signature: offer nothing
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    name = getattr(factory, "__qualname__", repr(factory))
    called = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    try:
        model = factory(**kwargs)
    except Exception as exc:  # the user's code: say what failed, not where inside batchpilot
        raise JobError(f"the model factory {name}({called}) raised {_one_line(exc)}; fix the factory "
                       "or the options it is given") from exc
    if not isinstance(model, nn.Module):
        raise JobError(f"the model factory {name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_model(model: nn.Module, inputs: torch.Tensor, *, num_classes: int, amp: str | None = None,
                hint: str) -> None:
    """Run one forward on a small batch before any search, and check it gives class scores.

    A model that cannot take the inputs fails here in one sentence instead of deep inside a
    search, and one with too few outputs here instead of as an out-of-range target (a
    device-side assert on CUDA). The forward runs in eval mode under ``no_grad`` so that it
    changes nothing (BatchNorm statistics, the RNG through dropout); the inputs go to the
    model's device (a ``meta`` model checks shapes only). An out-of-memory error is left to
    the search.

    Raises:
        JobError: the forward raised, or did not return ``(batch, >= num_classes)`` scores;
            the message names the input shape, the problem and ``hint`` (what to check).
    """
    first = next(model.parameters(), None)
    first = first if first is not None else next(model.buffers(), None)
    device = first.device if first is not None else torch.device("cpu")
    x = inputs.to(device)
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), autocast(device.type, amp_dtype(amp)):
            out = model(x)
    except Exception as exc:
        if is_oom(exc):
            return
        raise JobError(f"the model failed on a batch of input shape {tuple(x.shape)}: {_one_line(exc)}; "
                       f"{hint}") from exc
    finally:
        for m, training in flags:
            m.training = training
    if not (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == len(x)
            and out.shape[1] >= num_classes):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise JobError(f"the model returned {got} for a batch of input shape {tuple(x.shape)}; cross-entropy "
                       f"over {num_classes} classes needs ({len(x)}, {num_classes}) scores; {hint}")


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, cut to a readable length."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def _build_model(config: TrainConfig, split: DigitsSplit) -> nn.Module:
    if config.model == "cnn":
        return SmallCNN(in_channels=1, num_classes=split.num_classes)
    if config.model == "mlp":
        return MLP(in_features=split.sample_shape[0], num_classes=split.num_classes)
    return call_model_factory(config.model, num_classes=split.num_classes, input_shape=split.sample_shape)


_OPTIMIZER_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def make_optimizer(name: str, params: Any, *, lr: float, weight_decay: float = 0.0,
                   momentum: float = 0.9) -> torch.optim.Optimizer:
    """``sgd`` (with ``momentum``), ``adam`` or ``adamw`` over ``params``.

    Raises:
        ValueError: unknown name.
    """
    _choice("optimizer", name, OPTIMIZERS)
    extra = {"momentum": momentum} if name == "sgd" else {}
    return _OPTIMIZER_CLASSES[name](params, lr=lr, weight_decay=weight_decay, **extra)


def _resolve_capacity(config: TrainConfig, device: torch.device) -> int | None:
    if config.capacity == "auto":
        return DEFAULT_CPU_CAPACITY if device.type == "cpu" else None
    return config.capacity  # type: ignore[return-value]


@dataclass(kw_only=True)
class _Squeeze:
    start: int  # first squeezed step, 1-based (or, by_samples, samples trained before it)
    stop: int  # first step after the squeeze (or samples)
    capacity: int
    by_samples: bool = False

    def position(self, step: int, samples_before: int) -> int:
        return samples_before if self.by_samples else step


def _resolve_squeeze(config: TrainConfig, capacity: int | None, total_steps: int,
                     total_samples: int | None = None) -> _Squeeze | None:
    """The squeeze window; under a batch schedule (``total_samples`` given) "auto" is the middle third of the samples."""
    if config.squeeze_at is None or capacity is None:
        return None
    squeezed = config.squeeze_capacity if config.squeeze_capacity is not None else capacity // 2
    if squeezed >= capacity:
        raise JobError(
            f"squeeze_capacity {format_bytes(squeezed)} must be below the capacity {format_bytes(capacity)}"
        )
    if total_samples is not None and config.squeeze_at == "auto":
        # the number of steps depends on the schedule: from a third of the samples, for a third
        # of them (or squeeze_steps batches of batch_size)
        length = total_samples // 3 if config.squeeze_steps is None else config.squeeze_steps * config.batch_size
        return _Squeeze(start=total_samples // 3, stop=total_samples // 3 + length, capacity=int(squeezed),
                        by_samples=True)
    start = max(2, total_steps // 3 + 1) if config.squeeze_at == "auto" else int(config.squeeze_at)
    steps = config.squeeze_steps if config.squeeze_steps is not None else max(1, total_steps // 3)
    if start > total_steps and total_samples is None:
        logger.warning("squeeze_at %d is after the last step (%d): no squeeze", start, total_steps)
        return None
    return _Squeeze(start=start, stop=start + steps, capacity=int(squeezed))


@torch.no_grad()
def _accuracy(model: nn.Module, split: DigitsSplit, device: torch.device, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, split.num_test, batch_size):
        x, y = split.batch(range(start, min(start + batch_size, split.num_test)), held_out=True)
        correct += int((model(x.to(device)).argmax(dim=1) == y.to(device)).sum())
    model.train(was_training)
    return correct / split.num_test


def _step_record(step: int, epoch: int, res: StepResult, capacity: int | None, lr: float) -> dict[str, Any]:
    return {
        "step": step,
        "epoch": epoch,
        "loss": res.loss,
        "micro_batch_size": res.micro_batch_size,
        "accum_steps": res.accum_steps,
        "ooms": res.ooms,
        "peak_bytes": res.peak_bytes,
        "capacity_bytes": capacity,
        "seconds": res.seconds,
        "micro_batch_reason": res.micro_batch_reason,
        "global_batch_size": res.global_batch_size,
        "lr": lr,
        "noise_scale": res.noise_scale,
        "noise": None if res.noise is None else res.noise.to_dict(),
        "length": res.length,
        "micro_batch_sizes": list(res.micro_batch_sizes),
        "micro_batch_lengths": list(res.micro_batch_lengths),
    }


# ---------------------------------------------------------------------------
# The job


@dataclass(kw_only=True)
class _Run:
    """What the training loop produced."""

    steps: list[dict[str, Any]]
    samples_seen: int


def _train_loop(config: TrainConfig, engine: Engine, split: DigitsSplit, device: torch.device,
                capacity: int | None, squeeze: _Squeeze | None, total_steps: int | None) -> _Run:
    """Every epoch through the elastic sampler, one ``engine.step`` per global batch.

    The sampler follows the engine's batch (a schedule may change it after any step): each
    sample is seen once per epoch whatever the batch sizes, and a short tail is dropped.
    ``total_steps`` is ``None`` under a schedule; the bar then counts samples.
    """
    sampler = ElasticBatchSampler(split.num_train, engine.per_rank_batch_size, shuffle=True, seed=config.seed,
                                  drop_last=True, num_replicas=1, rank=0)
    probe = get_probe(device)
    run = _Run(steps=[], samples_seen=0)
    by_samples = total_steps is None
    bar = report.progress(total=config.epochs * split.num_train if by_samples else total_steps, desc="train",
                          enabled=config.progress, unit="sample" if by_samples else "step")
    squeeze_scope = contextlib.ExitStack()
    squeezed = False
    step = 0
    try:
        for epoch in range(config.epochs):
            sampler.set_epoch(epoch)
            for indices in sampler:
                step += 1
                at = 0 if squeeze is None else squeeze.position(step, run.samples_seen)
                if squeeze is not None and not squeezed and squeeze.start <= at < squeeze.stop:
                    logger.info("step %d: capacity squeezed to %s", step, format_bytes(squeeze.capacity))
                    squeeze_scope.enter_context(emulate_capacity(squeeze.capacity, device))
                    squeezed = True
                elif squeezed and at >= squeeze.stop:
                    logger.info("step %d: capacity back to %s", step, format_bytes(capacity or 0))
                    squeeze_scope.close()
                    squeezed = False
                lr = engine.optimizer.param_groups[0]["lr"]
                res = engine.step(split.batch(indices))
                sampler.mark_consumed()
                sampler.set_batch_size(engine.per_rank_batch_size)
                run.samples_seen += res.samples
                record = _step_record(step, epoch, res, probe.capacity() if capacity is not None else None, float(lr))
                run.steps.append(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", batch=res.global_batch_size, micro=res.micro_batch_size,
                                accum=res.accum_steps, peak=format_bytes(res.peak_bytes), refresh=False)
                bar.update(res.samples if by_samples else 1)
    finally:
        squeeze_scope.close()
        bar.close()
    return run


def _write_outputs(config: TrainConfig, log: dict[str, Any]) -> TrainResult:
    result = TrainResult(log=log)
    if config.out is None:
        return result
    out = Path(config.out)
    result.json_path = report.write_json(log, out / "run.json")
    if config.plot:
        title = (f"batchpilot train: {log['config']['model']} on digits, global batch {config.batch_size}, "
                 f"held-out accuracy {log['accuracy']:.1%}")
        result.plot_path = report.save_run_plot(log["plan"], log["steps"], out / "run.png", title=title)
    return result


def run_training(config: TrainConfig) -> TrainResult:
    """Train, evaluate, and write ``run.json`` / ``run.png`` to ``config.out`` if set.

    Raises:
        batchpilot.policy.search.NothingFitsError: the finder found no batch that fits.
        batchpilot.train.engine.BatchDoesNotFitError: even a micro-batch of 1 ran out of memory.
        JobError: a global batch larger than the training split, a squeeze that does not
            take memory away, or a model factory that returns no module.
        ValueError: a batch schedule whose batches do not fit its bounds.
    """
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    image = config.model == "cnn" or (callable(config.model) and config.image_inputs)
    split = load_digits(held_out=config.held_out, seed=config.seed, layout="image" if image else "flat")
    steps_per_epoch = split.num_train // config.batch_size
    if steps_per_epoch == 0:
        raise JobError(
            f"batch_size {config.batch_size} is larger than the {split.num_train} training samples; lower it"
        )
    schedule = config.schedule()
    scheduled = not isinstance(schedule, ConstantSchedule)
    # under a schedule the number of steps is not known up front: the run is epochs of samples
    total_steps = None if scheduled else steps_per_epoch * config.epochs
    total_samples = config.epochs * split.num_train
    device = resolve_device(config.device)
    model = _build_model(config, split).to(device)
    inputs, other = ("1x8x8 images", "64 features without") if image else ("64 features", "1x8x8 images with")
    check_model(model, split.batch([0, 1])[0], num_classes=split.num_classes, amp=config.amp, hint=(
        f"the digits are {inputs} in {split.num_classes} classes ({other} --image-inputs): make the model take them"
    ))
    opt_class = _OPTIMIZER_CLASSES[config.optimizer]
    lr = scale_lr(config.lr_base, config.batch_size, config.lr_base_size, config.lr_base_scale, optimizer=opt_class)
    rule = config.lr_base_scale
    if rule == "auto":
        rule = "sqrt" if is_adaptive(opt_class) else "linear"
    optimizer = make_optimizer(config.optimizer, model.parameters(), lr=lr, weight_decay=config.weight_decay)
    holder: dict[str, Engine] = {}
    scheduler = None
    if config.sched == "cosine" and not scheduled:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    elif config.sched == "cosine":
        def cosine(_: int) -> float:
            # over samples, not steps; the engine steps the scheduler after the optimizer and
            # before counting the batch, so the samples done are its count plus this batch
            engine = holder.get("engine")
            done = 0 if engine is None else engine.samples_seen + engine.global_batch_size
            return 0.5 * (1 + math.cos(math.pi * min(1.0, done / total_samples)))

        # LambdaLR scales base_lrs, which the engine's LR rescaling moves at each batch change
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    capacity = _resolve_capacity(config, device)
    squeeze = _resolve_squeeze(config, capacity, total_steps or 0, total_samples if scheduled else None)
    # auto: the engine's choice for its schedule (every under one that follows the noise scale)
    mode = None if config.noise == "auto" else config.noise
    noise = False if config.noise == "off" else NoiseConfig(mode=mode, dataset_size=split.num_train)
    # None: the engine runs the finder on the first batch; an int skips it
    start = None if config.grad_accum_steps is None else -(-config.batch_size // config.grad_accum_steps)
    with contextlib.ExitStack() as device_scope:
        if capacity is not None:
            device_scope.enter_context(emulate_capacity(capacity, device, track=(model, optimizer)))
        elif device.type == "cpu":
            # without a capacity, a storage tracker still makes the CPU's memory figures exact
            device_scope.enter_context(track_peak(device, track=(model, optimizer)))
        engine = Engine(
            model, optimizer, supervised_loss(nn.CrossEntropyLoss()), global_batch_size=config.batch_size,
            micro_batch_size="auto", start=start, device=device, amp=config.amp, grad_clip=config.clip_grad,
            target=config.target, scheduler=scheduler,
            # the capacity goes to the finder only: as EngineConfig.capacity it would pin the
            # engine's limit, and the engine must see the squeeze through the probe
            config=EngineConfig(
                grow_after=config.grow_after,
                find=FindOptions(capacity=capacity, strategy=config.strategy, progress=config.progress),
            ),
            noise=noise, schedule=schedule if scheduled else None,
        )
        holder["engine"] = engine
        run = _train_loop(config, engine, split, device, capacity, squeeze, total_steps)
    accuracy = _accuracy(model, split, device, config.batch_size)
    log = {
        "schema_version": report.SCHEMA_VERSION,
        "command": "train",
        "config": config.to_dict(),
        "dataset": {
            "name": "sklearn-digits",
            "num_train": split.num_train,
            "num_held_out": split.num_test,
            "num_classes": split.num_classes,
            "sample_shape": list(split.sample_shape),
        },
        "device": str(device),
        "plan": None if engine.plan is None else report.plan_record(engine.plan),
        "split": None if engine.split is None else engine.split.to_dict(),
        "lr": {"base": config.lr_base, "base_size": config.lr_base_size, "rule": rule, "scaled": lr},
        "steps": run.steps,
        "micro_batch_changes": report.micro_batch_changes(run.steps),
        "schedule": {"spec": schedule.describe(), "lr_rule": rule, "scale_weight_decay": config.scale_weight_decay},
        "batch_changes": report.batch_changes(run.steps),
        "noise_scale": engine.noise_scale,
        "accuracy": accuracy,
        "samples_seen": run.samples_seen,
        "optimizer_steps": len(run.steps),
        "total_ooms": sum(s["ooms"] for s in run.steps),
        "seconds": time.perf_counter() - t0,
    }
    return _write_outputs(config, log)
