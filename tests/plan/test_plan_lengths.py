"""The planner per sequence length (batchpilot.plan.lengths): fake runs at two or three lengths, a table for all."""

from __future__ import annotations

import pytest
import torch

from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch
from batchpilot.plan.lengths import plan_per_length
from batchpilot.plan.planner import plan_batch_size

OPTIONS = dict(capacity="1MiB", optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), loss_fn=lm_loss,
               max_batch_size=32)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=16, heads=2, layers=1, max_len=64)


def test_table_matches_the_planner_at_a_length_not_planned() -> None:
    model = _model()
    result = plan_per_length(model, lambda b, L: padded_lm_batch([L] * b, vocab=64), lengths=(16, 24, 32, 64),
                             **OPTIONS)
    assert sorted(result.plans) == [16, 32, 64]
    assert result.longest.batch_size == result.per_length[64]
    assert result.fit.bytes_per_token_squared > 0  # TinyGPT's attention is unfused
    direct = plan_batch_size(model, lambda b: padded_lm_batch([24] * b, vocab=64), **OPTIONS)
    assert result.per_length[24] == direct.batch_size
    d = result.to_dict()
    assert d["per_length"][1] == {"length": 24, "batch_size": direct.batch_size}


def test_an_example_batch_is_trimmed_on_seq_dim() -> None:
    model = _model()
    example = padded_lm_batch([64, 5], vocab=64, pad_to=64)
    result = plan_per_length(model, example, lengths=(32, 64), **OPTIONS)
    assert set(result.per_length) == {32, 64} and result.per_length[32] > result.per_length[64]
    with pytest.raises(ValueError, match="seq_dim=2 is missing"):
        plan_per_length(model, example, lengths=(32, 64), seq_dim=2, **OPTIONS)
    with pytest.raises(ValueError, match="two or three lengths"):
        plan_per_length(model, example, lengths=(64,), **OPTIONS)
