"""The Search object: one search's state, gone with the search."""

from __future__ import annotations

import gc
import weakref

import torch

from batchpilot.find import search as search_module
from batchpilot.find.finder import find_batch_size


def test_a_search_and_its_snapshot_are_freed_when_find_batch_size_returns(monkeypatch):
    # a reference cycle would keep the snapshot's copies of the model and optimizer alive until a
    # collection: memory the next step (the engine's, after its finder) cannot use
    made: list[weakref.ref] = []
    init = search_module.Search.__init__

    def remembering(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(search_module.Search, "__init__", remembering)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())

    def step(b: int) -> None:
        opt.zero_grad()
        model(torch.randn(b, 8)).sum().backward()
        opt.step()

    enabled = gc.isenabled()
    gc.disable()
    try:
        plan = find_batch_size(step, device="cpu", capacity="1MiB", restore=(model, opt), max_batch_size=64)
        assert plan.batch_size == 64 and len(made) == 1
        assert made[0]() is None  # freed by reference counting alone
    finally:
        if enabled:
            gc.enable()
