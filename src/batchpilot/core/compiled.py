"""``torch.compile``: recognise compiled models, keep them compiled, keep their batch dimension dynamic.

Three facts about dynamo that batchpilot works around (details and numbers in
``docs/internals.md#compiled``):

* a frame dynamo meets under a dispatch mode (a :class:`~batchpilot.memory.tracker.StorageTracker`,
  the planner's counter) is skipped, and the skip is cached on its code object for the rest
  of the process: the model silently runs eager afterwards. :func:`eager_while_tracked` runs
  tracked work under the ``"force_eager"`` compile stance instead, which leaves dynamo's caches
  as they were;
* every new batch size is a new shape: dynamo compiles a static graph for the first size and a
  dynamic one for the second, unless dim 0 is marked dynamic up front (:func:`mark_batch_dynamic`);
  so is every new padded length of a batch sized by length (its ``seq_dim``, marked the same way);
* sizes 0 and 1 are always specialised: a batch of one sample compiles a graph of its own, so
  batchpilot avoids choosing one (:func:`no_single_tail`, :func:`compiled_floor`).

Nothing here imports ``torch._dynamo`` (2-3 s): a model can only be compiled once it is loaded.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from .batch import BatchSplitter
from .seqbatch import padded_length

__all__ = [
    "is_compiled",
    "compiled_modules",
    "eager_while_tracked",
    "compilations",
    "CompileCounter",
    "mark_batch_dynamic",
    "no_single_tail",
    "compiled_floor",
]

logger = logging.getLogger(__name__)


def _dynamo() -> Any:
    """``torch._dynamo`` if something has loaded it, else ``None`` (then nothing is compiled)."""
    return sys.modules.get("torch._dynamo")


def _is_compiled_module(m: nn.Module) -> bool:
    if type(m).__name__ == "OptimizedModule" and type(m).__module__ == "torch._dynamo.eval_frame":
        return True
    # nn.Module.compile() compiles in place: the module keeps its class
    return getattr(m, "_compiled_call_impl", None) is not None


def compiled_modules(*objs: Any) -> list[nn.Module]:
    """The compiled modules in ``objs`` and their submodules: ``torch.compile(m)`` or ``m.compile()``.

    Non-modules (optimizers, tensors, ``None``) are ignored, so a finder's ``restore=`` list
    can be passed as it is.
    """
    if _dynamo() is None:
        return []
    out: list[nn.Module] = []
    seen: set[int] = set()
    for obj in objs:
        if not isinstance(obj, nn.Module):
            continue
        for m in obj.modules():
            if id(m) not in seen and _is_compiled_module(m):
                seen.add(id(m))
                out.append(m)
    return out


def is_compiled(*objs: Any) -> bool:
    """True when any module in ``objs`` is, or contains, a ``torch.compile``'d module."""
    return bool(compiled_modules(*objs))


@contextlib.contextmanager
def eager_while_tracked() -> Iterator[None]:
    """Run compiled code eagerly in this block, and leave dynamo's caches as they were.

    For work a dispatch mode watches: dynamo does not compile under one, and would remember
    each skipped frame for good. Under the ``"force_eager"`` stance it never sees the frames.
    The stance is process-wide: another thread's compiled code runs eagerly meanwhile too.
    Where the stance cannot be set (torch < 2.6, or inside a compiled region) and where
    ``torch._dynamo`` is first loaded inside the block, ``torch._dynamo.reset()`` runs at the
    end instead: the skips are forgotten and compiled models recompile on their next call.
    """
    dynamo = _dynamo()
    stance = None
    if dynamo is not None:
        try:
            stance = torch.compiler.set_stance("force_eager")
        except (AttributeError, RuntimeError) as exc:  # no stance API, or inside a compiled region
            logger.debug("cannot set the force_eager compile stance (%s); dynamo is reset afterwards", exc)
    try:
        yield
    finally:
        if stance is not None:
            stance.__exit__(None, None, None)
        elif _dynamo() is not None:
            _dynamo().reset()


def compilations() -> int:
    """Graphs dynamo has compiled in this process so far (0 when it is not loaded)."""
    dynamo = _dynamo()
    if dynamo is None:
        return 0
    return int(dynamo.utils.counters["stats"]["unique_graphs"])


class CompileCounter:
    """Graphs dynamo compiles between construction and :attr:`count`'s read (any model, any thread)."""

    def __init__(self) -> None:
        self._start = compilations()

    @property
    def count(self) -> int:
        return compilations() - self._start


def mark_batch_dynamic(batch: Any, layout: Any = None, *, seq_dim: int | None = None) -> Any:
    """Mark dim 0 of every per-sample tensor of ``batch`` dynamic for dynamo; returns ``batch``.

    Per-sample by the rules of :mod:`batchpilot.core.batch` (``layout``: its ``BatchLayout``, for
    ``shared`` keys). With ``seq_dim`` (a batch sized by length), that dim is marked too on the
    per-sample tensors as long there as the batch's padded length, so a new length reuses the
    graph; labels of another shape keep theirs. Marking is weak (``maybe_mark_dynamic``): a
    model that specialises on a size still compiles. Without ``torch._dynamo`` loaded it does
    nothing. A size of one is not marked: dynamo specialises it anyway.
    """
    dynamo = _dynamo()
    if dynamo is None:
        return batch
    try:
        split = BatchSplitter(batch, layout)
    except ValueError:
        return batch  # nothing readable to mark: dynamo's automatic dynamic shapes take over
    width = 0
    if seq_dim is not None:
        try:
            width = padded_length(split, seq_dim=seq_dim)
        except ValueError:  # no per-sample tensor has that dim: only the batch dim is marked
            width = 0

    def mark(t: torch.Tensor) -> torch.Tensor:
        if split.size > 1:
            dynamo.maybe_mark_dynamic(t, 0)
        if width > 1 and t.dim() > seq_dim and t.shape[seq_dim] == width:
            dynamo.maybe_mark_dynamic(t, seq_dim)
        return t

    split.map_rows(mark)
    return batch


def no_single_tail(sizes: Iterable[int]) -> list[int]:
    """Micro-batch sizes with a last micro-batch of one sample moved to two; same total.

    A compiled model compiles a graph of its own for a batch of one (dynamo specialises size 1),
    so one sample is taken from the micro-batch before the last. Only when that one keeps at
    least two::

        [32, 32, 1] -> [32, 31, 2]
        [3, 1]      -> [2, 2]
        [2, 2, 1]   -> [2, 2, 1]     (a micro-batch of 2 cannot give one away)
        [1]         -> [1]
    """
    out = list(sizes)
    if len(out) >= 2 and out[-1] == 1 and out[-2] >= 3:
        out[-2] -= 1
        out[-1] = 2
    return out


def compiled_floor(min_batch_size: int, max_batch_size: int | None) -> int:
    """The smallest batch a search of a compiled model starts from: 2 rather than 1 when allowed.

    A trial at 1 would compile a graph of its own (dynamo specialises size 1); the finder tries
    1 only when 2 does not fit::

        compiled_floor(1, None) -> 2
        compiled_floor(1, 1)    -> 1
        compiled_floor(4, 64)   -> 4
    """
    if min_batch_size == 1 and (max_batch_size is None or max_batch_size >= 2):
        return 2
    return min_batch_size
