"""RL-shaped training under FSDP2: batches whose lengths are known only once they are generated.

    torchrun --standalone --nproc-per-node=2 examples/rl_fsdp.py
    torchrun --standalone --nproc-per-node=2 examples/rl_fsdp.py --capacity 3MiB --steps 6 --check

Each step the sharded policy samples a response to every prompt (until its end token, or
``--max-new`` tokens), the responses are scored, and one policy-gradient step trains on them. No
one knows the lengths before the rollout: the engine sizes every step by the longest of the ranks'
batches (``lengths=LengthConfig(split=True)``): each rank sorts its samples by length, cuts
micro-batches that fit at their own longest sample, and every rank runs as many micro-batches
(FSDP's collectives pair up only so). An OOM on any rank makes every rank retry the same cut.
``--check`` trains one process on the same rollouts (both ranks' samples at once) and compares
the parameters. gloo on CPU, NCCL on GPU; without torchrun it runs as one rank.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from batchpilot import Engine, EngineConfig, LengthConfig
from batchpilot.app.models import TinyGPT
from batchpilot.core.sharding import shard_model
from batchpilot.dist import distributed as bd
from batchpilot.memory.probes import emulate_capacity

VOCAB = 64
EOS = 1


def policy() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, dim=32, heads=2, layers=2, max_len=160)


def prompts(step: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randint(2, VOCAB, (n, 4), generator=g)


@torch.no_grad()
def rollout(model: nn.Module, prompt: torch.Tensor, *, max_new: int, eos_bias: float, seed: int) -> dict[str, Any]:
    """Sample a response per prompt; the batch is padded to this rank's longest prompt + response.

    Every rank decodes as many tokens (a sharded forward is a collective), until every sample on
    every rank has ended or ``max_new``; ``eos_bias`` is added to the end token's logit (a longer
    or shorter tail of lengths).
    """
    g = torch.Generator().manual_seed(seed)
    seq, done = prompt.clone(), torch.zeros(len(prompt), dtype=torch.bool)
    ends = torch.full((len(prompt),), prompt.shape[1] + max_new)
    for t in range(max_new):
        logits = model(input_ids=seq)[:, -1].float()
        logits[:, EOS] += eos_bias
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(1)
        token[done] = 0
        seq = torch.cat([seq, token[:, None]], dim=1)
        ended = ~done & (token == EOS)
        ends[ended] = seq.shape[1]
        done |= ended
        finished = torch.tensor([int(done.all())])
        if dist.is_initialized():
            dist.all_reduce(finished, op=dist.ReduceOp.MIN)
        if finished.item():
            break
    width = int(ends.max())
    seq = seq[:, :width]
    real = torch.arange(width)[None, :] < ends[:, None]
    response = real & (torch.arange(width)[None, :] >= prompt.shape[1])
    # a toy reward: the share of even tokens in the response, centred on this batch's mean
    even = ((seq % 2 == 0) & response).sum(1) / response.sum(1).clamp(min=1)
    advantage = (even - even.mean())[:, None].expand(-1, width) * response
    return {"input_ids": seq.masked_fill(~real, 0), "attention_mask": real.long(),
            "labels": seq.masked_fill(~response, -100), "advantages": advantage.float()}


def pg_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE: ``-(advantage × log p(token))`` summed over the response tokens, and their count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1]
    labels = batch["labels"][:, 1:]
    taken = labels != -100
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return -(batch["advantages"][:, 1:] * logp * taken).sum(), taken.sum()


def pad_to(batch: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100, "advantages": 0}
    return {k: nn.functional.pad(v, (0, width - v.shape[1]), value=fill[k]) for k, v in batch.items()}


def one_process(batches: list[list[dict[str, torch.Tensor]]], lr: float) -> list[torch.Tensor]:
    """One process, one plain step per step on every rank's samples at once: what the sharded run must equal."""
    model = policy()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for parts in batches:
        width = max(p["input_ids"].shape[1] for p in parts)
        whole = {k: torch.cat([pad_to(p, width)[k] for p in parts]) for k in parts[0]}
        opt.zero_grad(set_to_none=True)
        total, count = pg_loss(model, whole)
        (total / count).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--per-rank", type=int, default=16, help="prompts per rank per step")
    parser.add_argument("--max-new", type=int, default=128, help="the longest response")
    parser.add_argument("--eos-bias", type=float, default=2.0, help="added to the end token's logit")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--capacity", default=None, help="emulate a device of this size on every rank, e.g. 3MiB")
    parser.add_argument("--check", action="store_true", help="compare with one process on the same rollouts")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {bd.rank()}] %(levelname)s %(name)s: %(message)s")
    bd.init_distributed()  # the process group torchrun describes; nothing without torchrun
    torch.set_num_threads(1)
    rank, world = bd.rank(), max(1, bd.world_size())
    model = policy()
    if world > 1:
        shard_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine = Engine(model, opt, pg_loss, global_batch_size=args.per_rank * world, lengths=LengthConfig(split=True),
                    config=EngineConfig(capacity=args.capacity))
    device = emulate_capacity(args.capacity, track=(model, opt)) if args.capacity else contextlib.nullcontext()
    recorded = []
    with device:
        for step in range(args.steps):
            batch = rollout(model, prompts(step, rank, args.per_rank), max_new=args.max_new,
                            eos_bias=args.eos_bias, seed=step * 100 + rank)
            r = engine.step(batch)
            if args.check:
                recorded.append({k: v.clone() for k, v in batch.items()})
            if rank == 0:
                print(f"step {step}: length {r.length} (this rank {batch['input_ids'].shape[1]}), "
                      f"micro-batches {list(r.micro_batch_sizes)} at {list(r.micro_batch_lengths)}, "
                      f"OOMs {r.ooms}, loss {r.loss:.4f}", flush=True)
    if args.check:
        gathered: list[Any] = [recorded]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, recorded)
        params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]
        if rank == 0:
            expected = one_process([list(parts) for parts in zip(*gathered)], args.lr)
            worst = max(float(((a - b).abs() / b.abs().clamp(min=1e-6)).max()) for a, b in zip(params, expected))
            same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(params, expected))
            print(f"one process on the same rollouts: {'equal' if same else 'DIFFERENT'} "
                  f"(largest relative difference {worst:.1e})", flush=True)
            if not same:
                raise SystemExit(1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
