"""The vocabulary every layer above shares: what a batch is and how the step runs.

:mod:`~batchpilot.core.batch` and :mod:`~batchpilot.core.seqbatch` (the batch rules: splitting,
sizes, sequence lengths), :mod:`~batchpilot.core.loss` (the loss convention),
:mod:`~batchpilot.core.amp` (autocast), :mod:`~batchpilot.core.compiled` (``torch.compile``'d
models), :mod:`~batchpilot.core.ranks` (rank and world size),
:mod:`~batchpilot.core.sharding` (``fully_shard`` models) and :mod:`~batchpilot.core.model` (a model's
device and context length). No memory, finder or engine here.
"""
