"""The engine's split of a batch into micro-batches: balanced, by the finder's step times, with its reason."""

from __future__ import annotations

import pytest
import torch

from batchpilot.find.options import FindOptions
from batchpilot.find.result import BatchPlan
from batchpilot.memory.probes import emulate_capacity
from batchpilot.policy.search import Trial
from batchpilot.train.engine import Engine, EngineConfig

from engine_utils import CE, InjectOOM, assert_params_close, batches, make, one_thread, params, peak_at  # noqa: F401


def timed_plan(largest: int, curve, sizes) -> BatchPlan:
    """A finder's plan whose fitting trials were timed on ``curve`` (seconds per step at a size)."""
    trials = [Trial(batch_size=b, outcome="fit", peak_bytes=1000 + b, step_seconds=curve(b)) for b in sizes]
    return BatchPlan(batch_size=largest, target=0.8, capacity=1 << 30, limit_bytes=1 << 29, strategy="predict",
                     device="cpu", trials=trials, largest_fitting=largest)


def linear(b: int) -> float:
    return 0.05 + 0.001 * b


def cache_cliff(b: int) -> float:
    """1 ms per sample up to 16, 3 ms per sample beyond: small micro-batches are faster."""
    return 0.001 + (0.001 * b if b <= 16 else 0.016 + 0.003 * (b - 16))


def test_balanced_micro_batches_give_the_update_of_one_batch():
    model, opt = make("mlp")
    ref_model, ref_opt = make("mlp")
    batch = next(batches(model, 10, 1))
    Engine(ref_model, ref_opt, CE, global_batch_size=10, micro_batch_size=10).step(batch)
    sizes = []

    def recording(m, b):
        sizes.append(len(b[0]))
        return CE(m, b)

    r = Engine(model, opt, recording, global_batch_size=10, start=4).step(batch)
    assert (r.micro_batch_size, r.accum_steps, r.samples) == (4, 3, 10)
    assert sizes == [4, 3, 3]  # not 4 + 4 + 2: the same passes and peak, no ragged tail
    assert_params_close(params(model), params(ref_model))  # fp32, rtol 1e-5


def test_without_timing_the_fewest_balanced_micro_batches():
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=64, start=40)
    r = eng.step(next(batches(model, 64, 1)))
    # 40 fit: 2 micro-batches either way, 32 + 32 holds less than 40 + 24
    assert (r.micro_batch_size, r.accum_steps) == (32, 2)
    assert r.micro_batch_reason == eng.micro_batch_reason == "fewest micro-batches of at most 40, balanced (not timed)"
    assert eng.describe() == ("global 64 = micro 32 × world 1 × accum 2: fewest micro-batches of at most 40, "
                              "balanced (not timed)")
    assert eng.split.to_dict()["largest_fitting"] == 40


def test_a_linear_time_plan_keeps_the_fewest_micro_batches():
    model, opt = make("mlp")
    plan = timed_plan(40, linear, (1, 8, 20, 40))
    eng = Engine(model, opt, CE, global_batch_size=64, start=plan)
    r = eng.step(next(batches(model, 64, 1)))
    assert (r.micro_batch_size, r.accum_steps) == (32, 2)
    assert r.micro_batch_reason.startswith("fewest micro-batches of at most 40, balanced: predicted")
    assert eng.split.seconds == pytest.approx(2 * linear(32))


class CurveClock:
    """The clock a step's passes are timed by, moved by each micro-batch's loss along a curve.

    Installed as :data:`batchpilot.find.timing.clock` and ``thread_clock`` (the module's
    documented injection points): the engine's real steps then take the curve's time at the
    sizes they really run, ``load(step)`` times over (a co-tenant's share of the machine).
    """

    def __init__(self, monkeypatch, curve, load=lambda step: 1.0) -> None:
        from batchpilot.find import timing

        self.curve, self.load, self.now, self.step = curve, load, 0.0, 0
        monkeypatch.setattr(timing, "clock", lambda: self.now)
        monkeypatch.setattr(timing, "thread_clock", lambda: self.now)

    def loss(self, m, b):  # a real loss; the clock moves by the curve at this micro-batch
        self.now += self.curve(len(b[0])) * self.load(self.step)
        return CE(m, b)

    def run(self, eng, model, steps):
        out = []
        for b in batches(model, 64, steps):
            out.append(eng.step(b))
            self.step += 1
        return out


def test_a_split_timed_faster_is_kept_when_paired_real_steps_confirm_it_and_does_not_grow_back(monkeypatch, caplog):
    clock = CurveClock(monkeypatch, cache_cliff)
    model, opt = make("mlp")
    plan = timed_plan(64, cache_cliff, (1, 8, 16, 32, 64))
    eng = Engine(model, opt, clock.loss, global_batch_size=64, start=plan, config=EngineConfig(grow_after=1))
    with caplog.at_level("INFO", logger="batchpilot.train.adapt"):
        results = clock.run(eng, model, 11)
    # nominated: one pass of 64 costs 0.161 s, four of 16 cost 4 x 0.017. Then pairs of real
    # steps, split and fewest in turn (S F, F S, S F, F S), every pair favouring the split: kept
    ran = [(r.micro_batch_size, r.accum_steps) for r in results]
    s, f = (16, 4), (64, 1)
    assert ran == [s, f, f, s, s, f, f, s] + [s] * 3
    assert results[0].micro_batch_reason.startswith("measured faster: 4 micro-batches predicted 0.068 s")
    assert "checking it on real steps (step 1 of up to 8)" in results[0].micro_batch_reason
    assert results[1].micro_batch_reason.startswith("checking the timed split on real steps (step 2 of up to 8)")
    assert results[8].micro_batch_reason == eng.micro_batch_reason
    assert "confirmed: 0.068 s against 0.161 s on 4 pairs of real steps (median ratio 0.42" in eng.micro_batch_reason
    assert eng.batcher.check.verdict == "split" and eng.batcher.check.ratios() == pytest.approx([0.068 / 0.161] * 4)
    assert eng.policy.ceiling == 16  # growth (grow_after=1, memory to spare) stops at the timed size
    assert [r.getMessage() for r in caplog.records if "confirmed" in r.getMessage()] == [eng.micro_batch_reason]
    fewest = Engine(*make("mlp"), CE, global_batch_size=64, start=plan, config=EngineConfig(split="fewest"))
    assert fewest.step(next(batches(model, 64, 1))).accum_steps == 1


def test_a_split_the_real_steps_do_not_confirm_goes_back_to_the_fewest_once_and_stays(monkeypatch, caplog):
    # the plan's times say small micro-batches are faster; the real steps are linear (a step's
    # fixed cost per micro-batch): the first pair shows it, and the engine goes back for good
    clock = CurveClock(monkeypatch, linear)
    model, opt = make("mlp")
    plan = timed_plan(64, cache_cliff, (1, 8, 16, 32, 64))
    eng = Engine(model, opt, clock.loss, global_batch_size=64, start=plan, config=EngineConfig(grow_after=1))
    with caplog.at_level("INFO", logger="batchpilot.train.adapt"):
        results = clock.run(eng, model, 8)
    assert [(r.micro_batch_size, r.accum_steps) for r in results] == [(16, 4)] + [(64, 1)] * 7
    reason = eng.micro_batch_reason
    assert reason == ("fewest micro-batches of at most 64, balanced: the timed split into 4 of 16, predicted 0.068 s "
                      "against 0.161 s, was not faster on real steps: 0.264 s against 0.114 s on 1 pair of real "
                      "steps (a pair not faster)")
    assert all(r.micro_batch_reason == reason for r in results[2:])
    assert eng.batcher.check.verdict == "fewest" and eng.policy.ceiling is None
    assert [r.getMessage() for r in caplog.records if "not faster" in r.getMessage()] == [reason]  # said once
    assert "was not faster on real steps" in eng.describe()


def test_a_split_that_pays_on_a_quiet_machine_but_not_under_load_keeps_the_fewest(monkeypatch):
    # the split is 2x faster, but a co-tenant arrives on the fourth step and triples every step's
    # time from there: the second pair (F S) reads 3 x 0.068 against 0.161, not faster. The
    # evidence no longer beats the noise: the simplest split, whatever comes after
    clock = CurveClock(monkeypatch, cache_cliff, load=lambda step: 3.0 if step >= 3 else 1.0)
    model, opt = make("mlp")
    plan = timed_plan(64, cache_cliff, (1, 8, 16, 32, 64))
    eng = Engine(model, opt, clock.loss, global_batch_size=64, start=plan)
    results = clock.run(eng, model, 6)
    assert [r.accum_steps for r in results] == [4, 1, 1, 4, 1, 1]
    assert eng.batcher.check.ratios() == pytest.approx([0.068 / 0.161, 3 * 0.068 / 0.161])


def test_an_oom_at_the_checks_fewest_step_ends_the_check_at_the_nominated_split(monkeypatch):
    clock = CurveClock(monkeypatch, cache_cliff)
    model, opt = make("mlp")
    loss = InjectOOM(clock.loss, in_step={(1, 0)})  # the second step: the check's first at the fewest
    plan = timed_plan(64, cache_cliff, (1, 8, 16, 32, 64))
    eng = Engine(model, opt, loss, global_batch_size=64, start=plan)
    results = []
    for b in batches(model, 64, 4):
        loss.begin_step()
        results.append(eng.step(b))
    assert [(r.micro_batch_size, r.accum_steps, r.ooms) for r in results] == [(16, 4, 0), (16, 4, 1), (16, 4, 0),
                                                                              (16, 4, 0)]
    assert results[1].micro_batch_reason == eng.micro_batch_reason == (
        "shrunk after an out-of-memory error at micro-batch 64: the split by time carries on, unchecked")
    assert eng.batcher.check is None and eng.policy.ceiling == 16


def test_the_reason_follows_an_oom_and_the_growth_back():
    model, opt = make("mlp")
    loss = InjectOOM(CE, in_step={(1, 0)})
    eng = Engine(model, opt, loss, global_batch_size=64, start=64, config=EngineConfig(grow_after=2))
    reasons = []
    with emulate_capacity(1 << 30, track=(model, opt)):
        for b in batches(model, 64, 5):
            loss.begin_step()
            r = eng.step(b)
            reasons.append((r.micro_batch_size, r.ooms, r.micro_batch_reason))
    assert reasons[0] == (64, 0, "fewest micro-batches of at most 64, balanced (not timed)")
    assert reasons[1] == (32, 1, "shrunk after an out-of-memory error at micro-batch 64")
    assert reasons[2][:2] == (32, 0)
    grown = [r for r in reasons[3:] if r[0] == 64]
    assert grown and grown[0][2].startswith("grown from 32 after 2 clean steps")


def test_bad_split_options():
    with pytest.raises(ValueError, match="split must be 'time' or 'fewest'"):
        EngineConfig(split="fast")
    with pytest.raises(ValueError, match="speed_tolerance"):
        EngineConfig(split_margin=0.9)


def test_the_engines_own_finder_times_the_curve_and_the_split_follows_it(monkeypatch):
    from batchpilot.find import timing

    now = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])
    monkeypatch.setattr(timing, "thread_clock", lambda: now[0])

    def clocked(m, b):  # a real loss, and the fake clock moves by the curve at this micro-batch
        now[0] += cache_cliff(len(b[0]))
        return CE(m, b)

    model, opt = make("mlp")
    ref_model, ref_opt = make("mlp")
    batch = next(batches(model, 64, 1))
    # the throughput search gives the finder's plan a dense curve; memory allows the whole batch
    cfg = EngineConfig(find=FindOptions(objective="throughput"))
    eng = Engine(model, opt, clocked, global_batch_size=64, config=cfg)
    with emulate_capacity(1 << 30, track=(model, opt)):
        r = eng.step(batch)
    assert eng.plan.largest_fitting == 64 and len(eng.plan.timed_points()) >= 4
    assert eng.split.accum_steps > 1 and r.micro_batch_size < 64
    assert r.micro_batch_reason.startswith("measured faster")
    # the finer split is the same update (no BatchNorm): fp32, rtol 1e-5
    Engine(ref_model, ref_opt, CE, global_batch_size=64, micro_batch_size=64).step(batch)
    assert_params_close(params(model), params(ref_model))


def test_the_memory_bound_is_a_memory_plans_answer_and_a_throughput_plans_largest_fit():
    # after find_batch_size_distributed a memory plan's batch_size is the smallest rank's answer,
    # below this rank's own largest fit: the split must stay under the agreed one
    model, opt = make("mlp")
    agreed = timed_plan(48, linear, (1, 16, 48))
    agreed.batch_size = 20
    eng = Engine(model, opt, CE, global_batch_size=64, start=agreed)
    assert eng.step(next(batches(model, 64, 1))).micro_batch_size == 16  # 4 x 16 under 20, not 2 x 32 under 48
    fast = timed_plan(48, linear, (1, 16, 48))
    fast.objective, fast.batch_size = "throughput", 16  # the smallest about as fast; 48 fits
    eng = Engine(*make("mlp"), CE, global_batch_size=64, start=fast)
    assert eng.step(next(batches(model, 64, 1))).micro_batch_size == 32  # the split is the engine's own
