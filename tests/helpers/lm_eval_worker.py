"""torchrun worker for tests/integrations/test_lm_eval.py: BatchpilotLM on two ranks with different requests.

    python -m torch.distributed.run --standalone --nproc-per-node=2 lm_eval_worker.py OUT

HFLM treats a ``transformers`` model object as one process, and on a CPU it never goes data-parallel
(its Accelerator path counts GPUs), so each rank here sets the rank and world size that HFLM reads
under ``accelerate launch`` on GPUs; everything else is lm-eval's and batchpilot's own. Rank 0 holds
many requests, the longest ones included, on an emulated device twice the size of rank 1's; rank 1
holds a few short ones, and none at all for the second call. Each rank writes ``rank{r}.json``: its
results, HFLM's at batch size 1 on the same requests, and the batches it ran.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import tiny_llama  # noqa: E402

from batchpilot.integrations.lm_eval import BatchpilotLM  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

CONTEXT = 96


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model, tok = tiny_llama.model(context=CONTEXT), tiny_llama.tokenizer()
    lm = BatchpilotLM(pretrained=model, tokenizer=tok, capacity="1MiB" if rank == 0 else "512KiB")
    lm._rank, lm._world_size = rank, 2  # what HFLM sets under accelerate launch on GPUs
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=1)
    first = tiny_llama.loglikelihood_requests(40 if rank == 0 else 6, context=CONTEXT, long=2 if rank == 0 else 0,
                                              seed=rank)
    second = tiny_llama.rolling_requests([300, 40, 7] if rank == 0 else [])
    got = [lm.loglikelihood(first, disable_tqdm=True)]
    batches = [[(b.size, b.length, b.trial, b.oom) for b in lm.scorer.batches]]
    first_budget = lm.scorer.plan.budget().state_dict()  # what this rank brought to the agreement
    got.append(lm.loglikelihood_rolling(second, disable_tqdm=True))
    batches.append([(b.size, b.length, b.trial, b.oom) for b in lm.scorer.batches])
    want = [ref.loglikelihood(first, disable_tqdm=True), ref.loglikelihood_rolling(second, disable_tqdm=True)]
    (out / f"rank{rank}.json").write_text(json.dumps({"got": got, "want": want, "batches": batches,
                                                      "first_budget": first_budget}))
    dist.barrier()
    dist.destroy_process_group()
    print("done", rank)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
