"""The throughput objective's rule on a drifting clock: point estimates (before) against evidence beyond the noise (after).

A simulation, not a timing: the whole throughput search (:func:`batchpilot.policy.speed.search_throughput`)
runs on a step-time curve times a load in [1, 3] that drifts between measurements by a factor
``exp(N(0, σ))``, as other processes on a shared machine stretch a step; seeded, so every run of
this script prints the same table. For each σ and seed it reports what the rule before (the
smallest size within the tolerance by the medians of the visits: ``choose_fastest``) and the rule
now (:func:`batchpilot.policy.evidence.decide_throughput`) answer on the same measurements, as a
share of the true best samples/s (goal: at least ``1 - tolerance``).

    python benchmarks/noise_rules.py [--seeds 200] [--sigmas 0,0.02,0.05,0.15,0.3] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from batchpilot.app.report import format_table
from batchpilot.policy.evidence import decide_throughput
from batchpilot.policy.search import Trial
from batchpilot.policy.speed import choose_fastest, search_throughput, timed_fits

CURVES: dict[str, Callable[[int], float]] = {
    # saturating: 50 ms a step + 1 ms a sample (the knee, 95% of 2841's samples/s, at 703)
    "saturating": lambda b: 0.05 + 0.001 * b,
    # samples/s that peak near 141 and fall beyond (caches overflowing)
    "falling": lambda b: 0.01 + 0.001 * b + 5e-7 * b * b,
}
LARGEST = 2841
COLUMNS = ("curve", "sigma", "before: median", "before: worst", "before < 0.95", "after: median", "after: worst",
           "after < 0.95", "after = largest")


def one(curve: Callable[[int], float], seed: int, sigma: float, tolerance: float) -> tuple[int, int]:
    rng = random.Random(seed)
    state = {"load": rng.uniform(1.0, 2.0)}

    def clock(b: int) -> float:
        state["load"] = min(3.0, max(1.0, state["load"] * math.exp(rng.gauss(0.0, sigma))))
        return curve(b) * state["load"]

    def trial(b: int) -> Trial:
        return Trial(batch_size=b, outcome="fit", peak_bytes=100 * b, step_seconds=clock(b))

    trials = [trial(1), trial(14), trial(LARGEST)]
    rounds = search_throughput(trials, trial, lowest=1, highest=LARGEST, tolerance=tolerance, retime=clock,
                               settled=lambda v: (lambda d: d is None or d.settled)(decide_throughput(v, tolerance)))
    before = choose_fastest(timed_fits(trials, upto=LARGEST), tolerance).batch_size
    decision = decide_throughput(rounds or [], tolerance)
    return before, LARGEST if decision is None else decision.batch_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--sigmas", default="0,0.02,0.05,0.15,0.3")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows, doc = [], {"benchmark": "noise_rules", "date": datetime.date.today().isoformat(),
                     "command": "python benchmarks/noise_rules.py " + " ".join(sys.argv[1:] if argv is None else argv),
                     "rows": []}
    for name, curve in CURVES.items():
        sps = {b: b / curve(b) for b in range(1, LARGEST + 1)}
        best = max(sps.values())
        for sigma in (float(x) for x in args.sigmas.split(",")):
            pairs = [one(curve, s, sigma, args.tolerance) for s in range(args.seeds)]
            share_b = [sps[b] / best for b, _ in pairs]
            share_a = [sps[a] / best for _, a in pairs]
            floor = 1 - args.tolerance
            row: dict[str, Any] = {
                "curve": name, "sigma": sigma, "before_median": statistics.median(share_b), "before_worst": min(share_b),
                "before_below": sum(x < floor for x in share_b), "after_median": statistics.median(share_a),
                "after_worst": min(share_a), "after_below": sum(x < floor for x in share_a),
                "after_largest": sum(a == LARGEST for _, a in pairs)}
            doc["rows"].append(row)
            rows.append((name, sigma, f"{row['before_median']:.3f}", f"{row['before_worst']:.3f}",
                         f"{row['before_below']}/{args.seeds}", f"{row['after_median']:.3f}",
                         f"{row['after_worst']:.3f}", f"{row['after_below']}/{args.seeds}",
                         f"{row['after_largest']}/{args.seeds}"))
    print(f"throughput objective on a drifting clock: the answer's true samples/s as a share of the best, "
          f"{args.seeds} seeded searches per row, tolerance {args.tolerance:.0%}")
    print(format_table(COLUMNS, rows))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
