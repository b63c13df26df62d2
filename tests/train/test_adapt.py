"""MicroBatcher (batchpilot.train.adapt) through its interface, driving real training steps.

A hand-written accumulation loop plays the engine's part: it runs each attempt at the
micro-batch the batcher names, measures the attempt's peak and reports the outcome, so the
sequence of micro-batches, their reasons and the final parameters can be asserted.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from batchpilot.dist.coordinator import LocalCoordinator
from batchpilot.memory.gauge import gauge_for
from batchpilot.memory.oom import attempt
from batchpilot.memory.probes import emulate_capacity
from batchpilot.memory.tracker import active_tracker
from batchpilot.policy.microbatch import balanced_sizes
from batchpilot.train.adapt import MicroBatcher
from batchpilot.train.retry import BatchDoesNotFitError

from engine_utils import CE, GLOBAL, assert_params_close, batches, make, one_thread, params, peak_at  # noqa: F401

N = GLOBAL["mlp"]
CPU = torch.device("cpu")


class Peers(LocalCoordinator):
    """A world of one whose ``agree`` reports another rank's OOM at the calls named (0-based)."""

    def __init__(self, remote_oom_at: set[int] = frozenset()) -> None:
        self.remote_oom_at = set(remote_oom_at)
        self.agreements = 0

    def agree(self, oom: bool, size: int) -> tuple[bool, int]:
        index, self.agreements = self.agreements, self.agreements + 1
        return super().agree(oom or index in self.remote_oom_at, size)


def _batcher(coordinator=None, **overrides) -> MicroBatcher:
    knobs = dict(fixed=None, device=CPU, coordinator=coordinator or LocalCoordinator(),
                 capacity=lambda: active_tracker(CPU).capacity, target=0.8, high_water=1.0, adapt=True,
                 grow_after=2, backoff=2.0, max_wait=None, split_by_time=False, split_margin=0.05)
    return MicroBatcher(**(knobs | overrides))


def _accumulate(model, batch, micro: int) -> None:
    x, y = batch
    n = len(x)
    start = 0
    for size in balanced_sizes(n, -(-n // micro)):
        (CE(model, (x[start:start + size], y[start:start + size])) * (size / n)).backward()
        start += size


@dataclass
class Run:
    micro: int  # the attempt that succeeded
    ooms: int
    pressure: bool
    reason: str  # why the step ran at ``micro``
    peak: int  # of that attempt, over...
    start: int  # ...the bytes in use when it began


def _step(batcher: MicroBatcher, model, opt, batch) -> Run:
    """One optimizer step at the batcher's micro-batch, retried at a smaller one after an OOM."""
    gauge = gauge_for(CPU, emulated_capacity=active_tracker(CPU).capacity)
    ooms = 0
    while True:
        micro, reason = batcher.micro, batcher.reason
        gauge.reset()
        start = gauge.current()
        outcome = attempt(_accumulate, model, batch, micro, device=CPU, on_oom=lambda: opt.zero_grad(set_to_none=True))
        if outcome.oom:
            assert batcher.agree_failed()  # this rank ran out: every rank hears of it
        else:
            peak = gauge.peak()
            oom, pressure = batcher.agree_clean(micro, peak=peak, start_bytes=start, ooms=ooms)
            if not oom:
                opt.step()
                opt.zero_grad(set_to_none=True)
                return Run(micro, ooms, pressure, reason, peak, start)
        opt.zero_grad(set_to_none=True)
        ooms += 1
        batcher.shrink_after_oom(micro, outcome.message or "another rank ran out of memory")


def _warm(model, opt) -> None:
    """One step outside any emulation: the optimizer's momentum exists before the capacity matters."""
    _accumulate(model, next(batches(model, N, 1, seed=9)), N)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _attempt_peak(micro: int) -> Run:
    """A clean attempt's figures at ``micro`` on a warm copy of the model, with room to spare."""
    model, opt = make("mlp")
    _warm(model, opt)
    batcher = _batcher(adapt=False)
    batcher.start(N, micro, None)
    with emulate_capacity(100 * peak_at("mlp", N, N), track=(model, opt)):
        return _step(batcher, model, opt, next(batches(model, N, 1)))


def test_shrinks_on_a_real_oom_and_grows_back_when_memory_frees():
    half, whole = _attempt_peak(N // 2), _attempt_peak(N)
    small = (half.peak + whole.peak) // 2  # half the batch fits, all of it does not
    model, opt = make("mlp")
    _warm(model, opt)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own momentum buffers
    batcher = _batcher()
    assert batcher.micro is None and batcher.policy is None
    batcher.start(N, N, None)
    assert batcher.micro == N and batcher.split.accum_steps == 1
    data = batches(model, N, 7)
    with emulate_capacity(small, track=(model, opt)):
        runs = [_step(batcher, model, opt, next(data)) for _ in range(3)]
    with emulate_capacity(10 * small, track=(model, opt)):
        runs += [_step(batcher, model, opt, b) for b in data]
    # two clean steps waited at N / 2 under the small capacity, where the fit has no room for N;
    # the first clean step under the larger one grows (the retried step does not count as clean)
    assert [(r.micro, r.ooms) for r in runs] == [(N // 2, 1)] + [(N // 2, 0)] * 3 + [(N, 0)] * 3
    assert runs[0].reason == f"shrunk after an out-of-memory error at micro-batch {N}"
    assert runs[4].reason == (f"grown from {N // 2} after 2 clean steps: the memory fit has room for fewer "
                              "micro-batches")
    assert not batcher.policy.on_probation and batcher.fit.sizes == [N // 2, N]
    for b in batches(model, N, 7):  # the retried step is the step: the same update as the whole batch at once
        _accumulate(reference, b, N)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert_params_close(params(model), params(reference))


def test_another_ranks_oom_undoes_this_ranks_growth():
    model, opt = make("mlp")
    data = batches(model, N, 4)
    peers = Peers(remote_oom_at={1})  # the second step's first agreement: another rank ran out of memory
    batcher = _batcher(peers, grow_after=1)
    batcher.start(N, N // 4, None)
    with emulate_capacity(100 * peak_at("mlp", N, N), track=(model, opt)):
        first = _step(batcher, model, opt, next(data))
        assert (first.micro, first.ooms, batcher.micro) == (N // 4, 0, N)  # clean, with room: grown
        assert batcher.policy.on_probation
        second = _step(batcher, model, opt, next(data))
    # this rank's attempt at N succeeded and confirmed the growth; the agreement undid that, so
    # the OOM was charged to the growth on probation, as on the rank that ran out: back to N / 4
    # and a doubled wait (a confirmed N would have halved to N / 2, waiting 1)
    assert (second.micro, second.ooms) == (N // 4, 1)
    assert second.reason == f"shrunk after an out-of-memory error at micro-batch {N}"
    assert batcher.policy.wait == 2 and not batcher.policy.on_probation and peers.agreements == 3


def test_one_sample_that_does_not_fit_is_refused_with_the_fix():
    model, opt = make("mlp")
    batcher = _batcher()
    batcher.start(N, 1, None)
    with emulate_capacity(peak_at("mlp", N, 1) // 2, track=(model, opt)):
        with pytest.raises(BatchDoesNotFitError, match=r"micro-batch of 1 sample on cpu \(capacity .*\): .*amp='bf16'"):
            _step(batcher, model, opt, next(batches(model, N, 1)))


def test_pressure_shrinks_before_an_oom():
    whole = _attempt_peak(N)
    model, opt = make("mlp")
    _warm(model, opt)
    batcher = _batcher(high_water=0.95)
    batcher.start(N, N, None)
    with emulate_capacity(int(whole.peak / 0.97), track=(model, opt)):  # fits, above the high-water mark
        runs = [_step(batcher, model, opt, b) for b in batches(model, N, 2)]
    assert [(r.micro, r.ooms, r.pressure) for r in runs] == [(N, 0, True), (N // 2, 0, False)]
    assert runs[1].reason == f"shrunk from {N}: memory pressure (peak over the high-water mark)"


def test_a_size_decided_elsewhere_is_rounded_by_the_policy_and_kept_with_its_reason():
    batcher = _batcher()
    assert batcher.size_for(40, "sized for length 32", per_rank=N) == 32  # 64 in two: 32 + 32, not 40 + 24
    assert (batcher.micro, batcher.reason, batcher.policy.limit) == (32, "sized for length 32", N)
    assert batcher.size_for(10, "sized for length 128", per_rank=N) == 10  # 7 micro-batches: 10 x 1 + 9 x 6
    assert batcher.reason == "sized for length 128"


def test_resize_keeps_what_memory_allowed_and_the_state_round_trips():
    batcher = _batcher()
    batcher.start(64, 64, None)
    batcher.resize(96)
    assert batcher.micro == 48  # two balanced micro-batches under the 64 memory allowed
    batcher.resize(128)
    assert batcher.micro == 64  # back to the cap, not 43
    state = batcher.state_dict()
    assert set(state) == {"policy", "fit", "micro_cap"} and state["policy"]["micro"] == 64
    assert state["micro_cap"] == [64, 64]

    resumed = _batcher()
    resumed.load_state_dict(state, per_rank=128, same_world=True)
    assert resumed.state_dict() == state
    assert resumed.reason == "resumed from a checkpoint at micro-batch 64"
    other_world = _batcher()
    other_world.load_state_dict(state, per_rank=32, same_world=False)  # clamped; the cap was another world's
    assert other_world.micro == 32 and other_world.state_dict()["micro_cap"] is None


def test_a_fixed_micro_batch_never_moves():
    batcher = _batcher(fixed=8)
    assert (batcher.micro, batcher.reason, batcher.split) == (8, "fixed: micro_batch_size=8", None)
    batcher.resize(32)
    batcher.load_state_dict(_batcher().state_dict() | {"micro_batch_size": 4}, per_rank=64, same_world=True)
    assert batcher.micro == 8 and batcher.state_dict()["policy"] is None
