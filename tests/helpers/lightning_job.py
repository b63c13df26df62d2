"""Lightning jobs for tests/integrations/test_lightning.py, one process or under torchrun.

    python lightning_job.py OUT                                              # one process
    python -m torch.distributed.run --standalone --nproc-per-node=2 lightning_job.py OUT

Two fits of a real ``lightning.Trainer`` on CPU (DDP with gloo under torchrun), each with
``BatchSizeCallback(global_batch_size=128)``; rank r sizes for an emulated capacity of
``CAPACITIES[r]``, so with two ranks rank 1 limits the answer:

1. ``auto``: a plain LightningModule (automatic optimization): the callback sets the batch size
   and ``accumulate_grad_batches``; the module records every batch it trains on.
2. ``resilient``: the same network as a ``ResilientModule``; on rank ``world - 1`` the forward
   raises ``torch.OutOfMemoryError`` for micro-batches over 16 samples during optimizer step
   ``OOM_STEP`` (injected), and the run must go on with the same step.

Each rank writes ``OUT/<fit>_rank<r>.json`` (what the callback reported and what really ran) and
``OUT/<fit>_rank<r>.pt`` (the final parameters).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MAX_STEPS = 4
OOM_STEP = 2
GLOBAL = 128
CAPACITIES = ("400KiB", "300KiB")
LR = 1e-3


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1024, 32, generator=g), torch.randint(0, 4, (1024,), generator=g)


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))


def main(out: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from batchpilot.integrations.lightning import BatchSizeCallback, ResilientModule

    warnings.filterwarnings("ignore")
    X, Y = data()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = network()
            self.batch_size = 8  # the dataloader's, as configured: the LR was tuned for 8 × world
            self.batches: list[int] = []
            self.steps_at_batch: list[int] = []

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(X, Y), batch_size=self.batch_size)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.batches.append(len(x))
            self.steps_at_batch.append(self.trainer.global_step)
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Resilient(ResilientModule, Plain):
        step_ooms: list[int]
        step_micro: list[int]
        step_sizes: list[list[int]]

        def __init__(self) -> None:
            super().__init__()
            self.step_ooms, self.step_micro, self.step_sizes = [], [], []

        def compute_loss(self, batch):
            x, y = batch
            if (rank == world - 1 and self.batchpilot_engine is not None and self.trainer.global_step == OOM_STEP
                    and len(x) > 16):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
            return F.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.step_ooms.append(self.batchpilot_last_step.ooms)
            self.step_micro.append(self.batchpilot_last_step.micro_batch_size)
            self.step_sizes.append(list(self.batchpilot_last_step.micro_batch_sizes))

    for name, cls in (("auto", Plain), ("resilient", Resilient)):
        module = cls()
        callback = BatchSizeCallback(global_batch_size=GLOBAL, capacity=CAPACITIES[rank], lr_rule="auto")
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=MAX_STEPS,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[callback], use_distributed_sampler=True,
        )
        trainer.fit(module)
        setup = callback.setup
        doc = {
            "setup": setup.to_dict(),
            "global_step": trainer.global_step,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "batch_size_attr": module.batch_size,
            "lr": [g["lr"] for g in trainer.optimizers[0].param_groups],
        }
        if name == "auto":
            # the trials ran training_step too: the training batches are the last ones recorded
            n = MAX_STEPS * setup.accum_steps
            doc["batches"] = module.batches[-n:]
            doc["steps_at_batch"] = module.steps_at_batch[-n:]
        else:
            engine = module.batchpilot_engine
            doc["engine"] = {"describe": engine.describe(), "global_batch_size": engine.global_batch_size,
                             "steps": engine.steps, "micro_batch_size": engine.micro_batch_size}
            doc["step_ooms"], doc["step_micro"] = module.step_ooms, module.step_micro
            doc["step_sizes"] = module.step_sizes
            doc["engine_start"] = None if setup.plan is None else setup.plan.batch_size
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(doc))
        torch.save([p.detach().clone() for p in module.net.parameters()], out / f"{name}_rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
