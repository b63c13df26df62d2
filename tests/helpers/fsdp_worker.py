"""torchrun worker for tests/dist/test_fsdp.py: runs the named FSDP2 scenarios in one launch.

    python -m torch.distributed.run --standalone --nproc-per-node=2 fsdp_worker.py OUT SCENARIO...

Scenarios (tests/helpers/fsdp_common.py): ``exact``, ``find``, ``plan-peak``, and ``guard`` (aborts
the process group: run it alone, last). Each writes JSON / .pt under OUT.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import fsdp_common as fc  # noqa: E402
from scenario_main import run_scenarios  # noqa: E402

SCENARIOS = {"exact": fc.run_exact, "find": fc.run_find, "plan-peak": fc.run_plan_peak, "guard": fc.run_guard}


def main() -> None:
    run_scenarios(SCENARIOS)


if __name__ == "__main__":
    main()
