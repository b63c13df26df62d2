"""Real CPU OOM under RLIMIT_AS: fail, recover, train smaller; then 20 cycles without leaking.

Prints one JSON line that tests/memory/test_oom.py checks.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

sys.path.insert(0, __import__("os").path.dirname(__file__))
from rlimit import cap_address_space, rss_bytes  # noqa: E402

from batchpilot.memory.oom import attempt, is_oom  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(batch_size: int) -> float:
    x = torch.randn(batch_size, 256)
    y = torch.randint(0, 10, (batch_size,))
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


train_step(8)  # warm up allocator and kernels before the cap
cap_address_space(256 * 2**20)

# Several GiB of activations: far beyond the 256 MiB headroom.
huge = 1_000_000
caught = None
try:
    train_step(huge)
except RuntimeError as exc:
    caught = exc
real_message = str(caught).splitlines()[0] if caught else ""
real_is_oom = caught is not None and is_oom(caught)
del caught

rss_first = None
results = []
for i in range(20):
    a = attempt(train_step, huge)
    b = attempt(train_step, 64)
    results.append((a.oom, b.ok))
    if i == 0:
        rss_first = rss_bytes()
rss_last = rss_bytes()
print(json.dumps({
    "real_message": real_message,
    "real_is_oom": real_is_oom,
    "cycles": results,
    "rss_first": rss_first,
    "rss_last": rss_last,
}))
