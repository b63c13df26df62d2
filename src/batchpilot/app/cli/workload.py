"""What ``find`` and ``plan`` size a batch for: a model from ``--model``, its inputs, loss and optimizer.

``--model`` is a built-in name (``mlp``, ``cnn``, ``transformer``, ``resnet50``), ``MODULE:FUNCTION``
(imported like ``python -m``: the current directory comes first), or
``path/to/file.py:FUNCTION`` (loaded from the file).
The function is a factory returning an ``nn.Module``; it is called with the keyword
arguments ``num_classes`` and ``input_shape`` that its signature accepts (``**kwargs``
accepts both). Inputs are random: float tensors of ``--input-shape`` per sample, or
integer tokens for the built-in transformer; targets are class indices for
cross-entropy.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ...core.amp import AMP_MODES
from ..models import MLP, ResNet, SmallCNN, TransformerBlockModel
from ..trainjob import call_model_factory, check_model, make_optimizer
from .common import OPTIMIZERS, UsageError

__all__ = ["Workload", "load_factory", "BUILTIN_MODELS", "DEFAULT_INPUT_SHAPE"]

BUILTIN_MODELS = ("mlp", "cnn", "transformer", "resnet50")
DEFAULT_INPUT_SHAPE = (3, 32, 32)
_TRANSFORMER_SEQ_LEN = 32


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """The model factory named by ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``.

    Raises:
        UsageError: the spec is malformed, the module or file cannot be loaded, or the
            attribute is missing or not callable.
    """
    module_ref, sep, attr = spec.rpartition(":")
    if not sep or not module_ref or not attr.isidentifier():
        raise UsageError(
            f"--model {spec!r}: expected a built-in name ({', '.join(BUILTIN_MODELS)}), "
            "MODULE:FUNCTION or path/to/file.py:FUNCTION"
        )
    if module_ref.endswith(".py") or "/" in module_ref or "\\" in module_ref:
        path = Path(module_ref)
        if not path.is_file():
            raise UsageError(f"--model {spec!r}: no such file {str(path)!r}")
        name = f"_batchpilot_user_model_{abs(hash(path.resolve()))}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise UsageError(f"--model {spec!r}: cannot load {str(path)!r} as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise UsageError(f"--model {spec!r}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    else:
        module = _import_from_cwd(spec, module_ref)
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise UsageError(f"--model {spec!r}: {module_ref!r} has no callable {attr!r}")
    return factory


def _import_from_cwd(spec: str, module_ref: str) -> Any:
    """Import ``module_ref`` as ``python -m`` would: the current directory first, for this import only.

    The ``batchpilot`` console script's ``sys.path`` starts with its own bin directory, not
    the directory the user is in.
    """
    cwd = os.getcwd()
    added = cwd not in {os.path.abspath(p or os.curdir) for p in sys.path}
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_ref)
    except ImportError as exc:
        raise UsageError(f"--model {spec!r}: cannot import {module_ref!r}: {exc}") from exc
    except Exception as exc:
        raise UsageError(f"--model {spec!r}: importing {module_ref!r} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if added:
            sys.path.remove(cwd)


@dataclass(kw_only=True)
class Workload:
    """The model, inputs and optimizer a batch size is sought for.

    Raises:
        UsageError: an input shape that does not suit the built-in model, or a bad ``amp``.
    """

    model_spec: str | None = None
    input_shape: tuple[int, ...] | None = None
    num_classes: int = 10
    optimizer: str = "adamw"
    amp: str | None = None

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in AMP_MODES:
            raise UsageError(f"--amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.model_spec is None:
            shape = self.input_shape or DEFAULT_INPUT_SHAPE
            if len(shape) not in (1, 3):
                raise UsageError(
                    f"--input-shape {','.join(map(str, shape))}: the default model needs 1 dim (features, "
                    "for the MLP) or 3 (channels,height,width, for the CNN); pass --model for other shapes"
                )
            self.model_spec = "mlp" if len(shape) == 1 else "cnn"
        if self.input_shape is None:
            self.input_shape = {
                "mlp": (64,), "transformer": (_TRANSFORMER_SEQ_LEN,), "resnet50": (3, 224, 224),
            }.get(self.model_spec, DEFAULT_INPUT_SHAPE)
        expected = {"mlp": 1, "cnn": 3, "transformer": 1, "resnet50": 3}.get(self.model_spec)
        if expected is not None and len(self.input_shape) != expected:
            raise UsageError(
                f"--model {self.model_spec} takes a {expected}-dim --input-shape, got "
                f"{','.join(map(str, self.input_shape))}"
            )

    @property
    def tokens(self) -> bool:
        """Inputs are integer token ids (the built-in transformer) rather than floats."""
        return self.model_spec == "transformer"

    def build_model(self) -> nn.Module:
        """A fresh model.

        Raises:
            UsageError: a ``--model`` that cannot be loaded.
            batchpilot.app.trainjob.JobError: a factory that raises or returns no ``nn.Module``.
        """
        spec, shape, classes = self.model_spec, self.input_shape, self.num_classes
        assert spec is not None and shape is not None
        if spec == "mlp":
            return MLP(in_features=shape[0], num_classes=classes)
        if spec == "cnn":
            return SmallCNN(in_channels=shape[0], num_classes=classes)
        if spec == "transformer":
            return TransformerBlockModel(seq_len=shape[0], num_classes=classes)
        if spec == "resnet50":
            return ResNet(num_classes=classes, in_channels=shape[0])
        return call_model_factory(load_factory(spec), num_classes=classes, input_shape=shape)

    def make_batch(self, batch_size: int, *, generator: torch.Generator | None = None,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """A random ``(inputs, targets)`` batch."""
        assert self.input_shape is not None
        if self.tokens:
            x = torch.randint(0, 256, (batch_size, *self.input_shape), generator=generator)
        else:
            x = torch.randn(batch_size, *self.input_shape, generator=generator)
        y = torch.randint(0, self.num_classes, (batch_size,), generator=generator)
        return x.to(device), y.to(device)

    def at_lengths(self, lengths: tuple[int, ...]) -> Workload:
        """This workload with its sequence (the first input dim) at the longest of ``lengths``.

        Raises:
            UsageError: the built-in MLP or CNN, whose inputs have no sequence.
        """
        if self.model_spec in ("mlp", "cnn", "resnet50"):
            raise UsageError(f"--seq-lens needs a model whose inputs are sequences: --model transformer, or your own "
                             f"--model with --input-shape LENGTH,...; the built-in {self.model_spec} has none")
        assert self.input_shape is not None
        return dataclasses.replace(self, input_shape=(max(lengths), *self.input_shape[1:]))

    def batch_at(self, batch_size: int, length: int, *, generator: torch.Generator | None = None) -> Any:
        """A random batch of ``batch_size`` samples whose sequences are ``length`` long."""
        assert self.input_shape is not None
        return dataclasses.replace(self, input_shape=(length, *self.input_shape[1:])).make_batch(
            batch_size, generator=generator)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer; its learning rate does not change the memory, so a fixed one is used."""
        return make_optimizer(self.optimizer, model.parameters(), lr=1e-3)

    def check(self, model: nn.Module, *, seed: int = 0) -> None:
        """One forward at a batch of 2, before any search (:func:`~batchpilot.app.trainjob.check_model`).

        Raises:
            batchpilot.app.trainjob.JobError: the model cannot take these inputs or gives
                too few class scores; the message says which options to check.
        """
        inputs, _ = self.make_batch(2, generator=torch.Generator().manual_seed(seed))
        check_model(model, inputs, num_classes=self.num_classes, amp=self.amp,
                    hint="check --input-shape and --num-classes")

    def describe(self) -> dict[str, Any]:
        """The job fields of the ``find`` / ``plan`` JSON documents."""
        return {
            "model": self.model_spec,
            "input_shape": list(self.input_shape or ()),
            "num_classes": self.num_classes,
            "optimizer": self.optimizer,
            "amp": self.amp,
        }
