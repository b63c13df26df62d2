"""Batch-size finder strategies side by side on the reference models (CPU, emulated capacity).

For each model the true maximum — the largest batch whose two-step training peak
is at most ``target × capacity`` — is found by bisection on direct measurements
of fresh copies; then every strategy searches under the same emulated capacity.
With ``--plan-first`` each model also gets a ``predict+plan`` row: the planner's
answer (one fake-tensor planning pass) is the first real trial, which the finder
verifies; its seconds include the planning pass, also shown on its own.

    python benchmarks/finder.py
    python benchmarks/finder.py --plan-first
    python benchmarks/finder.py --capacity 8MiB --target 0.9 --json finder.json

Seconds are wall time on this machine: compare them within one run, not across machines.
On a CPU a fake planning pass can take longer than the small real trials it saves;
on a GPU the real trials (and any OOM) are the expensive part.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from typing import Any

import torch
from torch import nn

from batchpilot.app.models import MODEL_NAMES, build_model, example_batch
from batchpilot.core.batch import make_batch_fn
from batchpilot.find.front import find_batch_size_for
from batchpilot.memory.probes import track_peak
from batchpilot.memory.units import format_bytes, parse_bytes
from batchpilot.policy.search import STRATEGIES

logger = logging.getLogger("benchmarks.finder")

STEPS = 2


def setup(name: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = build_model(name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer, example_batch(model, 8, generator=torch.Generator().manual_seed(0))


def measure(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, b: int) -> int:
    """The peak of two training steps at batch b, on fresh copies of the model and optimizer."""
    model = copy.deepcopy(model)
    opt = type(optimizer)(model.parameters(), **optimizer.defaults)
    make, loss_fn = make_batch_fn(batch), nn.CrossEntropyLoss()
    with track_peak("cpu", track=(model, opt)) as m:
        for _ in range(STEPS):
            x, y = make(b)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
    return m.peak_bytes


def true_max(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, limit: int) -> tuple[int, int]:
    """(largest b with peak(b) <= limit, measurements used), by doubling then bisection."""
    count = 0

    def fits(b: int) -> bool:
        nonlocal count
        count += 1
        return measure(model, optimizer, batch, b) <= limit

    if not fits(1):
        return 0, count
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, count


def run(models: list[str], strategies: list[str], capacity: int, target: float,
        plan_first: bool = False) -> list[dict[str, Any]]:
    rows = []
    limit = int(target * capacity)
    methods = [(s, False) for s in strategies] + ([("predict", True)] if plan_first else [])
    for name in models:
        model, optimizer, batch = setup(name)
        best, used = true_max(model, optimizer, batch, limit)
        logger.info("%s: true max %d (%d measurements)", name, best, used)
        for strategy, seeded in methods:
            m, opt, data = setup(name)
            started = time.perf_counter()
            plan = find_batch_size_for(m, data, optimizer=opt, loss_fn=nn.CrossEntropyLoss(),
                                       capacity=capacity, target=target, strategy=strategy, plan_first=seeded)
            rows.append({
                "model": name,
                "strategy": f"{strategy}+plan" if seeded else strategy,
                "first_guess": plan.first_guess,
                "plan_seconds": round(plan.plan_seconds, 3),
                "trials": plan.num_trials,
                "ooms": plan.num_ooms,
                "over_target": sum(t.outcome == "over_target" for t in plan.trials),
                "seconds": round(time.perf_counter() - started, 3),
                "found": plan.batch_size,
                "true_max": best,
                "ratio": round(plan.batch_size / best, 4) if best else None,
                "sizes": [t.batch_size for t in plan.trials],
                "outcomes": [t.outcome for t in plan.trials],
            })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    seeded = any(r["strategy"].endswith("+plan") for r in rows)
    head = ("model", "strategy", "trials", "OOMs", "over", "seconds", *(("plan s",) if seeded else ()),
            "found", "true max", "found/true")
    body = [
        (r["model"], r["strategy"], str(r["trials"]), str(r["ooms"]), str(r["over_target"]),
         f"{r['seconds']:.2f}", *((f"{r['plan_seconds']:.2f}",) if seeded else ()), str(r["found"]),
         str(r["true_max"]), "-" if r["ratio"] is None else f"{r['ratio']:.3f}")
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = " | ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    lines += [fmt.format(*b) for b in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="16MiB", help="emulated device capacity (default 16MiB)")
    parser.add_argument("--target", type=float, default=0.8, help="fraction of the capacity (default 0.8)")
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated reference models")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies")
    parser.add_argument("--plan-first", action="store_true",
                        help="also run predict seeded by the planner (find_batch_size_for(plan_first=True))")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every trial")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    capacity = parse_bytes(args.capacity)
    rows = run(args.models.split(","), args.strategies.split(","), capacity, args.target, args.plan_first)
    print(f"capacity {format_bytes(capacity)} (emulated, CPU), target {args.target}, "
          f"limit {format_bytes(int(args.target * capacity))}, {STEPS} steps per trial, Adam; "
          "decay starts at 256")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"capacity": capacity, "target": args.target, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
