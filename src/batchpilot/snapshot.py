"""Snapshot training state (modules, optimizers, schedulers, scalers, tensors, RNGs) and put it back bit for bit.

Copies live in host memory and are made under :func:`~batchpilot.memory.untracked`, so a
running tracker never counts them. Details: ``docs/internals.md#snapshot``.
"""

from __future__ import annotations

import copy
import random
from collections import defaultdict
from typing import Any, Iterable

import numpy as np
import torch
from torch import nn

from .memory import untracked

__all__ = ["StateSnapshot", "RngState"]

_CPU = torch.device("cpu")


def _host_copy(obj: Any) -> Any:
    """Deep copy with every tensor cloned to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(_CPU, copy=True)
    if isinstance(obj, dict):
        out = type(obj)() if not isinstance(obj, defaultdict) else defaultdict(obj.default_factory)
        for k, v in obj.items():
            out[k] = _host_copy(v)
        return out
    if isinstance(obj, (list, tuple)):
        items = [_host_copy(v) for v in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    return copy.deepcopy(obj)


class RngState:
    """The torch, CUDA, numpy and python RNG states at construction; :meth:`restore` puts them back."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        # only an initialised CUDA context has generators; querying would create one
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.numpy = np.random.get_state()
        self.python = random.getstate()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


class _ModuleState:
    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # (owner, attribute name, original tensor or None, host copy or None)
        self.slots: list[tuple[nn.Module, str, torch.Tensor | None, torch.Tensor | None]] = []
        self.grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        seen: set[int] = set()
        for owner in module.modules():
            for name, p in owner._parameters.items():
                self.slots.append((owner, name, p, None if p is None else _host_copy(p)))
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    self.grads.append((p, None if p.grad is None else _host_copy(p.grad)))
            for name, b in owner._buffers.items():
                self.slots.append((owner, name, b, None if b is None else _host_copy(b)))
        self.training = [(m, m.training) for m in module.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            for owner, name, original, saved in self.slots:
                table = owner._parameters if name in owner._parameters else owner._buffers
                if table.get(name) is not original:  # a step replaced it: put the original back
                    table[name] = original
                if original is not None:
                    original.copy_(saved)
            for p, grad in self.grads:
                if grad is None:
                    p.grad = None
                elif p.grad is not None and p.grad.shape == grad.shape and p.grad.dtype == grad.dtype:
                    p.grad.copy_(grad)
                else:
                    p.grad = grad.to(p.device, copy=True)
        for m, flag in self.training:
            m.training = flag


class _StatefulState:
    """Anything with ``state_dict`` / ``load_state_dict``: optimizers, schedulers, GradScaler."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.state = _host_copy(obj.state_dict())

    def restore(self) -> None:
        # the object may keep the tensors it is given: hand it a fresh copy each time
        if isinstance(self.obj, torch.optim.Optimizer):
            self.obj.load_state_dict(_host_copy(self.state))
            return
        if self.state or not isinstance(self.obj, torch.amp.GradScaler):  # a disabled scaler saves {}
            self.obj.load_state_dict(_host_copy(self.state))
        if isinstance(self.obj, torch.amp.GradScaler) and hasattr(self.obj, "_per_optimizer_states"):
            # an OOM between unscale_() and update() leaves per-step bookkeeping
            # that would make the next step refuse to run
            self.obj._per_optimizer_states.clear()


class _TensorState:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.saved = _host_copy(tensor)

    def restore(self) -> None:
        with torch.no_grad():
            self.tensor.copy_(self.saved)


class StateSnapshot:
    """Copy the state of modules, optimizers, schedulers, scalers, tensors and the RNGs.

    Args:
        objects: what to snapshot (see the module docstring); ``None`` entries
            are skipped.
        rng: also snapshot the RNG states.

    Raises:
        TypeError: an object is neither a module, a tensor, nor has
            ``state_dict`` / ``load_state_dict``.

    Example::

        snap = StateSnapshot([model, optimizer, scheduler])
        try:
            train_a_few_steps()
        finally:
            snap.restore()
    """

    def __init__(self, objects: Iterable[Any] = (), *, rng: bool = True) -> None:
        self.objects = [o for o in objects if o is not None]
        with untracked(_CPU):
            self._parts: list[Any] = [self._capture(o) for o in self.objects]
            self._rng = RngState() if rng else None

    @staticmethod
    def _capture(obj: Any) -> Any:
        if isinstance(obj, nn.Module):
            return _ModuleState(obj)
        if isinstance(obj, torch.Tensor):
            return _TensorState(obj)
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            return _StatefulState(obj)
        raise TypeError(
            f"cannot snapshot {type(obj).__name__}: pass modules, optimizers, LR schedulers, "
            "GradScalers, tensors, or objects with state_dict() and load_state_dict()"
        )

    def restore(self) -> None:
        """Put every captured state back; safe to call any number of times."""
        with untracked(_CPU) as trackers:
            for part in self._parts:
                part.restore()
            if self._rng is not None:
                self._rng.restore()
        for tracker in trackers:
            # tensors created above were invisible to the tracker: count them now
            tracker.track(*self.objects)
