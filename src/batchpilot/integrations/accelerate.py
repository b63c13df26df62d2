"""Accelerate: a drop-in ``find_executable_batch_size`` with the finder's search and agreement between ranks.

Accelerate's decorator calls the whole training function at a batch size and, on every OOM,
starts it again at 0.9 times the size, on each rank on its own. This one first *searches*: each
trial runs the decorated function until it has made ``steps_per_trial`` optimizer steps and stops
it there, while batchpilot's finder (``predict`` by default) measures the peak and picks the
next size; under several processes every rank searches on its own device and all take the
smallest answer. Then the function runs once, for real, at that size on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from .._checks import positive_int
from ..core.ranks import default_device, world_size
from ..dist.distributed import find_batch_size_distributed
from ..find.options import FindOptions
from ..find.result import BatchPlan
from ..memory.oom import attempt
from ..train.batching import BatchConfig
from ._common import SizingOptions, note_equal_shares, require_installed

# checked, not imported: a trial patches Accelerate's classes, imported then (the function the
# decorator wraps builds its Accelerator anyway)
require_installed("accelerate", "batchpilot.integrations.accelerate")

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

__all__ = ["find_executable_batch_size"]

logger = logging.getLogger(__name__)


class _TrialDone(BaseException):
    """Ends a trial run of the user's function (a BaseException, so ``except Exception`` lets it through)."""


@dataclass
class _Trial:
    """What one trial run saw: the accelerators it prepared with, optimizer steps, DDP's reserved bytes."""

    steps: int
    done: int = 0
    accelerators: list[Accelerator] = field(default_factory=list)
    reserved: list[torch.Tensor] = field(default_factory=list)

    def end(self) -> None:
        for acc in self.accelerators:
            acc.free_memory()  # the prepared model, optimizer and loaders of this trial
        self.accelerators.clear()
        self.reserved.clear()


@contextlib.contextmanager
def _trial_mode(steps: int) -> Iterator[_Trial]:
    """Accelerate, patched for one trial of the user's function: no collective, and a stop after ``steps`` steps.

    Ranks run different trials, so nothing in a trial may talk to another rank: the model is
    prepared without its DDP wrapper (``evaluation_mode``: mixed precision is still applied) and
    the bytes DDP's reducer would hold (a gradient-sized bucket buffer unless
    ``gradient_as_bucket_view``) are allocated instead; prepared dataloaders skip the RNG broadcast
    and dispatching. The ``steps``-th optimizer step that really steps raises :class:`_TrialDone`.
    """
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    trial = _Trial(steps)
    prepare_model = Accelerator.prepare_model
    prepare_data_loader = Accelerator.prepare_data_loader
    optimizer_step = AcceleratedOptimizer.step

    def model_(self: Accelerator, model: torch.nn.Module, device_placement: bool | None = None,
               evaluation_mode: bool = False) -> torch.nn.Module:
        if self not in trial.accelerators:
            trial.accelerators.append(self)
        out = prepare_model(self, model, device_placement=device_placement, evaluation_mode=True)
        if not evaluation_mode and _wraps_in_ddp(self, out):
            trial.reserved.append(_ddp_buckets(self, out))
        return out

    def loader_(self: Accelerator, data_loader: Any, device_placement: bool | None = None,
                slice_fn_for_dispatch: Any = None) -> Any:
        if self not in trial.accelerators:
            trial.accelerators.append(self)
        rng, dispatch = self.rng_types, self.dataloader_config.dispatch_batches
        self.rng_types, self.dataloader_config.dispatch_batches = [], False
        try:
            return prepare_data_loader(self, data_loader, device_placement, slice_fn_for_dispatch)
        finally:
            self.rng_types, self.dataloader_config.dispatch_batches = rng, dispatch

    def step_(self: AcceleratedOptimizer, closure: Any = None) -> Any:
        out = optimizer_step(self, closure)
        if self.gradient_state.sync_gradients:
            trial.done += 1
            if trial.done >= trial.steps:
                raise _TrialDone
        return out

    Accelerator.prepare_model = model_  # type: ignore[method-assign]
    Accelerator.prepare_data_loader = loader_  # type: ignore[method-assign]
    AcceleratedOptimizer.step = step_  # type: ignore[method-assign]
    try:
        yield trial
    finally:
        Accelerator.prepare_model = prepare_model  # type: ignore[method-assign]
        Accelerator.prepare_data_loader = prepare_data_loader  # type: ignore[method-assign]
        AcceleratedOptimizer.step = optimizer_step  # type: ignore[method-assign]
        trial.end()


def _wraps_in_ddp(acc: Accelerator, model: torch.nn.Module) -> bool:
    # MULTI_GPU, MULTI_CPU, MULTI_XPU, ...: the types Accelerate wraps in DistributedDataParallel
    multi = str(getattr(acc.distributed_type, "value", acc.distributed_type)).startswith("MULTI_")
    return multi and any(p.requires_grad for p in model.parameters())


def _ddp_buckets(acc: Accelerator, model: torch.nn.Module) -> torch.Tensor:
    """Memory standing in for DDP's gradient buckets, which a trial runs without."""
    handler = getattr(acc, "ddp_handler", None)
    params = [p for p in model.parameters() if p.requires_grad]
    if handler is not None and getattr(handler, "gradient_as_bucket_view", False):
        nbytes = 0  # the buckets are the gradients themselves
    else:
        nbytes = sum(p.numel() * p.element_size() for p in params)
    # zeros, not empty: on a CPU only written pages are resident
    return torch.zeros(nbytes, dtype=torch.uint8, device=params[0].device)


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int | None = None,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    global_batch_size: int | None = None,
    options: FindOptions | None = None,
    **overrides: Any,
) -> Callable[..., Any]:
    """Drop-in for ``accelerate.utils.find_executable_batch_size``: search, agree across ranks, then run.

    The decorated ``function(batch_size, *args, **kwargs)`` is the whole training function, as for
    Accelerate (it builds or frees its model and dataloaders at that batch size and trains). Called
    without the batch size, the decorator

    1. searches with batchpilot's finder up to ``starting_batch_size``: each trial calls the
       function in *trial mode*, in which it stops after ``steps_per_trial`` optimizer steps of
       an optimizer prepared by the accelerator, and measures the peak memory of that run
       (optimizer state included); OOMs are recovered from;
    2. on several processes, takes the smallest answer of all ranks (every rank searches on its
       own device; trial mode runs without collectives, see below), and
    3. calls the function at that size, for real, and returns what it returns.

    In trial mode the model is prepared without its DDP wrapper (memory for DDP's gradient buckets
    is allocated in its place), and prepared dataloaders skip their RNG broadcast and batch
    dispatching, so a rank can run a different trial from another's. A trial therefore must not
    call collectives of its own (``accelerator.gather`` of a metric) before its
    ``steps_per_trial``-th optimizer step. On one process an OOM in the final run (which goes on
    past the trials' steps) reruns the function at the size whose peak on the search's memory line
    is 10% lower, as often as needed; on several processes it is raised, since another rank may be
    waiting inside a collective of the step.

    With ``global_batch_size`` the function is only ever called with micro-batches that divide
    each rank's share of it (``global_batch_size / world``), so that
    ``Accelerator(gradient_accumulation_steps=global_batch_size // (world × batch_size))`` holds the
    global batch exactly: the search bisects over those divisors (their memory is a step function
    of any size in between, which a search over every integer would waste trials on).

    The wrapper's ``plan`` attribute holds the last :class:`~batchpilot.find.result.BatchPlan` (with
    ``limited_by_rank``) and ``batch_size`` the size of the final run.

    Args:
        function: the training function; ``batch_size`` is its first parameter.
        starting_batch_size: the largest batch size to consider; default 128 (Accelerate's), or
            each rank's share of ``global_batch_size``.
        global_batch_size: samples per optimizer step over all ranks, to be held by accumulation.
        reduce_batch_size_fn: Accelerate's hook for the next size after an OOM; batchpilot's search
            picks every size, so it is refused rather than ignored.
        options: the finder's options (:class:`batchpilot.FindOptions`). ``steps_per_trial`` is
            the optimizer steps a trial call runs (2 puts the optimizer state in the peak);
            ``max_batch_size`` is ``starting_batch_size`` by another name (give one); ``timed_steps``
            is 0 unless set: a trial is one call of the whole function, set-up included.
        **overrides: other options: the fields of :class:`batchpilot.FindOptions` (``target``,
            ``capacity``, ``strategy``, ``min_batch_size``, ``steps_per_trial``, ...), each in place
            of ``options``'s value.

    Raises:
        ValueError: ``reduce_batch_size_fn`` given, ``starting_batch_size`` and a different
            ``max_batch_size``, or invalid options, among them ``BatchSizeError`` for a keyword
            that is no finder option (when decorating).
        TypeError: the batch size passed by the caller as well.
        batchpilot.policy.search.NothingFitsError: not even ``min_batch_size`` fits (on some rank).
        torch.OutOfMemoryError: the final run ran out of memory on several processes.
    """
    if reduce_batch_size_fn is not None:
        raise ValueError(
            "reduce_batch_size_fn is Accelerate's way to pick the next size after an OOM; batchpilot's finder "
            "picks every size, so it would go unused: remove it (or use accelerate.utils.find_executable_batch_size)"
        )
    if starting_batch_size is not None:
        positive_int("starting_batch_size", starting_batch_size)
    find = FindOptions.build(options, **overrides)
    if starting_batch_size is None:
        starting_batch_size = find.max_batch_size
    elif find.max_batch_size not in (None, starting_batch_size):
        raise ValueError(f"starting_batch_size={starting_batch_size} and max_batch_size={find.max_batch_size} "
                         "disagree: both are the largest size to try; give one")
    steps_per_trial, min_batch_size, target = find.steps_per_trial, find.min_batch_size, find.target
    # a trial is one call of the whole function, set-up included: timing another call would
    # charge the set-up to the step and run the function twice per trial. The function runs
    # steps_per_trial optimizer steps inside one call: one call per trial
    opts = SizingOptions(global_batch_size=global_batch_size, find=FindOptions.build(
        find, max_batch_size=starting_batch_size, steps_per_trial=1,
        timed_steps=0 if find.timed_steps is None else find.timed_steps,
    ))
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 global_batch_size=global_batch_size, options=find)
    params = list(inspect.signature(function).parameters)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v!r}" for p, v in zip(params[1:], args[1:]))
            raise TypeError(
                f"batch size was passed into `{function.__name__}` as the first argument; the decorator passes it: "
                f"call `{function.__name__}({given})`"
            )
        sizes = None if global_batch_size is None else _divisors(global_batch_size, starting_batch_size)
        limit = starting_batch_size or (sizes[-1] if sizes else 128)
        plan = _search(function, args, kwargs, opts, limit, steps_per_trial, sizes)
        size = plan.batch_size
        run.plan, run.batch_size = plan, size  # type: ignore[attr-defined]
        logger.info("batch size %d (limited by rank %s); running %s", size, plan.limited_by_rank, function.__name__)
        note_equal_shares(plan, world_size(), "Accelerate", "a prepared DataLoader shards one batch sampler")
        while True:
            outcome = attempt(function, size, *args, **kwargs)
            if outcome.ok:
                return outcome.result
            smaller = _lower(plan, size)
            if sizes is not None:
                smaller = max((c for c in sizes if c <= smaller), default=0)
            if world_size() > 1 or smaller < min_batch_size:
                why = (f"with several processes another rank may be inside a collective of the step, so there is no "
                       f"safe point to agree on a retry: lower target (now {target})" if world_size() > 1
                       else f"nothing smaller than {min_batch_size} is allowed")
                raise torch.OutOfMemoryError(f"{function.__name__} ran out of memory at batch size {size}, which its "
                                             f"trials fit ({outcome.message}); {why}")
            logger.warning("%s ran out of memory at batch size %d although its trials fit (%s); running it at %d, "
                           "whose predicted peak is %d%% lower", function.__name__, size, outcome.message, smaller,
                           round(100 * (1 - _RETRY_SHARE)))
            size = run.batch_size = smaller  # type: ignore[attr-defined]

    run.plan = None  # type: ignore[attr-defined]
    run.batch_size = None  # type: ignore[attr-defined]
    return run


#: after an OOM of the final run, the next size's predicted peak is this share of the failed one's
_RETRY_SHARE = 0.9


def _lower(plan: BatchPlan, size: int) -> int:
    """The size whose peak, on the plan's memory line, is 10% below the peak at ``size``; half without a line.

    ``peak = fixed + per_sample × b``, so a fixed part (weights, optimizer state) that dominates
    makes the step in the batch size larger than 10%, as it must to free 10% of the memory.
    """
    fit = plan.fit
    if fit is None or fit.bytes_per_sample <= 0:
        return size // 2
    wanted = _RETRY_SHARE * fit.predict(size)
    return min(size - 1, int((wanted - fit.fixed_bytes) // fit.bytes_per_sample))


def _divisors(global_batch_size: int, limit: int | None) -> list[int]:
    """The micro-batches that divide each rank's share of ``global_batch_size``, up to ``limit``.

    Raises:
        ValueError: the global batch does not divide by the world size (the nearest that do, named).
    """
    per_rank = BatchConfig(global_batch_size=global_batch_size, world_size=world_size()).micro_batch_size
    return [d for d in range(1, per_rank + 1) if per_rank % d == 0 and (limit is None or d <= limit)] or [1]


def _search(function: Callable[..., Any], args: tuple, kwargs: dict, opts: SizingOptions, limit: int,
            steps: int, sizes: list[int] | None = None) -> BatchPlan:
    """The finder over trial runs of ``function``, on every rank, agreeing on the smallest answer.

    With ``sizes`` the finder bisects over their indices (``binsearch``; 1 is ``sizes[0]``) and the
    plan is translated back to sizes (without a memory line: it was fitted over indices).
    """
    short: list[tuple[int, int]] = []  # (batch size, optimizer steps) of trials that returned early

    def trial(b: int) -> None:
        size = b if sizes is None else sizes[b - 1]
        with _trial_mode(steps) as t:
            try:
                function(size, *args, **kwargs)
            except _TrialDone:
                return
        short.append((size, t.done))

    options = opts.finder_options(limit)
    if sizes is not None:
        options = FindOptions.build(options, strategy="binsearch", min_batch_size=1, max_batch_size=len(sizes))
    plan = find_batch_size_distributed(trial, device=default_device(), options=options)
    if sizes is not None:
        plan = dataclasses.replace(
            plan, batch_size=sizes[plan.batch_size - 1], fit=None, tensor_fit=None,
            trials=[dataclasses.replace(t, batch_size=sizes[t.batch_size - 1]) for t in plan.trials],
        )
    if short:
        b, done = short[0]
        logger.warning(
            "%s returned after %d optimizer step(s) at batch size %d, before the %d a trial runs: either it trains "
            "that little, or its optimizer is not prepared by the accelerator (a trial stops at the prepared "
            "optimizer's steps)", function.__name__, done, b, steps,
        )
    return plan
