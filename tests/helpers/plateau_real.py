"""A step that slices ``X[:b]`` of a 5000-row dataset, searched on real memory (run in a fresh process).

    python plateau_real.py none            # the host's own memory: no capacity, no limit of its own
    python plateau_real.py rlimit MIB      # RLIMIT_AS at what is mapped + MIB

Past 5000 rows every batch size runs the same step, so the memory a trial adds stops growing: the
search must stop there by itself (``stop_reason "plateau"``). A tiny float64 MLP, as a new user
writes it, with no ``capacity`` and no ``max_batch_size``. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from rlimit import cap_address_space  # noqa: E402

from batchpilot import find_batch_size  # noqa: E402

ROWS = 5000
torch.set_num_threads(1)
torch.manual_seed(0)
X = torch.randn(ROWS, 32, dtype=torch.float64)
Y = torch.randint(0, 4, (ROWS,))
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).double()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


def step(b: int) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(X[:b]), Y[:b]).backward()
    opt.step()


step(8)  # the user's loop has run: Adam's state exists
if sys.argv[1] == "rlimit":
    cap_address_space(int(sys.argv[2]) * 2**20)
plan = find_batch_size(step, restore=(model, opt), progress=False)
print(json.dumps({"answer": plan.batch_size, "stop": plan.stop_reason, "memory": plan.memory,
                  "reason": plan.reason, "rows": ROWS,
                  "trials": [(t.batch_size, t.outcome, t.peak_bytes, t.start_bytes, t.end_bytes)
                             for t in plan.trials]}))
