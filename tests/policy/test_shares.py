"""Shares of one global batch over ranks that differ: proportional to speed, integers that add up, optimal."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from batchpilot.policy.shares import (
    shrunk_rates,
    ShareBalancer, balanced_total, check_shares, check_speeds, equal_shares, rank_shares, split_shares, step_seconds,
)


def best_makespan(total: int, speeds: list[float], caps: list[int | None]) -> float:
    """The least ``max(share / speed)`` over every split with shares >= 1 (brute force, small totals)."""
    best = float("inf")
    for head in itertools.product(range(1, total + 1), repeat=len(speeds) - 1):
        last = total - sum(head)
        shares = [*head, last]
        if last < 1 or any(c is not None and n > c for n, c in zip(shares, caps)):
            continue
        best = min(best, step_seconds(shares, speeds))
    return best


def test_shares_are_proportional_to_speed_and_add_up():
    assert split_shares(512, [3, 1]) == [384, 128]
    assert split_shares(10, [1, 1, 1]) == [4, 3, 3]  # the remainder goes to the lowest rank on a tie
    assert split_shares(1000, [154.8, 154.8, 53.8, 53.8]) == [371, 371, 129, 129]
    assert split_shares(7, [1.0]) == [7]


def test_every_rank_keeps_at_least_one_sample():
    assert split_shares(100, [1000, 1]) == [99, 1]
    assert split_shares(3, [1, 1, 1]) == [1, 1, 1]
    with pytest.raises(ValueError, match="at least 3"):
        split_shares(2, [1, 1, 1])


def test_caps_send_the_excess_to_the_others_by_speed():
    assert split_shares(100, [1, 1], caps=[10, None]) == [10, 90]
    assert split_shares(100, [2, 1, 1], caps=[20, None, None]) == [20, 40, 40]
    with pytest.raises(ValueError, match="at most 30"):
        split_shares(31, [1, 1], caps=[10, 20])
    with pytest.raises(ValueError, match="below floors"):
        split_shares(31, [1, 1], caps=[0 + 1, None], floors=[2, 1])


@pytest.mark.parametrize("seed", range(6))
def test_the_split_minimises_the_slowest_ranks_time(seed):
    rng = random.Random(seed)
    for _ in range(15):
        n = rng.randint(2, 3)
        speeds = [rng.choice([0.3, 1.0, 1.7, 2.5, 4.0]) for _ in range(n)]
        caps = [rng.choice([None, rng.randint(3, 12)]) for _ in range(n)]
        total = rng.randint(n, 18)
        if all(c is not None for c in caps) and sum(caps) < total:
            continue
        shares = split_shares(total, speeds, caps=caps)
        assert sum(shares) == total and min(shares) >= 1
        assert all(c is None or s <= c for s, c in zip(shares, caps))
        assert step_seconds(shares, speeds) == pytest.approx(best_makespan(total, speeds, caps))


def test_a_large_global_batch_splits_fast_and_exactly():
    speeds = [random.Random(1).uniform(0.5, 3) for _ in range(64)]
    shares = split_shares(10**9, speeds)
    assert sum(shares) == 10**9
    ideal = [10**9 * s / sum(speeds) for s in speeds]
    assert max(abs(a - b) for a, b in zip(shares, ideal)) < 1


def test_balanced_total_is_set_by_the_rank_with_least_memory_per_speed():
    assert balanced_total([3, 1], [800, 170]) == [510, 170]  # rank 1 sets the pace at its largest micro-batch
    assert balanced_total([1, 1], [800, 170]) == [170, 170]  # alike in speed: equal shares
    assert balanced_total([154.8, 53.8], [799, 171]) == [492, 171]
    assert balanced_total([100, 1], [50, 50]) == [50, 1]  # never past a rank's own memory, never below 1


def test_rank_shares_run_a_share_larger_than_memory_as_balanced_micro_batches():
    plan = rank_shares(1000, [3, 1], [200, 100])
    assert [r.share for r in plan] == [750, 250]
    assert [(r.micro_batch, r.accumulation) for r in plan] == [(188, 4), (84, 3)]  # 188+188+187+187, 84+83+83
    assert [r.max_micro_batch for r in plan] == [200, 100]
    assert max(r.time for r in plan) == 1.0 and min(r.time for r in plan) == pytest.approx(1.0)
    plan = rank_shares(None, [3, 1], [200, 100])
    assert [(r.share, r.accumulation) for r in plan] == [(200, 1), (66, 1)]  # rank 0's memory sets the pace


@pytest.mark.parametrize("speeds, needle", [
    ([], "empty"), ([1, 0], "positive"), ([1, float("nan")], "positive"), ("fast", "sequence"), ([1, -2], "positive"),
])
def test_bad_speeds_are_refused(speeds, needle):
    with pytest.raises(ValueError, match=needle):
        check_speeds(speeds)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="3 speeds for 2 ranks"):
        check_speeds([1, 2, 3], 2)
    with pytest.raises(ValueError, match="positive int"):
        split_shares(0, [1, 1])
    with pytest.raises(ValueError, match="one per rank"):
        split_shares(10, [1, 1], caps=[5])
    with pytest.raises(ValueError, match="max_micro"):
        rank_shares(10, [1, 1], [5, 0])
    with pytest.raises(ValueError, match="one per rank"):
        balanced_total([1, 1], [5])


# -- shares a user gives, and the runtime balancer ------------------------------------------------


def test_check_shares_takes_shares_or_weights_and_refuses_the_rest_saying_how():
    assert check_shares([24, 8], 32, 2) == (24, 8)
    assert check_shares([3, 1], 32, 2) == (24, 8)
    assert equal_shares(33, 2) == (17, 16)
    for bad in ([3], [3, 0], [3.0, 1], [True, 1]):
        with pytest.raises(ValueError, match=r'one positive int per rank \(2 ranks\).*shares=\[3, 1\]'):
            check_shares(bad, 32, 2)


def _feed(balancer: ShareBalancer, shares, rates, steps, outlier=None):
    decision = None
    for i in range(steps):
        seconds = [s / r for s, r in zip(shares, rates)]
        if outlier is not None and i == outlier[0]:
            seconds[outlier[1]] *= 20  # one step of one rank 20x slower: an anecdote
        decision = balancer.observe(shares, shares, seconds)
    return decision


def test_the_balancer_moves_to_proportional_shares_after_a_window_and_not_on_one_slow_step():
    balancer = ShareBalancer(window=5, skip=1)
    # rank 1 at half rank 0's speed, measured over 1 warm-up + 5 steps: the baseline needs another window
    first = _feed(balancer, (16, 16), (200.0, 100.0), 6)
    assert not first.changed and "kept until 2 windows are measured" in first.reason
    assert not _feed(balancer, (16, 16), (200.0, 100.0), 4).changed
    decision = _feed(balancer, (16, 16), (200.0, 100.0), 1)
    assert decision.changed and decision.shares == (22, 10)
    assert decision.predicted == pytest.approx(max(22 / 200, 10 / 100))
    # alike ranks with one outlier step in the window: the median keeps the shares
    balancer = ShareBalancer(window=5, skip=0)
    decision = _feed(balancer, (16, 16), (100.0, 100.0), 5, outlier=(2, 1))
    assert decision.rates == (100.0, 100.0) and not decision.changed


def test_the_balancer_needs_a_clear_gain_and_ignores_short_steps():
    balancer = ShareBalancer(window=3, skip=0, margin=0.05)
    # 2% apart: not worth a move
    assert not _feed(balancer, (16, 16), (102.0, 100.0), 3).changed
    # a short batch (an epoch's last) is not counted
    assert balancer.observe((16, 16), (5, 5), (0.1, 0.1)).reason.startswith("step not counted")
    assert balancer.measured == 0
    with pytest.raises(ValueError, match="window must be an int >= 3"):
        ShareBalancer(window=1)


def _noisy_run(seed: int, rates: tuple[float, float], balancer: ShareBalancer | None, steps: int = 200):
    """Total seconds of ``steps`` steps of a global batch of 64 on a busy clock, the shares at the end, the last move's step.

    Each rank's time is its share over its rate times a load: a log-normal scatter (25%) and one
    step in twenty three times slower, drawn from ``seed`` independently of the shares, so the
    same seed gives two runs the same loads.
    """
    rng = random.Random(seed)
    shares, total, moved_at = equal_shares(64, 2), 0.0, None
    for step in range(steps):
        loads = [math.exp(rng.gauss(0, 0.25)) * (3.0 if rng.random() < 0.05 else 1.0) for _ in rates]
        seconds = [s / r * x for s, r, x in zip(shares, rates, loads)]
        total += max(seconds)
        if balancer is not None:
            decision = balancer.observe(shares, shares, seconds)
            shares = decision.shares
            moved_at = step if decision.changed else moved_at
    return total, shares, moved_at


def test_alike_ranks_on_a_noisy_clock_never_end_slower_than_equal_shares():
    # a median over 8 steps of this clock is often 10-30% apart between alike ranks: moves on the
    # medians alone would be taken; the noise bound refuses most, the real-step check the rest
    for seed in range(60):
        equal, _, _ = _noisy_run(seed, (100.0, 100.0), None)
        auto, shares, moved_at = _noisy_run(seed, (100.0, 100.0), ShareBalancer())
        # a move in the last three windows may still be on trial when the run ends
        assert shares == (32, 32) or moved_at >= 200 - 3 * 8, seed
        assert equal / auto >= 0.98, seed


def test_a_truly_slower_rank_still_moves_on_a_noisy_clock_and_stays():
    for seed in range(20):
        equal, _, _ = _noisy_run(seed, (200.0, 100.0), None)
        balancer = ShareBalancer()
        auto, shares, moved_at = _noisy_run(seed, (200.0, 100.0), balancer)
        if moved_at >= 200 - 3 * 8 and not 38 <= shares[0] <= 50:
            # a move in the last three windows may still be on trial when the run ends: the shares it
            # left were in range, and the real steps at the new ones would send it back
            assert balancer.on_trial is not None and 38 <= balancer.on_trial[0] <= 50, (seed, shares)
        else:
            assert 38 <= shares[0] <= 50, (seed, shares)  # moved towards 43:21 (proportional) and kept
        assert equal / auto > 1.1, seed


def test_a_move_the_real_steps_do_not_confirm_is_reverted_and_held_until_reset():
    balancer = ShareBalancer(window=4, skip=0)
    # two windows with rank 1 at half rank 0's speed move the shares
    moved = _feed(balancer, (16, 16), (200.0, 100.0), 8)
    assert moved.changed and moved.shares == (22, 10)
    # the load moved to rank 0: at the new shares a step costs 22 / 100 = 0.22 s against 0.16 s before
    back = _feed(balancer, (22, 10), (100.0, 200.0), 4)
    assert back.changed and back.shares == (16, 16) and balancer.held
    assert ("shares [22, 10] -> [16, 16]: the move to [22, 10] was not faster on real steps: 0.22 s against "
            "0.16 s over 4 steps") in back.reason
    # held: however lopsided the next windows look, nothing moves, and nothing is measured
    held = _feed(balancer, (16, 16), (300.0, 100.0), 12)
    assert not held.changed and "held" in held.reason and balancer.measured == 0
    # a change of memory (reset) measures anew
    balancer.reset()
    assert not balancer.held and _feed(balancer, (16, 16), (300.0, 100.0), 8).changed


def test_a_hold_ends_after_its_windows_and_doubles_with_each_revert_in_a_row():
    balancer = ShareBalancer(window=4, skip=0, hold=2)
    assert _feed(balancer, (16, 16), (200.0, 100.0), 8).shares == (22, 10)
    back = _feed(balancer, (22, 10), (100.0, 200.0), 4)
    assert back.shares == (16, 16) and "held for 2 windows (8 steps)" in back.reason
    assert "held" in _feed(balancer, (16, 16), (200.0, 100.0), 7).reason and balancer.held
    # the eighth step ends the hold and is the first of a new window: rank 1 still at half speed
    assert not _feed(balancer, (16, 16), (200.0, 100.0), 1).changed and not balancer.held
    assert balancer.measured == 1
    moved = _feed(balancer, (16, 16), (200.0, 100.0), 7)
    assert moved.changed and moved.shares == (22, 10) and balancer.on_trial == (16, 16)
    # reverted again: the hold doubles
    again = _feed(balancer, (22, 10), (100.0, 200.0), 4)
    assert again.shares == (16, 16) and "held for 4 windows (16 steps)" in again.reason
    with pytest.raises(ValueError, match="hold must be an int >= 1"):
        ShareBalancer(hold=0)


def test_a_move_made_for_a_load_that_left_comes_back_to_equal_shares():
    # rank 1 at half speed for a while: the shares move to 22:10 and the real steps confirm it
    balancer = ShareBalancer(window=4, skip=0)
    assert _feed(balancer, (16, 16), (200.0, 100.0), 8).shares == (22, 10)
    assert not _feed(balancer, (22, 10), (200.0, 100.0), 4).changed and balancer.on_trial is None
    # the load leaves: alike ranks, and the way back is toward equal shares
    # (the rates are the median of every step at these shares: one window of each is a tie, a second
    # at the new rates moves them)
    assert not _feed(balancer, (22, 10), (200.0, 200.0), 4).changed
    back = _feed(balancer, (22, 10), (200.0, 200.0), 4)
    assert back.changed and back.shares == (16, 16), back.reason
    # its check: steps at 16:16 cost 0.08 s against 0.11 s: kept, and nothing is held
    kept = _feed(balancer, (16, 16), (200.0, 200.0), 4)
    assert not kept.changed and not balancer.held and balancer.on_trial is None


def test_rates_apart_by_their_noise_alone_are_shrunk_together_and_clear_ones_barely():
    # two ranks 10% apart with a 10% standard error each: taken as alike
    alike = shrunk_rates([110.0, 100.0], [0.1, 0.1])
    assert alike[0] == pytest.approx(alike[1])
    # 2x apart with the same error: nearly the whole ratio stays
    apart = shrunk_rates([200.0, 100.0], [0.1, 0.1])
    assert 1.9 < apart[0] / apart[1] < 2.0
    # exact rates stay exact (no error: no shrinking, no rounding)
    assert shrunk_rates([200.0, 100.0], [0.0, 0.0]) == (200.0, 100.0)


def test_a_move_the_real_steps_confirm_is_kept_and_a_gain_within_the_noise_is_not_taken():
    balancer = ShareBalancer(window=4, skip=0)
    assert _feed(balancer, (16, 16), (200.0, 100.0), 8).shares == (22, 10)
    kept = _feed(balancer, (22, 10), (200.0, 100.0), 4)
    assert not kept.changed and not balancer.held
    assert "the move to [22, 10] was faster on real steps: 0.11 s against 0.16 s" in kept.reason
    # rank 1's rates scatter 2x from step to step: a 20% predicted gain is within the noise
    balancer = ShareBalancer(window=8, skip=0)
    for i in range(8):
        decision = balancer.observe((16, 16), (16, 16), (0.16, 0.2 * (1.0 if i % 2 else 2.0) / 1.4))
    assert not decision.changed and "within the noise" in decision.reason
    assert balancer.decide((16, 16), decision.rates).changed  # without the noise it would move
