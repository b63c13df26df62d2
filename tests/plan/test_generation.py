"""The planner for generate() (batchpilot.plan.generation): fake prefill and last decoding step against real peaks."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[integrations]'")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from batchpilot.memory.probes import track_peak  # noqa: E402
from batchpilot.plan.generation import estimate_generation_memory, plan_generation  # noqa: E402
from batchpilot.plan.result import PlanningError  # noqa: E402

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa")


@pytest.fixture(autouse=True)
def _quiet():
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def generate_peak(model: nn.Module, b: int, prompt: int, new: int) -> int:
    """The tracker's peak over a real greedy ``generate`` of ``new`` tokens for ``b`` prompts of ``prompt`` tokens."""
    ids = torch.randint(1, CONFIG["vocab_size"], (b, prompt), generator=torch.Generator().manual_seed(b))
    mask = torch.ones(b, prompt, dtype=torch.long)
    with track_peak("cpu", track=(model, ids, mask)) as m:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
    return m.peak_bytes


@pytest.mark.parametrize("b, prompt, new, phase", [
    (16, 200, 100, "prefill"),  # a long prompt: its forward peaks
    (2, 400, 100, "prefill"),
    (32, 16, 200, "decode"),    # many new tokens: the last step over the grown cache peaks
    (64, 8, 64, "decode"),
])
def test_the_estimate_is_within_a_few_percent_of_a_real_generate(model, b, prompt, new, phase):
    est = estimate_generation_memory(model, b, prompt, new)
    real = generate_peak(model, b, prompt, new)
    assert est.limited_by == phase
    assert abs(est.peak_bytes - real) <= 0.03 * real, (est.peak_bytes, real)
    assert est.cache_bytes == 2 * 2 * b * 2 * (prompt + new) * 16 * 4  # K and V, 2 layers, 2 heads of 16, fp32
    assert est.decode.peak_bytes > est.cache_bytes  # the last step holds the whole cache


def test_the_table_sits_on_the_boundary_of_both_phases(model):
    capacity = 8 * 2**20
    plan = plan_generation(model, prompt_lengths=[32, 256], new_tokens=[16, 128], capacity=capacity)
    assert set(plan.table) == {(32, 16), (32, 128), (256, 16), (256, 128)}
    limit = int(0.8 * capacity)
    for (p, n), b in plan.table.items():
        assert b >= 1
        assert estimate_generation_memory(model, b, p, n).required_bytes <= limit
        assert estimate_generation_memory(model, b + 1, p, n).required_bytes > limit
    # longer prompts or more new tokens never allow a larger batch
    assert plan.table[(32, 16)] >= plan.table[(32, 128)] and plan.table[(32, 16)] >= plan.table[(256, 16)]
    assert {r["limited_by"] for r in plan.rows()} == {"prefill", "decode"}
    assert plan.limiting.batch_size == min(plan.table.values())


def test_a_named_gpu_plans_a_meta_model_too_large_to_build():
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    with torch.device("meta"):
        big = LlamaForCausalLM(cfg).to(torch.bfloat16)
    plan = plan_generation(big, prompt_lengths=[512, 2048], new_tokens=[512], capacity="H100-80GB")
    assert all(p.device == "cuda" and p.gpu == "H100-80GB" for p in (*plan.prefill.values(), *plan.decode.values()))
    assert plan.table[(512, 512)] > plan.table[(2048, 512)] > 0


def test_bad_lengths_and_models_are_refused(model):
    with pytest.raises(ValueError, match="past the model's context of 512"):
        estimate_generation_memory(model, 1, 500, 13)
    with pytest.raises(ValueError, match="at least one prompt length"):
        plan_generation(model, prompt_lengths=[], new_tokens=[4], capacity="1GiB")
    with pytest.raises(ValueError, match="new_tokens must be a positive int"):
        plan_generation(model, prompt_lengths=[8], new_tokens=[0], capacity="1GiB")
    with pytest.raises(PlanningError, match="Hugging Face causal LM"):
        estimate_generation_memory(nn.Linear(4, 4), 1, 8, 8)
