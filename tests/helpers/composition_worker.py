"""torchrun worker for tests/train/test_composition.py: the composition matrix's 2-rank cells.

    python -m torch.distributed.run --standalone --nproc-per-node=2 composition_worker.py OUT ddp fsdp

Scenario ``ddp`` runs :func:`composition.ddp_cells` with the model in ``DistributedDataParallel``,
``fsdp`` runs :func:`composition.fsdp_cells` with it ``fully_shard``-ed; each rank trains its half of
the global batch (rows ``rank·6 .. rank·6+5``). After every cell each rank rewrites
``{scenario}_rank{r}.json``: cell id → :class:`composition.Outcome`, so a launch that dies part way
still tells which cells ran.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import composition as cm  # noqa: E402
from scenario_main import run_scenarios, settle  # noqa: E402

from batchpilot.core.sharding import shard_model  # noqa: E402
from batchpilot.dist import distributed as bd  # noqa: E402


def _run(out: Path, name: str, cells: list[cm.Cell], wrap) -> None:
    rank, world = bd.rank(), bd.world_size()
    share = cm.GLOBAL // world
    only = os.environ.get("COMPOSITION_CELLS")  # comma-separated cell ids, to rerun a few by hand
    results = {}
    for cell in cells:
        if only and cell.id not in only.split(","):
            continue
        results[cell.id] = cm.run_cell(cell, wrap=wrap, rows=slice(rank * share, (rank + 1) * share),
                                       world=world).to_json()
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(results))
        settle()  # a compile cell leaves dynamo's modules and caches


def ddp(out: Path) -> None:
    _run(out, "ddp", cm.ddp_cells(), torch.nn.parallel.DistributedDataParallel)


def fsdp(out: Path) -> None:
    _run(out, "fsdp", cm.fsdp_cells(), shard_model)


if __name__ == "__main__":
    if os.environ.get("COMPOSITION_LOG"):  # batchpilot's decisions on stderr, to debug a cell by hand
        import logging

        logging.basicConfig(level=logging.DEBUG, format=f"[r{os.environ.get('RANK')}] %(name)s %(message)s")
    run_scenarios({"ddp": ddp, "fsdp": fsdp})
