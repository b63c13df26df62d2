"""The engine under DistributedDataParallel (one gloo rank): one gradient sync per global batch."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from batchpilot.train.engine import Coordinator, Engine, EngineConfig, LocalCoordinator

from engine_utils import CE, InjectOOM, assert_params_close, batches, make, one_thread, params  # noqa: F401

N, MICRO = 16, 4

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")


@pytest.fixture
def gloo(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _ddp_with_counters():
    model, opt = make("mlp")
    ddp = DDP(model)
    hooks = []

    def count_allreduce(state, bucket):
        hooks.append(bucket.index())
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, count_allreduce)
    flags = []

    def loss_fn(m, b):
        flags.append(m.require_backward_grad_sync)
        return CE(m, b)

    return ddp, model, opt, hooks, flags, loss_fn


def _reference(steps=3):
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, micro_batch_size=MICRO)
    losses = [eng.step(b).loss for b in batches(model, N, steps)]
    return losses, params(model)


def test_ddp_syncs_once_per_global_batch(gloo):
    ref_losses, ref_params = _reference()
    ddp, model, opt, hooks, flags, loss_fn = _ddp_with_counters()
    eng = Engine(ddp, opt, loss_fn, global_batch_size=N, micro_batch_size=MICRO)
    losses = [eng.step(b).loss for b in batches(model, N, 3)]
    assert flags == [False, False, False, True] * 3  # no_sync for all but the last micro-batch
    assert len(hooks) == 3  # one bucket, all-reduced once per step
    assert_params_close(params(model), ref_params)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7)


def test_ddp_oom_in_the_syncing_micro_batch_retries_cleanly(gloo):
    ref_losses, ref_params = _reference()
    ddp, model, opt, hooks, flags, loss_fn = _ddp_with_counters()
    # call 3 is the last (syncing) micro-batch of the first attempt; its forward ran, no backward
    eng = Engine(ddp, opt, InjectOOM(loss_fn, at={3}), global_batch_size=N, start=MICRO)
    results = [eng.step(b) for b in batches(model, N, 3)]
    assert [r.ooms for r in results] == [1, 0, 0]
    assert [r.micro_batch_size for r in results] == [MICRO // 2] * 3
    # DDP's forward of the failed micro-batch armed its reducer, so the retry's first backward
    # all-reduces too: with one process an average of averages (harmless); with several, the
    # other ranks would not join it -- which is why multi-rank runs use a deferring coordinator
    assert len(hooks) == 4
    assert_params_close(params(model), ref_params)
    torch.testing.assert_close([r.loss for r in results], ref_losses, rtol=1e-6, atol=1e-7)


def test_finder_trials_run_the_inner_module_and_are_undone(gloo):
    ref_losses, ref_params = _reference()
    ddp, model, opt, hooks, flags, loss_fn = _ddp_with_counters()
    wrapper_calls = []
    ddp.register_forward_pre_hook(lambda module, args: wrapper_calls.append(1))
    seen = []

    def recording_loss(m, b):
        seen.append(m)
        return loss_fn(m, b) if m is ddp else CE(m, b)

    # no start: the first step runs the finder on the first batch
    eng = Engine(ddp, opt, recording_loss, global_batch_size=N, micro_batch_size="auto",
                 config=EngineConfig(capacity=2**30))
    losses = [eng.step(b).loss for b in batches(model, N, 3)]
    trials = [m for m in seen if m is not ddp]
    assert trials and all(m is model for m in trials)  # the finder called the module inside DDP
    # the wrapper ran exactly the training micro-batches: no trial synchronised or broadcast
    assert len(wrapper_calls) == len(seen) - len(trials) == 3 * eng.accum_steps
    assert len(hooks) == 3
    assert_params_close(params(model), ref_params)  # the trials were undone
    torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-7)


class DeferringCoordinator(LocalCoordinator):
    """What batchpilot.dist.distributed supplies: agree first, then all-reduce the gradients."""

    defer_grad_sync = True

    def __init__(self):
        self.oom_votes, self.syncs, self.proposals = [], 0, []

    def agree_oom(self, oom):
        self.oom_votes.append(oom)
        return oom

    def agree_micro_batch(self, size):
        self.proposals.append(size)
        return size

    def sync_gradients(self, model):
        self.syncs += 1
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


def test_deferred_sync_runs_every_micro_batch_without_sync_then_agrees(gloo):
    ref_losses, ref_params = _reference()
    ddp, model, opt, hooks, flags, loss_fn = _ddp_with_counters()
    coord = DeferringCoordinator()
    assert isinstance(coord, Coordinator)
    eng = Engine(ddp, opt, InjectOOM(loss_fn, at={2}), global_batch_size=N, start=MICRO, coordinator=coord)
    results = [eng.step(b) for b in batches(model, N, 3)]
    assert not any(flags) and hooks == []  # DDP's own all-reduce never ran
    assert coord.syncs == 3  # the coordinator's ran once per step, after the agreement
    assert coord.oom_votes == [True, False, False, False]
    # the first micro-batch size, once per OOM retry, once per step end
    assert coord.proposals == [MICRO, MICRO // 2, MICRO // 2, MICRO // 2, MICRO // 2]
    assert [r.ooms for r in results] == [1, 0, 0]
    assert_params_close(params(model), ref_params)
    torch.testing.assert_close([r.loss for r in results], ref_losses, rtol=1e-6, atol=1e-7)


def test_remote_oom_drops_the_local_gradients():
    # another rank ran out of memory: this one's complete gradients must not be stepped
    class RemoteOOM(LocalCoordinator):
        votes = iter([True, False])

        def agree_oom(self, oom):
            return next(self.votes) or oom

    ref_losses, ref_params = _reference(steps=1)
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=N, start=MICRO, coordinator=RemoteOOM())
    r = eng.step(next(batches(model, N, 1)))
    assert r.ooms == 1 and r.micro_batch_size == MICRO // 2
    assert_params_close(params(model), ref_params)
