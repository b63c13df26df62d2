"""The planner: a batch size for a device you don't have, from the step run on fake tensors.

:mod:`~batchpilot.plan.planner` (``estimate_peak_memory``, ``plan_batch_size``),
:mod:`~batchpilot.plan.result` (its answers and ``PlanningError``), :mod:`~batchpilot.plan.gpus`
(named GPUs, CUDA accounting), :mod:`~batchpilot.plan.fsdp` (FSDP2 over a fake process group) and
:mod:`~batchpilot.plan.lengths` (the plan at every sequence length).
"""
