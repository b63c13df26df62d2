"""What the integrations share: their sizing options, the batch setup they report, imports."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType
from typing import Any

from .._checks import positive_int
from ..find.options import FindOptions
from ..find.result import BatchPlan
from ..policy.microbatch import accum_steps as micro_batches, balanced_sizes
from ..policy.schedule import LR_SCALE_RULES
from ..train.batching import BatchConfig, config_for_limit, is_adaptive

__all__ = ["BatchSetup", "DeferredOptimizer", "SizingOptions", "require", "require_installed", "choose_batches",
           "count_sizes", "lr_rule_for", "note_equal_shares"]

logger = logging.getLogger(__name__)


def require(module: str, extra_hint: str) -> ModuleType:
    """Import ``module`` or fail with an ImportError that names the extra to install.

    Raises:
        ImportError: ``module`` is not installed (the message says how to install it).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise _missing(module, extra_hint) from exc


def require_installed(module: str, extra_hint: str) -> None:
    """Fail early, as :func:`require` does, when ``module`` is not installed -- without importing it.

    For a module whose functions import their framework when called: importing the framework
    (``transformers`` alone: hundreds of modules) is then paid by what uses it, not by the import.

    Raises:
        ImportError: ``module`` is not installed (the message says how to install it).
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken half-imported module
        found = False
    if not found:
        raise _missing(module, extra_hint)


def _missing(module: str, extra_hint: str) -> ImportError:
    top = module.split(".")[0]
    return ImportError(f"{extra_hint} needs {top}, which is not installed: "
                       f"pip install 'batchpilot[integrations]' (or pip install {top})")


class DeferredOptimizer:
    """A trainer's optimizer as batchpilot's engine sees it inside the trainer's ``training_step``.

    The engine accumulates one batch's gradients (with its OOM retry and, under DDP, its gradient
    average once every rank succeeded); the trainer's own loop then clips them, steps the optimizer
    and the scheduler, counts ``global_step`` and zeroes them, as it does without batchpilot. So
    ``step`` and ``zero_grad`` do nothing here, and everything else is the trainer's optimizer of the
    moment (``trainer.optimizer``, which the trainer builds, and may rebuild, after the engine).
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._trainer.optimizer.param_groups

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    # the engine's length searches snapshot the optimizer and put it back: the trainer's, untouched by them
    def state_dict(self) -> dict[str, Any]:
        return self._trainer.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.optimizer.load_state_dict(state)


@dataclass(kw_only=True)
class SizingOptions:
    """How an integration sizes the batch; validated before anything runs.

    Attributes:
        global_batch_size: samples per optimizer step over all ranks to hold fixed: the micro-batch
            and the accumulation are chosen for it. ``None``: the largest micro-batch that fits, with
            the accumulation the job was configured with (the global batch then changes, and the
            learning rate follows by ``lr_rule``).
        lr_base_size: the global batch the learning rate was tuned for; ``None``: the global batch
            the job was configured with before sizing.
        lr_rule: how the learning rate follows the global batch: ``"none"`` (default: the learning
            rate is left as configured, as the peers' finders do), ``"auto"`` (sqrt for Adam-like
            optimizers, linear otherwise), ``"linear"`` or ``"sqrt"``
            (:func:`batchpilot.train.batching.scale_lr`).
        find: the finder's options (:class:`~batchpilot.find.options.FindOptions`); the integration
            sets the device and what to restore itself, and caps ``max_batch_size`` at the
            per-rank batch and at the dataset's length.

    Raises:
        ValueError: a size that is not a positive int, or an unknown ``lr_rule``.
        TypeError: ``find`` is not a :class:`~batchpilot.find.options.FindOptions`.
    """

    global_batch_size: int | None = None
    lr_base_size: int | None = None
    lr_rule: str = "none"
    find: FindOptions = field(default_factory=FindOptions)

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "lr_base_size"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.lr_rule not in LR_SCALE_RULES:
            raise ValueError(f"unknown lr_rule {self.lr_rule!r}; use one of {', '.join(LR_SCALE_RULES)}")
        if not isinstance(self.find, FindOptions):
            raise TypeError(f"find must be a batchpilot.FindOptions, got {type(self.find).__name__}")

    def finder_options(self, limit: int | None) -> FindOptions:
        """The finder's options, with ``max_batch_size`` the smaller of the option's and ``limit``."""
        caps = [c for c in (self.find.max_batch_size, limit) if c is not None]
        return FindOptions.build(self.find, max_batch_size=min(caps) if caps else None)


@dataclass(kw_only=True, frozen=True)
class BatchSetup:
    """The batch sizes an integration chose, and the learning rate that follows from them.

    ``global_batch_size == per_rank_batch_size × world_size``, and each rank's batch is the
    ``micro_batch_sizes`` in turn: ``accum_steps`` equal micro-batches of ``micro_batch_size`` for
    a framework's own accumulation, or batchpilot's engine's balanced ones (512 under 15:
    22 of 15 and 13 of 14), which differ by one sample.

    Attributes:
        micro_batch_size: samples per forward and backward pass on one device (the largest
            micro-batch).
        accum_steps: micro-batches per optimizer step on each rank.
        world_size: data-parallel ranks.
        global_batch_size: samples per optimizer step over all ranks.
        per_rank_batch_size: samples per optimizer step on one rank.
        micro_batch_sizes: the samples of each micro-batch of one rank's step, in order; their
            sum is ``per_rank_batch_size``, their count ``accum_steps``, the first
            ``micro_batch_size``.
        found_batch_size: the finder's per-device answer, agreed over ranks (``None`` when no
            search ran).
        limited_by_rank: the rank whose memory set ``found_batch_size``.
        lr_base_size: the global batch the learning rate was tuned for.
        lr_rule: the rule applied (``"auto"`` resolved to ``"linear"`` or ``"sqrt"``).
        lr_factor: what the learning rates were multiplied by (1.0 when the global batch is the base).
        learning_rates: the learning rates after scaling, one per optimizer param group.
        plan: the finder's plan on this rank (trials, memory fit), or ``None``.
    """

    micro_batch_size: int
    accum_steps: int
    world_size: int
    global_batch_size: int
    per_rank_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    found_batch_size: int | None = None
    limited_by_rank: int | None = None
    lr_base_size: int
    lr_rule: str
    lr_factor: float = 1.0
    learning_rates: tuple[float, ...] = ()
    plan: BatchPlan | None = None

    def __post_init__(self) -> None:
        sizes = tuple(self.micro_batch_sizes)
        object.__setattr__(self, "micro_batch_sizes", sizes)  # frozen: a list given becomes a tuple
        if (not sizes or sum(sizes) != self.per_rank_batch_size or len(sizes) != self.accum_steps
                or max(sizes) != self.micro_batch_size or sizes[0] != self.micro_batch_size):
            raise ValueError(
                f"micro_batch_sizes {list(sizes)} must be accum_steps={self.accum_steps} micro-batches of at most "
                f"micro_batch_size={self.micro_batch_size}, the first that size, summing to "
                f"per_rank_batch_size={self.per_rank_batch_size}"
            )

    def with_micro_batches(self, sizes: tuple[int, ...] | list[int]) -> BatchSetup:
        """The same setup with one rank's step cut into ``sizes`` (what an engine ran, say).

        Raises:
            ValueError: ``sizes`` do not sum to ``per_rank_batch_size``.
        """
        sizes = tuple(sizes)
        return replace(self, micro_batch_size=max(sizes, default=0), accum_steps=len(sizes), micro_batch_sizes=sizes)

    def describe(self) -> str:
        """One line, e.g. ``global 256 = micro 32 × world 2 × accum 4; lr × 1.41 (sqrt from 128)``.

        Unequal micro-batches are counted by size: ``global 512 = micro 15 × world 1 × accum 35
        (22 of 15, 13 of 14)``.
        """
        head = (f"global {self.global_batch_size} = micro {self.micro_batch_size} × world {self.world_size} "
                f"× accum {self.accum_steps}")
        if len(set(self.micro_batch_sizes)) > 1:
            head += f" ({count_sizes(self.micro_batch_sizes)})"
        if self.lr_factor != 1.0:
            head += f"; lr × {self.lr_factor:.4g} ({self.lr_rule} from {self.lr_base_size})"
        return head

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the plan as :meth:`BatchPlan.to_dict`)."""
        out = asdict(self)
        out["plan"] = None if self.plan is None else self.plan.to_dict()
        out["learning_rates"] = list(self.learning_rates)
        out["micro_batch_sizes"] = list(self.micro_batch_sizes)
        return out


def count_sizes(sizes: tuple[int, ...] | list[int]) -> str:
    """Micro-batch sizes counted in order of first appearance: ``(15,) * 22 + (14,) * 13`` is ``22 of 15, 13 of 14``."""
    counts: dict[int, int] = {}
    for size in sizes:
        counts[size] = counts.get(size, 0) + 1
    return ", ".join(f"{n} of {size}" for size, n in counts.items())


def lr_rule_for(rule: str, optimizer: Any) -> str:
    """The rule :func:`batchpilot.train.batching.scale_lr` applies: ``"auto"`` is sqrt for adaptive optimizers,
    else linear."""
    if rule != "auto":
        return rule
    return "sqrt" if is_adaptive(optimizer) else "linear"


def choose_batches(found: int, *, world_size: int, global_batch_size: int | None, accum_steps: int,
                   whole_micro_batches: bool) -> tuple[int, int, int, tuple[int, ...]]:
    """``(micro, accum, per_rank, micro_batch_sizes)`` for a finder's answer ``found``.

    With a global batch to hold, ``whole_micro_batches`` (a loop that accumulates equal
    micro-batches) takes the largest divisor of the per-rank batch up to ``found``
    (:func:`batchpilot.train.batching.config_for_limit`); otherwise the micro-batches are those
    batchpilot's engine starts with when it splits by count: the fewest that fit under ``found``,
    balanced (:func:`batchpilot.policy.microbatch.balanced_sizes`: 512 under 15 is 22 of 15 and
    13 of 14). Without one, the micro-batch is ``found`` and ``accum_steps`` is kept.

    Raises:
        ValueError: the global batch does not divide by the world size.
    """
    if global_batch_size is None:
        cfg = BatchConfig(micro_batch_size=found, accum_steps=accum_steps, world_size=world_size)
        return (cfg.micro_batch_size, cfg.accum_steps, cfg.micro_batch_size * cfg.accum_steps,
                (cfg.micro_batch_size,) * cfg.accum_steps)
    if whole_micro_batches:
        cfg = config_for_limit(global_batch_size, found, world_size=world_size)
        if cfg.micro_batch_size < 0.75 * min(found, cfg.micro_batch_size * cfg.accum_steps):
            step = found * cfg.world_size
            below = global_batch_size // step * step
            near = " or ".join(str(g) for g in (below, below + step) if g > 0)
            logger.warning(
                "micro-batches of %d fit, but global_batch_size=%d splits into equal micro-batches of %d at most; "
                "a global batch of %s would use the memory fully (batchpilot's engine, in ResilientTrainer or "
                "ResilientModule, cuts unequal micro-batches: %d per step instead of %d)", found,
                global_batch_size, cfg.micro_batch_size, near,
                math.ceil(cfg.micro_batch_size * cfg.accum_steps / found), cfg.accum_steps,
            )
        return (cfg.micro_batch_size, cfg.accum_steps, cfg.micro_batch_size * cfg.accum_steps,
                (cfg.micro_batch_size,) * cfg.accum_steps)
    per_rank = BatchConfig(global_batch_size=global_batch_size, world_size=world_size).micro_batch_size
    sizes = tuple(balanced_sizes(per_rank, micro_batches(per_rank, found)))
    return sizes[0], len(sizes), per_rank, sizes


def note_equal_shares(plan: BatchPlan | None, world_size: int, framework: str, sampler: str) -> bool:
    """Say, in one line, that this rank fits more than the size all ranks agreed on and why it keeps it.

    A framework whose sampler gives every rank the same per-device batch (``sampler`` names it)
    cannot take uneven shares: a rank with a larger batch would run fewer steps per epoch than
    the others (and wait for them in a collective), and its samples would weigh less in the
    averaged gradient. So the smallest rank's size stays everyone's, as before; this says so on
    the ranks it holds back (logged at WARNING, once per sizing). Returns whether it did.
    """
    if plan is None or world_size <= 1:
        return False
    own = max((t.batch_size for t in plan.trials if t.outcome == "fit"), default=plan.batch_size)
    if own <= plan.batch_size:
        return False
    logger.warning(
        "batchpilot: this rank fits a batch of %d but takes %d, rank %s's: %s gives every rank the same per-device "
        "batch (%s), so uneven shares cannot be handed out; the smallest rank's size is kept (docs/integrations.md"
        "#uneven-ranks)", own, plan.batch_size, plan.limited_by_rank, framework, sampler)
    return True
