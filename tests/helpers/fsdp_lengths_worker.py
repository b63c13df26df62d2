"""torchrun worker: FSDP2 sized by length (tests/helpers/fsdp_lengths_common.py)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import fsdp_lengths_common as flc  # noqa: E402
from scenario_main import run_scenarios  # noqa: E402

CAP = os.environ.get("FL_CAP", "3MiB")

SCENARIOS = {
    "whole": lambda out: flc.run(out, "whole", split=False, capacity=CAP),
    "split": lambda out: flc.run(out, "split", split=True, capacity=CAP),
    "shrink": lambda out: flc.run(out, "shrink", split=False, capacity=CAP, squeeze=(2, 0.3)),
    "shrink-split": lambda out: flc.run(out, "shrink-split", split=True, capacity=CAP, squeeze=(2, 0.3)),
}


def _fault(out):
    spec = json.loads(os.environ["FL_FAULT"])  # {"rank_at", "kind", "step", "nth", "split"}
    flc.run_fault(out, "fault", capacity=CAP, **spec)


def _hopeless(out):
    # rank 1's device shrinks past what one sample needs: an error on every rank naming it, never a hang
    try:
        flc.run(out, "hopeless", split=True, capacity=CAP, squeeze=(2, 0.1))
    except Exception as exc:
        flc.dump(out / f"hopeless_rank{flc.bd.rank()}.json", {"error": type(exc).__name__, "message": str(exc)})
        raise


SCENARIOS["fault"] = _fault
SCENARIOS["hopeless"] = _hopeless
SCENARIOS["find"] = flc.run_find
SCENARIOS["faults"] = flc.run_suite_faults


def main() -> None:
    run_scenarios(SCENARIOS)


if __name__ == "__main__":
    main()
