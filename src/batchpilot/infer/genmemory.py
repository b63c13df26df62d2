"""The memory of ``model.generate`` (a KV cache that grows) over batch, prompt length and new tokens.

A greedy ``generate`` of ``b`` prompts padded to ``P`` tokens with ``max_new_tokens=N`` grows the
memory in use by

    growth(b, P, N) = scale × max(prefill(b, P), decode(b, P + N))

* ``prefill(b, P) = F(P) + b × S(P)``: the forward over the prompt and its first token; ``S`` a
  quadratic in ``P`` (activations, the attention scores no fused kernel avoids), fitted like the
  finder's length model (:class:`~batchpilot.policy.lengths.LengthFit`);
* ``decode(b, T) = E(T) + b × D(T)`` in the step that leaves ``T`` tokens (prompt and new), taken
  at every ``T`` a trial decoded through (the line over its batch sizes) and interpolated between:
  ``D(T) ≈ per_step + per_token × T``, ``per_token`` a token of KV cache (with its ids and mask),
  ``per_step`` what a step holds whatever the length (the logits of its token, their float copy).
  ``D`` is no straight line: where a step's peak moves from its logits to its attention (the cache
  of one layer copied as it grows), it bends up; convex, so a chord between measured lengths is
  above it;
* ``scale >= 1``: the figure that fails over the tensor bytes modelled (an allocator's reserved
  memory, a host's address space) and what verifications or OOMs showed the model missing.

:func:`fit_generation_memory` measures it with real ``generate`` calls: at two or three prompt
lengths, two batch sizes each and a verification at the answer (at most three per length),
each split at every decoding step (a stopping criterion closes a measurement window), so one
trial gives the prefill and the cache's growth over ``N`` steps. Why and the figures:
``docs/generation.md``.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from .._checks import positive_int
from .._progress import Progress
from ..core.model import context_length, model_device
from ..find.notes import add_note
from ..find.options import FindOptions
from ..find.result import figure_name
from ..memory.gauge import AllocatorGauge, Gauge, TensorGauge, gauge_for
from ..memory.host import malloc_threshold_held
from ..memory.limits import limit_named
from ..memory.oom import attempt, free_memory, is_oom
from ..memory.probes import EMULATED_DEVICES, emulate_capacity, emulated_capacity
from ..memory.tracker import StorageTracker, active_tracker
from ..memory.units import format_bytes, resolve_device
from ..policy.lengths import LengthFit, check_lengths, fit_lengths
from ..policy.search import FIT, OOM, OVER_TARGET, BatchSizeError, NothingFitsError, least_squares_line

__all__ = [
    "GenerationFitError",
    "GenerationMemory",
    "GenerationTrial",
    "MAX_PADDING",
    "MemoryRoom",
    "UnverifiedShapeError",
    "band_heads",
    "band_low",
    "check_token_id",
    "choose_prompt_lengths",
    "context_length",
    "eos_ids",
    "fit_generation_memory",
    "fit_in",
    "measure_generate",
    "memory_room",
    "model_device",
]

logger = logging.getLogger(__name__)

#: the share of the room a trial's modelled growth must reach before its real figure corrects the
#: model (smaller trials are within the noise of a host's or an allocator's figure)
_SCALE_SHARE = 1 / 16
#: on a figure other than exact tensor bytes, the second trial aims at this share of the room
_SECOND_SHARE = 0.25
#: ... or takes every real prompt left in its band when they fit in this share by the first
#: trial's figure, which bounds a prompt's cost from above while the memory is affine in the batch
#: with a fixed part >= 0: the band then ends in two calls instead of three. A quarter of the room
#: is left for a host figure's noise, which at half the room put a band's last prompts at the edge
#: (measured: docs/internals.md)
_BAND_SHARE = 0.75
#: a batch pads no prompt to more than this many times its length, unless by no more than
#: max_new_tokens (whose steps cost alike): every decoding step attends over the padding too
#: (its cost measured: docs/internals.md)
MAX_PADDING = 2.0


class GenerationFitError(BatchSizeError):
    """The trials give no memory model (a per-sample cost that does not grow); ``trials`` keeps them.

    :func:`batchpilot.infer.generate.generate_by_length` then sizes each batch by the largest batch
    a trial ran under the limit at a shape at least as long.
    """

    def __init__(self, message: str, *, trials: Sequence[GenerationTrial] = ()) -> None:
        super().__init__(message)
        self.trials = list(trials)


class UnverifiedShapeError(ValueError):
    """A prompt length or a total length beyond the longest a trial measured."""


@dataclass(kw_only=True)
class GenerationTrial:
    """One real ``generate`` at ``(batch_size, prompt_length, max_new_tokens)``, measured per step.

    Tensor figures are bytes over what was live when it started (the tracker's on CPU, the
    allocator's allocated bytes on an accelerator).

    Attributes:
        outcome: ``"fit"``, ``"over_target"`` (ran, but its peak passed the limit) or ``"oom"``.
        prefill_bytes: the tensors' peak in the prompt's forward and first token.
        decode_bytes: ``((T, bytes), ...)``: the peak of each later step, ``T`` the tokens it
            leaves (prompt and new); the last step includes what ``generate`` does after it.
        tensor_peak_bytes: the whole call's tensor peak.
        peak_bytes: the growth of the figure that fails (:mod:`batchpilot.memory.gauge`) over
            ``start_bytes``; the tensor bytes themselves under an emulated CPU capacity.
        start_bytes: that figure when the trial started.
        seconds: the call's wall time.
        prompts: the indices of the real prompts it ran (``()``: made-up prompts).
        outputs: with real prompts that ran to the end, each row's new tokens as a ``generate``
            without the trial's measurement gives them (cut after the EOS the trial held back).
    """

    batch_size: int
    prompt_length: int
    max_new_tokens: int
    outcome: str
    prefill_bytes: int | None = None
    decode_bytes: tuple[tuple[int, int], ...] = ()
    tensor_peak_bytes: int | None = None
    peak_bytes: int | None = None
    start_bytes: int = 0
    seconds: float = 0.0
    prompts: tuple[int, ...] = ()
    outputs: tuple[list[int], ...] = field(default=(), repr=False, compare=False)

    @property
    def measured(self) -> bool:
        """It ran to the end (every step's window is there)."""
        return self.outcome != OOM and self.prefill_bytes is not None

    def to_dict(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "prompt_length": self.prompt_length,
                "max_new_tokens": self.max_new_tokens, "outcome": self.outcome,
                "prefill_bytes": self.prefill_bytes, "tensor_peak_bytes": self.tensor_peak_bytes,
                "peak_bytes": self.peak_bytes, "start_bytes": self.start_bytes, "seconds": self.seconds,
                "decode_steps": len(self.decode_bytes), "real_prompts": len(self.prompts)}


@dataclass(kw_only=True, repr=False)
class GenerationMemory:
    """``growth(b, P, N) = scale × max(prefill(b, P), decode(b, P + N))`` bytes; see the module docstring.

    Attributes:
        prefill: ``F(P) + b × S(P)``, the prompt's forward and first token.
        decode: ``((T, E, D), ...)`` by ``T``: a decoding step that leaves ``T`` tokens grows by
            ``E + b × D``, at every ``T`` measured; between them, linear; below the shortest,
            the shortest's (a shorter cache needs no more).
        scale: the failing figure per modelled byte (>= 1).
        prompt_lengths: the prompt lengths fitted (the longest bounds what the model answers).
        max_total_length: the longest ``P + N`` a trial decoded to (likewise).
        limit_bytes: the most the figure may reach (``target × capacity``; on a host the share
            of the headroom, as the finder's).
        start_bytes: the figure before the first trial (the weights and whatever else lives).
        capacity_bytes: the capacity it was fitted against.
        memory: the figure's name (:attr:`batchpilot.memory.limits.Limit.name`).
        verified: ``{(P, N): batch}``: the largest batch a trial ran within the limit there.
        trials: every trial, in order.
    """

    prefill: LengthFit
    decode: tuple[tuple[int, float, float], ...]
    scale: float = 1.0
    prompt_lengths: tuple[int, ...] = ()
    max_total_length: int = 0
    limit_bytes: int = 0
    start_bytes: int = 0
    capacity_bytes: int = 0
    memory: str = "tensors"
    verified: dict[tuple[int, int], int] = field(default_factory=dict)
    trials: list[GenerationTrial] = field(default_factory=list)

    # -- the summary -------------------------------------------------------
    def describe(self) -> str:
        """A few lines: the batches it answers, the limit, the model, the trials, what would raise it (``str()``)."""
        answers = ", ".join(f"{b} at {P} + {N} tokens" for (P, N), b in sorted(self.verified.items(), reverse=True))
        figure = figure_name(self.memory)
        ooms = sum(t.outcome == OOM for t in self.trials)
        over = sum(t.outcome == OVER_TARGET for t in self.trials)
        lines = [
            f"generate sized: largest batch {answers or 'none verified'} (prompt + new)",
            f"  limit {format_bytes(self.limit_bytes)} of {figure}: {self._share_text()}",
            f"  model: growth = {self.scale:.3f} x max(prefill, decode); KV cache {format_bytes(self.per_token_bytes)} "
            f"per token per prompt, {format_bytes(self.per_step_bytes)} per step; prefill fitted at prompt lengths "
            f"{', '.join(map(str, self.prompt_lengths))}, decoding up to {self.max_total_length} tokens",
            f"  search: {len(self.trials)} trials, {ooms} OOM, {over} over the limit, "
            f"{sum(t.seconds for t in self.trials):.1f}s",
            "  to raise it: fewer new tokens or shorter prompts per batch (the cache grows with both); a larger "
            "target; a smaller cache (a quantized or static KV cache) or more memory",
        ]
        return "\n".join(lines)

    def _share_text(self) -> str:
        """How the limit was set: a share of the capacity, or on a host of what was left above the start."""
        kind = limit_named(self.memory)
        if kind is not None and kind.host and self.start_bytes < self.capacity_bytes:
            left = self.capacity_bytes - self.start_bytes
            return (f"{format_bytes(self.start_bytes)} in use + {(self.limit_bytes - self.start_bytes) / left:.0%} "
                    f"of the {format_bytes(left)} left")
        return f"{self.limit_bytes / max(1, self.capacity_bytes):.0%} of {format_bytes(self.capacity_bytes)}"

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return (f"GenerationMemory(verified={self.verified}, limit_bytes={self.limit_bytes}, memory={self.memory!r}, "
                f"per_token_bytes={self.per_token_bytes:.0f}, scale={self.scale:.3f}, trials={len(self.trials)})")

    # -- the terms ---------------------------------------------------------
    @property
    def per_token_bytes(self) -> float:
        """Bytes a token of cache costs per sample (the KV cache of every layer, with its ids and mask):
        the slope of the least-squares line through ``D(T)``; 0 with one ``T`` measured."""
        return _decode_line(self.decode)[1]

    @property
    def per_step_bytes(self) -> float:
        """Bytes per sample a decoding step holds whatever the length (its logits, their float copy):
        that line's intercept."""
        return _decode_line(self.decode)[0]

    def decode_terms(self, total_length: int) -> tuple[float, float]:
        """``(E, D)`` of the step that leaves ``total_length`` tokens (``(0, 0)`` with no step measured)."""
        table = self.decode
        if not table:
            return 0.0, 0.0
        k = bisect.bisect_left(table, total_length, key=lambda row: row[0])
        if k < len(table) and table[k][0] == total_length:
            return table[k][1], table[k][2]
        if k == 0:
            return table[0][1], table[0][2]
        if k == len(table):
            return table[-1][1], table[-1][2]
        (t0, e0, d0), (t1, e1, d1) = table[k - 1], table[k]
        w = (total_length - t0) / (t1 - t0)
        return e0 + w * (e1 - e0), d0 + w * (d1 - d0)

    def prefill_bytes(self, batch_size: int, prompt_length: int) -> float:
        """The prefill's modelled growth (before ``scale``)."""
        return self.prefill.fixed_bytes(prompt_length) + batch_size * max(0.0, self.prefill.bytes_per_sample(prompt_length))

    def decode_bytes(self, batch_size: int, total_length: int) -> float:
        """A decoding step's modelled growth (before ``scale``) when it leaves ``total_length`` tokens."""
        fixed, per = self.decode_terms(total_length)
        return fixed + batch_size * per

    def growth(self, batch_size: int, prompt_length: int, max_new_tokens: int) -> float:
        """Predicted growth of the failing figure over the memory in use before ``generate``.

        Raises:
            UnverifiedShapeError: a prompt or total length beyond the longest measured.
        """
        self._check_shape(prompt_length, max_new_tokens)
        return self.scale * self.tensor_growth(batch_size, prompt_length, max_new_tokens)

    def peak(self, batch_size: int, prompt_length: int, max_new_tokens: int) -> float:
        """Predicted peak of the failing figure: what was in use at the fit plus :meth:`growth`."""
        return self.start_bytes + self.growth(batch_size, prompt_length, max_new_tokens)

    def tensor_growth(self, b: int, P: int, N: int) -> float:
        """The modelled growth before ``scale`` (no range check)."""
        pre = self.prefill_bytes(b, P)
        return pre if N < 2 else max(pre, self.decode_bytes(b, P + N))

    def _check_shape(self, P: int, N: int) -> None:
        positive_int("prompt_length", P)
        positive_int("max_new_tokens", N)
        longest = max(self.prompt_lengths)
        if P > longest or P + N > self.max_total_length:
            raise UnverifiedShapeError(
                f"prompts of {P} tokens with max_new_tokens={N} are beyond what the trials measured (prompts up "
                f"to {longest} tokens, {self.max_total_length} tokens in all): fit again with the longest prompts "
                f"and the most new tokens (fit_generation_memory(prompt_lengths=..., max_new_tokens={N})), or "
                "leave memory= out of generate_by_length to fit on its own prompts"
            )

    def max_batch(self, prompt_length: int, max_new_tokens: int, *, limit_bytes: float | None = None,
                  start_bytes: float | None = None, max_batch_size: int | None = None) -> int:
        """The largest batch whose predicted peak stays within the limit (0: not even one prompt).

        ``limit_bytes`` and ``start_bytes`` default to the fit's; pass the figures of another run to
        size it with this model. A prediction within a part in a billion of a whole prompt counts
        as that prompt (the fit comes back through floats).

        Raises:
            UnverifiedShapeError: a prompt or total length beyond the longest measured.
        """
        self._check_shape(prompt_length, max_new_tokens)
        limit = self.limit_bytes if limit_bytes is None else limit_bytes
        start = self.start_bytes if start_bytes is None else start_bytes
        room = (limit - start) / self.scale
        terms = [(self.prefill.fixed_bytes(prompt_length), max(0.0, self.prefill.bytes_per_sample(prompt_length)))]
        if max_new_tokens >= 2:
            terms.append(self.decode_terms(prompt_length + max_new_tokens))
        answer = 1 << 40
        for fixed, per in terms:
            if room < fixed:
                return 0
            if per > 0:
                answer = min(answer, math.floor((room - fixed) / per + 1e-9))
        answer = max(0, answer)
        return answer if max_batch_size is None else min(answer, max_batch_size)

    # -- corrections --------------------------------------------------------
    def note_oom(self, batch_size: int, prompt_length: int, max_new_tokens: int, *,
                 capacity_bytes: float | None = None, start_bytes: float | None = None) -> float:
        """A batch ran out of memory: scale the model so that it needs at least the capacity; the new scale.

        The OOM proves the batch needed more than ``capacity - start``; the model, scaled so, no
        longer fits that batch (nor, in proportion, its neighbours).
        """
        cap = self.capacity_bytes if capacity_bytes is None else capacity_bytes
        start = self.start_bytes if start_bytes is None else start_bytes
        modelled = self.tensor_growth(batch_size, prompt_length, max_new_tokens)
        if modelled > 0:
            needed = (cap - start) / modelled
            if needed > self.scale:
                logger.info("batch %d at %d + %d tokens ran out of memory: the model scales by %.3f (was %.3f)",
                            batch_size, prompt_length, max_new_tokens, needed, self.scale)
                self.scale = needed
        return self.scale

    def observe(self, batch_size: int, prompt_length: int, max_new_tokens: int, growth_bytes: float, *,
                room_bytes: float | None = None) -> bool:
        """A batch ran and its figure grew by ``growth_bytes``: scale the model up if it needed more; whether it did.

        Only a batch whose modelled growth is at least 1/16 of ``room_bytes`` (default the fit's
        room) counts: below that a host's or an allocator's figure moves by more than the batch.
        """
        room = (self.limit_bytes - self.start_bytes) if room_bytes is None else room_bytes
        modelled = self.tensor_growth(batch_size, prompt_length, max_new_tokens)
        # a part in a million over is the float round trip of an exact fit, not a miss
        if modelled <= 0 or modelled < _SCALE_SHARE * room or growth_bytes <= modelled * self.scale * (1 + 1e-6):
            return False
        logger.info("batch %d at %d + %d tokens grew by %s, over the model's %s: it scales by %.3f", batch_size,
                    prompt_length, max_new_tokens, format_bytes(growth_bytes), format_bytes(modelled * self.scale),
                    growth_bytes / modelled)
        self.scale = growth_bytes / modelled
        return True

    # -- the fit ------------------------------------------------------------
    @classmethod
    def from_trials(cls, trials: Sequence[GenerationTrial], *, limit_bytes: int, start_bytes: int,
                    capacity_bytes: int, memory: str = "tensors") -> GenerationMemory:
        """Fit the model to trials: the prefill over prompt lengths, the decoding steps over total length.

        The prefill at each prompt length is the line through its batch sizes (one batch size: all
        its bytes per sample), and the lines make a :func:`~batchpilot.policy.lengths.fit_lengths`
        model (one length: the same line at every shorter one). A decoding step is the line
        through the batch sizes that ran a step leaving the same number of tokens. ``scale``
        is the largest ratio of the failing figure to the model among trials large enough to
        tell (at least 1/16 of the room), and what each OOM proves.

        Raises:
            GenerationFitError: no trial ran to the end; a per-sample cost that is not positive
                (peaks that do not grow with the batch: a figure too noisy at these sizes).
        """
        measured = [t for t in trials if t.measured]
        if not measured:
            raise GenerationFitError("no trial ran to the end: nothing to fit", trials=trials)
        prefill = _fit_prefill(measured, trials)
        model = cls(prefill=prefill, decode=_fit_decode(measured, trials),
                    prompt_lengths=tuple(sorted({t.prompt_length for t in measured})),
                    max_total_length=max(t.prompt_length + t.max_new_tokens for t in measured),
                    limit_bytes=int(limit_bytes), start_bytes=int(start_bytes), capacity_bytes=int(capacity_bytes),
                    memory=memory, trials=list(trials))
        room = max(1.0, limit_bytes - start_bytes)
        for t in trials:
            if t.prompt_length > max(model.prompt_lengths) or t.prompt_length + t.max_new_tokens > model.max_total_length:
                continue  # an OOM at a shape no trial measured: nothing to compare with
            modelled = model.tensor_growth(t.batch_size, t.prompt_length, t.max_new_tokens)
            if modelled <= 0:
                continue
            if t.outcome == OOM:
                model.note_oom(t.batch_size, t.prompt_length, t.max_new_tokens,
                               capacity_bytes=capacity_bytes, start_bytes=t.start_bytes)
            elif t.peak_bytes is not None:
                model.observe(t.batch_size, t.prompt_length, t.max_new_tokens, t.peak_bytes, room_bytes=room)
        for t in measured:
            if t.outcome == FIT:
                key = (t.prompt_length, t.max_new_tokens)
                model.verified[key] = max(model.verified.get(key, 0), t.batch_size)
        return model

    def terms(self) -> dict[str, float]:
        """The model's terms in bytes, for reports (per sample unless named ``fixed``)."""
        longest = max(self.prompt_lengths)
        longest_step = self.decode_terms(self.max_total_length)
        return {"per_token": self.per_token_bytes, "per_step": self.per_step_bytes,
                "decode_fixed_at_longest": longest_step[0], "decode_per_sample_at_longest": longest_step[1],
                "prefill_fixed_at_longest": self.prefill.fixed_bytes(longest),
                "prefill_per_sample_at_longest": self.prefill.bytes_per_sample(longest),
                "prefill_per_token": self.prefill.per_sample[1], "prefill_per_token_squared": self.prefill.per_sample[2],
                "scale": self.scale}

    def to_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill.to_dict(),
                "decode": [{"total_length": T, "fixed": e, "per_sample": d} for T, e, d in self.decode],
                "scale": self.scale,
                "prompt_lengths": list(self.prompt_lengths), "max_total_length": self.max_total_length,
                "limit_bytes": self.limit_bytes, "start_bytes": self.start_bytes,
                "capacity_bytes": self.capacity_bytes, "memory": self.memory,
                "verified": [{"prompt_length": P, "max_new_tokens": N, "batch_size": b}
                             for (P, N), b in sorted(self.verified.items())],
                "terms": self.terms(), "trials": [t.to_dict() for t in self.trials]}


def _line(points: Mapping[int, float]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``{x: y}``; one point: the line through 0.

    Through ``{batch: bytes}`` one batch size so takes all its bytes as per sample: never less
    than the line through two would give at a larger batch, when the batch-free part is >= 0.
    """
    if len(points) == 1:
        (x, y), = points.items()
        return 0.0, y / x
    return least_squares_line(points)


def _fit_prefill(measured: Sequence[GenerationTrial], trials: Sequence[GenerationTrial]) -> LengthFit:
    by_length: dict[int, dict[int, float]] = {}
    for t in measured:
        pts = by_length.setdefault(t.prompt_length, {})
        pts[t.batch_size] = max(pts.get(t.batch_size, 0.0), float(t.prefill_bytes))  # type: ignore[arg-type]
    lines = {P: _line(pts) for P, pts in by_length.items()}
    for P, (_, per) in sorted(lines.items()):
        if per <= 0:
            raise GenerationFitError(
                f"the prefill's bytes per prompt at length {P} came out {per:.0f}: the peaks measured do not grow "
                "with the batch, so they make no memory model (a figure too coarse for batches this small)",
                trials=trials)
    if len(lines) == 1:
        (P, (fixed, per)), = lines.items()
        return LengthFit(fixed=(fixed, 0.0, 0.0), per_sample=(per, 0.0, 0.0), lengths=(P,))
    fit = fit_lengths(lines)
    for P in fit.lengths:
        if fit.bytes_per_sample(P) <= 0:
            raise GenerationFitError(f"the prefill model's bytes per prompt at length {P} are not positive", trials=trials)
    return fit


def _fit_decode(measured: Sequence[GenerationTrial],
                trials: Sequence[GenerationTrial]) -> tuple[tuple[int, float, float], ...]:
    by_length: dict[int, dict[int, float]] = {}
    for t in measured:
        for T, y in t.decode_bytes:
            pts = by_length.setdefault(T, {})
            pts[t.batch_size] = max(pts.get(t.batch_size, 0.0), float(y))
    table = tuple((T, *_line(pts)) for T, pts in sorted(by_length.items()))
    for T, _, per in table:
        if per <= 0:
            raise GenerationFitError(
                f"a decoding step's bytes per prompt at {T} tokens came out {per:.0f}: the peaks measured do not grow "
                "with the batch, so they make no memory model (a figure too coarse for batches this small)",
                trials=trials)
    step, per_token = _decode_line(table)
    if len(table) > 1 and per_token < 0:
        low, high = table[0][0], table[-1][0]
        if -per_token * (high - low) > 0.01 * max(per for _, _, per in table):
            raise GenerationFitError(
                f"the decoding steps' bytes per prompt fall by {-per_token:.1f} per token of cache from {low} to "
                f"{high} tokens: the peaks measured are no model of a cache that grows", trials=trials)
    return table


def _decode_line(table: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """``(per_step, per_token)``: the least-squares line through a decode table's bytes per sample."""
    if not table:
        return 0.0, 0.0
    if len(table) == 1:
        return table[0][2], 0.0
    fixed, slope = _line({T: per for T, _, per in table})
    return fixed, slope


# -- the figures a fit and a run are judged on -------------------------------------------------------


@dataclass(kw_only=True)
class MemoryRoom:
    """Where a generation job's memory is measured and how much it may use.

    Attributes:
        device: the device.
        gauge: the figure that fails (:func:`~batchpilot.memory.gauge.gauge_for`).
        meter: exact tensor bytes (the CPU tracker's; the allocator's allocated bytes elsewhere).
        capacity_bytes: the gauge's capacity (emulated or real).
        limit_bytes: the most the gauge may reach: ``target × capacity``, or on a host the
            figure in use plus ``target`` of the headroom (the finder's rule).
        start_bytes: the gauge's figure when the room was opened.
        target: the share asked for.
    """

    device: torch.device
    gauge: Gauge
    meter: Gauge
    capacity_bytes: int
    limit_bytes: int
    start_bytes: int
    target: float

    @property
    def exact(self) -> bool:
        """The failing figure is the tensor bytes themselves (an emulated CPU capacity)."""
        return self.gauge.limit.tracked

    @property
    def room_bytes(self) -> int:
        return self.limit_bytes - self.start_bytes

    @contextlib.contextmanager
    def measuring(self, model: Any) -> Iterator[None]:
        """Trials' context: on a CPU with no tracker running, one that counts the tensors (the model included)."""
        if self.device.type != "cpu" or self.meter is self.gauge or active_tracker(self.device) is not None:
            yield
            return
        with StorageTracker(self.device) as tr:
            tr.track(model)
            yield


@contextlib.contextmanager
def memory_room(model: Any, *, device: torch.device | str | int | None = None, capacity: int | str | None = None,
                target: float | None = None) -> Iterator[MemoryRoom]:
    """Open the room a generation job is sized in: an emulated ``capacity`` held for the whole block.

    With ``capacity`` the device behaves like one of that size throughout (the trials and the
    run: on CPU a :class:`~batchpilot.memory.tracker.StorageTracker` counting the model, on CUDA a
    memory fraction); inside the caller's own ``emulate_capacity`` that one counts; otherwise
    the device's real memory (:mod:`batchpilot.memory.gauge`).

    Raises:
        BatchSizeError: a target outside (0, 1]; a capacity that is no size, or asked of a device
            that cannot emulate one (only cpu and cuda can).
    """
    options = FindOptions(**({} if target is None else {"target": target}), capacity=capacity)  # the finder's checks of both, one home
    share, cap = float(options.target), options.capacity
    dev = resolve_device(device) if device is not None else model_device(model)
    if cap is not None:
        if dev.type not in EMULATED_DEVICES:
            raise BatchSizeError(f"capacity= is emulated on cpu and cuda, not {dev.type}; leave it out to use the "
                                 "device's own memory")
    with contextlib.ExitStack() as stack:
        if cap is not None:
            stack.enter_context(emulate_capacity(cap, dev, track=[model]))
            emulated: int | None = cap
        else:
            emulated = emulated_capacity(dev)
            tr = active_tracker(dev) if dev.type == "cpu" else None
            if tr is not None:
                tr.track(model)  # the weights count from the start, not when a trial first reads them
        gauge = gauge_for(dev, emulated_capacity=emulated)
        stack.callback(gauge.close)
        if gauge.host:
            # as the finder does, for the trials and the batches that follow them: below glibc's mmap
            # threshold (dynamic, or fixed high by the user) freed blocks stay mapped and later ones
            # reuse them, so a trial's figure would depend on the trials before it and not grow
            # with the batch (the prefill's freed blocks also held the first decoding steps' figures)
            stack.enter_context(malloc_threshold_held())
        if gauge.host and active_tracker(dev) is None:
            # a real host: the failing figure is measured as it is, step by step; a storage tracker
            # would cost about three times the generate it measures (one Python call per operator)
            meter: Gauge = gauge
        else:
            meter = TensorGauge(dev) if dev.type == "cpu" else AllocatorGauge(dev)
        free_memory(dev)
        capacity_bytes = int(gauge.capacity())
        start = int(gauge.current())
        if gauge.host and start < capacity_bytes:
            # on a host the runtime, libraries and model already live: the margin is on what is left
            limit = start + int(share * (capacity_bytes - start))
        else:
            limit = max(1, int(share * capacity_bytes))
        logger.info("generation sized on %s: %s memory, limit %s (%.0f%% of %s), %s in use", dev, gauge.kind,
                    format_bytes(limit), 100 * share, format_bytes(capacity_bytes), format_bytes(start))
        yield MemoryRoom(device=dev, gauge=gauge, meter=meter, capacity_bytes=capacity_bytes, limit_bytes=limit,
                         start_bytes=start, target=share)


# -- trials -------------------------------------------------------------------------------------------


class _Windows:
    """A stopping criterion that ends a measurement window at every decoding step and never stops a row."""

    def __init__(self, room: MemoryRoom) -> None:
        self.room = room
        self.tensors: list[tuple[int, int]] = []  # (tokens after the step, tensor peak of its window)
        self.gauge_peak = 0

    def close(self, tokens: int) -> None:
        self.gauge_peak = max(self.gauge_peak, int(self.room.gauge.peak()))
        self.tensors.append((tokens, int(self.room.meter.peak())))
        self.room.meter.reset()  # on CUDA this resets the reserved peak too: read above first

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.close(int(input_ids.shape[-1]))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _KeepGoing:
    """A logits processor that lets no EOS win, in place, so that a trial runs every step it is asked.

    It runs after every other processor, so the scores it sees are those greedy decoding picks
    from: it notes, per row, the first step whose pick is an EOS (and which), where a plain
    ``generate`` ends that row. The rows' tokens before it are the plain run's.
    """

    def __init__(self, eos: Sequence[int]) -> None:
        self.eos = tuple(eos)
        self.step = 0
        self.ended: dict[int, tuple[int, int]] = {}  # {row: (step, the EOS greedy picked there)}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        picks = scores.argmax(dim=-1).tolist()
        for row, tok in enumerate(picks):
            if tok in self.eos and row not in self.ended:
                self.ended[row] = (self.step, tok)
        self.step += 1
        for e in self.eos:  # a view and a fill: no new tensor (scores is generate's own float copy)
            scores[:, e] = float("-inf")
        return scores


def _hf_list(kind: str, items: Sequence[Any]) -> Any:
    """``items`` in transformers' list type for ``kind`` (a plain list without transformers)."""
    try:
        from transformers import LogitsProcessorList, StoppingCriteriaList
    except ImportError:  # a generate of the same protocol that is not transformers'
        return list(items)
    return (LogitsProcessorList if kind == "logits_processor" else StoppingCriteriaList)(items)


def eos_ids(model: Any, eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """The EOS ids a ``generate`` stops on: those given, else the model's generation config's."""
    value = eos_token_id
    if value is None:
        config = getattr(model, "generation_config", None)
        value = getattr(config, "eos_token_id", None) if config is not None else None
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    values = [value] if isinstance(value, numbers.Integral) else list(value)
    return tuple(check_token_id("eos_token_id", v) for v in values)


def check_token_id(name: str, value: Any) -> int:
    """``value`` as a token id (an int >= 0).

    Raises:
        ValueError: not an int, or negative.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a token id (an int >= 0), got {value!r}")
    return int(value)


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, kwargs: dict[str, Any]) -> Any:
    try:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, **kwargs)
    except Exception as exc:
        if not is_oom(exc):  # an OOM is the trial's answer, caught by attempt()
            add_note(exc, f"batchpilot: in a sizing trial, generate of {ids.shape[0]} prompts of {ids.shape[1]} "
                          f"tokens with max_new_tokens={max_new_tokens}")
        raise


def measure_generate(model: Any, room: MemoryRoom, *, batch_size: int, prompt_length: int, max_new_tokens: int,
                     pad_token_id: int, token_id: int, eos: Sequence[int] = (),
                     generate_kwargs: Mapping[str, Any] | None = None,
                     prompts: Mapping[int, Sequence[int]] | None = None) -> GenerationTrial:
    """One trial: ``generate`` of ``batch_size`` prompts of ``token_id`` (the first one left-padded by a token).

    Every step is measured (:class:`GenerationTrial`); no row stops at an EOS, so all
    ``max_new_tokens`` steps run. An OOM is recovered from (``outcome="oom"``); any other error
    propagates. Call it inside :meth:`MemoryRoom.measuring`.

    ``prompts`` (``{index: token ids}``, at most ``batch_size``, each shorter than
    ``prompt_length``) runs those real prompts in the first rows instead, left-padded to
    ``prompt_length``, and keeps their outputs (greedy decoding only: the EOS held back is put back
    where greedy picked it); made-up rows fill the batch to ``batch_size``.
    """
    kwargs, windows, keep_going = _trial_kwargs(room, generate_kwargs, pad_token_id, eos)
    dev = room.device
    real = dict(prompts or {})
    if len(real) > batch_size:
        raise ValueError(f"{len(real)} real prompts for a trial of {batch_size}")
    room.gauge.reset()
    room.meter.reset()
    start_gauge, start_tensors = int(room.gauge.current()), int(room.meter.current())
    began = time.perf_counter()
    ids, mask = _trial_inputs(batch_size, prompt_length, pad_token_id, token_id, real, dev)
    outcome = attempt(_generate, model, ids, mask, max_new_tokens, kwargs, device=dev)
    seconds = time.perf_counter() - began
    last_gauge, last_tensors = int(room.gauge.peak()), int(room.meter.peak())
    del ids, mask
    peak = max(windows.gauge_peak, last_gauge) - start_gauge
    if outcome.oom:
        logger.info("trial %d x (%d + %d): out of memory", batch_size, prompt_length, max_new_tokens)
        return GenerationTrial(batch_size=batch_size, prompt_length=prompt_length, max_new_tokens=max_new_tokens,
                               outcome=OOM, peak_bytes=peak, start_bytes=start_gauge, seconds=seconds,
                               prompts=tuple(real))
    steps = [(T, y - start_tensors) for T, y in windows.tensors]
    if not steps:
        raise RuntimeError("generate ran no step that the measurement saw: it must call its stopping criteria "
                           "after each new token, as transformers' generate does")
    # what generate does after its last step belongs to the last window
    T_last, y_last = steps[-1]
    steps[-1] = (T_last, max(y_last, last_tensors - start_tensors))
    fits = start_gauge + peak <= room.limit_bytes
    outputs = _trial_outputs(outcome.result, len(real), prompt_length, keep_going) if real else ()
    trial = GenerationTrial(batch_size=batch_size, prompt_length=prompt_length, max_new_tokens=max_new_tokens,
                            outcome=FIT if fits else OVER_TARGET, prefill_bytes=steps[0][1],
                            decode_bytes=tuple(steps[1:]), tensor_peak_bytes=max(y for _, y in steps),
                            peak_bytes=peak, start_bytes=start_gauge, seconds=seconds, prompts=tuple(real),
                            outputs=outputs)
    logger.info("trial %d x (%d + %d): %s (%s of tensors), %s", batch_size, prompt_length, max_new_tokens,
                format_bytes(peak), format_bytes(trial.tensor_peak_bytes), trial.outcome)
    return trial


def _trial_kwargs(room: MemoryRoom, generate_kwargs: Mapping[str, Any] | None, pad_token_id: int,
                  eos: Sequence[int]) -> tuple[dict[str, Any], _Windows, _KeepGoing]:
    """A trial's ``generate`` keywords: greedy unless asked, its step windows measured, no row stopped at an EOS."""
    kwargs = dict(generate_kwargs or {})
    kwargs.setdefault("do_sample", False)
    kwargs["pad_token_id"] = pad_token_id
    if eos:
        kwargs["eos_token_id"] = list(eos)
    windows = _Windows(room)
    kwargs["stopping_criteria"] = _hf_list("stopping_criteria", [*(kwargs.get("stopping_criteria") or ()), windows])
    keep_going = _KeepGoing(eos)
    if eos:
        kwargs["logits_processor"] = _hf_list("logits_processor",
                                              [*(kwargs.get("logits_processor") or ()), keep_going])
    return kwargs, windows, keep_going


def _trial_inputs(batch_size: int, prompt_length: int, pad_token_id: int, token_id: int,
                  real: Mapping[int, Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A trial's ids and attention mask: the real prompts left-padded in the first rows, made-up rows after."""
    # the prompts count: a real batch's ids and mask live through its generate too
    if real:
        ids = torch.full((batch_size, prompt_length), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        ids[len(real):, 1:] = token_id  # made-up rows, each padded by a token
        mask[len(real):, 1:] = 1
        for row, p in enumerate(real.values()):
            if len(p) >= prompt_length:
                raise ValueError(f"a trial's real prompt has {len(p)} tokens: it must be shorter than the trial's "
                                 f"{prompt_length}, so that its row is padded as a real batch's")
            ids[row, prompt_length - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[row, prompt_length - len(p):] = 1
        return ids.to(device), mask.to(device)
    ids = torch.full((batch_size, prompt_length), token_id, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    if prompt_length > 1:  # a padded batch takes the masked path real batches take
        ids[0, 0] = pad_token_id
        mask[0, 0] = 0
    return ids, mask


def _trial_outputs(result: Any, count: int, prompt_length: int, keep_going: _KeepGoing) -> tuple[list[int], ...]:
    """The new tokens of the first ``count`` rows (the real prompts), each cut after the EOS held back."""
    sequences = result if isinstance(result, torch.Tensor) else result.sequences
    rows = sequences[:count, prompt_length:].tolist()
    for row, (step, tok) in keep_going.ended.items():
        if row < len(rows):
            rows[row] = rows[row][:step] + [tok]
    return tuple(rows)


def choose_prompt_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    """The prompt lengths to fit at: all of them up to three, else the shortest, the longest and the
    one nearest their geometric mean (the longer on a tie), so that every length between is interpolated.

    >>> choose_prompt_lengths([7, 30, 12, 30, 500, 90])
    (7, 90, 500)
    """
    pool = check_lengths(lengths, name="prompt lengths")
    if len(pool) <= 3:
        return pool
    middle = math.sqrt(pool[0] * pool[-1])
    mid = min(pool[1:-1], key=lambda L: (round(abs(math.log(L / middle)), 9), -L))
    return (pool[0], mid, pool[-1])


def fit_in(model: Any, room: MemoryRoom, *, prompt_lengths: Sequence[int], max_new_tokens: int, pad_token_id: int,
           eos: Sequence[int] = (), token_id: int | None = None, max_batch_size: int | None = None,
           generate_kwargs: Mapping[str, Any] | None = None, prompts: Mapping[int, Sequence[int]] | None = None,
           max_padding: float = MAX_PADDING) -> GenerationMemory:
    """:func:`fit_generation_memory` in a room already open (the generate batcher's).

    At each chosen prompt length, longest first: a trial at 1; one at 2 (on an emulated CPU's
    exact bytes) or at the size the first puts at a quarter of the room (all the band's real
    prompts left, where the first puts them within three quarters of it); the model of every trial so far;
    and a trial at its answer, unless that ran already or no prompt is left. At most three per length.

    With ``prompts`` (``{index: token ids}``, greedy decoding only) the lengths are chosen among
    the longest prompts of their bands (:func:`band_heads`), and the trials run those real
    prompts, their outputs kept in :attr:`GenerationTrial.outputs`: at a length ``P`` they are
    padded to ``P + 1`` (every row padded, as in a real batch) and take the longest prompts left
    that fit there padded to no more than ``max_padding`` times their length (or by no more than
    ``max_new_tokens``). After the first length the trial at 1 is left out: the model of the longer
    lengths, which sizes a shorter prompt for no less than it needs, gives the first trial's size;
    a later length with too few real prompts left for a trial to tell (its modelled growth under
    1/16 of the room) is not fitted: the longer lengths' model sizes them.
    The first length's second trial is filled with made-up rows where too few real prompts are left.

    Raises:
        NothingFitsError: one prompt of the longest length does not fit.
        GenerationFitError: the trials make no model.
    """
    N = positive_int("max_new_tokens", max_new_tokens)
    cap = None if max_batch_size is None else positive_int("max_batch_size", max_batch_size)
    token = _trial_token(model, pad_token_id, eos) if token_id is None else check_token_id("token_id", token_id)
    fit = _Fit(model, room, new_tokens=N, cap=cap, token=token, pad_token_id=pad_token_id, eos=eos,
               generate_kwargs=generate_kwargs, prompts=prompts, max_padding=max_padding)
    lengths = fit.lengths(prompt_lengths)  # the longest first: fails fastest
    context = context_length(model)
    fit.announce()
    with room.measuring(model):
        for k, P in enumerate(lengths):
            fit.at_length(P, real=bool(fit.pending) and (context is None or P + 1 + N <= context), first=k == 0)
    memory = fit.fitted()
    logger.info("generation memory from %d trials: %.0f B per token of cache, %.0f B per step, scale %.3f",
                len(fit.trials), memory.per_token_bytes, memory.per_step_bytes, memory.scale)
    fit.progress.note(f"  fitted from {len(fit.trials)} trials in {fit.progress.elapsed():.1f}s")
    return memory


class _Fit:
    """One fit of :func:`fit_in`: its trials so far, the real prompts not yet run, and the progress it shows."""

    def __init__(self, model: Any, room: MemoryRoom, *, new_tokens: int, cap: int | None, token: int,
                 pad_token_id: int, eos: Sequence[int], generate_kwargs: Mapping[str, Any] | None,
                 prompts: Mapping[int, Sequence[int]] | None, max_padding: float) -> None:
        self.model, self.room, self.N, self.cap, self.token = model, room, new_tokens, cap, token
        self.pad_token_id, self.eos, self.generate_kwargs = pad_token_id, eos, generate_kwargs
        self.prompts, self.max_padding = prompts or {}, max_padding
        self.trials: list[GenerationTrial] = []
        self.pending = sorted(self.prompts, key=lambda i: -len(self.prompts[i]))
        self.progress: Progress | None = None

    def lengths(self, prompt_lengths: Sequence[int]) -> list[int]:
        """The prompt lengths to fit at, the longest first."""
        # real prompts: fit at the lengths batches start at (each the longest of a band a batch may pad together)
        heads = band_heads([len(self.prompts[i]) for i in self.pending], self.N, self.max_padding) \
            if self.pending else prompt_lengths
        return sorted(choose_prompt_lengths(heads), reverse=True)

    def announce(self) -> None:
        room = self.room
        self.progress = Progress(f"sizing generate on {room.device}", logger=logger)
        share = (f"{format_bytes(room.start_bytes)} in use + {room.target:.0%} of the rest" if room.gauge.host else
                 f"{room.target:.0%} of {format_bytes(room.capacity_bytes)}")
        self.progress.note(f"  {room.gauge.kind} memory, limit {format_bytes(room.limit_bytes)} ({share}), "
                           f"{self.N} new tokens")

    def take(self, b: int, width: int) -> dict[int, Sequence[int]]:
        """Up to ``b`` of the longest real prompts left that a batch padded to ``width`` takes."""
        low = band_low(width, self.N, self.max_padding)
        picked = [i for i in self.pending if low <= len(self.prompts[i]) < width][:b]
        return {i: self.prompts[i] for i in picked}

    def trial(self, b: int, P: int, real: bool = False, fill: bool = False) -> GenerationTrial:
        """A trial of ``b`` prompts padded to ``P`` (real ones where ``real``; made-up rows fill it where ``fill``)."""
        N, room, shown = self.N, self.room, self.progress
        chosen = self.take(b, P) if real else {}
        if chosen and not fill:
            b = len(chosen)
        shown.start(f"batch {b} x ({P} + {N} tokens)")
        t = measure_generate(self.model, room, batch_size=b, prompt_length=P, max_new_tokens=N,
                             pad_token_id=self.pad_token_id, token_id=self.token, eos=self.eos,
                             generate_kwargs=self.generate_kwargs, prompts=chosen or None)
        grown = "?" if t.peak_bytes is None else format_bytes(t.start_bytes + t.peak_bytes)
        shown.done(f"batch {b} x ({P} + {N} tokens): "
                   + ("out of memory" if t.outcome == OOM else
                      f"{'fits' if t.outcome == FIT else 'over the limit'}, peak {grown} of "
                      f"{format_bytes(room.limit_bytes)}") + f", {t.seconds:.1f}s")
        self.trials.append(t)
        if t.outcome != OOM:
            for i in t.prompts:
                self.pending.remove(i)
        return t

    def fitted(self) -> GenerationMemory:
        room = self.room
        return GenerationMemory.from_trials(self.trials, limit_bytes=room.limit_bytes, start_bytes=room.start_bytes,
                                            capacity_bytes=room.capacity_bytes, memory=room.gauge.kind)

    def at_length(self, P: int, *, real: bool, first: bool) -> None:
        """The trials at prompt length ``P``: at most three (see :func:`fit_in`)."""
        N, cap = self.N, self.cap
        W = P + 1 if real else P
        if real and not first:
            so_far = self.fitted()
            b1 = max(1, so_far.max_batch(W, N, max_batch_size=cap))
            if so_far.growth(len(self.take(b1, W)), W, N) < _SCALE_SHARE * self.room.room_bytes:
                return  # too few prompts left here for a figure to tell (or none): the longer lengths' model sizes them
            self.trial(b1, W, real)
        else:
            one = self.trial(1, W, real)
            if one.outcome != FIT:  # named by the prompt's own length, not the trial's padded one
                raise _nothing_fits(one, self.room, length=P)
            if cap == 1:
                return
            self.trial(self._second_size(one, W, real), W, real, fill=True)  # the line needs it: made-up rows fill it
        answer = self.fitted().max_batch(W, N, max_batch_size=cap)
        if answer >= 1 and all(t.batch_size != answer for t in self.trials if t.prompt_length == W):
            if not real or self.take(answer, W):  # real prompts left at this length, or made-up ones
                self.trial(answer, W, real)

    def _second_size(self, one: GenerationTrial, W: int, real: bool) -> int:
        """The first length's second trial: 2 on exact bytes, else at a share of the room by the first's growth."""
        room = self.room
        if room.exact:
            b2 = 2
        else:
            # by the larger of the two figures: a caching allocator may reserve nothing new for one prompt
            grew = max(1, one.peak_bytes or 0, one.tensor_peak_bytes or 0)
            b2 = max(2, math.floor(_SECOND_SHARE * room.room_bytes / grew))
            left = len(self.take(len(self.pending), W)) if real else 0
            if b2 < left <= _BAND_SHARE * room.room_bytes / grew:
                b2 = left
        return b2 if self.cap is None else min(b2, self.cap)


def band_low(length: int, max_new_tokens: int, max_padding: float = MAX_PADDING) -> float:
    """The shortest prompt a batch padded to ``length`` takes: padded to at most ``max_padding``
    times its length, or by at most ``max_new_tokens``."""
    return min(length / max_padding, length - max_new_tokens)


def band_heads(lengths: Sequence[int], max_new_tokens: int, max_padding: float = MAX_PADDING) -> list[int]:
    """The longest prompt of each band, longest first: a band starts at the longest prompt left and
    holds every prompt down to :func:`band_low` of it.

    >>> band_heads([917, 880, 207, 150, 103, 60, 51, 10], 48)
    [917, 207, 103, 51]
    """
    heads: list[int] = []
    for L in sorted(lengths, reverse=True):
        if not heads or L < band_low(heads[-1], max_new_tokens, max_padding):
            heads.append(L)
    return heads


def _trial_token(model: Any, pad_token_id: int, eos: Sequence[int]) -> int:
    """A token for the trials' prompts: the smallest id that is neither the pad nor an EOS."""
    return next(i for i in range(len(eos) + 2) if i != pad_token_id and i not in eos)


def _nothing_fits(trial: GenerationTrial, room: MemoryRoom, length: int | None = None) -> NothingFitsError:
    length = trial.prompt_length if length is None else length
    what = ("ran out of memory" if trial.outcome == OOM
            else f"peaked at {format_bytes(room.start_bytes + (trial.peak_bytes or 0))}")
    return NothingFitsError(
        f"one prompt of {length} tokens with max_new_tokens={trial.max_new_tokens} {what}, over the limit "
        f"{format_bytes(room.limit_bytes)} ({room.target:.0%} of {format_bytes(room.capacity_bytes)}) on "
        f"{room.device}: shorten the prompts or max_new_tokens, use a smaller model or half precision, a larger "
        "target, or a device with more memory",
        batch_size=1, peak_bytes=None if trial.peak_bytes is None else room.start_bytes + trial.peak_bytes,
        limit_bytes=room.limit_bytes, capacity_bytes=room.capacity_bytes)


def fit_generation_memory(model: Any, *, prompt_lengths: Sequence[int], max_new_tokens: int, pad_token_id: int,
                          eos_token_id: int | Sequence[int] | None = None, target: float | None = None,
                          capacity: int | str | None = None, device: torch.device | str | int | None = None,
                          max_batch_size: int | None = None, **generate_kwargs: Any) -> GenerationMemory:
    """Fit :class:`GenerationMemory` for ``model.generate`` from real trials at two or three prompt lengths.

    ``prompt_lengths`` are the lengths batches will be padded to (the fit picks up to three:
    :func:`choose_prompt_lengths`), ``max_new_tokens`` the most any batch will ask for;
    ``generate_kwargs`` go to every trial's ``generate`` (greedy, ``do_sample=False``, unless
    they say otherwise). The trials' prompts are made up (one token repeated); no EOS ends them.

    Raises:
        ValueError: a length that is not a positive int, or a prompt and its new tokens longer
            than the model's context.
        BatchSizeError: a bad ``target`` or ``capacity``.
        NothingFitsError: one prompt of the longest length does not fit.
        GenerationFitError: the trials make no model.
    """
    N = positive_int("max_new_tokens", max_new_tokens)
    lengths = check_lengths(prompt_lengths, name="prompt_lengths")
    context = context_length(model)
    if context is not None and lengths[-1] + N > context:
        raise ValueError(f"prompts of {lengths[-1]} tokens and max_new_tokens={N} need {lengths[-1] + N} positions, "
                         f"more than the model's context of {context}: shorten the prompts or max_new_tokens")
    pad = check_token_id("pad_token_id", pad_token_id)
    eos = eos_ids(model, eos_token_id)
    with memory_room(model, device=device, capacity=capacity, target=target) as room:
        return fit_in(model, room, prompt_lengths=lengths, max_new_tokens=N, pad_token_id=pad, eos=eos,
                      max_batch_size=max_batch_size, generate_kwargs=generate_kwargs)
