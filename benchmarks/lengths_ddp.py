"""Memory that follows the tokens under torchrun: lengths.py's job on 2 DDP ranks (gloo, CPU).

Each global batch of ``lengths.py`` is dealt in halves to the two ranks, each half padded to its own
longest sample, so the ranks' lengths differ at most steps. Three arms, as in ``lengths.py``:
``fixed`` (the micro-batch found at the longest length), ``by length`` (every step sized for the
longer of the two ranks' batches) and ``by length + split`` (each rank cuts and trims its own
samples; a rank needing fewer micro-batches halves its largest, so both run as many). Every rank
runs under the same emulated capacity (exact tensor bytes, a real OOM past it).

Reported per arm: OOMs after the first step, micro-batches per step (equal on both ranks: checked),
the slowest rank's CPU seconds of the engine steps as a ratio to ``fixed`` (one intra-op thread per
rank; wall-clock beside it), and the final parameters on both ranks against the full-batch
computation (fp32, rtol 1e-5).

    python benchmarks/lengths_ddp.py --quick          # launches itself under torchrun, 2 ranks
    python benchmarks/lengths_ddp.py --json lengths_ddp.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import machine  # noqa: E402
from _torchrun import finish, launch_under_torchrun  # noqa: E402
from lengths import arm_engine, build_model, job_config, length_plan, make_batches, reference  # noqa: E402

from batchpilot.app.models import TinyGPT  # noqa: E402
from batchpilot.app.report import format_table, write_json  # noqa: E402
from batchpilot.core.seqbatch import trim_batch  # noqa: E402
from batchpilot.dist import distributed as bd  # noqa: E402
from batchpilot.memory.probes import emulate_capacity  # noqa: E402

RANKS = 2
COLUMNS = ("arm", "steps", "OOMs after step 1", "verifications", "micro-batches / step", "CPU s (slowest rank)",
           "samples/s ratio", "wall ratio", "max |Δparam| rel", "exact")


def rank_half(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """This rank's half of a global batch, trimmed to its own longest sample (as its loader would pad it)."""
    n = batch["input_ids"].shape[0] // RANKS
    rows = {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}
    longest = int(rows["attention_mask"].sum(1).max())
    return trim_batch(rows, longest, seq_dim=1, copy=True)


def run_arm(name: str, model: TinyGPT, batches: Any, cfg: dict, plan: Any, rank: int) -> dict[str, Any]:
    model = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    engine = arm_engine(name, ddp, torch.optim.SGD(model.parameters(), lr=0.05), cfg, plan)
    ooms, micro = [], []
    dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    with emulate_capacity(cfg["capacity"]):
        for batch in batches:
            r = engine.step(rank_half(batch, rank))
            ooms.append(r.ooms)
            micro.append(r.accum_steps)
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    return {"name": name, "model": model, "ooms": ooms, "micro": micro, "cpu": cpu, "wall": wall,
            "verifications": engine.lengths.verifications if engine.lengths is not None else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="lengths.py's quick job: a small model, 24 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--capacity", default=None, help="emulated capacity per rank (default 40MiB; 1MiB with --quick)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    launch_under_torchrun(__file__, RANKS)
    bd.init_distributed(backend="gloo", timeout=timedelta(seconds=600))
    rank = bd.rank()
    cfg = job_config(args.quick, args.steps, args.capacity)
    torch.set_num_threads(1)
    model = build_model(cfg)
    batches = make_batches(cfg)
    # the same search on every rank (same model, same emulated device): the same plan everywhere
    plan = length_plan(model, cfg, max_batch_size=cfg["global_batch"] // RANKS)
    arms = [run_arm(name, model, batches, cfg, plan, rank) for name in ("fixed", "by length", "by length + split")]
    local = [{"cpu": a["cpu"], "wall": a["wall"], "micro": a["micro"], "ooms": a["ooms"],
              "params": [p.detach() for p in a["model"].parameters()]} for a in arms]
    gathered: list[Any] = [None] * RANKS
    dist.all_gather_object(gathered, local)
    status = 0
    if rank == 0:
        expected = list(reference(model, batches).parameters())
        rows, records = [], []
        fixed_cpu = max(g[0]["cpu"] for g in gathered)
        fixed_wall = max(g[0]["wall"] for g in gathered)
        for i, a in enumerate(arms):
            per_rank = [g[i] for g in gathered]
            same_micro = all(r["micro"] == per_rank[0]["micro"] for r in per_rank)
            cpu, wall = max(r["cpu"] for r in per_rank), max(r["wall"] for r in per_rank)
            diff = max(float(((p - q.detach()).abs() / q.detach().abs().clamp(min=1e-6)).max())
                       for r in per_rank for p, q in zip(r["params"], expected))
            exact = all(torch.allclose(p, q, rtol=1e-5, atol=1e-7) for r in per_rank
                        for p, q in zip(r["params"], expected))
            ooms_after = sum(sum(r["ooms"][1:]) for r in per_rank)
            mean_micro = sum(per_rank[0]["micro"]) / len(per_rank[0]["micro"])
            rows.append((a["name"], cfg["steps"], ooms_after, a["verifications"],
                         f"{mean_micro:.2f}" + ("" if same_micro else " (ranks differ!)"), f"{cpu:.1f}",
                         f"{fixed_cpu / cpu:.2f}x", f"{fixed_wall / wall:.2f}x", f"{diff:.1e}", "yes" if exact else "NO"))
            records.append({"arm": a["name"], "ooms_after_first": ooms_after, "verifications": a["verifications"],
                            "same_micro_batches_on_every_rank": same_micro, "mean_micro_batches": mean_micro,
                            "slowest_rank_cpu_seconds": cpu, "slowest_rank_wall_seconds": wall,
                            "ratio_vs_fixed": fixed_cpu / cpu, "wall_ratio_vs_fixed": fixed_wall / wall,
                            "max_rel_param_diff": diff, "exact": exact})
            if ooms_after or not exact or not same_micro:
                status = 1
        print(f"{cfg['steps']} steps of {cfg['global_batch']} samples on {RANKS} ranks ({cfg['global_batch'] // RANKS} "
              f"each), lengths {cfg['min_len']}-{cfg['max_len']} (long-tailed), capacity {cfg['capacity']} per rank, "
              f"fixed micro-batch {plan.per_length[max(plan.per_length)]}")
        print(format_table(COLUMNS, rows))
        if args.json:
            write_json({"benchmark": "lengths_ddp", "date": datetime.date.today().isoformat(), "machine": machine(),
                        "ranks": RANKS, "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
                        "arms": records}, args.json)
    dist.barrier()
    # correctness only (no OOM after step 1, equal micro-batch counts, exact parameters); speed is reported
    finish(status)
    return status


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
