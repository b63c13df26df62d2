"""batchpilot.policy.schedule: pure schedule arithmetic (property-tested), and the engine following it.

The engine tests train for real (fp32, SGD with momentum) and compare against an uninterrupted
run at rtol 1e-5; data goes through the elastic sampler, so "exactly once" is checked on the
indices the loop actually received.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchpilot.policy.microbatch import MicroBatchPolicy
from batchpilot.policy.schedule import (
    AdaptiveSchedule, ConstantSchedule, RampSchedule, SchedulePoint, parse_schedule, round_to_multiple,
)
from batchpilot.train.batching import rescale_lr, rescale_weight_decay, scale_lr
from batchpilot.train.data import ElasticBatchSampler, ElasticLoader
from batchpilot.train.engine import Engine, LocalCoordinator
from batchpilot.train.noise import NoiseConfig

from engine_utils import CE, assert_params_close, one_thread, params  # noqa: F401

# -- pure arithmetic -----------------------------------------------------------------------------


def test_round_to_multiple_examples():
    assert [round_to_multiple(v, 16) for v in (50, 56, 3, 0, 64)] == [48, 64, 16, 16, 64]


@given(value=st.floats(0, 1e6, allow_nan=False), unit=st.integers(1, 512))
@settings(max_examples=300, deadline=None)
def test_round_to_multiple_is_the_nearest_multiple(value, unit):
    r = round_to_multiple(value, unit)
    assert r % unit == 0 and r >= unit
    if value >= unit / 2:
        assert abs(r - value) <= unit / 2 + 1e-9


def megatron(consumed: int, start: int, incr: int, ramp: int, final: int) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, written out in exact fractions
    (its float division lands a hair short at the ends of increments: 38131 / (38131 / 7) < 7)."""
    num_increments = (final - start) // incr
    per_increment = Fraction(ramp, num_increments)
    return min(final, start + math.floor(consumed / per_increment) * incr)


def test_ramp_docstring_sequence():
    ramp = RampSchedule(start=32, increment=32, samples=300)
    batches, consumed, batch = [], 0, ramp.initial(128, 1)
    for step in range(1, 10):
        batches.append(batch)
        consumed += batch
        batch = ramp.decide(SchedulePoint(step=step, samples=consumed, current=batch), 128)
    assert batches == [32, 32, 32, 32, 64, 64, 96, 128, 128]


@given(start_k=st.integers(1, 8), incr_k=st.integers(1, 8), n_incr=st.integers(1, 10),
       ramp=st.integers(1, 100_000), consumed=st.integers(0, 200_000), world=st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=300, deadline=None)
def test_ramp_is_megatrons_ramp_rounded_to_the_world(start_k, incr_k, n_incr, ramp, consumed, world):
    start, incr = 8 * start_k, 8 * incr_k
    final = start + n_incr * incr
    sched = RampSchedule(start=start, increment=incr, samples=ramp)
    got = sched.decide(SchedulePoint(step=1, samples=consumed, current=start, world=world), final)
    want = megatron(consumed, start, incr, ramp, final)
    assert got % world == 0 and got == max(world, want // world * world)
    later = sched.decide(SchedulePoint(step=2, samples=consumed + 1000, current=got, world=world), final)
    assert later >= got  # never shrinks
    if consumed >= ramp:
        assert got == final // world * world


@given(
    noise=st.one_of(st.floats(0.01, 1e6), st.just(math.inf)),
    current_k=st.integers(1, 64), world=st.sampled_from([1, 2, 4]), granule=st.sampled_from([1, 4, 8]),
    k=st.floats(0.1, 4), steps_since=st.integers(0, 40), every=st.integers(1, 20),
    decrease=st.booleans(), max_factor=st.floats(1.1, 8),
)
@settings(max_examples=500, deadline=None)
def test_adaptive_rounds_clamps_waits_and_only_grows(noise, current_k, world, granule, k, steps_since, every,
                                                      decrease, max_factor):
    sched = AdaptiveSchedule(k=k, min_batch_size=16, max_batch_size=1024, granule=granule, every=every,
                             decrease=decrease, max_factor=max_factor)
    unit = world * granule
    lo, hi = sched.bounds(2048, world)
    assert lo % unit == 0 and hi % unit == 0 and 16 <= lo <= hi <= 1024
    current = min(max(current_k * unit, lo), hi)
    point = SchedulePoint(step=100 + steps_since, samples=0, current=current, last_change=100, world=world,
                          noise_scale=noise)
    new = sched.decide(point, 2048)
    if steps_since < every:
        assert new == current and not sched.wants_noise(point)  # changed at most every `every` steps
        return
    assert new % unit == 0 and lo <= new <= hi  # rounded and clamped
    if not decrease:
        assert new >= current  # upward only unless asked
    # one change moves the batch by at most max_factor (up to rounding to the unit)
    assert new <= max(current * max_factor + unit, lo) and new >= min(current / max_factor - unit, current)
    # a larger noise scale never asks for a smaller batch
    more = sched.decide(SchedulePoint(**{**point.__dict__, "noise_scale": noise * 2}), 2048)
    assert more >= new
    # nothing measured: no change
    assert sched.decide(SchedulePoint(**{**point.__dict__, "noise_scale": None}), 2048) == current


def test_adaptive_docstring_sequence_and_bounds_errors():
    sched = AdaptiveSchedule(k=1, min_batch_size=16, max_batch_size=128, every=2)
    batch, last, out = sched.initial(1024, 1), 0, []
    for step, noise in zip(range(1, 9), (None, 40, None, 200, None, 200, None, 200)):
        out.append(batch)
        new = sched.decide(SchedulePoint(step=step, samples=0, current=batch, last_change=last, noise_scale=noise), 1024)
        if new != batch:
            batch, last = new, step
    assert out == [16, 16, 32, 32, 64, 64, 128, 128]
    assert AdaptiveSchedule().initial(256, 1) == 32  # min defaults to the reference // 8
    with pytest.raises(ValueError, match=r"no multiple of world 4 × granule 8 = 32 lies in \[10, 20\]"):
        AdaptiveSchedule(min_batch_size=10, max_batch_size=20, granule=8).bounds(256, 4)
    with pytest.raises(ValueError, match="min_batch_size 64 is above max_batch_size 32"):
        AdaptiveSchedule(min_batch_size=64, max_batch_size=32)
    with pytest.raises(ValueError, match="k must be a positive number"):
        AdaptiveSchedule(k=0)
    with pytest.raises(ValueError, match="lr_rule must be one of auto, linear, sqrt, none"):
        ConstantSchedule(lr_rule="cubic")


@given(sizes=st.lists(st.integers(1, 4096), min_size=2, max_size=8), rule=st.sampled_from(["linear", "sqrt", "none"]),
       wd=st.booleans())
@settings(max_examples=200, deadline=None)
def test_lr_rescales_compose_and_weight_decay_keeps_the_timescale(sizes, rule, wd):
    """Rescaling through any chain of batch sizes ends where one rescale from the first to the last
    does, and with weight-decay scaling B / (lr × wd) (AdamW's τ, in epochs) never moves."""
    param = nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1)
    for old, new in zip(sizes, sizes[1:]):
        factor = rescale_lr(opt, old, new, rule=rule)
        if wd:
            rescale_weight_decay(opt, old, new, lr_factor=factor)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(scale_lr(1e-3, sizes[-1], sizes[0], rule=rule), rel=1e-9)
    if wd:
        assert sizes[-1] / (group["lr"] * group["weight_decay"]) == pytest.approx(sizes[0] / (1e-3 * 0.1), rel=1e-9)
    else:
        assert group["weight_decay"] == 0.1


def test_parse_schedule_round_trips_and_explains_typos():
    for spec in ("constant", "ramp:32,32,10000", "ramp:16,16,500,granule=8",
                 "adaptive:k=0.5,min=16,max=512,every=5,granule=8,max_factor=1.5,decrease=yes"):
        sched = parse_schedule(spec)
        assert parse_schedule(sched.describe()) == sched
    assert parse_schedule("adaptive") == AdaptiveSchedule()
    assert parse_schedule("ramp:32,32,1000", lr_rule="sqrt").lr_rule == "sqrt"
    for bad, why in (("rmp:32,32,1000", "unknown batch schedule 'rmp:32,32,1000'"),
                     ("ramp:32,32", "a ramp is ramp:START,INCR,SAMPLES"),
                     ("ramp:32,x,100", "'x' is not a whole number"),
                     ("adaptive:kk=2", "unknown adaptive key 'kk'"),
                     ("adaptive:k", "'k' is not key=value"),
                     ("adaptive:decrease=maybe", "decrease='maybe': use yes or no"),
                     ("constant:64", "unknown batch schedule")):
        with pytest.raises(ValueError, match=why) as info:
            parse_schedule(bad)
        assert "ramp:START,INCR,SAMPLES" in str(info.value)  # and the accepted spellings


def test_policy_rebase_keeps_what_memory_allowed():
    p = MicroBatchPolicy(limit=64, micro=64)
    p.rebase(96, 64)
    assert (p.limit, p.micro, p.accum_steps) == (96, 48, 2)
    p.rebase(128, 64)
    assert (p.micro, p.accum_steps) == (64, 2)
    p.rebase(32, 64)
    assert p.micro == 32


# -- the engine follows a schedule ---------------------------------------------------------------

N_DATA = 240


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_DATA, 12, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y, torch.arange(N_DATA))


def train(schedule, *, epochs: int, resume: dict | None = None, stop_at: int | None = None, micro=16,
          noise=None, lr_rule_check=True):
    """Train an MLP through an ElasticLoader that follows the engine; returns the run's record."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine = Engine(model, opt, lambda m, b: CE(m, b[:2]), global_batch_size=96, start=micro,
                    schedule=schedule, noise=noise if noise is not None else NoiseConfig(dataset_size=N_DATA))
    ds = data()
    loader = ElasticLoader(ds, ElasticBatchSampler(N_DATA, engine.per_rank_batch_size, seed=0, drop_last=True,
                                                   num_replicas=1, rank=0))
    start_epoch = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        engine.load_state_dict(resume["engine"])
        loader.load_state_dict(resume["data"])
        loader.set_batch_size(engine.per_rank_batch_size)
        start_epoch = resume["epoch"]
        saved, now = resume["engine"], engine.state_dict()
        for key in ("global_batch_size", "samples", "last_batch_change"):
            assert now["global_batch"][key] == saved["global_batch"][key], key  # the schedule continues
        for key in ("noise", "steps"):
            assert now[key] == saved[key], key  # and the EMAs
        assert now["micro_batch"]["policy"]["micro"] == saved["micro_batch"]["policy"]["micro"]  # and the micro-batch
    record = {"indices": [], "globals": [], "lrs": []}
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for x, y, idx in loader:
            r = engine.step((x, y, idx))
            loader.set_batch_size(engine.per_rank_batch_size)
            record["indices"].append((epoch, idx.tolist()))
            record["globals"].append(r.global_batch_size)
            record["lrs"].append(opt.param_groups[0]["lr"])
            if lr_rule_check:  # SGD: the linear rule from the reference 96
                assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * engine.global_batch_size / 96)
            if stop_at is not None and engine.steps == stop_at:
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict(),
                            "data": loader.state_dict(), "epoch": epoch}, buf)
                buf.seek(0)
                record["checkpoint"] = torch.load(buf, weights_only=True)  # plain containers only
                return record
    record["params"] = params(model)
    record["engine"] = engine
    return record


def test_ramp_changes_the_batch_with_data_exactly_once_and_resumes_exactly():
    ramp = RampSchedule(start=24, increment=24, samples=360)
    full = train(ramp, epochs=3)
    assert full["globals"][0] == 24 and full["globals"][-1] == 96
    assert sorted(set(full["globals"])) == [24, 48, 72, 96]
    # every sample once per epoch, whatever the batch sizes (drop_last drops at most a tail)
    for epoch in range(3):
        seen = [i for e, idx in full["indices"] if e == epoch for i in idx]
        assert len(seen) == len(set(seen)) and len(seen) > N_DATA - 96
    # a checkpoint in the middle of the ramp, resumed in a fresh process state
    half = train(ramp, epochs=3, stop_at=9)
    assert half["globals"][-1] < 96
    rest = train(ramp, epochs=3, resume=half["checkpoint"])
    assert half["indices"] + rest["indices"] == full["indices"]
    assert half["globals"] + rest["globals"] == full["globals"]
    assert_params_close(rest["params"], full["params"])
    assert rest["engine"].samples_seen == full["engine"].samples_seen
    assert rest["engine"].noise_scale == pytest.approx(full["engine"].noise_scale, rel=1e-6)


def test_adaptive_follows_the_noise_scale_and_resumes_exactly():
    sched = AdaptiveSchedule(k=1.0, min_batch_size=16, max_batch_size=96, granule=8, every=3, decrease=True)
    full = train(sched, epochs=3, micro=8, noise=NoiseConfig(mode="every", dataset_size=N_DATA))
    engine = full["engine"]
    assert full["globals"][0] == 16
    assert len(set(full["globals"])) > 2 and all(g % 8 == 0 and 16 <= g <= 96 for g in full["globals"])
    half = train(sched, epochs=3, micro=8, stop_at=10, noise=NoiseConfig(mode="every", dataset_size=N_DATA))
    rest = train(sched, epochs=3, micro=8, resume=half["checkpoint"],
                 noise=NoiseConfig(mode="every", dataset_size=N_DATA))
    assert half["globals"] + rest["globals"] == full["globals"]
    assert half["indices"] + rest["indices"] == full["indices"]
    assert_params_close(rest["params"], full["params"])
    assert rest["engine"].noise_scale == pytest.approx(engine.noise_scale, rel=1e-6)


def test_adaptive_splits_a_lone_micro_batch_to_measure():
    sched = AdaptiveSchedule(min_batch_size=16, max_batch_size=96, every=2)
    run = train(sched, epochs=1, micro=64)  # the micro-batch covers the whole first batch
    assert run["engine"].noise_scale is not None
    assert run["globals"][0] == 16 and max(run["globals"]) > 16


def test_set_global_batch_size_checks_the_world_and_rescales():
    class World(LocalCoordinator):
        world_size = 4

    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    engine = Engine(model, opt, CE, global_batch_size=64, start=16, coordinator=World())
    with pytest.raises(ValueError, match="nearest valid global_batch_size: 96 or 100"):
        engine.set_global_batch_size(98)
    factor = engine.set_global_batch_size(256, scale_weight_decay=True)
    assert factor == pytest.approx(2.0)  # sqrt rule for AdamW: sqrt(256 / 64)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3) and opt.param_groups[0]["weight_decay"] == pytest.approx(0.2)
    assert (engine.global_batch_size, engine.per_rank_batch_size) == (256, 64)
    assert engine.set_global_batch_size(256) == 1.0
    assert engine.set_global_batch_size(128, lr_rule=None) == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(2e-3)
    by_spec = Engine(model, opt, CE, global_batch_size=64, start=16, coordinator=World(), schedule="ramp:16,16,100")
    assert by_spec.schedule == RampSchedule(start=16, increment=16, samples=100) and by_spec.global_batch_size == 16
    with pytest.raises(ValueError, match="unknown batch schedule 'adaptiv'"):
        Engine(model, opt, CE, global_batch_size=64, schedule="adaptiv")


def test_a_schedule_starts_from_the_reference_lr_and_warns_a_loader_that_does_not_follow(caplog):
    model = nn.Sequential(nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
    engine = Engine(model, opt, CE, global_batch_size=128, start=8, scheduler=sched,
                    schedule=RampSchedule(start=32, increment=32, samples=96))
    assert engine.global_batch_size == 32 and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert sched.base_lrs == [pytest.approx(0.1)]  # warmup / decay continue from the rescaled LR
    x, y = torch.randn(32, 12), torch.randint(0, 2, (32,))
    engine.step((x, y))
    engine.step((x, y))
    assert engine.global_batch_size == 96  # 64 samples consumed
    with caplog.at_level("WARNING", logger="batchpilot.train.engine"):
        engine.step((x, y))  # the loader kept giving 32
        engine.step((x, y))
    assert "the data loader did not follow" in caplog.text
    with pytest.raises(ValueError, match=r"more than this rank's 16 of the global batch 16 \(it was 128; a schedule"):
        engine.set_global_batch_size(16)
        engine.step((x, y))


def test_rescale_weight_decay_refuses_a_bad_lr_factor():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0.1)
    for bad in (0, -1.0, math.inf, True):
        with pytest.raises(ValueError, match="lr_factor must be a finite number > 0"):
            rescale_weight_decay(opt, 64, 128, lr_factor=bad)
    assert rescale_weight_decay(opt, 64, 128, lr_factor=2.0) == 1.0  # the linear rule keeps it
    assert opt.param_groups[0]["weight_decay"] == 0.1
