"""Find the largest batch size whose training (or inference) step fits under a memory target.

:func:`find_batch_size` runs a user's step at the batch sizes a search policy
(:mod:`batchpilot.policy.search`) asks for, measures each trial's peak with the memory
probes, recovers from OOMs, and puts the model, optimizer and RNG state back
afterwards; its answer is a :class:`~batchpilot.find.result.BatchPlan`. The search itself is a
:class:`~batchpilot.find.search.Search` (its state and phases), its trials a
:class:`~batchpilot.find.trials.TrialRunner`'s. :func:`batchpilot.find.front.find_batch_size_for` builds the step from a model, an
optimizer, a loss and an example batch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..policy.search import BatchSizeError, NothingFitsError
from .options import FindOptions
from .result import BatchPlan
from .search import Search
from .trials import warm_up

__all__ = [
    "BatchSizeError",
    "NothingFitsError",
    "find_batch_size",
    "warm_up",
]


def find_batch_size(
    step: Callable[[int], Any],
    *,
    device: torch.device | str | int | None = None,
    target: float | None = None,
    restore: Iterable[Any] = (),
    options: FindOptions | None = None,
    lockstep: Any = None,
    **overrides: Any,
) -> BatchPlan:
    """Find the largest batch size whose step peaks at or under ``target × capacity`` (or the fastest one).

    Each trial calls ``step(batch_size)`` ``steps_per_trial`` times and measures the peak of
    the memory that fails on the device (:mod:`batchpilot.memory.gauge`); a peak over the limit
    counts as "does not fit" just like an OOM, which is recovered from. Before the first
    trial the objects in ``restore`` and the torch / numpy / python RNG states are
    snapshotted, and they are put back after every trial and when the search ends, also on
    error.

    What is measured: with ``capacity`` on CPU or CUDA the trials run under
    :func:`~batchpilot.memory.probes.emulate_capacity` (tensor bytes on CPU, reserved bytes on CUDA);
    without it, the device's real memory: on CPU the process's resident set against the
    tightest of its cgroup limit, ``RLIMIT_AS`` and the available RAM (with the tensor bytes
    alongside, per trial), on CUDA reserved memory plus everything outside PyTorch against
    the card's total. On a real CPU no trial is run whose predicted peak is over a limit that
    kills (a container's): it is recorded as ``"refused"``. An OOM lowers the capacity to
    what the failure proves, so the next trial lands under it.

    Speed: every trial that fits also times ``timed_steps`` steps after the warm-up step (the
    device synchronised around each, the fastest counts; on CPU with the storage tracker set
    aside, which slows every operator, and with one intra-op thread by the thread's CPU time,
    which other processes cannot stretch: :mod:`batchpilot.find.timing`), and ``plan.time_fit``
    fits ``T(b) = fixed + per_sample × b`` to them. ``objective="throughput"`` then times a
    few smaller sizes (:class:`~batchpilot.policy.speed.ThroughputSearch`), times the sizes the choice
    rests on again side by side, and answers the smallest fitting batch whose samples/s is
    within ``speed_tolerance`` of the fastest measured; memory stays a hard limit.

    Args:
        step: runs one full step (forward, backward, optimizer step) at a batch size.
        device: the device whose memory is measured; default the current accelerator, else CPU.
        target: fraction of the capacity the peak may use, in (0, 1]; ``None``: ``options``'s
            (default 0.8, :class:`~batchpilot.find.options.FindOptions`).
        restore: modules, optimizers, LR schedulers, GradScalers or tensors to
            snapshot and restore bit for bit; their tensors also count as
            memory in use at the start of each trial.
        options: the finder's options (:class:`~batchpilot.find.options.FindOptions`); default
            every option at its default.
        lockstep: ranks that must run the same trials (FSDP2): the agreement hooks of
            :func:`batchpilot.dist.fsdp.find_batch_size_fsdp`, which passes them; leave it ``None``.
        **overrides: other options: the fields of :class:`~batchpilot.find.options.FindOptions`
            (``capacity``, ``strategy``, ``min_batch_size``, ``max_batch_size``,
            ``steps_per_trial``, ``first_guess``, ``max_trials``, ``progress``, ``tolerance``,
            ``snapshot``, ``objective``, ``speed_tolerance``, ``timed_steps``), each in place of
            ``options``'s value.

    Returns:
        A :class:`BatchPlan`.

    Raises:
        BatchSizeError: invalid options, or a keyword that is no option (the closest named),
            raised before any trial.
        NothingFitsError: even ``min_batch_size`` does not fit; the message gives
            its peak and the capacity.
        Exception: any non-OOM error of ``step`` propagates unchanged, after the
            state is restored.
    """
    if target is not None:
        overrides["target"] = target
    cfg = FindOptions.build(options, **overrides).resolved()
    return Search(step, cfg, device=device, restore=restore, lockstep=lockstep).run()
