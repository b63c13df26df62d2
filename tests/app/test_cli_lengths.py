"""``batchpilot find|plan --seq-lens``: the per-length table, in text and JSON, and its errors."""

from __future__ import annotations

import json

import pytest

from batchpilot.app import report


def _check_lengths(doc: dict, lengths: list[int]) -> None:
    assert [r["length"] for r in doc["per_length"]] == lengths
    for r in doc["per_length"]:
        assert set(r) == report.SCHEMAS["per_length"]
    assert set(doc["length_fit"]) == report.SCHEMAS["length_fit"]
    batches = [r["batch_size"] for r in doc["per_length"]]
    assert batches == sorted(batches, reverse=True) and batches[-1] == doc["batch_size"] >= 1
    assert doc["input_shape"] == [lengths[-1]]


def test_plan_seq_lens_table_and_json(cli):
    status, out, _ = cli("plan", "--model", "transformer", "--seq-lens", "8,16,32", "--capacity", "4MiB", "--json",
                         "--max-batch-size", "256")
    assert status == 0
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["plan"]
    _check_lengths(doc, [8, 16, 32])
    table = report.lengths_table(doc)  # what the text output prints
    assert "length  batch  tokens  from" in table and "searched" in table


def test_find_seq_lens_json(cli):
    status, out, _ = cli("find", "--model", "transformer", "--seq-lens", "8,32", "--capacity", "4MiB", "--json",
                         "--no-progress", "--timed-steps", "0")
    assert status == 0
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["find"]
    _check_lengths(doc, [8, 32])
    assert doc["fitted_lengths"] == [8, 32]


def test_without_seq_lens_the_length_keys_are_null(cli):
    status, out, _ = cli("plan", "--model", "mlp", "--capacity", "4MiB", "--json")
    doc = json.loads(out)
    assert status == 0 and doc["per_length"] is None and doc["length_fit"] is None


@pytest.mark.parametrize("argv, match", [
    (("plan", "--model", "mlp", "--seq-lens", "8,16", "--capacity", "4MiB"), "needs a model whose inputs are sequences"),
    (("plan", "--model", "transformer", "--seq-lens", "16", "--capacity", "4MiB"), "two or more distinct lengths"),
    (("plan", "--model", "transformer", "--seq-lens", "0,16", "--capacity", "4MiB"), "at least 1"),
    (("find", "--model", "transformer", "--seq-lens", "8,16", "--capacity", "4MiB", "--objective", "throughput"),
     "drop --objective throughput"),
])
def test_bad_seq_lens(cli, argv, match):
    status, _, err = cli(*argv)
    assert status != 0 and match in err and "Traceback" not in err
