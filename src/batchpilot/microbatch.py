"""Deprecated: the batch rules moved to :mod:`batchpilot.batch`, the loss convention to :mod:`batchpilot.loss`."""

from __future__ import annotations

import warnings

from .batch import BatchSplitter, batch_size_of
from .loss import LossFn, as_loss_fn, supervised_loss

__all__ = ["BatchSplitter", "batch_size_of", "supervised_loss", "as_loss_fn", "LossFn"]

warnings.warn("batchpilot.microbatch is deprecated: use batchpilot.batch and batchpilot.loss",
              DeprecationWarning, stacklevel=2)
