"""``GrowStepDownPolicy`` against a copy of the loop continuous batching verified its cache with before it.

The copy below (``_old_verify``) is the loop as it stood in ``integrations/continuous.py``, with the
real runs, the cache geometry and the fill test replaced by plain functions; it is kept only here, as
the reference the policy must reproduce: the same sizes run in the same order and the same answer,
on many random memory functions.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import pytest

from batchpilot.policy.search import (
    FIT,
    OOM,
    OVER_TARGET,
    BatchSizeError,
    GrowStepDownPolicy,
    SearchSpace,
    Trial,
    below_by_excess,
    run_search,
)

_STEP_DOWN, _MAX_RUNS, _GROW = 0.15, 6, 0.05


@dataclass
class _Geo:
    """The cache's units: sectors of ``bps`` bytes, blocks of ``bpb`` bytes (as transformers rounds them)."""

    bps: int
    bpb: int
    foot: Callable[[int], int]

    def sectors(self, num_blocks: int) -> int:
        return max(1, math.ceil(num_blocks * self.bpb / self.bps))

    def blocks(self, sectors: int) -> int:
        return max(1, sectors * self.bps // self.bpb)


@dataclass
class _Run:
    num_blocks: int
    ok: bool
    peak_bytes: int


@dataclass
class _Case:
    geo: _Geo
    limit: int
    floor: int
    ceiling: int
    start: int
    probe: _Run
    need: Callable[[int], int]  # blocks -> measured growth
    capacity: int  # a run whose need passes this runs out of memory
    fill_blocks: int  # runs at up to this many blocks fill their cache
    leak: int = 0  # what a run out of memory leaves behind (a heap's arena): later runs need that much more
    creep: int = 0  # what every run leaves behind (fragmentation)
    left: int = 0

    def run(self, blocks: int, log: list[int]) -> _Run:
        log.append(blocks)
        need = self.need(blocks) + self.left
        self.left += self.creep
        if need > self.capacity:
            self.left += self.leak
            return _Run(blocks, False, self.capacity // 2)
        return _Run(blocks, True, need)

    def filled(self, blocks: int) -> bool:
        return blocks <= self.fill_blocks


def _old_verify(c: _Case, log: list[int], paths: Counter) -> tuple[int, int] | None:
    """The old loop, decision for decision: ``(blocks, expected growth)`` of the answer, or None (nothing fits)."""
    geo = c.geo
    probe = c.probe
    sectors = c.start
    floor_sectors, ceiling = c.floor, c.ceiling
    best = None
    grown = False
    last = probe
    for _ in range(_MAX_RUNS):
        blocks = geo.blocks(sectors)
        filled = c.filled(blocks)
        run = c.run(blocks, log)
        predicted = probe.peak_bytes + geo.foot(geo.sectors(blocks)) - geo.foot(geo.sectors(probe.num_blocks))
        expected = run.peak_bytes if filled else max(predicted, run.peak_bytes)
        slope = max(1, geo.foot(sectors + 1) - geo.foot(sectors))
        if run.ok and last.ok and geo.sectors(blocks) != geo.sectors(last.num_blocks):
            measured = (run.peak_bytes - last.peak_bytes) / (geo.sectors(blocks) - geo.sectors(last.num_blocks))
            slope = max(slope, math.ceil(measured))
        last = run if filled else last
        if run.ok and expected <= c.limit:
            best = (blocks, run, expected)
            grow = math.floor((c.limit - expected) / slope)
            if grown or not filled or sectors >= ceiling or grow < max(1, _GROW * sectors):
                paths["answer"] += 1
                return blocks, expected
            grown = True
            paths["grow"] += 1
            sectors = min(ceiling, sectors + grow)
            continue
        if best is not None:
            blocks, _, expected = best
            run = c.run(blocks, log)
            if run.ok and run.peak_bytes <= c.limit:
                paths["rerun fits"] += 1
                return blocks, max(expected, run.peak_bytes)
            paths["rerun fails"] += 1
            best = None
            sectors = geo.sectors(blocks)
        if run.ok:
            paths["over the limit"] += 1
            sectors = below_by_excess(sectors, expected - c.limit, slope)
        else:
            paths["out of memory"] += 1
            sectors = min(sectors - 1, math.floor(sectors * (1 - _STEP_DOWN)))
        grown = True
        if sectors < floor_sectors:
            break
    paths["nothing fits"] += 1
    return None


def _new_verify(c: _Case, log: list[int]) -> tuple[int, int] | None:
    """The policy driven by ``run_search``, as ``continuous.py`` drives it now."""
    geo = c.geo
    policy = GrowStepDownPolicy(
        start=c.start, limit=c.limit, floor=c.floor, ceiling=c.ceiling,
        probe_units=geo.sectors(c.probe.num_blocks), probe_peak=c.probe.peak_bytes, footprint=geo.foot,
        units=lambda s: geo.sectors(geo.blocks(s)), fills=lambda s: c.filled(geo.blocks(s)),
        grow=_GROW, step=_STEP_DOWN, rounds=_MAX_RUNS,
    )

    def trial(size: int) -> Trial:
        run = c.run(geo.blocks(size), log)
        outcome = OOM if not run.ok else FIT if run.peak_bytes <= c.limit else OVER_TARGET
        return Trial(batch_size=size, outcome=outcome, peak_bytes=run.peak_bytes)

    space = SearchSpace(limit_bytes=max(1, c.limit), capacity_bytes=max(1, c.limit, c.capacity))
    result = run_search(policy, space, trial, max_trials=2 * _MAX_RUNS)
    found = policy.answer(result.trials)
    return None if found is None else (geo.blocks(found[0]), found[1])


def _case(rng: random.Random) -> _Case:
    bps = rng.choice([1024, 4096, 3000])
    bpb = rng.choice([256, 1024, 4096, 5000])
    per_sector = rng.randint(800, 1200) * bps // 1000
    convex = rng.choice([0, 0, 1, 3])
    geo = _Geo(bps, bpb, lambda s: 50_000 + per_sector * s + convex * s * s // 64)
    # what runs really take: the account, times a factor, plus an overhead and noise, some of it an arena step
    factor, overhead = rng.uniform(0.9, 1.4), rng.randint(0, 200_000)
    step_at, step = rng.randint(1, 400), rng.choice([0, 0, 100_000, 400_000])
    noise = {}

    def need(blocks: int) -> int:
        s = geo.sectors(blocks)
        noise.setdefault(blocks, rng.randint(-20_000, 20_000))  # one figure per size, a repeat measures it again
        jitter = rng.randint(-5_000, 5_000) if rng.random() < 0.3 else 0
        return int(factor * geo.foot(s)) + overhead + (step if s >= step_at else 0) + noise[blocks] + jitter

    probe_blocks = rng.randint(1, 8)
    probe = _Run(probe_blocks, True, need(probe_blocks))
    limit = rng.randint(200_000, 3_000_000)
    slope = max(1, geo.foot(geo.sectors(probe_blocks) + 1) - geo.foot(geo.sectors(probe_blocks)))
    start = max(1, geo.sectors(probe_blocks) + (limit - probe.peak_bytes) // slope)
    floor = rng.randint(1, 6)
    ceiling = rng.choice([1 << 40, max(floor, start + rng.randint(-5, 200))])
    start = max(floor, min(start, ceiling))
    return _Case(geo, limit, floor, ceiling, start, probe, need, capacity=int(limit * rng.uniform(0.8, 1.6)),
                 fill_blocks=rng.choice([0, 1 << 40, rng.randint(1, 3000)]), leak=rng.choice([0, 0, limit // 3]),
                 creep=rng.choice([0, 0, limit // 15]))


def test_the_policy_runs_the_old_loops_sizes_in_order_and_returns_its_answer():
    paths: Counter = Counter()
    for seed in range(2000):
        old_log: list[int] = []
        new_log: list[int] = []
        # the same random memory function twice: the seed fixes the case and every figure it measures
        old = _old_verify(_case(random.Random(seed)), old_log, paths)
        new = _new_verify(_case(random.Random(seed)), new_log)
        assert (new_log, new) == (old_log, old), f"seed {seed}"
    # every decision of the old loop was exercised, each many times
    for path in ("answer", "grow", "rerun fits", "rerun fails", "over the limit", "out of memory", "nothing fits"):
        assert paths[path] >= 10, paths


def test_a_trial_at_another_size_than_asked_is_refused():
    policy = GrowStepDownPolicy(start=10, limit=1000, floor=1, ceiling=100, probe_units=1, probe_peak=100,
                                footprint=lambda s: 100 * s, units=lambda s: s, fills=lambda s: True)
    space = SearchSpace(limit_bytes=1000, capacity_bytes=1000)
    assert policy.next_size([], space) == 10
    with pytest.raises(BatchSizeError, match="asked for 10"):
        policy.next_size([Trial(batch_size=9, outcome=FIT, peak_bytes=900)], space)
