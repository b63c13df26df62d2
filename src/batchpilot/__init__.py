"""batchpilot: pick and keep the best batch size for a PyTorch job.

The names below are the stable public API. The planner, the distributed helpers
and the main job are imported on first use: they pull in fake tensors and
torch.distributed, which a plain training script should not pay for.
"""

from __future__ import annotations

import importlib
from typing import Any

from .batching import BatchConfig, rescale_lr, rescale_weight_decay, scale_lr
from .data import ElasticBatchSampler, ElasticLoader
from .engine import BatchDoesNotFitError, Engine, EngineConfig, StepResult
from .engine_lengths import LengthConfig
from .find_lengths import LengthPlan
from .find_result import BatchPlan
from .finder import find_batch_size
from .front import find_batch_size_for
from .lengths import LengthBudget, LengthFit, UnverifiedLengthError
from .noise import NoiseConfig, NoiseSample
from .oom import attempt, free_memory, is_oom
from .probes import emulate_capacity, get_probe, track_peak
from .schedule import AdaptiveSchedule, ConstantSchedule, RampSchedule, parse_schedule
from .search import BatchSizeError, NothingFitsError
from .tracker import StorageTracker
from .units import parse_bytes

__version__ = "0.2.0"

_LAZY = {
    "estimate_peak_memory": "plan",
    "plan_batch_size": "plan",
    "PlanningError": "plan",
    "MemoryEstimate": "plan",
    "PlanResult": "plan",
    "DistributedCoordinator": "distributed",
    "find_batch_size_distributed": "distributed",
    "init_distributed": "distributed",
    "FSDPCoordinator": "fsdp",
    "CollectiveOOMError": "fsdp",
    "find_batch_size_fsdp": "fsdp",
    "TrainConfig": "app.trainjob",
    "run_training": "app.trainjob",
}

__all__ = [
    # oom
    "is_oom", "free_memory", "attempt",
    # memory
    "get_probe", "track_peak", "emulate_capacity", "parse_bytes", "StorageTracker",
    # finder
    "find_batch_size", "find_batch_size_for", "BatchPlan", "BatchSizeError", "NothingFitsError",
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
