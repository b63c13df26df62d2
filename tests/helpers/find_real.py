"""The finder told nothing about the memory, under a real limit (run in a fresh process).

    python find_real.py MODEL rlimit HEADROOM_MIB TARGET   # RLIMIT_AS at what is mapped + HEADROOM_MIB
    python find_real.py MODEL none 0 TARGET                # whatever limits it (a cgroup it was started in)

Builds a reference model with a warmed-up Adam, caps the address space if asked, runs
``find_batch_size(step, target=TARGET, restore=(model, opt))`` with no ``capacity``, then checks
the answer in the same process: whether 2 steps at it run, and whether 2 steps at 12% more run
out of memory (only under RLIMIT_AS, where that raises). Prints one JSON line.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from rlimit import cap_address_space  # noqa: E402

from batchpilot import find_batch_size  # noqa: E402
from batchpilot.app.models import MLP, SmallCNN, TransformerBlockModel  # noqa: E402
from batchpilot.memory.oom import attempt, free_memory  # noqa: E402

torch.set_num_threads(1)

name, limit, headroom, target = sys.argv[1], sys.argv[2], int(sys.argv[3]) * 2**20, float(sys.argv[4])
torch.manual_seed(0)
model = {"cnn": lambda: SmallCNN(in_channels=3, widths=(8, 16, 32)),
         "mlp": lambda: MLP(in_features=1024, width=128, depth=8),
         "transformer": lambda: TransformerBlockModel(dim=64, heads=4, layers=2, seq_len=64)}[name]()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()


def batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "transformer":
        return torch.randint(0, 256, (b, 64)), torch.randint(0, 10, (b,))
    x = torch.randn(b, 3, 32, 32) if name == "cnn" else torch.randn(b, 1024)
    return x, torch.randint(0, 10, (b,))


def step(b: int) -> None:
    x, y = batch(b)
    opt.zero_grad(set_to_none=True)
    criterion(model(x), y).backward()
    opt.step()


step(2)  # kernels loaded, Adam's state created
if limit == "rlimit":
    cap_address_space(headroom)
plan = find_batch_size(step, target=target, restore=(model, opt))


def two_steps(b: int) -> None:
    step(b)
    step(b)


free_memory("cpu")
trained = 0  # the answer trains in the process that asked: ten steps
for _ in range(10):
    if attempt(step, plan.batch_size).oom:
        break
    trained += 1
fits = trained == 10
# 12% more must not run: under RLIMIT_AS at 0.99 the answer is within the tolerance of this process's
# boundary (what the search left behind included)
above = attempt(two_steps, math.ceil(plan.batch_size * 1.12)).oom if limit == "rlimit" else None
print(json.dumps({
    "batch_size": plan.batch_size, "memory": plan.memory, "binding": plan.binding_limit,
    "trials": [[t.batch_size, t.outcome] for t in plan.trials], "ooms": plan.num_ooms,
    "stop_reason": plan.stop_reason, "fits": fits, "more_fails": above,
    "capacity": plan.capacity, "peaks": [t.peak_bytes for t in plan.trials if t.outcome != "refused"],
    "limit": plan.limit_bytes, "trained": trained, "verified": plan.verified,
    "onednn": torch.backends.mkldnn.enabled,
}))
