"""A tiny Llama built from a config and a word-level tokenizer built locally: no download, no weights file.

The model is ``transformers``' own ``LlamaForCausalLM`` (random weights, float32) and the tokenizer
a ``tokenizers`` ``WordLevel`` model over the words ``w0 ... w{n-1}`` wrapped in
``PreTrainedTokenizerFast``: one token per word, so a text's length in tokens is its number of words.
:func:`texts` draws long-tailed lengths (most short, a few near the context), the shape of
evaluation requests that a single batch size serves badly.
"""

from __future__ import annotations

import random
from typing import Any

import torch

#: the special tokens, first in the vocabulary
SPECIALS = ("<unk>", "<pad>", "<s>", "</s>")


def tokenizer(words: int = 96) -> Any:
    """A word-level ``PreTrainedTokenizerFast``: ``<unk>``, ``<pad>``, ``<s>``, ``</s>``, then ``w0 ...``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *(f"w{i}" for i in range(words))))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", model_max_length=1 << 30)


def model(*, context: int = 128, layers: int = 2, hidden: int = 32, words: int = 96, seed: int = 0,
          attn: str = "sdpa") -> Any:
    """A ``LlamaForCausalLM`` of ``layers`` layers and ``context`` positions, in eval mode, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(SPECIALS) + words, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=context, pad_token_id=1, bos_token_id=2, eos_token_id=3,
        tie_word_embeddings=False, attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def lengths(n: int, *, context: int, median: int = 12, long: int = 0, seed: int = 0) -> list[int]:
    """``n`` long-tailed lengths in ``[1, context]``: log-normal around ``median``, and ``long`` near ``context``."""
    rng = random.Random(seed)
    out = [max(1, min(context, round(rng.lognormvariate(0, 0.6) * median))) for _ in range(n - long)]
    out += [rng.randint(int(0.8 * context), context) for _ in range(long)]
    rng.shuffle(out)
    return out


def texts(word_counts: list[int], *, words: int = 96, seed: int = 0) -> list[str]:
    """One text of random words per count (``w17 w3 ...``)."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(words)}" for _ in range(k)) for k in word_counts]


def loglikelihood_requests(n: int, *, context: int, long: int = 2, seed: int = 0) -> list[Any]:
    """lm-eval ``loglikelihood`` instances: long-tailed contexts (``long`` past ``context``, which HFLM
    truncates), an empty context, two one-word continuations of one context (HFLM's ``logits_cache``)."""
    from lm_eval.api.instance import Instance

    ctx = texts(lengths(n, context=context, median=12, long=long, seed=seed), seed=seed)
    ctx[:long] = texts([context + 5 * (k + 1) for k in range(long)], seed=seed + 1)
    cont = texts([1 + k % 3 for k in range(n)], seed=seed + 2)
    pairs = [(c, " " + d) for c, d in zip(ctx, cont)]
    pairs += [("", "w1 w2"), (ctx[-1], " w5"), (ctx[-1], " w9")]
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def rolling_requests(word_counts: list[int], *, seed: int = 3) -> list[Any]:
    """lm-eval ``loglikelihood_rolling`` instances, one document per count (longer than the context: several windows)."""
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts(word_counts, seed=seed))]


def generate_requests(n: int, *, context: int, gen_kwargs: dict, seed: int = 4) -> list[Any]:
    """lm-eval ``generate_until`` instances with long-tailed prompts."""
    from lm_eval.api.instance import Instance

    prompts = texts(lengths(n, context=context, median=10, long=1, seed=seed), seed=seed)
    return [Instance("generate_until", {}, (p, dict(gen_kwargs)), i) for i, p in enumerate(prompts)]
