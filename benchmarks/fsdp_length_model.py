"""The world-2 memory model by length against the real 2-rank peak, at lengths it did not fit.

One ``torchrun`` of 2 gloo ranks (the held-out causal LM of ``tests/helpers/fsdp_lengths_common.py``,
sharded with ``fully_shard``, an emulated 3 MiB per rank) runs ``find_batch_size_for(...,
lengths=(24, 48, 96, 158))`` on the sharded model, which searches three of the lengths in lockstep
and fits ``peak ≈ F(L) + b·P(L)`` from them; then, at lengths none of the searches ran (40, 64, 120,
140), each rank measures the tracked peak of two plain steps at the batch the fitted budget gives
that length. In this process, ``plan_per_length(..., world_size=2, sharding="fsdp2")`` answers the
same table on fake tensors over a fake process group. The table gives both models' predictions
against every rank's real peak.

    python benchmarks/fsdp_length_model.py [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(HELPERS))

from _harness import machine  # noqa: E402
import fsdp_lengths_common as flc  # noqa: E402
import heldout_lm as hl  # noqa: E402

from batchpilot.app.report import format_table  # noqa: E402
from batchpilot.plan.lengths import plan_per_length  # noqa: E402
from batchpilot.policy.lengths import LengthFit  # noqa: E402

COLUMNS = ("rank", "length", "batch", "real peak", "finder's model", "error", "planner's model", "error")


def launch(out: Path, timeout: float = 300) -> None:
    """The worker's ``find`` scenario on 2 ranks; raises with its output when it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HELPERS / "fsdp_lengths_worker.py"), str(out), "find"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    done = all((out / f"find_rank{r}.json").exists() for r in range(flc.WORLD))
    if not done:
        raise RuntimeError(f"the 2-rank launch wrote no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def run() -> dict:
    with tempfile.TemporaryDirectory(prefix="bp-fsdp-model-") as tmp:
        out = Path(tmp)
        t0 = time.perf_counter()
        launch(out)
        seconds = time.perf_counter() - t0
        ranks = [json.loads((out / f"find_rank{r}.json").read_text()) for r in range(flc.WORLD)]
    planned = plan_per_length(flc.build(), flc.example(), lengths=flc.TABLE, capacity="3MiB", world_size=2,
                              sharding="fsdp2", optimizer=lambda ps: torch.optim.SGD(ps, lr=flc.LR),
                              loss_fn=hl.loss, max_batch_size=64)
    finder = LengthFit.from_state(ranks[0]["fit"])
    rows = []
    for r, doc in enumerate(ranks):
        for b, L, peak, race in doc["peaks"]:
            f, p = finder.peak(b, L), planned.fit.peak(b, L)
            rows.append({"rank": r, "length": L, "batch": b, "peak": peak, "race": race,
                         "finder": f, "finder_error": f / peak - 1, "planner": p, "planner_error": p / peak - 1})
    return {
        "benchmark": "fsdp_length_model",
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/fsdp_length_model.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "fitted": {"finder": ranks[0]["fitted"], "planner": sorted(planned.plans)},
        "per_length": ranks[0]["per_length"],
        "capacity": ranks[0]["capacity"],
        "launch_seconds": seconds,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    result = run()
    print(f"2 FSDP2 ranks, emulated 3 MiB each; the finder fitted lengths {result['fitted']['finder']}, the "
          f"planner {result['fitted']['planner']}; peaks at lengths neither fitted, at the budget's batch")
    print(format_table(COLUMNS, [
        (r["rank"], r["length"], r["batch"], r["peak"], round(r["finder"]), f"{100 * r['finder_error']:+.2f}%",
         round(r["planner"]), f"{100 * r['planner_error']:+.2f}%") for r in result["rows"]]))
    worst = max(abs(r[k]) for r in result["rows"] for k in ("finder_error", "planner_error"))
    print(f"largest error {100 * worst:.2f}% (goal: within 2%)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
