"""Training: the engine and the parts it composes.

:mod:`~batchpilot.train.engine` (``Engine.step``: the composition), :mod:`~batchpilot.train.adapt`
(the micro-batch: first split, growth, shrinking on pressure and OOM, agreed over ranks),
:mod:`~batchpilot.train.retry` (what a retry after an OOM puts back),
:mod:`~batchpilot.train.lengths` (sizing each step by its sequence length),
:mod:`~batchpilot.train.noise` (the gradient noise scale), :mod:`~batchpilot.train.batching`
(global = micro × world × accumulation, LR scaling) and :mod:`~batchpilot.train.data` (the
elastic sampler and loader).
"""
