"""Uneven shares: scenarios shared by the torchrun worker (tests/helpers/uneven_worker.py) and tests/dist/test_uneven.py.

The references run in one process without a process group on the same global batches, so a
2-rank run with shares 3:1 and its single-process reference share their model, data and loss.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from batchpilot.train.engine import Engine, EngineConfig, LocalCoordinator

FEATURES = 8
CLASSES = 4
GLOBAL = 32  # samples per optimizer step over all ranks
SHARES = (24, 8)  # 3:1
#: the global batch of each step: full ones, then an epoch's short last one
STEP_SIZES = (GLOBAL, GLOBAL, GLOBAL, 6)
#: what each rank takes of the short last batch: under FSDP rank 0 has fewer samples than the count of
#: micro-batches rank 1 needs, and runs the extra one at zero weight
SHORT_SPLIT = (1, 5)
CLIP = 0.5
#: the OOM scenario's model (activations of 64 copies) and rank 1's emulated capacity: a micro-batch
#: of 8 needs about 430 kB there, one of 4 about 235 kB
OOM_COPIES = 64
OOM_CAPACITY = 300_000

#: name -> (dtype, loss kind, amp, relative tolerance against one process)
CASES: dict[str, tuple[torch.dtype, str, str | None, float]] = {
    "fp64-mean": (torch.float64, "mean", None, 1e-10),
    "fp64-sum": (torch.float64, "sum", None, 1e-10),
    "fp32-mean-clip": (torch.float32, "mean", None, 1e-5),
    "fp32-sum-clip": (torch.float32, "sum", None, 1e-5),
    # bf16 autocast: the micro-batches differ from the reference's one pass, and bf16 rounds at 4e-3
    "bf16-mean-clip": (torch.float32, "mean", "bf16", 2e-2),
    "bf16-sum-clip": (torch.float32, "sum", "bf16", 2e-2),
}


class Widen(nn.Module):
    """Activations of ``copies`` times the width and no parameter: memory that grows with the micro-batch."""

    def __init__(self, copies: int) -> None:
        super().__init__()
        self.copies = copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.tanh(x.repeat(1, self.copies))
        return wide.view(len(x), self.copies, -1).mean(1)


def build(dtype: torch.dtype, copies: int = 1) -> nn.Module:
    torch.manual_seed(0)
    widen = [Widen(copies)] if copies > 1 else []
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), *widen, nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, CLASSES)).to(dtype)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def global_batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = STEP_SIZES[step]
    x = torch.randn(n, FEATURES, generator=g).to(dtype)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.3] = -100  # ignored samples: a (sum, count) loss counts the rest
    return x, y


def rank_rows(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch: consecutive rows, rank 0 first."""
    x, y = global_batch(step, dtype)
    split = SHARES if len(y) == GLOBAL else SHORT_SPLIT
    start = sum(split[:rank])
    return x[start:start + split[rank]], y[start:start + split[rank]]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least float32 (a bf16 output under autocast), a float64 one kept."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def loss_fn(kind: str):
    def mean(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        keep = y != -100
        # a mean over all samples of the batch (ignored ones count as 0): the engine's weighting by samples
        losses = F.cross_entropy(_wide(model(x)), y, ignore_index=-100, reduction="none")
        return (losses * keep).mean()

    def summed(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        loss = F.cross_entropy(_wide(model(x)), y, ignore_index=-100, reduction="sum")
        return loss, (y != -100).sum()

    return mean if kind == "mean" else summed


def reference_params(case: str, copies: int = 1) -> list[torch.Tensor]:
    """One process on each whole global batch, one micro-batch, the same loss, AMP and clipping."""
    dtype, kind, amp, _ = CASES[case]
    model = build(dtype, copies)
    clip = CLIP if "clip" in case else None
    opt = optimizer(model)  # one optimizer across the per-step engines: the momentum carries over
    for step in range(len(STEP_SIZES)):
        engine = Engine(model, opt, loss_fn(kind), global_batch_size=STEP_SIZES[step],
                        micro_batch_size=STEP_SIZES[step], coordinator=LocalCoordinator(), amp=amp, grad_clip=clip)
        engine.step(global_batch(step, dtype))
    return [p.detach().clone() for p in model.parameters()]


def dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


def config() -> EngineConfig:
    return EngineConfig(grow_after=1000, capacity=1 << 30)
