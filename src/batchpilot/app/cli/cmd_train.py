"""``batchpilot train``: the main job (see :mod:`batchpilot.app.trainjob`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from ...core.amp import AMP_MODES
from ...memory.units import format_bytes
from ...policy.schedule import LR_SCALE_RULES, SCHEDULE_SPECS, parse_schedule
from .. import report
from ..trainjob import DEFAULT_CPU_CAPACITY, NOISE_CHOICES, OPTIMIZERS, TrainConfig, TrainResult, run_training
from .common import (
    UsageError, add_find_options, add_verbose, byte_size, device_or_fail, fraction, non_negative_int,
    positive_float, positive_int,
)
from .workload import load_factory

__all__ = ["add_parser", "run"]


def _capacity(text: str) -> int | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    return byte_size(text)


def _squeeze_at(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def _batch_schedule(text: str) -> str:
    try:
        parse_schedule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="the main job: train a CNN on the bundled digits with every batchpilot piece on",
        description="Train a model on scikit-learn's bundled handwritten digits (1,797 8x8 images, nothing "
                    "downloaded) with everything on: the finder picks the starting micro-batch under the memory "
                    "limit, the engine holds the global batch fixed (accumulating micro-batches, recovering from "
                    "OOM, growing back), the LR is scaled from --lr-base by rule, and on CPU an emulated device "
                    "of --capacity bytes raises real out-of-memory errors; a squeeze halves it for a third of the "
                    "run so the adaptation shows. Prints the held-out accuracy; writes run.json and run.png.",
        epilog="Defaults: a SmallCNN, global batch 128, AdamW at lr 0.01 x sqrt(128/256), 10 epochs, an emulated "
               f"{format_bytes(DEFAULT_CPU_CAPACITY)} CPU device squeezed to half from a third of the run for a "
               "third of it. The run takes well under a minute on two CPU cores and reaches about 98% "
               "held-out accuracy.",
    )
    g = p.add_argument_group("model and data")
    g.add_argument("--model", metavar="SPEC", default="cnn",
                   help="cnn (SmallCNN on 1x8x8 images), mlp (on 64 features), or MODULE:FUNCTION / "
                        "path/to/file.py:FUNCTION, a factory given num_classes= and input_shape= if it takes them "
                        "(default: %(default)s)")
    g.add_argument("--image-inputs", action="store_true",
                   help="give a factory model 1x8x8 images instead of 64 flat features")
    g.add_argument("--held-out", metavar="FRACTION", type=fraction, default=0.2,
                   help="fraction of the digits kept for the accuracy (default: %(default)s)")
    g.add_argument("--seed", type=non_negative_int, default=0,
                   help="seeds the split, the weights and the shuffling (default: %(default)s)")

    o = p.add_argument_group("optimisation (names as in timm)")
    o.add_argument("--epochs", type=positive_int, default=10, help="passes over the training split (default: %(default)s)")
    o.add_argument("-b", "--batch-size", metavar="N", type=positive_int, default=128,
                   help="global batch: samples per optimizer step, held fixed whatever the memory; with "
                        "--batch-schedule the batch the LR is set for, the ramp's final batch and adaptive's "
                        "largest (default: %(default)s)")
    o.add_argument("--batch-schedule", metavar="SPEC", type=_batch_schedule, default="constant",
                   help=f"how the global batch moves during the run: {SCHEDULE_SPECS}. ramp: Megatron's, from START "
                        "up to --batch-size by INCR, evenly over SAMPLES samples; adaptive: k x the measured "
                        "gradient noise scale, between min (default batch-size/8) and max (default batch-size), "
                        "changed at most every `every` steps, by at most max_factor, upward only unless "
                        "decrease=yes. The LR follows by --lr-base-scale (default: %(default)s)")
    o.add_argument("--noise", choices=NOISE_CHOICES, default="auto",
                   help="measure the gradient noise scale from the first micro-batch (nearly free; EMA over about "
                        "200 steps), every micro-batch (settles several times faster, one gradient norm per "
                        "micro-batch), or off; auto = every under the adaptive schedule, else first "
                        "(default: %(default)s)")
    o.add_argument("--scale-weight-decay", action="store_true",
                   help="at each change of the global batch also rescale weight decay, keeping AdamW's timescale "
                        "B/(lr x wd x N) (Bergsma et al. 2025); off by default")
    o.add_argument("--grad-accum-steps", metavar="N", type=positive_int, default=None,
                   help="start with batch-size/N samples per micro-batch instead of asking the finder; "
                        "the engine still adapts (default: ask the finder)")
    o.add_argument("--opt", "--optimizer", dest="optimizer", choices=OPTIMIZERS, default="adamw",
                   help="optimizer (default: %(default)s)")
    o.add_argument("--lr-base", metavar="LR", type=positive_float, default=0.01,
                   help="learning rate tuned for a global batch of --lr-base-size (default: %(default)s)")
    o.add_argument("--lr-base-size", metavar="N", type=positive_int, default=256,
                   help="the global batch --lr-base is tuned for (default: %(default)s)")
    o.add_argument("--lr-base-scale", choices=LR_SCALE_RULES, default="auto",
                   help="how the LR follows the batch: linear, sqrt, none, or auto (sqrt for Adam-family, "
                        "linear otherwise) (default: %(default)s)")
    o.add_argument("--weight-decay", metavar="WD", type=float, default=0.05, help="weight decay (default: %(default)s)")
    o.add_argument("--sched", choices=("cosine", "none"), default="cosine",
                   help="LR schedule, stepped per optimizer step (default: %(default)s)")
    o.add_argument("--clip-grad", metavar="NORM", type=positive_float, default=None,
                   help="clip the gradient norm to NORM (default: off)")
    o.add_argument("--amp", choices=AMP_MODES, default=None, help="mixed precision (default: off)")

    m = p.add_argument_group("memory")
    m.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the accelerator if any, else cpu)")
    m.add_argument("--threads", metavar="N", type=positive_int, default=1,
                   help="CPU threads for torch's kernels (torch.set_num_threads); the digits model's tensors are "
                        "too small for a second thread to pay, and on a busy machine idle threads spin "
                        "(default: %(default)s)")
    m.add_argument("--capacity", metavar="SIZE", type=_capacity, default="auto",
                   help="memory the job may use, e.g. 2MiB: emulated on CPU (a real OutOfMemoryError past it), a "
                        f"memory fraction on CUDA; auto = {format_bytes(DEFAULT_CPU_CAPACITY)} on CPU, the whole "
                        "device elsewhere; none = the whole device (default: %(default)s)")
    add_find_options(m, ["target", "strategy"], notes={
        "target": "below 0.95 for training: the engine aims its grown micro-batches at it too",
        "strategy": "the finder's, for the first micro-batch"})
    m.add_argument("--grow-after", metavar="STEPS", type=positive_int, default=10,
                   help="clean steps before the engine tries a larger micro-batch (default: %(default)s)")
    m.add_argument("--squeeze-at", metavar="STEP", type=_squeeze_at, default="auto",
                   help="step at which the capacity drops, as if another job took memory; auto = a third of the "
                        "way in (default: %(default)s)")
    m.add_argument("--squeeze-steps", metavar="N", type=positive_int, default=None,
                   help="how many steps the squeeze lasts (default: a third of the run)")
    m.add_argument("--squeeze-capacity", metavar="SIZE", type=byte_size, default=None,
                   help="the capacity during the squeeze (default: half of --capacity)")
    m.add_argument("--no-squeeze", action="store_true", help="keep the capacity constant")

    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", default="runs/latest",
                     help="directory for run.json and run.png (default: %(default)s)")
    out.add_argument("--no-plot", action="store_true", help="do not write run.png")
    out.add_argument("--json", action="store_true", help="print only the JSON run log on stdout")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_verbose(p)
    p.set_defaults(handler=run)
    return p


def _config(args: argparse.Namespace) -> TrainConfig:
    device = str(device_or_fail(args.device)) if args.device is not None else None
    model: Any = args.model
    if model not in ("cnn", "mlp"):
        if ":" not in model:
            raise UsageError(f"--model {model!r}: use cnn, mlp, MODULE:FUNCTION or path/to/file.py:FUNCTION")
        model = load_factory(model)
    try:
        return TrainConfig(
            model=model, image_inputs=args.image_inputs, epochs=args.epochs, batch_size=args.batch_size,
            batch_schedule=args.batch_schedule, noise=args.noise, scale_weight_decay=args.scale_weight_decay,
            grad_accum_steps=args.grad_accum_steps, optimizer=args.optimizer, lr_base=args.lr_base,
            lr_base_size=args.lr_base_size, lr_base_scale=args.lr_base_scale, weight_decay=args.weight_decay,
            sched=args.sched, clip_grad=args.clip_grad, amp=args.amp, device=device, target=args.target,
            capacity=args.capacity, strategy=args.strategy, grow_after=args.grow_after,
            squeeze_at=None if args.no_squeeze else args.squeeze_at, squeeze_steps=args.squeeze_steps,
            squeeze_capacity=args.squeeze_capacity, held_out=args.held_out, seed=args.seed, out=args.out,
            plot=not args.no_plot, progress=not args.no_progress,
        )
    except ValueError as exc:
        raise UsageError(str(exc).replace("_", "-")) from None


def _human(result: TrainResult) -> str:
    log = result.log
    lines = []
    plan = log["plan"]
    first = log["steps"][0] if log["steps"] else None
    if plan is not None:
        lines += [f"finder ({plan['strategy']}): {plan['num_trials']} trials, {plan['num_ooms']} OOM, "
                  f"{plan['seconds']:.1f} s", "", report.trials_table(plan["trials"]), "",
                  f"largest batch under the limit: {plan['batch_size']} (limit {format_bytes(plan['limit_bytes'])} = "
                  f"{plan['target']:.0%} of {format_bytes(plan['capacity_bytes'])})"]
    if first is not None:
        lines.append(f"global batch {first['global_batch_size']} = micro-batch {first['micro_batch_size']} x "
                     f"{first['accum_steps']} accumulation steps at the start")
    lr = log["lr"]
    line = (f"lr: {lr['base']:g} at batch {lr['base_size']} -> {lr['scaled']:.6g} at batch "
            f"{log['config']['batch_size']} ({lr['rule']} rule)")
    if first is not None and first["global_batch_size"] != log["config"]["batch_size"]:
        line += f"; the schedule starts at {first['lr']:.6g} for batch {first['global_batch_size']}"
    lines.append(line)
    trail = " ".join(f"-> {c['to']} (step {c['step']})" for c in log["micro_batch_changes"])
    start = first["micro_batch_size"] if first is not None else "-"
    lines.append(f"micro-batch over the run: {start} {trail}".rstrip() + f"; {log['total_ooms']} OOM recovered")
    if log["batch_changes"] or log["schedule"]["spec"] != "constant":
        changes = log["batch_changes"]
        shown = changes if len(changes) <= 8 else changes[:4] + [None] + changes[-3:]
        trail = " ".join("..." if c is None else f"-> {c['to']} (after step {c['step']})" for c in shown)
        begin = first["global_batch_size"] if first is not None else "-"
        lines.append(f"global batch ({log['schedule']['spec']}): {begin} {trail}".rstrip())
    if log["noise_scale"] is not None:
        lines.append(f"gradient noise scale B_simple at the end: {log['noise_scale']:.0f} samples (EMA)")
    lines.append(f"trained {log['optimizer_steps']} steps, {log['samples_seen']} samples in {log['seconds']:.1f} s")
    lines.append(f"held-out accuracy: {log['accuracy']:.2%} ({log['dataset']['num_held_out']} digits)")
    if result.json_path is not None:
        lines.append(f"run log: {result.json_path}")
    if result.plot_path is not None:
        lines.append(f"plot: {result.plot_path}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    torch.set_num_threads(args.threads)
    with report.logging_through_progress(config.progress):
        result = run_training(config)
    if args.json:
        print(report.to_json(result.log))
    else:
        print(_human(result))
    sys.stdout.flush()
    return 0
