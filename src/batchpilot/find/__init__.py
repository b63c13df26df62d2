"""The finder: real trials on the device, the state put back after each.

:mod:`~batchpilot.find.options` (``FindOptions``: every option of the finder, documented where
declared), :mod:`~batchpilot.find.finder` (``find_batch_size``: trials, the search),
:mod:`~batchpilot.find.result` (``BatchPlan``), :mod:`~batchpilot.find.front`
(``find_batch_size_for``: the step built from a model and a batch, seeded by the planner on
request), :mod:`~batchpilot.find.lengths` (the search at several sequence lengths),
:mod:`~batchpilot.find.snapshot` (bit-exact state snapshots), :mod:`~batchpilot.find.timing`
(the clocks and the timed step) and :mod:`~batchpilot.find.notes` (the notes an error from the
step gains during a trial or a search at a sequence length).
"""

from .finder import find_batch_size
from .front import find_batch_size_for
from .lengths import LengthPlan
from .result import BatchPlan

__all__ = ["find_batch_size", "find_batch_size_for", "BatchPlan", "LengthPlan"]
