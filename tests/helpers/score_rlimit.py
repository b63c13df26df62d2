"""BatchpilotLM's loglikelihood under a real RLIMIT_AS, in a plain fresh process (issue #26's workload).

    python score_rlimit.py HEADROOM_MIB

Builds the side-by-side benchmark's model (a 4-layer Llama from a config, context 1024, 1000
words, random weights) and 360 long-tailed ``loglikelihood`` requests (median 43 tokens, 20 over
800), warms up with one tiny forward, caps the address space at what is mapped + HEADROOM_MIB and
scores every request with ``BatchpilotLM`` told nothing about the cap. Prints one JSON line: the
results, every ``run_batch`` call (size, padded length, trial, OOM), the fitted lengths, the
forward calls and the widest ``logits_to_keep`` any asked for.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tiny_llama  # noqa: E402
from rlimit import cap_address_space  # noqa: E402

CONTEXT, WORDS = 1024, 1000


def requests() -> list:
    from lm_eval.api.instance import Instance

    counts = tiny_llama.lengths(360, context=CONTEXT - 4, median=43, long=20, seed=1)
    ctx = tiny_llama.texts(counts, words=WORDS, seed=1)
    cont = tiny_llama.texts([1 + k % 3 for k in range(len(counts))], words=WORDS, seed=2)
    return [Instance("loglikelihood", {}, (c, " " + d), i) for i, (c, d) in enumerate(zip(ctx, cont))]


def model():
    return tiny_llama.model(context=CONTEXT, layers=4, hidden=64, words=WORDS)


def main() -> None:
    # settings of this process alone: the test imports the module for model() and requests()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from batchpilot.integrations.lm_eval import BatchpilotLM

    headroom = int(sys.argv[1]) * 2**20
    net, tok = model(), tiny_llama.tokenizer(words=WORDS)
    asks = requests()
    lm = BatchpilotLM(pretrained=net, tokenizer=tok)
    calls: list[int | None] = []
    forward = lm._model_call

    def counted(*args, **kwargs):
        calls.append(kwargs.get("logits_to_keep"))
        return forward(*args, **kwargs)

    lm._model_call = counted
    with torch.no_grad():
        net(torch.ones(1, 8, dtype=torch.long))
    cap_address_space(headroom)
    out = lm.loglikelihood(asks, disable_tqdm=True)
    print(json.dumps({
        "results": out,
        "batches": [[b.size, b.length, b.trial, b.oom] for b in lm.scorer.batches],
        "fitted": sorted(lm.scorer.plan.length_plans),
        "lengths": sorted(len(lm._row(c, d)) for c, d in (lm._encode_pair(*a.args) for a in asks)),
        "forward_calls": len(calls),
        "widest_kept": max((k for k in calls if k is not None), default=None),
    }))


if __name__ == "__main__":
    main()
