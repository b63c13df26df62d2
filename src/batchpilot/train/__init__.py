"""Training: the engine and the parts it composes.

:mod:`~batchpilot.train.engine` (``Engine.step``: the composition), :mod:`~batchpilot.train.adapt`
(the micro-batch: first split, growth, shrinking on pressure and OOM, agreed over ranks),
:mod:`~batchpilot.train.retry` (what a retry after an OOM puts back),
:mod:`~batchpilot.train.lengths` (sizing each step by its sequence length),
:mod:`~batchpilot.train.noise` (the gradient noise scale), :mod:`~batchpilot.train.batching`
(global = micro × world × accumulation, LR scaling) and :mod:`~batchpilot.train.data` (the
elastic sampler and loader).
"""

from .batching import BatchConfig, rescale_lr, rescale_weight_decay, scale_lr
from .data import ElasticBatchSampler, ElasticLoader
from .engine import BatchDoesNotFitError, Engine, EngineConfig, StepResult
from .lengths import LengthConfig
from .noise import NoiseConfig, NoiseSample

__all__ = [
    "Engine", "EngineConfig", "StepResult", "BatchDoesNotFitError", "LengthConfig", "NoiseConfig", "NoiseSample",
    "BatchConfig", "scale_lr", "rescale_lr", "rescale_weight_decay", "ElasticBatchSampler", "ElasticLoader",
]
