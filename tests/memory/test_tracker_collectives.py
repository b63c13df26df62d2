"""The tracker runs c10d collectives on uncounted copies: a sharded step's peak is one figure.

gloo's worker thread holds a collective's tensors until its work ends; were they the caller's,
the last reference to a buffer would die there at a moment that varies from run to run, and
gloo's own copy-out (a reduce-scatter's split, run when the caller waits) would charge tensors
of gloo's as host data. A one-process gloo group has the same worker thread.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from batchpilot.memory.probes import emulate_capacity, track_peak
from batchpilot.memory.tracker import StorageTracker


@pytest.fixture
def gloo():
    if dist.is_initialized():
        pytest.skip("a process group already runs in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_reduce_scatter_charges_nothing_but_its_callers_tensors(gloo):
    with StorageTracker() as tr:
        inp = torch.arange(8, dtype=torch.float32)
        out = torch.empty(8)
        assert tr.live == tr.peak == 64
        for _ in range(5):
            dist.reduce_scatter_single(output=out, input=inp)
        # without the copies, gloo's split of a tensor of its own counted as host data: peak 96
        assert (tr.live, tr.peak) == (64, 64)
        assert torch.equal(out, inp)
        assert tr.foreign_release_bytes == 0


def test_an_all_gather_into_its_own_input_writes_the_callers_output(gloo):
    with track_peak("cpu") as m:
        out = torch.full((6,), -1.0)
        inp = out.narrow(0, 0, 6)  # FSDP2 gathers into the buffer its input is a slice of
        inp.copy_(torch.arange(6.0))
        dist.all_gather_single(out, inp)
        got = out.clone()
    assert torch.equal(got, torch.arange(6.0))
    assert m.peak_bytes == 48  # out, then its clone: the collective's copies are not counted
    assert m.extra["foreign_release_bytes"] == 0


def test_an_async_all_reduce_gives_a_done_work_whose_future_holds_the_callers_tensors(gloo):
    # DDP's reducer reads the work's future: its value must be the tensors it passed
    with StorageTracker():
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        value = work.get_future().value()
    assert value[0] is t and torch.equal(t, torch.ones(4))


def test_the_copies_are_not_limited_by_an_emulated_capacity(gloo):
    inp = torch.ones(256)
    out = torch.empty(256)
    # room for exactly the two tensors: the copies gloo works on are no device memory
    with emulate_capacity(2 * 256 * 4, track=(inp, out)):
        dist.reduce_scatter_single(output=out, input=inp)
    assert torch.equal(out, inp)
