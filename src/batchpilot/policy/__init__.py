"""Pure, torch-free policies: the decisions, with no device in sight.

:mod:`~batchpilot.policy.search` (which batch size to try next), :mod:`~batchpilot.policy.microbatch`
(how the engine's micro-batch grows and shrinks), :mod:`~batchpilot.policy.lengths` (memory over
batch and sequence length), :mod:`~batchpilot.policy.schedule` (the global batch over training) and
:mod:`~batchpilot.policy.speed` (step time, throughput, the split of a batch). They import nothing
but :mod:`batchpilot._checks` and each other, and never torch (a test holds it).
"""

from .lengths import LengthBudget, LengthFit, UnverifiedLengthError
from .schedule import LR_SCALE_RULES, AdaptiveSchedule, BatchSchedule, ConstantSchedule, RampSchedule, parse_schedule
from .search import STRATEGIES, BatchSizeError, NothingFitsError, Trial, decay_batch_step

__all__ = [
    "STRATEGIES", "decay_batch_step", "Trial", "BatchSizeError", "NothingFitsError",
    "LengthFit", "LengthBudget", "UnverifiedLengthError",
    "BatchSchedule", "ConstantSchedule", "RampSchedule", "AdaptiveSchedule", "parse_schedule", "LR_SCALE_RULES",
]
