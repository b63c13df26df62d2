"""The planner for ``generate``: the largest batch per (prompt length, new tokens), for a device you don't have.

A causal LM's ``generate`` (Hugging Face style: a ``DynamicCache`` grown by one token a step) peaks
either in the prefill, the forward over the prompt at length P that makes the cache, or in the
last decoding step, one token's forward over a cache of P + N - 1 tokens that it grows to P + N
(every step before it holds less). Both run on fake tensors through the planner
(:func:`batchpilot.plan.planner.plan_batch_size`, the same storage counting and CUDA accounting),
each at its own exact boundary; the answer for (P, N) is the smaller of the prefill's at P and the
decoding step's at P + N. The model is copied onto fake tensors and never touched.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._checks import positive_int
from ..core.model import context_length
from ..policy.search import DEFAULT_TARGET
from .planner import estimate_peak_memory, plan_batch_size
from .result import MemoryEstimate, PlanningError, PlanResult

__all__ = ["GenerationEstimate", "GenerationPlanResult", "estimate_generation_memory", "plan_generation"]


@dataclass(frozen=True, kw_only=True)
class GenerationEstimate:
    """The peak of ``generate`` at one batch, prompt length and number of new tokens.

    Attributes:
        prefill: the prompt's forward, its cache made.
        decode: the last decoding step, over a cache of ``prompt_length + new_tokens - 1`` tokens.
        cache_bytes: the KV cache at ``prompt_length + new_tokens`` tokens.
    """

    batch_size: int
    prompt_length: int
    new_tokens: int
    prefill: MemoryEstimate
    decode: MemoryEstimate
    cache_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.prefill.peak_bytes, self.decode.peak_bytes)

    @property
    def required_bytes(self) -> int:
        """What the device must hold: the larger phase's (reserved + context on CUDA)."""
        return max(self.prefill.required_bytes, self.decode.required_bytes)

    @property
    def limited_by(self) -> str:
        return "prefill" if self.prefill.required_bytes >= self.decode.required_bytes else "decode"


@dataclass(frozen=True, kw_only=True)
class GenerationPlanResult:
    """The largest ``generate`` batch per (prompt length, new tokens).

    Attributes:
        table: ``{(prompt_length, new_tokens): batch size}`` (0 when not even one fits).
        prefill: the planner's search of the prefill, per prompt length.
        decode: the planner's search of the last decoding step, per total length ``P + N``.
        seconds: wall time of all of it.
    """

    table: dict[tuple[int, int], int]
    prefill: dict[int, PlanResult] = field(default_factory=dict)
    decode: dict[int, PlanResult] = field(default_factory=dict)
    seconds: float = 0.0

    def limited_by(self, prompt_length: int, new_tokens: int) -> str:
        """``"prefill"`` or ``"decode"``: the phase that sets the batch at (P, N)."""
        pre, dec = self.prefill[prompt_length].batch_size, self.decode[prompt_length + new_tokens].batch_size
        return "prefill" if pre <= dec else "decode"

    @property
    def limiting(self) -> PlanResult:
        """The phase's plan that sets the smallest batch of the table (the one size that fits every row)."""
        p, n = min(self.table, key=lambda k: (self.table[k], -k[0] - k[1]))
        return self.prefill[p] if self.limited_by(p, n) == "prefill" else self.decode[p + n]

    def rows(self) -> list[dict[str, Any]]:
        return [{"prompt_length": p, "new_tokens": n, "batch_size": b, "limited_by": self.limited_by(p, n),
                 "prefill_batch_size": self.prefill[p].batch_size, "decode_batch_size": self.decode[p + n].batch_size}
                for (p, n), b in sorted(self.table.items())]

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_lengths": sorted(self.prefill), "new_tokens": sorted({n for _, n in self.table}),
                "rows": self.rows(), "seconds": self.seconds}


# ---------------------------------------------------------------------------
# The two phases, as steps the planner runs on fake tensors


def _params(model: nn.Module) -> Any:
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def _cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The cache under the name the model's forward takes (``cache`` from transformers 5.25, ``past_key_values``)."""
    return {"cache" if "cache" in _params(model) else "past_key_values": cache}


def _cache_out(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _forward_kwargs(model: nn.Module, mask: torch.Tensor, query: int) -> dict[str, Any]:
    """What ``generate`` passes besides the tokens: the last position's logits only (``logits_to_keep=1``),
    and position ids counted from the attention mask (``cumsum - 1``, as it makes them for every batch)."""
    params = _params(model)
    out: dict[str, Any] = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    if "position_ids" in params:
        positions = mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(mask == 0, 1)
        out["position_ids"] = positions[:, -query:]
    return out


def _next_token(out: Any) -> torch.Tensor:
    # generate copies the last position's logits to float32 before choosing
    return out.logits[:, -1, :].to(dtype=torch.float32, copy=True).argmax(-1)


@torch.no_grad()
def _prefill_step(model: nn.Module, optimizer: Any, batch: dict[str, torch.Tensor]) -> None:
    # The mask is held, as generate holds it, but not passed: a mask of ones lets the real
    # attention skip building a [b, 1, P, P] mask, which fake tensors cannot see (a data check)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    out = model(input_ids=ids, use_cache=True, **_forward_kwargs(model, mask, ids.shape[1]))
    batch["next"] = _next_token(out)
    batch["cache"] = _cache_out(out)  # kept: the decoding steps read it


@torch.no_grad()
def _decode_step(model: nn.Module, optimizer: Any, batch: dict[str, Any]) -> None:
    ids, mask = batch.pop("input_ids"), batch.pop("attention_mask")
    cache = _cache_of(model, ids.shape[0], ids.shape[1])
    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
    out = model(input_ids=ids[:, -1:], use_cache=True, **_cache_kwargs(model, cache), **_forward_kwargs(model, mask, 1))
    nxt = _next_token(out)
    batch.pop("previous_logits")  # the step before's, which generate's loop holds until this step's replace them
    ids = torch.cat([ids, nxt[:, None]], dim=-1)
    batch["input_ids"], batch["attention_mask"] = ids, mask


def _text_config(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise PlanningError("planning generate needs a Hugging Face causal LM (a model with .config and a KV cache)")
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _kv_geometry(model: nn.Module) -> tuple[int, int, int, torch.dtype]:
    """``(layers, kv heads, head dim, dtype)`` of the model's KV cache."""
    cfg = _text_config(model)
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
    if not all(isinstance(v, int) and v > 0 for v in (layers, kv, head_dim)):
        raise PlanningError(f"cannot read the KV cache's shape from {type(cfg).__name__} "
                            "(num_hidden_layers, num_key_value_heads, head_dim)")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return layers, kv, head_dim, dtype


def _cache_of(model: nn.Module, batch_size: int, length: int) -> Any:
    """A ``DynamicCache`` holding ``length`` tokens per layer (a sliding layer its window), made in place.

    Each layer's keys and values are set as the tensors the decoding steps left, not copied in: a
    copy would count a second layer's worth that no real step holds.
    """
    try:
        from transformers import DynamicCache
    except ImportError as exc:
        raise PlanningError("planning generate needs transformers (its DynamicCache): pip install transformers") from exc
    layers, kv, head_dim, dtype = _kv_geometry(model)
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != layers:
        raise PlanningError(f"the model's DynamicCache has {len(cache.layers)} layers for {layers} hidden layers "
                            "(shared or skipped KV layers are not planned)")
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        held = min(length, window - 1) if isinstance(window, int) and window > 0 else length
        k = torch.empty(batch_size, kv, held, head_dim, dtype=dtype)
        v = torch.empty(batch_size, kv, held, head_dim, dtype=dtype)
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        if hasattr(layer, "cumulative_length"):  # a sliding layer counts every token it has seen
            layer.cumulative_length = length
    return cache


def _prefill_sample(prompt_length: int):
    def make(b: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(b, prompt_length, dtype=torch.long),
                "attention_mask": torch.ones(b, prompt_length, dtype=torch.long)}
    return make


def _decode_sample(total_length: int, vocab: int):
    held = total_length - 1  # the last step runs over P + N - 1 tokens and makes the last one

    def make(b: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(b, held, dtype=torch.long),
                "attention_mask": torch.ones(b, held, dtype=torch.long),
                "previous_logits": torch.empty(b, vocab, dtype=torch.float32)}
    return make


def _vocab(model: nn.Module) -> int:
    vocab = getattr(_text_config(model), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise PlanningError("cannot read the vocabulary size from the model's config (vocab_size)")
    return vocab


def _check(model: nn.Module, prompt_length: int, new_tokens: int) -> None:
    positive_int("prompt_length", prompt_length)
    positive_int("new_tokens", new_tokens)
    _text_config(model)  # a model with a config, or the error that says what planning needs
    context = context_length(model)
    if context is not None and prompt_length + new_tokens > context:
        raise ValueError(f"prompt_length {prompt_length} + new_tokens {new_tokens} = {prompt_length + new_tokens} "
                         f"positions, past the model's context of {context}")


# ---------------------------------------------------------------------------
# Public


def estimate_generation_memory(
    model: nn.Module,
    batch_size: int,
    prompt_length: int,
    new_tokens: int,
    *,
    device: Literal["cpu", "cuda"] = "cpu",
    **kwargs: Any,
) -> GenerationEstimate:
    """The peak of ``model.generate`` at ``batch_size`` prompts of ``prompt_length`` and ``new_tokens`` new tokens.

    Greedy decoding, no padding (a batch of prompts of one length). ``kwargs`` are those of
    :func:`batchpilot.plan.planner.estimate_peak_memory` (``accounting``).

    Raises:
        PlanningError: not a causal LM with a Hugging Face cache, or a step fake tensors cannot run.
        ValueError: lengths that are not positive ints, or past the model's context.
    """
    _check(model, prompt_length, new_tokens)
    layers, kv, head_dim, dtype = _kv_geometry(model)
    common = dict(step_fn=None, mode="eval", steps=1, device=device, **kwargs)
    prefill = estimate_peak_memory(model, _prefill_sample(prompt_length), batch_size,
                                   **{**common, "step_fn": _prefill_step})
    decode = estimate_peak_memory(model, _decode_sample(prompt_length + new_tokens, _vocab(model)), batch_size,
                                  **{**common, "step_fn": _decode_step})
    cache = 2 * layers * batch_size * kv * (prompt_length + new_tokens) * head_dim * dtype.itemsize
    return GenerationEstimate(batch_size=batch_size, prompt_length=prompt_length, new_tokens=new_tokens,
                              prefill=prefill, decode=decode, cache_bytes=cache)


def plan_generation(
    model: nn.Module,
    *,
    prompt_lengths: Iterable[int],
    new_tokens: Iterable[int],
    capacity: int | float | str,
    target: float = DEFAULT_TARGET,
    device: Literal["cpu", "cuda"] | None = None,
    max_batch_size: int = 1 << 20,
    **kwargs: Any,
) -> GenerationPlanResult:
    """The largest ``generate`` batch for every (prompt length, new tokens) pair, on fake tensors.

    Args:
        model: a causal LM with a Hugging Face KV cache (``transformers``), possibly on the meta
            device (a model too large for this machine plans from its shapes alone).
        prompt_lengths, new_tokens: the lengths to answer for; the table has every pair.
        capacity, target, device, max_batch_size, kwargs: as for
            :func:`batchpilot.plan.planner.plan_batch_size` (``capacity="H100-80GB"`` plans a named GPU).

    Raises:
        PlanningError: as :func:`estimate_generation_memory`.
        ValueError: no lengths, lengths that are not positive ints or past the context, and
            ``plan_batch_size``'s own.
    """
    started = time.perf_counter()
    prompts = sorted(set(prompt_lengths))
    news = sorted(set(new_tokens))
    if not prompts or not news:
        raise ValueError("give at least one prompt length and one number of new tokens")
    for p in prompts:
        for n in news:
            _check(model, p, n)
    _kv_geometry(model)
    common = dict(capacity=capacity, target=target, device=device, max_batch_size=max_batch_size, mode="eval",
                  steps=1, **kwargs)
    prefill = {p: plan_batch_size(model, _prefill_sample(p), step_fn=_prefill_step, **common) for p in prompts}
    vocab = _vocab(model)
    decode = {t: plan_batch_size(model, _decode_sample(t, vocab), step_fn=_decode_step, **common)
              for t in sorted({p + n for p in prompts for n in news})}
    table = {(p, n): min(prefill[p].batch_size, decode[p + n].batch_size) for p in prompts for n in news}
    return GenerationPlanResult(table=table, prefill=prefill, decode=decode, seconds=time.perf_counter() - started)
