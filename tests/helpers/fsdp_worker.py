"""torchrun worker for tests/test_fsdp.py: runs the named FSDP2 scenarios in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node=2 fsdp_worker.py OUT SCENARIO...

Scenarios (tests/helpers/fsdp_common.py): ``exact``, ``find``, ``plan-peak``, and ``guard`` (aborts
the process group: run it alone, last). Each writes JSON / .pt under OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import fsdp_common as fc  # noqa: E402

from batchpilot import distributed as bd  # noqa: E402

SCENARIOS = {"exact": fc.run_exact, "find": fc.run_find, "plan-peak": fc.run_plan_peak, "guard": fc.run_guard}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    timeout = timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "60")))
    bd.init_distributed(backend="gloo", timeout=timeout)
    for name in sys.argv[2:]:
        began = time.perf_counter()
        SCENARIOS[name](out)
        if bd.rank() == 0:
            print(json.dumps({"scenario": name, "seconds": round(time.perf_counter() - began, 2)}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
