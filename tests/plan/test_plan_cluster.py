"""A mixed cluster planned on fake tensors: each rank's micro-batch from its own memory, its share by speed."""

from __future__ import annotations

import pytest
import torch

from batchpilot.app.models import build_model, example_batch
from batchpilot.plan.gpus import GPUS
from batchpilot.plan.planner import plan_batch_size
from batchpilot.plan.result import ClusterPlanResult
from batchpilot.policy.search import NothingFitsError


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = build_model("mlp", in_features=256)
    return model, example_batch(model, 2)


def test_each_ranks_micro_batch_is_its_own_plan_and_the_shares_follow_the_speeds(mlp):
    model, sample = mlp
    caps = ["32MiB", "8MiB", "32MiB"]
    plan = plan_batch_size(model, sample, optimizer=adam, capacity=caps, global_batch_size=3000, speeds=[2, 1, 2])
    assert isinstance(plan, ClusterPlanResult)
    alone = {c: plan_batch_size(model, sample, optimizer=adam, capacity=c).batch_size for c in set(caps)}
    assert [r.max_micro_batch for r in plan.ranks] == [alone[c] for c in caps]
    assert [r.plan.batch_size for r in plan.ranks] == [alone[c] for c in caps]
    assert plan.shares == [1200, 600, 1200] and plan.global_batch_size == 3000
    for r in plan.ranks:  # the share in as few balanced micro-batches as the memory allows
        assert r.accumulation == -(-r.share // r.max_micro_batch)
        assert r.micro_batch <= r.max_micro_batch and r.micro_batch * r.accumulation >= r.share
    assert plan.speeds_from == "given" and plan.device == "cpu"
    # one fake setup, estimates shared: no more fake steps than the two capacities' searches alone
    assert plan.evaluations <= sum(len(p.evaluations) for p in {r.plan.capacity: r.plan for r in plan.ranks}.values())


def test_named_gpus_split_by_the_tables_speed(mlp):
    model, sample = mlp
    gpus = ["A6000-48GB", "A6000-48GB", "RTX2080Ti-11GB", "RTX2080Ti-11GB"]
    plan = plan_batch_size(model, sample, optimizer=adam, capacity=gpus, global_batch_size=10_000,
                           max_batch_size=1 << 16)
    assert plan.speeds_from == "table" and plan.device == "cuda"
    ratio = GPUS["A6000-48GB"].tflops / GPUS["RTX2080Ti-11GB"].tflops
    assert plan.shares[0] == plan.shares[1] and plan.shares[2] == plan.shares[3]
    assert plan.shares[0] / plan.shares[2] == pytest.approx(ratio, rel=0.01)
    assert sum(plan.shares) == 10_000
    assert max(r.time for r in plan.ranks) == 1.0 and min(r.time for r in plan.ranks) > 0.99
    assert plan.speedup == pytest.approx((ratio + 1) / 2, rel=0.01)  # equal shares wait for the slow cards
    text = plan.describe()
    for needle in ("global batch 10000 over 4 ranks", "A6000-48GB x 2", "RTX2080Ti-11GB", "data sheets",
                   "equal shares", "fake steps"):
        assert needle in text
    d = plan.to_dict()
    assert [r["share"] for r in d["ranks"]] == plan.shares and d["speeds_from"] == "table"


def test_without_a_global_batch_the_rank_with_least_memory_per_speed_sets_it(mlp):
    model, sample = mlp
    plan = plan_batch_size(model, sample, optimizer=adam, capacity=["32MiB", "8MiB"], speeds=[1, 1])
    small = plan.ranks[1].max_micro_batch
    assert plan.shares == [small, small] and all(r.accumulation == 1 for r in plan.ranks)
    assert plan.equal_share_micro_batch == small and plan.speedup == 1.0


def test_refusals(mlp):
    model, sample = mlp
    with pytest.raises(ValueError, match="no speed in the GPU table"):
        plan_batch_size(model, sample, capacity=["8MiB", "2MiB"])
    with pytest.raises(ValueError, match="3 speeds for 2 ranks"):
        plan_batch_size(model, sample, capacity=["8MiB", "2MiB"], speeds=[1, 2, 3])
    with pytest.raises(ValueError, match="as a list"):
        plan_batch_size(model, sample, capacity="8MiB", global_batch_size=64)
    with pytest.raises(ValueError, match="empty list"):
        plan_batch_size(model, sample, capacity=[])
    with pytest.raises(ValueError, match="did you mean 'RTX2080Ti-11GB'"):
        plan_batch_size(model, sample, capacity=["A6000-48GB", "RTX2080-11GB"])
    with pytest.raises(ValueError, match="world size is 2"):
        plan_batch_size(model, sample, capacity=["8MiB", "2MiB"], speeds=[1, 1], world_size=4)
    with pytest.raises(NothingFitsError, match="rank 1"):
        plan_batch_size(model, sample, optimizer=adam, capacity=["32MiB", "2MiB"], speeds=[1, 1])


def test_the_table_keeps_wide_values_apart_and_marks_a_rank_stopped_by_the_search_cap(mlp):
    model, sample = mlp
    plan = plan_batch_size(model, sample, optimizer=adam, capacity=["32MiB", "8MiB"], speeds=[154.8, 53.8],
                           global_batch_size=10_000_000, max_batch_size=2000)
    capped, full = plan.ranks
    assert capped.plan.stopped_by == "max_batch_size" and capped.max_micro_batch == 2000
    assert full.plan.stopped_by == "memory" and full.max_micro_batch < 2000
    assert [r["stopped_by"] for r in plan.to_dict()["ranks"]] == ["max_batch_size", "memory"]
    text = plan.describe()
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    # rank, gpu (two words: a size), max micro, speed, share, micro, "x", accumulation, time: none run together
    assert [(r[3], r[4], r[5], r[8]) for r in rows] == [
        ("2000*", "154.8", str(capped.share), str(capped.accumulation)),
        (str(full.max_micro_batch), "53.8", str(full.share), str(full.accumulation))]
    assert len(str(capped.share)) == 7
    assert "search cap max_batch_size=2000, not memory" in text
    alone = plan_batch_size(model, sample, optimizer=adam, capacity="32MiB", max_batch_size=2000)
    assert alone.stopped_by == "max_batch_size" and alone.to_dict()["stopped_by"] == "max_batch_size"
    assert "search cap max_batch_size=2000, not memory" in alone.describe()
