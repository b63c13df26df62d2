"""The sequence dimension of a batch (batchpilot.core.seqbatch): the padded length, each sample's real length
(from the mask, or from labels -100)."""

from __future__ import annotations

import pytest
import torch

from batchpilot.core.batch import BatchSplitter
from batchpilot.core.seqbatch import IGNORE_INDEX, padded_length, sample_lengths


def _ids(width: int, n: int = 3) -> torch.Tensor:
    return torch.arange(1, n * width + 1).reshape(n, width)


def test_labels_without_a_mask_give_each_sample_up_to_its_last_label() -> None:
    ids = _ids(6)
    labels = ids.clone()
    labels[0, 4:] = IGNORE_INDEX  # 4 real tokens, then padding
    labels[2, :] = IGNORE_INDEX  # all padding: one token, which adds nothing to the loss
    assert sample_lengths({"input_ids": ids, "labels": labels}) == [4, 6, 1]


def test_a_prompt_masked_with_minus_100_before_the_answer_is_kept() -> None:
    ids = _ids(8, n=2)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX  # the prompt: no loss, but the answer attends to it
    labels[0, 6:] = IGNORE_INDEX
    assert sample_lengths({"input_ids": ids, "labels": labels}) == [6, 8]


def test_the_attention_mask_wins_over_the_labels() -> None:
    ids = _ids(5, n=2)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    labels = ids.masked_fill(torch.tensor([[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]).bool(), IGNORE_INDEX)
    assert sample_lengths({"input_ids": ids, "attention_mask": mask, "labels": labels}) == [3, 5]


@pytest.mark.parametrize("batch", [
    {"input_ids": _ids(4), "labels": torch.tensor([0, 1, 2])},  # one label per sample: no tokens to read
    (_ids(4), _ids(4)),
])
def test_a_batch_with_neither_is_refused_naming_both(batch) -> None:
    with pytest.raises(ValueError, match="attention_mask, or \\(batch, length\\) labels with -100 at the pads"):
        sample_lengths(batch)


def test_length_fn_reads_the_users_batch_also_when_given_the_engines_splitter() -> None:
    # the engine's sizer passes its BatchSplitter; a list of per-sample token tensors has no seq dim to
    # read, so length_fn is the way, and it is written for the batch the user has
    batch = [torch.ones(n, dtype=torch.long) for n in (3, 7, 5)]
    seen = []

    def longest(b):
        seen.append(type(b))
        return max(len(t) for t in b)

    assert padded_length(BatchSplitter(batch), length_fn=longest) == 7
    assert padded_length(batch, length_fn=longest) == 7
    assert seen == [list, list]


def test_a_dict_batch_without_a_mask_is_as_long_as_its_input_ids_or_labels() -> None:
    ids = _ids(6)
    assert padded_length({"input_ids": ids, "labels": ids.clone()}) == 6
    assert padded_length({"labels": _ids(5)}) == 5
    assert padded_length({"input_ids": ids, "attention_mask": torch.ones(3, 4)}) == 4  # the mask first
    assert padded_length(BatchSplitter({"input_ids": ids})) == 6


@pytest.mark.parametrize("batch", [(_ids(4), _ids(4)), {"x": _ids(4)}, {"input_ids": torch.arange(3)}])
def test_a_batch_with_no_length_to_read_asks_for_seq_dim_or_length_fn(batch) -> None:
    with pytest.raises(ValueError, match="declare seq_dim= .* or pass length_fn="):
        padded_length(batch)
