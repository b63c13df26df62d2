"""transformers' continuous batching (``model.generate_batch``) with its cache sized for the limit that applies.

transformers sizes the paged KV cache of ``generate_batch`` as ``max_memory_percent`` of the device's
memory: on CPU 0.6 of the host's RAM, blind to ``RLIMIT_AS`` and to a container's limit, with 8192
batch tokens whatever the model. :func:`continuous_batching_config` sizes it for the headroom of the
limit that binds this process (:mod:`batchpilot.memory.gauge`: address space under ``RLIMIT_AS``, a
cgroup's charge, available RAM; on CUDA the device's free memory), from transformers' own account of
what the cache and the tensors sized with it take plus what a short real run in this process
measured beyond that account, and returns it only after a real run at the answer has completed in
this process (stepping down if one does not).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from .._checks import positive_int
from ..core.model import context_length, model_device
from ..memory.gauge import Gauge, gauge_for
from ..memory.host import ResidentPeak, resident_bytes
from ..memory.oom import free_memory, is_oom
from ..memory.units import format_bytes, parse_bytes
from ..policy.search import (
    FIT,
    OOM,
    OVER_TARGET,
    GrowStepDownPolicy,
    NothingFitsError,
    SearchSpace,
    Trial,
    check_target,
    run_search,
)
from ._common import require_installed

# checked, not imported: transformers is loaded by the functions that use it (its package alone is
# hundreds of modules, which a process sized tight must not pay for on import)
require_installed("transformers", "batchpilot.integrations.continuous")

__all__ = ["ContinuousBatchingPlan", "continuous_batching_config", "size_continuous_batching"]

logger = logging.getLogger(__name__)

#: transformers' logger for continuous batching (it logs every failed request at ERROR, with a traceback)
_CB_LOGGER = "ContinuousBatchingLogger"
#: new tokens per request of a sizing run: enough for decode steps that read the whole cache
_RUN_NEW_TOKENS = 2
#: each verification that runs out of memory steps the cache down by this fraction
_STEP_DOWN = 0.15
_MAX_RUNS = 6
#: a verifying run fills the cache when that takes at most this long at the first run's rate
_FILL_SECONDS = 8.0
_FILL_REQUESTS = 4096
#: a run that filled its cache with room left grows it again when that adds this fraction or more
_GROW = 0.05
#: how often the waiting thread samples the host's memory figure during a run
_SAMPLE_SECONDS = 0.002
_MIN_BATCH_TOKENS = 64
_MAX_BATCH_TOKENS = 8192  # transformers' own default


@dataclass(frozen=True, kw_only=True)
class _Geometry:
    """The cache's units and transformers' account of the memory a configuration takes (a run's cache)."""

    bytes_per_sector: int
    tokens_per_sector: int
    bytes_per_block: int
    page_size: int
    masks: bool  # eager / SDPA attention: [M, cache + M] masks are allocated (flash needs none)
    footprint: Callable[[int, int], int]  # (max_batch_tokens, sectors) -> bytes

    def sectors(self, num_blocks: int) -> int:
        """The sectors transformers allocates for ``num_blocks`` (its ``num_sectors_from_config``)."""
        return max(1, math.ceil(num_blocks * self.bytes_per_block / self.bytes_per_sector))

    def blocks(self, sectors: int) -> int:
        """The most ``num_blocks`` that allocates no more than ``sectors``."""
        return max(1, sectors * self.bytes_per_sector // self.bytes_per_block)

    def sectors_for_tokens(self, tokens: int) -> int:
        return max(1, math.ceil(tokens / self.tokens_per_sector))


@dataclass(frozen=True, kw_only=True)
class _Run:
    num_blocks: int
    max_batch_tokens: int
    ok: bool
    peak_bytes: int  # growth of the gauge's figure over the baseline
    error: str | None = None
    seconds: float = 0.0
    generating: float = 0.0  # of which the requests' generation (not the cache's allocation, nor the thread's)


@dataclass(frozen=True, kw_only=True)
class ContinuousBatchingPlan:
    """What :func:`size_continuous_batching` chose, and what it measured.

    Attributes:
        config: the ``ContinuousBatchingConfig`` to pass to ``generate_batch``.
        num_blocks: cache blocks of ``page_size`` tokens (for every layer).
        max_batch_tokens: tokens per forward pass.
        cache_bytes: the paged KV cache itself.
        predicted_bytes: the growth of the memory figure a run at the answer reaches with its
            cache full: transformers' account of the cache, its masks, indices and activations,
            plus the overhead the first run measured beyond that account.
        measured_bytes: the growth the verifying run at the answer reached.
        headroom_bytes: what the binding limit left this process when sizing began.
        limit_bytes: ``target × headroom_bytes``, what the prediction was held under.
        memory: the figure decided on (``"address_space"``, ``"cgroup"``, ``"resident"``, ``"device"``...).
        runs: every real run, in order: ``(num_blocks, max_batch_tokens, growth in bytes, "ok" | the error)``.
        seconds: wall time of the sizing.
    """

    config: Any
    num_blocks: int
    max_batch_tokens: int
    cache_bytes: int
    predicted_bytes: int
    measured_bytes: int
    headroom_bytes: int
    limit_bytes: int
    memory: str
    runs: tuple[tuple[int, int, int, str], ...] = field(default_factory=tuple)
    seconds: float = 0.0

    def describe(self) -> str:
        return (f"{self.num_blocks} blocks ({format_bytes(self.cache_bytes)} of KV cache), {self.max_batch_tokens} "
                f"batch tokens: predicted {format_bytes(self.predicted_bytes)}, measured "
                f"{format_bytes(self.measured_bytes)} of {format_bytes(self.limit_bytes)} "
                f"({format_bytes(self.headroom_bytes)} of {self.memory} headroom)")


def continuous_batching_config(model: nn.Module, generation_config: Any = None, **limits: Any) -> Any:
    """A ``ContinuousBatchingConfig`` for ``model.generate_batch`` sized for the memory limit that applies.

    ``model.generate_batch(inputs, generation_config=gc, continuous_batching_config=cfg)`` then runs
    within ``target`` of the headroom of the limit binding this process. ``limits`` are those of
    :func:`size_continuous_batching` (``inputs``, ``target``, ``capacity``, ``max_batch_tokens``,
    ``config``), which also says what was measured.
    """
    return size_continuous_batching(model, generation_config, **limits).config


def size_continuous_batching(
    model: nn.Module,
    generation_config: Any = None,
    *,
    inputs: Sequence[Sequence[int]] | None = None,
    target: float = 0.9,
    capacity: int | str | None = None,
    max_batch_tokens: int | None = None,
    config: Any = None,
) -> ContinuousBatchingPlan:
    """Size the paged cache of ``generate_batch`` (``num_blocks``) and its ``max_batch_tokens`` for this process.

    1. The headroom: what the limit binding this process leaves it now, in the figure that limit
       counts (address space under ``RLIMIT_AS``, a cgroup's working set, the resident set against
       the available RAM; on CUDA reserved memory plus what lies outside PyTorch, against the total:
       the free memory), or below ``capacity`` when given.
    2. ``max_batch_tokens``: with eager / SDPA attention every forward pass allocates an attention
       mask of ``max_batch_tokens × (cache tokens + max_batch_tokens)``, which costs as much per
       cache token as the cache itself once ``max_batch_tokens`` reaches the cache's bytes per token
       divided by the mask's element size; that many (a power of two in [64, 8192]) unless given. With
       flash attention (no masks) transformers' 8192.
    3. A short real ``generate_batch`` with a small cache, filled, measures this process's overhead
       beyond transformers' own account of the cache, its masks, indices and activations (its
       thread's malloc arena and stack, allocator slack); the largest cache whose predicted growth
       stays under ``target × headroom`` is the answer, capped at what ``inputs`` need all at once.
    4. A real run at the answer verifies it in this process; one that runs out of memory, or that
       measures more than the limit, steps the cache down and runs again. The answer returned is
       the last configuration that ran.

    Args:
        model: a transformers model with ``generate_batch`` (transformers 5), on the device it runs on.
        generation_config: the ``GenerationConfig`` the job will pass (its logits processors take
            memory too); default ``model.generation_config``. Never modified.
        inputs: the prompts (token ids) the job will run, optional: the cache is capped at what they
            all need at once, and a request longer than the model's context, or than the cache the
            limit allows, is an error here rather than inside the run.
        target: fraction of the headroom the run may grow into, in (0, 1] (checked as the finder's).
            Its default is above the finder's 0.8 because it is a share of what is left after the
            model and the runtime on every device, where the finder's is a share of an accelerator's
            whole capacity.
        capacity: the memory to size for instead of the binding limit (bytes or ``"2GiB"``), counted
            as the figure above; the smaller of the two applies.
        max_batch_tokens: tokens per forward pass; default as in 2.
        config: a ``ContinuousBatchingConfig`` whose other fields (``page_size``, ``scheduler_type``,
            ...) to keep; its ``num_blocks`` must be ``None`` (it is what is sized).

    Returns:
        The plan; ``plan.config`` is the ``ContinuousBatchingConfig``.

    Raises:
        ValueError: bad arguments, an empty ``inputs``, a request longer than the model's context.
        batchpilot.policy.search.NothingFitsError: the limit leaves too little for a cache that
            holds one request (or the batch tokens' tensors): the message says what it needs.
        TypeError: a model without ``generate_batch`` (transformers older than 5).
    """
    started = time.perf_counter()
    gen = _generation_config(model, generation_config)
    new_tokens = _max_new_tokens(gen)
    context = context_length(model)
    lengths = _check_inputs(inputs, new_tokens, context)
    check_target(target)
    cap = None if capacity is None else parse_bytes(capacity)
    if max_batch_tokens is not None:
        positive_int("max_batch_tokens", max_batch_tokens)
    base_config = _base_config(config)

    device = model_device(model)
    free_memory(device)
    gauge = gauge_for(device)
    try:
        gauge.reset()
        baseline = gauge.current()
        ceiling = gauge.capacity() if cap is None else min(cap, gauge.capacity())
        headroom = ceiling - baseline
        limit = int(target * headroom)
        if headroom <= 0:
            raise NothingFitsError(
                f"no memory left to size a cache for: this process's {gauge.kind} is {format_bytes(baseline)}, "
                f"at or over its limit {format_bytes(ceiling)}", batch_size=1, peak_bytes=None, limit_bytes=limit,
                capacity_bytes=ceiling)
        sizer = _Sizer(model, gen, base_config, gauge, baseline, limit, headroom, lengths, new_tokens, context)
        plan = sizer.size(max_batch_tokens)
    finally:
        gauge.close()
    plan = replace(plan, seconds=time.perf_counter() - started)
    logger.info("continuous batching sized in %.1f s: %s", plan.seconds, plan.describe())
    return plan


# ---------------------------------------------------------------------------
# Checks


def _generation_config(model: nn.Module, generation_config: Any) -> Any:
    if not callable(getattr(model, "generate_batch", None)):
        raise TypeError(
            f"{type(model).__name__} has no generate_batch: continuous batching needs a transformers model "
            f"(transformers >= 5; installed {_transformers_version()})"
        )
    gen = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if gen is None:
        raise ValueError("the model has no generation_config: pass generation_config=GenerationConfig(...)")
    return copy.deepcopy(gen)  # transformers sets eos_token_id in place when it is None


def _max_new_tokens(gen: Any) -> int:
    new = getattr(gen, "max_new_tokens", None)
    if new is None:
        raise ValueError("generation_config.max_new_tokens is None: set it, the cache is sized for prompts + new tokens")
    return positive_int("generation_config.max_new_tokens", new)


def _check_inputs(inputs: Sequence[Sequence[int]] | None, new_tokens: int, context: int | None) -> list[int] | None:
    if inputs is None:
        return None
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise ValueError(f"inputs must be a list of prompts (lists of token ids), got {type(inputs).__name__}")
    if len(inputs) == 0:
        raise ValueError("inputs is empty: pass the prompts the job will run, or inputs=None to size without them")
    lengths = []
    for i, prompt in enumerate(inputs):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or len(prompt) == 0:
            raise ValueError(f"inputs[{i}] must be a non-empty list of token ids, got {prompt!r:.60}")
        if context is not None and len(prompt) + new_tokens > context:
            room = context - new_tokens
            raise ValueError(
                f"inputs[{i}] has {len(prompt)} tokens and max_new_tokens is {new_tokens}: {len(prompt) + new_tokens} "
                f"positions, past the model's context of {context}; truncate the prompt to {max(room, 0)} tokens "
                "or lower max_new_tokens" if room > 0 else
                f"max_new_tokens={new_tokens} leaves no room for a prompt in the model's context of {context}"
            )
        lengths.append(len(prompt))
    return lengths


def _base_config(config: Any) -> Any:
    from transformers import ContinuousBatchingConfig

    if config is None:
        return ContinuousBatchingConfig()
    if not isinstance(config, ContinuousBatchingConfig):
        raise ValueError(f"config must be a transformers ContinuousBatchingConfig, got {type(config).__name__}")
    if config.num_blocks is not None:
        raise ValueError(f"config.num_blocks={config.num_blocks} is what this sizes: leave it None "
                         "(or pass the config straight to generate_batch without sizing it)")
    return copy.deepcopy(config)


# ---------------------------------------------------------------------------
# The sizing


class _Sizer:
    """Real runs of ``generate_batch`` at chosen configurations, measured from one baseline."""

    def __init__(self, model: nn.Module, gen: Any, base_config: Any, gauge: Gauge, baseline: int, limit: int,
                 headroom: int, lengths: list[int] | None, new_tokens: int, context: int | None) -> None:
        self.model = model
        self.gen = gen
        self.base_config = base_config
        self.gauge = gauge
        self.baseline = baseline
        self.limit = limit
        self.headroom = headroom
        self.lengths = lengths
        self.new_tokens = new_tokens
        self.context = context
        self.runs: list[_Run] = []
        self.fixed_tokens = False
        self.geometry: _Geometry | None = None
        self._rng = torch.Generator().manual_seed(0)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.text_config = cfg

    # -- the plan

    def size(self, max_batch_tokens: int | None) -> ContinuousBatchingPlan:
        auto = max_batch_tokens is None
        self.fixed_tokens = not auto
        tokens = max_batch_tokens if max_batch_tokens is not None else self._batch_tokens(self._uses_masks())
        while True:
            probe = self._probe(tokens)
            geo = self.geometry  # None when the first run failed before its cache existed
            if probe.ok and geo is not None:
                if auto and geo.masks != self._uses_masks():
                    # the run switched the attention (transformers picks flash for half precision when it can)
                    better = self._batch_tokens(geo.masks)
                    if better != tokens:
                        tokens = better
                        continue
                sectors = self._solve(tokens, probe)
                if sectors >= self._min_sectors(tokens):
                    return self._verify(tokens, sectors)
            if not auto or tokens <= _MIN_BATCH_TOKENS:
                raise self._nothing_fits(tokens, probe)
            tokens = max(_MIN_BATCH_TOKENS, tokens // 2)  # fewer batch tokens: smaller masks and activations

    def _uses_masks(self) -> bool:
        from transformers.utils.generic import is_flash_attention_requested

        return not is_flash_attention_requested(self.text_config)

    def _batch_tokens(self, masks: bool) -> int:
        """Batch tokens at which the masks cost as much per cache token as the cache (a power of two)."""
        if not masks:
            return _MAX_BATCH_TOKENS
        per_token = self._kv_bytes_per_token()
        element = self.model.dtype.itemsize if isinstance(getattr(self.model, "dtype", None), torch.dtype) else 4
        n = max(1, per_token // element)
        tokens = 1 << (n.bit_length() - 1)
        return min(_MAX_BATCH_TOKENS, max(_MIN_BATCH_TOKENS, tokens))

    def _kv_bytes_per_token(self) -> int:
        from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

        cfg = self.text_config
        element = self.model.dtype.itemsize if isinstance(getattr(self.model, "dtype", None), torch.dtype) else 4
        return 2 * int(cfg.num_hidden_layers) * find_num_key_value_heads(cfg) * find_head_dim(cfg) * element

    def _prompt_length(self, tokens: int) -> int:
        """Prompts of one page at most (each request then holds as few blocks as it can: the most requests
        at once, and their logits rows), and a quarter of a batch (several prefills share a forward)."""
        length = min(self.base_config.page_size - _RUN_NEW_TOKENS, tokens // 4)
        if self.context is not None:
            length = min(length, self.context - _RUN_NEW_TOKENS)
        return max(1, length)

    def _prompts(self, count: int, length: int) -> list[list[int]]:
        vocab = int(getattr(self.text_config, "vocab_size", 0) or 2)
        return torch.randint(0, vocab, (count, length), generator=self._rng).tolist()

    def _workload(self, tokens: int) -> list[list[int]]:
        """Prompts that fill two batches of ``tokens``."""
        length = self._prompt_length(tokens)
        return self._prompts(max(2, math.ceil(2 * tokens / length)), length)

    def _fill(self, tokens: int, blocks: int, rate: float) -> tuple[list[list[int]], bool]:
        """Prompts that fill a cache of ``blocks`` (more requests than it holds), when that takes a few seconds
        at the probe's rate; else the probe's workload. And whether they fill it."""
        if self._fills(tokens, blocks, rate):
            return self._prompts(self._fill_count(tokens, blocks), self._prompt_length(tokens)), True
        return self._workload(tokens), False

    def _fill_count(self, tokens: int, blocks: int) -> int:
        """Requests that fill a cache of ``blocks``, with some left waiting."""
        per_request = math.ceil((self._prompt_length(tokens) + _RUN_NEW_TOKENS) / self.base_config.page_size)
        return math.ceil(1.2 * blocks / per_request) + 1

    def _fills(self, tokens: int, blocks: int, rate: float) -> bool:
        """Whether runs at ``blocks`` fill their cache: in a few seconds at the probe's ``rate`` of prompt tokens."""
        count = self._fill_count(tokens, blocks)
        return count * self._prompt_length(tokens) <= _FILL_SECONDS * rate and count <= _FILL_REQUESTS

    def _blocks_for(self, lengths: Sequence[int], new: int) -> int:
        page = self.base_config.page_size
        return sum(math.ceil((n + new) / page) for n in lengths)

    def _probe(self, tokens: int) -> _Run:
        prompts = self._workload(tokens)
        blocks = self._blocks_for([len(p) for p in prompts], _RUN_NEW_TOKENS) + 1
        return self._run(blocks, tokens, prompts)

    def _predicted(self, tokens: int, sectors: int, probe: _Run) -> int:
        geo = self.geometry
        assert geo is not None
        probe_sectors = geo.sectors(probe.num_blocks)
        return probe.peak_bytes + geo.footprint(tokens, sectors) - geo.footprint(tokens, probe_sectors)

    def _solve(self, tokens: int, probe: _Run) -> int:
        """The most sectors whose predicted growth fits the limit, capped at what the requests need."""
        geo = self.geometry
        assert geo is not None
        lo = geo.sectors(probe.num_blocks)
        slope = max(1, geo.footprint(tokens, lo + 1) - geo.footprint(tokens, lo))
        sectors = lo + math.floor((self.limit - probe.peak_bytes) / slope)
        while sectors > 1 and self._predicted(tokens, sectors, probe) > self.limit:
            sectors -= 1  # the masks make the footprint a little convex in rounding
        return min(sectors, self._max_sectors())

    def _min_sectors(self, tokens: int) -> int:
        """A cache that holds the longest request (or, without requests, one batch of tokens)."""
        geo = self.geometry
        assert geo is not None
        longest = max(self.lengths) + self.new_tokens if self.lengths else tokens
        return geo.sectors(math.ceil(longest / self.base_config.page_size))

    def _max_sectors(self) -> int:
        """The cache all requests need at once (with transformers' scheduling margin); more is never used."""
        geo = self.geometry
        assert geo is not None
        if self.lengths is not None:
            blocks = self._blocks_for(self.lengths, self.new_tokens)
        else:
            if self.context is None:
                return 1 << 40
            requests = self.base_config.max_requests_per_batch or 1024
            blocks = requests * math.ceil(self.context / self.base_config.page_size)
        margin = self.base_config.safety_margin if self.base_config.safety_margin is not None else 0.15
        return geo.sectors(math.ceil(blocks / max(1e-3, 1 - margin)) + 1)

    def _verify(self, tokens: int, sectors: int) -> ContinuousBatchingPlan:
        """Run at ``sectors``; grow once when a run that filled its cache leaves room, step down when one fails.

        A run whose requests filled the cache measured the peak itself, and is judged by what it
        measured; one that could not fill it in a few seconds is judged by the larger of its measure
        and the prediction. The configuration returned is the last that ran. The decisions are
        :class:`~batchpilot.policy.search.GrowStepDownPolicy`'s, in cache sectors, driven by
        :func:`~batchpilot.policy.search.run_search`.
        """
        geo = self.geometry
        assert geo is not None
        probe = self.runs[-1]
        rate = sum(len(p) for p in self._workload(tokens)) / max(probe.generating, 1e-3)
        policy = GrowStepDownPolicy(
            start=sectors, limit=self.limit, floor=self._min_sectors(tokens), ceiling=self._max_sectors(),
            probe_units=geo.sectors(probe.num_blocks), probe_peak=probe.peak_bytes,
            footprint=lambda s: geo.footprint(tokens, s), units=lambda s: geo.sectors(geo.blocks(s)),
            fills=lambda s: self._fills(tokens, geo.blocks(s), rate), grow=_GROW, step=_STEP_DOWN, rounds=_MAX_RUNS,
        )

        def trial(size: int) -> Trial:
            blocks = geo.blocks(size)
            prompts, _ = self._fill(tokens, blocks, rate)
            run = self._run(blocks, tokens, prompts)
            outcome = OOM if not run.ok else FIT if run.peak_bytes <= self.limit else OVER_TARGET
            return Trial(batch_size=size, outcome=outcome, peak_bytes=run.peak_bytes, seconds=run.seconds)

        # the space only bounds the sizes asked for; the policy judges each run against its own limit
        space = SearchSpace(limit_bytes=max(1, self.limit), capacity_bytes=max(1, self.limit, self.headroom))
        result = run_search(policy, space, trial, max_trials=2 * _MAX_RUNS)
        found = policy.answer(result.trials)
        if found is None:
            raise self._nothing_fits(tokens, self.runs[-1])
        size, expected = found
        return self._plan(geo.blocks(size), tokens, expected, self.runs[-1])

    def _plan(self, blocks: int, tokens: int, predicted: int, run: _Run) -> ContinuousBatchingPlan:
        geo = self.geometry
        assert geo is not None
        config = self._config(blocks, tokens)
        return ContinuousBatchingPlan(
            config=config, num_blocks=blocks, max_batch_tokens=tokens,
            cache_bytes=geo.sectors(blocks) * geo.bytes_per_sector, predicted_bytes=predicted,
            measured_bytes=run.peak_bytes, headroom_bytes=self.headroom, limit_bytes=self.limit,
            memory=self.gauge.kind,
            runs=tuple((r.num_blocks, r.max_batch_tokens, r.peak_bytes, "ok" if r.ok else (r.error or "failed"))
                       for r in self.runs),
        )

    def _nothing_fits(self, tokens: int, run: _Run) -> NothingFitsError:
        geo = self.geometry
        need = ""
        if geo is not None:
            sectors = self._min_sectors(tokens)
            need = (f"; a cache for the longest request ({geo.blocks(sectors)} blocks of {self.base_config.page_size} "
                    f"tokens) with {tokens} batch tokens needs {format_bytes(geo.footprint(tokens, sectors))} by "
                    "transformers' own account, beside what the run itself takes")
        what = f"the last run ran out of memory ({run.error})" if not run.ok else \
            f"the last run grew {format_bytes(run.peak_bytes)}"
        fix = "lower max_batch_tokens, or " if self.fixed_tokens else ""
        return NothingFitsError(
            f"continuous batching does not fit: the limit leaves {format_bytes(self.limit)} "
            f"({self.gauge.kind} headroom {format_bytes(self.headroom)}) and {what} at {tokens} batch "
            f"tokens{need}. To run it, {fix}shorten the requests, or give the process more memory",
            batch_size=tokens, peak_bytes=run.peak_bytes or None, limit_bytes=self.limit,
            capacity_bytes=self.baseline + self.headroom,
        )

    # -- real runs

    def _config(self, blocks: int, tokens: int) -> Any:
        cfg = copy.deepcopy(self.base_config)
        cfg.num_blocks = blocks
        cfg.max_batch_tokens = tokens
        if cfg.max_requests_per_batch is None:
            # fixed here, not from the job's request count: the logits rows it reserves are part of the footprint
            cfg.max_requests_per_batch = min(1024, tokens)
        # num_blocks sets the cache; transformers then only checks the footprint against this share of the
        # free memory it sees (on CPU the host's RAM), which the limit measured here has already bounded
        cfg.max_memory_percent = 1.0
        return cfg

    def _run(self, blocks: int, tokens: int, prompts: list[list[int]]) -> _Run:
        """One real ``generate_batch``-like run; its peak over the baseline, or its OOM."""
        gen = copy.deepcopy(self.gen)
        gen.max_new_tokens = new = _RUN_NEW_TOKENS
        gen.eos_token_id = -1  # no request may end early: the cache is to fill
        cfg = self._config(blocks, tokens)
        free_memory(self.gauge.device, generation=1)
        sampler = _PeakSampler(self.gauge)
        began = time.perf_counter()
        error: str | None = None
        clock = [0.0]
        with _quiet(), _kept_rng(self.gauge.device), sampler:
            try:
                error = self._generate(cfg, gen, prompts, new, sampler, clock)
            except Exception as exc:
                if not (is_oom(exc) or _no_thread(exc)):
                    raise
                error = _short(exc)
        peak = sampler.peak() - self.baseline
        run = _Run(num_blocks=blocks, max_batch_tokens=tokens, ok=error is None, peak_bytes=peak, error=error,
                   seconds=time.perf_counter() - began, generating=clock[0])
        self.runs.append(run)
        logger.debug("continuous batching run at %d blocks, %d batch tokens: %s, +%s in %.2f s (footprint %s)", blocks,
                     tokens, "ok" if run.ok else error, format_bytes(peak), run.seconds,
                     format_bytes(self.geometry.footprint(tokens, self.geometry.sectors(blocks))) if self.geometry else "?")
        return run

    def _generate(self, cfg: Any, gen: Any, prompts: list[list[int]], new: int, sampler: _PeakSampler,
                  clock: list[float]) -> str | None:
        """``generate_batch``'s loop, with the cache's geometry read while it exists. The first error, or None."""
        with self.model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cfg, block=True, timeout=60) as manager:
            if self.geometry is None:
                self.geometry = _geometry(manager, self.model)
            sampler.sample()
            began = time.perf_counter()
            ids = manager.add_requests(inputs=prompts, max_new_tokens=new)
            done: dict[str, Any] = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=_SAMPLE_SECONDS)
                sampler.sample()
                if result is not None:
                    if result.is_finished():
                        done[result.request_id] = result
                elif not manager.is_running():
                    break
            clock[0] = time.perf_counter() - began
        errors = [r.error for r in done.values() if r.error]
        if errors:
            if not is_oom(RuntimeError(errors[0])):
                raise RuntimeError(f"generate_batch failed while sizing its cache: {errors[0]}")
            return _short(errors[0])
        if len(done) < len(ids):
            return "the generation thread stopped before every request finished"
        return None


def _geometry(manager: Any, model: nn.Module) -> _Geometry:
    """The cache's units and transformers' footprint function, from a running manager's cache."""
    try:
        from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

        cache = manager.batch_processor.cache
        allocators = cache.cache_allocators
        supports = getattr(model, "_supports_logits_to_keep", None)
        handler = PagedAttentionMemoryHandler(
            config=model.config.get_text_config(), cb_config=manager.continuous_batching_config, dtype=cache.dtype,
            bytes_per_sector=cache.bytes_per_sector, tokens_per_sector=cache.tokens_per_sector,
            bytes_per_block=sum(ca.bytes_per_block for ca in allocators.values()), attn_types=list(allocators),
            model_supports_logits_to_keep=callable(supports) and supports(), kv_tp_size=1,
        )
        geo = _Geometry(
            bytes_per_sector=int(cache.bytes_per_sector), tokens_per_sector=int(cache.tokens_per_sector),
            bytes_per_block=int(sum(ca.bytes_per_block for ca in allocators.values())),
            page_size=int(manager.continuous_batching_config.page_size),
            masks=handler.num_attention_masks > 0,
            footprint=lambda m, s: int(handler.compute_memory_footprint(m, s)),
        )
        geo.footprint(64, 2)
        return geo
    except (AttributeError, ImportError, TypeError) as exc:
        raise RuntimeError(
            f"transformers {_transformers_version()}'s continuous batching does not size its cache as this "
            f"integration reads it (PagedAttentionMemoryHandler over cache sectors, transformers 5.2x): {exc!r}"
        ) from exc


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _no_thread(exc: BaseException) -> bool:
    """The generation thread could not start: its stack did not fit (a limit on the address space)."""
    return isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)


def _short(error: Any) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


@contextlib.contextmanager
def _quiet():
    """transformers logs each failed request at ERROR with its traceback: a run that runs out is expected here."""
    cb_logger = logging.getLogger(_CB_LOGGER)
    level = cb_logger.level
    cb_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        cb_logger.setLevel(level)


@contextlib.contextmanager
def _kept_rng(device: torch.device):
    """generate_batch seeds torch's generator from it: leave the caller's exactly as it was."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=True):
        yield


class _PeakSampler:
    """The largest figure of a gauge during a block.

    A device's gauge keeps its own peak. On a host the kernel keeps a resettable high-water mark
    of the resident set only, and not of the figure an address-space limit or a cgroup counts: the
    peak is the larger of that figure sampled by :meth:`sample` (what lives long: the cache, its
    masks, a thread's malloc arena and stack, mapped whether touched or not) and its start plus the
    resident growth (what lives briefly is written, so resident). The caller's own thread samples:
    a thread of its own would get a malloc arena of its own, 64 MiB of address space. The kernel's
    ``VmPeak`` is not used: glibc maps twice an arena's 64 MiB for a moment to align a new one, and
    under a limit that would refuse that it maps what it needs instead.
    """

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._max = 0
        self._resident = ResidentPeak() if gauge.host else None
        self._start = (0, 0)

    def __enter__(self) -> _PeakSampler:
        self.gauge.reset()
        self._max = self.gauge.current()
        if self._resident is not None:
            self._resident.reset()
            self._start = (self._max, resident_bytes())
        return self

    def sample(self) -> None:
        if self._resident is not None:
            self._max = max(self._max, self.gauge.current())

    def __exit__(self, *exc: Any) -> None:
        self.gauge.synchronize()
        if self._resident is not None:
            figure, rss = self._start
            grown = figure + max(0, self._resident.peak() - rss)
            self._max = max(self._max, grown, self.gauge.current())
            self._resident.close()
        else:
            self._max = max(self._max, self.gauge.peak(), self.gauge.current())

    def peak(self) -> int:
        return self._max
