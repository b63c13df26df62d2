"""Per-step time of batchpilot's DDP step against plain DDP, side by side, as ratios.

    python benchmarks/ddp_overhead.py            # launches itself under torchrun, 2 ranks, gloo
    python benchmarks/ddp_overhead.py --json
    torchrun --standalone --nproc-per-node=2 benchmarks/ddp_overhead.py --steps 30

Every variant trains its own copy of the same model at the same micro-batch and accumulation:

* ``plain``: the usual DDP loop, ``no_sync`` on all but the last micro-batch, whose backward
  all-reduces each gradient bucket as soon as it is ready (overlapped with the rest of it).
* ``batchpilot``: ``Engine`` + ``DistributedCoordinator()`` (the safe default): every
  micro-batch under ``no_sync``, one all-reduce MAX "did any rank OOM?", then the gradient
  all-reduce after the whole backward, one all-reduce MIN of the next micro-batch.
* ``deferred``: the plain loop with the same deferral and agreement but no engine, which
  separates the price of deferring the gradient sync from the engine's own overhead.
* ``overlap``: ``Engine`` + ``DistributedCoordinator(defer_grad_sync=False)``: DDP's overlapped
  all-reduce kept, at the price of OOM safety (see batchpilot.dist.distributed).

Variants take turns step by step (the order rotated) so that drift on a shared machine hits
all of them alike; each figure is the median step, the slower rank's. Times on a busy 2-core
CPU are noisy: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from batchpilot.app.models import MLP
from batchpilot.dist import distributed as bd
from batchpilot.train.engine import Engine, EngineConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _torchrun import finish, launch_under_torchrun, median_step_seconds, slowest_rank_ms  # noqa: E402

VARIANTS = ("plain", "batchpilot", "deferred", "overlap")


def _plain_step(ddp: DDP, opt: torch.optim.Optimizer, micro_batches: list) -> None:
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        if i < last:
            with ddp.no_sync():
                (F.cross_entropy(ddp(x), y) / len(micro_batches)).backward()
        else:
            (F.cross_entropy(ddp(x), y) / len(micro_batches)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _deferred_step(ddp: DDP, opt: torch.optim.Optimizer, micro_batches: list, coord: bd.DistributedCoordinator) -> None:
    with ddp.no_sync():
        for x, y in micro_batches:
            (F.cross_entropy(ddp(x), y) / len(micro_batches)).backward()
    if coord.agree_oom(False):
        raise AssertionError("no rank can run out of memory here")
    coord.sync_gradients(ddp)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _make_variants(width: int, depth: int, global_per_rank: int, micro: int) -> dict[str, Callable[[tuple], None]]:
    torch.manual_seed(0)
    base = MLP(in_features=256, width=width, depth=depth)
    steps: dict[str, Callable[[tuple], None]] = {}
    for name in VARIANTS:
        model = copy.deepcopy(base)
        ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if name == "plain":
            steps[name] = lambda b, ddp=ddp, opt=opt: _plain_step(ddp, opt, list(zip(b[0].split(micro), b[1].split(micro))))
        elif name == "deferred":
            coord = bd.DistributedCoordinator()
            steps[name] = lambda b, ddp=ddp, opt=opt, c=coord: _deferred_step(
                ddp, opt, list(zip(b[0].split(micro), b[1].split(micro))), c)
        else:
            coord = bd.DistributedCoordinator(defer_grad_sync=(name == "batchpilot"))
            engine = Engine(ddp, opt, nn.CrossEntropyLoss(), global_batch_size=global_per_rank * bd.world_size(),
                            micro_batch_size=micro, coordinator=coord, config=EngineConfig(adapt=False))
            steps[name] = engine.step
    return steps


def measure(width: int, depth: int, global_per_rank: int, micro: int, steps: int) -> dict:
    variants = _make_variants(width, depth, global_per_rank, micro)
    g = torch.Generator().manual_seed(bd.rank())
    batch = (torch.randn(global_per_rank, 256, generator=g), torch.randint(0, 10, (global_per_rank,), generator=g))
    local = median_step_seconds(variants, batch, steps)
    local.update(_collective_costs(width, depth, batch, steps))
    ms = slowest_rank_ms(local)
    params = sum(p.numel() for p in MLP(in_features=256, width=width, depth=depth).parameters())
    return {
        "model": f"MLP {depth}x{width}", "params": params, "grad_mib": round(params * 4 / 2**20, 2),
        "micro": micro, "accum": global_per_rank // micro, "ranks": bd.world_size(),
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "ratio": {k: round(ms[k] / ms["plain"], 3) for k in VARIANTS if k != "plain"},
    }


def _collective_costs(width: int, depth: int, batch: tuple, steps: int) -> dict[str, float]:
    """Median seconds of the gradient all-reduce alone, and of the two per-step agreements."""
    torch.manual_seed(0)
    model = MLP(in_features=256, width=width, depth=depth)
    ddp = DDP(model)
    with ddp.no_sync():
        F.cross_entropy(ddp(batch[0]), batch[1]).backward()
    coord = bd.DistributedCoordinator()
    sync, agree = [], []
    for _ in range(steps):
        torch.distributed.barrier()
        began = time.perf_counter()
        coord.sync_gradients(ddp)
        sync.append(time.perf_counter() - began)
        torch.distributed.barrier()
        began = time.perf_counter()
        coord.agree_oom(False)
        coord.agree_micro_batch(1)
        agree.append(time.perf_counter() - began)
    return {"grad_allreduce": statistics.median(sync), "agreements": statistics.median(agree)}


CASES = [  # width, depth, per-rank global batch, micro
    (256, 2, 64, 64),
    (256, 2, 256, 64),
    (1024, 4, 64, 64),
    (1024, 4, 256, 64),
    (2048, 4, 64, 32),
]


def _table(rows: list[dict]) -> str:
    head = (f"{'model':<14}{'grads':>9}{'micro×accum':>13}{'plain ms':>10}{'batchpilot':>12}{'ratio':>7}"
            f"{'deferred':>10}{'ratio':>7}{'overlap':>9}{'ratio':>7}{'grad a-r':>10}{'agree':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms, ratio = r["ms"], r["ratio"]
        lines.append(
            f"{r['model']:<14}{r['grad_mib']:>6.2f}MiB{str(r['micro']) + '×' + str(r['accum']):>13}"
            f"{ms['plain']:>10.2f}{ms['batchpilot']:>12.2f}{ratio['batchpilot']:>7.2f}"
            f"{ms['deferred']:>10.2f}{ratio['deferred']:>7.2f}{ms['overlap']:>9.2f}{ratio['overlap']:>7.2f}"
            f"{ms['grad_allreduce']:>10.2f}{ms['agreements']:>7.2f}"
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
            print(f"ranks {bd.world_size()}, gloo on CPU, {steps} steps per variant, median step (slower rank)")
            print("ratio = time / plain DDP time (no_sync on all but the last micro-batch); grad a-r: the\n"
                  "gradient all-reduce alone (what deferral exposes); agree: the two per-step agreements, ms")
            print(_table(rows))
    finish()


if __name__ == "__main__":
    main()
