"""Accelerate's pattern under a real address-space cap, sized by the drop-in or by the finder (a fresh process).

    python accelerate_rlimit.py drop-in|finder HEADROOM_MIB

Builds an MLP, its Adam optimizer and a dataset, runs a tiny step (kernels loaded, Adam's state
created), caps ``RLIMIT_AS`` at what is mapped + HEADROOM_MIB, then sizes the training function
(an ``Accelerator``-prepared epoch) at ``target=0.99``: with the drop-in decorator, or with
``find_batch_size`` on one training step of the same model and loader followed by the epoch at its
answer. Prints one JSON line: the answer, every call of the function and its outcome.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
from rlimit import cap_address_space  # noqa: E402

from batchpilot import find_batch_size  # noqa: E402
from batchpilot.integrations.accelerate import find_executable_batch_size  # noqa: E402
from batchpilot.memory.oom import is_oom  # noqa: E402

SAMPLES = 8192
torch.set_num_threads(1)
method, headroom = sys.argv[1], int(sys.argv[2]) * 2**20
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(SAMPLES, 512), torch.randint(0, 10, (SAMPLES,)))
accelerator = Accelerator(cpu=True)
calls: list[list] = []


def epoch(batch_size: int) -> int:
    accelerator.free_memory()
    m, opt, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=batch_size))
    steps = 0
    try:
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            accelerator.backward(nn.functional.cross_entropy(m(x), y))
            opt.step()  # a trial of the drop-in ends here after its steps
            steps += 1
    except BaseException as exc:
        calls.append([batch_size, "oom" if is_oom(exc) else "error" if isinstance(exc, Exception) else "trial"])
        raise
    calls.append([batch_size, "ok"])
    return steps


def one_step(b: int) -> None:
    x, y = next(iter(DataLoader(data, batch_size=b)))
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


one_step(2)
cap_address_space(headroom)
if method == "drop-in":
    run = find_executable_batch_size(epoch, starting_batch_size=SAMPLES, target=0.99)
    run()
    answer, trials = run.batch_size, run.plan.trials
else:
    plan = find_batch_size(one_step, target=0.99, restore=(model, optimizer), max_batch_size=SAMPLES)
    epoch(plan.batch_size)
    answer, trials = plan.batch_size, plan.trials
print(json.dumps({"batch_size": answer, "calls": calls, "trials": [[t.batch_size, t.outcome] for t in trials]}))
