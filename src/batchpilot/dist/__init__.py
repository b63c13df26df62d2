"""Distributed training: the coordinators the engine and the finder agree through, DDP and FSDP2.

:mod:`~batchpilot.dist.coordinator` (the ``Coordinator`` protocol and the one-process
``LocalCoordinator``), :mod:`~batchpilot.dist.distributed` (agreement between ranks,
``DistributedCoordinator``, the finder on every rank), :mod:`~batchpilot.dist.gradsync` (deferred
gradient averaging) and :mod:`~batchpilot.dist.fsdp` (FSDP2's ``FSDPCoordinator`` and
``find_batch_size_fsdp``) and :mod:`~batchpilot.dist.front` (``find_batch_size_for`` with the search a
sharded model needs: the package root's).
"""

from __future__ import annotations

from .._checks import lazy_exports

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
    "find_batch_size_for": "front",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
