"""transformers' continuous batching under a real RLIMIT_AS, sized by transformers and by batchpilot (fresh process).

    python continuous_rlimit.py HEADROOM_MIB          # defaults, then batchpilot's config, then a reference
    python continuous_rlimit.py HEADROOM_MIB nothing  # a room too small for any cache: the error it raises

Builds a tiny Llama from a config (random weights, float32), caps the soft ``RLIMIT_AS`` at what is
mapped + HEADROOM_MIB and only then imports batchpilot's integration (as in a process its user capped
before calling it: the import is paid out of the room), runs ``generate_batch`` with transformers'
defaults, sizes a config with :func:`batchpilot.integrations.transformers.size_continuous_batching`
and runs ``generate_batch`` with it; lifts the cap and runs the same requests with a generous
hand-made config for reference. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rlimit import vm_bytes  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

headroom = int(sys.argv[1]) * 2**20
torch.manual_seed(0)
# a wide initialisation spreads the logits, so that greedy choices are far from ties
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                     attn_implementation="sdpa")
model = LlamaForCausalLM(config).eval()
g = torch.Generator().manual_seed(1)
lengths = [int(n) for n in torch.randint(4, 60, (22,), generator=g)] + [300, 420]
prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in lengths]
gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)


def generate(cfg: ContinuousBatchingConfig | None) -> tuple[list[list[int]] | None, str | None]:
    try:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
    except Exception as exc:  # transformers' sizing fails in the caller's thread
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    results = list(out.values())
    errors = [r.error for r in results if r.error]
    if errors or len(results) != len(prompts):
        return None, (errors[0] if errors else f"{len(results)} of {len(prompts)} results")[:200]
    return [list(r.generated_tokens) for r in results], None


cap = vm_bytes() + headroom
resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
before = vm_bytes()
from batchpilot.integrations.transformers import size_continuous_batching  # noqa: E402  (under the cap)
import_bytes = vm_bytes() - before
if sys.argv[2:] == ["nothing"]:
    from batchpilot.policy.search import NothingFitsError

    try:
        small = size_continuous_batching(model, gen)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                          "nothing_fits": isinstance(exc, NothingFitsError)}))
    else:
        print(json.dumps({"error": None, "runs": small.runs, "limit": small.limit_bytes}))
    sys.exit(0)
before = vm_bytes()
_, defaults_error = generate(None)
defaults_left = vm_bytes() - before  # its worker thread's malloc arena, transformers' modules, ...
plan = size_continuous_batching(model, gen)
sized, sized_error = generate(plan.config)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.getrlimit(resource.RLIMIT_AS)[1]))
reference, reference_error = generate(ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512))
print(json.dumps({
    "defaults_error": defaults_error, "sized_error": sized_error, "reference_error": reference_error,
    "identical": sized is not None and sized == reference, "headroom": headroom,
    "plan_headroom": plan.headroom_bytes, "memory": plan.memory,
    "num_blocks": plan.num_blocks, "max_batch_tokens": plan.max_batch_tokens, "cache_bytes": plan.cache_bytes,
    "predicted": plan.predicted_bytes, "measured": plan.measured_bytes, "limit": plan.limit_bytes,
    "runs": plan.runs, "seconds": plan.seconds, "import_bytes": import_bytes, "defaults_left_bytes": defaults_left,
}))
