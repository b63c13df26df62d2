"""Search policies against memory functions written in plain Python (no torch)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from typing import Callable

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pure import modules_loaded_alone

from batchpilot.policy.search import (
    FIT,
    OOM,
    OVER_TARGET,
    BatchSizeError,
    BinsearchPolicy,
    DecayPolicy,
    PowerPolicy,
    PredictPolicy,
    SearchPolicy,
    SearchSpace,
    TensorModel,
    Trial,
    bracket,
    decay_batch_step,
    fit_line,
    make_policy,
    run_search,
)

Peak = Callable[[int], int]


def linear(b: int) -> int:
    return 10_000 + 300 * b


def kink(b: int) -> int:
    # the optimizer step dominates small batches, activations large ones
    return max(50_000, 20_000 + 1_733 * b)


def superlinear(b: int) -> int:
    return int(10_000 + 50 * b**1.3)


def step_change(b: int) -> int:
    # e.g. a kernel switching to a larger workspace from batch 40 on
    return 10_000 + 300 * b + (20_000 if b >= 40 else 0)


def run(
    policy: SearchPolicy, peak: Peak, *, capacity: int, target: float = 0.8, start: int = 8_000,
    min_batch_size: int = 1, max_batch_size: int | None = None, max_trials: int = 40,
):
    space = SearchSpace(limit_bytes=int(target * capacity), capacity_bytes=capacity,
                        min_batch_size=min_batch_size, max_batch_size=max_batch_size)

    def trial(b: int) -> Trial:
        p = peak(b)
        if p > capacity:
            return Trial(batch_size=b, outcome=OOM, start_bytes=start)
        return Trial(batch_size=b, outcome=FIT if p <= space.limit_bytes else OVER_TARGET,
                     peak_bytes=p, start_bytes=start)

    result = run_search(policy, space, trial, max_trials=max_trials)
    return result, [t.batch_size for t in result.trials], space


def true_max(peak: Peak, limit: int, min_batch_size: int = 1, max_batch_size: int | None = None) -> int | None:
    if peak(min_batch_size) > limit:
        return None
    b = min_batch_size
    while (max_batch_size is None or b < max_batch_size) and peak(b + 1) <= limit:
        b += 1
    return b


# ---------------------------------------------------------------------------
# timm's decay schedule


def test_decay_batch_step_sequence_from_256():
    seq, b = [], 256
    while b:
        seq.append(b)
        b = decay_batch_step(b)
    assert seq == [256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1]


def test_decay_batch_step_options():
    assert [decay_batch_step(b, num_intra_steps=4) for b in (256, 224, 192, 160, 128)] == [224, 192, 160, 128, 112]
    assert decay_batch_step(100) == 96 and decay_batch_step(96) == 64
    assert decay_batch_step(7) == 6 and decay_batch_step(6) == 4 and decay_batch_step(5) == 4
    assert decay_batch_step(3, no_odd=True) == 2 and decay_batch_step(4, no_odd=True) == 2
    assert decay_batch_step(1) == 0 and decay_batch_step(0) == 0
    with pytest.raises(ValueError):
        decay_batch_step(8, num_intra_steps=0)


# ---------------------------------------------------------------------------
# documented sequences


def test_power_sequence_and_stop():
    res, seq, _ = run(PowerPolicy(), linear, capacity=20_000, target=0.9)  # true max 26
    assert seq == [1, 2, 4, 8, 16, 32]
    assert res.batch_size == 16 and res.stop_reason == "strategy"


def test_power_halves_when_the_start_fails():
    res, seq, _ = run(PowerPolicy(start=64), linear, capacity=20_000, target=0.6)  # true max 6
    assert seq == [64, 32, 16, 8, 4] and res.batch_size == 4


def test_binsearch_sequence_reaches_the_exact_boundary():
    peak = lambda b: 1_000 + 100 * b  # noqa: E731
    res, seq, _ = run(BinsearchPolicy(), peak, capacity=10_000, target=0.47)  # limit 4700: true max 37
    assert seq == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert res.batch_size == 37 and res.stop_reason == "boundary"


def test_binsearch_bisects_down_when_the_start_fails():
    res, seq, space = run(BinsearchPolicy(start=64), linear, capacity=20_000, target=0.6)
    assert seq[0] == 64 and res.batch_size == true_max(linear, space.limit_bytes) == 6


def test_decay_sequence_from_256():
    res, seq, _ = run(DecayPolicy(), lambda b: 1_000 + 100 * b, capacity=10_000, target=0.47)
    assert seq == [256, 192, 128, 96, 64, 48, 32]
    assert res.batch_size == 32 and res.stop_reason == "strategy"


def test_decay_respects_min_batch_size():
    res, seq, _ = run(DecayPolicy(start=16), kink, capacity=40_000, min_batch_size=3)
    assert seq == [16, 12, 8, 6, 4, 3] and res.batch_size is None and res.stop_reason == "nothing_fits"


def test_predict_sequence_linear():
    # 1, the proportional guess, then the line's answer, certified by three collinear points
    res, seq, space = run(PredictPolicy(), linear, capacity=206_000)
    assert seq == [1, 68, 516]
    assert res.batch_size == true_max(linear, space.limit_bytes) == 516 and res.stop_reason == "boundary"


def test_predict_sequence_kink():
    # flat start: the capacity guard holds the jump back, the overshoot is measured, then interpolated
    res, seq, space = run(PredictPolicy(), kink, capacity=250_000, start=10_000)
    assert seq == [1, 4, 24, 111, 103]
    assert res.batch_size == true_max(kink, space.limit_bytes) == 103
    assert res.trials[3].outcome == OVER_TARGET  # over the target but no OOM


def mlp_like(b: int) -> int:
    # the reference MLP on CPU: the optimizer step, a transition, then the activations
    return max(1_887_484 + 264 * b, 1_100_000 + 4_100 * b, 1_032_448 + 4_360 * b)


@pytest.mark.parametrize("capacity,target,expected", [
    (16 << 20, 0.8, [1, 14, 3324, 2813, 2841]),
    (8 << 20, 0.9, [1, 7, 1124, 1570, 1494]),
])
def test_predict_sequence_flat_start(capacity, target, expected):
    # 1 and the proportional guess barely differ: the line's answer is far past the ceiling, so the
    # geometric mean of the two skips the transition (ceiling steps gave 1, 14, 253, 3574, 2841, 2842)
    res, seq, space = run(PredictPolicy(), mlp_like, capacity=capacity, target=target, start=1_022_160)
    assert seq == expected
    assert res.batch_size == true_max(mlp_like, space.limit_bytes) == expected[-1]
    assert res.stop_reason == "boundary" and all(t.outcome != OOM for t in res.trials)
    assert PredictPolicy().certified(res.batch_size, res.trials, space)


def test_predict_sequence_step_change():
    res, seq, space = run(PredictPolicy(), step_change, capacity=206_000)
    assert seq == [1, 68, 259, 449]
    assert res.batch_size == true_max(step_change, space.limit_bytes) == 449


@pytest.mark.parametrize("target", [0.6, 0.8, 0.9])
@pytest.mark.parametrize("capacity", [25_000, 60_000, 206_000, 1_000_000])
def test_predict_linear_memory_takes_at_most_four_trials(capacity, target):
    res, seq, space = run(PredictPolicy(), linear, capacity=capacity, target=target)
    assert res.batch_size == true_max(linear, space.limit_bytes)
    assert len(seq) <= 4
    assert all(t.outcome != OOM for t in res.trials)


@pytest.mark.parametrize("peak,start", [(kink, 10_000), (superlinear, 8_000), (step_change, 8_000)])
@pytest.mark.parametrize("target", [0.6, 0.9])
@pytest.mark.parametrize("capacity_factor", [2, 5, 20, 100])
def test_predict_is_exact_on_nonlinear_memory(peak, start, target, capacity_factor):
    capacity = capacity_factor * peak(1)
    res, seq, space = run(PredictPolicy(), peak, capacity=capacity, target=target, start=start)
    assert res.batch_size == true_max(peak, space.limit_bytes)
    assert len(seq) <= 12
    assert sum(t.outcome == OOM for t in res.trials) <= 3


def test_predict_when_the_true_max_is_below_the_first_guess():
    res, seq, space = run(PredictPolicy(first_guess=64), linear, capacity=20_000, target=0.6)
    assert res.batch_size == true_max(linear, space.limit_bytes) == 6
    assert seq[0] == 64 and res.trials[0].outcome == OOM and len(seq) <= 5


def test_predict_checks_an_exact_first_guess_with_one_more_trial():
    res, seq, _ = run(PredictPolicy(first_guess=516), linear, capacity=206_000)
    assert seq == [516, 517] and res.batch_size == 516


def test_predict_stops_at_max_batch_size():
    res, seq, _ = run(PredictPolicy(), linear, capacity=206_000, max_batch_size=100)
    assert res.batch_size == 100 and res.stop_reason == "max_batch_size" and seq[-1] == 100
    assert all(b <= 100 for b in seq)


def sliced(b: int) -> int:
    # a step that slices X[:b] of a dataset of 256 rows: past 256 every size costs the same
    return 10_000 + 300 * min(b, 256)


@pytest.mark.parametrize("first_guess", [None, 100, 300])
def test_predict_stops_where_memory_stops_growing(first_guess):
    res, seq, space = run(PredictPolicy(first_guess=first_guess), sliced, capacity=206_000)
    assert res.stop_reason == "plateau" and len(seq) <= 6
    assert res.batch_size >= 256 and sliced(res.batch_size) == sliced(256)
    assert res.batch_size == min(b for b in seq if sliced(b) == sliced(256))  # the smallest measured at the level
    # a max_batch_size is the batch the user wants: the search goes up to it
    res, seq, _ = run(PredictPolicy(first_guess=first_guess), sliced, capacity=206_000, max_batch_size=5_000)
    assert (res.batch_size, res.stop_reason) == (5_000, "max_batch_size")


def test_a_flat_start_is_no_plateau():
    # level first, growing after (the optimizer step's fixed peak, then the activations): the search goes on
    flat_first = lambda b: max(60_000, 10_000 + 300 * b)  # noqa: E731
    res, _, space = run(PredictPolicy(), flat_first, capacity=206_000)
    assert res.stop_reason == "boundary" and res.batch_size == true_max(flat_first, space.limit_bytes)
    assert PredictPolicy().plateau(res.trials, space) is None


@pytest.mark.parametrize("policy", [PredictPolicy(), BinsearchPolicy(), PowerPolicy(), DecayPolicy(start=8)])
def test_nothing_fits(policy):
    # the smallest size is over the target (measured) for one, an OOM for the other
    for capacity, outcome in ((55_000, OVER_TARGET), (45_000, OOM)):
        res, seq, _ = run(policy, kink, capacity=capacity, target=0.9, min_batch_size=1)
        assert res.batch_size is None and res.stop_reason == "nothing_fits"
        assert res.trials[-1].batch_size == 1 and res.trials[-1].outcome == outcome


def test_min_batch_size_is_the_first_probe():
    res, seq, space = run(PredictPolicy(), linear, capacity=206_000, min_batch_size=32)
    assert seq[0] == 32 and res.batch_size == true_max(linear, space.limit_bytes, 32)


def test_allocator_rounding_needs_a_tolerance():
    # peaks rounded up to 512 bytes are not convex: three of them can be collinear by chance
    rounded = lambda b: 10_000 + 512 * math.ceil((300 * b + 77) / 512)  # noqa: E731
    for capacity in (21_024, 51_500, 206_000):
        for target in (0.6, 0.8, 0.9):
            res, _, space = run(PredictPolicy(tolerance_bytes=512), rounded, capacity=capacity, target=target)
            assert res.batch_size == true_max(rounded, space.limit_bytes)


# ---------------------------------------------------------------------------
# properties


@settings(max_examples=150, deadline=None)
@given(
    fixed=st.integers(0, 200_000),
    per_sample=st.integers(1, 50_000),
    quadratic=st.sampled_from([0, 0, 1, 30]),
    flat=st.integers(0, 300_000),
    jump=st.integers(0, 100_000),
    jump_at=st.integers(2, 3_000),
    headroom=st.integers(1, 400),
    target=st.sampled_from([0.5, 0.6, 0.8, 0.9, 1.0]),
    min_batch_size=st.integers(1, 4),
    max_batch_size=st.one_of(st.none(), st.integers(4, 5_000)),
    first_guess=st.one_of(st.none(), st.integers(1, 5_000)),
)
# flat up to just past the boundary: predict crept up one sample per trial from the flat fit (33 trials)
@example(fixed=0, per_sample=179, quadratic=0, flat=94321, jump=0, jump_at=2, headroom=132, target=0.8,
         min_batch_size=1, max_batch_size=None, first_guess=None)
# an upward step, then a flat start: one step up and level, like a plateau's start (stopped at 2 of 6)
@example(fixed=0, per_sample=1, quadratic=0, flat=6, jump=1, jump_at=2, headroom=1, target=1.0,
         min_batch_size=1, max_batch_size=None, first_guess=None)
def test_exact_strategies_find_the_boundary(fixed, per_sample, quadratic, flat, jump, jump_at, headroom, target,
                                            min_batch_size, max_batch_size, first_guess):
    # a flat start, a linear or convex part and an upward step: what a real peak looks like
    start = fixed // 2

    def peak(b: int) -> int:
        grown = start + fixed + per_sample * b + quadratic * b * b
        return max(start + flat, grown) + (jump if b >= jump_at else 0)

    capacity = peak(1) + headroom * per_sample
    for policy in (PredictPolicy(first_guess=first_guess), BinsearchPolicy(start=first_guess)):
        res, seq, space = run(policy, peak, capacity=capacity, target=target, start=start,
                              min_batch_size=min_batch_size, max_batch_size=max_batch_size)
        best = true_max(peak, space.limit_bytes, min_batch_size, max_batch_size)
        assert res.batch_size == best
        # doubling up to the boundary (or halving down from the first guess), then bisecting
        scale = max(best or 1, first_guess or 1)
        assert len(seq) == len(set(seq)) and len(seq) <= 2 * math.ceil(math.log2(scale + 1)) + 6
        if res.batch_size is not None and res.stop_reason == "boundary":
            assert any(t.batch_size == res.batch_size + 1 and not t.fits for t in res.trials) or \
                policy.certified(res.batch_size, res.trials, space)


@settings(max_examples=60, deadline=None)
@given(per_sample=st.integers(1, 10_000), fixed=st.integers(0, 50_000), headroom=st.integers(2, 2_000),
       target=st.sampled_from([0.6, 0.8, 0.9]))
def test_predict_on_linear_memory_never_ooms(per_sample, fixed, headroom, target):
    start = 10_000
    peak = lambda b: start + fixed + per_sample * b  # noqa: E731
    res, seq, space = run(PredictPolicy(), peak, capacity=peak(1) + headroom * per_sample, target=target, start=start)
    assert res.batch_size == true_max(peak, space.limit_bytes)
    assert all(t.outcome != OOM for t in res.trials)


# ---------------------------------------------------------------------------
# helpers and validation


def test_bracket_and_fit_line():
    trials = [
        Trial(batch_size=1, outcome=FIT, peak_bytes=1_100),
        Trial(batch_size=10, outcome=FIT, peak_bytes=2_000),
        Trial(batch_size=30, outcome=OOM),
        Trial(batch_size=20, outcome=OVER_TARGET, peak_bytes=3_000),
    ]
    assert bracket(trials) == (10, 20)
    assert fit_line(trials) == (1_000.0, 100.0)
    assert fit_line(trials[:1]) is None
    assert bracket([]) == (None, None)


def test_trial_validation():
    with pytest.raises(ValueError):
        Trial(batch_size=1, outcome="maybe", peak_bytes=1)
    with pytest.raises(ValueError):
        Trial(batch_size=1, outcome=FIT)
    assert Trial(batch_size=3, outcome=OOM).to_dict()["peak_bytes"] is None


def test_search_space_validation():
    with pytest.raises(BatchSizeError, match="larger than max_batch_size"):
        SearchSpace(limit_bytes=10, capacity_bytes=10, min_batch_size=8, max_batch_size=4)
    with pytest.raises(BatchSizeError):
        SearchSpace(limit_bytes=11, capacity_bytes=10)
    with pytest.raises(BatchSizeError):
        SearchSpace(limit_bytes=10, capacity_bytes=10, min_batch_size=0)


def test_make_policy():
    assert isinstance(make_policy("predict", first_guess=7), PredictPolicy)
    assert make_policy("predict", first_guess=7).first_guess == 7
    assert make_policy("decay", max_batch_size=100).start == 100
    assert make_policy("decay").start == 256
    assert make_policy("power", first_guess=4).start == 4
    custom = BinsearchPolicy(start=3)
    assert make_policy(custom) is custom
    with pytest.raises(ValueError, match="predict, power, binsearch, decay"):
        make_policy("exhaustive")
    with pytest.raises(BatchSizeError):
        PredictPolicy(first_guess=0)


def test_run_search_max_trials():
    res, seq, _ = run(BinsearchPolicy(), linear, capacity=206_000, max_trials=3)
    assert seq == [1, 2, 4] and res.batch_size == 4 and res.stop_reason == "max_trials"


@pytest.mark.parametrize("module", ["policy.search", "policy.microbatch", "_checks"])
def test_pure_modules_do_not_import_torch(module):
    out = modules_loaded_alone(module, then="print(mod.decay_batch_step(256))" if module == "policy.search" else "")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "[]", f"{module} imported {lines[0]}"
    if module == "policy.search":
        assert lines[1] == "192"


# ---------------------------------------------------------------------------
# the tensor model: the envelope of two allocation timelines


def timeline(b: int) -> list[int]:
    """Live tensor bytes after each allocation of a step: weights (fixed), activations (per sample),
    the optimizer's temporaries (fixed, after the activations are gone)."""
    weights = 1_000_000
    acts = [weights + k * 4_000 * b for k in range(1, 6)]
    grads = [weights + 2_000 * b + 1_000_000, weights + 1_000_000]
    optimizer = [2 * weights + 500_000, weights + 1_000_000]
    return [*acts, *grads, *optimizer]


def test_the_model_of_two_tiny_timelines_is_the_peak_at_every_size():
    model = TensorModel.from_timelines(2, timeline(2), 3, timeline(3))
    for b in (1, 2, 3, 10, 40, 41, 500, 10_000):
        assert model(b) == max(timeline(b))
    # the optimizer's fixed peak below the kink, the activations' line above: only those two remain
    assert model.lines == ((2_500_000, 0.0), (1_000_000, 20_000.0))
    assert model.solve(max(timeline(700))) == 700 and model.solve(2_499_999) is None


def test_timelines_that_do_not_align_give_no_model():
    assert TensorModel.from_timelines(2, timeline(2), 3, timeline(3)[:-1]) is None
    assert TensorModel.from_timelines(2, timeline(2), 2, timeline(2)) is None
    assert TensorModel.from_timelines(2, [], 3, []) is None


def test_the_union_of_two_models_is_the_higher_at_every_size():
    a = TensorModel(lines=((100.0, 1.0),))
    b = TensorModel(lines=((0.0, 2.0), (500.0, 0.0)))
    u = TensorModel.union(a, b)
    assert all(u(x) == max(a(x), b(x)) for x in range(0, 1000, 7))
    assert u.to_dict() == {"lines": [[500.0, 0.0], [0.0, 2.0]]}


@given(st.lists(st.tuples(st.integers(-10**6, 10**6), st.integers(0, 10**4)), min_size=1, max_size=30))
@settings(max_examples=100, deadline=None)
def test_the_upper_envelope_keeps_the_maximum(lines):
    model = TensorModel.from_timelines(1, [a + c for a, c in lines], 2, [a + 2 * c for a, c in lines])
    for b in (0, 1, 5, 99, 10**5):
        assert model(b) == pytest.approx(max(a + c * b for a, c in lines))


# ---------------------------------------------------------------------------
# the modelled search (a host's real memory): two tiny sizes, one calibration, the answer


def modelled_run(real: Callable[[int], int | None], tensors: Callable[[int], list[int]], *, capacity: int,
                 target: float, base: int, left: int = 0, max_trials: int = 12, once: tuple[int, int] = (0, 0)):
    """``run_search`` as the finder drives it on a host: the model joins the space after two trials.

    ``real(b)`` is a trial's real peak (``None``: it runs out of memory); each new size leaves
    ``left`` bytes behind (JIT code for its shape), as real memory does. ``once = (size, bytes)``:
    the first trial at ``size`` or more also sets up ``bytes`` for good (a heap grown for good),
    in its peak and left behind.
    """
    limit = base + int(target * (capacity - base))
    space = SearchSpace(limit_bytes=limit, capacity_bytes=capacity)
    held = [base]
    timelines: dict[int, list[int]] = {}

    def trial(b: int) -> Trial:
        start = held[-1]
        peak = real(b)
        first = once[1] and b >= once[0] and not any(x >= once[0] for x in timelines)
        held.append(start + left + (once[1] if first else 0))
        if first and peak is not None:
            peak += once[1]
        if peak is None or peak + start - base > capacity:
            # the allocator's bound: what was mapped when it failed plus the request it refused
            # (here the whole need: the step failed at its largest allocation)
            bound = None if peak is None else peak + start - base
            return Trial(batch_size=b, outcome=OOM, peak_bytes=bound, bound_bytes=bound, start_bytes=start,
                         end_bytes=held[-1])
        timelines.setdefault(b, tensors(b))
        peak += start - base
        return Trial(batch_size=b, outcome=FIT if peak <= limit else OVER_TARGET, peak_bytes=peak,
                     start_bytes=start, end_bytes=held[-1], tensor_bytes=max(tensors(b)))

    def revise(sp: SearchSpace, t: Trial) -> SearchSpace | None:
        if sp.tensors is None and len(timelines) == 2:
            (b1, t1), (b2, t2) = timelines.items()
            return dataclasses.replace(sp, tensors=TensorModel.from_timelines(b1, t1, b2, t2))
        return None

    policy = PredictPolicy(modelled=True, rel_tolerance=0.02)
    result = run_search(policy, space, trial, max_trials=max_trials, revise=revise)
    return result, [t.batch_size for t in result.trials], limit


MB = 2**20


def test_modelled_search_calibrates_once_and_lands_within_the_tolerance():
    # real memory is the tensors times 1.15 (kernel scratch) over a runtime of 500 MB
    base, capacity = 500 * MB, 1524 * MB
    real = lambda b: base + int(1.15 * (max(timeline(b)) - max(timeline(0))))  # noqa: E731
    result, sizes, limit = modelled_run(real, timeline, capacity=capacity, target=0.8, base=base, left=2 * MB)
    assert sizes[:2] == [2, 3] and len(sizes) == 4, sizes  # two tiny sizes, a calibration, the answer
    answer = result.batch_size
    assert answer == sizes[-1] and result.trials[-1].peak_bytes <= limit
    assert result.trials[-1].peak_bytes >= limit - 0.02 * (capacity - base) - 8 * MB  # 8 MB: the leftovers


def test_a_one_time_set_up_left_by_the_first_large_trial_does_not_stop_the_search_short():
    # the first trial of 1000 samples or more grows the heap by 6% of the room for good: it is in
    # every later trial's start, not noise between them; the search still ends within the
    # tolerance of the limit (taken as noise, it stopped the search 6% short; with 10%, 10% short)
    base, capacity = 500 * MB, 1524 * MB
    real = lambda b: base + int(1.15 * (max(timeline(b)) - max(timeline(0))))  # noqa: E731
    for share in (0.06, 0.1):
        once = (1000, int(share * (capacity - base)))
        result, sizes, limit = modelled_run(real, timeline, capacity=capacity, target=0.8, base=base, once=once)
        answer = [t for t in result.trials if t.batch_size == result.batch_size][-1]
        assert limit - 0.02 * (capacity - base) <= answer.peak_bytes <= limit, sizes
        assert len(sizes) <= 6, sizes


def test_modelled_search_finds_the_kink_an_extrapolated_line_misses():
    # the optimizer's fixed peak hides the activations at small sizes: a line through two small
    # sizes would jump far past the boundary; the model knows where the activations take over
    def kinked(b: int) -> list[int]:
        return [60 * MB, 10 * MB + 30_000 * b]

    base, capacity = 400 * MB, 1424 * MB
    real = lambda b: base + max(kinked(b)) - 60 * MB  # noqa: E731
    result, sizes, limit = modelled_run(real, kinked, capacity=capacity, target=0.99, base=base)
    assert all(t.outcome != OOM for t in result.trials) and len(sizes) <= 5, sizes
    true_max = (limit - base + 50 * MB) // 30_000
    assert 0.97 * true_max <= result.batch_size <= true_max


def test_an_oom_the_model_did_not_foresee_is_not_repeated():
    # real memory grows twice as fast as the tensors past 8000 samples: the calibration cannot see it
    def real(b: int) -> int | None:
        return 300 * MB + 20_000 * b + (20_000 * (b - 8_000) if b > 8_000 else 0)

    tensors = lambda b: [5 * MB, 20_000 * b]  # noqa: E731
    result, sizes, limit = modelled_run(real, tensors, capacity=900 * MB, target=0.99, base=300 * MB)
    ooms = [t for t in result.trials if t.outcome == OOM]
    assert len(ooms) == 1 and result.trials.index(ooms[0]) < len(result.trials) - 1
    assert result.trials[-1].fits and len(sizes) <= 6, sizes


@pytest.mark.parametrize("once", [0, 4 * MB, 12 * MB])
def test_on_a_large_host_a_plateau_far_inside_the_tolerance_stops_the_search_near_its_start(once):
    # X[:b] of 5000 rows on a host with gigabytes of room: past 5000 every size adds the same 8 MB,
    # far less than 2% of the room; the model of the tiny sizes says the tensors should have grown.
    # The first large trial also sets up ``once`` for good, up to more than the level's own growth
    rows = 5000

    def tensors(b: int) -> list[int]:
        return [2 * MB, 1_600 * min(b, rows)]

    base = 300 * MB
    real = lambda b: base + int(1.05 * max(tensors(b)))  # noqa: E731
    result, sizes, _ = modelled_run(real, tensors, capacity=20_000 * MB, target=0.8, base=base, left=MB // 4,
                                    once=(1000, once))
    assert result.stop_reason == "plateau" and len(sizes) <= 6, sizes
    assert rows <= result.batch_size <= 4 * rows, sizes  # at the level, near where it starts


def test_on_a_large_host_memory_that_grows_little_but_steadily_is_no_plateau():
    # the same small step reading every sample it is given: its memory grows slowly but without
    # end, and the search goes on to the limit
    def tensors(b: int) -> list[int]:
        return [2 * MB, 1_600 * b]

    base = 300 * MB
    real = lambda b: base + int(1.05 * max(tensors(b)))  # noqa: E731
    result, sizes, limit = modelled_run(real, tensors, capacity=2_000 * MB, target=0.8, base=base, left=MB // 4,
                                        once=(1000, 4 * MB))
    assert result.stop_reason == "tolerance" and result.trials[-1].peak_bytes <= limit, sizes


def dip(b: int) -> int:
    # real memory that falls between two small sizes (a cache released, noise larger than the
    # samples between them): the line through them slopes down and never reaches the limit
    return 100_000 - 40 * b if b < 40 else 98_400 + 600 * (b - 40)


def test_predict_does_not_follow_a_falling_line_and_still_finds_the_boundary():
    res, seq, space = run(PredictPolicy(first_guess=2), dip, capacity=300_000, start=90_000)
    # 2 -> 30 measures a falling peak: a line through them never reaches the limit, so it is no
    # model; the search grows past it, brackets the boundary and lands on it exactly
    assert seq[:2] == [2, 30] and res.trials[1].peak_bytes < res.trials[0].peak_bytes
    assert res.batch_size == true_max(dip, space.limit_bytes) == 276
    assert len(seq) <= 6 and sum(t.outcome == OOM for t in res.trials) <= 1


def test_check_target_is_the_one_range_and_error():
    from batchpilot.policy.search import check_target

    assert check_target(1) == 1.0 and check_target(0.8) == 0.8
    for bad in (0, -0.1, 1.01, float("nan"), True, "0.8", None):
        with pytest.raises(BatchSizeError, match=r"target must be a fraction of device memory in \(0, 1\]"):
            check_target(bad)
    # an entry point's own bound, exclusive, named in the message
    assert check_target(0.9, below=0.95, bound="config.high_water") == 0.9
    with pytest.raises(BatchSizeError, match=r"target 0.95 must be below config.high_water 0.95, or it is pressure"):
        check_target(0.95, below=0.95, bound="config.high_water", reason="or it is pressure")
