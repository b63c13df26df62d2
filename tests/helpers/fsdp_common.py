"""FSDP2 scenarios shared by the torchrun worker (tests/helpers/fsdp_worker.py) and tests/dist/test_fsdp.py.

The references run in one process without a process group, with the same model, data and
optimizer, so a 2-rank sharded run and its single-process reference share their code.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.nn import functional as F

from batchpilot.app.models import MLP
from batchpilot.core.sharding import shard_model
from batchpilot.dist import distributed as bd
from batchpilot.dist.fsdp import CollectiveOOMError, FSDPCoordinator, find_batch_size_fsdp
from batchpilot import find_batch_size_for
from batchpilot.memory.probes import emulate_capacity, track_peak
from batchpilot.train.engine import Engine, EngineConfig, LocalCoordinator

FEATURES = 16
CLASSES = 8
GLOBAL = 64  # samples per optimizer step over all ranks
STEPS = 7
BIG = 1 << 30  # a capacity nothing reaches: the tracker's exact figures, no OOM of its own


def build() -> nn.Module:
    torch.manual_seed(0)
    # four Linear layers: fully_shard_model shards each, then the root
    return MLP(in_features=FEATURES, width=64, depth=3, num_classes=CLASSES)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL, FEATURES, generator=g), torch.randint(0, CLASSES, (GLOBAL,), generator=g)


def shard_rows(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank::world].clone() for t in batch)


def ce_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (a sharded one gathered from all ranks: a collective)."""
    out = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(t.detach().clone())
    return out


def reference_params(steps: int = STEPS) -> list[torch.Tensor]:
    """One process, the whole global batch in one micro-batch, no OOM."""
    model = build()
    engine = Engine(model, make_optimizer(model.parameters()), ce_loss, global_batch_size=GLOBAL,
                    micro_batch_size=GLOBAL, coordinator=LocalCoordinator())
    for step in range(steps):
        engine.step(global_batch(step))
    return full_params(model)


class Clock:
    """The engine step the scenario is in, for the injectors."""

    step = -1


class InjectLoss:
    """A loss_fn raising OOM after the forward at chosen ``(step, call)``: outside any collective."""

    def __init__(self, clock: type[Clock], at: set[tuple[int, int]]) -> None:
        self.clock, self.at, self.calls, self.seen_step, self.injected = clock, at, 0, None, 0

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.seen_step != self.clock.step:
            self.seen_step, self.calls = self.clock.step, 0
        i, self.calls = self.calls, self.calls + 1
        loss = ce_loss(model, batch)
        if (self.clock.step, i) in self.at:
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM after the forward, step {self.clock.step} call {i}")
        return loss


class _InjectingComm:
    """Raise OOM when FSDP allocates a collective's buffer at chosen ``(step, call)``: inside a collective.

    ``always_from``: every allocation from that step on fails (the replay's too): no recovery.
    """

    def __init__(self, clock: type[Clock], at: set[tuple[int, int]], always_from: int | None = None) -> None:
        self.clock, self.at, self.always_from = clock, at, always_from
        self.calls, self.seen_step, self.injected = 0, None, 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.seen_step != self.clock.step:
            self.seen_step, self.calls = self.clock.step, 0
        i, self.calls = self.calls, self.calls + 1
        if (self.clock.step, i) in self.at or (self.always_from is not None and self.clock.step >= self.always_from):
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM in {self.kind} buffer, step {self.clock.step} call {i}")
        return super().allocate(size, dtype=dtype, device=device)


class InjectAllGather(_InjectingComm, DefaultAllGather):
    kind = "all-gather"


class InjectReduceScatter(_InjectingComm, DefaultReduceScatter):
    kind = "reduce-scatter"


def sharded(comm_at: dict[str, Any] | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model sharded over the process group, optionally with injecting comms on every module."""
    model = shard_model(build())
    if comm_at:
        for m in model.modules():
            if hasattr(m, "set_custom_all_gather"):
                if "all_gather" in comm_at:
                    m.set_custom_all_gather(comm_at["all_gather"])
                if "reduce_scatter" in comm_at:
                    m.set_custom_reduce_scatter(comm_at["reduce_scatter"])
    return model, make_optimizer(model.parameters())


# -- exactness with OOMs on one rank --------------------------------------------------------------

# {rank: {(step, call)}}: after the forward of the 2nd micro-batch (rank 1, step 1); the 3rd
# all-gather of the step, mid-forward (rank 1, step 3); the 2nd reduce-scatter buffer, inside the
# last micro-batch's backward (rank 0, step 5)
EXACT_LOSS_OOM = {1: {(1, 1)}}
EXACT_AG_OOM = {1: {(3, 2)}}
EXACT_RS_OOM = {0: {(5, 1)}}
EXACT_OOM_STEPS = (1, 3, 5)


def run_exact(out: Path) -> None:
    rank, world = bd.rank(), bd.world_size()
    ag = InjectAllGather(Clock, EXACT_AG_OOM.get(rank, set()))
    rs = InjectReduceScatter(Clock, EXACT_RS_OOM.get(rank, set()))
    model, opt = sharded({"all_gather": ag, "reduce_scatter": rs})
    loss_fn = InjectLoss(Clock, EXACT_LOSS_OOM.get(rank, set()))
    coord = FSDPCoordinator()
    # micro-batch 16 of a per-rank batch of 32: two micro-batches, the first without gradient sync;
    # after each OOM the micro-batch halves, and grows back after a clean step
    engine = Engine(model, opt, loss_fn, global_batch_size=GLOBAL, start=16, coordinator=coord,
                    config=EngineConfig(grow_after=2, capacity=BIG))
    steps = []
    with emulate_capacity(BIG, track=(model, opt)):
        for step in range(STEPS):
            Clock.step = step
            r = engine.step(shard_rows(global_batch(step), rank, world))
            steps.append({"micro": r.micro_batch_size, "accum": r.accum_steps, "ooms": r.ooms, "loss": r.loss,
                          "seconds": r.seconds})
    params = full_params(model)
    if rank == 0:
        torch.save(params, out / "exact_params.pt")
    dump(out / f"exact_rank{rank}.json", {
        "steps": steps, "replays": coord.replays, "remote_ooms": coord.remote_ooms,
        "injected": {"loss": loss_fn.injected, "all_gather": ag.injected, "reduce_scatter": rs.injected},
        "coordinator": type(engine.coordinator).__name__,
    })


# -- the finder in lockstep -------------------------------------------------------------------------

FIND_MAX = 32  # samples in the finder's example batch (the per-rank batch of the engine)


def trial_peak(b: int, rounds: int) -> int:
    """Exact peak of a warm engine-style step at micro-batch ``b`` (``rounds`` micro-batches), on every rank."""
    model, opt = sharded()
    x, y = shard_rows(global_batch(0), bd.rank(), bd.world_size())
    engine = Engine(model, opt, ce_loss, global_batch_size=GLOBAL, micro_batch_size=b, config=EngineConfig(capacity=BIG))
    with emulate_capacity(BIG, track=(model, opt)):
        engine.step((x, y))  # optimizer state exists from here on
        with track_peak("cpu", track=(model, opt)) as m:
            engine.step((x[: b * rounds], y[: b * rounds]))
    return m.peak_bytes


def run_find(out: Path) -> None:
    rank, world = bd.rank(), bd.world_size()
    per_rank = GLOBAL // world
    # rank 1's device holds about a quarter of the per-rank batch at the default target 0.8
    small = int(trial_peak(per_rank // 4, 2) / 0.8)
    capacity = {0: 4 * trial_peak(per_rank, 1), 1: small}[rank]
    result: dict[str, Any] = {"capacity": capacity}

    # 1. the engine's own finder (micro_batch_size="auto", no start)
    model, opt = sharded()
    coord = FSDPCoordinator()
    engine = Engine(model, opt, ce_loss, global_batch_size=GLOBAL, coordinator=coord,
                    config=EngineConfig(capacity=capacity))
    steps = []
    with emulate_capacity(capacity, track=(model, opt)):
        for step in range(3):
            r = engine.step(shard_rows(global_batch(step), rank, world))
            steps.append({"micro": r.micro_batch_size, "accum": r.accum_steps})
    plan = engine.plan
    result["engine"] = {
        "steps": steps, "limited_by_rank": coord.limited_by_rank, "plan_batch": plan.batch_size,
        "trials": [(t.batch_size, t.outcome, t.peak_bytes) for t in plan.trials],
    }
    params = full_params(model)
    if rank == 0:
        torch.save(params, out / "find_engine_params.pt")

    # 2. find_batch_size_fsdp on a step of your own: first the truth (room for everything), then
    # rank 1's device between the peaks at 8 and 16 samples, so that its trials run out of memory
    model, opt = sharded()
    x, y = shard_rows(global_batch(1), rank, world)
    engine_warm = Engine(model, opt, ce_loss, global_batch_size=GLOBAL, micro_batch_size=per_rank,
                         config=EngineConfig(capacity=BIG))
    engine_warm.step((x, y))  # sharded Adam state exists: the restore must put it back bit for bit
    before = [p.to_local().clone() for p in model.parameters()]
    state_before = [v.to_local().clone() for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")]

    def step(b: int) -> None:
        opt.zero_grad(set_to_none=True)
        ce_loss(model, (x[:b], y[:b])).backward()
        opt.step()

    coord = FSDPCoordinator()
    common = dict(restore=(model, opt), coordinator=coord, device="cpu", target=1.0, max_batch_size=FIND_MAX, strategy="binsearch")
    truth = find_batch_size_fsdp(step, capacity=BIG, **{**common, "max_batch_size": 16})
    peaks = {t.batch_size: t.peak_bytes for t in truth.trials}
    tight = {0: BIG, 1: (peaks[8] + peaks[16]) // 2}[rank]
    began = time.perf_counter()
    plan = find_batch_size_fsdp(step, capacity=tight, **common)
    # the generic helper on the sharded model: the same lockstep search, chosen by itself
    generic = find_batch_size_for(model, (x, y), optimizer=opt, loss_fn=ce_loss, capacity=tight, target=1.0,
                                  max_batch_size=FIND_MAX, strategy="binsearch")
    result["generic"] = {"batch_size": generic.batch_size, "limited_by_rank": generic.limited_by_rank,
                         "trials": [(t.batch_size, t.outcome, t.peak_bytes) for t in generic.trials]}
    # the finder's own layer has no lockstep search (it lives in dist, above it): told so, before any trial
    from batchpilot.find.front import find_batch_size_for as finder_layer

    try:
        finder_layer(model, (x, y), optimizer=opt, loss_fn=ce_loss, capacity=tight, max_batch_size=FIND_MAX)
        result["finder_layer"] = "searched"
    except ValueError as e:
        result["finder_layer"] = str(e)
    result["direct"] = {
        "truth": [(t.batch_size, t.outcome, t.peak_bytes) for t in truth.trials],
        "batch_size": plan.batch_size, "limited_by_rank": plan.limited_by_rank, "capacity": tight,
        "trials": [(t.batch_size, t.outcome, t.peak_bytes) for t in plan.trials],
        "seconds": time.perf_counter() - began, "replays": coord.replays,
        "restored": all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())),
        "state_restored": all(
            torch.equal(a, v.to_local()) for a, v in
            zip(state_before, [v for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")])
        ),
    }
    dump(out / f"find_rank{rank}.json", result)


# -- the hang guard ---------------------------------------------------------------------------------

GUARD_FROM = 2  # from this step on, every all-gather buffer on rank 1 fails: the replay too
GUARD_MICRO = 8


def run_guard(out: Path) -> None:
    rank, world = bd.rank(), bd.world_size()
    # what each rank says, as it says it: the launcher stops the others once one process exits
    log = logging.FileHandler(out / f"guard_rank{rank}.log")
    log.setLevel(logging.ERROR)
    logging.getLogger("batchpilot.dist.fsdp").addHandler(log)
    ag = InjectAllGather(Clock, set(), always_from=GUARD_FROM if rank == 1 else None)
    model, opt = sharded({"all_gather": ag})
    engine = Engine(model, opt, ce_loss, global_batch_size=GLOBAL, start=GUARD_MICRO,
                    config=EngineConfig(capacity=BIG, grow_after=100))
    began = time.perf_counter()
    outcome: dict[str, Any] = {"error": None}
    try:
        for step in range(STEPS):
            Clock.step = step
            engine.step(shard_rows(global_batch(step), rank, world))
    except CollectiveOOMError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc), "rank": exc.rank,
                   "micro_batch_size": exc.micro_batch_size, "step": exc.step}
        raise
    finally:
        outcome["seconds"] = time.perf_counter() - began
        dump(out / f"guard_rank{rank}.json", outcome)


# -- the planner's validation: a real sharded step's tracked peak -------------------------------------

PLAN_BATCH = 24


def run_plan_peak(out: Path) -> None:
    """Two real steps at PLAN_BATCH per rank under the tracker, from a fresh optimizer."""
    rank = bd.rank()
    model, opt = sharded()
    x = torch.randn(PLAN_BATCH, FEATURES)
    y = torch.randint(0, CLASSES, (PLAN_BATCH,))
    with track_peak("cpu", track=(model, opt)) as m:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            ce_loss(model, (x, y)).backward()
            opt.step()
    dump(out / f"plan_rank{rank}.json", {"peak": m.peak_bytes, "start": m.start_bytes})


def dump(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
