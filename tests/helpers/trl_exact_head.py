"""TRL's fused LM head computed in the model's own dtype, to tell TRL's float32 rounding from micro-batching.

TRL 1.16 replaces the LM head of a ``GRPOTrainer``'s model by ``trl.kernels.ChunkedLogProbFunction``:
it folds each tile of logits into float32 statistics (``tile.float()``: log Z, the target's logit)
and accumulates the head's gradients in float32 (``_addmm_fp32`` casts float64 tiles down), whatever
the model's dtype. A float64 GRPO update is therefore float32-accurate at best, and TRL against
itself at another per-device batch differs at that level. :func:`exact_head` swaps in the same
function computed by plain ``log_softmax`` in the input's dtype, for TRL and batchpilot alike, so
that an exactness check can hold float64 to float64's precision.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class ExactHead:
    """``ChunkedLogProbFunction.apply``'s signature and outputs (log-probs, entropy), in the input's dtype."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        z = hidden @ weight.t()
        if bias is not None:
            z = z + bias
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        logp = (z / temperature).log_softmax(-1)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return picked, entropy, None, None, None


@contextmanager
def exact_head() -> Iterator[None]:
    """TRL's fused LM head computed by :class:`ExactHead` while the block runs (trl.trainer.utils' kernel name)."""
    import trl.trainer.utils as trl_utils

    fused = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = ExactHead
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = fused
