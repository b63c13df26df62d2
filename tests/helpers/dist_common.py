"""Scenarios shared by the torchrun worker (tests/helpers/dist_worker.py) and the tests.

Every function here runs the same way in one process (no process group: world 1) and under
torchrun, so a single-process reference and a 2-rank run share their code exactly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from batchpilot.app.models import MLP
from batchpilot.dist import distributed as bd
from batchpilot.memory.probes import emulate_capacity, track_peak
from batchpilot.train.data import ElasticBatchSampler, ElasticLoader
from batchpilot.train.engine import Engine, EngineConfig, LocalCoordinator

# -- OOM on one rank ---------------------------------------------------------------------------

OOM_GLOBAL = 256  # samples per optimizer step over all ranks
OOM_STEPS = 20
OOM_FEATURES = 32


def oom_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # activations (not parameters) dominate the peak, so a smaller micro-batch needs less memory
    model = MLP(in_features=OOM_FEATURES, width=64, depth=2)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def oom_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of ``step`` (identical on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(OOM_GLOBAL, OOM_FEATURES, generator=g), torch.randint(0, 10, (OOM_GLOBAL,), generator=g)


def shard(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows (interleaved, as the samplers deal them); cloned so a tracker counts them."""
    return tuple(t[rank::world].clone() for t in batch)


def ce_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


class InjectOOM:
    """A loss_fn that raises ``torch.OutOfMemoryError`` at chosen ``(step, call within the step)``."""

    def __init__(self, at: set[tuple[int, int]]) -> None:
        self.at, self.step, self.calls, self.injected = at, 0, 0, 0

    def begin(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        i, self.calls = self.calls, self.calls + 1
        loss = ce_loss(model, batch)
        if (self.step, i) in self.at:
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM at step {self.step}, loss_fn call {i}")
        return loss


def step_peak(micro: int) -> int:
    """Exact CPU peak of a warm single-process step of the OOM model at ``micro`` (per-rank batch)."""
    model, opt = oom_model()
    per_rank = OOM_GLOBAL // 2
    # one process's measurement, also inside a torchrun worker: a local coordinator on purpose
    local = LocalCoordinator()
    Engine(model, opt, ce_loss, global_batch_size=per_rank, micro_batch_size=per_rank, coordinator=local).step(
        shard(oom_batch(0), 0, 2)
    )
    with track_peak("cpu", track=(model, opt)) as m:
        Engine(model, opt, ce_loss, global_batch_size=per_rank, micro_batch_size=micro, coordinator=local).step(
            shard(oom_batch(1), 0, 2)
        )
    return m.peak_bytes


def reference_oom_params(steps: int = OOM_STEPS) -> list[torch.Tensor]:
    """One process, one micro-batch of the whole global batch, no OOM."""
    model, opt = oom_model()
    engine = Engine(model, opt, ce_loss, global_batch_size=OOM_GLOBAL, micro_batch_size=OOM_GLOBAL)
    for step in range(steps):
        engine.step(oom_batch(step))
    return [p.detach().clone() for p in model.parameters()]


def run_oom(out: Path, *, capacities: dict[int, int], inject: dict[int, set[tuple[int, int]]]) -> None:
    """Train OOM_STEPS steps under DDP; rank r runs under ``capacities[r]`` bytes."""
    rank, world = bd.rank(), bd.world_size()
    model, opt = oom_model()
    ddp = nn.parallel.DistributedDataParallel(model) if bd.is_distributed() else model
    coordinator = bd.DistributedCoordinator()
    loss_fn = InjectOOM(inject.get(rank, set()))
    # capacity: the engine plans against more than the emulated device holds, so it keeps trying
    # to grow into a micro-batch that OOMs on rank 1 (and backs off each time)
    engine = Engine(
        ddp, opt, loss_fn, global_batch_size=OOM_GLOBAL, start=OOM_GLOBAL // world,
        coordinator=coordinator, config=EngineConfig(grow_after=2, capacity=2**30),
    )
    assert engine.per_rank_batch_size == OOM_GLOBAL // world
    steps = []
    with emulate_capacity(capacities[rank], track=(model, opt)):
        for step in range(OOM_STEPS):
            loss_fn.begin(step)
            r = engine.step(shard(oom_batch(step), rank, world))
            steps.append({"micro": r.micro_batch_size, "accum": r.accum_steps, "ooms": r.ooms, "loss": r.loss})
    torch.save([p.detach().clone() for p in model.parameters()], out / f"oom_params_rank{rank}.pt")
    _dump(out / f"oom_rank{rank}.json", {
        "steps": steps, "remote_ooms": coordinator.remote_ooms, "limited_by_rank": coordinator.limited_by_rank,
        "injected": loss_fn.injected, "capacity": capacities[rank],
    })


# -- The engine's finder under DDP -------------------------------------------------------------

ENGINE_FIND_STEPS = 3


def run_engine_find(out: Path) -> None:
    """The engine's own finder (no ``start``) on 2 ranks whose devices differ.

    ``overlap``: ``defer_grad_sync=False``, so every micro-batch of a step goes through DDP's
    synchronising backward; the finder's trials must not (ranks run different trials). Rank 1's
    smaller device sets the micro-batch of both. ``nothing_fits``: nothing fits on rank 1; every
    rank must raise NothingFitsError, and no state may change.
    """
    rank, world = bd.rank(), bd.world_size()
    per_rank = OOM_GLOBAL // world
    # rank 0 fits all of its share, rank 1 about a quarter (the finder aims at 0.8 of capacity)
    capacities = {0: 8 * step_peak(per_rank), 1: int(step_peak(per_rank // 4) / 0.8)}
    result: dict[str, Any] = {}

    model, opt = oom_model()
    # with a buffer, every forward through the DDP wrapper broadcasts it (broadcast_buffers): a
    # trial through the wrapper would be a collective, and the ranks run different trials
    model.register_buffer("marker", torch.zeros(4))
    coordinator = bd.DistributedCoordinator(defer_grad_sync=False)
    ddp = nn.parallel.DistributedDataParallel(model)
    wrapper_calls = [0]
    ddp.register_forward_pre_hook(lambda module, args: wrapper_calls.__setitem__(0, wrapper_calls[0] + 1))
    engine = Engine(ddp, opt, ce_loss, global_batch_size=OOM_GLOBAL,
                    coordinator=coordinator, config=EngineConfig(capacity=capacities[rank]))
    steps = []
    for step in range(ENGINE_FIND_STEPS):
        r = engine.step(shard(oom_batch(step), rank, world))
        steps.append({"micro": r.micro_batch_size, "accum": r.accum_steps, "samples": r.samples})
    torch.save([p.detach().clone() for p in model.parameters()], out / f"engine_find_params_rank{rank}.pt")
    result["overlap"] = {"steps": steps, "limited_by_rank": coordinator.limited_by_rank, "per_rank": per_rank,
                         "describe": engine.describe(), "wrapper_calls": wrapper_calls[0]}

    model, opt = oom_model()
    before = [p.detach().clone() for p in model.parameters()]
    tiny = {0: capacities[0], 1: step_peak(1) // 2}[rank]
    engine = Engine(nn.parallel.DistributedDataParallel(model), opt, ce_loss, global_batch_size=OOM_GLOBAL,
                    coordinator=bd.DistributedCoordinator(), config=EngineConfig(capacity=tiny))
    try:
        engine.step(shard(oom_batch(0), rank, world))
        outcome = {"error": None}
    except Exception as exc:  # recorded; the test compares the ranks' errors
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["restored"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    result["nothing_fits"] = outcome
    _dump(out / f"engine_find_rank{rank}.json", result)


# -- Elastic resume ----------------------------------------------------------------------------

ELASTIC_N = 96  # samples; divides by both world sizes and the global batch: no padding
ELASTIC_GLOBAL = 16
ELASTIC_FEATURES = 12


class IndexedData(torch.utils.data.Dataset):
    """``(x, y, index)`` rows of a fixed synthetic data set."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(ELASTIC_N, ELASTIC_FEATURES, generator=g)
        self.y = torch.randint(0, 10, (ELASTIC_N,), generator=g)

    def __len__(self) -> int:
        return ELASTIC_N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def elastic_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = MLP(in_features=ELASTIC_FEATURES, width=32, depth=1)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def run_elastic(out: Path, tag: str, *, steps: int | None, resume: Path | None = None,
                save: Path | None = None, micro: int = 4) -> None:
    """Train ``steps`` steps of epoch 0 (None: to its end); optionally resume from / save to a checkpoint.

    Writes the sample ids each rank trained on, per step, to ``<out>/<tag>_rank<r>.json``.
    """
    rank, world = bd.rank(), bd.world_size()
    model, opt = elastic_model()
    data = IndexedData()
    state = torch.load(resume, weights_only=False) if resume is not None else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    ddp = nn.parallel.DistributedDataParallel(model) if bd.is_distributed() else model
    # the same global batch on any world size: the engine derives this rank's share
    engine = Engine(ddp, opt, ce_loss, global_batch_size=ELASTIC_GLOBAL, start=min(micro, ELASTIC_GLOBAL // world),
                    coordinator=bd.DistributedCoordinator())
    sampler = ElasticBatchSampler(len(data), engine.per_rank_batch_size, shuffle=True, seed=5)
    loader = ElasticLoader(data, sampler)
    if state is not None:
        # the sampler keeps its per-rank batch when the world changed; the engine clamps its
        # saved micro-batch to the new per-rank batch
        loader.load_state_dict(state["sampler"])
        engine.load_state_dict(state["engine"])
    seen: list[list[int]] = []
    shapes: list[dict[str, int]] = []
    loader.set_epoch(0)
    for batch in loader:
        x, y, ids = batch
        r = engine.step((x, y))
        seen.append(ids.tolist())
        shapes.append({"micro": r.micro_batch_size, "accum": r.accum_steps, "samples": r.samples, "world": world,
                       "global": engine.global_batch_size, "per_rank": engine.per_rank_batch_size})
        if steps is not None and len(seen) == steps:
            break
    if save is not None and rank == 0:
        torch.save({
            "model": bd.unwrap_model(ddp).state_dict(), "optimizer": opt.state_dict(),
            "sampler": loader.state_dict(), "engine": engine.state_dict(),
        }, save)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out / f"{tag}_params.pt")
    _dump(out / f"{tag}_rank{rank}.json", {"seen": seen, "shapes": shapes})


def reference_elastic_params() -> list[torch.Tensor]:
    """One process, one whole epoch without a restart, the same sample order."""
    model, opt = elastic_model()
    data = IndexedData()
    sampler = ElasticBatchSampler(len(data), ELASTIC_GLOBAL, shuffle=True, seed=5, num_replicas=1, rank=0)
    engine = Engine(model, opt, ce_loss, global_batch_size=ELASTIC_GLOBAL, micro_batch_size=ELASTIC_GLOBAL)
    for idx in sampler:
        engine.step((data.x[idx], data.y[idx]))
    return [p.detach().clone() for p in model.parameters()]


def _dump(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


# -- the engine under torchrun with no coordinator passed -----------------------------------------

PLAIN_STEPS = 4


def run_plain(out: Path) -> None:
    """An unwrapped model and an Engine given no coordinator: what a new user writes first."""
    rank, world = bd.rank(), bd.world_size()
    model, opt = oom_model()
    engine = Engine(model, opt, ce_loss, global_batch_size=OOM_GLOBAL, micro_batch_size=OOM_GLOBAL // (2 * world))
    samples = []
    for step in range(PLAIN_STEPS):
        r = engine.step(shard(oom_batch(step), rank, world))
        samples.append(r.samples)
    torch.save([p.detach().clone() for p in model.parameters()], out / f"plain_params_rank{rank}.pt")
    _dump(out / f"plain_rank{rank}.json", {
        "world": engine.world_size, "per_rank": engine.per_rank_batch_size, "samples": samples,
        "coordinator": type(engine.coordinator).__name__, "describe": engine.describe(),
    })
