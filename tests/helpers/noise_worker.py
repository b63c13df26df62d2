"""The noise scale and batch schedules over 2 ranks (torchrun), and their 1-rank references.

    python -m torch.distributed.run --standalone --nproc-per-node=2 noise_worker.py OUT SCENARIO...

Scenarios: ``equal`` (2-rank measurements and schedule decisions, to compare with the 1-rank
accumulation path on the same global batches), ``ramp-save`` (a ramp stopped mid-way into a
checkpoint, path in $RAMP_SAVE). The functions run the same in one process (world 1), which is
how tests/train/test_noise_distributed.py computes the references. DDP objects live inside the
functions, never at module level (torch 2.13 + gloo may abort at exit otherwise).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchpilot.dist import distributed as bd
from batchpilot.policy.schedule import AdaptiveSchedule, RampSchedule
from batchpilot.train.data import ElasticBatchSampler
from batchpilot.train.engine import Engine
from batchpilot.train.noise import NoiseConfig

sys.path.insert(0, os.path.dirname(__file__))
from scenario_main import run_scenarios  # noqa: E402

D = 16
GLOBAL = 32
STEPS = 10


def model_opt(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def global_batch(step: int, size: int, tokens: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """The whole global batch of ``step`` (the same on every rank); ``tokens``: 1..4 tokens per sample."""
    g = torch.Generator().manual_seed(500 + step)
    if not tokens:
        x = torch.randn(size, D, generator=g)
        return {"x": x.to(dtype), "y": (x.sum(1, keepdim=True) + 0.5 * torch.randn(size, 1, generator=g)).to(dtype)}
    x = torch.randn(size, 4, D, generator=g)
    y = x.sum(-1, keepdim=True) + 0.5 * torch.randn(size, 4, 1, generator=g)
    mask = (torch.arange(4) < torch.randint(1, 5, (size,), generator=g)[:, None]).unsqueeze(-1)
    return {"x": x, "y": y, "mask": mask}


def my_share(batch: dict, rank: int, world: int) -> dict:
    """Contiguous shares, so the ranks' micro-batches are the 1-rank run's micro-batches."""
    n = len(batch["x"]) // world
    return {k: v[rank * n:(rank + 1) * n].clone() for k, v in batch.items()}


def mse(model: nn.Module, b: dict) -> torch.Tensor:
    return 0.5 * ((model(b["x"]) - b["y"]) ** 2).mean()


def token_mse(model: nn.Module, b: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return (0.5 * (model(b["x"]) - b["y"]) ** 2 * b["mask"]).sum(), b["mask"].sum()


def measure(*, mode: str, micro: int, tokens: bool = False, schedule: Any = None, dtype=torch.float32,
            beta: float | None = None) -> dict:
    """Train STEPS steps on the global batches; every step's noise figures and global batch, and the weights."""
    rank, world = bd.rank(), bd.world_size()
    model, opt = model_opt(dtype)
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    engine = Engine(net, opt, token_mse if tokens else mse, global_batch_size=GLOBAL, micro_batch_size=micro,
                    noise=NoiseConfig(mode=mode, split=False, beta=beta), schedule=schedule)
    steps = []
    for step in range(STEPS):
        r = engine.step(my_share(global_batch(step, engine.global_batch_size, tokens, dtype), rank, world))
        steps.append({"global": r.global_batch_size, "noise": None if r.noise is None else r.noise.to_dict(),
                      "noise_scale": r.noise_scale, "lr": opt.param_groups[0]["lr"]})
    return {"steps": steps, "params": [p.detach().double().flatten().tolist() for p in model.parameters()]}


#: (name, 2-rank arguments, 1-rank arguments that see the same small and big batches)
EQUAL_CASES = [
    ("every", dict(mode="every", micro=8), dict(mode="every", micro=8)),
    # the same EMA on both sides: each mode has its own default beta
    ("first-is-each-rank-share", dict(mode="first", micro=8), dict(mode="every", micro=16, beta=0.99)),
    ("tokens", dict(mode="every", micro=4, tokens=True), dict(mode="every", micro=4, tokens=True)),
    ("adaptive", dict(mode="every", micro=8, schedule="adaptive"), dict(mode="every", micro=8, schedule="adaptive")),
]


def adaptive(world: int) -> AdaptiveSchedule:
    # granule × world = 16 on one rank and on two: the same decisions from the same numbers
    return AdaptiveSchedule(k=2.0, min_batch_size=16, max_batch_size=64, granule=16 // world, every=2,
                            decrease=True, start=16)


def run_case(args: dict) -> dict:
    args = dict(args)
    if args.get("schedule") == "adaptive":
        args["schedule"] = adaptive(bd.world_size())
    return measure(**args)


# -- elastic ramp: 2 ranks save, 1 rank resumes ---------------------------------------------------

N_DATA = 400
RAMP = dict(start=16, increment=16, samples=480)


def ramp_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(N_DATA, D, generator=g)
    return x, x.sum(1, keepdim=True) + 0.5 * torch.randn(N_DATA, 1, generator=g)


def run_ramp(*, epochs: int = 2, stop_at: int | None = None, save: Path | None = None,
             resume: Path | None = None) -> dict:
    rank, world = bd.rank(), bd.world_size()
    model, opt = model_opt()
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    engine = Engine(net, opt, mse, global_batch_size=64, micro_batch_size=8,
                    noise=NoiseConfig(dataset_size=N_DATA), schedule=RampSchedule(**RAMP))
    x, y = ramp_data()
    sampler = ElasticBatchSampler(N_DATA, engine.per_rank_batch_size, seed=0, drop_last=True)
    first_epoch = 0
    if resume is not None:
        ckpt = torch.load(resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        engine.load_state_dict(ckpt["engine"])
        sampler.load_state_dict(ckpt["data"])
        sampler.set_batch_size(engine.per_rank_batch_size)
        first_epoch = ckpt["epoch"]
    record: dict[str, Any] = {"indices": [], "globals": []}
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        for idx in sampler:
            r = engine.step({"x": x[idx], "y": y[idx]})
            sampler.mark_consumed()
            sampler.set_batch_size(engine.per_rank_batch_size)
            record["indices"].append([epoch, idx])
            record["globals"].append(r.global_batch_size)
            if stop_at is not None and engine.steps == stop_at:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict(),
                                "data": sampler.state_dict(), "epoch": epoch}, save)
                record["noise_scale"] = engine.noise_scale
                return record
    record["params"] = [p.detach().double().flatten().tolist() for p in model.parameters()]
    record["noise_scale"] = engine.noise_scale
    return record


# -- under torchrun --------------------------------------------------------------------------------


def _dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


def equal(out: Path) -> None:
    rank = bd.rank()
    result = {name: run_case(two) for name, two, _ in EQUAL_CASES}
    # bf16 weights: the first gradient bucket is bf16, so the norms take an fp32 all-reduce of their own
    result["bf16"] = measure(mode="first", micro=8, dtype=torch.bfloat16)
    _dump(out / f"equal_rank{rank}.json", result)


def ramp_save(out: Path) -> None:
    record = run_ramp(stop_at=7, save=Path(os.environ["RAMP_SAVE"]))
    _dump(out / f"ramp_rank{bd.rank()}.json", record)


SCENARIOS = {"equal": equal, "ramp-save": ramp_save}


def main() -> None:
    run_scenarios(SCENARIOS)


if __name__ == "__main__":
    main()
