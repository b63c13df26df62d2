"""A real data set that ships inside a package: scikit-learn's handwritten digits.

1,797 grey 8×8 images of the digits 0–9 (the UCI "optdigits" test set), bundled
with scikit-learn, so the main job never downloads anything. Pixels are scaled
from 0..16 to 0..1. The held-out split is stratified, so every class keeps its
share in both halves.

Samples are kept as NumPy arrays: a batch becomes a tensor only when it is cut
(:meth:`DigitsSplit.batch`), so an emulated device capacity counts the batch, as a
real device would, and not the whole data set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["DigitsSplit", "load_digits", "DIGITS_NUM_CLASSES"]

DIGITS_NUM_CLASSES = 10

Layout = Literal["flat", "image"]


@dataclass(kw_only=True, frozen=True)
class DigitsSplit:
    """Train and held-out halves of the digits, as float32 inputs and int64 labels."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int = DIGITS_NUM_CLASSES

    def __post_init__(self) -> None:
        if len(self.train_x) != len(self.train_y) or len(self.test_x) != len(self.test_y):
            raise ValueError("inputs and labels must have the same length")
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise ValueError(f"train and held-out samples differ in shape: {self.train_x.shape[1:]} vs {self.test_x.shape[1:]}")

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one input sample: ``(64,)`` flat, ``(1, 8, 8)`` as an image."""
        return tuple(self.train_x.shape[1:])

    @property
    def num_train(self) -> int:
        return len(self.train_x)

    @property
    def num_test(self) -> int:
        return len(self.test_x)

    def batch(self, indices: np.ndarray | list[int] | torch.Tensor, *, held_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The training (or held-out) samples at ``indices`` as ``(inputs, labels)`` tensors."""
        idx = np.asarray(indices, dtype=np.int64)
        x, y = (self.test_x, self.test_y) if held_out else (self.train_x, self.train_y)
        # fancy indexing copies, so the tensors own their memory and the data set is never aliased
        return torch.from_numpy(x[idx]), torch.from_numpy(y[idx])


def load_digits(*, held_out: float = 0.2, seed: int = 0, layout: Layout = "flat") -> DigitsSplit:
    """Load the bundled digits and split off a stratified held-out part.

    Args:
        held_out: fraction of the 1,797 samples kept for evaluation.
        seed: seed of the split; the same seed gives the same split.
        layout: ``"flat"`` gives 64 features per sample (for an MLP),
            ``"image"`` gives ``1×8×8`` (for a CNN).

    Raises:
        ValueError: ``held_out`` outside (0, 1) or an unknown layout.
        ImportError: scikit-learn is not installed (``pip install batchpilot[cli]``).
    """
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out must be a fraction in (0, 1), got {held_out}")
    if layout not in ("flat", "image"):
        raise ValueError(f"layout must be 'flat' or 'image', got {layout!r}")
    try:
        from sklearn.datasets import load_digits as _sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # an optional extra: say how to get it
        raise ImportError("the digits data set needs scikit-learn: pip install 'batchpilot[cli]'") from exc
    raw = _sk_load_digits()
    x = (raw.data / 16.0).astype(np.float32)
    y = raw.target.astype(np.int64)
    if layout == "image":
        x = x.reshape(-1, 1, 8, 8)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=held_out, random_state=seed, stratify=y)
    return DigitsSplit(
        train_x=np.ascontiguousarray(train_x),
        train_y=np.ascontiguousarray(train_y),
        test_x=np.ascontiguousarray(test_x),
        test_y=np.ascontiguousarray(test_y),
    )
