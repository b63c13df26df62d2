"""torchrun worker for tests/dist/test_distributed.py: runs the named scenarios in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node=2 dist_worker.py OUT SCENARIO...

Scenarios: ``collectives``, ``find``, ``engine-find``, ``oom``, ``plain`` (no coordinator passed), ``elastic-save`` / ``elastic-resume`` (paths in
the environment, see below), ``crash`` (rank 1 raises), ``hang`` (rank 1 never joins the
collective; the process-group timeout must end the job). Each writes JSON / .pt under OUT.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import dist_common as dc  # noqa: E402
from scenario_main import run_scenarios  # noqa: E402

from batchpilot.dist import distributed as bd  # noqa: E402


def collectives(out: Path) -> None:
    rank = bd.rank()
    result = {
        "rank": rank, "world": bd.world_size(), "local_rank": bd.local_rank(),
        "min": bd.all_reduce_int(10 + rank, "min"),
        "max": bd.all_reduce_int(10 + rank, "max"),
        "sum": bd.all_reduce_int(10 + rank, "sum"),
        "min_with_rank": bd.agree_min_with_rank(5 - 3 * rank),  # rank 1 has the smaller value
        "tie": bd.agree_min_with_rank(7),  # equal everywhere: the lowest rank wins
        "negative": bd.agree_min_with_rank(-4 if rank == 1 else 3),
    }
    # the engine's per-attempt agreement: an OOM vote and the next micro-batch in one all-reduce
    coord = bd.DistributedCoordinator()
    result["agree_clean"] = coord.agree(False, 9 - 3 * rank)  # rank 1 proposes the smaller size
    result["agree_limited_by"] = coord.limited_by_rank
    result["agree_oom"] = coord.agree(rank == 1, 9)  # rank 1 ran out of memory
    result["agree_remote_ooms"], result["agree_collectives"] = coord.remote_ooms, coord.collectives
    result["grads"], result["buffer"] = _sync_gradients_case(rank)
    dc._dump(out / f"collectives_rank{rank}.json", result)


def _sync_gradients_case(rank: int) -> tuple[dict, list[float]]:
    """Gradients present on both ranks, on one, on none; packed and in place; fp32 and bf16."""
    net = nn.Module()
    net.both = nn.Parameter(torch.zeros(3, 5))
    net.only_rank1 = nn.Parameter(torch.zeros(7))
    net.nowhere = nn.Parameter(torch.zeros(2))
    net.large = nn.Parameter(torch.zeros(512, 512))  # 1 MiB: all-reduced in place
    net.large_only_rank0 = nn.Parameter(torch.zeros(1024, 256))
    net.low = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    net.register_buffer("stat", torch.zeros(3))
    net.forward = lambda x: x  # DDP needs a module; this test sets gradients by hand
    ddp = nn.parallel.DistributedDataParallel(net)
    net.stat.fill_(10.0 + rank)  # diverged buffers: sync_gradients puts rank 0's back
    grads = {"both": 1.0 + rank, "only_rank1": 4.0 if rank == 1 else None, "nowhere": None,
             "large": 2.0 * (rank + 1), "large_only_rank0": 6.0 if rank == 0 else None, "low": 0.5 + rank}
    for name, value in grads.items():
        p = getattr(net, name)
        p.grad = None if value is None else torch.full_like(p, value)
    bd.DistributedCoordinator().sync_gradients(ddp)
    out = {}
    for name in grads:
        g = getattr(net, name).grad
        out[name] = None if g is None else sorted(set(g.float().flatten().tolist()))
    return out, net.stat.tolist()


def _outcome(fn) -> dict:
    """Run ``fn``; the error, if any, is recorded by type and message (the test compares them)."""
    try:
        plan = fn()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"batch_size": plan.batch_size, "limited_by_rank": plan.limited_by_rank,
            "local_best": max(t.batch_size for t in plan.trials if t.outcome == "fit")}


def find(out: Path) -> None:
    rank = bd.rank()
    model, opt = dc.oom_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, dc.OOM_FEATURES, generator=g), torch.randint(0, 10, (512,), generator=g)

    def step(b: int, net: nn.Module = model) -> None:
        opt.zero_grad(set_to_none=True)
        dc.ce_loss(net, (x[:b].clone(), y[:b].clone())).backward()
        opt.step()

    peak_small, peak_large = dc.step_peak(1), dc.step_peak(128)
    # rank 1 has the smaller device: about half the batch fits there
    capacity = {0: 2 * peak_large, 1: peak_small + peak_large}[rank]
    common = dict(device="cpu", capacity=capacity, target=0.9, max_batch_size=256, restore=(ddp, opt))
    before = [p.detach().clone() for p in model.parameters()]
    result = {
        "plan": _outcome(lambda: bd.find_batch_size_distributed(step, **common)),
        # the step runs the DDP wrapper: refused on every rank, no hang
        "wrapper": _outcome(lambda: bd.find_batch_size_distributed(lambda b: step(b, ddp), **common)),
        # nothing fits on rank 1 only: every rank raises NothingFitsError naming rank 1
        "nothing_fits": _outcome(lambda: bd.find_batch_size_distributed(
            step, **{**common, "capacity": capacity if rank == 0 else peak_small // 2})),
        # the step fails on rank 0 only: rank 0 re-raises its error, rank 1 stops too
        "failure": _outcome(lambda: bd.find_batch_size_distributed(
            (lambda b: (_ for _ in ()).throw(ValueError("bad step on rank 0"))) if rank == 0 else step, **common)),
        "restored": all(torch.equal(a, p) for a, p in zip(before, model.parameters())),
    }
    dc._dump(out / f"find_rank{rank}.json", result)


def oom(out: Path) -> None:
    per_rank = dc.OOM_GLOBAL // 2
    full, half = dc.step_peak(per_rank), dc.step_peak(per_rank // 2)
    assert half < full, f"the scenario needs a smaller peak at a smaller micro-batch: {half} >= {full}"
    # rank 1's device fits half the per-rank batch but not all of it; rank 0 never runs out
    capacities = {0: 8 * full, 1: (half + full) // 2}
    # and one injected OOM on rank 1 in the *second* micro-batch of step 5, while rank 0 runs on
    dc.run_oom(out, capacities=capacities, inject={1: {(5, 1)}})


def engine_find(out: Path) -> None:
    dc.run_engine_find(out)


def elastic_save(out: Path) -> None:
    dc.run_elastic(out, "save2", steps=2, save=Path(os.environ["ELASTIC_SAVE"]))


def elastic_resume(out: Path) -> None:
    dc.run_elastic(out, "resume2", steps=None, resume=Path(os.environ["ELASTIC_RESUME"]))


def plain(out: Path) -> None:
    dc.run_plain(out)


def crash(out: Path) -> None:
    if bd.rank() == 1:
        raise RuntimeError("rank 1 died on purpose")
    bd.all_reduce_int(1, "sum")  # rank 0 waits for a rank that is gone


def hang(out: Path) -> None:
    if bd.rank() == 1:
        time.sleep(600)  # never joins; torchrun stops it once rank 0 has failed
    bd.all_reduce_int(1, "sum")


SCENARIOS = {
    "collectives": collectives, "find": find, "engine-find": engine_find, "oom": oom, "elastic-save": elastic_save,
    "elastic-resume": elastic_resume, "plain": plain, "crash": crash, "hang": hang,
}


def main() -> None:
    run_scenarios(SCENARIOS)


if __name__ == "__main__":
    main()
