"""The entry point the torchrun workers share: ``python WORKER.py OUT_DIR SCENARIO [SCENARIO ...]``.

Every rank joins a gloo group (made here, inside a function: module-level process groups abort at
exit now and then with torch 2.13), runs the named scenarios in order with ``OUT_DIR``, and leaves.
``PG_TIMEOUT_S`` (default 60) bounds every collective, so a broken scenario fails instead of hanging.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from batchpilot.dist import distributed as bd


def settle() -> None:
    """Collect garbage, then freeze what is left out of later collections' way.

    What is still alive between scenarios (or cells, or runs) is state: imports, dynamo's modules,
    FSDP's caches. Every full collection batchpilot runs (two a search, one after each OOM) would
    walk it: 55 ms each in a rank with FSDP loaded, 6 of a launch's 32 s. tests/conftest.py does
    the same between tests.
    """
    gc.collect()
    gc.freeze()


def run_scenarios(scenarios: dict[str, Callable[[Path], None]]) -> None:
    """Run the scenarios named on the command line; rank 0 prints each one's seconds as a JSON line."""
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    settle()  # the imports never become garbage
    timeout = timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "60")))
    bd.init_distributed(backend="gloo", timeout=timeout)
    for name in sys.argv[2:]:
        began = time.perf_counter()
        scenarios[name](out)
        settle()
        if bd.rank() == 0:
            print(json.dumps({"scenario": name, "seconds": round(time.perf_counter() - began, 2)}), flush=True)
    torch.distributed.destroy_process_group()
    # every scenario ran and wrote its result: leave without the interpreter's teardown, where torch
    # 2.13's gloo threads now and then abort a finished rank ("terminate called without an active
    # exception", exit -6) and torchrun fails a launch whose work is all done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
