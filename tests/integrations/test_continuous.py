"""batchpilot.integrations.continuous: transformers' ``generate_batch`` with a cache sized for the limit that applies.

The real cases run in a fresh process under a real ``RLIMIT_AS`` (tests/helpers/continuous_rlimit.py),
with a tiny Llama built from a config; bad input is refused here, before any run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[integrations]'")

from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from batchpilot.integrations.transformers import continuous_batching_config, size_continuous_batching  # noqa: E402

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "continuous_rlimit.py"

pytestmark = pytest.mark.timeout(240)


def run(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(HELPER), *args], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_under_rlimit_as_the_defaults_fail_and_the_sized_config_runs_with_the_same_outputs():
    # the cap is set before batchpilot's integration is imported: its import is paid out of the room
    out = run("128")
    assert out["import_bytes"] <= 8 * 2**20, out  # batchpilot's own modules, not the Trainer stack
    # transformers sizes its cache from the host's RAM: under the cap its first allocation fails
    assert "can't allocate memory" in out["defaults_error"], out
    assert out["sized_error"] is None and out["reference_error"] is None, out
    assert out["identical"], out  # greedy outputs equal to an uncapped run's, request by request
    assert out["memory"] == "address_space", out
    # sized for the limit: 90% of what the cap left it (after the import and what the defaults' failed
    # attempt left mapped: a malloc arena for its thread, transformers' modules), and using most of that
    # (not a token cache)
    left = out["headroom"] - out["import_bytes"] - out["defaults_left_bytes"]
    assert left - 16 * 2**20 <= out["plan_headroom"] <= out["headroom"], out
    assert out["limit"] == int(0.9 * out["plan_headroom"]), out
    assert out["predicted"] <= out["limit"] and out["measured"] <= out["limit"], out
    assert out["measured"] >= 0.8 * out["limit"], out
    assert out["runs"][-1][0] == out["num_blocks"] and out["runs"][-1][-1] == "ok", out  # the answer ran last
    assert len(out["runs"]) <= 4, out


def test_a_room_too_small_for_any_cache_is_a_clear_error():
    out = run("8", "nothing")
    assert out["nothing_fits"], out
    assert "continuous batching does not fit" in out["message"] and "more memory" in out["message"], out


# ---------------------------------------------------------------------------
# Bad input, refused before any run


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).eval()


GEN = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(inputs=[]), "inputs is empty"),
    (dict(inputs=[[1, 2, 3], list(range(1, 30))]), r"inputs\[1\] has 29 tokens .* truncate the prompt to 24 tokens"),
    (dict(inputs=[[]]), r"inputs\[0\] must be a non-empty list"),
    (dict(inputs="hello"), "list of prompts"),
    (dict(target=0), "target must be a fraction"),
    (dict(target=1.5), "target must be a fraction"),
    (dict(max_batch_tokens=0), "max_batch_tokens must be a positive int"),
    (dict(config=ContinuousBatchingConfig(num_blocks=8)), "num_blocks=8 is what this sizes"),
    (dict(config={"num_blocks": 8}), "ContinuousBatchingConfig"),
    (dict(capacity="lots"), "as a memory size"),
])
def test_bad_arguments_are_refused_with_how_to_fix_them(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        size_continuous_batching(model, GEN, **kwargs)


def test_no_room_for_a_prompt_and_no_max_new_tokens_are_refused(model):
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        size_continuous_batching(model, GenerationConfig(max_new_tokens=32), inputs=[[1]])
    with pytest.raises(ValueError, match="max_new_tokens is None"):
        continuous_batching_config(model, GenerationConfig(max_new_tokens=None))


def test_a_model_without_generate_batch_is_a_type_error():
    with pytest.raises(TypeError, match="has no generate_batch"):
        continuous_batching_config(nn.Linear(2, 2), GEN)
