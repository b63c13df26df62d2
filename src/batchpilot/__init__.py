"""batchpilot: pick and keep the best batch size for a PyTorch job.

The top level holds what a script needs to find, plan and train: the two finders and their
answer, the planner, the engine and its configs, ``emulate_capacity`` and the errors. Everything
else is public in its subpackage (``batchpilot.memory``, ``.policy``, ``.find``, ``.plan``,
``.dist``, ``.train``), each with its own ``__all__``. The planner is imported on first use: it
pulls in fake tensors, which a plain training script should not pay for.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from .find.finder import find_batch_size
from .dist.front import find_batch_size_for
from .find.options import FindOptions
from .find.result import BatchPlan
from .memory.probes import emulate_capacity
from .policy.lengths import UnverifiedLengthError
from .policy.search import BatchSizeError, NothingFitsError
from .train.engine import BatchDoesNotFitError, Engine, EngineConfig, StepResult
from .train.lengths import LengthConfig
from .train.noise import NoiseConfig

__version__ = "0.2.0"


_LAZY = {
    "plan_batch_size": "plan.planner",
    "PlanningError": "plan.result",
}

__all__ = [
    # find the batch size on the device, or plan it for one you don't have
    "find_batch_size", "find_batch_size_for", "FindOptions", "BatchPlan", "plan_batch_size",
    # train with it
    "Engine", "EngineConfig", "StepResult", "LengthConfig", "NoiseConfig",
    # run as on a device of a given size
    "emulate_capacity",
    # the errors
    "BatchSizeError", "NothingFitsError", "BatchDoesNotFitError", "PlanningError", "UnverifiedLengthError",
    "__version__",
]

#: names the top level exported before 0.3.0 -> the module that exports them now
_MOVED = {
    **dict.fromkeys(["is_oom", "free_memory", "attempt", "get_probe", "track_peak", "parse_bytes",
                     "StorageTracker"], "batchpilot.memory"),
    **dict.fromkeys(["BatchConfig", "scale_lr", "rescale_lr", "rescale_weight_decay", "ElasticBatchSampler",
                     "ElasticLoader", "NoiseSample"], "batchpilot.train"),
    **dict.fromkeys(["LengthPlan"], "batchpilot.find"),
    **dict.fromkeys(["LengthFit", "LengthBudget", "ConstantSchedule", "RampSchedule", "AdaptiveSchedule",
                     "parse_schedule"], "batchpilot.policy"),
    **dict.fromkeys(["estimate_peak_memory", "MemoryEstimate", "PlanResult"], "batchpilot.plan"),
    **dict.fromkeys(["DistributedCoordinator", "find_batch_size_distributed", "init_distributed",
                     "FSDPCoordinator", "CollectiveOOMError", "find_batch_size_fsdp"], "batchpilot.dist"),
    **dict.fromkeys(["TrainConfig", "run_training"], "batchpilot.app.trainjob"),
}


def _moved_message(name: str) -> str:
    home = _MOVED[name]
    return (f"batchpilot.{name} moved in 0.3.0: import it from {home} (from {home} import {name}); "
            "the top level keeps only what a script needs to find, plan and train (CHANGELOG.md lists each move)")


def _importing_from() -> bool:
    """Whether the caller of ``__getattr__`` runs ``from batchpilot import name``.

    Python turns an ``AttributeError`` raised there into ``ImportError: cannot import name``,
    dropping its message; an ``ImportError`` of our own keeps it. Elsewhere (``batchpilot.name``,
    ``hasattr``) the error stays an ``AttributeError``.
    """
    import opcode

    frame = sys._getframe(2)  # 0: this function, 1: __getattr__, 2: the code asking
    code = frame.f_code.co_code
    return 0 <= frame.f_lasti < len(code) and code[frame.f_lasti] == opcode.opmap.get("IMPORT_FROM")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        if _importing_from():
            raise ImportError(_moved_message(name), name=__name__)
        raise AttributeError(_moved_message(name), name=name, obj=sys.modules[__name__])
    raise AttributeError(f"module 'batchpilot' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
