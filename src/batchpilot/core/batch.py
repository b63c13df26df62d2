"""Batches as users have them: which parts are per-sample, how to cut and grow them.

One set of rules for the engine, the finder and the planner. A batch is any pytree (tuple,
list, dict, namedtuple, nested) with the samples on dim 0:

* a tensor with a dim 0 is per-sample, unless its dict key is declared ``shared``
  (a positions tensor of shape ``(T,)`` next to ``(B, T)`` ids, a mask shared by all samples);
* a list or tuple holding no tensor (names, ids, raw strings) is per-sample when its length is
  the batch size, and passes through otherwise;
* a ``list`` of tensors is structure (like ``(inputs, targets)``); only when that leaves the
  batch size ambiguous is it read as one tensor per sample (images of different sizes);
* everything else (0-dim tensors, numbers, strings, ``None``) passes through unchanged.

When the sizes still disagree the error names the shapes and the fix (``shared=``, or a
``split_fn(batch, start, stop)`` that cuts the batch your way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

__all__ = ["BatchLayout", "BatchSplitter", "batch_size_of", "make_batch_fn", "SplitFn"]

#: ``split_fn(batch, start, stop) -> the samples start .. stop-1 of batch``
SplitFn = Callable[[Any, int, int], Any]

_ROWS, _SEQ, _PASS = "rows", "seq", "pass"


@dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """What in a batch is not per-sample, or how to cut it.

    Attributes:
        shared: dict keys (at any depth) whose values are the same for every sample and pass
            through to each micro-batch whole.
        split_fn: ``split_fn(batch, start, stop)`` returning samples ``start .. stop-1``; used
            instead of the rules above for cutting. The batch size is still read by the rules.

    Raises:
        TypeError: ``shared`` is not a string or an iterable of strings, or ``split_fn`` is not callable.
    """

    shared: frozenset[str] = field(default_factory=frozenset)
    split_fn: SplitFn | None = None

    def __post_init__(self) -> None:
        shared = self.shared
        if isinstance(shared, str):
            shared = (shared,)
        try:
            keys = frozenset(shared)
        except TypeError:
            raise TypeError(f"shared must be a dict key or a set of keys, got {self.shared!r}") from None
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"shared must name dict keys (strings), got {sorted(map(repr, keys))}")
        object.__setattr__(self, "shared", keys)
        if self.split_fn is not None and not callable(self.split_fn):
            raise TypeError(f"split_fn must be callable as split_fn(batch, start, stop), got {self.split_fn!r}")

    @classmethod
    def of(cls, shared: str | Iterable[str] | None = None, split_fn: SplitFn | None = None) -> BatchLayout | None:
        """The layout for the ``shared=`` / ``split_fn=`` keywords, or ``None`` when neither is given."""
        if shared is None and split_fn is None:
            return None
        return cls(shared=frozenset() if shared is None else shared, split_fn=split_fn)


_DEFAULT = BatchLayout()


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


class _Reader:
    """Walks a batch once, classifying every part as per-sample rows, a per-sample sequence, or passed through."""

    def __init__(self, layout: BatchLayout, tensor_lists: bool) -> None:
        self.layout = layout
        self.tensor_lists = tensor_lists
        self.sizes: list[tuple[str, int, str]] = []  # (path, size, what) of the per-sample parts
        self.seen_keys: set[str] = set()

    def read(self, obj: Any, path: str, shared: bool) -> Any:
        """A tree mirroring ``obj`` whose leaves are ``(kind, value)``."""
        if isinstance(obj, torch.Tensor):
            if obj.dim() > 0 and not shared:
                self.sizes.append((path, obj.shape[0], f"tensor {tuple(obj.shape)}"))
                return (_ROWS, obj)
            return (_PASS, obj)
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                declared = isinstance(k, str) and k in self.layout.shared
                if declared:
                    self.seen_keys.add(k)
                out[k] = self.read(v, f"{path}[{k!r}]", shared or declared)
            return ("dict", type(obj), out)
        if isinstance(obj, (list, tuple)):
            if not _has_tensor(obj):
                # names, ids, strings: per-sample if their count is the batch size (decided later)
                return ("maybe_seq", obj, shared)
            if self.tensor_lists and type(obj) is list and all(isinstance(v, torch.Tensor) for v in obj):
                if not shared:
                    self.sizes.append((path, len(obj), f"list of {len(obj)} tensors"))
                    return (_SEQ, obj)
                return (_PASS, obj)
            items = [self.read(v, f"{path}[{i}]", shared) for i, v in enumerate(obj)]
            return ("seq_struct", type(obj), items)
        return (_PASS, obj)


def _settle(node: Any, size: int) -> Any:
    """Decide the "maybe" sequences now that the batch size is known."""
    tag = node[0]
    if tag == "dict":
        return ("dict", node[1], {k: _settle(v, size) for k, v in node[2].items()})
    if tag == "seq_struct":
        return ("seq_struct", node[1], [_settle(v, size) for v in node[2]])
    if tag == "maybe_seq":
        _, obj, shared = node
        return (_SEQ, obj) if not shared and len(obj) == size else (_PASS, obj)
    return node


def _rebuild(node: Any, leaf: Callable[[str, Any], Any]) -> Any:
    tag = node[0]
    if tag == "dict":
        kind, items = node[1], {k: _rebuild(v, leaf) for k, v in node[2].items()}
        try:
            return kind(items)
        except TypeError:  # a Mapping type that cannot be built from a dict
            return items
    if tag == "seq_struct":
        kind, items = node[1], [_rebuild(v, leaf) for v in node[2]]
        if hasattr(kind, "_fields"):  # namedtuple
            return kind(*items)
        return kind(items)
    return leaf(tag, node[1])


def _map_leaves(node: Any, leaf: Callable[[str, Any], Any]) -> Any:
    """The tree with each leaf's value replaced by ``leaf(kind, value)``, every kind kept."""
    tag = node[0]
    if tag == "dict":
        return ("dict", node[1], {k: _map_leaves(v, leaf) for k, v in node[2].items()})
    if tag == "seq_struct":
        return ("seq_struct", node[1], [_map_leaves(v, leaf) for v in node[2]])
    return (tag, leaf(tag, node[1]))


def _ambiguous(sizes: list[tuple[str, int, str]]) -> str:
    parts = ", ".join(f"{path or 'batch'}: {what}" for path, _, what in sizes)
    return (
        f"the batch's parts disagree on the batch size (dim 0): {parts}. Declare the parts that are "
        "the same for every sample with shared={'key', ...} (e.g. a positions tensor), or pass "
        "split_fn(batch, start, stop) to cut the batch yourself"
    )


class BatchSplitter:
    """One batch, read once by the rules above, sliced into micro-batches on demand.

    Raises:
        ValueError: no per-sample tensor, sizes that disagree (the message names the parts and
            the fix), or a ``shared`` key that is not in the batch.
    """

    __slots__ = ("batch", "layout", "tree", "size")

    def __init__(self, batch: Any, layout: BatchLayout | None = None) -> None:
        self.batch = batch
        self.layout = layout or _DEFAULT
        tree, sizes, reader = self._read(tensor_lists=False)
        distinct = {s for _, s, _ in sizes}
        if len(distinct) > 1:
            tree2, sizes2, reader2 = self._read(tensor_lists=True)
            if len({s for _, s, _ in sizes2}) == 1:
                tree, sizes, reader, distinct = tree2, sizes2, reader2, {sizes2[0][1]}
        missing = self.layout.shared - reader.seen_keys
        if missing:
            raise ValueError(
                f"shared names {sorted(missing)}, which the batch does not have; its dict keys are "
                f"{sorted(_dict_keys(batch))}"
            )
        if not distinct:
            raise ValueError(
                "the batch has no tensor with a batch dimension; pass a tensor or a tuple / list / dict "
                "of tensors whose dim 0 is the batch"
            )
        if len(distinct) > 1:
            raise ValueError(_ambiguous(sizes))
        self.size = distinct.pop()
        self.tree = _settle(tree, self.size)

    def _read(self, *, tensor_lists: bool) -> tuple[Any, list, _Reader]:
        reader = _Reader(self.layout, tensor_lists)
        tree = reader.read(self.batch, "", False)
        return tree, reader.sizes, reader

    def slice(self, start: int, length: int, device: torch.device | None = None) -> Any:
        """Samples ``start .. start+length`` (views of the tensors), moved to ``device`` if given."""
        if self.layout.split_fn is not None:
            out = self.layout.split_fn(self.batch, start, start + length)
            return out if device is None else to_device(out, device)

        def leaf(kind: str, value: Any) -> Any:
            if kind == _ROWS:
                value = value.narrow(0, start, length)
            elif kind == _SEQ:
                value = value[start:start + length]
            return value if device is None else to_device(value, device)

        return _rebuild(self.tree, leaf)

    def narrow(self, start: int, length: int) -> BatchSplitter:
        """A splitter over samples ``start .. start+length`` that reads them as this one does.

        Reading the slice afresh can read it otherwise: a list of per-sample token tensors whose
        slice holds tensors of one length (one sample, or equal lengths) reads as a list of tensors
        whose dim 0, the tokens, is the batch. With a ``split_fn`` the slice is read by the rules.
        """
        if self.layout.split_fn is not None:
            return BatchSplitter(self.slice(start, length), self.layout)

        def leaf(kind: str, value: Any) -> Any:
            if kind == _ROWS:
                return value.narrow(0, start, length)
            if kind == _SEQ:
                return value[start:start + length]
            return value

        out = object.__new__(BatchSplitter)
        out.layout, out.size = self.layout, length
        out.tree = _map_leaves(self.tree, leaf)
        out.batch = _rebuild(out.tree, lambda kind, value: value)
        return out

    def repeat_rows(self, b: int) -> Any:
        """A batch of ``b`` samples: rows ``0, 1, …, b-1`` modulo the size, each part its own copy.

        Tensors are gathered (``index_select``), so the result owns exactly ``b`` rows, like a
        freshly loaded batch. With a ``split_fn`` only ``b <= size`` is possible.

        Raises:
            ValueError: ``b`` is above the size and a ``split_fn`` cuts the batch.
        """
        n = self.size
        if self.layout.split_fn is not None:
            if b > n:
                raise ValueError(
                    f"a split_fn can cut at most the {n} samples of the example batch, not {b}; pass "
                    f"max_batch_size={n} or a function batch_size -> batch"
                )
            return self.layout.split_fn(self.batch, 0, b)

        def leaf(kind: str, value: Any) -> Any:
            if kind == _ROWS:
                idx = torch.arange(b, device=value.device).remainder_(n)
                return value.index_select(0, idx)
            if kind == _SEQ:
                return type(value)(value[i % n] for i in range(b))
            return value

        return _rebuild(self.tree, leaf)

    def map_rows(self, fn: Callable[[torch.Tensor], Any], seq: Callable[[Any], Any] | None = None) -> Any:
        """The batch with ``fn`` applied to every per-sample tensor (and ``seq`` to per-sample sequences)."""

        def leaf(kind: str, value: Any) -> Any:
            if kind == _ROWS:
                return fn(value)
            if kind == _SEQ and seq is not None:
                return seq(value)
            return value

        return _rebuild(self.tree, leaf)


def _dict_keys(obj: Any) -> set[str]:
    keys: set[str] = set()
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            keys.add(str(k))
            keys |= _dict_keys(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            keys |= _dict_keys(v)
    return keys


def to_device(obj: Any, device: torch.device) -> Any:
    """Every tensor in ``obj`` moved to ``device`` (non-blocking: from pinned memory it overlaps)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        try:
            return type(obj)({k: to_device(v, device) for k, v in obj.items()})
        except TypeError:
            return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and _has_tensor(obj):
        items = [to_device(v, device) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def batch_size_of(batch: Any, layout: BatchLayout | None = None) -> int:
    """The number of samples in ``batch`` by the rules above.

    Raises:
        ValueError: as :class:`BatchSplitter`.
    """
    return BatchSplitter(batch, layout).size


def make_batch_fn(batch: Any, layout: BatchLayout | None = None) -> Callable[[int], Any]:
    """A function ``b -> batch of b samples`` built from an example batch (or the function itself).

    A batch of b takes samples ``0, 1, …, b-1`` modulo the example's size of every per-sample
    part (:meth:`BatchSplitter.repeat_rows`); shared parts pass through. A callable is
    returned unchanged.

    Raises:
        ValueError: as :class:`BatchSplitter`.
    """
    if callable(batch) and not isinstance(batch, torch.Tensor):
        return batch
    return BatchSplitter(batch, layout).repeat_rows
