"""What a search leaves behind in the process that ran it, under a real address-space cap.

Each row is a fresh process (one intra-op thread, one malloc arena) that builds one of
``peers.py``'s models with a warmed-up Adam, caps its address space at what is mapped + ``--cap-mib``,
runs ``find_batch_size`` told nothing about the cap, and reports how much address space (what
``RLIMIT_AS`` counts) and resident memory the process holds after the search and its restore, beside
what each trial left (``end_bytes - start_bytes``). ``malloc`` is glibc's mmap threshold at the start:
``fixed`` (``MALLOC_MMAP_THRESHOLD_=131072``) or ``dynamic`` (glibc's default, which the finder fixes
in its own process before it measures: docs/real-memory.md).

    python benchmarks/left_behind.py [--cap-mib 1024] [--models mlp,cnn,transformer] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import BENCH_MODELS, child_env, machine  # noqa: E402

MiB = 2**20
COLUMNS = ("malloc", "model", "answer", "trials", "address space after", "resident after", "left by each trial (MiB)")

_CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import torch
from _harness import Workload, cap_address_space, vm_bytes
from batchpilot.find.finder import find_batch_size
from batchpilot.memory.host import resident_bytes
from batchpilot.memory.oom import free_memory
torch.set_num_threads(1)
w = Workload.build({model!r})
w.warm_up()
cap_address_space({cap})
vm, rss = vm_bytes(), resident_bytes()
plan = find_batch_size(w.train_step, device="cpu", restore=(w.model, w.optimizer))
free_memory("cpu")
print(json.dumps({{"answer": plan.batch_size, "trials": plan.num_trials, "vm": vm_bytes() - vm,
                  "rss": resident_bytes() - rss,
                  "left": [(t.end_bytes or 0) - (t.start_bytes or 0) for t in plan.trials]}}))
"""


def measure(model: str, malloc: str, cap_mib: int) -> dict:
    env = child_env(malloc)
    env["PYTHONPATH"] = str(HERE.parent / "src") + os.pathsep + env.get("PYTHONPATH", "")
    code = _CHILD.format(here=str(HERE), model=model, cap=cap_mib * MiB)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"model": model, "malloc": malloc, "error": proc.stderr.strip().splitlines()[-1:]}
    return {"model": model, "malloc": malloc, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    from batchpilot.app.report import format_table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap-mib", type=int, default=1024, help="address space allowed beyond what is mapped (default 1024)")
    p.add_argument("--models", type=lambda s: s.split(","), default=list(BENCH_MODELS),
                   help=f"comma-separated, from {','.join(BENCH_MODELS)}")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    rows = [measure(m, malloc, args.cap_mib) for malloc in ("fixed", "dynamic") for m in args.models]
    print(f"left behind by a search under RLIMIT_AS = mapped + {args.cap_mib} MiB, {datetime.date.today()}")
    print(format_table(COLUMNS, [
        (r["malloc"], r["model"], "-", "-", "-", "-", f"failed: {r['error']}") if "error" in r else
        (r["malloc"], r["model"], r["answer"], r["trials"], f"{r['vm'] / MiB:+.1f} MiB", f"{r['rss'] / MiB:+.1f} MiB",
         ", ".join(f"{x / MiB:.1f}" for x in r["left"]))
        for r in rows]))
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "left_behind", "date": datetime.date.today().isoformat(),
                                         "machine": machine(), "cap_mib": args.cap_mib, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
