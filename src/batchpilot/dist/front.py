"""``find_batch_size_for`` with the search a model's ranks need: the package's public door.

:func:`batchpilot.find.front.find_batch_size_for` measures a step under whatever search it is
given; which search a model needs is a distributed fact: a ``fully_shard`` model over several ranks
must run every trial on all ranks together (:func:`batchpilot.dist.fsdp.find_batch_size_fsdp`).
This layer knows both, so it picks the search here and the finder stays below ``dist``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from ..core.sharding import sharded_over_ranks
from ..find.front import find_batch_size_for as _find_for
from ..find.result import BatchPlan

__all__ = ["find_batch_size_for"]


@functools.wraps(_find_for)
def find_batch_size_for(model: nn.Module, batch: Any, *args: Any,
                        search: Callable[..., BatchPlan] | None = None, **kwargs: Any) -> Any:
    if search is None and sharded_over_ranks(model):
        from .fsdp import find_batch_size_fsdp  # on first use: DDP-only and one-process jobs never load FSDP

        search = find_batch_size_fsdp
    return _find_for(model, batch, *args, search=search, **kwargs)
