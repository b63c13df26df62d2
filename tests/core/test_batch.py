"""The batch rules shared by the engine, the finder and the planner (batchpilot.core.batch)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from batchpilot.core.batch import BatchLayout, BatchSplitter, batch_size_of, make_batch_fn


def test_splitter_views_and_errors():
    x = torch.arange(10.0)
    s = BatchSplitter((x, [x * 2], "tag"))
    part = s.slice(3, 4)
    assert part[0].data_ptr() == x[3:].data_ptr() and part[1][0].tolist() == [6, 8, 10, 12] and part[2] == "tag"
    with pytest.raises(ValueError, match="disagree on the batch size"):
        batch_size_of((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        batch_size_of({"a": 1, "b": torch.tensor(2.0)})


def user_batch(B=6, T=5):
    """A dict batch as users have them: ids (B, T), a per-batch positions tensor (T,), names, an int."""
    return {
        "input_ids": torch.arange(B * T).reshape(B, T),
        "positions": torch.arange(T),
        "names": [f"doc{i}" for i in range(B)],
        "epoch": 3,
        "source": "wiki",
    }


def test_undeclared_shared_tensor_is_ambiguous_with_the_fix_in_the_message():
    with pytest.raises(ValueError, match=r"input_ids.*positions.*shared="):
        BatchSplitter(user_batch())


def test_shared_keys_pass_through_and_per_sample_lists_are_cut():
    batch = user_batch()
    s = BatchSplitter(batch, BatchLayout(shared={"positions"}))
    assert s.size == 6
    part = s.slice(2, 3)
    assert part["input_ids"].tolist() == batch["input_ids"][2:5].tolist()
    assert part["positions"] is batch["positions"]
    assert part["names"] == ["doc2", "doc3", "doc4"]
    assert part["epoch"] == 3 and part["source"] == "wiki"


def test_shared_accepts_one_key_and_rejects_a_missing_key():
    assert BatchSplitter(user_batch(), BatchLayout(shared="positions")).size == 6
    with pytest.raises(ValueError, match=r"shared names \['postions'\].*positions"):
        BatchSplitter(user_batch(), BatchLayout(shared={"positions", "postions"}))
    with pytest.raises(TypeError, match="shared"):
        BatchLayout(shared={1, 2})


def test_a_list_of_other_length_passes_through():
    batch = {"x": torch.zeros(4, 2), "classes": ["a", "b", "c"]}
    part = BatchSplitter(batch).slice(0, 2)
    assert part["classes"] == ["a", "b", "c"]


def test_a_list_of_per_sample_tensors_of_different_shapes():
    images = [torch.zeros(3, 4 + i, 5) for i in range(4)]
    batch = {"images": images, "labels": torch.arange(4)}
    s = BatchSplitter(batch)
    assert s.size == 4
    part = s.slice(1, 2)
    assert [t.shape[1] for t in part["images"]] == [5, 6] and part["labels"].tolist() == [1, 2]


def test_tuples_and_namedtuples_keep_their_type():
    Pair = namedtuple("Pair", "x y")
    batch = (Pair(torch.arange(4), torch.arange(4) * 2), ("a", "b", "c", "d"))
    part = BatchSplitter(batch).slice(1, 2)
    assert isinstance(part[0], Pair) and part[0].y.tolist() == [2, 4]
    assert part[1] == ("b", "c")


def test_split_fn_cuts_and_the_rules_read_the_size():
    calls = []

    def split(batch, start, stop):
        calls.append((start, stop))
        return {"ids": batch["ids"][start:stop], "cu": batch["cu"]}

    batch = {"ids": torch.arange(8), "cu": torch.tensor([0, 3, 8])}
    s = BatchSplitter(batch, BatchLayout(shared={"cu"}, split_fn=split))
    assert s.size == 8 and s.slice(2, 3)["ids"].tolist() == [2, 3, 4] and calls == [(2, 5)]
    make = make_batch_fn(batch, BatchLayout(shared={"cu"}, split_fn=split))
    assert make(4)["ids"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="max_batch_size=8"):
        make(9)


def test_make_batch_fn_repeats_every_per_sample_part():
    batch = user_batch(B=3)
    out = make_batch_fn(batch, BatchLayout(shared={"positions"}))(5)
    assert out["input_ids"].shape == (5, 5) and out["names"] == ["doc0", "doc1", "doc2", "doc0", "doc1"]
    assert out["positions"] is batch["positions"] and out["epoch"] == 3
    assert out["input_ids"].untyped_storage().nbytes() == 5 * 5 * 8  # owns exactly b rows


def test_narrow_reads_a_slice_of_per_sample_tensors_as_the_whole_batch_was_read():
    # a list of per-sample token tensors; a slice of one sample, or of samples of one length, read
    # afresh is a list of tensors whose dim 0 (the tokens) looks like the batch
    batch = [torch.arange(9), torch.arange(5), torch.arange(5) + 10]
    split = BatchSplitter(batch)
    assert split.size == 3
    one = split.narrow(0, 1)
    assert one.size == 1 and len(one.batch) == 1 and torch.equal(one.slice(0, 1)[0], batch[0])
    equal = split.narrow(1, 2)
    assert equal.size == 2 and [t.tolist() for t in equal.slice(1, 1)] == [batch[2].tolist()]
    # rows, per-sample names and passed-through values keep their kinds
    d = BatchSplitter({"x": torch.arange(12).view(6, 2), "names": list("abcdef"), "k": 3}).narrow(2, 3)
    assert d.size == 3 and d.batch["names"] == ["c", "d", "e"] and d.batch["k"] == 3
    assert d.slice(1, 2)["x"].tolist() == [[6, 7], [8, 9]]
