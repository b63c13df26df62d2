"""The gradient noise scale ``B_simple = tr(Σ) / |G|²``, from gradient norms at two batch sizes.

McCandlish et al. 2018 (arXiv 1812.06162, appendix A.1): the squared norm of a gradient
averaged over ``B`` samples has expectation ``|G|² + tr(Σ) / B``, so norms measured at a small
and a big batch of the same step give unbiased estimates of ``|G|²`` and ``tr(Σ)``. Each is
smoothed by an EMA before their ratio is taken. The engine measures what it holds anyway: the
first (or every) micro-batch's gradient and the accumulated one, or each rank's local gradient
before the deferred all-reduce and the global one after. Details: ``docs/internals.md#noise``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

from .._checks import check_int

__all__ = [
    "DEFAULT_BETA",
    "NOISE_MODES",
    "NoiseConfig",
    "NoiseMeter",
    "NoiseSample",
    "NoiseScale",
    "default_mode",
    "make_meter",
    "population_factor",
    "squared_norm",
    "unbiased_estimates",
]

logger = logging.getLogger(__name__)

#: ``first``: the first micro-batch is the small batch (one extra gradient norm per step);
#: ``every``: every micro-batch is one (one norm per micro-batch, and one gradient-sized buffer
#: while each backward runs, to keep it apart from the running sum).
NOISE_MODES: tuple[str, ...] = ("first", "every")
#: The EMA factor each mode defaults to: what its estimate needs to settle (benchmarks/noise.py).
DEFAULT_BETA: dict[str, float] = {"first": 0.99, "every": 0.95}

Number = Any  # a float, or a 0-dim tensor on the gradients' device (no host sync)


# ---------------------------------------------------------------------------
# The estimator (pure arithmetic: floats or 0-dim tensors alike)


def population_factor(elements: Number, samples: int, population: int | None = None) -> Number:
    """``c`` in ``E|G_B|² = |G|² + tr(Σ) · c`` for a batch of ``samples`` holding ``elements``.

    ``1 / elements`` for an infinite population (fresh samples); drawn without replacement from
    ``population`` samples (an epoch of a finite data set), the finite-population correction
    ``(N - b) / (N - 1)`` multiplies it, with ``Σ`` the population covariance (divided by N).
    ``elements`` is the sample count for mean losses and the counted elements (tokens) for
    ``(sum, count)`` losses; the sampling fraction is the samples' either way.

    Example: ``population_factor(16, 16) == 1/16``; ``population_factor(16, 16, 1000) == 984/999/16``.
    """
    if population is None:
        return 1.0 / elements
    fpc = max(population - samples, 0) / (population - 1)
    return fpc / elements


def unbiased_estimates(small_sq: Number, small_factor: Number, big_sq: Number, big_factor: Number) -> tuple[Number, Number]:
    """``(|G|², tr(Σ))`` from two squared gradient norms of one step.

    ``small_sq`` is the mean of ``|g|²`` over small batches whose factors (see
    :func:`population_factor`) average ``small_factor``; ``big_sq`` is ``|g|²`` of the big
    batch. Solving ``E[x] = |G|² + tr(Σ) · c`` at both gives, with ``c = 1 / B``, McCandlish's
    ``|G|² = (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)`` and
    ``tr(Σ) = (|G_small|² - |G_big|²) / (1 / B_small - 1 / B_big)``. Either may come out
    negative on one step; only their EMAs are divided.

    Example: ``unbiased_estimates(5.0, 1/2, 3.0, 1/4) == (1.0, 8.0)``
    (``|G|² = 1``, ``tr Σ = 8``: ``1 + 8/2 = 5`` and ``1 + 8/4 = 3``).
    """
    trace = (small_sq - big_sq) / (small_factor - big_factor)
    return big_sq - trace * big_factor, trace


class NoiseScale:
    """EMAs of ``|G|²``, ``tr(Σ)`` and elements per sample; their ratio is ``B_simple``.

    The EMAs are bias-corrected like Adam's moments (``ema / (1 - beta^t)``), so the first
    steps are not pulled toward zero; the correction cancels in the ratio. Values may be floats
    or 0-dim tensors (an accelerator's: nothing waits for the device until a value is read).

    Example, ``beta=0.5``: updates ``(|G|² 2, tr 20)`` then ``(4, 20)`` give ``grad_sq`` =
    ``(0.25·2 + 0.5·4) / 0.75 = 10/3`` and ``noise_scale`` ``20 / (10/3) = 6``.

    Raises:
        ValueError: ``beta`` outside [0, 1).
    """

    def __init__(self, beta: float = 0.95) -> None:
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 <= beta < 1:
            raise ValueError(f"beta must be an EMA factor in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self.updates = 0
        self._grad_sq: Number = 0.0
        self._trace: Number = 0.0
        self._elements: Number = 0.0

    def update(self, grad_sq: Number, trace: Number, elements_per_sample: Number = 1.0) -> None:
        """Fold one step's unbiased estimates into the EMAs."""
        b = self.beta
        self._grad_sq = b * self._grad_sq + (1 - b) * grad_sq
        self._trace = b * self._trace + (1 - b) * trace
        self._elements = b * self._elements + (1 - b) * elements_per_sample
        self.updates += 1

    def _corrected(self, value: Number) -> Number | None:
        if self.updates == 0:
            return None
        return value / (1 - self.beta**self.updates)

    @property
    def grad_sq(self) -> Number | None:
        """EMA of ``|G|²`` (``None`` before the first update)."""
        return self._corrected(self._grad_sq)

    @property
    def trace(self) -> Number | None:
        """EMA of ``tr(Σ)`` (``None`` before the first update)."""
        return self._corrected(self._trace)

    @property
    def elements_per_sample(self) -> Number | None:
        """EMA of counted elements per sample (1 for mean losses)."""
        return self._corrected(self._elements)

    @property
    def noise_scale(self) -> float | None:
        """``B_simple`` in samples: ``tr(Σ) / |G|²`` from the EMAs, divided by elements per sample.

        ``None`` before the first update; ``inf`` while the ``|G|²`` EMA is not positive
        (noise swamps the signal: the batches measured are far below the noise scale). Reading
        it waits for the device.
        """
        return _ratio(self.trace, self.grad_sq, self.elements_per_sample) if self.updates else None

    @property
    def noise_scale_elements(self) -> float | None:
        """``B_simple`` in counted elements (tokens for ``(sum, count)`` losses)."""
        return _ratio(self.trace, self.grad_sq, 1.0) if self.updates else None

    def state_dict(self) -> dict[str, Any]:
        """Plain floats: loads with ``torch.load(..., weights_only=True)``."""
        return {"beta": self.beta, "updates": self.updates, "grad_sq": float(self._grad_sq),
                "trace": float(self._trace), "elements": float(self._elements)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved EMAs exactly (this ``beta`` is kept; a different saved one is logged)."""
        if float(state["beta"]) != self.beta:
            logger.warning("noise-scale EMA saved with beta %s, continuing with beta %s", state["beta"], self.beta)
        self.updates = check_int("noise state updates", state["updates"], minimum=0)
        self._grad_sq = float(state["grad_sq"])
        self._trace = float(state["trace"])
        self._elements = float(state["elements"])


def _ratio(trace: Number, grad_sq: Number, elements: Number) -> float:
    g, t, e = float(grad_sq), float(trace), float(elements)
    if not (math.isfinite(g) and math.isfinite(t)):
        return math.nan
    if g <= 0:
        return math.inf
    return max(t, 0.0) / g / e


# ---------------------------------------------------------------------------
# Configuration and per-step record


@dataclass(kw_only=True)
class NoiseConfig:
    """How the engine measures the gradient noise scale.

    Attributes:
        mode: ``"first"``: the small batch is each step's first micro-batch (or, over several
            ranks with a deferred sync, each rank's share); ``"every"``: every micro-batch on
            every rank, more accurate (the mean of several small batches) for one gradient norm
            per micro-batch and one gradient-sized buffer during each backward. ``None``
            (default): the engine's choice, :func:`default_mode`: ``every`` under a schedule
            that follows the noise scale, ``first`` otherwise. A mode given is kept.
        beta: EMA factor for ``|G|²`` and ``tr(Σ)``; ``None``: :data:`DEFAULT_BETA` of the mode
            (once the mode is known), 0.99 for ``first`` (about 200 steps: one small batch a step
            needs long averaging) and 0.95 for ``every`` (about 40; see ``benchmarks/README.md``
            for what each needs).
        dataset_size: samples in the data set an epoch draws the batches from without
            replacement; enables the finite-population correction (without it a small data set
            biases ``B_simple`` upward: by ``B_simple / N`` relative). ``None``: fresh samples.
        split: when a step is a single micro-batch on a single rank there is no smaller batch
            to compare with; ``True`` runs such steps as two micro-batches (the same update, up to
            BatchNorm statistics, which are per micro-batch), ``False`` leaves them unmeasured,
            ``"auto"`` splits only when a batch schedule follows the noise scale.

    Raises:
        ValueError: an unknown mode, ``beta`` outside [0, 1), ``dataset_size`` below 2, or a
            ``split`` other than True, False, "auto".
    """

    mode: Literal["first", "every"] | None = None
    beta: float | None = None
    dataset_size: int | None = None
    split: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in NOISE_MODES:
            raise ValueError(f"noise mode must be one of {', '.join(NOISE_MODES)} (or None for the engine's "
                             f"choice), got {self.mode!r}")
        if self.beta is None and self.mode is not None:
            self.beta = DEFAULT_BETA[self.mode]
        if self.beta is not None:
            NoiseScale(self.beta)  # validates beta
        if self.dataset_size is not None:
            check_int("dataset_size", self.dataset_size, minimum=2,
                      hint="; the finite-population correction needs the number of samples an epoch draws from")
        if self.split not in (True, False, "auto"):
            raise ValueError(f'split must be True, False or "auto", got {self.split!r}')


@dataclass(frozen=True, kw_only=True)
class NoiseSample:
    """One step's noise measurement (``StepResult.noise``).

    Values are floats on CPU and 0-dim tensors on an accelerator (read them with ``float()``:
    that waits for the device). Batch sizes are in samples, summed over ranks.

    Attributes:
        grad_sq: this step's unbiased estimate of ``|G|²`` (may be negative).
        trace: this step's unbiased estimate of ``tr(Σ)``, per sample (per element for
            ``(sum, count)`` losses).
        grad_sq_ema, trace_ema: their EMAs after this step.
        elements_per_sample: EMA of counted elements per sample (1 for mean losses).
        small_batch: mean size of the small batches measured; ``small_count`` of them.
        big_batch: size of the big batch (the global batch of the step).
    """

    grad_sq: Number
    trace: Number
    grad_sq_ema: Number
    trace_ema: Number
    elements_per_sample: Number
    small_batch: float
    small_count: int
    big_batch: int

    @property
    def noise_scale(self) -> float:
        """``B_simple`` in samples from the EMAs (``inf`` while the ``|G|²`` EMA is not positive)."""
        return _ratio(self.trace_ema, self.grad_sq_ema, self.elements_per_sample)

    @property
    def noise_scale_step(self) -> float:
        """``B_simple`` from this step's estimates alone (very noisy)."""
        return _ratio(self.trace, self.grad_sq, self.elements_per_sample)

    def to_dict(self) -> dict[str, float | int]:
        """Floats and ints (reads the values: a sync point on an accelerator)."""
        return {"grad_sq": float(self.grad_sq), "trace": float(self.trace), "grad_sq_ema": float(self.grad_sq_ema),
                "trace_ema": float(self.trace_ema), "small_batch": self.small_batch,
                "small_count": self.small_count, "big_batch": self.big_batch}


# ---------------------------------------------------------------------------
# Measuring in the engine


def squared_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ |t|²`` over ``tensors`` as a 0-dim tensor on the first one's device.

    One multi-tensor norm per accumulation dtype (the fewest kernel launches, and on CPU faster
    than a dot product per tensor): fp16 / bf16 / fp32 in fp32, so that fp16 gradients cannot
    overflow; fp64 in fp64 (torch refuses to narrow it, and a float64 model keeps its precision).
    The result has the widest of them.
    """
    dev = tensors[0].device
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(_accumulation(t.dtype), []).append(t)
    norms: list[torch.Tensor] = []
    for acc, group in groups.items():
        norms.extend(torch._foreach_norm(group, 2, dtype=acc))
    if len(groups) > 1 or any(n.device != dev for n in norms):  # mixed dtypes, or a model spread over devices
        widest = max(groups, key=lambda d: torch.finfo(d).bits)
        norms = [n.to(device=dev, dtype=widest) for n in norms]
    return torch.stack(norms).square().sum()


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm of ``dtype`` values is squared in: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _host(value: torch.Tensor) -> Number:
    """A CPU tensor as a float (free there); an accelerator's stays a tensor (no sync)."""
    return float(value) if value.device.type == "cpu" else value


def _as_number(count: Any, device: torch.device) -> Number:
    if isinstance(count, torch.Tensor):
        return _host(count.detach().to(device=device, dtype=torch.float32).reshape(()))
    return float(count)


class NoiseMeter:
    """The engine's side of the estimator: which norms to take, when, and how to scale them.

    The engine calls, per attempt at a step (all optional when the meter is ``None``):
    :meth:`micro_batch` to choose the micro-batch, :meth:`begin` before the first micro-batch,
    :meth:`before_backward` / :meth:`after_backward` around each micro-batch's backward,
    :meth:`local_values` before the gradient sync (their sum over ranks rides in the sync's
    first collective), :meth:`measure` with the final gradients before the optimizer step, and
    :meth:`commit` once the step is known not to be skipped (:meth:`abort` after an OOM).

    Which batches are compared (``W`` ranks, ``A`` micro-batches per rank):

    ========================== ============================== ====================================
    setting                    small batches                  big batch
    ========================== ============================== ====================================
    ``first``, W = 1           the first micro-batch (A ≥ 2)  the accumulated gradient
    ``first``, W > 1, deferred each rank's share, pre-sync    the averaged gradient after the sync
    ``first``, W > 1, DDP sync the first micro-batch per rank the averaged gradient
    ``every``                  every micro-batch on every     the averaged gradient
                               rank (not the one whose
                               backward DDP syncs)
    ========================== ============================== ====================================

    Args:
        config: the :class:`NoiseConfig`.
        world: data-parallel ranks.
        deferred: the coordinator defers the gradient sync (``defer_grad_sync``).
        split: run single-micro-batch steps as two (``config.split`` resolved).
    """

    def __init__(self, config: NoiseConfig, *, world: int, deferred: bool, split: bool) -> None:
        if config.mode is None:
            raise ValueError("NoiseMeter needs a NoiseConfig with a mode; make_meter chooses one for mode=None")
        self.config = config
        self.world = world
        self.deferred = deferred
        self.split = split
        self.scale = NoiseScale(config.beta)
        self._warned = False
        self._reset_attempt()

    def describe(self) -> str:
        """The mode in use and its EMA factor, e.g. ``noise every (beta 0.95, a lone micro-batch split)``."""
        split = ", a lone micro-batch split" if self.split else ""
        return f"noise {self.config.mode} (beta {self.config.beta:g}{split})"

    # -- per attempt -----------------------------------------------------------------------
    def _reset_attempt(self) -> None:
        self._sizes: list[int] = []
        self._n = 0
        self._per_rank = 0
        self._inv_scale: Number = 1.0
        self._x: Number = 0.0  # sum of |g_i|² over this rank's small batches
        self._c: Number = 0.0  # sum of their population factors
        self._k: Number = 0.0  # how many
        self._stash: list[torch.Tensor | None] | None = None
        self._local_level = False
        self._measured: list[int] = []  # the micro-batches this attempt measures

    @property
    def _micro_level(self) -> bool:
        """The small batches are micro-batches (else: each rank's whole share)."""
        return self.config.mode == "every" or self.world == 1 or not self.deferred

    @property
    def active(self) -> bool:
        """This attempt measures something. The same on every rank: it depends on sizes, not values."""
        return self._local_level or bool(self._measured)

    def micro_batch(self, n: int, micro: int) -> int:
        """The micro-batch for a step of ``n`` samples: ``micro``, or half of ``n`` to split a lone one."""
        lone = self.world == 1 or not self.deferred  # else each rank's share is a small batch already
        if self.split and self._micro_level and lone and n >= 2 and micro >= n:
            return -(-n // 2)
        return micro

    def begin(self, *, n: int, sizes: list[int], per_rank: int, scale: torch.Tensor | None) -> None:
        """A new attempt at a step of ``n`` samples in micro-batches ``sizes``; ``scale`` is fp16's loss scale."""
        self._reset_attempt()
        self._sizes, self._n, self._per_rank = sizes, n, per_rank
        if scale is not None:
            self._inv_scale = _host(1.0 / scale.detach().float().square())
        self._local_level = not self._micro_level
        self._measured = [i for i in range(len(sizes)) if self._measures(i)]
        if not self.active and not self._warned:
            self._warned = True
            logger.info("the gradient noise scale is not measured on steps that run as one micro-batch: there is "
                        "no smaller batch to compare with (NoiseConfig(split=True) splits them in two)")

    def _measures(self, i: int) -> bool:
        if not self._micro_level or not self._sizes:
            return False
        last = len(self._sizes) - 1
        # DDP all-reduces inside the last micro-batch's backward unless the sync is deferred
        if i == last and self.world > 1 and not self.deferred:
            return False
        if self.config.mode == "first":
            return i == 0 and (last > 0 or self.world > 1)
        return last > 0 or self.world > 1

    def before_backward(self, i: int, params: list[torch.Tensor]) -> None:
        """``every`` mode: set the running sum aside so that this backward writes the micro-batch's gradient alone."""
        if self.config.mode != "every" or i not in self._measured:
            return
        self._stash = [p.grad for p in params]
        for p in params:
            p.grad = None

    def after_backward(self, i: int, size: int, count: Any, params: list[torch.Tensor]) -> None:
        """Take micro-batch ``i``'s gradient norm, then put the running sum back (``every`` mode)."""
        if i not in self._measured:
            return
        grads = [p.grad for p in params if p.grad is not None]
        sq = _host(squared_norm(grads)) if grads else None
        if self._stash is not None:
            new, old = [], []
            for p, kept in zip(params, self._stash):
                if kept is None:
                    continue
                if p.grad is None:
                    p.grad = kept
                else:
                    new.append(p.grad)
                    old.append(kept)
            if new:
                with torch.no_grad():
                    torch._foreach_add_(new, old)  # a + b == b + a: the sum autograd would have made
            self._stash = None
        if sq is None:
            return
        if count is None:  # mean loss, weighted size / n in the backward
            self._add(sq * (self._n / size) ** 2, float(size), size)
        else:  # (sum, count): backward of sum / per_rank; the micro-batch's mean is over its count
            elements = _as_number(count, grads[0].device)
            self._add_counted(sq, elements, size, grads[0].device)

    def _add(self, sq: Number, elements: Number, samples: int) -> None:
        self._x = self._x + sq * self._inv_scale
        self._c = self._c + population_factor(elements, samples, self.config.dataset_size)
        self._k = self._k + 1.0

    def _add_counted(self, sq: Number, elements: Number, samples: int, device: torch.device) -> None:
        if isinstance(elements, torch.Tensor):
            ok = elements > 0
            safe = torch.where(ok, elements, torch.ones_like(elements))
            x = sq * (self._per_rank / safe) ** 2 * self._inv_scale
            self._x = self._x + torch.where(ok, x, torch.zeros_like(x))
            self._c = self._c + torch.where(ok, population_factor(safe, samples, self.config.dataset_size),
                                            torch.zeros_like(safe))
            self._k = self._k + ok.float()
        elif elements > 0:  # a micro-batch of nothing but padding has no gradient to measure
            self._add(sq * (self._per_rank / elements) ** 2, elements, samples)

    def local_values(self, params: list[torch.Tensor], count: Any) -> Any:
        """``[Σ|g|², Σc, k]`` of this rank's small batches, to be summed over ranks (``None``: nothing measured).

        A 1-D tensor over several ranks; on one rank the three values as they are (nothing to
        sum, no tensor to build). With several ranks and a deferred sync in ``first`` mode, this
        takes the norm of the rank's accumulated gradient now, before the all-reduce averages it away.
        """
        if not self.active:
            return None
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:  # no gradient at all this step; every rank still sends the same three values
            if self.world == 1:
                return 0.0, 0.0, 0.0
            dev = params[0].device if params else torch.device("cpu")
            return torch.zeros(3, dtype=torch.float32, device=dev)
        if self._local_level:
            sq = _host(squared_norm(grads))
            if count is None:
                self._add(sq, float(self._n), self._n)
            else:
                self._add_counted(sq, _as_number(count, grads[0].device), self._n, grads[0].device)
        if self.world == 1:
            return self._x, self._c, self._k
        dev = grads[0].device
        return torch.stack([torch.as_tensor(v, dtype=torch.float32, device=dev).reshape(())
                            for v in (self._x, self._c, self._k)])

    def measure(self, params: list[torch.Tensor], reduced: Any, *, total_count: Any,
                grad_norm: torch.Tensor | None) -> tuple | None:
        """The step's estimates from the final gradients; ``reduced`` is :meth:`local_values` summed over ranks.

        ``grad_norm`` is the clipping norm of the same (unscaled) gradients, reused when given.
        Returns what :meth:`commit` folds into the EMAs once the step is known not to be skipped,
        or ``None`` when nothing was measured.
        """
        if reduced is None:
            return None
        x, c, k = reduced if isinstance(reduced, tuple) else (_host(v) for v in reduced.unbind())
        if total_count is not None or isinstance(k, float):
            # (sum, count) losses may count nothing on a micro-batch (padding); their step has
            # read the total count already, so reading k here adds no wait
            k = float(k)
            if k <= 0:
                return None
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return None
        dev = grads[0].device
        if grad_norm is not None:
            big_sq = _host(grad_norm.detach().to(device=dev, dtype=_accumulation(grad_norm.dtype)).square())
        else:
            big_sq = _host(squared_norm(grads)) * self._inv_scale
        samples = self._n * self.world
        elements = float(samples) if total_count is None else _as_number(total_count, dev)
        small_sq, small_c = x / k, c / k
        big_c = population_factor(elements, samples, self.config.dataset_size)
        grad_sq, trace = unbiased_estimates(small_sq, small_c, big_sq, big_c)
        if self._local_level:
            small_batch, small_count = float(self._n), self.world
        else:
            measured = [self._sizes[i] for i in self._measured]
            small_batch, small_count = sum(measured) / len(measured), len(measured) * self.world
        return grad_sq, trace, elements / samples, small_batch, small_count, samples

    def commit(self, pending: tuple) -> NoiseSample | None:
        """Fold :meth:`measure`'s estimates into the EMAs; ``None`` (and no update) when they are not finite."""
        grad_sq, trace, per_sample, small_batch, small_count, samples = pending
        if isinstance(grad_sq, float) and not (math.isfinite(grad_sq) and math.isfinite(trace)):
            logger.debug("a non-finite noise estimate was dropped")
            return None
        self.scale.update(grad_sq, trace, per_sample)
        return NoiseSample(
            grad_sq=grad_sq, trace=trace, grad_sq_ema=self.scale.grad_sq, trace_ema=self.scale.trace,
            elements_per_sample=self.scale.elements_per_sample, small_batch=small_batch,
            small_count=small_count, big_batch=samples,
        )

    def abort(self) -> None:
        """The attempt failed (OOM): put nothing back, hold on to nothing."""
        self._stash = None

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.config.mode, **self.scale.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.load_state_dict(state)


def default_mode(follower: str | None) -> str:
    """The mode of a :class:`NoiseConfig` that names none: ``every`` for a schedule that follows the noise scale
    (it reads the estimate every few steps, so it must settle in tens of steps, not hundreds), else ``first``."""
    return "first" if follower is None else "every"


def make_meter(noise: bool | NoiseConfig | None, *, world: int, deferred: bool,
               follower: str | None = None) -> NoiseMeter | None:
    """The engine's meter for ``noise``, or ``None`` (nothing measured).

    ``noise``: ``None`` (the engine's default) measures only for a ``follower``, a schedule
    that reads the noise scale; ``True`` is ``NoiseConfig()``; ``False`` measures nothing. A
    config without a mode gets :func:`default_mode`; a mode given is kept, and a ``first``
    under a follower is announced (its estimate settles in about 200 steps). ``follower`` also
    makes a missing measurement an error and turns ``split="auto"`` on. ``world`` and
    ``deferred`` are the coordinator's: its ranks, and whether it syncs the gradients after the
    backward (:attr:`batchpilot.dist.coordinator.Coordinator.defer_grad_sync`); over several
    ranks the meter's local norms are summed by the coordinator's ``sync_gradients_and_sum``
    and ``sum_over_ranks``, which the protocol declares.

    Raises:
        TypeError: ``noise`` is not None, a bool or a :class:`NoiseConfig`.
        ValueError: ``follower`` is set and ``noise`` is False.
    """
    if noise is None:
        noise = follower is not None
    if noise is False:
        if follower is not None:
            raise ValueError(f"the {follower} schedule follows the gradient noise scale; "
                             "leave noise on (leave noise= out, noise=True or a NoiseConfig)")
        return None
    if noise is True:
        noise = NoiseConfig()
    if not isinstance(noise, NoiseConfig):
        raise TypeError(f"noise must be True, False or a batchpilot.train.noise.NoiseConfig (None: the default), "
                        f"got {type(noise).__name__}")
    if noise.mode is None:
        noise = dataclasses.replace(noise, mode=default_mode(follower))
    elif noise.mode == "first" and follower is not None:
        logger.info("noise mode first (beta %s) under the %s schedule, as asked: its estimate settles in about "
                    "200 steps; NoiseConfig(mode=None or \"every\") settles in about 40", noise.beta, follower)
    split = follower is not None if noise.split == "auto" else bool(noise.split)
    return NoiseMeter(noise, world=world, deferred=deferred, split=split)
