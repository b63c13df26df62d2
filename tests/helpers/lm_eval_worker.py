"""torchrun worker for tests/integrations/test_lm_eval.py: BatchpilotLM on two ranks with different requests.

    python -m torch.distributed.run --standalone --nproc-per-node=2 lm_eval_worker.py OUT

HFLM treats a ``transformers`` model object as one process, and on a CPU it never goes data-parallel
(its Accelerator path counts GPUs), so each rank here sets the rank and world size that HFLM reads
under ``accelerate launch`` on GPUs; everything else is lm-eval's and batchpilot's own. Rank 0 holds
many requests, the longest ones included, on an emulated device twice the size of rank 1's; rank 1
holds a few short ones, and none at all for the second call; for ``generate_until`` rank 0 holds two
``gen_kwargs`` groups, rank 1 a few short prompts of the first only. Each rank writes
``rank{r}.json``: its results, HFLM's at batch size 1 on the same requests, and the batches it ran.
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
    # generate_until: two gen_kwargs groups on rank 0 (its longest prompts in the first), rank 1 has
    # a few short prompts in the first group only
    greedy = {"until": ["w7"], "max_gen_toks": 12, "do_sample": False}
    asks = tiny_llama.generate_requests(80 if rank == 0 else 4, context=CONTEXT - 16, gen_kwargs=greedy, seed=rank)
    if rank == 0:
        asks += tiny_llama.generate_requests(5, context=CONTEXT - 16, gen_kwargs={**greedy, "max_gen_toks": 6}, seed=9)
    generated = lm.generate_until(asks, disable_tqdm=True)
    gen_batches = [list(b) for g in lm.generations for b in g.batches]
    theirs: list = [None, None]
    dist.all_gather_object(theirs, gen_batches)
    # rank 1's own model asked at the shapes rank 0 ran: what the agreement had to respect
    from batchpilot.infer.genmemory import UnverifiedShapeError

    def own_answer(length: int, new: int):
        memory = lm.generations[0].memory if lm.generations else None
        if memory is None:
            return None
        try:
            return memory.max_batch(length, new)
        except UnverifiedShapeError:
            return None

    # [batch rank 0 ran, length, new tokens, this rank's own model's answer there]
    answers = [[b, L, N, own_answer(L, N)] for b, L, N in theirs[0]]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "got": got, "want": want, "batches": batches, "first_budget": first_budget,
        "generated": generated, "generated_want": ref.generate_until(asks, disable_tqdm=True),
        "gen_batches": gen_batches, "groups": len(lm.generations), "answers_at_rank0_batches": answers}))
    dist.barrier()
    dist.destroy_process_group()
    print("done", rank)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
