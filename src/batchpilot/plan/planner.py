"""Plan a batch size for a device you don't have: run the step on fake tensors.

:func:`estimate_peak_memory` counts every storage a step makes on ``FakeTensorMode`` copies of
the model (byte-exact against the CPU tracker); :func:`plan_batch_size` solves for the largest
batch under a capacity. The user's model, optimizer and RNG are never touched. What is and is
not counted: ``docs/internals.md#plan``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .._checks import positive_int
from ..core.amp import amp_dtype, autocast
from ..core.batch import BatchLayout, BatchSplitter
from ..core.compiled import eager_while_tracked
from ..core.loss import as_loss_fn, forward_only, parse_loss
from ..memory.tracker import StorageLedger, tensor_leaves, tensor_storages, watch_storage_resizes, wraps_subclass
from ..memory.units import format_bytes, parse_bytes
from ..policy.search import (
    DEFAULT_TARGET,
    FIT,
    OVER_TARGET,
    NothingFitsError,
    SearchSpace,
    SecantPolicy,
    Trial,
    check_target,
    run_search,
)
from ..policy.shares import check_speeds, rank_shares
from .gpus import CachingAllocatorModel, CudaAccounting, gpu_spec
from .result import ClusterPlanResult, MemoryEstimate, PlanningError, PlanResult, RankPlan

__all__ = [
    "default_step",
    "estimate_peak_memory",
    "plan_batch_size",
]

logger = logging.getLogger(__name__)

StepFn = Callable[[nn.Module, "torch.optim.Optimizer | None", Any], Any]

_MODES = ("train", "eval")
_DEVICES = ("cpu", "cuda")
_FAKE_UNSUPPORTED = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    UnsupportedFakeTensorException,
    NotImplementedError,
)
_ADVICE = "run the finder (batchpilot.find_batch_size) on the device instead"


# ---------------------------------------------------------------------------
# The step


def default_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
    *,
    loss_fn: Any = None,
    amp: str | torch.dtype | None = None,
    mode: Literal["train", "eval"] = "train",
) -> None:
    """The step the planner runs unless given ``step_fn``: the finder's and the engine's step.

    Training: ``zero_grad(set_to_none=True)``, ``loss_fn(model, batch)`` (under autocast when
    ``amp`` is set; a ``(sum, count)`` loss is divided out), backward, ``optimizer.step()``.
    ``loss_fn`` follows :mod:`batchpilot.core.loss`; ``None`` is cross entropy on ``(inputs,
    targets)`` batches. Inference (``mode="eval"``): the forward alone under ``torch.no_grad()``.

    Raises:
        ValueError: a batch the loss cannot read (e.g. a dict with a criterion), or a loss that
            is not a scalar.
    """
    loss_fn = as_loss_fn(F.cross_entropy if loss_fn is None else loss_fn)
    ctx = autocast(_device_type(batch), amp_dtype(amp))
    if mode == "eval":
        with torch.no_grad(), ctx:
            forward_only(loss_fn)(model, batch)
        return
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    with ctx:
        loss, count, kind = parse_loss(loss_fn(model, batch))
    if kind == "sum":
        loss = loss / (count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1))
    loss.backward()
    if optimizer is not None:
        optimizer.step()


def _device_type(batch: Any) -> str:
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    return leaves[0].device.type if leaves else "cpu"


# ---------------------------------------------------------------------------
# Counting fake storages


_ROLES = ("parameters", "buffers", "inputs", "gradients", "optimizer_state", "activations",
          "unsharded_parameters", "communication")


@dataclass(eq=False)
class _Record:
    """A storage the planner counts: its role, and its key in the CUDA allocator model."""

    role: str | None = None


def _batch_norm_ops() -> tuple[Any, ...]:
    aten = torch.ops.aten
    names = (
        ("native_batch_norm", "default"),
        ("_native_batch_norm_legit", "default"),
        ("_native_batch_norm_legit", "no_stats"),
        ("_native_batch_norm_legit_functional", "default"),
        ("_batch_norm_with_update", "default"),
        ("_batch_norm_no_update", "default"),
    )
    ops = []
    for op, overload in names:
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            ops.append(getattr(packet, overload))
    return tuple(ops)


_BATCH_NORM_OPS = frozenset(_batch_norm_ops())
_REDUCED = (torch.bfloat16, torch.float16)


def _kernel_parity(func: Any, args: tuple, out: Any) -> Any:
    """Make fake outputs match the real kernels where the meta functions disagree.

    Batch norm on bf16/fp16 input with float32 (or no) affine weight saves its
    mean and inverse std in float32 on CPU and CUDA; the meta function uses
    the input dtype, which would under-count them by half.
    """
    if func in _BATCH_NORM_OPS:
        x, weight = args[0], args[1] if len(args) > 1 else None
        if x.dtype in _REDUCED and (weight is None or weight.dtype == torch.float32):
            out = list(out)
            out[1:3] = [torch.empty_like(t, dtype=torch.float32) for t in out[1:3]]
            return tuple(out)
    return out


class _FakeStorageCounter(TorchDispatchMode):
    """Count live storage bytes of the tensors a step makes, and what they are at the peak.

    Runs on top of a ``FakeTensorMode``; counts every storage an operator
    reads or returns once (views share it) and drops it when the storage is
    freed, in the CPU tracker's own ledger (:class:`batchpilot.memory.tracker.StorageLedger`).
    Every change is logged, so the live set at the peak can be rebuilt at the end;
    roles (gradient, optimizer state, ...) are given later by :meth:`mark`,
    so a gradient counts as one even if the peak came just before autograd
    stored it. Optionally replays the allocations through a CUDA allocator model.
    """

    def __init__(self, allocator: CachingAllocatorModel | None = None) -> None:
        super().__init__()
        self.allocator = allocator
        self._ledger = StorageLedger(on_release=self._released)
        self._records: dict[int, _Record] = {}
        self._log: list[tuple[_Record, int]] = []  # (record, change in bytes)
        self._peak_at = 0  # log entries up to the peak
        self.resize_role: str | None = None  # what a storage grown in place is (FSDP: unsharded parameters)

    @property
    def live(self) -> int:
        return self._ledger.live

    @property
    def peak(self) -> int:
        return self._ledger.peak

    def _logged(self, rec: _Record, delta: int) -> None:
        self._log.append((rec, delta))
        if self._ledger.bump_peak():
            self._peak_at = len(self._log)

    def _released(self, key: int, nbytes: int) -> None:
        rec = self._records.pop(key, None)
        if rec is not None:
            self._logged(rec, -nbytes)
            if self.allocator is not None:
                self.allocator.free(rec)

    def _add(self, storage: torch.UntypedStorage, role: str | None = None) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        old = self._ledger.size(key)
        if old is None:
            rec = self._records[key] = _Record(role)
            if self.allocator is not None:
                self.allocator.malloc(rec, nbytes)
        elif old != nbytes:  # resize_ grew or shrank it in place
            rec = self._records[key]
            if self.allocator is not None:
                self.allocator.free(rec)
                self.allocator.malloc(rec, nbytes)
        else:
            return
        self._logged(rec, self._ledger.charge(storage, nbytes))

    def track(self, tensors: Iterable[torch.Tensor], role: str) -> None:
        """Count tensors that exist before the step, as ``role``."""
        for t in tensors:
            for st in tensor_storages(t):
                self._add(st, role)
            self.mark(t, role)

    def mark(self, tensor: torch.Tensor | None, role: str) -> None:
        """Record that ``tensor``'s storages are a ``role`` (the first role given wins)."""
        for st in tensor_storages(tensor):
            rec = self._records.get(id(st))
            if rec is not None and rec.role is None:
                rec.role = role

    def resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """Count a storage resized in place (FSDP2's unsharded parameters), which no dispatch mode sees."""
        if nbytes > 0 or id(st) in self._records:
            self._add(st)
            rec = self._records.get(id(st))
            if rec is not None and rec.role is None and nbytes > 0:
                rec.role = self.resize_role

    def breakdown(self) -> dict[str, int]:
        """Bytes per role at the peak."""
        parts = dict.fromkeys(_ROLES, 0)
        for rec, delta in self._log[: self._peak_at]:
            parts[rec.role or "activations"] += delta
        return parts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if wraps_subclass(types):
            return NotImplemented  # a DTensor runs as operators on its local tensors, counted here
        kwargs = kwargs or {}
        for t in tensor_leaves((args, kwargs)):
            st = _storage_of(t)
            if st is not None and id(st) not in self._records:
                self._add(st)
        out = _kernel_parity(func, args, func(*args, **kwargs))
        for t in tensor_leaves(out):
            if t.device.type not in ("cpu", "meta"):
                # A fake CUDA tensor's backward aborts a CPU-only build: stop before it runs.
                raise PlanningError(
                    f"the step put a tensor on {t.device} ({func}); planning runs on CPU fake tensors, "
                    "so the step must follow the batch's device (e.g. device=x.device) rather than "
                    f"name one; or {_ADVICE}"
                )
            st = _storage_of(t)
            if st is not None:
                self._add(st)
        return out


def _storage_of(t: Any) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested tensors own no plain storage
        return None


# ---------------------------------------------------------------------------
# The fake copy


class _FakeSetup:
    """A fake copy of the model (and a recipe for the optimizer), reused across batch sizes."""

    def __init__(self, model: nn.Module, optimizer: Any, *, mode: str, foreach: bool, shards: Any = None) -> None:
        # Fallback kernels would run a missing meta kernel on real zero-filled
        # tensors, allocating the full batch for real: refuse instead.
        self.fake_mode = FakeTensorMode(allow_fallback_kernels=False, allow_non_fake_inputs=True)
        memo: dict[int, torch.Tensor] = {}
        real_params = list(model.parameters())
        if isinstance(optimizer, torch.optim.Optimizer):
            real_params += [p for g in optimizer.param_groups for p in g["params"]]
        for t in [*real_params, *model.buffers()]:
            if id(t) not in memo:
                memo[id(t)] = self._fake_of(t)
        self._fake_by_id = dict(memo)
        try:
            self.model = copy.deepcopy(model, memo)
        except Exception as exc:
            raise PlanningError(
                f"planning needs a copy of the model and copy.deepcopy failed ({exc!r}); {_ADVICE}"
            ) from exc
        self.model.train(mode == "train")
        #: the FSDP2 hooks when sharded (batchpilot.plan.fsdp.FakeShards), else None
        self.shards = None
        if shards is not None:
            real = list(model.parameters())
            self.shards = shards(self.model, self.fake_mode)
            sharded = list(self.model.parameters())
            # fully_shard replaced each parameter by its shard, in the same order
            self._fake_by_id.update({id(r): f for r, f in zip(real, sharded)})
        self.params = list(self.model.parameters())
        self.buffers = list(self.model.buffers())
        self.optimizer = optimizer
        self.foreach = foreach

    def _fake_of(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return self.fake_mode.from_tensor(t)
        with self.fake_mode:  # a CUDA / meta model plans from CPU fakes of the same layout
            fake = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu")
        if isinstance(t, nn.Parameter):
            return nn.Parameter(fake, requires_grad=t.requires_grad)
        return fake.requires_grad_(t.requires_grad)

    def new_optimizer(self) -> torch.optim.Optimizer | None:
        """A fresh optimizer (empty state) over the fake parameters."""
        opt = self.optimizer
        if opt is None:
            return None
        with self.fake_mode:
            if isinstance(opt, torch.optim.Optimizer):
                groups = [
                    {**{k: v for k, v in g.items() if k != "params"},
                     "params": [self._fake_by_id[id(p)] for p in g["params"]]}
                    for g in opt.param_groups
                ]
                try:
                    fake_opt = type(opt)(groups, **opt.defaults)
                except TypeError:
                    try:
                        fake_opt = type(opt)(groups)
                    except TypeError as exc:
                        raise PlanningError(
                            f"cannot rebuild {type(opt).__name__} from its param_groups ({exc}); pass a factory, "
                            "optimizer=lambda params: MyOptimizer(params, ...)"
                        ) from exc
            else:
                fake_opt = opt(self.params)
        if not isinstance(fake_opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(fake_opt).__name__}, not a torch.optim.Optimizer")
        if self.foreach:
            # On CUDA tensors torch defaults to the foreach implementation, whose
            # temporaries are whole lists of state-sized tensors; CPU defaults to a loop.
            for g in fake_opt.param_groups:
                if "foreach" in g and g["foreach"] is None and not g.get("fused") and not g.get("differentiable"):
                    g["foreach"] = True
        return fake_opt

    def batch(self, sample: Any, batch_size: int, layout: BatchLayout | None = None) -> Any:
        """A fake batch of ``batch_size`` samples shaped like ``sample`` (or made by it)."""
        with self.fake_mode:
            if callable(sample):
                made = sample(batch_size)
            else:
                made = BatchSplitter(sample, layout).map_rows(
                    lambda t: _fake_rows(t, batch_size),
                    seq=lambda items: type(items)(items[i % len(items)] for i in range(batch_size)),
                )
        return tree_map(self._cpu_fake, made)

    def _cpu_fake(self, t: Any) -> Any:
        """A CPU fake of ``t``: a batch function may put its batch on the accelerator it trains on."""
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, FakeTensor):
            t = self.fake_mode.from_tensor(t) if t.device.type == "cpu" else t
        if t.device.type == "cpu":
            return t
        with self.fake_mode:
            return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu")


def _fake_rows(t: Any, batch_size: int) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if t.dim() == 0:
        return torch.empty((), dtype=t.dtype, device="cpu").requires_grad_(t.requires_grad)
    shape = (batch_size, *t.shape[1:])
    channels_last = t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=t.dtype, device="cpu", memory_format=fmt).requires_grad_(t.requires_grad)


def _check_sample(sample: Any, layout: BatchLayout | None) -> None:
    if callable(sample):
        return
    try:
        BatchSplitter(sample, layout)
    except ValueError as exc:
        raise ValueError(
            f"sample must be an example batch (samples on dim 0, e.g. (inputs, targets)) or a callable "
            f"batch_size -> batch: {exc}"
        ) from None


# ---------------------------------------------------------------------------
# Estimating


@dataclass(kw_only=True)
class _Config:
    sample: Any
    loss_fn: Any
    step_fn: StepFn | None
    steps: int
    mode: str
    amp: Any
    device: str
    accounting: CudaAccounting | None
    layout: BatchLayout | None = None
    world_size: int = 1
    sharding: str | None = None

    def __post_init__(self) -> None:
        if self.step_fn is None:
            # the one convention (batchpilot.core.loss); a bad criterion fails here, before any fake run
            self.loss_fn = as_loss_fn(F.cross_entropy if self.loss_fn is None else self.loss_fn)
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1 (2 or more so that optimizer state counts), got {self.steps}")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {self.mode!r}")
        amp_dtype(self.amp)  # raises with the accepted values
        if self.device not in _DEVICES:
            raise ValueError(f"device must be 'cpu' or 'cuda' (the accounting to apply), got {self.device!r}")
        if self.accounting is not None and self.device != "cuda":
            raise ValueError("accounting applies to device='cuda' only")
        if self.device == "cuda" and self.accounting is None:
            self.accounting = CudaAccounting()
        positive_int("world_size", self.world_size)
        if self.sharding not in (None, "fsdp2"):
            raise ValueError(f"sharding must be None or 'fsdp2', got {self.sharding!r}")
        if self.sharding is None and self.world_size != 1:
            raise ValueError(
                f"world_size={self.world_size} needs sharding='fsdp2'; a data-parallel (DDP) rank holds the "
                "whole model, so plan it with world_size=1"
            )
        _check_sample(self.sample, self.layout)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any) -> None:
        if self.step_fn is not None:
            self.step_fn(model, optimizer, batch)
        else:
            default_step(model, optimizer, batch, loss_fn=self.loss_fn, amp=self.amp, mode=self.mode)


def _mark_grads(counter: _FakeStorageCounter, params: list[torch.Tensor]) -> None:
    for p in params:
        counter.mark(p.grad, "gradients")


def _mark_state(counter: _FakeStorageCounter, optimizer: torch.optim.Optimizer) -> None:
    for t in tree_flatten(list(optimizer.state.values()))[0]:
        counter.mark(t, "optimizer_state")


def _measure(setup: _FakeSetup, cfg: _Config, batch_size: int) -> MemoryEstimate:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    start = time.perf_counter()
    acc = cfg.accounting
    allocator = CachingAllocatorModel(acc) if acc is not None else None
    setup.model.zero_grad(set_to_none=True)
    counter = _FakeStorageCounter(allocator)
    handles = []
    try:
        optimizer = setup.new_optimizer()
        batch = setup.batch(cfg.sample, batch_size, cfg.layout)
        if allocator is not None:
            # cuBLAS workspaces are allocated on the first matrix product and kept.
            for i in range(acc.handles(cfg.mode == "train")):
                allocator.malloc(("cublas", i), acc.blas_workspace)
        counter.track(setup.params, "parameters")
        counter.track(setup.buffers, "buffers")
        counter.track((t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)), "inputs")
        for p in setup.params:
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda q: counter.mark(q.grad, "gradients")))
        if optimizer is not None:
            handles.append(optimizer.register_step_post_hook(lambda opt, _a, _k: _mark_state(counter, opt)))
            # gradients set without autograd's accumulation (FSDP2's reduce-scattered shards)
            handles.append(optimizer.register_step_pre_hook(lambda _o, _a, _k: _mark_grads(counter, setup.params)))
        if setup.shards is not None:
            counter.resize_role = "unsharded_parameters"
            handles += setup.shards.attach(counter)
        # a compiled model is planned as its eager program: dynamo cannot run on fake tensors under
        # a dispatch mode, and would otherwise stop compiling the model's code for good
        with torch.enable_grad() if cfg.mode == "train" else contextlib.nullcontext(), eager_while_tracked(), \
                setup.fake_mode, counter, watch_storage_resizes(counter.resized):
            for _ in range(cfg.steps):
                cfg.step(setup.model, optimizer, batch)
    except (PlanningError, ValueError, TypeError):
        raise
    except _FAKE_UNSUPPORTED as exc:
        raise PlanningError(
            f"planning is not available for this model: its step cannot run on fake tensors "
            f"({type(exc).__name__}: {exc}). Data-dependent shapes, .item() and custom operators "
            f"without a meta kernel need real data; {_ADVICE}"
        ) from exc
    except Exception as exc:
        raise PlanningError(
            f"planning is not available for this model: its step raised {type(exc).__name__} on fake "
            f"tensors ({exc}); if the step runs on real tensors, {_ADVICE}"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    parts = counter.breakdown()
    if allocator is not None:
        allocated = allocator.peak_allocated + acc.extra
        reserved = allocator.peak_reserved + acc.extra
        context = acc.context
    else:
        allocated = reserved = counter.peak
        context = 0
    est = MemoryEstimate(
        batch_size=batch_size, device=cfg.device, peak_bytes=counter.peak, **parts,
        allocated_bytes=allocated, reserved_bytes=reserved, context_bytes=context,
        seconds=time.perf_counter() - start, world_size=cfg.world_size, sharding=cfg.sharding,
    )
    logger.debug("fake step at batch %d: peak %s, required %s (%.3f s)", batch_size,
                 format_bytes(est.peak_bytes), format_bytes(est.required_bytes), est.seconds)
    return est


def estimate_peak_memory(
    model: nn.Module,
    sample: Any,
    batch_size: int,
    *,
    optimizer: Any = None,
    loss_fn: Any = None,
    step_fn: StepFn | None = None,
    steps: int = 2,
    mode: Literal["train", "eval"] = "train",
    amp: str | torch.dtype | None = None,
    device: Literal["cpu", "cuda"] = "cpu",
    accounting: CudaAccounting | None = None,
    shared: str | Iterable[str] | None = None,
    world_size: int = 1,
    sharding: Literal["fsdp2"] | None = None,
    shard_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> MemoryEstimate:
    """Peak memory of ``steps`` training steps at ``batch_size``, without running them for real.

    Args:
        model: the model; copied onto fake tensors, never modified.
        sample: an example batch (a pytree of tensors, batch on dim 0; only
            shapes and dtypes are used) or a callable ``batch_size -> batch``
            (called under ``FakeTensorMode``, so ``torch.randn(b, ...)`` in it
            allocates nothing).
        batch_size: rows per batch.
        optimizer: ``None`` (no optimizer step), an optimizer instance (its
            class and param groups are rebuilt over the fake parameters, with
            empty state) or a factory ``lambda params: torch.optim.AdamW(params, ...)``.
        loss_fn: ``loss_fn(model, batch) -> loss | (sum, count)`` or a
            criterion, as for the engine and the finder (cross entropy on
            ``(inputs, targets)`` when ``None``).
        step_fn: ``step_fn(model, optimizer, batch)`` running one whole step
            your way, instead of :func:`default_step` (as ``find_batch_size``
            takes a step); it must create tensors on the batch's device (CPU
            fakes), e.g. ``torch.autocast("cpu")``.
        shared: dict keys of the batch that are not per-sample (see
            :mod:`batchpilot.core.batch`).
        steps: steps to run; 2 or more so that optimizer state and the second
            step's gradients count.
        mode: ``"train"`` or ``"eval"`` (forward under ``no_grad``).
        amp: ``"bf16"`` / ``"fp16"`` autocast around forward and loss.
        device: ``"cpu"`` (exact tensor bytes) or ``"cuda"`` (adds the
            caching-allocator model, cuBLAS workspaces and the context).
        accounting: CUDA constants (default :class:`CudaAccounting()`).
        world_size, sharding: ``sharding="fsdp2"`` plans one rank of ``world_size`` with the
            model under ``fully_shard`` (over a fake process group: no other process runs);
            ``None`` (the default) plans the whole model on one device.
        shard_fn: ``shard_fn(model, mesh)`` calling ``fully_shard`` your way; default
            :func:`batchpilot.core.sharding.shard_model` (each block, then the root).

    Returns:
        The peak and its breakdown at the moment of the peak.

    Raises:
        PlanningError: the step cannot run on fake tensors (``.item()``,
            data-dependent shapes, custom operators without a meta kernel, a
            hard-coded CUDA device); run the finder on the device instead. Also
            a sharded plan inside a process that runs a process group already.
        ValueError: invalid arguments.
    """
    cfg = _Config(sample=sample, loss_fn=loss_fn, step_fn=step_fn, steps=steps, mode=mode, amp=amp,
                  device=device, accounting=accounting, layout=BatchLayout.of(shared), world_size=world_size,
                  sharding=sharding)
    # Dispatch modes already running (a StorageTracker, a FLOP counter) must not see the fake step.
    with _disable_current_modes(), _sharded(cfg, shard_fn) as shards:
        setup = _FakeSetup(model, optimizer, mode=mode, foreach=device == "cuda", shards=shards)
        return _measure(setup, cfg, batch_size)


@contextlib.contextmanager
def _sharded(cfg: _Config, shard_fn: Callable[[nn.Module, Any], Any] | None) -> Any:
    """``None`` unsharded; else, inside a fake process group, a factory sharding the fake model."""
    if cfg.sharding is None:
        yield None
        return
    from .fsdp import FakeShards, fake_process_group  # torch.distributed, only when asked for

    with fake_process_group(cfg.world_size) as mesh:
        yield lambda model, fake_mode: FakeShards(model, mesh, fake_mode, shard_fn)


# ---------------------------------------------------------------------------
# Planning


#: evaluations a boundary search may take: far more than it needs (about two per doubling of the batch)
_MAX_EVALUATIONS = 1000


def _search_boundary(
    cost: Callable[[int], int], limit: int, max_batch_size: int, probe: int = 1024
) -> tuple[int, dict[int, int]]:
    """Largest ``b <= max_batch_size`` with ``cost(b) <= limit`` and ``cost(b + 1) > limit``.

    Assumes ``cost`` grows with ``b``. The search is the finder's loop
    (:func:`~batchpilot.policy.search.run_search`) with the policy for cheap, exact costs,
    :class:`~batchpilot.policy.search.SecantPolicy`: each fake run is a trial whose peak is its cost.

    Returns:
        ``(b, {batch size: cost})``; ``b`` is 0 when ``cost(1) > limit``.
    """
    policy = SecantPolicy(probe=probe)
    bound = max(1, limit)  # a space's limit is positive; what fits is judged against ``limit`` itself
    space = SearchSpace(limit_bytes=bound, capacity_bytes=bound, max_batch_size=max_batch_size)

    def trial(b: int) -> Trial:
        c = cost(b)
        return Trial(batch_size=b, outcome=FIT if c <= limit else OVER_TARGET, peak_bytes=c)

    result = run_search(policy, space, trial, max_trials=_MAX_EVALUATIONS)
    return policy.boundary(result.trials, space), {t.batch_size: t.peak_bytes for t in result.trials}


def _resolve_capacity(capacity: int | float | str, device: str | None) -> tuple[int, str, str | None]:
    """``(bytes, device, gpu name)`` from a size or a named GPU."""
    if isinstance(capacity, str):
        try:
            size = parse_bytes(capacity)
        except ValueError:
            spec = gpu_spec(capacity)  # raises with the list of known GPUs
            if device not in (None, "cuda"):
                raise ValueError(f"capacity {capacity!r} names a GPU; plan it with device='cuda', not {device!r}")
            return spec.capacity, "cuda", spec.name
        return size, device or "cpu", None
    return parse_bytes(capacity), device or "cpu", None


def plan_batch_size(
    model: nn.Module,
    sample: Any,
    *,
    capacity: int | float | str | Sequence[int | float | str],
    target: float = DEFAULT_TARGET,
    optimizer: Any = None,
    loss_fn: Any = None,
    step_fn: StepFn | None = None,
    steps: int = 2,
    mode: Literal["train", "eval"] = "train",
    amp: str | torch.dtype | None = None,
    device: Literal["cpu", "cuda"] | None = None,
    accounting: CudaAccounting | None = None,
    max_batch_size: int = 1 << 20,
    shared: str | Iterable[str] | None = None,
    world_size: int = 1,
    sharding: Literal["fsdp2"] | None = None,
    shard_fn: Callable[[nn.Module, Any], Any] | None = None,
    global_batch_size: int | None = None,
    speeds: Sequence[float] | None = None,
) -> PlanResult | ClusterPlanResult:
    """The largest batch whose estimated peak fits ``target × capacity``, on fake tensors.

    The boundary is exact against :func:`estimate_peak_memory`: the
    estimate at ``batch_size`` fits and the one at ``batch_size + 1`` does
    not (``required_bytes``: tensor bytes on CPU; reserved peak plus CUDA
    context on CUDA).

    Args:
        capacity: bytes, a size such as ``"24GiB"``, or a named GPU such as
            ``"H100-80GB"`` (see :data:`batchpilot.plan.gpus.GPUS`), which implies
            ``device="cuda"`` and that GPU's cuBLAS workspace. A list or tuple of them, one per
            rank, plans a data-parallel job over GPUs that differ and returns a
            :class:`~batchpilot.plan.result.ClusterPlanResult`: each rank's largest micro-batch
            from its own memory, and its share of the global batch proportional to its speed
            (:func:`batchpilot.policy.shares.rank_shares`).
        target: fraction of ``capacity`` to fill, in (0, 1] (the finder's default,
            :data:`batchpilot.policy.search.DEFAULT_TARGET`).
        device: ``"cpu"`` or ``"cuda"``; default: ``"cuda"`` for a named GPU,
            else ``"cpu"``.
        accounting: CUDA constants; default :meth:`CudaAccounting.for_gpu`
            for a named GPU, else :class:`CudaAccounting()`.
        max_batch_size: the largest batch considered.
        world_size, sharding, shard_fn: ``sharding="fsdp2"`` plans the per-rank batch of one
            rank of ``world_size`` sharding the model with FSDP2 (see :func:`estimate_peak_memory`).
        model, sample, optimizer, loss_fn, step_fn, steps, mode, amp, shared: as for
            :func:`estimate_peak_memory`.
        global_batch_size: with a list of capacities, the samples per optimizer step over all
            ranks; ``None``: the largest that every rank takes in one micro-batch.
        speeds: with a list of capacities, one figure per rank proportional to its samples/s;
            ``None``: the GPU table's TFLOPS (every entry must then name a GPU).

    Raises:
        PlanningError: the step cannot run on fake tensors; run the finder on
            the device instead.
        ValueError: unknown GPU name (the message lists the known ones), a
            malformed capacity, or other invalid arguments.
        NothingFitsError: with a list of capacities, a rank where not even a batch of one fits.
    """
    start = time.perf_counter()
    check_target(target)
    if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
    options = dict(sample=sample, loss_fn=loss_fn, step_fn=step_fn, steps=steps, mode=mode, amp=amp,
                   layout=BatchLayout.of(shared), sharding=sharding)
    if isinstance(capacity, (list, tuple)):
        return _plan_cluster(model, optimizer, list(capacity), options, target=target, device=device,
                             accounting=accounting, max_batch_size=max_batch_size, world_size=world_size,
                             shard_fn=shard_fn, global_batch_size=global_batch_size, speeds=speeds, start=start)
    if global_batch_size is not None or speeds is not None:
        raise ValueError("global_batch_size and speeds split a global batch over ranks that differ: pass capacity "
                         "as a list with one entry per rank, e.g. capacity=['A6000-48GB', 'RTX2080Ti-11GB']")
    cap, device, gpu = _resolve_capacity(capacity, device)
    if device == "cuda" and accounting is None:
        accounting = CudaAccounting.for_gpu(gpu) if gpu else CudaAccounting()
    cfg = _Config(device=device, accounting=accounting, world_size=world_size, **options)
    # Dispatch modes already running (a StorageTracker, a FLOP counter) must not see the fake steps.
    with _disable_current_modes(), _sharded(cfg, shard_fn) as shards:
        setup = _FakeSetup(model, optimizer, mode=mode, foreach=device == "cuda", shards=shards)
        result = _plan_on(setup, cfg, {}, cap=cap, gpu=gpu, target=target, max_batch_size=max_batch_size)
    result = dataclasses.replace(result, seconds=time.perf_counter() - start)
    logger.info("planned batch %d for %s (limit %s) in %d fake runs, %.2f s", result.batch_size, format_bytes(cap),
                format_bytes(result.limit), len(result.evaluations), result.seconds)
    return result


def _plan_on(setup: _FakeSetup, cfg: _Config, estimates: dict[int, MemoryEstimate], *, cap: int, gpu: str | None,
             target: float, max_batch_size: int) -> PlanResult:
    """The largest batch under ``target × cap``; ``estimates`` (batch -> estimate under ``cfg``) is reused and filled."""
    start = time.perf_counter()
    limit = int(target * cap)
    seen: set[int] = set()

    def cost(b: int) -> int:
        seen.add(b)
        if b not in estimates:
            estimates[b] = _measure(setup, cfg, b)
        return estimates[b].required_bytes

    best, _ = _search_boundary(cost, limit, max_batch_size)
    nxt = best + 1
    if nxt <= max_batch_size:
        cost(nxt)
    if best == 0:
        logger.warning("even a batch of 1 needs %s, over the limit of %s (%.0f%% of %s)",
                       format_bytes(estimates[1].required_bytes), format_bytes(limit), 100 * target, format_bytes(cap))
    return PlanResult(
        batch_size=best, capacity=cap, target=target, limit=limit, device=cfg.device, gpu=gpu,
        estimate=estimates.get(best), next_estimate=estimates.get(nxt) if nxt <= max_batch_size else None,
        evaluations={b: estimates[b].required_bytes for b in sorted(seen)},
        seconds=time.perf_counter() - start, world_size=cfg.world_size, sharding=cfg.sharding,
    )


def _plan_cluster(model: nn.Module, optimizer: Any, capacities: list[Any], options: dict[str, Any], *, target: float,
                  device: str | None, accounting: CudaAccounting | None, max_batch_size: int, world_size: int,
                  shard_fn: Callable[[nn.Module, Any], Any] | None, global_batch_size: int | None,
                  speeds: Sequence[float] | None, start: float) -> ClusterPlanResult:
    """One plan per kind of GPU in ``capacities`` (fake steps shared where the accounting is the same), then the split."""
    n = len(capacities)
    if n == 0:
        raise ValueError("capacity is an empty list: give one capacity or named GPU per rank")
    if global_batch_size is not None and positive_int("global_batch_size", global_batch_size) < n:
        raise ValueError(f"global_batch_size={global_batch_size} cannot give {n} ranks a sample each: make it at "
                         f"least {n}")
    resolved = [_resolve_capacity(c, device) for c in capacities]
    if device is None and len({d for _, d, _ in resolved}) > 1:  # named GPUs beside sizes: all of them CUDA
        resolved = [_resolve_capacity(c, "cuda") for c in capacities]
    if speeds is None:
        missing = [c for c, (_, _, gpu) in zip(capacities, resolved) if gpu is None or gpu_spec(gpu).tflops is None]
        if missing:
            raise ValueError(f"capacity {missing[0]!r} has no speed in the GPU table: give speeds=[...] with one "
                             f"figure per rank proportional to its samples/s (e.g. speeds=[1.0] * {n})")
        speeds = [gpu_spec(gpu).tflops for _, _, gpu in resolved]  # type: ignore[arg-type, misc]
        speeds_from = "table"
    else:
        speeds = check_speeds(speeds, n)
        speeds_from = "given"
    sharding = options["sharding"]
    if world_size not in (1, n):
        raise ValueError(f"world_size={world_size} with {n} capacities: a list plans one rank per entry, so the "
                         f"world size is {n} (leave world_size out)")
    cluster_device = resolved[0][1]
    configs: dict[Any, _Config] = {}
    memo: dict[Any, dict[int, MemoryEstimate]] = {}
    plans: dict[tuple[Any, int], PlanResult] = {}
    keys = []
    for cap, dev, gpu in resolved:
        acc = accounting
        if dev == "cuda" and acc is None:
            acc = CudaAccounting.for_gpu(gpu) if gpu else CudaAccounting()
        key = (dev, None if acc is None else dataclasses.astuple(acc))
        if key not in configs:
            configs[key] = _Config(device=dev, accounting=acc, world_size=n if sharding else 1, **options)
            memo[key] = {}
        keys.append(key)
    cfg0 = next(iter(configs.values()))
    with _disable_current_modes(), _sharded(cfg0, shard_fn) as shards:
        setup = _FakeSetup(model, optimizer, mode=cfg0.mode, foreach=cluster_device == "cuda", shards=shards)
        for key, (cap, _, gpu) in zip(keys, resolved):
            if (key, cap) not in plans:
                plans[key, cap] = _plan_on(setup, configs[key], memo[key], cap=cap, gpu=gpu, target=target,
                                           max_batch_size=max_batch_size)
    per_rank = [plans[key, cap] for key, (cap, _, _) in zip(keys, resolved)]
    for i, plan in enumerate(per_rank):
        if plan.batch_size == 0:
            need = plan.evaluations.get(1)
            raise NothingFitsError(
                f"nothing fits on rank {i} ({plan.gpu or format_bytes(plan.capacity)}): batch size 1 needs "
                f"{format_bytes(need or 0)}, over its limit {format_bytes(plan.limit)}; leave the rank out, or "
                "need less memory per sample (mixed precision, activation checkpointing)",
                batch_size=1, peak_bytes=need, limit_bytes=plan.limit, capacity_bytes=plan.capacity)
    shares = rank_shares(global_batch_size, speeds, [p.batch_size for p in per_rank])
    ranks = tuple(RankPlan(**dataclasses.asdict(s), gpu=p.gpu, capacity=p.capacity, plan=p) for s, p in zip(shares, per_rank))
    result = ClusterPlanResult(
        global_batch_size=sum(r.share for r in ranks), ranks=ranks, speeds_from=speeds_from, target=target,
        device=cluster_device, seconds=time.perf_counter() - start, evaluations=sum(len(m) for m in memo.values()))
    logger.info("planned %d ranks: shares %s of a global batch of %d, %d fake runs, %.2f s", n, result.shares,
                result.global_batch_size, result.evaluations, result.seconds)
    return result
