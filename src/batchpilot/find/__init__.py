"""The finder: real trials on the device, the state put back after each.

:mod:`~batchpilot.find.options` (``FindOptions``: every option of the finder, documented where
declared), :mod:`~batchpilot.find.finder` (``find_batch_size``: trials, the search),
:mod:`~batchpilot.find.result` (``BatchPlan``), :mod:`~batchpilot.find.front`
(``find_batch_size_for``: the step built from a model and a batch, seeded by the planner on
request), :mod:`~batchpilot.find.lengths` (the search at several sequence lengths),
:mod:`~batchpilot.find.snapshot` (bit-exact state snapshots), :mod:`~batchpilot.find.timing`
(the clocks and the timed step) and :mod:`~batchpilot.find.notes` (the note an error from the step
gains during a trial).
"""
