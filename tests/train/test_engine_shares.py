"""batchpilot.train.shares in one process: what the engine refuses with shares, and a world of one.

The 2-rank behaviour (exactness, lockstep, OOM, "auto", data) is tested under torchrun in
tests/dist/test_uneven.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchpilot.train.engine import Engine, LocalCoordinator
from batchpilot.train.shares import RankShares


def _engine(**kwargs) -> Engine:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), global_batch_size=8,
                  coordinator=LocalCoordinator(), **kwargs)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    (dict(shares="auto", schedule="ramp:8,16,10"), "shares= with a global-batch schedule is not supported"),
    (dict(shares="auto", noise=True), "shares= with noise= is not supported: .*use noise=False"),
    (dict(shares=[8], lengths=True), "shares= with lengths= is not supported"),
    (dict(shares="even"), 'shares must be "auto" or one positive int per rank'),
    (dict(shares=[3, 1]), r"shares=\[3, 1\] splits the global batch over 2 ranks, but this process is a world of "
                          r"one \(world size 1\): uneven shares need a process group of several ranks"),
])
def test_the_engine_refuses_what_shares_do_not_combine_with_saying_how(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        _engine(**kwargs)


def test_a_world_of_one_with_shares_trains_as_without():
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    plain, shared = _engine(micro_batch_size=3), _engine(micro_batch_size=3, shares="auto")
    for _ in range(3):
        plain.step((x, y))
        shared.step((x, y))
    for a, b in zip(plain.model.parameters(), shared.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert shared.shares == (8,) and plain.shares == (8,)
    assert shared.state_dict()["shares"] == {"shares": [8], "auto": True, "world_size": 1, "global_batch_size": 8}
    with pytest.raises(ValueError, match="set_global_batch_size with uneven shares is not supported"):
        shared.set_global_batch_size(16)


def test_shares_as_weights_are_scaled_to_the_global_batch_and_a_short_rank_pads_with_weightless_passes():
    part = RankShares([3, 1], global_batch_size=32, world=2, rank=1, coordinator=LocalCoordinator(),
                      lockstep=True)
    assert part.shares == (24, 8) and part.own == 8 and part.norm == 16
    part.accum = 3  # the count another rank needs (FSDP): 2 samples here run as 1 + 1 + a weightless pass
    assert part.cut(2, 4) == [1, 1, 0]
    part.total = 26
    assert part.mean_weight(13) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="cannot give each of 2 ranks a sample"):
        RankShares("auto", global_batch_size=1, world=2, rank=0, coordinator=LocalCoordinator())
