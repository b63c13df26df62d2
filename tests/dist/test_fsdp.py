"""batchpilot.dist.fsdp: FSDP2 in the engine and the finder (lockstep, replay, hang guard), and its planner.

The 2-rank tests launch torchrun once for the engine, finder and planner scenarios
(tests/helpers/fsdp_worker.py) and once more for the hang guard, which aborts its process
group. The single-process tests run FSDP2 over a one-rank gloo group in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from batchpilot.app.models import MLP, TinyGPT
from batchpilot.core.sharding import all_fsdp_param_groups, fsdp_roots, is_fsdp, reset_fsdp_state, shard_blocks, shard_model
from batchpilot.dist import distributed as bd
from batchpilot.dist.fsdp import FSDPCoordinator
from batchpilot.memory.probes import emulate_capacity, track_peak
from batchpilot.plan.planner import estimate_peak_memory, plan_batch_size
from batchpilot.plan.result import PlanningError
from batchpilot.train.engine import Engine, EngineConfig, LocalCoordinator

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HELPERS))
import fsdp_common as fc  # noqa: E402
from dist_launch import ROOT, assert_params_close, read_result, torchrun  # noqa: E402

WORKER = HELPERS / "fsdp_worker.py"
EXAMPLE = ROOT / "examples" / "fsdp_train.py"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    torchrun(WORKER, str(out), "exact", "find", "plan-peak", timeout=240)
    return out


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process, and a 1-D mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


# -- without a launch ------------------------------------------------------------------------------


def test_shard_blocks_finds_the_repeated_layers():
    mlp = MLP(in_features=8, width=16, depth=3)
    assert shard_blocks(mlp) == [m for m in mlp.net if isinstance(m, nn.Linear)]
    gpt = TinyGPT(vocab=32, dim=16, heads=2, layers=3, max_len=8)
    assert shard_blocks(gpt) == list(gpt.blocks)
    assert shard_blocks(nn.Linear(2, 2)) == []
    assert not is_fsdp(mlp) and fsdp_roots(mlp) == []


def test_collective_oom_error_is_never_retried_as_an_oom_and_pickles():
    import pickle

    from batchpilot.dist.fsdp import CollectiveOOMError
    from batchpilot.memory.oom import is_oom

    exc = CollectiveOOMError("rank 1 ran out of memory at micro-batch 8: CUDA out of memory. Tried to allocate 2 GiB",
                             rank=1, micro_batch_size=8, step=3)
    assert not is_oom(exc) and is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    back = pickle.loads(pickle.dumps(exc))
    assert (str(back), back.rank, back.micro_batch_size, back.step) == (str(exc), 1, 8, 3)


def test_shard_model_needs_a_process_group_or_a_mesh():
    with pytest.raises(RuntimeError, match="needs a process group"):
        shard_model(MLP(in_features=8, width=16, depth=2))


def test_one_rank_engine_recovers_from_an_oom_mid_step_exactly(one_rank):
    # an OOM after the 2nd micro-batch's forward leaves FSDP half way and the 1st micro-batch's
    # gradients unsharded (no sync yet): the retry must start from nothing
    model = shard_model(fc.build(), mesh=one_rank)
    assert is_fsdp(model) and fsdp_roots(model) == [model]
    opt = fc.make_optimizer(model.parameters())
    loss_fn = fc.InjectLoss(fc.Clock, {(1, 1), (2, 2)})
    engine = Engine(model, opt, loss_fn, global_batch_size=fc.GLOBAL, start=32, config=EngineConfig(capacity=fc.BIG))
    assert isinstance(engine.coordinator, FSDPCoordinator)  # chosen by itself, also on one rank
    ooms = []
    with emulate_capacity(fc.BIG, track=(model, opt)):
        for step in range(3):
            fc.Clock.step = step
            ooms.append(engine.step(fc.global_batch(step)).ooms)
    assert ooms == [0, 1, 1] and loss_fn.injected == 2
    assert_params_close(fc.full_params(model), fc.reference_params(3))


def test_reset_fsdp_state_drops_unsynced_gradients(one_rank):
    model = shard_model(fc.build(), mesh=one_rank)
    x, y = fc.global_batch(0)
    model.set_requires_gradient_sync(False)
    fc.ce_loss(model, (x, y)).backward()
    unsharded = [p._unsharded_param for g in all_fsdp_param_groups(model) for p in g.fsdp_params]
    assert any(p.grad is not None for p in unsharded)
    reset_fsdp_state(model)
    assert all(p.grad is None for p in unsharded)


def test_reset_fsdp_state_before_the_first_forward_is_a_no_op(one_rank):
    # an OOM before the sharded model ever ran (a loss_fn preparing its inputs, a finder's first
    # trial) recovers through this; FSDP's lazy init has not built what reset_iter_state() clears
    model = shard_model(fc.build(), mesh=one_rank)
    before = [p.detach().clone() for p in model.parameters()]
    reset_fsdp_state(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    fc.ce_loss(model, fc.global_batch(0)).backward()  # and the model trains afterwards
    assert all(p.grad is not None for p in model.parameters())


def test_engine_refuses_coordinators_and_fp16_that_cannot_run_fsdp(one_rank):
    model = shard_model(fc.build(), mesh=one_rank)
    opt = fc.make_optimizer(model.parameters())
    for coordinator in (LocalCoordinator(), bd.DistributedCoordinator()):
        with pytest.raises(ValueError, match="FSDPCoordinator"):
            Engine(model, opt, fc.ce_loss, global_batch_size=8, coordinator=coordinator)
    with pytest.raises(ValueError, match="amp='bf16'"):
        Engine(model, opt, fc.ce_loss, global_batch_size=8, amp="fp16")
    with pytest.raises(ValueError, match="fully_shard"):
        FSDPCoordinator().bind(fc.build())
    with pytest.raises(ValueError, match="find_batch_size_fsdp"):  # ranks cannot search alone
        bd.find_batch_size_distributed(lambda b: None, restore=(model, opt), capacity="1MiB")
    # sized by length on a sharded model: the FSDP coordinator keeps the sizer's searches in lockstep
    engine = Engine(model, opt, fc.ce_loss, global_batch_size=8, lengths=True)
    assert engine.lengths is not None and isinstance(engine.coordinator, FSDPCoordinator)


def test_a_snapshot_after_a_forward_without_backward_holds_the_sharded_parameters(one_rank):
    # generation or evaluation under no_grad leaves the root's parameters unsharded, registered in
    # its place; a snapshot of those would copy into storage FSDP frees at its next reshard
    from batchpilot.find.snapshot import StateSnapshot

    torch.manual_seed(0)
    model = shard_model(TinyGPT(vocab=16, dim=8, heads=1, layers=1, max_len=8), mesh=one_rank)  # the root owns params
    opt = fc.make_optimizer(model.parameters())
    ids = torch.randint(0, 16, (4, 8))
    with torch.no_grad():
        model(input_ids=ids)
    assert any(not hasattr(p, "to_local") for p in model.parameters())  # unsharded, as FSDP left them
    before = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    snap = StateSnapshot([model, opt])
    assert all(hasattr(p, "to_local") for p in model.parameters())  # resharded first
    model(input_ids=ids).sum().backward()
    opt.step()
    snap.restore()
    after = [p.full_tensor() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_storage_tracker_counts_sharded_parameters_and_in_place_resizes(one_rank):
    model = shard_model(fc.build(), mesh=one_rank)
    local = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
    with track_peak("cpu", track=(model,)) as m:
        pass
    assert m.start_bytes == local  # a DTensor counts by its local shard
    t = torch.empty(1000)
    st = t.untyped_storage()
    with track_peak("cpu") as m:
        st.resize_(0)
        st.resize_(8000)
    assert m.peak_bytes - m.start_bytes == 8000 and m.end_bytes - m.start_bytes == 8000
    with emulate_capacity(4000), pytest.raises(torch.OutOfMemoryError, match="resize_"):
        torch.empty(0).untyped_storage().resize_(8000)


def test_dtensor_sharding_propagation_allocates_nothing_under_an_emulated_capacity(one_rank):
    # DTensor propagates an operator's sharding on fake tensors at the full unsharded shape:
    # they own no memory, so an in-place add on a 4 MiB weight fits a 5 MiB device
    layer = fully_shard(nn.Linear(1024, 1024, bias=False), mesh=one_rank)
    before = layer.weight.full_tensor().clone()
    with emulate_capacity("5MiB", track=(layer,)) as probe:
        start = probe.current()
        with torch.no_grad():
            layer.weight.add_(1.0)
        assert probe.current() == probe.peak() == start == 4 * 2**20
    assert torch.equal(layer.weight.full_tensor(), before + 1)


def _example(*args: str) -> subprocess.Popen:
    """``python examples/fsdp_train.py ARGS``: one rank, its own gloo group."""
    return subprocess.Popen([sys.executable, str(EXAMPLE), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def test_one_rank_example_under_an_emulated_capacity_trains_or_says_nothing_fits():
    # 4 MiB holds a step at batch 1 (3.06 MiB tracked with accumulation) under the 80% target;
    # 3 MiB does not: the honest answer is "nothing fits" with the real peak, not DTensor's error
    fits, small = _example("--steps", "3", "--capacity", "4MiB"), _example("--steps", "3", "--capacity", "3MiB")
    (out, err), (small_out, small_err) = fits.communicate(timeout=240), small.communicate(timeout=240)
    assert fits.returncode == 0, err[-4000:]
    assert sum(line.startswith("epoch 0 step") for line in out.splitlines()) == 3, out
    assert small.returncode == 1 and "Sharding propagation" not in small_err, small_err[-4000:]
    assert "NothingFitsError: nothing fits on cpu: batch size 1" in small_err, small_err[-4000:]


def test_two_rank_example_too_small_for_one_sample_ends_with_the_real_reason():
    # rank 1's 2 MiB is under a step at one sample (2.20 MiB tracked): every rank ends, naming it
    with pytest.raises(AssertionError) as failed:
        torchrun(EXAMPLE, "--capacity", "6MiB,2MiB", timeout=180)
    text = str(failed.value)
    assert "Sharding propagation" not in text, text
    assert "rank 1 ran out of memory" in text or "nothing fits" in text, text


# -- the planner --------------------------------------------------------------------------------------

SAMPLE = (torch.randn(2, fc.FEATURES), torch.randint(0, fc.CLASSES, (2,)))


def test_fake_plan_at_world_2_equals_the_real_two_rank_tracked_peak(launched):
    est = estimate_peak_memory(fc.build(), SAMPLE, fc.PLAN_BATCH, optimizer=fc.make_optimizer,
                               loss_fn=fc.ce_loss, world_size=2, sharding="fsdp2")
    for rank in (0, 1):
        real = read_result(launched, f"plan_rank{rank}.json")
        assert est.peak_bytes == real["peak"]  # byte for byte, on every rank
        assert est.parameters == real["start"]  # the shards the rank holds before the step
    parts = ("parameters", "buffers", "inputs", "gradients", "optimizer_state", "activations",
             "unsharded_parameters", "communication")
    assert sum(getattr(est, k) for k in parts) == est.peak_bytes
    assert est.unsharded_parameters > 0 and est.communication > 0
    assert (est.world_size, est.sharding) == (2, "fsdp2")


def test_sharded_plans_shrink_with_the_world_and_grow_the_batch():
    kw = dict(optimizer=fc.make_optimizer, loss_fn=fc.ce_loss, sharding="fsdp2")
    peaks = [estimate_peak_memory(fc.build(), SAMPLE, 8, world_size=w, **kw) for w in (2, 4, 8)]
    assert peaks[0].parameters == 2 * peaks[1].parameters == 4 * peaks[2].parameters
    steps = 4 * len(list(fc.build().parameters()))  # AdamW's step counters: one fp32 scalar per parameter
    moments = [p.optimizer_state - steps for p in peaks]
    assert moments[0] == 2 * moments[1] == 4 * moments[2]
    assert peaks[0].peak_bytes > peaks[1].peak_bytes > peaks[2].peak_bytes
    cap = 3 * peaks[0].peak_bytes // 2
    one, eight = (plan_batch_size(fc.build(), SAMPLE, capacity=cap, target=1.0, world_size=w, max_batch_size=512, **kw)
                  for w in (2, 8))
    assert eight.batch_size > one.batch_size > 0 and (eight.world_size, eight.sharding) == (8, "fsdp2")
    assert eight.estimate.required_bytes <= cap < eight.next_estimate.required_bytes


def test_planner_sharding_arguments_are_checked():
    with pytest.raises(ValueError, match="needs sharding='fsdp2'"):
        estimate_peak_memory(fc.build(), SAMPLE, 4, world_size=4)
    with pytest.raises(ValueError, match="sharding must be"):
        estimate_peak_memory(fc.build(), SAMPLE, 4, world_size=4, sharding="zero3")
    with pytest.raises(ValueError, match="world_size"):
        estimate_peak_memory(fc.build(), SAMPLE, 4, world_size=0, sharding="fsdp2")


def test_sharded_plan_inside_a_running_process_group_is_refused(one_rank):
    with pytest.raises(PlanningError, match="before init_process_group"):
        estimate_peak_memory(fc.build(), SAMPLE, 4, world_size=4, sharding="fsdp2")


# -- 2 ranks under torchrun -------------------------------------------------------------------------


def test_engine_survives_ooms_outside_and_inside_collectives_exactly(launched):
    r0, r1 = (read_result(launched, f"exact_rank{r}.json") for r in (0, 1))
    assert r0["coordinator"] == r1["coordinator"] == "FSDPCoordinator"
    key = [(s["micro"], s["accum"], s["ooms"]) for s in r0["steps"]]
    assert key == [(s["micro"], s["accum"], s["ooms"]) for s in r1["steps"]]  # lockstep
    assert [s["ooms"] for s in r0["steps"]] == [int(i in fc.EXACT_OOM_STEPS) for i in range(fc.STEPS)]
    # each injection fired once: rank 1 after a forward and in an all-gather buffer, rank 0 in a
    # reduce-scatter buffer; each rank replayed its own and followed the other's
    assert r1["injected"] == {"loss": 1, "all_gather": 1, "reduce_scatter": 0}
    assert r0["injected"] == {"loss": 0, "all_gather": 0, "reduce_scatter": 1}
    assert (r0["replays"], r0["remote_ooms"]) == (1, 2)
    assert (r1["replays"], r1["remote_ooms"]) == (2, 1)
    # the same training as one process on the whole global batch, without any OOM
    assert_params_close(torch.load(launched / "exact_params.pt"), fc.reference_params())


def test_engine_finder_runs_in_lockstep_and_the_smaller_device_sets_the_micro_batch(launched):
    r0, r1 = (read_result(launched, f"find_rank{r}.json")["engine"] for r in (0, 1))
    assert r0 == r1  # the same trials, peaks and answer on both ranks
    per_rank = fc.GLOBAL // 2
    assert 1 <= r0["plan_batch"] < per_rank and r0["limited_by_rank"] == 1
    assert all(s["micro"] == r0["plan_batch"] for s in r0["steps"])
    assert_params_close(torch.load(launched / "find_engine_params.pt"), fc.reference_params(3))


def test_find_batch_size_fsdp_agrees_after_each_trial_and_restores_the_shards(launched):
    r0, r1 = (read_result(launched, f"find_rank{r}.json")["direct"] for r in (0, 1))
    assert r0["trials"] == r1["trials"] and r0["batch_size"] == r1["batch_size"]
    assert 8 <= r0["batch_size"] < 16  # rank 1's device sits between the peaks at 8 and 16
    assert any(outcome == "oom" for _, outcome, _ in r0["trials"])
    assert r0["replays"] == 0 and r1["replays"] >= 1  # only rank 1 ran out; rank 0 waited for its replay
    assert r0["limited_by_rank"] == r1["limited_by_rank"] == 1
    assert r0["restored"] and r1["restored"] and r0["state_restored"] and r1["state_restored"]
    for rank in (0, 1):  # find_batch_size_for on a model sharded over ranks searches in lockstep by itself
        generic = read_result(launched, f"find_rank{rank}.json")["generic"]
        # its own step (slices of the example batch, the loss through the engine's rules) holds more
        # than the direct one's, so rank 1's device bounds it below 16 without pinning it to 8
        assert 1 <= generic["batch_size"] < 16 and generic["limited_by_rank"] == 1
        assert any(outcome == "oom" for _, outcome, _ in generic["trials"])  # rank 1 ran out, in lockstep
        assert generic == read_result(launched, "find_rank0.json")["generic"]  # the same trials everywhere
        refusal = read_result(launched, f"find_rank{rank}.json")["finder_layer"]
        assert "batchpilot.find_batch_size_for" in refusal and "search=" in refusal


def test_an_oom_no_replay_can_survive_ends_every_rank_with_the_rank_and_size(tmp_path):
    began = time.perf_counter()
    with pytest.raises(AssertionError, match="CollectiveOOMError"):
        # a 60 s process-group timeout: a rank left waiting would take that long at least
        torchrun(WORKER, str(tmp_path), "guard", timeout=120, env={"PG_TIMEOUT_S": "60"})
    assert time.perf_counter() - began < 60
    said = f"rank 1 ran out of memory at micro-batch {fc.GUARD_MICRO} (step {fc.GUARD_FROM + 1}"
    for rank in (0, 1):
        # every rank logged the error naming the rank and the size (rank 0 from its watchdog, while
        # it still waited in a collective; rank 1 when it gave up)
        assert said in (tmp_path / f"guard_rank{rank}.log").read_text(), rank
    r1 = read_result(tmp_path, "guard_rank1.json")
    assert r1["error"] == "CollectiveOOMError" and r1["seconds"] < 30
    assert (r1["rank"], r1["micro_batch_size"], r1["step"]) == (1, fc.GUARD_MICRO, fc.GUARD_FROM + 1)
    r0 = tmp_path / "guard_rank0.json"
    if r0.exists():  # rank 0 raises too when its collective fails, unless the launcher stopped it first
        r0 = json.loads(r0.read_text())
        assert r0["error"] == "CollectiveOOMError" and said in r0["message"] and r0["seconds"] < 30
