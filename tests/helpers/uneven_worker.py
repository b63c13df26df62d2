"""torchrun worker for tests/dist/test_uneven.py: uneven shares of one global batch on 2 gloo ranks.

Scenarios (all in one launch): ``exact`` (DDP deferred and overlapped, FSDP2, each loss kind and
AMP of uneven_common.CASES, shares 3:1, the per-rank micro-batch counts differing),
``oom`` (rank 1 under an emulated capacity that its first micro-batch exceeds: a real
allocator failure of the storage tracker; the ranks must agree and stay exact),
``auto`` (shares="auto", rank 1 slowed, an ElasticLoader following the engine's shares,
a checkpoint mid-epoch), output under the directory given as the first argument.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import uneven_common as uc  # noqa: E402
from scenario_main import run_scenarios  # noqa: E402

from batchpilot.core.sharding import shard_model  # noqa: E402
from batchpilot.dist import distributed as bd  # noqa: E402
from batchpilot.dist.fsdp import FSDPCoordinator  # noqa: E402
from batchpilot.memory.probes import emulate_capacity  # noqa: E402
from batchpilot.train.data import ElasticBatchSampler, ElasticLoader  # noqa: E402
from batchpilot.train.engine import Engine  # noqa: E402


def _train(out: Path, name: str, model: nn.Module, wrapped: nn.Module, coordinator, case: str,
           starts: tuple[int, int], capacity: int | None = None) -> None:
    rank = bd.rank()
    dtype, kind, amp, _ = uc.CASES[case]
    opt = uc.optimizer(wrapped)
    engine = Engine(wrapped, opt, uc.loss_fn(kind), global_batch_size=uc.GLOBAL, shares=[3, 1],
                    start=starts[rank], coordinator=coordinator, amp=amp,
                    grad_clip=uc.CLIP if "clip" in case else None, config=uc.config())
    steps = []
    with emulate_capacity(capacity if capacity is not None else 1 << 30, track=(wrapped, opt)):
        for step in range(len(uc.STEP_SIZES)):
            r = engine.step(uc.rank_rows(step, rank, dtype))
            steps.append({"samples": r.samples, "accum": r.accum_steps, "sizes": list(r.micro_batch_sizes),
                          "ooms": r.ooms, "micro": r.micro_batch_size})
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in wrapped.parameters()]
    if rank == 0:
        torch.save(params, out / f"{name}_params.pt")
    uc.dump(out / f"{name}_rank{rank}.json", {
        "steps": steps, "collectives": coordinator.collectives, "shares": list(engine.shares),
        "remote_ooms": coordinator.remote_ooms,
    })


def exact(out: Path) -> None:
    for case in uc.CASES:
        dtype = uc.CASES[case][0]
        model = uc.build(dtype)
        # rank 0: its 24 in one micro-batch; rank 1: its 8 in three: DDP runs 1 and 3 passes
        _train(out, f"ddp-{case}", model, nn.parallel.DistributedDataParallel(model), bd.DistributedCoordinator(),
               case, (24, 3))
        # FSDP2: every rank runs the larger count (three), rank 0 cutting its 24 into 8s
        fsdp = shard_model(uc.build(dtype))
        _train(out, f"fsdp-{case}", fsdp, fsdp, FSDPCoordinator(), case, (24, 3))
    model = uc.build(torch.float64)
    _train(out, "ddp-overlap-fp64-mean", model, nn.parallel.DistributedDataParallel(model),
           bd.DistributedCoordinator(defer_grad_sync=False), "fp64-mean", (24, 3))


def oom(out: Path) -> None:
    # rank 1 holds a third of what its micro-batch of 8 needs: its first attempt runs out of
    # memory in the tracker (a real allocation refused), both ranks drop and retry, rank 1 alone shrinks
    model = uc.build(torch.float64, uc.OOM_COPIES)
    capacity = {0: 1 << 30, 1: uc.OOM_CAPACITY}[bd.rank()]
    _train(out, "oom", model, nn.parallel.DistributedDataParallel(model), bd.DistributedCoordinator(),
           "fp64-mean", (24, 8), capacity=capacity)


AUTO_DATASET = 203
AUTO_GLOBAL = 16


class _Slow(nn.Module):
    """Rank 1's loss takes longer per sample (a sleep per sample: the test is of the decision, not of speed)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def __call__(self, model: nn.Module, batch):
        x, y = batch
        if self.delay:
            time.sleep(self.delay * len(y))
        return nn.functional.cross_entropy(model(x), y)


def auto(out: Path) -> None:
    """shares="auto" with rank 1 three times slower; the data follow; a checkpoint at step 25."""
    rank, world = bd.rank(), bd.world_size()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(AUTO_DATASET, uc.FEATURES),
                                          torch.randint(0, uc.CLASSES, (AUTO_DATASET,)), torch.arange(AUTO_DATASET))
    model = uc.build(torch.float32)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = uc.optimizer(ddp)
    loss = _Slow(0.004 if rank == 1 else 0.0)
    engine = Engine(ddp, opt, lambda m, b: loss(m, b[:2]), global_batch_size=AUTO_GLOBAL, shares="auto",
                    config=uc.config())
    sampler = ElasticBatchSampler(AUTO_DATASET, AUTO_GLOBAL // world, seed=3, num_replicas=world, rank=rank)
    loader = ElasticLoader(data, sampler)
    seen, history = [], []
    step = 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            engine.step(batch)
            step += 1
            seen.append([epoch, *batch[2].tolist()])
            history.append(list(engine.shares))
            loader.set_shares(engine.shares)
            if step == 25:
                torch.save({"engine": engine.state_dict(), "data": loader.state_dict()}, out / f"auto_ckpt_rank{rank}.pt")
                seen.append(["checkpoint"])
    uc.dump(out / f"auto_rank{rank}.json", {"seen": seen, "history": history,
                                           "rebalances": engine.rank_shares.rebalances,
                                           "describe": engine.describe()})


SCENARIOS = {"exact": exact, "oom": oom, "auto": auto}


def main() -> None:
    run_scenarios(SCENARIOS)


if __name__ == "__main__":
    main()
