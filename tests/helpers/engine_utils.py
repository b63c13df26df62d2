"""Shared pieces of the engine tests: small models, fixed batches, OOM injection."""

from __future__ import annotations

import copy

import pytest

import torch
from torch import nn

from batchpilot.app.models import MLP, SmallCNN, example_batch
from batchpilot.core.loss import supervised_loss
from batchpilot.memory.probes import track_peak
from batchpilot.memory.tracker import untracked
from batchpilot.train.engine import Engine

GLOBAL = {"mlp": 64, "cnn": 16}


def make(name: str, seed: int = 0, *, batch_norm: bool = False, lr: float = 0.05):
    torch.manual_seed(seed)
    if name == "mlp":
        model = MLP(in_features=32, width=32, depth=2)
    else:
        model = SmallCNN(widths=(4, 8), batch_norm=batch_norm)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, opt


def batches(model: nn.Module, size: int, count: int, seed: int = 1):
    """``count`` batches, made one at a time on the host, as a loader makes them: inside a storage
    tracker (an emulated device) the engine counts only the micro-batches it reads of each."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        with untracked():
            batch = example_batch(model, size, generator=g)
        yield batch


class InjectOOM:
    """A loss_fn that raises ``torch.OutOfMemoryError`` on chosen calls of the wrapped one.

    ``at``: 0-based call numbers over the whole run. ``in_step``: ``(step, call)`` pairs, the
    call counted from the start of that step (retries included); the test calls
    :meth:`begin_step` before each ``engine.step``.
    """

    def __init__(self, loss_fn, at=(), *, in_step=(), always: bool = False):
        self.loss_fn = loss_fn
        self.at = set(at)
        self.in_step = set(in_step)
        self.always = always
        self.calls = 0
        self.step = -1
        self.step_calls = 0
        self.injected = 0

    def begin_step(self) -> None:
        self.step += 1
        self.step_calls = 0

    def __call__(self, model, batch):
        i, j = self.calls, self.step_calls
        self.calls += 1
        self.step_calls += 1
        out = self.loss_fn(model, batch)
        if self.always or i in self.at or (self.step, j) in self.in_step:
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM at loss_fn call {i}")
        return out


CE = supervised_loss(nn.CrossEntropyLoss())


def peak_at(name: str, global_batch: int, micro: int) -> int:
    """Exact CPU peak of a warm step (optimizer state present) at ``micro``, on a copy."""
    model, opt = make(name)
    batch = next(batches(model, global_batch, 1))
    Engine(model, opt, CE, global_batch_size=global_batch, micro_batch_size=global_batch).step(batch)
    model, opt = copy.deepcopy((model, opt))  # one memo: the copy steps the copied parameters
    # the global batch is host data, as the engine counts it: only the micro-batches it reads
    with track_peak("cpu", track=(model, opt)) as m:
        Engine(model, opt, CE, global_batch_size=global_batch, micro_batch_size=micro).step(batch)
    return m.peak_bytes


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_params_close(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: intra-op threads cost more in hand-offs than they save, and on a shared
    2-core machine a busy neighbour makes their spin-waits many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
