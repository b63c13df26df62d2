"""The engine under a real CPU OOM: RLIMIT_AS caps the address space below one global batch.

50 steps at a global batch whose single forward/backward does not fit; the engine starts at the
whole global batch and must shrink on the allocator's own error. Prints one JSON line that
tests/train/test_engine_real_oom.py checks.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from rlimit import cap_address_space, rss_bytes  # noqa: E402

from batchpilot.train.engine import Engine  # noqa: E402

# The headroom stays above glibc's 64 MiB per-thread arena reservation, so that the OOMs come
# from the tensors, not from malloc's bookkeeping.
STEPS, N, HEADROOM = 50, 1024, 48 * 2**20


class Wide(nn.Module):
    """~100 KiB of activations per sample for the flops of a 64 -> 256 layer: memory-bound on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.out = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x).repeat(1, 32))  # (batch, 8192)
        return self.out(h.view(-1, 32, 256).mean(1))


torch.set_num_threads(1)
torch.manual_seed(0)
model = Wide()  # the global batch needs ~200 MiB on top of the model
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
optimizer_steps = []
opt.register_step_post_hook(lambda *a: optimizer_steps.append(1))
calls: list[torch.Tensor] = []


def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y, ids = batch
    calls.append(ids.clone())
    return nn.functional.cross_entropy(m(x), y)


def make_batch(step: int, n: int = N) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g), torch.arange(n)


# kernels, allocator and momentum buffers exist before the cap
Engine(model, opt, loss_fn, global_batch_size=8, micro_batch_size=8).step(make_batch(-1, 8))
optimizer_steps.clear()

cap = cap_address_space(HEADROOM)
engine = Engine(model, opt, loss_fn, global_batch_size=N, start=N)
results, exact_once, rss_first = [], [], None
for step in range(STEPS):
    calls.clear()
    r = engine.step(make_batch(step))
    # the attempt that succeeded is the last accum_steps calls: every sample exactly once
    used = torch.cat(calls[-r.accum_steps:]).sort().values
    exact_once.append(bool(torch.equal(used, torch.arange(N))))
    results.append({"micro": r.micro_batch_size, "ooms": r.ooms, "samples": r.samples, "loss": r.loss})
    if step == 0:
        rss_first = rss_bytes()

print(json.dumps({
    "optimizer_steps": len(optimizer_steps),
    "results": results,
    "exact_once": exact_once,
    "rss_first": rss_first,
    "rss_last": rss_bytes(),
    "cap": cap,
}))
