"""Per-step time of batchpilot's FSDP2 step against a plain FSDP2 accumulation loop, as ratios.

    python benchmarks/fsdp_overhead.py            # launches itself under torchrun, 2 ranks, gloo
    python benchmarks/fsdp_overhead.py --quick    # two cases, 3 steps (a smoke run)
    torchrun --standalone --nproc-per-node=2 benchmarks/fsdp_overhead.py --steps 30 --json

Every variant trains its own copy of the same model, sharded the same way (``fully_shard`` on
each block, then the root), at the same micro-batch and accumulation:

* ``plain``: the usual FSDP2 loop: ``set_requires_gradient_sync(False)`` on all but the last
  micro-batch, whose backward reduce-scatters; the optimizer step on the shards.
* ``batchpilot``: ``Engine(micro_batch_size=micro)`` with :class:`batchpilot.dist.fsdp.FSDPCoordinator`
  (chosen by itself): the same loop plus one all-reduce before the step (every rank brought a
  batch of the same size) and one after the attempt (did any rank run out of memory?), and the
  collective counting that makes a replay possible.
* ``auto``: the same engine with ``micro_batch_size="auto"`` started at ``micro``, which also
  measures each step's peak, agrees on the next micro-batch and trims the heap per step.

Variants take turns step by step (the order rotated) so that drift on a shared machine hits
all of them alike; each figure is the median step, the slower rank's. Times on a busy 2-core
CPU are noisy: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from batchpilot.app.models import MLP, TinyGPT, lm_loss, padded_lm_batch
from batchpilot.core.sharding import shard_model
from batchpilot.dist import distributed as bd
from batchpilot.train.engine import Engine, EngineConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun import finish, launch_under_torchrun, median_step_seconds, slowest_rank_ms  # noqa: E402

VARIANTS = ("plain", "batchpilot", "auto")


def _build(kind: str, size: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(in_features=256, width=size, depth=depth)
    return TinyGPT(vocab=512, dim=size, heads=4, layers=depth, max_len=64)


def _batch(kind: str, n: int) -> object:
    g = torch.Generator().manual_seed(bd.rank())
    if kind == "mlp":
        return torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
    return padded_lm_batch([64] * n, vocab=512, generator=g)


def _loss(kind: str) -> Callable:
    if kind == "mlp":
        return lambda model, b: F.cross_entropy(model(b[0]), b[1])
    return lm_loss


def _micro_batches(batch: object, micro: int) -> list:
    if isinstance(batch, dict):
        n = batch["input_ids"].shape[0]
        return [{k: v[i:i + micro] for k, v in batch.items()} for i in range(0, n, micro)]
    return list(zip(batch[0].split(micro), batch[1].split(micro)))


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable, micro_batches: list) -> None:
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == last)
        out = loss_fn(model, mb)
        loss = out[0] / out[1] if isinstance(out, tuple) else out
        (loss / len(micro_batches)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _make_variants(kind: str, size: int, depth: int, per_rank: int, micro: int) -> dict[str, Callable[[object], None]]:
    base = _build(kind, size, depth)
    loss_fn = _loss(kind)
    steps: dict[str, Callable[[object], None]] = {}
    for name in VARIANTS:
        model = shard_model(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "plain":
            steps[name] = lambda b, m=model, o=opt: _plain_step(m, o, loss_fn, _micro_batches(b, micro))
        else:
            fixed = name == "batchpilot"
            engine = Engine(model, opt, loss_fn, global_batch_size=per_rank * bd.world_size(),
                            micro_batch_size=micro if fixed else "auto", start=None if fixed else micro,
                            config=EngineConfig(adapt=False))
            steps[name] = engine.step
    return steps


def measure(kind: str, size: int, depth: int, per_rank: int, micro: int, steps: int) -> dict:
    variants = _make_variants(kind, size, depth, per_rank, micro)
    batch = _batch(kind, per_rank)
    local = median_step_seconds(variants, batch, steps)
    ms = slowest_rank_ms(local)
    params = sum(p.numel() for p in _build(kind, size, depth).parameters())
    label = f"MLP {depth}x{size}" if kind == "mlp" else f"GPT {depth}x{size}"
    return {
        "model": label, "params": params, "micro": micro, "accum": per_rank // micro, "ranks": bd.world_size(),
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "ratio": {k: round(ms[k] / ms["plain"], 3) for k in VARIANTS if k != "plain"},
    }


CASES = [  # kind, width, depth, per-rank batch, micro
    ("mlp", 1024, 4, 64, 64),
    ("mlp", 1024, 4, 256, 64),
    ("mlp", 2048, 4, 128, 32),
    ("gpt", 128, 4, 16, 4),
]


def _table(rows: list[dict]) -> str:
    head = (f"{'model':<14}{'params':>10}{'micro×accum':>13}{'plain ms':>10}{'batchpilot':>12}{'ratio':>7}"
            f"{'auto':>9}{'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms, ratio = r["ms"], r["ratio"]
        lines.append(
            f"{r['model']:<14}{r['params'] / 1e6:>9.2f}M{str(r['micro']) + '×' + str(r['accum']):>13}"
            f"{ms['plain']:>10.2f}{ms['batchpilot']:>12.2f}{ratio['batchpilot']:>7.3f}"
            f"{ms['auto']:>9.2f}{ratio['auto']:>7.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    parser.add_argument("--quick", action="store_true", help="the first two cases, 3 steps (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--nproc", type=int, default=2, help="ranks when launching itself")
    args = parser.parse_args()
    launch_under_torchrun(__file__, args.nproc)
    torch.set_num_threads(1)
    bd.init_distributed(backend="gloo")
    cases = CASES[:2] if args.quick else CASES
    steps = 3 if args.quick else args.steps
    rows = [measure(*case, steps=steps) for case in cases]
    if bd.rank() == 0:
        if args.json:
            print(json.dumps({"backend": "gloo", "device": "cpu", "rows": rows}, indent=2))
        else:
            print(f"ranks {bd.world_size()}, gloo on CPU, FSDP2 (fully_shard per block, then the root), "
                  f"{steps} steps per variant, median step (slower rank)")
            print("ratio = time / the plain FSDP2 accumulation loop's time at the same micro-batch")
            print(_table(rows))
    finish()


if __name__ == "__main__":
    main()
