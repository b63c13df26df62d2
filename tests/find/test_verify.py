"""The answer has run in the state the search leaves: verification after the last OOM, step-down when it fails.

A simulated device stands in for a GPU's allocator (its figures are the gauge's, stubbed): every
OOM leaves some of its memory behind (fragmented cached blocks that ``empty_cache`` cannot give
back), so a size that fitted before an OOM may not fit after it.
"""

from __future__ import annotations

import pytest
import torch

from batchpilot.find import finder, search
from batchpilot.find.finder import find_batch_size
from batchpilot.memory.gauge import Gauge
from batchpilot.policy.search import FIT, OOM

MB = 2**20


class SimulatedDevice(Gauge):
    """``fixed + per_sample × b`` on top of what it holds; each OOM leaves ``left_per_oom`` held, up to ``most_left``."""

    kind = "device"

    def __init__(self, *, capacity: int, held: int, fixed: int, per_sample: int, left_per_oom: int,
                 most_left: int = 10**12) -> None:
        super().__init__(torch.device("cpu"))
        self.cap, self.held, self.fixed, self.per_sample, self.left = capacity, held, fixed, per_sample, left_per_oom
        self.most = held + most_left
        self._peak = held
        self.steps: list[int] = []

    def step(self, b: int) -> None:
        need = self.held + self.fixed + self.per_sample * b
        self._peak = max(self._peak, min(need, self.cap))
        self.steps.append(b)
        if need > self.cap:
            self.held = min(self.most, self.held + self.left)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {need - self.cap} bytes")

    def capacity(self) -> int:
        return self.cap

    def current(self) -> int:
        return self.held

    def peak(self) -> int:
        return self._peak

    def reset(self) -> None:
        self._peak = self.held

    def synchronize(self) -> None:
        pass


@pytest.fixture
def device(monkeypatch):
    # fragments that the allocator cannot give back: 12 MB per OOM, 60 MB in all
    sim = SimulatedDevice(capacity=1000 * MB, held=100 * MB, fixed=50 * MB, per_sample=4 * MB, left_per_oom=12 * MB,
                          most_left=60 * MB)
    monkeypatch.setattr(search, "gauge_for", lambda dev, emulated_capacity=None: sim)
    return sim


def test_an_answer_that_ran_before_the_last_oom_runs_again_and_steps_down_when_it_no_longer_fits(device):
    # binsearch brackets with OOMs: its answer ran before the last of them, which left 12 MB behind
    plan = find_batch_size(device.step, device="cpu", strategy="binsearch", target=1.0)
    ooms = [i for i, t in enumerate(plan.trials) if t.outcome == OOM]
    assert plan.verified and ooms and ooms[-1] < len(plan.trials) - 1
    last = plan.trials[-1]
    assert last.outcome == FIT and last.batch_size == plan.batch_size == plan.largest_fitting
    # the OOMs took 60 MB for good: the answer fits in the memory that is left, close to the most that does
    most = (device.cap - device.held - device.fixed) // device.per_sample
    assert 0.95 * most <= plan.batch_size <= most
    # one verification of the search's answer (it ran out), one step down along the line (it ran)
    assert plan.stop_reason == "verification" and [t.outcome for t in plan.trials[-2:]] == [OOM, FIT]
    assert plan.trials[-2].batch_size == max(t.batch_size for t in plan.trials[:-2] if t.outcome == FIT)
    for _ in range(10):
        device.step(plan.batch_size)  # and it trains in the state the search left


def test_an_answer_that_ran_last_far_below_the_capacity_is_not_run_again(device):
    plan = find_batch_size(device.step, device="cpu", target=0.8)
    assert not plan.verified and plan.num_ooms == 0
    assert sum(t.batch_size == plan.batch_size for t in plan.trials) == 1


def test_when_nothing_runs_again_the_search_says_nothing_fits(monkeypatch):
    # a device whose every OOM leaves so much behind that nothing fits by the end
    sim = SimulatedDevice(capacity=1000 * MB, held=100 * MB, fixed=50 * MB, per_sample=4 * MB, left_per_oom=400 * MB)
    monkeypatch.setattr(search, "gauge_for", lambda dev, emulated_capacity=None: sim)
    with pytest.raises(finder.NothingFitsError):
        find_batch_size(sim.step, device="cpu", strategy="binsearch", target=1.0)


def test_a_memory_line_that_does_not_rise_is_no_model():
    from batchpilot.policy.search import Trial

    # the second trial starts 4 MB above the first (what the first left behind): from the search's
    # baseline the peaks rise by 1 MB a sample, not the raw 1.4 MB
    crept = [Trial(batch_size=b, outcome=FIT, peak_bytes=p, start_bytes=s)
             for b, p, s in ((10, 110 * MB, 100 * MB), (20, 124 * MB, 104 * MB))]
    assert search.memory_line(crept, limit=200 * MB, base=100 * MB) == pytest.approx((100 * MB, 1 * MB))
    # raw peaks that fall with the batch (noise larger than the samples between two trials): no line
    falling = [Trial(batch_size=b, outcome=FIT, peak_bytes=p, start_bytes=100 * MB)
               for b, p in ((10, 130 * MB), (20, 125 * MB))]
    assert search.memory_line(falling, limit=200 * MB, base=100 * MB) is None
