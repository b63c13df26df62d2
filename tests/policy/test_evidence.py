"""Choices from measured times on a noisy clock: the noise estimate, the simple choice by default, the check.

The clocks here are plain Python: a step-time curve times a load factor that drifts from one
measurement to the next (seeded, so every run is the same), as other processes on a shared
machine stretch a step.
"""

from __future__ import annotations

import math
import random

import pytest

from batchpilot.policy.evidence import (
    BatchingCheck,
    decide_throughput,
    fit_overhead,
    log_spread,
)
from batchpilot.policy.search import Trial
from batchpilot.policy.speed import choose_fastest, search_throughput, spare_size, timed_fits


def linear(b: int) -> float:
    """Saturating samples/s: 50 ms per step plus 1 ms per sample; the knee (95% of 2841's speed) at 703."""
    return 0.05 + 0.001 * b


BEST = 2841 / linear(2841)


def true_share(b: int) -> float:
    """Samples/s at ``b`` as a share of the largest's, on the curve without noise."""
    return b / linear(b) / BEST


def drifting_clock(seed: int, step: float):
    """``linear(b)`` times a load in [1, 3] that drifts by a factor ``exp(N(0, step))`` per measurement."""
    rng = random.Random(seed)
    state = {"load": rng.uniform(1.0, 2.0)}

    def clock(b: int) -> float:
        state["load"] = min(3.0, max(1.0, state["load"] * math.exp(rng.gauss(0.0, step))))
        return linear(b) * state["load"]

    return clock


def search(seed: int, step: float):
    """The throughput search after a memory search that timed 1, 14 and 2841, all on the drifting clock."""
    clock = drifting_clock(seed, step)

    def trial(b: int) -> Trial:
        return Trial(batch_size=b, outcome="fit", peak_bytes=100 * b, step_seconds=clock(b))

    trials = [trial(1), trial(14), trial(2841)]
    rounds = search_throughput(trials, trial, lowest=1, highest=2841, retime=clock)
    return trials, rounds


def test_log_spread_pools_the_scatter_of_repeated_measurements():
    s, dof = log_spread([[1.0, 1.1], [2.0, 2.2], [5.0]])
    assert dof == 2 and s == pytest.approx(math.log(1.1) / math.sqrt(2))
    assert log_spread([[1.0], [3.0]]) == (0.0, 0)


def test_a_quiet_clock_decides_as_the_point_estimates_do():
    trials, rounds = search(0, 0.0)
    d = decide_throughput(rounds, 0.05)
    assert d.noise == pytest.approx(0, abs=1e-12) and d.batch_size == choose_fastest(timed_fits(trials)).batch_size == 703
    assert d.largest == 2841 and "smallest within 5% of the fastest beyond the noise: batch 703" in d.reason


@pytest.mark.parametrize("step", [0.15, 0.3])
def test_on_a_busy_clock_the_evidence_never_answers_a_batch_slower_than_the_tolerance(step):
    # 40 seeded runs of the whole throughput search, the load drifting between measurements
    old, new = [], []
    for seed in range(40):
        trials, rounds = search(seed, step)
        old.append(choose_fastest(timed_fits(trials, upto=2841)).batch_size)
        new.append(decide_throughput(rounds, 0.05))
    # every answer gives up at most the tolerance of the true best; the noise sends most to the largest
    assert min(true_share(d.batch_size) for d in new) >= 0.95
    assert sum(d.batch_size == 2841 for d in new) >= 30
    assert all(d.noise > 0.02 for d in new)
    reverted = next(d for d in new if d.batch_size == 2841)
    assert reverted.reason.startswith("the largest that fits")
    # the point estimates of the same measurements (the rule before) answer far slower batches
    assert sum(true_share(b) < 0.95 for b in old) >= 8 and min(true_share(b) for b in old) < 0.85


def test_when_the_noise_is_small_a_smaller_batch_still_wins_on_evidence():
    new = [decide_throughput(search(seed, 0.02)[1], 0.05) for seed in range(40)]
    smaller = [d for d in new if d.batch_size < 2841]
    assert len(smaller) >= 15  # not just "always the largest"
    # a wrong pick beyond the tolerance is the z = 2 bound's rare chance, and never by much
    assert sum(true_share(d.batch_size) < 0.95 for d in new) <= 3
    assert min(true_share(d.batch_size) for d in new) >= 0.93


def test_the_spare_size_gives_up_half_the_tolerance():
    points = {b: linear(b) for b in (1, 14, 616, 703, 2841)}
    s = spare_size(points, 0.05)
    assert s is not None and 703 * 1.125 < s < 2841 / 1.125
    assert true_share(s) == pytest.approx(0.975, abs=0.002)
    assert spare_size({1: linear(1), 2841: linear(2841)}, 0.05) is None  # the answer is the largest: none above
    assert spare_size({1: 1.0, 2: 2.0}, 0.05) is None  # no fixed cost: the smallest is as fast; nothing between


def test_one_round_is_no_evidence_and_answers_the_largest():
    d = decide_throughput([{703: linear(703), 2841: linear(2841)}], 0.05)
    assert d.batch_size == 2841 and math.isinf(d.noise) and "noise unknown" in d.reason
    assert decide_throughput([], 0.05) is None


# ---------------------------------------------------------------------------
# the scorer's batching


def calls(fixed: float, per_token: float, tokens, noise: list[float]):
    return {t: [(fixed + per_token * t) * f] for t, f in zip(tokens, noise)}


def test_a_time_line_is_used_only_when_it_predicts_the_calls_within_the_tolerance():
    quiet = fit_overhead(calls(0.02, 1e-5, (100, 400, 1600, 3200), [1.0, 1.01, 0.995, 1.0]), 0.05)
    assert quiet is not None and quiet.overhead_tokens == pytest.approx(2000, rel=0.1) and quiet.noise < 0.02
    busy = calls(0.02, 1e-5, (100, 400, 1600, 3200), [1.0, 1.6, 1.0, 1.3])
    assert fit_overhead(busy, 0.05) is None  # scattered by more than the tolerance: batch by length alone
    assert fit_overhead(calls(0.02, 1e-5, (100, 400), [1.0, 1.0]), 0.05) is None  # two calls: no scatter to see
    same = {100: [0.021, 0.0212, 0.021]}
    assert fit_overhead(same, 0.05) is None  # one size: no line


def test_the_check_keeps_a_line_that_predicts_and_reverts_one_that_does_not():
    ok = BatchingCheck(noise=0.02, tolerance=0.05)
    verdicts = [ok.observe(1.0, t) for t in (1.01, 0.98, 1.03, 1.0)]
    assert verdicts == [None, None, None, "timed"] and "measured call overhead" in ok.reason
    bad = BatchingCheck(noise=0.02, tolerance=0.05)
    for t in (1.4, 1.3, 1.5):
        assert bad.observe(1.0, t) is None
    assert bad.observe(1.0, 1.35) == "simple"
    assert bad.reason.startswith("batched by length alone") and "1.37x" in bad.reason
    with pytest.raises(ValueError, match="decided"):
        bad.observe(1.0, 1.0)
    # a line that over-predicts is as wrong as one that under-predicts
    fast = BatchingCheck(noise=0.01, tolerance=0.05, calls=2)
    fast.observe(1.0, 0.7)
    assert fast.observe(1.0, 0.72) == "simple"


@pytest.mark.parametrize("kw", [dict(noise=-0.1, tolerance=0.05), dict(noise=0.1, tolerance=0.6),
                                dict(noise=0.1, tolerance=0.05, calls=0)])
def test_the_check_is_validated(kw):
    with pytest.raises(ValueError):
        BatchingCheck(**kw)


def test_rounds_go_on_while_only_the_noise_stands_between_the_point_estimate_and_the_answer():
    clock = drifting_clock(1, 0.15)

    def trial(b: int) -> Trial:
        return Trial(batch_size=b, outcome="fit", peak_bytes=100 * b, step_seconds=clock(b))

    unsettled = search_throughput([trial(1), trial(14), trial(2841)], trial, lowest=1, highest=2841, retime=clock,
                                  settled=lambda v: False, max_rounds=5)
    assert len(unsettled) == 5
    settled = search_throughput([trial(1), trial(14), trial(2841)], trial, lowest=1, highest=2841, retime=clock,
                                settled=lambda v: True, max_rounds=5)
    assert len(settled) == 3  # the rounds asked for, no more
    quiet = decide_throughput(search(0, 0.0)[1], 0.05)
    assert quiet.settled  # no noise: the evidence and the point estimate agree
