"""How the engine agrees with the other data-parallel ranks.

:class:`Coordinator` is the protocol :class:`batchpilot.train.engine.Engine` calls to agree on every
OOM, on the micro-batch and on the ``(sum, count)`` losses' total count, and to average the
gradients when their all-reduce is deferred; it declares every member the engine uses.
:class:`LocalCoordinator` is the one-process default and the one base of the others, holding the
defaults (every agreement is the local answer, every hook does nothing); the data-parallel one is
:class:`batchpilot.dist.distributed.DistributedCoordinator`. Both names are also exported by
:mod:`batchpilot.train.engine`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch
from torch import nn

from ..find.finder import find_batch_size
from ..find.result import BatchPlan
from ..memory.oom import Attempt, attempt

__all__ = ["Coordinator", "LocalCoordinator", "check_coordinator"]


@runtime_checkable
class Coordinator(Protocol):
    """How the engine agrees with the other data-parallel ranks.

    Every rank makes the same calls in the same order, so collectives inside them pair up:

    0. ``bind(model)`` once at construction, for a ``fully_shard`` model (only a ``lockstep``
       coordinator can keep one in step);
    1. ``agree_micro_batch(size)`` when an ``"auto"`` engine picks its first micro-batch (after
       ``find_batch_size(step, *, restore, replay, **options)`` for the ``"auto"`` start, when
       the world has several ranks or the coordinator is ``lockstep``);
    2. per step, ``agree_batch(samples)`` first; per attempt at the batch, ``attempt(run,
       replay, *, device, on_oom, micro_batch_size, step)`` runs it (with
       ``set_gradient_sync(flag)`` before each micro-batch of a ``fully_shard`` model, True for
       the last) and, once the local attempt has returned or failed (never inside an ``except``
       block), a fixed engine calls ``agree_oom(oom)``; an ``"auto"`` engine calls
       ``agree(oom, next_size)``, which also agrees on the micro-batch of the next step
       (``next_size`` is this rank's proposal, meaningful only where the attempt succeeded).
       After an agreed OOM, an ``"auto"`` engine calls ``agree_micro_batch(smaller)`` and
       retries; a fixed one raises on every rank;
    3. after the successful attempt, ``sync_gradients(model)`` if ``defer_grad_sync``, then
       ``total_count(count)`` for ``(sum, count)`` losses. With the gradient noise scale
       (:mod:`batchpilot.train.noise`), ``sync_gradients_and_sum(model, values)`` replaces
       ``sync_gradients`` (the values ride in its collective), and ``sum_over_ranks(values)``
       sums them alone when the sync is not deferred;
    4. ``explain(exc)`` when a step fails: an error to raise instead (a peer's failure), or ``None``.

    A clean step therefore makes one agreement besides the gradient sync: ``agree`` for an
    ``"auto"`` engine, ``agree_oom`` for a fixed one. :class:`LocalCoordinator` holds the
    one-process default of each; a coordinator subclasses it and overrides what it agrees on.

    Attributes:
        world_size: data-parallel ranks; gradients arrive averaged over them.
        rank: this process's rank among them.
        defer_grad_sync: ``False``: under DDP the last micro-batch's backward all-reduces the
            gradients as usual (an OOM inside it on one rank cannot be agreed on). ``True``:
            every micro-batch runs under ``no_sync`` and, once :meth:`agree_oom` says no rank
            ran out of memory, :meth:`sync_gradients` averages the gradients (of a DDP-wrapped
            model or of a plain one).
        group: the process group the agreements run over; ``None`` is the default group.
        lockstep: every rank runs the same trials and micro-batches in the same order, as
            ``fully_shard`` (FSDP2) needs (its forward and backward run collectives):
            :meth:`find_batch_size` runs the ``"auto"`` start's trials in lockstep and
            :meth:`attempt` replays an attempt that ran out of memory.
        oom_rank: the lowest rank that ran out of memory in the last agreement that found an
            OOM (:meth:`agree_oom`, :meth:`agree`), so that every rank's error can name it;
            ``None`` before any, and in one process.
    """

    world_size: int
    rank: int
    defer_grad_sync: bool
    group: Any
    lockstep: bool
    oom_rank: int | None

    def bind(self, model: nn.Module) -> None:
        """Attach to the ``fully_shard`` ``model`` the engine trains (once, at construction)."""

    def find_batch_size(self, step: Callable[..., Any], *, restore: Iterable[Any] = (),
                        replay: Callable[[int], Any] | None = None, **options: Any) -> BatchPlan:
        """The ``"auto"`` start's search: ``step(b)`` trains at ``b``; every rank gets the same answer.

        ``replay(b)`` re-runs a trial at one sample per micro-batch (for ``lockstep``).
        """

    def agree_batch(self, samples: int) -> None:
        """Check at the start of a step that every rank may train on ``samples`` samples."""

    def set_gradient_sync(self, sync: bool) -> None:
        """Whether the next micro-batch's backward synchronises the gradients (``fully_shard`` models)."""

    def attempt(self, run: Callable[[], Any], replay: Callable[[], Any], *, device: torch.device,
                on_oom: Callable[[], None] | None, micro_batch_size: int, step: int | None = None) -> Attempt:
        """Run one attempt at the batch as :func:`batchpilot.memory.oom.attempt` does.

        ``replay`` runs the same micro-batches at one sample each (for ``lockstep``).
        """

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

    def sync_gradients_and_sum(self, model: nn.Module, values: torch.Tensor) -> torch.Tensor:
        """:meth:`sync_gradients`, and ``values`` summed over ranks in the same collective."""

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over ranks."""

    def explain(self, exc: BaseException) -> BaseException | None:
        """The error to raise instead of ``exc`` when a peer's failure caused it, else ``None``."""


def _members() -> tuple[str, ...]:
    methods = [name for name, value in vars(Coordinator).items() if callable(value) and not name.startswith("_")]
    return (*Coordinator.__annotations__, *methods)


#: every member the engine uses, as :class:`Coordinator` declares them
_MEMBERS: tuple[str, ...] = _members()


def check_coordinator(coordinator: Any) -> None:
    """Refuse an object that lacks a member of :class:`Coordinator`.

    Raises:
        TypeError: naming the members missing and the base that has them.
    """
    missing = [name for name in _MEMBERS if not hasattr(coordinator, name)]
    if missing:
        raise TypeError(
            f"coordinator {type(coordinator).__name__} lacks {', '.join(missing)} of the Coordinator protocol; "
            "subclass batchpilot.dist.coordinator.LocalCoordinator, which has the one-process default of each, "
            "and override what your coordinator agrees on"
        )


class LocalCoordinator:
    """One process: every agreement is the local answer, every hook does nothing.

    The base of every coordinator: the defaults of :class:`Coordinator` live here. Subclasses
    that override :meth:`agree_oom` / :meth:`agree_micro_batch` get an :meth:`agree` made of
    the two.
    """

    world_size = 1
    rank = 0
    defer_grad_sync = False
    group: Any = None
    lockstep = False
    oom_rank: int | None = None

    def bind(self, model: nn.Module) -> None:
        return None

    def find_batch_size(self, step: Callable[..., Any], *, restore: Iterable[Any] = (),
                        replay: Callable[[int], Any] | None = None, **options: Any) -> BatchPlan:
        return find_batch_size(step, restore=restore, **options)

    def agree_batch(self, samples: int) -> None:
        return None

    def set_gradient_sync(self, sync: bool) -> None:
        return None

    def attempt(self, run: Callable[[], Any], replay: Callable[[], Any], *, device: torch.device,
                on_oom: Callable[[], None] | None, micro_batch_size: int, step: int | None = None) -> Attempt:
        return attempt(run, device=device, on_oom=on_oom)

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

    def explain(self, exc: BaseException) -> BaseException | None:
        return None
