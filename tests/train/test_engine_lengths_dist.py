"""The engine sized by length under torchrun (DDP, 2 ranks, gloo): one budget, the full batch's update.

Each rank's batches have their own padded lengths (tests/helpers/lengths_worker.py). The ranks
must run as many micro-batches as each other at every step (DDP's forward broadcasts buffers and
SyncBatchNorm gathers statistics: a collective per micro-batch), hold the same budget, and end on
the parameters of one plain step per global batch: both ranks' samples together, padded alike.
"""

from __future__ import annotations

import pytest
import torch

import lengths_worker as lw
from dist_launch import assert_params_close, read_result, torchrun

from batchpilot.app.models import lm_loss

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("lengths_dist")
    torchrun(lw.__file__, str(out), "whole", "split", "oom", timeout=200)
    return out


def _pad(batch: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    extra = width - batch["input_ids"].shape[1]
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.nn.functional.pad(t, (0, extra), value=fill[k]) for k, t in batch.items()}


def _full_batch_params() -> list[torch.Tensor]:
    """One SGD step per global batch: both ranks' samples in one batch, the mean over their tokens."""
    model = lw.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in zip(*(lw.rank_batches(r) for r in range(2))):
        width = max(b["input_ids"].shape[1] for b in step)
        batch = {k: torch.cat([_pad(b, width)[k] for b in step]) for k in step[0]}
        opt.zero_grad(set_to_none=True)
        total, count = lm_loss(model, batch)
        (total / count).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _ranks(out, scenario: str) -> tuple[list[dict], list[tuple[dict, dict]]]:
    """Both ranks' records, checked for what DDP needs whatever happened: one length, as many micro-batches."""
    ranks = [read_result(out, f"{scenario}_rank{r}.json") for r in range(2)]
    steps = list(zip(*(r["steps"] for r in ranks)))
    for (a, b), widths in zip(steps, lw.WIDTHS):
        assert a["length"] == b["length"] == max(widths)  # sized for the longest rank's batch
        assert len(a["sizes"]) == len(b["sizes"]), (a, b)  # as many micro-batches: DDP pairs them
        assert sum(a["sizes"]) == sum(b["sizes"]) == lw.PER_RANK
        assert a["ooms"] == b["ooms"]  # an OOM anywhere is a retry everywhere
    assert ranks[0]["sizer"] == ranks[1]["sizer"]  # the same budget: fit, limit, verified answers, corrections
    assert ranks[0]["limits"] == ranks[1]["limits"]  # after every step, not only at the end
    expected = _full_batch_params()
    for r in ranks:
        assert_params_close([torch.tensor(p) for p in r["params"]], expected)
    return ranks, steps


@pytest.mark.parametrize("scenario", ["whole", "split"])
def test_ranks_with_different_lengths_share_one_budget_and_the_full_batch_update(launched, scenario):
    ranks, steps = _ranks(launched, scenario)
    assert all(a["ooms"] == 0 for a, _ in steps)
    # 40, 48 and 64 were beyond every verified length when they came: searched on every rank, once
    assert ranks[0]["verifications"] == ranks[1]["verifications"] == 3
    verified = {L for L, _ in ranks[0]["sizer"]["budget"]["verified"]}
    assert {24, 12, 6, 40, 48, 64} <= verified
    if scenario == "split":
        # each rank cut its own samples: trimmed to their own lengths, so the ranks' cuts differ,
        # and a rank whose samples needed fewer micro-batches halved its largest ones
        assert any(a["lengths"] != b["lengths"] for a, b in steps)
        for a, b in steps:
            for s in (a, b):
                assert max(s["lengths"]) <= s["length"]
    else:
        for a, b in steps:
            assert a["sizes"] == b["sizes"] and a["lengths"] == b["lengths"] == [a["length"]] * len(a["sizes"])


def test_an_oom_on_one_rank_derates_every_rank_alike_and_loses_no_sample(launched):
    ranks, steps = _ranks(launched, "oom")
    assert sum(a["ooms"] for a, _ in steps) >= 1  # rank 1 ran out (both count the agreed retry)
    limits = ranks[0]["limits"]
    assert limits == sorted(limits, reverse=True) and limits[-1] < limits[0]  # derated, on both ranks
