"""A fresh process under RLIMIT_AS sizes generate() on the host's real figure: does the fit make a model?

Prints one JSON line: whether glibc's mmap threshold ended up fixed, each trial's shape and outcome,
and whether the decoding steps' figures made a memory model (``model``) or
:class:`GenerationFitError` refused them (``refused``). The workload is the lm-eval benchmark's
long band (10 prompts of 565-917 tokens, 48 new tokens) on its 4-layer Llama.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tiny_llama  # noqa: E402
from batchpilot.infer.genmemory import GenerationFitError, fit_generation_memory  # noqa: E402
from batchpilot.memory.host import address_space_bytes, malloc_threshold_pinned  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_llama.model(context=1024, layers=4, hidden=64, words=1000)
    with torch.no_grad():  # lazy initialisation before the cap, as a job that has run its model once
        model(torch.ones(1, 8, dtype=torch.long))
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False, pad_token_id=1)
    cap = address_space_bytes() + 176 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out: dict = {}
    try:
        memory = fit_generation_memory(model, prompt_lengths=[918, 700, 565], max_new_tokens=48, pad_token_id=1)
        out["model"] = {"per_token": memory.per_token_bytes, "per_step": memory.per_step_bytes}
        trials = memory.trials
    except GenerationFitError as exc:
        out["refused"] = str(exc)
        trials = exc.trials
    out["pinned"] = malloc_threshold_pinned()
    out["trials"] = [(t.batch_size, t.prompt_length, t.outcome) for t in trials]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
