"""The sequence dimension of a batch: its padded length, trimming it, and each sample's real length.

The padded length of a batch comes from, in order: a user's ``length_fn(batch)``, the size of
a declared sequence dimension (``seq_dim``, on every per-sample tensor that has it), or the
width of a Hugging Face dict batch (its ``attention_mask``, else its ``input_ids``, else its ``labels``). Trimming narrows every per-sample tensor whose
size on ``seq_dim`` is the padded length, so labels of another shape pass through. A sample's
real length comes from the ``attention_mask``, or from ``labels`` of -100 at the pads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from .._checks import check_int, positive_int
from .batch import BatchLayout, BatchSplitter

__all__ = ["IGNORE_INDEX", "LengthFn", "padded_length", "trim_batch", "sample_lengths", "gather_rows", "length_batch_fn"]

#: ``length_fn(batch) -> the batch's padded sequence length``
LengthFn = Callable[[Any], int]

#: the label of a padding token: ``cross_entropy``'s default ``ignore_index``, as Hugging Face pads labels
IGNORE_INDEX = -100


def _tensors_with_dim(split: BatchSplitter, seq_dim: int) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    split.map_rows(lambda t: found.append(t) if t.dim() > seq_dim else None)
    return found


def padded_length(batch: Any, *, seq_dim: int | None = None, length_fn: LengthFn | None = None,
                  layout: BatchLayout | None = None) -> int:
    """The padded sequence length of ``batch``.

    Raises:
        ValueError: ``length_fn`` returned something other than a positive int; ``seq_dim``
            is declared but no per-sample tensor has that dimension (the message lists the
            shapes); neither is given and the batch is not a dict with a 2-D ``attention_mask``,
            ``input_ids`` or ``labels``.
    """
    if length_fn is not None:
        # the user's function reads the user's batch, never the engine's splitter around it
        raw = batch.batch if isinstance(batch, BatchSplitter) else batch
        return positive_int("length_fn(batch)", length_fn(raw))
    if seq_dim is not None:
        check_int("seq_dim", seq_dim, minimum=1, hint=" (dim 0 is the batch)")
        split = batch if isinstance(batch, BatchSplitter) else BatchSplitter(batch, layout)
        found = _tensors_with_dim(split, seq_dim)
        if not found:
            shapes: list[tuple[int, ...]] = []
            split.map_rows(lambda t: shapes.append(tuple(t.shape)))
            raise ValueError(
                f"the declared sequence dimension seq_dim={seq_dim} is missing from the batch: its per-sample "
                f"tensors have shapes {shapes}; declare the dim that holds the tokens (1 for (batch, length) "
                "ids), or pass length_fn=lambda batch: <its padded length>"
            )
        return positive_int("the padded length", max(int(t.shape[seq_dim]) for t in found))
    raw = batch.batch if isinstance(batch, BatchSplitter) else batch
    for key in _WIDTH_KEYS:
        t = raw.get(key) if isinstance(raw, Mapping) else None
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            return positive_int(f"the {key}'s width", int(t.shape[1]))
    raise ValueError(
        "cannot tell the batch's sequence length: it is not a dict with a (batch, length) attention_mask, input_ids "
        "or labels; declare seq_dim= (the dim that holds the tokens, e.g. 1) or pass length_fn=lambda batch: <length>"
    )


#: the keys of a Hugging Face dict batch that are (batch, length), in the order they are read
_WIDTH_KEYS = ("attention_mask", "input_ids", "labels")


def trim_batch(batch: Any, length: int, *, seq_dim: int = 1, width: int | None = None,
               layout: BatchLayout | None = None, copy: bool = False) -> Any:
    """``batch`` with every per-sample tensor of size ``width`` on ``seq_dim`` narrowed to ``length``.

    ``width`` defaults to the batch's padded length on ``seq_dim``; ``copy=True`` makes the
    trimmed tensors contiguous copies (an example batch whose memory should follow the length).

    Raises:
        ValueError: ``length`` above ``width`` (an example batch too short for the lengths asked).
    """
    split = batch if isinstance(batch, BatchSplitter) else BatchSplitter(batch, layout)
    if width is None:
        width = padded_length(split, seq_dim=seq_dim)
    if length > width:
        raise ValueError(
            f"the batch is {width} long on seq_dim={seq_dim}, shorter than the length {length} asked for; pass an "
            f"example batch padded to the longest length, or a function (batch_size, length) -> batch"
        )

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > seq_dim and t.shape[seq_dim] == width:
            t = t.narrow(seq_dim, 0, length)
            return t.contiguous() if copy else t
        return t

    return split.map_rows(cut)


def sample_lengths(batch: Any) -> list[int]:
    """Each sample's real length, from the ``attention_mask`` or, without one, from the ``labels``.

    With a mask: its ones, which must come first (right padding). Without one: up to the last
    label that is not :data:`IGNORE_INDEX` (-100, the padding convention of
    ``cross_entropy(ignore_index=-100)`` and Hugging Face collators). What follows that label
    changes no loss term only in a causal model (no token attends to a later one), which a padded
    batch without a mask must be for its padding not to change the loss; prompt tokens masked
    with -100 before the answer are kept.

    Raises:
        ValueError: not a dict with a 2-D ``attention_mask`` or 2-D ``labels``, or a left-padded /
            gapped mask (trimming the right end would cut real tokens).
    """
    raw = batch if isinstance(batch, Mapping) else None
    mask = raw.get("attention_mask") if raw is not None else None
    labels = raw.get("labels") if raw is not None else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        m = mask.bool()
        lengths = m.sum(dim=1)
        expected = torch.arange(m.shape[1], device=m.device)[None, :] < lengths[:, None]
        if not torch.equal(m, expected):  # one sync per step: the split is planned on the host
            raise ValueError(
                "length-aware splitting needs right-padded batches (each attention_mask row all ones, then all "
                "zeros); pad on the right (tokenizer.padding_side = 'right'), or turn split off"
            )
    elif isinstance(labels, torch.Tensor) and labels.dim() == 2:
        positions = torch.arange(1, labels.shape[1] + 1, device=labels.device)
        lengths = torch.where(labels != IGNORE_INDEX, positions[None, :], 0).amax(dim=1)
    else:
        raise ValueError(
            "length-aware splitting needs dict batches with a (batch, length) attention_mask, or (batch, length) "
            f"labels with {IGNORE_INDEX} at the pads (Hugging Face style); turn split off for other batches"
        )
    return [max(1, int(v)) for v in lengths.tolist()]


def gather_rows(split: BatchSplitter, index: list[int]) -> Any:
    """The batch's samples in the order ``index`` (per-sample tensors gathered, lists reordered)."""
    cache: dict[torch.device, torch.Tensor] = {}

    def rows(t: torch.Tensor) -> torch.Tensor:
        idx = cache.get(t.device)
        if idx is None:
            idx = cache[t.device] = torch.tensor(index, dtype=torch.long, device=t.device)
        return t.index_select(0, idx)

    return split.map_rows(rows, lambda seq: type(seq)(seq[i] for i in index))


def length_batch_fn(batch: Any, lengths: tuple[int, ...], *, seq_dim: int | None) -> Callable[[int], Any]:
    """``length -> example batch`` (trimmed copy), or ``length -> (b -> batch(b, length))`` for a function.

    Raises:
        ValueError: the declared ``seq_dim`` is missing, or the example batch is shorter than
            the longest length.
    """
    if callable(batch) and not isinstance(batch, torch.Tensor):
        return lambda L: (lambda b: batch(b, L))
    dim = 1 if seq_dim is None else seq_dim
    width = padded_length(batch, seq_dim=dim)
    if width < lengths[-1]:
        raise ValueError(
            f"the example batch is {width} long on seq_dim={dim}, shorter than the longest length {lengths[-1]}; pass "
            f"an example padded to {lengths[-1]} (e.g. padded_lm_batch(..., pad_to={lengths[-1]})) or a function "
            "(batch_size, length) -> batch"
        )
    return lambda L: trim_batch(batch, L, seq_dim=dim, width=width, copy=True)
