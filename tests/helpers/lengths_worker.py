"""torchrun worker for tests/train/test_engine_lengths_dist.py: the engine sized by length under DDP.

    python -m torch.distributed.run --standalone --nproc-per-node=2 lengths_worker.py OUT SCENARIO...

Scenarios ``whole`` (``LengthConfig()``) and ``split`` (``LengthConfig(split=True)``): a TinyGPT in
DDP on an emulated 1 MiB device, no plan given (the engine fits on its first batch), batches of
different padded lengths on the two ranks (:func:`rank_batches`); ``oom``: ``whole`` with rank 1's
device shrunk under it from step 3. Each rank writes
``{scenario}_rank{r}.json``: per step its length, micro-batches and OOMs, the sizer's state and
the final parameters.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import dist_common as dc  # noqa: E402
from scenario_main import run_scenarios  # noqa: E402

from batchpilot import Engine, EngineConfig, LengthConfig  # noqa: E402
from batchpilot.dist import distributed as bd  # noqa: E402
from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch  # noqa: E402
from batchpilot.memory.probes import emulate_capacity  # noqa: E402

CAP = "1MiB"
PER_RANK = 16
#: each step's padded length on rank 0 and rank 1: either rank the longer one, then a rank beyond
#: every length verified so far (a verification on every rank), then both alike
WIDTHS = [(24, 9), (12, 40), (48, 48), (20, 6), (30, 64), (8, 16)]


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=16, heads=2, layers=1, max_len=64)


def rank_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s batch at every step: ``PER_RANK`` samples padded to that rank's width."""
    g = torch.Generator().manual_seed(7)
    out = []
    for widths in WIDTHS:
        for r, w in enumerate(widths):
            lens = torch.randint(1, w + 1, (PER_RANK,), generator=g).tolist()
            lens[3] = w  # padded to its longest sample, as a collate function does
            batch = padded_lm_batch(lens, vocab=64, generator=g)
            if r == rank:
                out.append(batch)
    return out


def _run(out: Path, name: str, config: LengthConfig, squeeze: tuple[int, float] | None = None) -> None:
    """``squeeze=(step, share)``: from that step on, rank 1's device holds ``share`` of ``CAP``."""
    rank = bd.rank()
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = Engine(ddp, opt, lm_loss, global_batch_size=PER_RANK * bd.world_size(), lengths=config,
                    config=EngineConfig(capacity=CAP))
    cap = engine.config.capacity
    batches = rank_batches(rank)
    at = len(batches) if squeeze is None else squeeze[0]
    steps, limits = [], []
    for part, device in ((batches[:at], cap), (batches[at:], cap if rank == 0 or squeeze is None
                                                 else int(squeeze[1] * cap))):
        with emulate_capacity(device):
            for batch in part:
                r = engine.step(batch)
                steps.append({"length": r.length, "sizes": list(r.micro_batch_sizes),
                              "lengths": list(r.micro_batch_lengths), "ooms": r.ooms})
                limits.append(engine.lengths.budget.limit_bytes)
    dc._dump(out / f"{name}_rank{rank}.json", {
        "steps": steps, "limits": limits, "sizer": engine.lengths.state_dict(),
        "verifications": engine.lengths.verifications, "params": [p.detach().tolist() for p in net.parameters()],
    })


def whole(out: Path) -> None:
    _run(out, "whole", LengthConfig())


def split(out: Path) -> None:
    _run(out, "split", LengthConfig(split=True))


def oom(out: Path) -> None:
    # from step 3 rank 1's device holds 30% of what the budget was fitted for: the step at 64 (searched
    # on both ranks first) still runs out there, and both ranks retry smaller and derate alike
    _run(out, "oom", LengthConfig(), squeeze=(3, 0.3))


SCENARIOS = {"whole": whole, "split": split, "oom": oom}


def main() -> None:
    run_scenarios(SCENARIOS)


if __name__ == "__main__":
    main()
