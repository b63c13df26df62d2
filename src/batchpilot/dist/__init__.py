"""Distributed training: the coordinators the engine and the finder agree through, DDP and FSDP2.

:mod:`~batchpilot.dist.coordinator` (the ``Coordinator`` protocol and the one-process
``LocalCoordinator``), :mod:`~batchpilot.dist.distributed` (agreement between ranks,
``DistributedCoordinator``, the finder on every rank), :mod:`~batchpilot.dist.gradsync` (deferred
gradient averaging) and :mod:`~batchpilot.dist.fsdp` (FSDP2's ``FSDPCoordinator`` and
``find_batch_size_fsdp``).
"""

from __future__ import annotations

import importlib
from typing import Any

#: name -> the module defining it, imported on first use (the engine loads the coordinator protocol
#: alone; the DDP and FSDP2 modules wait until a job asks for them)
_LAZY = {
    "Coordinator": "coordinator",
    "LocalCoordinator": "coordinator",
    "DistributedCoordinator": "distributed",
    "init_distributed": "distributed",
    "find_batch_size_distributed": "distributed",
    "FSDPCoordinator": "fsdp",
    "CollectiveOOMError": "fsdp",
    "find_batch_size_fsdp": "fsdp",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
