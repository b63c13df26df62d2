"""The vocabulary every layer above shares: what a batch is and how the step runs.

:mod:`~batchpilot.core.batch` and :mod:`~batchpilot.core.seqbatch` (the batch rules: splitting,
sizes, sequence lengths), :mod:`~batchpilot.core.loss` (the loss convention),
:mod:`~batchpilot.core.amp` (autocast), :mod:`~batchpilot.core.compiled` (``torch.compile``'d
models), :mod:`~batchpilot.core.ranks` (rank and world size) and
:mod:`~batchpilot.core.sharding` (``fully_shard`` models). No memory, finder or engine here.
"""
