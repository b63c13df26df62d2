"""The one loss convention of the engine, the finder and the planner.

``loss_fn(model, batch)`` returns the batch's mean loss (a 0-dim tensor) or a ``(sum, count)``
pair for losses averaged over something other than samples (tokens that are not padding).
A torch criterion (``nn.CrossEntropyLoss()``, or a function of ``torch.nn.functional`` such as
``F.cross_entropy``) is applied as ``criterion(model(inputs), targets)`` to ``(inputs, targets)``
batches.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Callable, Literal

import torch
from torch import nn

__all__ = ["LossFn", "as_loss_fn", "supervised_loss", "parse_loss", "call_model", "forward_only", "is_criterion"]

#: ``loss_fn(model, batch) -> mean loss | (sum, count)``
LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, torch.Tensor | int | float]"]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict of inputs (Hugging Face style), else ``model(inputs)``."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def is_criterion(fn: Any) -> bool:
    """A torch loss module, or a loss function of ``torch.nn.functional`` (``F.cross_entropy``)."""
    if isinstance(fn, nn.modules.loss._Loss):
        return True
    return callable(fn) and getattr(fn, "__module__", None) == "torch.nn.functional"


def supervised_loss(criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LossFn:
    """``loss_fn`` for ``(inputs, targets)`` batches: ``criterion(model(inputs), targets)``.

    A criterion with ``reduction="sum"`` is returned as ``(sum, number of samples)`` so that it
    is still averaged over the whole global batch.

    Raises:
        ValueError: the criterion's reduction is ``"none"`` (the step needs a scalar), or, when
            called, a batch that is not an ``(inputs, targets)`` pair.
    """
    reduction = getattr(criterion, "reduction", "mean")
    if reduction == "none":
        raise ValueError(
            "the criterion has reduction='none', which gives one loss per element; use "
            "reduction='mean' (or 'sum'), or write loss_fn(model, batch) returning loss.mean() or "
            "(loss.sum(), count)"
        )

    def loss_fn(model: nn.Module, batch: Any) -> Any:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(
                f"a criterion ({_name(criterion)}) needs batches of (inputs, targets), got "
                f"{type(batch).__name__}; for other batches (a dict, say) pass "
                "loss_fn=lambda model, batch: ... returning the loss or (sum, count)"
            )
        inputs, targets = batch
        loss = criterion(call_model(model, inputs), targets)
        return (loss, targets.shape[0]) if reduction == "sum" else loss

    loss_fn.criterion = criterion  # type: ignore[attr-defined]
    return loss_fn


def as_loss_fn(loss_fn: Any) -> LossFn:
    """Accept a ``loss_fn(model, batch)`` or a torch criterion.

    Raises:
        TypeError: ``loss_fn`` is not callable.
        ValueError: a criterion with ``reduction='none'``.
    """
    if is_criterion(loss_fn):
        return supervised_loss(loss_fn)
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, batch) or be a torch criterion, got "
            f"{type(loss_fn).__name__}"
        )
    return loss_fn


def forward_only(loss_fn: LossFn | None) -> Callable[[nn.Module, Any], Any]:
    """What an inference step runs: the model on the batch's inputs (no loss for a criterion).

    Without a ``loss_fn`` (or with a criterion): ``(inputs, targets)`` → ``model(inputs)``, a
    dict → ``model(**batch)``, else ``model(batch)``. A ``loss_fn(model, batch)`` of your own
    runs as it is (its forward is the cost; the loss is a few bytes).
    """
    if loss_fn is not None and getattr(loss_fn, "criterion", None) is None:
        return loss_fn

    def forward(model: nn.Module, batch: Any) -> Any:
        pair = isinstance(batch, (tuple, list)) and len(batch) == 2
        return call_model(model, batch[0] if pair else batch)

    return forward


def parse_loss(out: Any) -> tuple[torch.Tensor, Any, Literal["mean", "sum"]]:
    """``(loss, count, kind)`` from what a ``loss_fn`` returned.

    Raises:
        ValueError: not a 0-dim tensor or a ``(sum, count)`` pair, a non-scalar loss (the message
            says how to reduce it), or a loss that does not require grad.
    """
    if isinstance(out, torch.Tensor):
        loss, count, kind = out, None, "mean"
    elif isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        loss, count, kind = out[0], out[1], "sum"
        if not isinstance(count, (numbers.Real, torch.Tensor)) or isinstance(count, bool):
            raise ValueError(f"the count in a (sum, count) loss must be a number or a tensor, got {type(count).__name__}")
    else:
        raise ValueError(
            "loss_fn must return the batch's mean loss as a 0-dim tensor, or a (sum, count) pair; "
            f"got {type(out).__name__}"
        )
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)}, not a scalar (reduction='none'?); "
            "reduce it: loss.mean(), or return (loss.sum(), count) for a per-element average"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: was it computed under torch.no_grad(), from "
            "detached outputs, or with every parameter frozen?"
        )
    return loss, count, kind  # type: ignore[return-value]


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__
