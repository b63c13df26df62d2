"""The pure micro-batch policy and memory model: exact sequences, no torch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchpilot.policy.microbatch import MicroBatchPolicy, PeakFit, accum_steps, efficient_size


@pytest.mark.parametrize("total,micro,expected", [(24, 10, 8), (24, 8, 8), (64, 20, 16), (10, 4, 4), (7, 100, 7), (5, 1, 1)])
def test_efficient_size(total, micro, expected):
    assert efficient_size(total, micro) == expected


@given(total=st.integers(1, 5000), micro=st.integers(1, 5000))
@settings(max_examples=300, deadline=None)
def test_efficient_size_keeps_the_count_and_never_grows(total, micro):
    size = efficient_size(total, micro)
    assert 1 <= size <= min(total, micro)
    assert accum_steps(total, size) == accum_steps(total, min(micro, total))
    # and it is the smallest such size
    assert size == 1 or accum_steps(total, size - 1) > accum_steps(total, size)


def test_docstring_sequence():
    p = MicroBatchPolicy(limit=64, micro=64, grow_after=2, backoff=2)
    assert p.on_oom() == 32 and p.wait == 2
    assert p.on_clean(None) == 32
    assert p.on_clean(64) == 64 and p.on_probation
    assert p.on_oom() == 32 and p.wait == 4 and not p.on_probation
    assert [p.on_clean(64) for _ in range(3)] == [32, 32, 32]
    assert p.on_clean(64) == 64 and p.on_probation
    assert p.on_clean(64) == 64 and not p.on_probation and p.wait == 2


def test_growth_waits_for_grow_after_clean_steps_and_needs_room():
    p = MicroBatchPolicy(limit=100, micro=10, grow_after=3)
    assert [p.on_clean(100) for _ in range(3)] == [10, 10, 100]
    p = MicroBatchPolicy(limit=100, micro=10, grow_after=3)
    # room for 11 only: ceil(100/11) = 10 micro-batches, no fewer than now, so no growth
    assert [p.on_clean(11) for _ in range(5)] == [10] * 5
    # room for 30: 4 micro-batches of 25
    assert p.on_clean(30) == 25


def test_backoff_doubles_each_failed_growth_and_caps():
    p = MicroBatchPolicy(limit=8, micro=4, grow_after=1, backoff=2, max_wait=5)
    waits = []
    for _ in range(4):
        while p.on_clean(8) != 8:
            pass
        assert p.on_oom() == 4
        waits.append(p.wait)
    assert waits == [2, 4, 5, 5]


def test_oom_without_model_halves_and_stops_at_one():
    p = MicroBatchPolicy(limit=100, micro=100, grow_after=10)
    sizes = []
    while (s := p.on_oom()) is not None:
        sizes.append(s)
    # halves, rounded down to the smallest size with the same number of micro-batches
    assert sizes == [50, 25, 12, 6, 3, 1]
    assert p.micro == 1


def test_oom_shrinks_less_than_half_only_when_the_model_allows():
    p = MicroBatchPolicy(limit=100, micro=34)  # 3 micro-batches
    assert p.on_oom(max_fitting=30) == 25  # 30 -> 4 micro-batches -> 25 each (half would be 17)
    assert p.on_oom(max_fitting=40) == 12  # the model was wrong (40 >= 25): halve
    assert p.on_oom(max_fitting=2) == 6    # never shrink harder than halving on the model's word


def test_pressure_shrinks_but_not_below_one():
    p = MicroBatchPolicy(limit=16, micro=2)
    assert p.on_pressure() == 1
    assert p.on_pressure() == 1


def test_adopt_smaller_size_cancels_probation():
    p = MicroBatchPolicy(limit=64, micro=16, grow_after=1)
    assert p.on_clean(64) == 64 and p.on_probation
    p.adopt(16)
    assert not p.on_probation and p.micro == 16


def test_state_dict_round_trip_and_new_limit():
    p = MicroBatchPolicy(limit=64, micro=64, grow_after=2)
    p.on_oom()
    p.on_clean(64)
    q = MicroBatchPolicy(limit=64, micro=64, grow_after=2)
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict()
    r = MicroBatchPolicy(limit=24, micro=24, grow_after=2)
    r.load_state_dict(p.state_dict())
    assert r.micro == 24 and r.clean == 0  # saved 32, clamped to the new limit


@pytest.mark.parametrize("kwargs", [dict(limit=0, micro=1), dict(limit=4, micro=5), dict(limit=4, micro=2, backoff=0.5),
                                    dict(limit=4, micro=2, grow_after=0), dict(limit=4, micro=True)])
def test_policy_rejects_bad_config(kwargs):
    with pytest.raises(ValueError):
        MicroBatchPolicy(**kwargs)


@given(ops=st.lists(st.sampled_from(["clean", "oom", "pressure"]), max_size=60), limit=st.integers(1, 300),
       fit=st.one_of(st.none(), st.integers(0, 400)))
@settings(max_examples=200, deadline=None)
def test_policy_invariants(ops, limit, fit):
    p = MicroBatchPolicy(limit=limit, micro=limit, grow_after=2)
    for op in ops:
        before = p.micro
        if op == "clean":
            p.on_clean(fit)
            assert p.micro >= before
        elif op == "oom":
            if p.on_oom(fit) is None:
                assert before == 1
        else:
            p.on_pressure(fit)
            assert p.micro <= before
        assert 1 <= p.micro <= limit
        assert p.micro == efficient_size(limit, p.micro)


def test_peak_fit_single_point_is_conservative_and_lsq_is_exact():
    fit = PeakFit()
    assert fit.max_fitting(1000) is None
    fit.observe(10, peak=700, start=100)  # true increase: 200 + 40 b
    assert fit.line() == (0.0, 60.0)
    assert fit.max_fitting(1300, start=100) == 20  # under-estimates the true 25
    fit.observe(20, peak=1100, start=100)
    fixed, per = fit.line()
    assert fixed == pytest.approx(200) and per == pytest.approx(40)
    assert fit.max_fitting(1300, start=100) == 25
    assert fit.predict(25, start=100) == pytest.approx(1300)
    assert fit.max_fitting(100, start=100) == 0


def test_peak_fit_models_the_increase_over_the_start():
    fit = PeakFit()
    fit.observe(8, peak=500, start=100)   # first step: optimizer state not there yet
    fit.observe(4, peak=700, start=500)   # it is now: same increase per sample, more in use
    fixed, per = fit.line()
    assert per == pytest.approx(50) and fixed == pytest.approx(0)
    assert fit.max_fitting(1000, start=500) == 10


def test_peak_fit_keeps_the_largest_increase_per_size_and_a_prior():
    fit = PeakFit(prior=(50.0, 5.0))
    fit.observe(4, peak=100)
    assert fit.line() == (50.0, 5.0)  # one size: the prior wins
    fit.observe(4, peak=90)
    fit.observe(8, peak=140)
    assert fit.predict(4) == pytest.approx(100) and fit.predict(8) == pytest.approx(140)
    g = PeakFit()
    g.load_state_dict(fit.state_dict())
    assert g.line() == fit.line()


def test_peak_fit_flat_peak_means_the_micro_batch_does_not_matter():
    fit = PeakFit()
    fit.observe(64, peak=1100, start=100)
    fit.observe(32, peak=1150, start=100)  # smaller, yet no smaller peak: fixed memory dominates
    assert fit.line() == (1050.0, 0.0)
    assert fit.predict(1, start=100) == fit.predict(64, start=100) == 1150
    assert fit.max_fitting(1200, start=100) >= 2**40  # any size
    assert fit.max_fitting(1000, start=100) == 0  # no size


def test_peak_fit_forgets_old_sizes():
    fit = PeakFit(max_sizes=3)
    for b in (1, 2, 3, 4):
        fit.observe(b, peak=10 * b)
    assert fit.sizes == [2, 3, 4]
