"""Uneven shares of one global batch on 2 gloo ranks: exact updates, lockstep collectives, OOM, auto shares, data.

One torchrun launch runs every scenario (tests/helpers/uneven_worker.py); the references run in
this process on the same global batches (tests/helpers/uneven_common.py). A hang is a failure:
the workers' process group times out after 60 s, the launch after 200 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HELPERS))
import uneven_common as uc  # noqa: E402
import uneven_worker as uw  # noqa: E402
from dist_launch import read_result, torchrun  # noqa: E402

from batchpilot.train.data import ElasticBatchSampler  # noqa: E402

WORKER = HELPERS / "uneven_worker.py"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uneven")
    torchrun(WORKER, str(out), "exact", "oom", "auto", timeout=200,
             finished=lambda stdout: '"scenario": "auto"' in stdout)
    return out


def _relative_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert len(got) == len(ref)
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))


@pytest.mark.parametrize("case", list(uc.CASES))
def test_shares_3_to_1_equal_one_process_on_the_global_batch(launched, case):
    """DDP (deferred sync) and FSDP2, shares 24 + 8 and a short last batch of 1 + 5: the update of one process."""
    tolerance = uc.CASES[case][3]
    ref = uc.reference_params(case)
    for backend in ("ddp", "fsdp"):
        got = torch.load(launched / f"{backend}-{case}_params.pt")
        assert _relative_error(got, ref) < tolerance, (backend, case)
    if case == "fp64-mean":  # DDP's own overlapped all-reduce in the last micro-batch's backward
        got = torch.load(launched / "ddp-overlap-fp64-mean_params.pt")
        assert _relative_error(got, ref) < tolerance


def test_every_rank_runs_the_same_collectives_whatever_its_micro_batches(launched):
    for backend in ("ddp", "fsdp"):
        ranks = [read_result(launched, f"{backend}-fp64-mean_rank{r}.json") for r in (0, 1)]
        assert ranks[0]["collectives"] == ranks[1]["collectives"] > 0
        sizes = [[s["sizes"] for s in rank["steps"]] for rank in ranks]
        if backend == "ddp":  # each rank its own count of passes: one and three
            assert sizes[0][:3] == [[24]] * 3 and sizes[1][:3] == [[3, 3, 2]] * 3
        else:  # FSDP: the larger count on both; rank 0's one sample and a weightless pass at the end
            assert sizes[0][:3] == [[8, 8, 8]] * 3 and sizes[1][:3] == [[3, 3, 2]] * 3
            assert sizes[0][3] == [1, 0] and sizes[1][3] == [3, 2]
        assert [s["samples"] for s in ranks[0]["steps"]] == [24, 24, 24, 1]


def test_an_oom_on_one_rank_shrinks_that_rank_alone_and_the_update_stays_exact(launched):
    ranks = [read_result(launched, f"oom_rank{r}.json") for r in (0, 1)]
    # rank 1's micro-batch of 8 exceeded its emulated capacity: both ranks retried the step, rank 1 at 4
    assert [s["ooms"] for s in ranks[0]["steps"]] == [1, 0, 0, 0] == [s["ooms"] for s in ranks[1]["steps"]]
    assert ranks[0]["remote_ooms"] == 1 and ranks[1]["remote_ooms"] == 0
    assert [s["sizes"] for s in ranks[1]["steps"][:3]] == [[4, 4]] * 3
    assert [s["sizes"] for s in ranks[0]["steps"][:3]] == [[24]] * 3
    assert ranks[0]["collectives"] == ranks[1]["collectives"]
    ref = uc.reference_params("fp64-mean", uc.OOM_COPIES)
    assert _relative_error(torch.load(launched / "oom_params.pt"), ref) < 1e-10


def _epochs(seen: list) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in seen:
        if entry[0] == "checkpoint":
            continue
        out.setdefault(entry[0], []).extend(entry[1:])
    return out


def test_auto_shares_move_to_the_faster_rank_in_lockstep_and_the_data_stay_exactly_once(launched):
    ranks = [read_result(launched, f"auto_rank{r}.json") for r in (0, 1)]
    assert ranks[0]["history"] == ranks[1]["history"]  # every rank adopted the same shares at the same step
    assert ranks[0]["rebalances"] >= 1
    final = ranks[0]["history"][-1]
    assert sum(final) == uw.AUTO_GLOBAL and final[0] > final[1]  # rank 1 is the slow one
    for epoch in (0, 1):
        got = sorted(_epochs(ranks[0]["seen"])[epoch] + _epochs(ranks[1]["seen"])[epoch])
        assert got == list(range(uw.AUTO_DATASET)), epoch  # exactly once through the rebalance


@pytest.mark.parametrize("world, shares", [(1, None), (2, [5, 11]), (3, [2, 3, 4])])
def test_a_checkpoint_resumes_exactly_once_on_another_split_or_world(launched, world, shares):
    """The 2-rank auto run's checkpoint (step 25, after the rebalance) resumed on 1 rank, another split, 3 ranks."""
    state = torch.load(launched / "auto_ckpt_rank0.pt")["data"]
    seen = [read_result(launched, f"auto_rank{r}.json")["seen"] for r in (0, 1)]
    epoch = state["epoch"]
    before = []
    for rank_seen in seen:
        for entry in rank_seen[:rank_seen.index(["checkpoint"])]:
            if entry[0] == epoch:
                before.extend(entry[1:])
    samplers = [ElasticBatchSampler(uw.AUTO_DATASET, 4, seed=3, num_replicas=world, rank=r, shares=shares)
                for r in range(world)]
    after = []
    for sampler in samplers:
        sampler.load_state_dict(state)
        sampler.set_epoch(epoch)
        for batch in sampler:
            sampler.mark_consumed()
            after.extend(batch)
    got = before + after
    # every sample once; a tail shorter than the ranks is padded (at most world - 1 repeats)
    assert set(got) == set(range(uw.AUTO_DATASET)) and len(got) - uw.AUTO_DATASET < world
