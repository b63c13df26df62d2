"""Snapshot training state (modules, optimizers, schedulers, scalers, tensors, RNGs) and put it back bit for bit.

Copies live in host memory and are made under :func:`~batchpilot.memory.tracker.untracked`, so a
running tracker never counts them. Details: ``docs/internals.md#snapshot``.
"""

from __future__ import annotations

import copy
import os
import random
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from ..core.sharding import reshard_fsdp
from ..memory.tracker import untracked

__all__ = ["StateSnapshot", "RngState"]

_CPU = torch.device("cpu")


class _Slot:
    """Where a tensor of the snapshot waits in the store."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Store:
    """The snapshot's host copies: in memory, or spilled to a temporary file.

    Spilled, the copies cost no memory between restores: each restore maps the file
    (``torch.load(mmap=True)``, pages the kernel can drop) and lets go of it afterwards.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] | None = []
        self.path: str | None = None
        self.nbytes = 0

    def keep(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by a slot holding its host copy."""
        if isinstance(obj, torch.Tensor):
            copy_ = obj.detach().to(_CPU, copy=True)
            assert self.tensors is not None
            self.tensors.append(copy_)
            self.nbytes += copy_.untyped_storage().nbytes()
            return _Slot(len(self.tensors) - 1)
        if isinstance(obj, dict):
            out = type(obj)() if not isinstance(obj, defaultdict) else defaultdict(obj.default_factory)
            for k, v in obj.items():
                out[k] = self.keep(v)
            return out
        if isinstance(obj, (list, tuple)):
            items = [self.keep(v) for v in obj]
            return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
        return copy.deepcopy(obj)

    def get(self, obj: Any, *, fresh: bool = False) -> Any:
        """``obj`` with its slots filled (fresh copies when ``fresh``: the receiver may keep them)."""
        if isinstance(obj, _Slot):
            assert self.tensors is not None, "the store is spilled: use it inside loaded()"
            t = self.tensors[obj.index]
            return t.clone() if fresh else t
        if isinstance(obj, dict):
            out = type(obj)() if not isinstance(obj, defaultdict) else defaultdict(obj.default_factory)
            for k, v in obj.items():
                out[k] = self.get(v, fresh=fresh)
            return out
        if isinstance(obj, (list, tuple)):
            items = [self.get(v, fresh=fresh) for v in obj]
            return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
        return copy.deepcopy(obj) if fresh else obj

    def spill(self) -> None:
        """Move the copies to a temporary file (``$TMPDIR``) and free them."""
        fd, path = tempfile.mkstemp(prefix="batchpilot-snapshot-", suffix=".pt")
        os.close(fd)
        torch.save(self.tensors, path)
        self.path, self.tensors = path, None

    @contextmanager
    def loaded(self) -> Iterator[None]:
        if self.path is None:
            yield
            return
        self.tensors = torch.load(self.path, mmap=True, weights_only=True)
        try:
            yield
        finally:
            self.tensors = None

    def close(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None


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
    def __init__(self, module: nn.Module, store: _Store) -> None:
        self.module, self.store = module, store
        reshard_fsdp(module)  # the sharded parameters are the state; an unsharded copy is FSDP's to free
        # (owner, attribute name, original tensor or None, host copy or None)
        self.slots: list[tuple[nn.Module, str, torch.Tensor | None, torch.Tensor | None]] = []
        self.grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        seen: set[int] = set()
        for owner in module.modules():
            for name, p in owner._parameters.items():
                self.slots.append((owner, name, p, None if p is None else store.keep(p)))
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    self.grads.append((p, None if p.grad is None else store.keep(p.grad)))
            for name, b in owner._buffers.items():
                self.slots.append((owner, name, b, None if b is None else store.keep(b)))
        self.training = [(m, m.training) for m in module.modules()]

    def restore(self) -> None:
        with torch.no_grad():
            for owner, name, original, saved in self.slots:
                table = owner._parameters if name in owner._parameters else owner._buffers
                if table.get(name) is not original:  # a step replaced it: put the original back
                    table[name] = original
                if original is not None:
                    original.copy_(self.store.get(saved))
            for p, slot in self.grads:
                if slot is None:
                    p.grad = None
                    continue
                grad = self.store.get(slot)
                if p.grad is not None and p.grad.shape == grad.shape and p.grad.dtype == grad.dtype:
                    p.grad.copy_(grad)
                else:
                    p.grad = grad.to(p.device, copy=True)
        for m, flag in self.training:
            m.training = flag


class _StatefulState:
    """Anything with ``state_dict`` / ``load_state_dict``: optimizers, schedulers, GradScaler."""

    def __init__(self, obj: Any, store: _Store) -> None:
        self.obj, self.store = obj, store
        self.state = store.keep(obj.state_dict())

    def restore(self) -> None:
        # the object may keep the tensors it is given: hand it a fresh copy each time
        if isinstance(self.obj, torch.optim.Optimizer):
            self.obj.load_state_dict(self.store.get(self.state, fresh=True))
            return
        if self.state or not isinstance(self.obj, torch.amp.GradScaler):  # a disabled scaler saves {}
            self.obj.load_state_dict(self.store.get(self.state, fresh=True))
        if isinstance(self.obj, torch.amp.GradScaler) and hasattr(self.obj, "_per_optimizer_states"):
            # an OOM between unscale_() and update() leaves per-step bookkeeping
            # that would make the next step refuse to run
            self.obj._per_optimizer_states.clear()


class _TensorState:
    def __init__(self, tensor: torch.Tensor, store: _Store) -> None:
        self.tensor, self.store = tensor, store
        self.saved = store.keep(tensor)

    def restore(self) -> None:
        with torch.no_grad():
            self.tensor.copy_(self.store.get(self.saved))


class StateSnapshot:
    """Copy the state of modules, optimizers, schedulers, scalers, tensors and the RNGs.

    Args:
        objects: what to snapshot (see the module docstring); ``None`` entries
            are skipped.
        rng: also snapshot the RNG states.
        spill: keep the copies in a temporary file instead of memory (on a CPU whose
            memory is being measured, so that the snapshot does not compete with the job).

    Attributes:
        nbytes: bytes of the host copies.
        seconds: time spent taking the snapshot and restoring it, so far.

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

    def __init__(self, objects: Iterable[Any] = (), *, rng: bool = True, spill: bool = False) -> None:
        began = time.perf_counter()
        self.objects = [o for o in objects if o is not None]
        self._store = _Store()
        with untracked(_CPU):
            self._parts: list[Any] = [self._capture(o, self._store) for o in self.objects]
            self._rng = RngState() if rng else None
        self.nbytes = self._store.nbytes
        if spill:
            self._store.spill()
        self.seconds = time.perf_counter() - began

    @property
    def spilled(self) -> bool:
        """True when the copies live in a temporary file rather than in memory."""
        return self._store.path is not None

    @staticmethod
    def objects_nbytes(objects: Iterable[Any]) -> int:
        """Bytes a snapshot of ``objects`` would copy (parameters, buffers, gradients, state)."""
        from ..memory.tracker import tensors_of

        seen: dict[int, int] = {}
        for obj in objects:
            if obj is None:
                continue
            for t in tensors_of(obj):
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    @staticmethod
    def _capture(obj: Any, store: _Store) -> Any:
        if isinstance(obj, nn.Module):
            return _ModuleState(obj, store)
        if isinstance(obj, torch.Tensor):
            return _TensorState(obj, store)
        if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            return _StatefulState(obj, store)
        raise TypeError(
            f"cannot snapshot {type(obj).__name__}: pass modules, optimizers, LR schedulers, "
            "GradScalers, tensors, or objects with state_dict() and load_state_dict()"
        )

    def restore(self) -> None:
        """Put every captured state back; safe to call any number of times."""
        began = time.perf_counter()
        with untracked(_CPU) as trackers, self._store.loaded():
            for part in self._parts:
                part.restore()
            if self._rng is not None:
                self._rng.restore()
        for tracker in trackers:
            # tensors created above were invisible to the tracker: count them now
            tracker.track(*self.objects)
        self.seconds += time.perf_counter() - began

    def close(self) -> None:
        """Delete a spilled snapshot's file (the snapshot cannot be restored afterwards)."""
        self._store.close()

    def __del__(self) -> None:
        self.close()
