"""``batchpilot plan --gpu A,B,...``: a mixed cluster from the command line, its JSON and its refusals."""

from __future__ import annotations

import json

import pytest

from batchpilot.app import report
from batchpilot.app.cli.workload import Workload
from batchpilot.plan.gpus import GPUS

MIXED = "A6000-48GB,A6000-48GB,RTX2080Ti-11GB,RTX2080Ti-11GB"


def test_plan_json_for_a_mixed_cluster(cli):
    status, out, err = cli("plan", "--model", "mlp", "--input-shape", "32768", "--gpu", MIXED,
                           "--global-batch-size", "100000", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["plan"]
    cluster = doc["cluster"]
    assert set(cluster) == report.SCHEMAS["plan.cluster"]
    assert all(set(r) == report.SCHEMAS["plan.cluster.rank"] for r in cluster["ranks"])
    shares = [r["share"] for r in cluster["ranks"]]
    assert sum(shares) == cluster["global_batch_size"] == 100_000
    ratio = GPUS["A6000-48GB"].tflops / GPUS["RTX2080Ti-11GB"].tflops
    assert shares[0] / shares[2] == pytest.approx(ratio, rel=0.01) and cluster["speeds_from"] == "table"
    for r in cluster["ranks"]:
        assert r["required_bytes"] <= r["limit_bytes"]
        assert r["micro_batch_size"] <= r["max_micro_batch_size"]
        assert r["micro_batch_size"] * r["accumulation"] >= r["share"]
    # the rest of the document is the plan of the GPU with the smallest batch: what equal shares get today
    assert doc["gpu"] == "RTX2080Ti-11GB" and doc["batch_size"] == cluster["ranks"][2]["max_micro_batch_size"]


def test_plan_table_with_given_speeds(cli):
    status, out, err = cli("plan", "--model", "mlp", "--input-shape", "32768", "--gpu", "A6000-48GB,RTX2080Ti-11GB",
                           "--speeds", "1,0.5", "--global-batch-size", "3000", "--max-batch-size", "20000")
    assert status == 0, err
    assert "global batch 3000 over 2 ranks (A6000-48GB, RTX2080Ti-11GB)" in out
    assert "the speeds given" in out and "equal shares" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[1], r[4]) for r in rows] == [("A6000-48GB", "2000"), ("RTX2080Ti-11GB", "1000")]


@pytest.mark.parametrize("argv, needle", [
    (("--gpu", "A6000-48GB,RTX2080-11GB"), "unknown GPU 'RTX2080-11GB'; did you mean 'RTX2080Ti-11GB'"),
    (("--gpu", "A6000-48GB,RTX2080Ti-11GB", "--speeds", "1,1,1"), "3 figures for 2 GPUs"),
    (("--gpu", "H100-80GB", "--global-batch-size", "64"), "give --gpu a list"),
    (("--capacity", "1GiB", "--speeds", "1,1"), "give --gpu a list"),
    (("--gpu", "A6000-48GB,RTX2080Ti-11GB", "--world-size", "2"), "cannot go with a list of GPUs"),
    (("--gpu", "A6000-48GB,RTX2080Ti-11GB", "--global-batch-size", "1"), "at least 2"),
])
def test_mixed_cluster_mistakes_exit_2(cli, argv, needle):
    status, out, err = cli("plan", "--model", "mlp", "--input-shape", "64", *argv)
    assert status == 2, err
    assert needle in err and "Traceback" not in err and out == ""


def test_speeds_must_be_positive_numbers(cli):
    status, _, err = cli("plan", "--gpu", MIXED, "--speeds", "1,1,0,1")
    assert status == 2 and "--speeds" in err


def test_resnet50_is_built_in():
    w = Workload(model_spec="resnet50")
    assert w.input_shape == (3, 224, 224)
    model = w.build_model()
    assert sum(p.numel() for p in model.parameters()) == 23_528_522  # ResNet-50 with a 10-class head


def test_a_plan_stopped_by_the_search_cap_says_so_not_memory(cli):
    status, out, err = cli("plan", "--model", "mlp", "--capacity", "1GiB", "--max-batch-size", "64")
    assert status == 0, err
    assert "batch size: 64, the planner's search cap, not memory: pass --max-batch-size larger than 64" in out
    status, out, err = cli("plan", "--model", "mlp", "--capacity", "1GiB", "--max-batch-size", "64", "--json")
    assert status == 0, err
    assert json.loads(out)["stopped_by"] == "max_batch_size"
