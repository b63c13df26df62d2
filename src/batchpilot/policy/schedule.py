"""Global-batch schedules: constant, a Megatron-style ramp, and one that follows the noise scale.

Pure and torch-free: a schedule is told where training stands (:class:`SchedulePoint`) and names
the global batch of the next step. :class:`batchpilot.train.engine.Engine` follows it (per-rank batch,
accumulation, LR by rule); the data loader follows the engine. Details: ``docs/internals.md#schedule``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

from .._checks import check_int, positive_int

__all__ = [
    "LR_SCALE_RULES",
    "AdaptiveSchedule",
    "BatchSchedule",
    "ConstantSchedule",
    "RampSchedule",
    "SCHEDULE_SPECS",
    "SchedulePoint",
    "parse_schedule",
    "round_to_multiple",
]

#: Accepted LR scaling rules: a schedule's ``lr_rule``, ``rule`` in
#: :func:`batchpilot.train.batching.scale_lr` and :func:`batchpilot.train.batching.rescale_lr`.
LR_SCALE_RULES: tuple[str, ...] = ("auto", "linear", "sqrt", "none")

#: The spellings :func:`parse_schedule` accepts (and ``batchpilot train --batch-schedule``).
SCHEDULE_SPECS = ("constant | ramp:START,INCR,SAMPLES | "
                  "adaptive[:k=K,min=N,max=N,every=N,granule=N,start=N,max_factor=F,decrease=yes]")


def round_to_multiple(value: float, unit: int) -> int:
    """The multiple of ``unit`` nearest to ``value`` (halves round up), at least ``unit``.

    Example: ``round_to_multiple(50, 16) == 48``, ``round_to_multiple(56, 16) == 64``,
    ``round_to_multiple(3, 16) == 16``.
    """
    unit = positive_int("unit", unit)
    return max(unit, unit * math.floor(value / unit + 0.5))


@dataclass(frozen=True, kw_only=True)
class SchedulePoint:
    """Where training stands after an optimizer step.

    Attributes:
        step: optimizer steps done.
        samples: samples trained on so far, summed over ranks.
        current: the global batch of the step just done.
        last_change: the step after which the global batch last changed (0: never).
        world: data-parallel ranks.
        noise_scale: ``B_simple`` in samples (the engine's EMA); ``None`` when not measured or
            not read (the engine reads it only when :meth:`BatchSchedule.wants_noise` says so).
    """

    step: int
    samples: int
    current: int
    last_change: int = 0
    world: int = 1
    noise_scale: float | None = None


@dataclass(frozen=True, kw_only=True)
class BatchSchedule:
    """A global-batch schedule: :meth:`initial` for the first step, :meth:`decide` after each.

    ``reference`` is the engine's ``global_batch_size``: the batch the optimizer's LR is set
    for. On every change the engine rescales the LR by ``lr_rule`` (see
    :func:`batchpilot.train.batching.rescale_lr`) and, with ``scale_weight_decay``, the weight decay so
    that AdamW's timescale ``τ = B / (η λ D)`` stays put (Bergsma et al. 2025, arXiv
    2505.13738): ``λ ← λ · (B_new / B_old) / (η_new / η_old)``. Off by default.

    Attributes:
        lr_rule: ``auto`` (sqrt for Adam-family, linear otherwise), ``linear``, ``sqrt``, ``none``.
        scale_weight_decay: rescale weight decay with the batch as above.

    Raises:
        ValueError: an unknown ``lr_rule``.
    """

    lr_rule: str = "auto"
    scale_weight_decay: bool = False

    #: the schedule follows the gradient noise scale (the engine must measure it)
    reads_noise: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.lr_rule not in LR_SCALE_RULES:
            raise ValueError(f"lr_rule must be one of {', '.join(LR_SCALE_RULES)}, got {self.lr_rule!r}")

    def initial(self, reference: int, world: int) -> int:
        """The global batch of the first step."""
        raise NotImplementedError

    def decide(self, point: SchedulePoint, reference: int) -> int:
        """The global batch of the step after ``point``."""
        raise NotImplementedError

    def wants_noise(self, point: SchedulePoint) -> bool:
        """Whether :meth:`decide` will read ``point.noise_scale`` (reading it waits for the device)."""
        return False

    def for_world(self, batch: int, reference: int, world: int) -> int:
        """``batch`` made valid on ``world`` ranks (a checkpoint resumed on another world size)."""
        return batch

    def describe(self) -> str:
        """The spec :func:`parse_schedule` reads back."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class ConstantSchedule(BatchSchedule):
    """The engine's ``global_batch_size`` on every step."""

    def initial(self, reference: int, world: int) -> int:
        return reference

    def decide(self, point: SchedulePoint, reference: int) -> int:
        return reference

    def for_world(self, batch: int, reference: int, world: int) -> int:
        return reference

    def describe(self) -> str:
        return "constant"


@dataclass(frozen=True, kw_only=True)
class RampSchedule(BatchSchedule):
    """Megatron's ``--rampup-batch-size START INCR SAMPLES``: from ``start`` up to the engine's
    ``global_batch_size`` in steps of ``increment``, evenly over the first ``samples`` samples.

    The batch of a step is ``start + increment · ⌊consumed / (samples / n)⌋``, capped at the
    final batch, where ``n = ⌈(final - start) / increment⌉`` increments and ``consumed`` is the
    samples trained on before the step; rounded down to a multiple of ``world × granule``.

    Example, ``start=32, increment=32, samples=300``, final 128 (3 increments, one per 100
    samples): steps train on 32, 32, 32, 32 (128 consumed), 64, 64 (256), 96 (352), 128, ...

    Attributes:
        start: the first global batch.
        increment: the step between batches.
        samples: samples over which the ramp reaches the final batch.
        granule: batches are multiples of ``world × granule``.

    Raises:
        ValueError: a value that is not a positive int.
    """

    start: int
    increment: int
    samples: int
    granule: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("start", "increment", "samples", "granule"):
            positive_int(name, getattr(self, name))

    def _batch(self, consumed: int, reference: int, world: int) -> int:
        unit = world * self.granule
        if self.start >= reference:
            raw = reference
        else:
            increments = -(-(reference - self.start) // self.increment)
            # ⌊consumed / (samples / n)⌋ in integers: Megatron's float division can land a hair short
            raw = min(reference, self.start + self.increment * (consumed * increments // self.samples))
        return max(unit, raw // unit * unit)

    def initial(self, reference: int, world: int) -> int:
        return self._batch(0, reference, world)

    def decide(self, point: SchedulePoint, reference: int) -> int:
        return self._batch(point.samples, reference, point.world)

    def for_world(self, batch: int, reference: int, world: int) -> int:
        unit = world * self.granule
        return max(unit, batch // unit * unit)

    def describe(self) -> str:
        extra = f",granule={self.granule}" if self.granule != 1 else ""
        return f"ramp:{self.start},{self.increment},{self.samples}{extra}"


@dataclass(frozen=True, kw_only=True)
class AdaptiveSchedule(BatchSchedule):
    """The global batch follows ``k × B_simple``, the engine's EMA of the gradient noise scale.

    After every ``every`` steps since the last change, the next batch is ``k × noise_scale``,
    moved by at most a factor ``max_factor`` from the current one (an early, noisy estimate
    cannot throw the batch to the maximum at once), clamped to ``[min_batch_size,
    max_batch_size]`` and rounded to the nearest multiple of ``world × granule``. An infinite
    noise scale (the signal lost in the noise) asks for the maximum. It only grows unless
    ``decrease``; it stays while nothing is measured.

    Example, ``k=1, min 16, max 128, every 2, max_factor 2``, one rank, noise scale 40 after
    step 2 and 200 after steps 4 and 6: steps 1-2 train on 16, 3-4 on 32 (40 capped at 2 × 16),
    5-6 on 64, then 128.

    McCandlish et al. find the critical batch ``B_crit ≈ B_noise ≳ B_simple``: at ``B = B_crit``
    a run needs twice the minimum steps and twice the minimum samples; ``k < 1`` spends fewer
    samples and more steps.

    Attributes:
        k: multiple of the noise scale to train at.
        min_batch_size: the smallest global batch, and the first unless ``start``; default
            the engine's ``global_batch_size`` // 8.
        max_batch_size: the largest; default the engine's ``global_batch_size``.
        granule: batches are multiples of ``world × granule`` (8: sizes that suit accelerators).
        every: steps between changes (and before the first).
        max_factor: the most one change may multiply (or, with ``decrease``, divide) the batch by.
        decrease: let the batch shrink when the noise scale falls.
        start: the first global batch; default ``min_batch_size``.

    Raises:
        ValueError: a value out of range.
    """

    k: float = 1.0
    min_batch_size: int | None = None
    max_batch_size: int | None = None
    granule: int = 8
    every: int = 10
    max_factor: float = 2.0
    decrease: bool = False
    start: int | None = None

    reads_noise: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.k, bool) or not isinstance(self.k, numbers.Real) or not (math.isfinite(self.k) and self.k > 0):
            raise ValueError(f"k must be a positive number (the multiple of the noise scale), got {self.k!r}")
        for name in ("min_batch_size", "max_batch_size", "start"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        positive_int("granule", self.granule)
        positive_int("every", self.every)
        if isinstance(self.max_factor, bool) or not isinstance(self.max_factor, numbers.Real) or not self.max_factor > 1:
            raise ValueError(f"max_factor must be a number above 1 (the most one change multiplies the batch by), "
                             f"got {self.max_factor!r}")
        if self.min_batch_size is not None and self.max_batch_size is not None and self.min_batch_size > self.max_batch_size:
            raise ValueError(f"min_batch_size {self.min_batch_size} is above max_batch_size {self.max_batch_size}")

    def bounds(self, reference: int, world: int) -> tuple[int, int]:
        """The smallest and largest multiples of ``world × granule`` in ``[min, max]``.

        Raises:
            ValueError: no multiple lies there; the message names the unit and the range.
        """
        unit = world * self.granule
        hi_raw = self.max_batch_size if self.max_batch_size is not None else reference
        lo_raw = self.min_batch_size if self.min_batch_size is not None else max(1, reference // 8)
        lo_raw = min(lo_raw, hi_raw)
        lo, hi = -(-lo_raw // unit) * unit, hi_raw // unit * unit
        if hi < lo:
            raise ValueError(
                f"no multiple of world {world} × granule {self.granule} = {unit} lies in [{lo_raw}, {hi_raw}]; "
                "widen min_batch_size / max_batch_size or lower the granule"
            )
        return lo, hi

    def _clamp(self, value: float, reference: int, world: int) -> int:
        lo, hi = self.bounds(reference, world)
        if math.isnan(value):
            value = lo
        return round_to_multiple(min(max(value, lo), hi), world * self.granule)

    def initial(self, reference: int, world: int) -> int:
        lo, _ = self.bounds(reference, world)
        return lo if self.start is None else self._clamp(self.start, reference, world)

    def wants_noise(self, point: SchedulePoint) -> bool:
        return point.step - point.last_change >= self.every

    def decide(self, point: SchedulePoint, reference: int) -> int:
        if not self.wants_noise(point) or point.noise_scale is None or math.isnan(point.noise_scale):
            return point.current
        target = min(max(self.k * point.noise_scale, point.current / self.max_factor), point.current * self.max_factor)
        new = self._clamp(target, reference, point.world)
        if new < point.current and not self.decrease:
            return point.current
        return new

    def for_world(self, batch: int, reference: int, world: int) -> int:
        return self._clamp(batch, reference, world)

    def describe(self) -> str:
        parts = [f"k={self.k:g}"]
        for key, value in (("min", self.min_batch_size), ("max", self.max_batch_size), ("start", self.start)):
            if value is not None:
                parts.append(f"{key}={value}")
        parts += [f"every={self.every}", f"granule={self.granule}", f"max_factor={self.max_factor:g}"]
        if self.decrease:
            parts.append("decrease=yes")
        return "adaptive:" + ",".join(parts)


_ADAPTIVE_KEYS = {"k": "k", "min": "min_batch_size", "max": "max_batch_size", "every": "every",
                  "granule": "granule", "start": "start", "max_factor": "max_factor", "decrease": "decrease"}
_YES, _NO = ("yes", "true", "1", "on"), ("no", "false", "0", "off")


def parse_schedule(spec: str, *, lr_rule: str = "auto", scale_weight_decay: bool = False) -> BatchSchedule:
    """A schedule from its spec: ``constant``, ``ramp:START,INCR,SAMPLES`` or ``adaptive[:key=value,...]``.

    Adaptive keys: ``k``, ``min``, ``max``, ``every``, ``granule``, ``start``, ``max_factor``,
    ``decrease`` (yes/no); a ramp may end with ``granule=N``. Example: ``adaptive:k=0.5,min=16,max=512``.

    Raises:
        ValueError: an unknown kind or key, or a value that is not a number; the message shows
            the accepted spellings (:data:`SCHEDULE_SPECS`).
    """
    if not isinstance(spec, str):
        raise ValueError(f"a batch schedule is a string, {SCHEDULE_SPECS}; got {spec!r}")
    kind, _, args = spec.strip().partition(":")
    kind = kind.strip().lower()
    common = {"lr_rule": lr_rule, "scale_weight_decay": scale_weight_decay}
    try:
        if kind == "constant" and not args:
            return ConstantSchedule(**common)
        if kind == "ramp":
            parts = [p.strip() for p in args.split(",") if p.strip()]
            keyed = dict(_key_value(p) for p in parts[3:])
            if len(parts) < 3 or set(keyed) - {"granule"}:
                raise ValueError("a ramp is ramp:START,INCR,SAMPLES[,granule=N]")
            start, incr, samples = (_int(p) for p in parts[:3])
            return RampSchedule(start=start, increment=incr, samples=samples,
                                **{k: _int(v) for k, v in keyed.items()}, **common)
        if kind == "adaptive":
            options: dict[str, Any] = {}
            for part in (p.strip() for p in args.split(",") if p.strip()):
                key, value = _key_value(part)
                if key not in _ADAPTIVE_KEYS:
                    raise ValueError(f"unknown adaptive key {key!r}; use {', '.join(_ADAPTIVE_KEYS)}")
                if key in ("k", "max_factor"):
                    options[key] = _float(value)
                elif key == "decrease":
                    if value.lower() not in _YES + _NO:
                        raise ValueError(f"decrease={value!r}: use yes or no")
                    options["decrease"] = value.lower() in _YES
                else:
                    options[_ADAPTIVE_KEYS[key]] = _int(value)
            return AdaptiveSchedule(**options, **common)
    except ValueError as exc:
        raise ValueError(f"batch schedule {spec!r}: {exc}; accepted: {SCHEDULE_SPECS}") from None
    raise ValueError(f"unknown batch schedule {spec!r}; accepted: {SCHEDULE_SPECS}")


def _key_value(part: str) -> tuple[str, str]:
    key, sep, value = part.partition("=")
    if not sep or not value.strip():
        raise ValueError(f"{part!r} is not key=value")
    return key.strip().lower(), value.strip()


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    return check_int("value", value, minimum=1)
