"""RetryState (batchpilot.train.retry): a retried attempt starts from the statistics and RNG the step began with."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from batchpilot.memory.oom import is_oom
from batchpilot.train.retry import BatchDoesNotFitError, RetryState, fixed_oom_error, running_stat_buffers

from engine_utils import one_thread  # noqa: F401

CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_retry_after_a_failed_attempt_trains_as_if_it_never_ran():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)
    clean = _model()
    clean_opt = torch.optim.SGD(clean.parameters(), lr=0.1, momentum=0.9)
    model = copy.deepcopy(clean)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    retry = RetryState(model, CPU, buffers=True, rng=True)
    assert len(retry.buffers) == 3  # BatchNorm1d: running mean, running var, batches tracked

    for seed in (7, 8):  # the second step's snapshot copies into the first one's tensors
        torch.manual_seed(seed)
        want = _train_step(clean, clean_opt, x, y)
        torch.manual_seed(seed)
        retry.snapshot()
        # a failed attempt: a forward and backward over half the batch (statistics moved, dropout drawn)
        nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
        opt.zero_grad(set_to_none=True)  # the engine drops the partial gradients
        retry.restore()
        got = _train_step(model, opt, x, y)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for (name, a), b in zip(_state(model).items(), _state(clean).values()):
            assert torch.equal(a, b), name  # bit for bit: BatchNorm statistics, dropout masks, parameters


@pytest.mark.parametrize("keep", ["buffers", "rng"])
def test_what_is_not_kept_stays_as_the_failed_attempt_left_it(keep):
    model = _model()
    retry = RetryState(model, CPU, buffers=keep == "buffers", rng=keep == "rng")
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    before = _state(model)
    retry.snapshot()
    first = model(x).detach()
    retry.restore()
    moved = not torch.equal(model[1].running_mean, before["1.running_mean"])
    second = model(x).detach()
    if keep == "buffers":
        assert not moved  # the statistics are back...
        assert not torch.equal(first, second)  # ...but the RNG went on: another dropout mask
    else:
        assert moved and retry.buffers == []  # the statistics stay where the failed forward left them...
        torch.testing.assert_close(first, second, rtol=0, atol=0)  # ...and the dropout mask repeats


def test_running_stat_buffers_are_those_a_forward_changes():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.InstanceNorm2d(2, track_running_stats=True),
                          nn.BatchNorm2d(2, track_running_stats=False), nn.LayerNorm([2, 2]))
    found = running_stat_buffers(model)
    assert len(found) == 6  # BatchNorm2d and the tracking InstanceNorm2d: mean, var, count each
    bn, inorm = model[1], model[2]
    assert [id(b) for b in found] == [id(b) for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked,
                                                      inorm.running_mean, inorm.running_var,
                                                      inorm.num_batches_tracked)]
    assert running_stat_buffers(nn.Linear(2, 2)) == []


def test_the_errors_say_what_to_do_and_keep_their_kind():
    err = fixed_oom_error(8, CPU, "CPU out of memory")
    assert isinstance(err, torch.OutOfMemoryError) and is_oom(err)  # every OOM handler still sees an OOM
    assert str(err) == ('out of memory at the fixed micro-batch 8 on cpu: CPU out of memory; '
                        'micro_batch_size="auto" shrinks and retries instead')
    assert issubclass(BatchDoesNotFitError, RuntimeError) and not is_oom(BatchDoesNotFitError("x"))
