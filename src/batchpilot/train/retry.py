"""What the engine's OOM retry puts back before it reruns the same batch.

An attempt that runs out of memory may already have run some forward passes: BatchNorm's
running statistics moved and the RNG advanced (dropout masks drawn). :class:`RetryState`
snapshots both before the first attempt of a step (:meth:`RetryState.snapshot`) and puts them
back before each retry (:meth:`RetryState.restore`), so the retried step computes what one
attempt without an OOM would have. The gradients are the engine's to drop.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BatchDoesNotFitError", "RetryState", "fixed_oom_error", "running_stat_buffers"]


class BatchDoesNotFitError(RuntimeError):
    """Even a micro-batch of one sample runs out of memory."""


def running_stat_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Buffers a forward pass mutates: BatchNorm / InstanceNorm running statistics."""
    out = []
    for mod in model.modules():
        # _NormBase is torch's one base of BatchNorm*d, SyncBatchNorm and InstanceNorm*d (no public alias)
        if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats:
            out += [b for b in (mod.running_mean, mod.running_var, mod.num_batches_tracked) if b is not None]
    return out


class RetryState:
    """The running statistics and RNG state a retried attempt starts from.

    Args:
        model: the module whose BatchNorm / InstanceNorm running statistics are kept.
        device: where the model runs; on CUDA its RNG is kept too.
        buffers: keep the running statistics (one in-place copy of them per step).
        rng: keep the CPU (and CUDA) RNG state, so dropout masks repeat.
    """

    def __init__(self, model: nn.Module, device: torch.device, *, buffers: bool, rng: bool) -> None:
        self.device = device
        self.rng = rng
        self.buffers = running_stat_buffers(model) if buffers else []
        self._saved: list[torch.Tensor] | None = None
        self._cpu_rng: torch.Tensor | None = None
        self._device_rng: torch.Tensor | None = None

    def snapshot(self) -> None:
        """Remember the state the step begins in (before its first attempt)."""
        if self.buffers:
            if self._saved is None:
                self._saved = [b.detach().clone() for b in self.buffers]
            else:
                torch._foreach_copy_(self._saved, self.buffers)
        if self.rng:
            self._cpu_rng = torch.get_rng_state()
            self._device_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def restore(self) -> None:
        """Put back what :meth:`snapshot` saw, before a retry."""
        if self._saved is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self._saved)
        if self.rng and self._cpu_rng is not None:
            torch.set_rng_state(self._cpu_rng)
            if self._device_rng is not None:
                torch.cuda.set_rng_state(self._device_rng, self.device)


def fixed_oom_error(micro: int, device: torch.device, message: str) -> torch.OutOfMemoryError:
    """The error a fixed micro-batch raises on an OOM (on every rank when any rank ran out)."""
    return torch.OutOfMemoryError(
        f"out of memory at the fixed micro-batch {micro} on {device}: {message}; "
        'micro_batch_size="auto" shrinks and retries instead'
    )
