"""batchpilot: pick and keep the best batch size for a PyTorch job.

The names below are the stable public API. The planner, the distributed helpers
and the main job are imported on first use: they pull in fake tensors and
torch.distributed, which a plain training script should not pay for.
"""

from __future__ import annotations

import importlib
from typing import Any

from .find.finder import find_batch_size
from .find.front import find_batch_size_for
from .find.lengths import LengthPlan
from .find.options import FindOptions
from .find.result import BatchPlan
from .memory.oom import attempt, free_memory, is_oom
from .memory.probes import emulate_capacity, get_probe, track_peak
from .memory.tracker import StorageTracker
from .memory.units import parse_bytes
from .policy.lengths import LengthBudget, LengthFit, UnverifiedLengthError
from .policy.schedule import AdaptiveSchedule, ConstantSchedule, RampSchedule, parse_schedule
from .policy.search import BatchSizeError, NothingFitsError
from .train.batching import BatchConfig, rescale_lr, rescale_weight_decay, scale_lr
from .train.data import ElasticBatchSampler, ElasticLoader
from .train.engine import BatchDoesNotFitError, Engine, EngineConfig, StepResult
from .train.lengths import LengthConfig
from .train.noise import NoiseConfig, NoiseSample

__version__ = "0.2.0"

_LAZY = {
    "estimate_peak_memory": "plan.planner",
    "plan_batch_size": "plan.planner",
    "PlanningError": "plan.result",
    "MemoryEstimate": "plan.result",
    "PlanResult": "plan.result",
    "DistributedCoordinator": "dist.distributed",
    "find_batch_size_distributed": "dist.distributed",
    "init_distributed": "dist.distributed",
    "FSDPCoordinator": "dist.fsdp",
    "CollectiveOOMError": "dist.fsdp",
    "find_batch_size_fsdp": "dist.fsdp",
    "TrainConfig": "app.trainjob",
    "run_training": "app.trainjob",
}

__all__ = [
    # oom
    "is_oom", "free_memory", "attempt",
    # memory
    "get_probe", "track_peak", "emulate_capacity", "parse_bytes", "StorageTracker",
    # finder
    "find_batch_size", "find_batch_size_for", "FindOptions", "BatchPlan", "BatchSizeError", "NothingFitsError",
    # batch arithmetic and LR
    "BatchConfig", "scale_lr", "rescale_lr", "rescale_weight_decay",
    # data
    "ElasticBatchSampler", "ElasticLoader",
    # engine
    "Engine", "EngineConfig", "StepResult", "BatchDoesNotFitError",
    # sequence length: memory over (batch, length)
    "LengthConfig", "LengthPlan", "LengthFit", "LengthBudget", "UnverifiedLengthError",
    # statistical efficiency: the gradient noise scale and global-batch schedules
    "NoiseConfig", "NoiseSample", "ConstantSchedule", "RampSchedule", "AdaptiveSchedule", "parse_schedule",
    # lazily imported
    *_LAZY,
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchpilot' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
