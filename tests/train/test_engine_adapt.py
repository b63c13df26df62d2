"""Engine adaptation: regrowth, backoff, memory pressure, the finder's start, untracked CPU."""

from __future__ import annotations

import copy

import pytest
import torch

import batchpilot.train.adapt as adapt_mod
from batchpilot.app.models import MLP
from batchpilot.memory.probes import emulate_capacity, track_peak
from batchpilot.train.engine import Engine, EngineConfig

from engine_utils import CE, GLOBAL, InjectOOM, assert_params_close, batches, make, one_thread, params, peak_at  # noqa: F401

N = GLOBAL["mlp"]


@pytest.fixture(scope="module")
def peaks():
    return {m: peak_at("mlp", N, m) for m in (N // 2, N)}


def test_grows_back_when_the_capacity_rises(peaks):
    small = (peaks[N // 2] + peaks[N]) // 2
    model, opt = make("mlp")
    data = batches(model, N, 14)
    eng = Engine(model, opt, CE, global_batch_size=N, start=N, config=EngineConfig(grow_after=3))
    with emulate_capacity(small, track=(model, opt)):
        tight = [eng.step(next(data)) for _ in range(6)]
    with emulate_capacity(4 * peaks[N], track=(model, opt)):
        roomy = [eng.step(next(data)) for _ in range(8)]
    # the first step fits (no momentum buffers yet); then N OOMs and N/2 has no room to grow
    assert [r.micro_batch_size for r in tight] == [N] + [N // 2] * 5
    assert [r.ooms for r in tight] == [0, 1, 0, 0, 0, 0]
    assert all(r.next_micro_batch_size == N // 2 for r in tight[1:])
    # with room, the clean steps already counted (>= grow_after) let it grow right away
    assert [r.micro_batch_size for r in roomy] == [N // 2] + [N] * 7
    assert all(r.ooms == 0 and not r.pressure for r in roomy)
    assert not eng.policy.on_probation  # the growth was confirmed by a clean step


def test_failed_growth_backs_off_and_doubles_the_wait(peaks):
    small = (peaks[N // 2] + peaks[N]) // 2
    model, opt = make("mlp")
    # the engine plans against 10x the real capacity: every growth to N looks safe and OOMs
    cfg = EngineConfig(grow_after=2, capacity=10 * small)
    eng = Engine(model, opt, CE, global_batch_size=N, start=N // 2, config=cfg)
    waits, failed_at = [], []
    with emulate_capacity(small, track=(model, opt)):
        for i, batch in enumerate(batches(model, N, 21)):
            r = eng.step(batch)
            assert r.micro_batch_size == N // 2 and r.samples == N
            if r.ooms:
                failed_at.append(i)
                waits.append(eng.policy.wait)
    # clean steps between failures: 2, then 4, then 8 (the GradScaler pattern on the micro-batch)
    assert waits[:3] == [4, 8, 16]
    assert [b - a - 1 for a, b in zip(failed_at, failed_at[1:])][:2] == [4, 8]
    assert failed_at[0] == 2


def test_pressure_shrinks_before_an_oom(peaks):
    # the global batch fits, but its peak is above 95% of the capacity
    capacity = int(peaks[N] / 0.97)
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, start=N, config=EngineConfig(grow_after=2))
    with emulate_capacity(capacity, track=(model, opt)):
        results = [eng.step(b) for b in batches(model, N, 8)]
    assert sum(r.ooms for r in results) == 0
    hit = next(i for i, r in enumerate(results) if r.pressure)
    assert results[hit].micro_batch_size == N and results[hit].next_micro_batch_size < N
    # the memory model knows N is over the target: no regrowth into the pressure
    assert all(r.micro_batch_size < N for r in results[hit + 1:])


def test_allocator_retries_count_as_pressure(monkeypatch):
    capacity = 10 * peak_at("mlp", N, N)
    retries = iter([0, 0, 0, 3, 3, 3])  # the micro-batcher reads it when built and after every step
    monkeypatch.setattr(adapt_mod, "alloc_retries", lambda device: next(retries))
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, start=N, config=EngineConfig(grow_after=50))
    with emulate_capacity(capacity, track=(model, opt)):
        results = [eng.step(b) for b in batches(model, N, 5)]
    assert [r.pressure for r in results] == [False, False, True, False, False]
    assert [r.micro_batch_size for r in results] == [N, N, N, N // 2, N // 2]


def test_untracked_cpu_decides_on_real_memory_and_grows_back():
    # no tracker: the engine reads the process's resident memory against the host's limits,
    # and a machine with gigabytes free has room for the whole batch again after the OOM
    model, opt = make("mlp")
    eng = Engine(model, opt, InjectOOM(CE, at={0}), global_batch_size=N, start=N, config=EngineConfig(grow_after=1))
    results = [eng.step(b) for b in batches(model, N, 6)]
    assert results[0].ooms == 1 and results[0].micro_batch_size == N // 2
    assert all(r.measured and r.memory == "resident" for r in results)
    assert results[-1].micro_batch_size == N and sum(r.ooms for r in results) == 1


def test_adapt_false_keeps_only_the_oom_retry(peaks):
    model, opt = make("mlp")
    eng = Engine(model, opt, InjectOOM(CE, at={0}), global_batch_size=N, start=N,
                 config=EngineConfig(grow_after=1, adapt=False))
    with emulate_capacity(10 * peaks[N], track=(model, opt)):
        results = [eng.step(b) for b in batches(model, N, 5)]
    assert results[0].ooms == 1
    assert {r.micro_batch_size for r in results} == {N // 2}


def test_auto_start_asks_the_finder_and_leaves_the_state_alone(peaks):
    capacity = (peaks[N // 2] + peaks[N]) // 2
    model, opt = make("mlp")
    ref = Engine(model, opt, CE, global_batch_size=N, micro_batch_size=N)
    ref_losses = [ref.step(b).loss for b in batches(model, N, 3)]
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N)
    with emulate_capacity(capacity, track=(model, opt)):
        results = [eng.step(b) for b in batches(model, N, 3)]
    assert 1 <= results[0].micro_batch_size < N
    assert eng.fit.prior is not None  # the finder's memory line seeds the engine's
    assert sum(r.ooms for r in results) == 0
    # the finder's trials were undone: the run is the plain one
    torch.testing.assert_close([r.loss for r in results], ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_close(params(model), params(ref.model))


def test_pressure_that_a_smaller_micro_batch_cannot_relieve_stops_shrinking(caplog):
    # AdamW on the default MLP: weights, gradients and two moments are most of the peak
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = next(batches(model, 256, 1))
    Engine(model, opt, CE, global_batch_size=256, micro_batch_size=256).step(batch)  # Adam state exists
    peaks = {}
    for micro in (16, 32):
        m, o = copy.deepcopy((model, opt))
        with track_peak("cpu", track=(m, o, batch)) as measured:
            Engine(m, o, CE, global_batch_size=256, micro_batch_size=micro).step(batch)
        peaks[micro] = measured.peak_bytes
    assert peaks[32] - peaks[16] < 0.05 * peaks[16]  # halving the micro-batch barely helps
    capacity = int(peaks[16] / 0.93)  # every micro-batch from 16 up is above a 0.9 high-water mark
    eng = Engine(model, opt, CE, global_batch_size=256, start=256, config=EngineConfig(high_water=0.9))
    with caplog.at_level("WARNING", logger="batchpilot.train.adapt"):  # the micro-batch's own logger
        with emulate_capacity(capacity, track=(model, opt)):
            results = [eng.step(b) for b in batches(model, 256, 6)]
    sizes = [r.micro_batch_size for r in results]
    assert all(r.pressure for r in results)
    # it shrank until the memory model saw that halving does not lower the peak, then stopped
    assert sizes == sorted(sizes, reverse=True) and sizes[0] < 256
    assert sizes[-1] >= 16 and len(set(sizes[-4:])) == 1
    assert sum("would not relieve" in m for m in caplog.messages) == 1  # warned once
