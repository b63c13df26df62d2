"""The uneven-shares balancer on simulated clocks: ``shares="auto"`` against equal shares, per load pattern.

``ShareBalancer`` (``batchpilot.policy.shares``) decides from measured step times, so what it
does on a busy machine depends on how the load on each rank's cores comes and goes. Real
launches (``uneven.py``) take minutes each and their load cannot be repeated; this runs the
balancer's decisions on seeded clocks, hundreds of runs in seconds, the same loads for both arms
(a seed draws the loads independently of the shares), so the ratio is the decisions' alone.

Each step a global batch of ``--global`` samples is split over 2 ranks; rank r's seconds are its
share over its rate times its load; a step costs the slowest rank's seconds. Patterns:

* ``alike-iid``: alike ranks, 25% log-normal scatter, one step in 20 three times slower;
* ``alike-dwell``: alike ranks, a 2x load that sits on one rank for a while (a dwell of about
  ``--dwell`` steps, geometric) then moves to the other or leaves;
* ``load-leaves``: a 2x load on rank 1 for the first ``--leave`` steps, then gone for good (a
  move made for it must come back);
* ``slower``: rank 1 truly at half rank 0's speed, with the ``alike-iid`` scatter;
* ``slower-dwell``: rank 1 truly at half speed, with the ``alike-dwell`` load on top.

For each: equal / auto total time (above 1: auto faster), mean and worst over the seeds, and how
many runs end on uneven shares.

    python benchmarks/shares_sim.py [--seeds 200] [--steps 200] [--patterns ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from typing import Callable, Sequence

from batchpilot.policy.shares import ShareBalancer, equal_shares

Loads = Callable[[int], Sequence[float]]


def _iid(rng: random.Random) -> float:
    return math.exp(rng.gauss(0, 0.25)) * (3.0 if rng.random() < 0.05 else 1.0)


def _dwell_loads(rng: random.Random, dwell: float) -> Loads:
    """A 2x load that stays on one rank (or on neither) for a geometric dwell, then moves."""
    where = [rng.choice((None, 0, 1))]

    def loads(step: int) -> Sequence[float]:
        if rng.random() < 1 / dwell:
            where[0] = rng.choice([w for w in (None, 0, 1) if w != where[0]])
        return [_iid(rng) * (2.0 if where[0] == r else 1.0) for r in range(2)]
    return loads


def pattern_loads(name: str, rng: random.Random, args: argparse.Namespace) -> tuple[tuple[float, float], Loads]:
    """The ranks' true rates and the per-step load multipliers of pattern ``name``."""
    if name == "alike-iid":
        return (100.0, 100.0), lambda step: [_iid(rng) for _ in range(2)]
    if name == "alike-dwell":
        return (100.0, 100.0), _dwell_loads(rng, args.dwell)
    if name == "load-leaves":
        return (100.0, 100.0), lambda step: [_iid(rng), _iid(rng) * (2.0 if step < args.leave else 1.0)]
    if name == "slower":
        return (200.0, 100.0), lambda step: [_iid(rng) for _ in range(2)]
    if name == "slower-dwell":
        return (200.0, 100.0), _dwell_loads(rng, args.dwell)
    raise SystemExit(f"unknown pattern {name!r}: choose from {', '.join(PATTERNS)}")


PATTERNS = ("alike-iid", "alike-dwell", "load-leaves", "slower", "slower-dwell")


def run(pattern: str, seed: int, auto: bool, args: argparse.Namespace) -> tuple[float, tuple[int, ...]]:
    """Total seconds of one run and the shares it ends on."""
    rng = random.Random(seed)
    rates, loads = pattern_loads(pattern, rng, args)
    balancer = ShareBalancer() if auto else None
    shares, total = equal_shares(args.global_batch, 2), 0.0
    for step in range(args.steps):
        seconds = [s / r * x for s, r, x in zip(shares, rates, loads(step))]
        total += max(seconds)
        if balancer is not None:
            shares = balancer.observe(shares, shares, seconds).shares
    return total, tuple(shares)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global", dest="global_batch", type=int, default=64)
    p.add_argument("--dwell", type=float, default=12.0, help="mean steps a load stays where it is")
    p.add_argument("--leave", type=int, default=60, help="load-leaves: the step the load leaves at")
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    print(f"{'pattern':<14} {'mean':>6} {'worst':>6} {'best':>6}  uneven at end")
    for pattern in args.patterns.split(","):
        ratios, uneven = [], 0
        equal_end = equal_shares(args.global_batch, 2)
        for seed in range(args.seeds):
            equal, _ = run(pattern, seed, False, args)
            auto, shares = run(pattern, seed, True, args)
            ratios.append(equal / auto)
            uneven += shares != equal_end
        row = dict(pattern=pattern, mean=statistics.mean(ratios), worst=min(ratios), best=max(ratios),
                   uneven_at_end=uneven, seeds=args.seeds)
        rows.append(row)
        print(f"{pattern:<14} {row['mean']:6.3f} {row['worst']:6.3f} {row['best']:6.3f}  {uneven}/{args.seeds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "shares_sim", "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
