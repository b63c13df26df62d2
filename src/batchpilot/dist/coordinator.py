"""How the engine agrees with the other data-parallel ranks.

:class:`Coordinator` is the protocol :class:`batchpilot.train.engine.Engine` calls to agree on every
OOM, on the micro-batch and on the ``(sum, count)`` losses' total count, and to average the
gradients when their all-reduce is deferred. :class:`LocalCoordinator` is the one-process
default, where every agreement is the local answer; the data-parallel one is
:class:`batchpilot.dist.distributed.DistributedCoordinator`. Both names are also exported by
:mod:`batchpilot.train.engine`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["Coordinator", "LocalCoordinator"]


@runtime_checkable
class Coordinator(Protocol):
    """How the engine agrees with the other data-parallel ranks.

    Every rank makes the same calls in the same order, so collectives inside them pair up:

    1. ``agree_micro_batch(size)`` when an ``"auto"`` engine picks its first micro-batch;
    2. per attempt at the batch, once the local attempt has returned or failed (never inside
       an ``except`` block): a fixed engine calls ``agree_oom(oom)``; an ``"auto"`` engine calls
       ``agree(oom, next_size)``, which also agrees on the micro-batch of the next step
       (``next_size`` is this rank's proposal, meaningful only where the attempt succeeded).
       After an agreed OOM, an ``"auto"`` engine calls ``agree_micro_batch(smaller)`` and
       retries; a fixed one raises on every rank;
    3. after the successful attempt, ``sync_gradients(model)`` if ``defer_grad_sync``, then
       ``total_count(count)`` for ``(sum, count)`` losses.

    A clean step therefore makes one agreement besides the gradient sync: ``agree`` for an
    ``"auto"`` engine, ``agree_oom`` for a fixed one.

    Optional, for the gradient noise scale over several ranks (:mod:`batchpilot.train.noise`):
    ``sync_gradients_and_sum(model, values) -> values summed over ranks`` replaces step 3's
    ``sync_gradients`` (the values ride in its collective), and ``sum_over_ranks(values)`` sums
    them alone when the sync is not deferred. A coordinator of several ranks without them gets
    no noise measurement.

    Optional hooks, used when present (:class:`batchpilot.dist.fsdp.FSDPCoordinator` has them all):
    ``bind(model)`` once at construction; ``agree_batch(samples)`` at the start of every step;
    ``set_gradient_sync(flag)`` before each micro-batch (True for the last);
    ``attempt(run, replay, *, device, on_oom, micro_batch_size, step)`` instead of
    :func:`batchpilot.memory.oom.attempt` for each attempt; ``explain(exc)`` when a step fails (an
    error to raise instead, or ``None``); ``find_batch_size(step, *, restore, replay, **options)``
    for the ``"auto"`` start.

    Attributes:
        world_size: data-parallel ranks; gradients arrive averaged over them.
        defer_grad_sync: ``False``: under DDP the last micro-batch's backward all-reduces the
            gradients as usual (an OOM inside it on one rank cannot be agreed on). ``True``:
            every micro-batch runs under ``no_sync`` and, once :meth:`agree_oom` says no rank
            ran out of memory, :meth:`sync_gradients` averages the gradients (of a DDP-wrapped
            model or of a plain one).
    """

    world_size: int
    defer_grad_sync: bool

    def agree_oom(self, oom: bool) -> bool:
        """True when any rank ran out of memory in this attempt."""

    def agree_micro_batch(self, size: int) -> int:
        """The micro-batch every rank uses next (e.g. the minimum of the proposals)."""

    def agree(self, oom: bool, size: int) -> tuple[bool, int]:
        """``agree_oom(oom)`` and, when no rank ran out, ``agree_micro_batch(size)`` at once.

        Returns ``(True, size)`` (the size unused) when any rank ran out of memory, else
        ``(False, agreed size)``. A distributed coordinator does both in one collective.
        """

    def total_count(self, count: Any) -> Any:
        """Sum of the ``(sum, count)`` losses' counts over all ranks."""

    def sync_gradients(self, model: nn.Module) -> None:
        """Average the gradients over ranks; called only when ``defer_grad_sync``."""


class LocalCoordinator:
    """One process: every agreement is the local answer.

    Subclasses that override :meth:`agree_oom` / :meth:`agree_micro_batch` get an :meth:`agree`
    made of the two.
    """

    world_size = 1
    defer_grad_sync = False

    def agree_oom(self, oom: bool) -> bool:
        return oom

    def agree_micro_batch(self, size: int) -> int:
        return size

    def agree(self, oom: bool, size: int) -> tuple[bool, int]:
        if self.agree_oom(oom):
            return True, size
        return False, self.agree_micro_batch(size)

    def total_count(self, count: Any) -> Any:
        return count

    def sync_gradients(self, model: nn.Module) -> None:
        return None

    def sync_gradients_and_sum(self, model: nn.Module, values: torch.Tensor) -> torch.Tensor:
        self.sync_gradients(model)
        return values

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values
