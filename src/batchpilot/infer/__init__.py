"""Inference sized by length: scoring (forward only) and generation (a KV cache that grows).

- :mod:`~batchpilot.infer.score`: ``score_by_length`` runs forward-only requests (log-likelihoods,
  perplexity, embeddings) longest first, each batch sized for its own padded length;
- :mod:`~batchpilot.infer.generate`: ``generate_by_length`` batches ``model.generate`` by prompt length;
- :mod:`~batchpilot.infer.genmemory`: ``GenerationMemory``, the memory of ``generate`` over batch,
  prompt length and new tokens, fitted by ``fit_generation_memory`` from real trials.
- :mod:`~batchpilot.infer.ranks`: the one exchange of sizes (or failures) between ranks that
  scoring, generation and the lm-eval adapter make per call.

The names are imported on first use.
"""

from __future__ import annotations

from .._checks import lazy_exports

_LAZY = {
    "score_by_length": "score",
    "LengthScorer": "score",
    "ScoreBatch": "score",
    "generate_by_length": "generate",
    "GenerationMemory": "genmemory",
    "fit_generation_memory": "genmemory",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
