"""find_batch_size_for(..., lengths=): real searches at two or three lengths, the model answers between."""

from __future__ import annotations

import re

import pytest
import torch

from batchpilot import find_batch_size_for
from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch
from batchpilot.find.lengths import LengthPlan
from batchpilot.policy.lengths import choose_fit_lengths
from summary import assert_explains

CAP = "1MiB"


def _setup():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=16, heads=2, layers=1, max_len=64)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def test_per_length_answers_match_real_searches_at_lengths_not_searched() -> None:
    model, opt = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    example = padded_lm_batch([64, 40, 10, 3], vocab=64, pad_to=64)
    plan = find_batch_size_for(model, example, optimizer=opt, loss_fn=lm_loss, capacity=CAP,
                               lengths=(16, 24, 32, 64))
    assert isinstance(plan, LengthPlan)
    assert sorted(plan.length_plans) == [16, 32, 64] == list(choose_fit_lengths((16, 24, 32, 64)))
    assert plan.batch_size == plan.length_plans[64].batch_size == plan.per_length[64]
    assert plan.length_fit.bytes_per_token_squared > 0  # unfused attention: the L² term is there
    assert plan.per_length[16] > plan.per_length[32] > plan.per_length[64] >= 1
    # a length the model was not fitted on: the same answer as a real search there
    real = find_batch_size_for(model, padded_lm_batch([24] * 4, vocab=64), optimizer=opt, loss_fn=lm_loss,
                               capacity=CAP)
    assert plan.per_length[24] == real.batch_size
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # state put back
    text = str(plan)  # the table, the limit, the 2-D model and the searches, in a few lines
    assert text.splitlines()[0].startswith(f"batch size by length on cpu: 16: {plan.per_length[16]}, ")
    assert_explains(text, figure="tensor bytes", target="80% of 1.00 MiB", model="memory model: peak = F(L) + b x P(L)")
    assert "from searches at lengths 16, 32, 64" in text and "3 searches (predict)" in text
    assert repr(plan).startswith("LengthPlan(per_length={16: ")
    d = plan.to_dict()
    assert d["per_length"][0] == {"length": 16, "batch_size": plan.per_length[16]}
    assert d["fitted_lengths"] == [16, 32, 64] and d["length_fit"]["bytes_per_token"] > 0


def test_batch_function_of_size_and_length() -> None:
    model, opt = _setup()
    plan = find_batch_size_for(model, lambda b, L: padded_lm_batch([L] * b, vocab=64), optimizer=opt,
                               loss_fn=lm_loss, capacity=CAP, lengths=(16, 64))
    assert plan.seq_dim is None and set(plan.per_length) == {16, 64}


@pytest.mark.parametrize("kwargs, match", [
    (dict(lengths=(16, 64), seq_dim=2), "seq_dim=2 is missing from the batch"),
    (dict(lengths=(0, 64)), "positive int"),
    (dict(lengths=(64,)), "two or three lengths"),
    (dict(lengths=(16, 128)), "shorter than the longest length 128"),
])
def test_bad_input_fails_before_any_trial(kwargs, match) -> None:
    model, opt = _setup()
    example = padded_lm_batch([64, 10], vocab=64, pad_to=64)
    with pytest.raises(ValueError, match=match):
        find_batch_size_for(model, example, optimizer=opt, loss_fn=lm_loss, capacity=CAP, **kwargs)


def test_a_model_error_at_a_length_keeps_its_type_and_names_the_batch_size_and_length() -> None:
    """A held-out LM whose position table holds 48, asked for lengths up to 64: its IndexError, told where."""
    import heldout_lm as lm

    net = lm.model(max_positions=48)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(IndexError, match="index out of range") as info:
        find_batch_size_for(net, lm.batch([64, 20], seed=1), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                            loss_fn=lm.loss, capacity=CAP, lengths=(16, 64), seq_dim=1)
    first, second = info.value.__notes__
    assert re.fullmatch(r"batchpilot: raised by the step during a trial at batch size \d+", first), first
    # the longest is searched first: nothing ran, so no length is recommended that the model cannot take
    assert second.startswith("batchpilot: in the search at sequence length 64 (no length ran before it); if the "
                             "model takes no sequences of 64 tokens"), second
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # state put back


def test_the_length_note_advises_a_shorter_length_only_when_the_length_may_be_the_cause() -> None:
    from batchpilot.find.notes import length_note

    plain = "batchpilot: in the search at sequence length 32"
    assert length_note(32, [64], own=True) == plain  # 64 ran: 32 is not too long for the model
    assert length_note(32, [], own=False) == plain  # batchpilot's own error (nothing fits): no advice
    assert length_note(300, [128, 256], own=True).startswith(
        "batchpilot: in the search at sequence length 300 (the longest length that ran is 256); if the model "
        "takes no sequences of 300 tokens")


def test_a_length_search_note_follows_the_trial_note_and_advises_only_on_the_users_error() -> None:
    from batchpilot.find.notes import note_length_search, note_trial_error
    from batchpilot.policy.search import BatchSizeError

    exc = IndexError("index out of range in self")
    note_trial_error(exc, batch_size=8)
    note_length_search(exc, 300, [128, 256])
    assert exc.__notes__ == [
        "batchpilot: raised by the step during a trial at batch size 8",
        "batchpilot: in the search at sequence length 300 (the longest length that ran is 256); if the model takes "
        "no sequences of 300 tokens (a position table, a max_length), cut batches to the longest it takes, and find "
        "with lengths up to that",
    ]
    ours = BatchSizeError("the search measured fewer than two batch sizes")  # batchpilot's own: not the length's fault
    note_length_search(ours, 300, [128, 256])
    assert ours.__notes__ == ["batchpilot: in the search at sequence length 300"]


def test_fit_lengths_sequences() -> None:
    import doctest

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(choose_fit_lengths):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 2 and result.failed == 0
    assert choose_fit_lengths((16, 32, 64, 128, 256, 384, 512)) == (64, 256, 512)  # within 8x; the tie goes long
    assert choose_fit_lengths((16, 512)) == (16, 512)
    # down_to replaces the 8x rule: down to the longest length at most down_to, else the shortest
    assert choose_fit_lengths((16, 32, 64, 128, 256, 384, 512), down_to=40) == (32, 128, 512)
    assert choose_fit_lengths((16, 32, 64, 128, 256, 384, 512), down_to=8) == (16, 128, 512)
    assert choose_fit_lengths((16, 512), down_to=600) == (16, 512)  # nothing long enough left: every length
