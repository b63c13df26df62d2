"""Accelerate with batchpilot: the largest micro-batch every rank fits, a global batch held by accumulation.

    python examples/accelerate_train.py                                                # one process
    torchrun --standalone --nproc-per-node=2 examples/accelerate_train.py --capacity 1MiB,600KiB
    accelerate launch --cpu --num_processes 2 examples/accelerate_train.py             # the same, Accelerate's way

``--global-batch`` is the number of samples per optimizer step over all ranks, the one the learning
rate is tuned for. ``batchpilot.integrations.accelerate.find_executable_batch_size`` finds the
largest micro-batch that divides each rank's share of the global batch and fits on every rank
(trial runs of ``train`` stopped after two optimizer steps, then the smallest answer over ranks);
``train`` builds ``Accelerator(gradient_accumulation_steps=...)`` to make up the rest. The optimisation, and
the learning rate, are the same on any number of ranks and any memory. ``--capacity`` emulates a
smaller device per rank (comma-separated; CPU only). Each rank prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchpilot.core.ranks import rank, world_size
from batchpilot.integrations.accelerate import find_executable_batch_size
from batchpilot.memory.probes import emulate_capacity
from batchpilot.train.batching import BatchConfig


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--global-batch", type=int, default=256, help="samples per optimizer step over all ranks")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps to train")
    p.add_argument("--capacity", default=None, help="emulated memory per rank, e.g. 1MiB,600KiB (CPU)")
    p.add_argument("--lr", type=float, default=1e-3, help="the learning rate, tuned for --global-batch")
    args = p.parse_args(argv)
    world = world_size()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
    report: dict = {}

    @find_executable_batch_size(global_batch_size=args.global_batch)
    def train(batch_size: int) -> dict:
        # batch_size divides this rank's share of the global batch: accumulation makes up the rest
        batches = BatchConfig(global_batch_size=args.global_batch, micro_batch_size=batch_size, world_size=world)
        accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=batches.accum_steps)
        accelerator.free_memory()  # the previous call's model and optimizer
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        loader = DataLoader(data, batch_size=batches.micro_batch_size, shuffle=True, drop_last=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        steps, samples, per_step = 0, 0, []
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                samples += len(x)
                optimizer.step()  # steps only at the last micro-batch of each global batch
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                steps, per_step = steps + 1, per_step + [samples]
                samples = 0
                if steps == args.steps:
                    break
        return {"micro_batch_size": batches.micro_batch_size, "accum_steps": batches.accum_steps,
                "world_size": world, "global_batch_size": batches.global_batch_size, "optimizer_steps": steps,
                "samples_per_step_this_rank": per_step, "loss": float(loss.detach()),
                "params": [float(t.detach().double().sum()) for t in model.parameters()]}

    capacities = args.capacity.split(",") if args.capacity else None
    with emulate_capacity(capacities[rank() % len(capacities)]) if capacities else contextlib.nullcontext():
        report = train()
    report.update(rank=rank(), found_batch_size=train.batch_size, limited_by_rank=train.plan.limited_by_rank,
                  trials=[[t.batch_size, t.outcome] for t in train.plan.trials])
    sys.stdout.write(json.dumps(report) + "\n")  # one write: the ranks' lines do not interleave
    sys.stdout.flush()
    return report


if __name__ == "__main__":
    main()
