"""Find the batch size for a model without writing the step, optionally seeded by the planner.

:func:`find_batch_size_for` builds the step from a model, an optimizer, a loss and an example
batch and runs the finder (:func:`batchpilot.find.finder.find_batch_size`) on it; with
``plan_first=True`` the search starts from the planner's answer (:mod:`batchpilot.plan.planner`), which
it verifies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..core.amp import amp_dtype as _amp_dtype, autocast
from ..core.batch import BatchLayout, SplitFn, batch_size_of, make_batch_fn, to_device
from ..core.compiled import is_compiled, mark_batch_dynamic
from ..core.loss import LossFn, as_loss_fn, forward_only, parse_loss
from ..core.model import model_device
from ..core.sharding import sharded_over_ranks
from ..memory.gauge import gauge_for
from ..memory.probes import EMULATED_DEVICES, emulated_capacity
from ..memory.tracker import view_extent
from ..memory.units import format_bytes, resolve_device
from ..policy.search import BatchSizeError
from .finder import find_batch_size
from .options import FindOptions
from .result import BatchPlan

__all__ = ["find_batch_size_for"]

logger = logging.getLogger(__name__)

#: find_batch_size_for's objective by mode (docs/speed.md)
_DEFAULT_OBJECTIVE = {"train": "memory", "eval": "throughput"}


def find_batch_size_for(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Any = None,
    mode: Literal["train", "eval"] = "train",
    amp: str | torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    restore: Iterable[Any] | None = None,
    plan_first: bool = False,
    shared: str | Iterable[str] | None = None,
    split_fn: SplitFn | None = None,
    search: Callable[..., BatchPlan] | None = None,
    lengths: Iterable[int] | None = None,
    seq_dim: int | None = None,
    device: torch.device | str | int | None = None,
    target: float | None = None,
    options: FindOptions | None = None,
    **overrides: Any,
) -> BatchPlan:
    """Find the batch size for a model without writing the step.

    The step is the engine's: ``loss_fn(model, batch)`` returning the mean loss or a
    ``(sum, count)`` pair (divided out before ``backward``), or a torch criterion applied as
    ``criterion(model(inputs), targets)`` to ``(inputs, targets)`` batches; any batch of
    :mod:`batchpilot.core.batch`'s rules (dicts of tensors, per-sample lists, ``shared`` keys).
    ``mode="train"`` runs ``optimizer.zero_grad(set_to_none=True)``, the loss, ``backward``
    and ``optimizer.step()`` (through ``scaler`` when given); ``mode="eval"`` runs the
    forward alone under ``torch.inference_mode()`` with the model in eval mode.

    With ``plan_first=True`` one planning pass on fake tensors picks the first real trial,
    which the search then verifies (two trials when the plan is right). It pays where real
    trials are dear (a GPU); a step that cannot be planned is searched unseeded (logged).

    Args:
        model: the model, already on its device (the one measured unless ``device=`` is given).
        batch: an example batch (samples repeated up to any size) or a function
            ``batch_size -> batch``; moved to the device per trial.
        optimizer: required for ``mode="train"``.
        loss_fn: ``loss_fn(model, batch)`` or a criterion; required for training.
        mode: ``"train"`` or ``"eval"``.
        amp: ``"bf16"`` / ``"fp16"`` (or a dtype): the forward under ``torch.autocast``.
        scaler: a ``GradScaler`` for fp16 training.
        restore: what to snapshot and restore; default the model, optimizer and scaler.
        plan_first: seed the search with the planner's answer (``seeded_by == "plan"``).
        shared: dict keys of the batch that are not per-sample (see :mod:`batchpilot.core.batch`).
        split_fn: ``split_fn(batch, start, stop)`` cutting the example batch yourself; the
            search then stays within the example's size.
        search: the search the step runs under, called as ``search(step, device=, restore=,
            options=)``: :func:`find_batch_size` (default), or
            :func:`batchpilot.dist.distributed.find_batch_size_distributed` to agree across ranks.
        lengths: sequence lengths to answer for (padded LM batches): a real search runs at two
            or three of them (those within 8× of the longest: see
            :func:`batchpilot.policy.lengths.choose_fit_lengths`) on
            the example batch trimmed to each on ``seq_dim`` (or ``batch(batch_size, length)`` when
            ``batch`` is a function), and their memory lines fit ``peak ≈ F(L) + b·P(L)``
            (:mod:`batchpilot.policy.lengths`). Returns a :class:`batchpilot.find.lengths.LengthPlan`:
            the search at the longest length, with ``per_length`` answering every length.
        seq_dim: the dimension of the example batch that holds the tokens (with ``lengths``;
            ``None``: 1). On a compiled model it is marked dynamic with the batch dimension, so
            the searches at several lengths share one graph.
        device: the device measured; default the model's.
        target: fraction of the capacity the peak may use, as for :func:`find_batch_size`.
        options: the finder's options (:class:`~batchpilot.find.options.FindOptions`).
        **overrides: other options: the fields of :class:`~batchpilot.find.options.FindOptions`
            (``capacity``, ``max_batch_size``, ``objective``, …), each in place of ``options``'s
            value. ``objective=None`` (the default) is ``"throughput"`` for ``mode="eval"``, where
            the batch is only a speed knob, and ``"memory"`` for training, where it is a
            hyperparameter that should not move with the machine's load.

    Raises:
        ValueError: unknown mode, training without an optimizer or loss, a criterion with
            ``reduction='none'``, an example batch the rules cannot read, or a model sharded over
            several ranks without ``search=`` (:func:`batchpilot.find_batch_size_for` picks the
            lockstep search for it).
        BatchSizeError: as :func:`find_batch_size` (an unknown option among them, before any work),
            or ``plan_first`` with a ``first_guess``.
        NothingFitsError: as :func:`find_batch_size`.
    """
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    if target is not None:
        overrides["target"] = target
    user = FindOptions.build(options, **overrides)  # bad options fail here, before any work
    if lengths is not None:  # one search per fitted length, each through this function
        from .lengths import find_per_length

        return find_per_length(
            find_batch_size_for, model, batch, lengths=lengths, seq_dim=seq_dim, optimizer=optimizer,
            loss_fn=loss_fn, mode=mode, amp=amp, scaler=scaler, restore=restore, plan_first=plan_first,
            shared=shared, split_fn=split_fn, search=search, device=device,
            options=FindOptions.build(user, objective=user.objective or _DEFAULT_OBJECTIVE[mode]),
        )
    sharded = _sharded_with_search(model, search)
    dtype = _amp_dtype(amp)
    _check_training(mode, optimizer, loss_fn)
    loss = as_loss_fn(loss_fn) if loss_fn is not None else None
    layout = BatchLayout.of(shared, split_fn)
    make = make_batch_fn(batch, layout)
    # what this call decides, applied to the user's options once: the objective a mode (or
    # lockstep ranks, which size by memory) gives when left open, the example's size, the plan
    decided: dict[str, Any] = {"objective": user.objective or ("memory" if sharded else _DEFAULT_OBJECTIVE[mode])}
    if (most := _split_limit(batch, layout, user.max_batch_size)) is not None:
        decided["max_batch_size"] = most
    device = model_device(model, default=None) if device is None else device  # parameterless: the accelerator
    dev = resolve_device(device)
    targets = list(restore) if restore is not None else [model, optimizer, scaler]
    seed = None
    if plan_first:
        seed = _plan_seed(model, batch, optimizer=optimizer, loss_fn=loss, mode=mode, amp=dtype, layout=layout,
                          cfg=user, max_batch_size=decided.get("max_batch_size", user.max_batch_size), device=dev)
        decided["first_guess"] = seed.batch_size
    opts = FindOptions.build(user, **decided)
    step = _step_for(model, make, mode=mode, optimizer=optimizer, loss=loss, dtype=dtype, scaler=scaler, device=dev,
                     layout=layout, seq_dim=seq_dim)
    plan = _run_as(model, mode, search or find_batch_size, step, device=device, restore=targets, options=opts)
    return plan if seed is None else seed.seeded(plan)


def _check_training(mode: str, optimizer: Any, loss_fn: Any) -> None:
    if mode == "train" and optimizer is None:
        raise ValueError("mode='train' needs an optimizer; use mode='eval' to size inference")
    if mode == "train" and loss_fn is None:
        raise ValueError("mode='train' needs loss_fn: loss_fn(model, batch) -> loss | (sum, count), or a criterion")


def _split_limit(batch: Any, layout: BatchLayout | None, max_batch_size: int | None) -> int | None:
    """With ``split_fn`` cutting an example batch, its size when that is below ``max_batch_size``; else ``None``."""
    if layout is None or layout.split_fn is None or callable(batch):
        return None
    most = batch_size_of(batch, layout)
    if max_batch_size is not None and max_batch_size <= most:
        return None
    logger.info("split_fn cuts the example batch: searching up to its %d samples", most)
    return most


def _step_for(model: nn.Module, make: Callable[[int], Any], *, mode: str, optimizer: torch.optim.Optimizer | None,
              loss: LossFn | None, dtype: torch.dtype | None, scaler: torch.amp.GradScaler | None,
              device: torch.device, layout: BatchLayout | None, seq_dim: int | None) -> Callable[[int], None]:
    """The step the finder runs at a batch size: the batch made, moved, then trained on or evaluated."""
    step = _train_step(model, optimizer, loss, dtype, scaler, device) if mode == "train" else None
    # dim 0 (and the tokens' dim) dynamic from the first compilation: one graph for every trial size
    dynamic = (lambda data: mark_batch_dynamic(data, layout, seq_dim=seq_dim)) if is_compiled(model) \
        else (lambda data: data)

    def train_step(b: int) -> None:
        step(dynamic(to_device(make(b), device)))

    fwd = forward_only(loss)

    def eval_step(b: int) -> None:
        data = dynamic(to_device(make(b), device))
        with torch.inference_mode(), autocast(device.type, dtype):
            fwd(model, data)

    return train_step if mode == "train" else eval_step


def _run_as(model: nn.Module, mode: str, search: Callable[..., BatchPlan], step: Callable[[int], None],
            **kwargs: Any) -> BatchPlan:
    """``search(step, **kwargs)``; for ``mode="eval"`` in eval mode, each module's flag put back after."""
    if mode != "eval":
        return search(step, **kwargs)
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return search(step, **kwargs)
    finally:
        for m, flag in flags:
            m.training = flag


def _sharded_with_search(model: nn.Module, search: Callable[..., BatchPlan] | None) -> bool:
    """Whether ``model`` is sharded over several ranks; such a model needs a lockstep ``search``.

    Raises:
        ValueError: a sharded model without ``search=``: the lockstep search lives in ``dist``, a
            layer above this one, which :func:`batchpilot.find_batch_size_for` picks it from.
    """
    sharded = sharded_over_ranks(model)
    if sharded and search is None:
        raise ValueError(
            "the model is sharded with fully_shard over several ranks, whose trials must run in lockstep: "
            "call batchpilot.find_batch_size_for (it picks the lockstep search), or pass "
            "search=batchpilot.dist.fsdp.find_batch_size_fsdp"
        )
    return sharded


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn, dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None, device: torch.device,
) -> Callable[[Any], None]:
    """One optimizer step on a batch, by the engine's loss convention (a ``(sum, count)`` loss is averaged)."""

    def run(data: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device.type, dtype):
            out = loss_fn(model, data)
        loss, count, kind = parse_loss(out)
        if kind == "sum":
            # an all-padding batch counts 0: its gradients are 0, not NaN
            loss = loss / (count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()

    return run


# ---------------------------------------------------------------------------
# planner seed


@dataclass(frozen=True, kw_only=True)
class _Seed:
    """The planner's first guess (``None``: search unseeded) and the seconds planning took."""

    batch_size: int | None
    seconds: float

    def seeded(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` with the planning pass counted: its seconds, and ``seeded_by`` when the plan gave a guess."""
        plan.plan_seconds = self.seconds
        plan.seconds += self.seconds
        plan.seeded_by = "plan" if self.batch_size is not None else None
        return plan


def _pool_storage_bytes(batch: Any, device: torch.device) -> list[int]:
    """Bytes of the example batch's storages on ``device``, each storage once.

    :func:`make_batch_fn` reads every batch's rows from the example batch, so
    the finder's measurements count that pool (the tracker counts a storage
    once it is read; a caching allocator holds it anyway) on top of the batch
    itself; the planner builds each batch from shapes alone. A callable batch
    has no pool.
    """
    if callable(batch) and not isinstance(batch, torch.Tensor):
        return []
    sizes: dict[int, int] = {}
    for t in tree_flatten(batch)[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device == device:
            st = t.untyped_storage()
            # the tracker charges a slice of a larger tensor by the part it covers
            covered = min(st.nbytes(), view_extent(t)) if device.type == "cpu" else st.nbytes()
            sizes[id(st)] = max(sizes.get(id(st), 0), covered)
    return list(sizes.values())


def _cuda_accounting(device: torch.device) -> Any:
    """Allocator accounting for this GPU, without the CUDA context.

    The finder measures the context (and everything else outside PyTorch) when a trial
    starts, so the plan leaves it out and its limit is lowered by what is outside now; the
    cuBLAS workspace size depends on the architecture, as in :mod:`batchpilot.plan.gpus`.
    """
    from ..plan.gpus import CUBLAS_WORKSPACE_DEFAULT, CUBLAS_WORKSPACE_HOPPER, HIPBLAS_WORKSPACE_MI300, CudaAccounting

    if torch.version.hip:
        arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
        workspace = HIPBLAS_WORKSPACE_MI300 if arch.startswith(("gfx94", "gfx95")) else CUBLAS_WORKSPACE_HOPPER
    else:
        major = torch.cuda.get_device_capability(device)[0]
        workspace = CUBLAS_WORKSPACE_HOPPER if major in (9, 10, 12) else CUBLAS_WORKSPACE_DEFAULT
    return CudaAccounting(blas_workspace=workspace, context=0)


def _plan_seed(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: LossFn | None,
    mode: str,
    amp: torch.dtype | None,
    layout: BatchLayout | None,
    cfg: FindOptions,
    max_batch_size: int | None,
    device: torch.device,
) -> _Seed:
    """One planning pass for the limit the finder will measure against.

    The planner runs the finder's own step (same loss, ``steps_per_trial`` steps; a
    GradScaler's few scalar tensors are left out) and solves for ``target × capacity`` less
    what the finder counts besides the step: the example batch kept on the device (see
    :func:`_pool_storage_bytes`) and, on real memory, what is in use now. On an emulated CPU
    its answer is the finder's byte for byte. On CUDA it predicts reserved memory (allocator
    rounding, segments, cuBLAS workspaces); the context and other processes are measured
    now and left out of the limit. On a real CPU the plan counts tensors only, while the
    resident set also holds allocator and kernel scratch, so half the plan is tried first.
    """
    # imported here: fake tensors and the GPU tables are needed only when a plan is asked for
    from ..plan.result import PlanningError
    from ..plan.planner import plan_batch_size

    if cfg.first_guess is not None:
        raise BatchSizeError("pass first_guess or plan_first=True, not both: the plan is a first guess")
    started = time.perf_counter()
    emulated = cfg.capacity is not None and device.type in EMULATED_DEVICES
    gauge = gauge_for(device, emulated_capacity=cfg.capacity if emulated else emulated_capacity(device))
    cap = cfg.capacity if cfg.capacity is not None else gauge.capacity()
    limit = int(cfg.target * cap)
    accounting = _cuda_accounting(device) if device.type == "cuda" else None
    pool = sum(accounting.block_size(n) if accounting else n for n in _pool_storage_bytes(batch, device))
    if not gauge.limit.tracked:
        gauge.reset()  # a CUDA gauge reads what is outside PyTorch here
        pool = max(pool, 0) + int(gauge.current()) if gauge.host else pool + gauge.outside
    if limit <= pool:
        logger.info("plan_first: the example batch alone (%s) fills the limit %s; searching unseeded",
                    format_bytes(pool), format_bytes(limit))
        return _Seed(batch_size=None, seconds=time.perf_counter() - started)
    try:
        plan = plan_batch_size(
            model, batch, capacity=limit - pool, target=1.0, optimizer=optimizer if mode == "train" else None,
            loss_fn=loss_fn, amp=amp, steps=cfg.steps_per_trial, mode=mode,
            device="cpu" if accounting is None else "cuda", accounting=accounting,
            max_batch_size=max_batch_size or 1 << 20,
            shared=None if layout is None else layout.shared,
        )
    except PlanningError as exc:
        logger.info("plan_first: searching unseeded, the step cannot be planned: %s", exc)
        return _Seed(batch_size=None, seconds=time.perf_counter() - started)
    seconds = time.perf_counter() - started
    if plan.batch_size == 0:
        logger.info("plan_first: the plan says even a batch of 1 needs more than %s; searching unseeded",
                    format_bytes(limit - pool))
        return _Seed(batch_size=None, seconds=seconds)
    guess = plan.batch_size if not gauge.host else max(1, plan.batch_size // 2)
    logger.info("plan_first: planned batch %d in %d fake runs (%.2fs); verifying %d on %s",
                plan.batch_size, len(plan.evaluations), seconds, guess, device)
    return _Seed(batch_size=guess, seconds=seconds)
