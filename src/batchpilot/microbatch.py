"""Split a batch pytree into micro-batches, and the loss conventions the engine accepts.

A batch is any pytree (tuple, list, dict, nested) whose tensor leaves share dim 0, the
batch dimension. Micro-batches are views (``narrow``) of those leaves, so splitting copies
nothing; 0-dim tensors and non-tensor leaves are passed to every micro-batch unchanged.

The engine calls ``loss_fn(model, micro_batch)``; it returns either the *mean* loss of the
micro-batch (a 0-dim tensor) or a ``(sum, count)`` pair for losses averaged over something
other than samples (tokens). :func:`supervised_loss` adapts a criterion such as
``nn.CrossEntropyLoss()`` to that convention for ``(inputs, targets)`` batches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["BatchSplitter", "batch_size_of", "supervised_loss", "as_loss_fn", "LossFn"]

#: ``loss_fn(model, micro_batch) -> mean loss | (sum, count)``
LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, torch.Tensor | int | float]"]


def batch_size_of(batch: Any) -> int:
    """The size of dim 0 shared by every tensor leaf of ``batch`` (0-dim tensors excepted).

    Raises:
        ValueError: no tensor leaf has a batch dimension, or two leaves disagree on it.
    """
    return BatchSplitter(batch).size


class BatchSplitter:
    """One batch, flattened once, sliced into micro-batches on demand.

    Raises:
        ValueError: as :func:`batch_size_of`.
    """

    __slots__ = ("leaves", "spec", "batched", "size")

    def __init__(self, batch: Any) -> None:
        leaves, self.spec = tree_flatten(batch)
        self.leaves = leaves
        self.batched = [isinstance(x, torch.Tensor) and x.dim() > 0 for x in leaves]
        sizes = {x.shape[0] for x, b in zip(leaves, self.batched) if b}
        if not sizes:
            raise ValueError(
                "the batch has no tensor with a batch dimension; pass a tensor or a tuple / list / "
                "dict of tensors whose dim 0 is the batch"
            )
        if len(sizes) > 1:
            shapes = [tuple(x.shape) for x, b in zip(leaves, self.batched) if b]
            raise ValueError(
                f"the batch's tensors disagree on dim 0 (the batch dimension): shapes {shapes}; "
                "every tensor in the batch must hold one row per sample"
            )
        self.size = sizes.pop()

    def slice(self, start: int, length: int, device: torch.device | None = None) -> Any:
        """Samples ``start .. start+length`` of every batched leaf, moved to ``device`` if given."""
        out = []
        for x, b in zip(self.leaves, self.batched):
            if b:
                x = x.narrow(0, start, length)
            if device is not None and isinstance(x, torch.Tensor) and x.device != device:
                # non_blocking: from pinned host memory the copy overlaps the previous micro-batch
                x = x.to(device, non_blocking=True)
            out.append(x)
        return tree_unflatten(out, self.spec)

    def split(self, sizes: list[int], device: torch.device | None = None) -> Iterator[Any]:
        """Consecutive micro-batches of the given sizes."""
        start = 0
        for n in sizes:
            yield self.slice(start, n, device)
            start += n


def supervised_loss(criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LossFn:
    """``loss_fn`` for ``(inputs, targets)`` batches: ``criterion(model(inputs), targets)``.

    A criterion with ``reduction="sum"`` is returned as ``(sum, number of samples)`` so that it
    is still averaged over the global batch.

    Raises:
        ValueError: the criterion's reduction is ``"none"`` (the engine needs a scalar).
    """
    reduction = getattr(criterion, "reduction", "mean")
    if reduction == "none":
        raise ValueError(
            "the criterion has reduction='none'; use reduction='mean' (or 'sum'), or write a "
            "loss_fn(model, batch) that reduces to a scalar or returns (sum, count)"
        )

    def loss_fn(model: nn.Module, batch: Any) -> Any:
        inputs, targets = batch
        loss = criterion(model(inputs), targets)
        return (loss, targets.shape[0]) if reduction == "sum" else loss

    loss_fn.criterion = criterion  # type: ignore[attr-defined]
    return loss_fn


def as_loss_fn(loss_fn: Any) -> LossFn:
    """Accept a ``loss_fn(model, batch)`` or a torch criterion (``nn.CrossEntropyLoss()``).

    Raises:
        TypeError: ``loss_fn`` is not callable.
    """
    if isinstance(loss_fn, nn.modules.loss._Loss):
        return supervised_loss(loss_fn)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    return loss_fn
