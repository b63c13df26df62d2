"""batchpilot.dist.distributed: agreements, OOM on one rank, distributed finder, elastic resume.

The multi-process tests launch the real launcher (torchrun, 2 ranks, gloo on CPU) once for
most scenarios (tests/helpers/dist_worker.py); the single-rank legs of the elastic round trip
and the references run in this process with the same code (tests/helpers/dist_common.py).
A hang is a failure: the workers' process group times out after 60 s, the launch after 120 s
(tests/helpers/dist_launch.py), and pytest's own timeout bounds each test.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from batchpilot.dist import distributed as bd, gradsync
from batchpilot.train.engine import Coordinator

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HELPERS))
import dist_common as dc  # noqa: E402
from dist_launch import (  # noqa: E402
    assert_params_close,
    read_result,
    rendezvous_lost_only,
    teardown_abort_only,
    torchrun,
)

WORKER = HELPERS / "dist_worker.py"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """One 2-rank launch for every scenario, between the two single-rank elastic legs."""
    out = tmp_path_factory.mktemp("dist")
    # 1 rank: 3 steps of the epoch, then a checkpoint the 2-rank run resumes from; its micro-batch
    # (the whole per-rank batch of 16) is larger than the 2-rank run's per-rank batch of 8
    dc.run_elastic(out, "save1", steps=3, save=out / "ckpt1.pt", micro=dc.ELASTIC_GLOBAL)
    torchrun(
        WORKER, str(out), "collectives", "find", "engine-find", "oom", "plain", "elastic-resume", "elastic-save",
        env={"ELASTIC_RESUME": str(out / "ckpt1.pt"), "ELASTIC_SAVE": str(out / "ckpt2.pt")},
        timeout=180,
    )
    # 1 rank again: resume the 2-rank checkpoint and finish the epoch
    dc.run_elastic(out, "resume1", steps=None, resume=out / "ckpt2.pt")
    return out


# -- without a process group ---------------------------------------------------------------------


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def test_only_gloos_teardown_abort_is_forgiven_and_only_after_the_work():
    abort = ("terminate called without an active exception\n"
             "E1201 api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 2838) of binary: python\n"
             "  exitcode  : -6 (pid: 2838)\n")
    assert teardown_abort_only(abort)
    assert not teardown_abort_only(abort + "  exitcode  : 1 (pid: 2837)\n")  # another rank failed for real
    assert not teardown_abort_only("failed (exitcode: -6) local_rank: 0")  # a SIGABRT of another kind
    # the aborting rank went first: the agent stopped the other, still in its teardown, with SIGTERM
    stopped = (abort + "W1204 api.py:1028] Sending process 5293 closing signal SIGTERM\n"
               "  exitcode  : -15 (pid: 5293)  (SIGTERM)\n")
    assert teardown_abort_only(stopped)
    assert not teardown_abort_only(stopped.replace("terminate called without an active exception\n", ""))
    assert not teardown_abort_only("  exitcode  : -15 (pid: 5293)\n")  # killed, and no abort beside it
    assert not teardown_abort_only(stopped.replace("closing signal SIGTERM", ""))  # -15 from elsewhere
    # on several nodes: the agent whose store closed under it after the other agent's abort
    lost = ("W1204 dynamic_rendezvous.py:1298] The node 'localhost_11348_0' has failed to shutdown the rendezvous "
            "'63684210' due to an error of type RendezvousConnectionError.\n"
            "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed.\n")
    assert rendezvous_lost_only(lost)
    assert not rendezvous_lost_only(lost + "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
                                    "  exitcode  : 1 (pid: 11360)\n")  # one of its own workers failed
    assert not rendezvous_lost_only("torch.distributed.DistNetworkError: Failed to recv")  # not at shutdown


def test_rank_helpers_read_torchrun_environment(monkeypatch):
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    assert (bd.is_distributed(), bd.rank(), bd.world_size(), bd.local_rank()) == (False, 0, 1, 0)
    assert bd.known_rank() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (bd.rank(), bd.world_size(), bd.local_rank(), bd.known_rank()) == (3, 4, 1, 3)
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(ValueError, match="RANK='three'"):
        bd.rank()


def test_rank_helpers_fall_back_to_slurm_and_torchrun_wins(monkeypatch):
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert (bd.rank(), bd.world_size(), bd.local_rank(), bd.known_rank()) == (5, 8, 2, 5)
    # torchrun inside a SLURM allocation: its own variables describe the job
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert (bd.rank(), bd.world_size(), bd.local_rank()) == (1, 2, 0)
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE=0 must be >= 1"):
        bd.world_size()
    monkeypatch.setenv("RANK", "-1")
    with pytest.raises(ValueError, match="RANK=-1 must be >= 0"):
        bd.rank()


def test_batching_and_data_use_the_distributed_rank_helpers(monkeypatch):
    # one owner of the lookup: the batch arithmetic and the sampler agree with it by construction
    from batchpilot.train import batching, data
    from batchpilot.train.batching import BatchConfig
    from batchpilot.train.data import ElasticBatchSampler

    assert batching._default_world_size is bd.world_size
    assert data._default_world_size is bd.world_size and data.known_rank is bd.known_rank
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert BatchConfig(global_batch_size=8).world_size == 2
    sampler = ElasticBatchSampler(10, 2)
    assert (sampler.num_replicas, sampler.rank) == (2, 1)


def test_agreements_are_local_without_a_process_group():
    assert bd.all_reduce_int(7, "min") == 7
    assert bd.agree_min_with_rank(5) == (5, 0)
    with pytest.raises(ValueError, match="op must be one of"):
        bd.all_reduce_int(1, "mean")
    coord = bd.DistributedCoordinator()
    assert isinstance(coord, Coordinator)  # the engine's hook
    assert coord.world_size == 1 and coord.defer_grad_sync
    assert coord.agree_oom(True) is True and coord.agree_oom(False) is False
    assert coord.agree_micro_batch(12) == 12 and coord.limited_by_rank == 0
    assert coord.agree(True, 9) == (True, 9) and coord.agree(False, 9) == (False, 9)
    assert coord.total_count(torch.tensor(5.0)).item() == 5.0
    model = nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()
    coord.sync_gradients(model)
    assert torch.equal(model.weight.grad, before)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bd.DistributedCoordinator(bucket_cap_mb=0)


def test_no_agreement_inside_an_oom_handler():
    coord = bd.DistributedCoordinator()
    try:
        raise torch.OutOfMemoryError("simulated")
    except torch.OutOfMemoryError:
        with pytest.raises(RuntimeError, match="leave the except block"):
            coord.agree_oom(True)
        with pytest.raises(RuntimeError, match="leave the except block"):
            bd.all_reduce_int(1, "max")
    try:
        raise KeyError("not an OOM")
    except KeyError:
        assert coord.agree_oom(False) is False  # only an OOM's handler pins the failed attempt
    assert coord.agree_oom(True) is True  # after the except block: fine


def test_buckets_split_by_dtype_and_cap():
    a, b = torch.zeros(10), torch.zeros(10)  # 40 bytes each
    c = torch.zeros(10, dtype=torch.bfloat16)
    d = torch.zeros(30)
    assert [len(x) for x in gradsync._buckets([a, b, c, d], cap_bytes=100)] == [2, 1, 1]
    assert [len(x) for x in gradsync._buckets([a, b, d], cap_bytes=80)] == [2, 1]
    assert gradsync._buckets([], cap_bytes=80) == []


def test_unwrap_model_leaves_plain_modules_alone():
    m = nn.Linear(2, 2)
    assert bd.unwrap_model(m) is m


def test_find_without_a_process_group_is_the_local_search():
    model, opt = dc.oom_model()
    x, y = torch.randn(64, dc.OOM_FEATURES), torch.randint(0, 10, (64,))

    def step(b: int) -> None:
        opt.zero_grad(set_to_none=True)
        dc.ce_loss(model, (x[:b].clone(), y[:b].clone())).backward()
        opt.step()

    plan = bd.find_batch_size_distributed(step, device="cpu", capacity="4MiB", max_batch_size=64,
                                          restore=(model, opt))
    assert plan.batch_size == 64 and plan.limited_by_rank == 0


# -- 2 ranks under torchrun ----------------------------------------------------------------------


def test_collectives_agree_on_min_max_sum_and_rank(launched):
    r0, r1 = (read_result(launched, f"collectives_rank{r}.json") for r in (0, 1))
    for rank, r in enumerate((r0, r1)):
        assert (r["rank"], r["world"], r["local_rank"]) == (rank, 2, rank)
        assert (r["min"], r["max"], r["sum"]) == (10, 11, 21)
        assert r["min_with_rank"] == [2, 1]
        assert r["tie"] == [7, 0]
        assert r["negative"] == [-4, 1]


def test_one_agreement_carries_the_oom_vote_and_the_next_micro_batch(launched):
    r0, r1 = (read_result(launched, f"collectives_rank{r}.json") for r in (0, 1))
    for r in (r0, r1):
        assert r["agree_clean"] == [False, 6] and r["agree_limited_by"] == 1
        assert r["agree_oom"][0] is True
        assert r["agree_collectives"] == 2  # one collective per agreement
    assert (r0["agree_remote_ooms"], r1["agree_remote_ooms"]) == (1, 0)


def test_sync_gradients_averages_like_ddp(launched):
    for rank in (0, 1):
        r = read_result(launched, f"collectives_rank{rank}.json")
        # (rank-0 value + rank-1 value) / 2, a missing gradient counting as zero
        assert r["grads"] == {
            "both": [1.5], "only_rank1": [2.0], "nowhere": None,
            "large": [3.0], "large_only_rank0": [3.0], "low": [1.0],
        }
        assert r["buffer"] == [10.0, 10.0, 10.0]  # rank 0's buffers, as DDP broadcasts them


def test_finder_agrees_on_the_minimum_and_names_the_limiting_rank(launched):
    r0, r1 = (read_result(launched, f"find_rank{r}.json") for r in (0, 1))
    assert r0["plan"]["batch_size"] == r1["plan"]["batch_size"] == r1["plan"]["local_best"]
    assert r0["plan"]["local_best"] > r1["plan"]["local_best"]
    assert r0["plan"]["limited_by_rank"] == r1["plan"]["limited_by_rank"] == 1
    assert r0["restored"] and r1["restored"]


def test_finder_refuses_a_step_through_the_ddp_wrapper_on_every_rank(launched):
    for rank in (0, 1):
        wrapper = read_result(launched, f"find_rank{rank}.json")["wrapper"]
        assert wrapper["error"] == "RuntimeError"
        assert "ddp_model.module" in wrapper["message"]


def test_finder_failure_on_one_rank_stops_every_rank(launched):
    r0, r1 = (read_result(launched, f"find_rank{r}.json") for r in (0, 1))
    # nothing fits on rank 1: both raise NothingFitsError, rank 0's names rank 1
    assert r0["nothing_fits"]["error"] == r1["nothing_fits"]["error"] == "NothingFitsError"
    assert "rank 1" in r0["nothing_fits"]["message"]
    # the step raised on rank 0: rank 0 re-raises it, rank 1 stops naming rank 0
    assert r0["failure"] == {"error": "ValueError", "message": "bad step on rank 0"}
    assert r1["failure"]["error"] == "RuntimeError" and "rank 0" in r1["failure"]["message"]


def test_oom_on_rank_one_only_keeps_ranks_identical_and_exact(launched):
    r0, r1 = (read_result(launched, f"oom_rank{r}.json") for r in (0, 1))
    assert r1["capacity"] < r0["capacity"]
    steps0, steps1 = r0["steps"], r1["steps"]
    assert len(steps0) == len(steps1) == dc.OOM_STEPS
    # both ranks retried the same steps and ran the same micro-batches
    assert [(s["micro"], s["accum"], s["ooms"]) for s in steps0] == [(s["micro"], s["accum"], s["ooms"]) for s in steps1]
    total = sum(s["ooms"] for s in steps1)
    assert r1["injected"] == 1 and total >= 3  # capacity OOMs on growth, plus the injected one
    assert r0["remote_ooms"] == total  # rank 0 never ran out itself; it followed rank 1 each time
    assert r1["remote_ooms"] == 0
    assert {s["micro"] for s in steps1} >= {dc.OOM_GLOBAL // 2, dc.OOM_GLOBAL // 4}
    p0 = torch.load(launched / "oom_params_rank0.pt")
    p1 = torch.load(launched / "oom_params_rank1.pt")
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert_params_close(p0, dc.reference_oom_params())


def test_an_engine_given_no_coordinator_trains_the_global_batch_under_torchrun(launched):
    # a 2-rank process group and an unwrapped model: the engine must not fall back to a world of 1
    r0, r1 = (read_result(launched, f"plain_rank{r}.json") for r in (0, 1))
    for r in (r0, r1):
        assert r["coordinator"] == "DistributedCoordinator" and r["world"] == 2
        assert r["per_rank"] == dc.OOM_GLOBAL // 2 and r["samples"] == [dc.OOM_GLOBAL // 2] * dc.PLAIN_STEPS
    p0 = torch.load(launched / "plain_params_rank0.pt")
    p1 = torch.load(launched / "plain_params_rank1.pt")
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    # gradients averaged over the ranks: one process on the whole global batch, step for step
    assert_params_close(p0, dc.reference_oom_params(dc.PLAIN_STEPS))


def test_engine_finder_under_overlapped_ddp_agrees_on_the_smaller_rank(launched):
    # defer_grad_sync=False: the finder's trials run the inner module, never DDP's syncing backward
    r0, r1 = (read_result(launched, f"engine_find_rank{r}.json")["overlap"] for r in (0, 1))
    assert r0["steps"] == r1["steps"] and len(r0["steps"]) == dc.ENGINE_FIND_STEPS
    micro = r0["steps"][0]["micro"]
    per_rank = r0["per_rank"]
    assert per_rank == dc.OOM_GLOBAL // 2
    assert micro < per_rank  # rank 0 alone would take its whole share: rank 1's device set it
    assert r0["limited_by_rank"] == r1["limited_by_rank"] == 1
    assert all(s["samples"] == per_rank for s in r0["steps"])
    # the wrapper ran the training micro-batches only, none of the finder's trials
    assert r0["wrapper_calls"] == r1["wrapper_calls"] == sum(s["accum"] for s in r0["steps"])
    accum = -(-per_rank // micro)
    if per_rank % micro == 0:
        assert r0["describe"].startswith(f"global {dc.OOM_GLOBAL} = micro {micro} × world 2 × accum {accum}: ")
    else:  # balanced micro-batches: sizes differ by at most one
        q, r = divmod(per_rank, accum)
        assert r0["describe"].startswith(f"global {dc.OOM_GLOBAL} = world 2 × {per_rank} per rank, micro {micro} × "
                                         f"accum {accum} ({r} of {q + 1}, {accum - r} of {q}): ")
    p0 = torch.load(launched / "engine_find_params_rank0.pt")
    p1 = torch.load(launched / "engine_find_params_rank1.pt")
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    # the trials left no trace: the same training as one process on the whole global batch
    assert_params_close(p0, dc.reference_oom_params(dc.ENGINE_FIND_STEPS))


def test_engine_finder_nothing_fits_on_one_rank_raises_on_every_rank(launched):
    r0, r1 = (read_result(launched, f"engine_find_rank{r}.json")["nothing_fits"] for r in (0, 1))
    assert r0["error"] == r1["error"] == "NothingFitsError"
    assert "nothing fits on rank 1" in r0["message"]
    assert r0["restored"] and r1["restored"]


@pytest.mark.parametrize("first, second", [("save1", "resume2"), ("save2", "resume1")])
def test_elastic_resize_sees_every_sample_exactly_once(launched, first, second):
    def legs(tag: str) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(launched.glob(f"{tag}_rank*.json"))]

    ids = [i for tag in (first, second) for leg in legs(tag) for step in leg["seen"] for i in step]
    assert sorted(ids) == list(range(dc.ELASTIC_N))  # every sample once, none twice
    for tag in (first, second):
        for leg in legs(tag):
            for s in leg["shapes"]:
                # the same global_batch_size on every world: each rank's share, accumulation recomputed
                assert s["global"] == dc.ELASTIC_GLOBAL and s["per_rank"] * s["world"] == dc.ELASTIC_GLOBAL
                assert s["samples"] * s["world"] == dc.ELASTIC_GLOBAL
                assert s["micro"] <= s["per_rank"]
                assert s["accum"] == dc.ELASTIC_GLOBAL // (s["world"] * s["micro"])
    worlds = [leg["shapes"][0]["world"] for tag in (first, second) for leg in legs(tag)[:1]]
    assert sorted(worlds) == [1, 2]
    if second == "resume2":
        # the 1-rank micro-batch of 16 was clamped to the 2-rank per-rank batch of 8
        assert legs("save1")[0]["shapes"][0]["micro"] == 16
        assert {s["micro"] for leg in legs("resume2") for s in leg["shapes"]} == {8}
    # same samples per global step in the same order: the same training as without the restart
    assert_params_close(torch.load(launched / f"{second}_params.pt"), dc.reference_elastic_params())


def test_a_dead_rank_fails_the_launch_instead_of_hanging(tmp_path):
    began = time.perf_counter()
    with pytest.raises(AssertionError, match="rank 1 died on purpose"):
        # a crash fails the launch even when the output looks finished: only gloo's teardown abort is forgiven
        torchrun(WORKER, str(tmp_path), "crash", timeout=90, finished=lambda _: True)
    assert time.perf_counter() - began < 90


def test_a_rank_that_never_joins_times_out_instead_of_hanging(tmp_path):
    with pytest.raises(AssertionError, match="Timed out|timed out|Timeout|failed"):
        torchrun(WORKER, str(tmp_path), "hang", timeout=90, env={"PG_TIMEOUT_S": "3"})
