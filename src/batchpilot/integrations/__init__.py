"""batchpilot where people already train and evaluate: Lightning, Hugging Face ``Trainer``, Accelerate, lm-eval, TRL.

Each integration is its own module and imports only its own framework, on first use:

- :mod:`batchpilot.integrations.lightning`: ``BatchSizeCallback`` sizes the batch at fit start
  (any number of DDP ranks) and ``ResilientModule`` trains through OOMs under manual optimization;
- :mod:`batchpilot.integrations.transformers`: ``configure_batch_size`` fills ``TrainingArguments``
  before the ``Trainer`` is built, and ``ResilientTrainer`` survives OOMs in training and evaluation;
  ``continuous_batching_config`` sizes ``generate_batch``'s paged cache for the memory limit that
  applies (:mod:`batchpilot.integrations.continuous`);
- :mod:`batchpilot.integrations.accelerate`: a drop-in ``find_executable_batch_size`` with the
  finder's search and agreement between ranks;
- :mod:`batchpilot.integrations.lm_eval`: ``BatchpilotLM``, lm-evaluation-harness's ``HFLM`` with
  batches sized by length, registered as the model ``batchpilot``;
- :mod:`batchpilot.integrations.trl`: ``ResilientGRPOTrainer``, TRL's ``GRPOTrainer`` with generation in
  whole prompt groups and training micro-batches sized by batchpilot, OOMs survived, the same update.

``pip install 'batchpilot[integrations]'`` installs the five frameworks at the versions tested.
Importing this package imports none of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._common import BatchSetup, SizingOptions

__all__ = ["BatchSetup", "SizingOptions", "lightning", "transformers", "accelerate", "lm_eval", "trl"]

_MODULES = ("lightning", "transformers", "accelerate", "lm_eval", "trl")


def __getattr__(name: str) -> ModuleType:
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'batchpilot.integrations' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
