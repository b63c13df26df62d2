"""batchpilot.train.schedule.GlobalBatch: the engine's global batch and its schedule, as a part with its own state."""

from __future__ import annotations

import logging

import pytest

from batchpilot.policy.schedule import RampSchedule
from batchpilot.train.schedule import GlobalBatch


def test_sizes_are_checked_and_the_per_rank_share_follows():
    batch = GlobalBatch(64, world_size=2)
    assert (batch.size, batch.per_rank, batch.reference, batch.schedule) == (64, 32, 64, None)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        GlobalBatch(0)
    with pytest.raises(ValueError, match="each rank trains on an equal share"):
        batch.resize(33)
    assert (batch.size, batch.per_rank) == (64, 32)  # a refused size changes nothing
    batch.resize(96)
    assert (batch.size, batch.per_rank, batch.reference) == (96, 48, 64)
    with pytest.raises(TypeError, match="schedule must be"):
        GlobalBatch(64, schedule=3)


def test_a_ramp_moves_it_by_the_samples_seen_and_the_loader_is_watched(caplog):
    batch = GlobalBatch(128, schedule=RampSchedule(start=32, increment=32, samples=300))
    assert batch.initial() == 32
    batch.resize(32)
    sizes = []
    for step in range(1, 8):
        batch.count(batch.per_rank)
        new = batch.next_size(step, lambda: pytest.fail("a ramp reads no noise scale"))
        if new != batch.size:
            batch.resize(new)
            batch.mark_change(step)
        sizes.append(batch.size)
    assert sizes == [32, 32, 32, 64, 64, 96, 128] and batch.samples == 32 * 4 + 64 * 2 + 96
    assert batch.last_change == 7
    with caplog.at_level(logging.WARNING, logger="batchpilot.train.schedule"):
        batch.check_loader(100)
        batch.check_loader(100)  # two short batches in a row: the loader did not follow
    assert "the data loader did not follow" in caplog.text


def test_its_state_resumes_the_schedule_on_another_world_size(caplog):
    saved = GlobalBatch(128, schedule="ramp:32,32,300")
    saved.resize(96)
    saved.count(96)
    saved.mark_change(5)
    state = saved.state_dict()
    assert state == {"global_batch_size": 96, "world_size": 1, "samples": 96, "reference_batch_size": 128,
                     "last_batch_change": 5, "schedule": "ramp:32,32,300"}
    # three ranks cannot split 96 samples by the ramp's granule: the part says where to continue
    resumed = GlobalBatch(129, world_size=3, schedule="ramp:32,32,300")
    with caplog.at_level(logging.WARNING, logger="batchpilot.train.schedule"):
        at = resumed.load_state_dict(state)
    assert "saved with global_batch_size=128 as the schedule's reference" in caplog.text
    assert resumed.size == 96 and (resumed.samples, resumed.last_change) == (96, 5)
    assert at == RampSchedule(start=32, increment=32, samples=300).for_world(96, 129, 3)
    # without a schedule the global batch stays this one's
    plain = GlobalBatch(64)
    with caplog.at_level(logging.WARNING, logger="batchpilot.train.schedule"):
        assert plain.load_state_dict(state) is None
    assert plain.size == 64 and plain.samples == 96 and "saved for a global batch of 96" in caplog.text
