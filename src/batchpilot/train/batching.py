"""Batch arithmetic (global = micro × world × accum) and learning-rate scaling rules.

A training job has one number that matters to the optimisation, the *global* batch (samples per
optimizer step), and two that only matter to the hardware: the *micro* batch (samples per
forward/backward on one rank) and the gradient-accumulation count. :class:`BatchConfig` keeps
the three consistent with the world size, so that a change of hardware (a smaller micro batch
after an OOM, fewer ranks after an elastic restart) never silently changes the optimisation.
:func:`scale_lr` and :func:`rescale_lr` apply the LR rule when the global batch itself changes.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import check_int, positive_int
from ..core.ranks import world_size as _default_world_size
from ..policy.schedule import LR_SCALE_RULES

__all__ = [
    "ADAPTIVE_NAME_MARKERS",
    "ADAPTIVE_OPTIMIZERS",
    "BatchConfig",
    "config_for_limit",
    "is_adaptive",
    "rescale_lr",
    "rescale_weight_decay",
    "scale_lr",
    "split_sizes",
]

logger = logging.getLogger(__name__)

#: torch optimizers that adapt a per-parameter step size; ``auto`` scales their LR by sqrt.
ADAPTIVE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.SparseAdam,
)

#: Substrings of a class name (lower-cased, anywhere in the MRO) that mark an adaptive
#: optimizer from outside torch (LAMB, Adafactor, AdaBelief, Adan, ...). They are the
#: substrings timm tests on the optimizer *name*, so ``auto`` agrees with timm's train.py.
ADAPTIVE_NAME_MARKERS: tuple[str, ...] = ("ada", "lamb")


def _multiples_around(n: int, step: int) -> list[int]:
    """The positive multiples of ``step`` nearest to ``n`` (not itself one) from below and above."""
    below = n // step * step
    return [m for m in (below, below + step) if m > 0]


def _divisors_around(n: int, target: int) -> list[int]:
    """The divisors of ``n`` nearest to ``target`` from below and from above (excluding it)."""
    divisors: set[int] = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            divisors.update((d, n // d))
    below = [d for d in divisors if d < target]
    above = [d for d in divisors if d > target]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


@dataclass(kw_only=True, frozen=True)
class BatchConfig:
    """The batch sizes of one training job, kept consistent: ``global = micro × world × accum``.

    Give any two of ``global_batch_size``, ``micro_batch_size`` and ``accum_steps`` and the third
    is filled in; give all three and they are checked. Given only ``global_batch_size``,
    ``accum_steps`` is 1; given only ``micro_batch_size``, ``accum_steps`` is 1. After
    construction every field is a positive int. The config is frozen: use
    :meth:`with_micro_batch_size` / :meth:`with_world_size` to derive a new one with the same
    global batch.

    Attributes:
        global_batch_size: Samples per optimizer step, summed over all ranks.
        micro_batch_size: Samples per forward/backward pass on one rank.
        accum_steps: Micro-batches accumulated per optimizer step on each rank.
        world_size: Number of data-parallel ranks. Default:
            :func:`batchpilot.dist.distributed.world_size` (the initialised ``torch.distributed``
            group, else ``$WORLD_SIZE`` (torchrun), else ``$SLURM_NTASKS``, else 1).

    Raises:
        ValueError: A value is not a positive int, fewer than the needed values are given, or
            the values do not satisfy ``global = micro × world × accum``. The message names the
            numbers that disagree and the nearest valid alternatives.
    """

    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    accum_steps: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        world = (
            _default_world_size()
            if self.world_size is None
            else positive_int("world_size", self.world_size)
        )
        given = {
            name: positive_int(name, getattr(self, name))
            for name in ("global_batch_size", "micro_batch_size", "accum_steps")
            if getattr(self, name) is not None
        }
        global_ = given.get("global_batch_size")
        micro = given.get("micro_batch_size")
        accum = given.get("accum_steps")
        if global_ is None and micro is None:
            raise ValueError(
                "BatchConfig needs global_batch_size or micro_batch_size (or both); "
                f"got only {', '.join(f'{k}={v}' for k, v in given.items()) or 'nothing'}"
            )
        if global_ is None:
            accum = 1 if accum is None else accum
            global_ = micro * world * accum  # type: ignore[operator]
        elif micro is None:
            if global_ % (world * (accum or 1)):
                raise ValueError(_explain_indivisible(global_, world, micro=None, accum=accum))
            accum = accum or 1
            micro = global_ // (world * accum)
        elif accum is None:
            if global_ % (micro * world):
                raise ValueError(_explain_indivisible(global_, world, micro=micro, accum=None))
            accum = global_ // (micro * world)
        elif global_ != micro * world * accum:
            product = micro * world * accum
            hint = f"use global_batch_size={product}"
            if global_ % (micro * world) == 0:
                hint += f", or accum_steps={global_ // (micro * world)}"
            raise ValueError(
                f"global_batch_size={global_} != micro_batch_size {micro} × world_size {world} × "
                f"accum_steps {accum} = {product}; {hint}, or leave one of the three out to have "
                "it computed"
            )
        # frozen dataclass: fields are filled in once, here.
        object.__setattr__(self, "global_batch_size", global_)
        object.__setattr__(self, "micro_batch_size", micro)
        object.__setattr__(self, "accum_steps", accum)
        object.__setattr__(self, "world_size", world)

    def describe(self) -> str:
        """One line for logs, e.g. ``global 256 = micro 32 × world 2 × accum 4``."""
        return (
            f"global {self.global_batch_size} = micro {self.micro_batch_size} × "
            f"world {self.world_size} × accum {self.accum_steps}"
        )

    def with_micro_batch_size(self, micro_batch_size: int) -> BatchConfig:
        """A config with the same global batch and world size, a new micro batch, accum recomputed.

        Raises:
            ValueError: ``global / world`` is not a multiple of ``micro_batch_size``; the message
                suggests the nearest micro batch sizes that divide it.
        """
        return BatchConfig(
            global_batch_size=self.global_batch_size,
            micro_batch_size=micro_batch_size,
            world_size=self.world_size,
        )

    def with_world_size(self, world_size: int) -> BatchConfig:
        """A config with the same global and micro batch on a new world size, accum recomputed.

        Used after an elastic restart so that the optimisation sees the same global batch.

        Raises:
            ValueError: ``global`` is not a multiple of ``micro × world_size``; the message
                suggests micro batch sizes (or global batch sizes) that would work.
        """
        return BatchConfig(
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            world_size=world_size,
        )


def _explain_indivisible(global_: int, world: int, *, micro: int | None, accum: int | None) -> str:
    """Why ``global_`` cannot be split as asked, and the nearest values that can.

    Exactly one of ``micro`` / ``accum`` is the value the user gave; ``None`` for both means only
    the global batch was given (accum defaults to 1, so micro = global / world).
    """
    if micro is None and accum is None:
        return (
            f"global_batch_size={global_} is not divisible by world_size {world}; nearest valid "
            f"global_batch_size: {_either(_multiples_around(global_, world))}"
        )
    known, known_name = (micro, "micro_batch_size") if micro is not None else (accum, "accum_steps")
    assert known is not None
    step = known * world
    msg = (
        f"global_batch_size={global_} is not divisible by {known_name} {known} × world_size "
        f"{world} = {step} ({global_} / {step} = {global_ / step:.4g}); "
        f"nearest valid global_batch_size: {_either(_multiples_around(global_, step))}"
    )
    if global_ % world:
        return msg + f" (global_batch_size must be a multiple of world_size {world})"
    per_rank = global_ // world
    return msg + (
        f", or {known_name} {_either(_divisors_around(per_rank, known))} "
        f"(divisors of global / world = {per_rank} nearest to {known})"
    )


def config_for_limit(
    global_batch_size: int, max_micro_batch_size: int, *, world_size: int | None = None
) -> BatchConfig:
    """The config holding ``global_batch_size`` with the largest micro-batch at most ``max_micro_batch_size``.

    Loops that accumulate whole micro-batches of one size (Lightning's ``accumulate_grad_batches``,
    Hugging Face's ``gradient_accumulation_steps``, Accelerate's ``accumulate``) need a micro-batch
    that divides the per-rank batch ``global / world``; this is its largest divisor not above the
    limit (a finder's answer). Examples with one rank: ``(256, 47)`` → micro 32 × accum 8;
    ``(256, 300)`` → micro 256 × accum 1; ``(96, 40)`` → micro 32 × accum 3.

    Raises:
        ValueError: a value that is not a positive int, or a global batch that does not divide by the
            world size (the message suggests the nearest that do).
    """
    max_micro = positive_int("max_micro_batch_size", max_micro_batch_size)
    whole = BatchConfig(global_batch_size=global_batch_size, world_size=world_size)
    per_rank = whole.micro_batch_size
    micro = max(d for d in _divisors_up_to(per_rank, max_micro))
    return whole.with_micro_batch_size(micro)


def _divisors_up_to(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` that are at most ``limit`` (1 always is)."""
    out = {1}
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            out.update(x for x in (d, n // d) if x <= limit)
    return sorted(out)


def split_sizes(total: int, micro: int) -> list[int]:
    """Micro-batch sizes that cover ``total`` samples: all ``micro`` except a smaller last one.

    Example: ``split_sizes(10, 4) == [4, 4, 2]``; ``split_sizes(0, 4) == []``.

    Raises:
        ValueError: ``total`` is negative or ``micro`` is not a positive int.
    """
    micro = positive_int("micro", micro)
    total = check_int("total", total, minimum=0)
    full, rest = divmod(total, micro)
    return [micro] * full + ([rest] if rest else [])


def is_adaptive(optimizer: torch.optim.Optimizer | type | None) -> bool:
    """Whether ``optimizer`` (an instance or a class) adapts per-parameter step sizes.

    True for subclasses of :data:`ADAPTIVE_OPTIMIZERS` and for any class whose MRO contains a
    class name with one of :data:`ADAPTIVE_NAME_MARKERS` ("ada", "lamb"), which covers
    optimizers from other libraries (LAMB, Adafactor, AdaBelief, Adan) without importing them.
    ``None`` is not adaptive.
    """
    if optimizer is None:
        return False
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if issubclass(cls, ADAPTIVE_OPTIMIZERS):
        return True
    return any(
        marker in klass.__name__.lower() for klass in cls.__mro__ for marker in ADAPTIVE_NAME_MARKERS
    )


def _resolve_rule(rule: str, optimizer: torch.optim.Optimizer | type | None) -> str:
    if rule not in LR_SCALE_RULES:
        raise ValueError(f"unknown LR scaling rule {rule!r}; use one of {', '.join(LR_SCALE_RULES)}")
    if rule == "auto":
        return "sqrt" if is_adaptive(optimizer) else "linear"
    return rule


def _batch_factor(new: int, old: int, rule: str) -> float:
    ratio = new / old
    if rule == "sqrt":
        # ** 0.5, not math.sqrt: the same float operations as timm, so the numbers are identical.
        return ratio**0.5
    if rule == "linear":
        return ratio
    return 1.0


def scale_lr(
    lr_base: float,
    global_batch_size: int,
    lr_base_size: int = 256,
    rule: str = "auto",
    optimizer: torch.optim.Optimizer | type | None = None,
) -> float:
    """The learning rate for ``global_batch_size``, given ``lr_base`` tuned at ``lr_base_size``.

    ======== ====================================== =================================================
    rule     lr                                      when
    ======== ====================================== =================================================
    linear   lr_base × gbs / lr_base_size            SGD-like optimizers (Goyal et al. 2017)
    sqrt     lr_base × sqrt(gbs / lr_base_size)      adaptive optimizers (Adam family, Adagrad, LAMB)
    none     lr_base                                 LR already tuned for this batch
    auto     sqrt if :func:`is_adaptive` else linear  the default
    ======== ====================================== =================================================

    ``auto`` by optimizer: Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, Adadelta, SparseAdam, their
    subclasses, and any class with "ada" or "lamb" in an MRO class name (LAMB, Adafactor,
    AdaBelief, Adan) → sqrt; SGD, RMSprop, ASGD, Rprop, LBFGS, LARS, ``None`` → linear. This is
    timm train.py's rule (sqrt iff "ada" or "lamb" is in the optimizer name), keyed on the class
    instead of a string, and it gives the same numbers.

    Args:
        lr_base: Learning rate tuned for ``lr_base_size`` samples per step.
        global_batch_size: Samples per optimizer step, summed over ranks and accumulation.
        lr_base_size: Global batch ``lr_base`` was tuned for.
        rule: One of :data:`LR_SCALE_RULES`.
        optimizer: An optimizer instance or class; only used by ``auto``.

    Raises:
        ValueError: Unknown ``rule``; ``lr_base`` not a finite number > 0; a batch size not a
            positive int.
    """
    if (
        isinstance(lr_base, bool)
        or not isinstance(lr_base, numbers.Real)
        or not math.isfinite(lr_base)
        or lr_base <= 0
    ):
        raise ValueError(f"lr_base must be a finite number > 0, got {lr_base!r}")
    global_batch_size = positive_int("global_batch_size", global_batch_size)
    lr_base_size = positive_int("lr_base_size", lr_base_size)
    resolved = _resolve_rule(rule, optimizer)
    return float(lr_base) * _batch_factor(global_batch_size, lr_base_size, resolved)


def _rescale_scheduler(scheduler: Any, factor: float) -> None:
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
    # SequentialLR / ChainedScheduler hand steps (and, at milestones, closed-form restarts from
    # base_lrs) to their children, so the children's base_lrs must move too.
    for child in getattr(scheduler, "_schedulers", ()):
        _rescale_scheduler(child, factor)


def rescale_lr(
    optimizer: torch.optim.Optimizer,
    old_global: int,
    new_global: int,
    rule: str = "auto",
    scheduler: Any = None,
) -> float:
    """Rescale a live optimizer (and its LR scheduler) after the global batch changed mid-run.

    Every param group's ``lr`` and ``initial_lr`` (and ``optimizer.defaults['lr']``) is multiplied
    by the rule's factor (``new/old`` for linear, its square root for sqrt, 1 for none), and so are
    the scheduler's ``base_lrs`` (recursively for ``SequentialLR``/``ChainedScheduler``), so that
    warmup and decay continue as if the scheduler had been built with the new base LR. Tensor LRs
    are scaled in place. Absolute LR bounds held elsewhere in a scheduler (``eta_min``,
    ``OneCycleLR``'s ``max_lr``, ``ReduceLROnPlateau``'s ``min_lrs``) are not touched.

    Args:
        optimizer: The optimizer to update in place.
        old_global: Global batch the current LRs are for.
        new_global: Global batch from now on.
        rule: One of :data:`LR_SCALE_RULES`; ``auto`` decides from ``optimizer``.
        scheduler: Optional LR scheduler attached to ``optimizer``.

    Returns:
        The factor the LRs were multiplied by.

    Raises:
        ValueError: Unknown rule, a batch size not a positive int, or a scheduler that belongs to
            another optimizer.
    """
    old_global = positive_int("old_global", old_global)
    new_global = positive_int("new_global", new_global)
    resolved = _resolve_rule(rule, optimizer)
    if scheduler is not None and getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("scheduler belongs to a different optimizer; pass the optimizer it drives")
    factor = _batch_factor(new_global, old_global, resolved)
    if factor == 1.0:
        return factor
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key not in group:
                continue
            if isinstance(group[key], torch.Tensor):
                # In place: compiled / capturable optimizer steps hold a reference to this tensor.
                group[key].mul_(factor)
            else:
                group[key] = group[key] * factor
    if isinstance(optimizer.defaults.get("lr"), numbers.Real):
        optimizer.defaults["lr"] = optimizer.defaults["lr"] * factor
    if scheduler is not None:
        _rescale_scheduler(scheduler, factor)
        if hasattr(scheduler, "_last_lr"):
            # So get_last_lr() reports the rescaled values before the next scheduler step.
            scheduler._last_lr = [
                g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                for g in optimizer.param_groups
            ]
    logger.info(
        "global batch %d -> %d: lr x %.6g (%s rule, %s)",
        old_global,
        new_global,
        factor,
        resolved,
        type(optimizer).__name__,
    )
    return factor


def rescale_weight_decay(
    optimizer: torch.optim.Optimizer, old_global: int, new_global: int, lr_factor: float
) -> float:
    """Rescale weight decay so that AdamW's timescale ``τ = B / (η λ D)`` survives a batch change.

    Bergsma et al. 2025 (arXiv 2505.13738) find the optimal AdamW run keeps ``τ``, in epochs,
    fixed across batch sizes; torch's AdamW decays by ``η λ`` per step, so with the LR already
    multiplied by ``lr_factor`` (what :func:`rescale_lr` returned) the decay is multiplied by
    ``(new / old) / lr_factor``: ``sqrt(new / old)`` under the sqrt rule, 1 under the linear one.
    Every param group's ``weight_decay`` (and ``optimizer.defaults``) is updated in place.

    Returns:
        The factor the weight decay was multiplied by.

    Raises:
        ValueError: a batch size that is not a positive int, or ``lr_factor`` not a finite number > 0.
    """
    old_global = positive_int("old_global", old_global)
    new_global = positive_int("new_global", new_global)
    if isinstance(lr_factor, bool) or not isinstance(lr_factor, numbers.Real) or not (math.isfinite(lr_factor) and lr_factor > 0):
        raise ValueError(f"lr_factor must be a finite number > 0, got {lr_factor!r}")
    factor = (new_global / old_global) / lr_factor
    if factor == 1.0:
        return factor
    for group in optimizer.param_groups:
        if isinstance(group.get("weight_decay"), numbers.Real):
            group["weight_decay"] = group["weight_decay"] * factor
    if isinstance(optimizer.defaults.get("weight_decay"), numbers.Real):
        optimizer.defaults["weight_decay"] = optimizer.defaults["weight_decay"] * factor
    logger.info("global batch %d -> %d: weight decay x %.6g (AdamW timescale kept)", old_global, new_global, factor)
    return factor
