"""Training: the engine and the parts it composes.

:mod:`~batchpilot.train.engine` (``Engine.step``: micro-batching, OOM retry, regrowth),
:mod:`~batchpilot.train.lengths` (sizing each step by its sequence length),
:mod:`~batchpilot.train.noise` (the gradient noise scale), :mod:`~batchpilot.train.batching`
(global = micro × world × accumulation, LR scaling) and :mod:`~batchpilot.train.data` (the
elastic sampler and loader).
"""
