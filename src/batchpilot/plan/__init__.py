"""The planner: a batch size for a device you don't have, from the step run on fake tensors.

:mod:`~batchpilot.plan.planner` (``estimate_peak_memory``, ``plan_batch_size``),
:mod:`~batchpilot.plan.result` (its answers, a mixed cluster's included, and ``PlanningError``), :mod:`~batchpilot.plan.gpus`
(named GPUs, CUDA accounting), :mod:`~batchpilot.plan.fsdp` (FSDP2 over a fake process group) and
:mod:`~batchpilot.plan.lengths` (the plan at every sequence length).
"""

from __future__ import annotations

from .._checks import lazy_exports

#: name -> the module defining it, imported on first use (the planner pulls in fake tensors)
_LAZY = {
    "plan_batch_size": "planner",
    "estimate_peak_memory": "planner",
    "PlanningError": "result",
    "MemoryEstimate": "result",
    "PlanResult": "result",
    "ClusterPlanResult": "result",
    "RankPlan": "result",
    "GpuSpec": "gpus",
    "gpu_spec": "gpus",
    "known_gpus": "gpus",
}

__all__ = list(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
