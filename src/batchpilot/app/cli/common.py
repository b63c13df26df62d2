"""Argument types, shared option groups and the user-error type of the command line."""

from __future__ import annotations

import argparse
import math
from typing import Any, Iterable

import torch

from ...core.amp import AMP_MODES
from ...find.options import FindOptions, option_default, option_help
from ...memory.units import parse_bytes, resolve_device
from ...policy.search import STRATEGIES, BatchSizeError, check_target
from ...policy.speed import OBJECTIVES
from ..trainjob import OPTIMIZERS

__all__ = [
    "UsageError",
    "positive_int",
    "non_negative_int",
    "fraction",
    "target_fraction",
    "speed_fraction",
    "positive_float",
    "byte_size",
    "speeds",
    "shape",
    "lengths",
    "add_model_options",
    "add_fit_options",
    "add_find_options",
    "find_options_of",
    "FIND_FLAGS",
    "add_verbose",
    "device_or_fail",
    "OPTIMIZERS",
]


class UsageError(Exception):
    """A mistake in what the user asked for: one line on stderr and exit status 2, no traceback."""


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def target_fraction(text: str) -> float:
    """argparse type: a target, checked as every door checks it (:func:`batchpilot.policy.search.check_target`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    try:
        return check_target(value)
    except BatchSizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def speed_fraction(text: str) -> float:
    """argparse type: a number in [0, 0.5), the share of the best samples/s one may give up."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"must be in [0, 0.5), e.g. 0.05 for 5%, got {text}")
    return value


def speeds(text: str) -> tuple[float, ...]:
    """argparse type: one positive number per rank such as ``1,1,0.4,0.4``."""
    try:
        values = tuple(positive_float(p) for p in text.split(","))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"expected one positive number per rank like 1,1,0.4,0.4: {exc}") from None
    return values


def byte_size(text: str) -> int:
    """argparse type: a memory size such as ``2GiB``, ``512MiB`` or a number of bytes."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shape(text: str) -> tuple[int, ...]:
    """argparse type: a per-sample shape such as ``3,224,224``, ``3x224x224`` (the same) or ``64``."""
    parts = [p for p in text.lower().replace("x", ",").split(",") if p.strip()]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes separated by commas or x, like 3,224,224 or 3x224x224, "
                                         f"got {text!r}") from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"every dimension must be at least 1, got {text!r}")
    return dims


def seq_lens(text: str) -> tuple[int, ...]:
    """argparse type: two or more sequence lengths such as ``128,512,2048``."""
    parts = [p for p in text.split(",") if p.strip()]
    try:
        values = sorted({int(p) for p in parts})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths like 128,512,2048, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every length must be at least 1, got {text!r}")
    if len(values) < 2:
        raise argparse.ArgumentTypeError(
            f"give two or more distinct lengths (e.g. 128,512), got {text!r}: one length cannot separate the "
            "per-token cost from the attention's L^2 cost")
    return tuple(values)


def lengths(text: str) -> tuple[int, ...]:
    """argparse type: one or more positive whole numbers such as ``128,512``."""
    try:
        values = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 128,512, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every number must be at least 1, got {text!r}")
    return tuple(values)


def add_length_options(parser: argparse.ArgumentParser) -> None:
    """``--seq-lens`` (find and plan): answer per sequence length, from searches at two or three of them."""
    parser.add_argument(
        "--seq-lens", metavar="L1,L2,...", type=seq_lens, default=None,
        help="answer the largest batch at each of these sequence lengths (a table), from searches at two or three "
             "of them and a memory model peak = F(L) + b x P(L) over (batch, length). The model's inputs must "
             "have the sequence first (the transformer, or --model with --input-shape LENGTH,...); each length "
             "replaces the first dim of --input-shape")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--input-shape``, ``--num-classes``, ``--optimizer``, ``--amp`` (find and plan)."""
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model", metavar="SPEC", default=None,
        help="the model: a built-in name (mlp, cnn, transformer, resnet50: ResNet-50, 3,224,224 by default), MODULE:FUNCTION, or path/to/file.py:FUNCTION "
             "naming a factory that returns an nn.Module (it is given num_classes= and input_shape= if its "
             "signature takes them). Default: mlp for a 1-dim --input-shape, cnn for a 3-dim one",
    )
    g.add_argument(
        "--input-shape", metavar="SHAPE", type=shape, default=None,
        help="shape of one input sample, e.g. 3,224,224 or 3x224x224 (images) or 64 (features); for the "
             "transformer, the sequence length of integer tokens. Default: 3,32,32, or the built-in model's own shape",
    )
    g.add_argument("--num-classes", metavar="N", type=positive_int, default=10,
                   help="classes of the cross-entropy targets (default: %(default)s)")
    g.add_argument("--optimizer", "--opt", dest="optimizer", choices=OPTIMIZERS, default="adamw",
                   help="optimizer whose state counts towards memory (default: %(default)s)")
    g.add_argument("--amp", choices=AMP_MODES, default=None,
                   help="run the forward pass under autocast in bfloat16 or float16 (default: off)")


#: The finder's options (:class:`~batchpilot.find.options.FindOptions`) as flags: what argparse needs
#: besides the help and the default, which come from the field. The flag is ``--field-name`` unless
#: ``flag`` names another; ``default`` only where the command line's differs from the API's.
#: The flag names are a contract (docs/cli.md). Options without a flag: ``first_guess``
#: (``--plan-first`` seeds it), ``max_trials``, ``tolerance``, ``snapshot``.
FIND_FLAGS: dict[str, dict[str, Any]] = {
    "target": dict(metavar="FRACTION", type=target_fraction),
    "capacity": dict(metavar="SIZE", type=byte_size),
    "strategy": dict(choices=tuple(STRATEGIES)),
    "min_batch_size": dict(metavar="N", type=positive_int),
    "max_batch_size": dict(metavar="N", type=positive_int),
    "steps_per_trial": dict(metavar="N", type=positive_int),
    "progress": dict(flag="--no-progress", action="store_false", default=True),
    "objective": dict(choices=OBJECTIVES, default="memory"),  # find sizes training: None is "memory" there
    "speed_tolerance": dict(metavar="FRACTION", type=speed_fraction),
    "timed_steps": dict(metavar="N", type=non_negative_int),
}


def add_find_options(parser: Any, names: Iterable[str], *, notes: dict[str, str] | None = None,
                     defaults: dict[str, Any] | None = None) -> None:
    """Add the flags of the finder's options ``names`` (see :data:`FIND_FLAGS`) to ``parser`` or a group.

    Each flag's help is the option's own documentation (:func:`~batchpilot.find.options.option_help`),
    followed by ``notes[name]`` (what the option means for this command) and its default.
    """
    for name in names:
        spec = dict(FIND_FLAGS[name])
        flag = spec.pop("flag", "--" + name.replace("_", "-"))
        spec.setdefault("default", option_default(name))
        if defaults and name in defaults:
            spec["default"] = defaults[name]
        text, _, unset = option_help(name).partition("; None: ")
        shown = " (default: %(default)s)"
        if spec.get("action") == "store_false":
            text, shown = f"turn off: {text}", ""
        elif unset and spec["default"] is None:
            text, shown = f"{text}; not given: {unset}", ""
        note = (notes or {}).get(name)
        spec["help"] = text.replace("%", "%%") + (f"; {note}" if note else "") + shown
        parser.add_argument(flag, dest=name, **spec)


def find_options_of(args: argparse.Namespace, names: Iterable[str] = FIND_FLAGS) -> FindOptions:
    """The finder's options the flags of ``names`` set (the rest at their defaults).

    Raises:
        batchpilot.policy.search.BatchSizeError: values the finder refuses together (min above max).
    """
    return FindOptions.build(**{name: getattr(args, name) for name in names})


def add_fit_options(parser: argparse.ArgumentParser) -> None:
    """``--target`` and ``--max-batch-size`` of the planner (``batchpilot plan``), the finder's defaults."""
    parser.add_argument(
        "--target", metavar="FRACTION", type=target_fraction, default=option_default("target"),
        help="use at most this fraction of the capacity, in (0, 1] (default: %(default)s)",
    )
    parser.add_argument("--max-batch-size", metavar="N", type=positive_int, default=None,
                        help="never propose a batch above N (default: no limit)")


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """``-v`` after the command name too (``batchpilot train -v``)."""
    parser.add_argument("-v", "--verbose", dest="sub_verbose", action="count", default=0,
                        help="log to stderr: -v progress notes, -vv debugging detail")


def device_or_fail(text: str | None) -> torch.device:
    """The ``--device`` as a ``torch.device``, checked to exist here.

    Raises:
        UsageError: an unknown device type, or a backend this machine lacks.
    """
    try:
        device = resolve_device(text)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    if device.type != "cpu":
        backend = getattr(torch, device.type, None)
        if backend is None or not backend.is_available():
            raise UsageError(f"--device {text}: no {device.type} device here; use --device cpu")
        count = getattr(backend, "device_count", None)
        if device.index is not None and count is not None and device.index >= count():
            raise UsageError(f"--device {text}: only {count()} {device.type} device(s) here")
    return device
