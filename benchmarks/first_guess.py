"""The finder's answer on real memory per first guess: does it depend on what ran before it?

The case of a step that slices a dataset tensor (``X[:b]``, ``Y[:b]``; ``X`` of 4096 x 3 x 32 x 32,
a bottleneck MLP, Adam), in fresh processes (one intra-op thread, one malloc arena) whose address
space is capped at what is mapped + ``--cap-mib`` before the search. Each arm runs the default
search (``target`` 0.8) after one of: nothing (``default``), a ``first_guess`` of its own, or an
earlier search of the same step at ``target=0.95`` (``after 0.95``, whose trials are larger). Each
arm runs ``--runs`` times in fresh processes under both glibc settings (``fixed``:
``MALLOC_MMAP_THRESHOLD_=131072``; ``dynamic``: glibc's default), so that the answers' scatter
between runs of one arm can be set beside the differences between arms.

    python benchmarks/first_guess.py [--cap-mib 448] [--runs 3] [--guesses default,700,3300,3500,4096,after]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import child_env, machine  # noqa: E402

MiB = 2**20
GUESSES = ("default", "700", "3300", "3500", "4096", "after")

_CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import torch
from torch import nn
from _harness import cap_address_space
from batchpilot.find.finder import find_batch_size
torch.set_num_threads(1)
torch.manual_seed(0)
X, Y = torch.randn(4096, 3, 32, 32), torch.randint(0, 10, (4096,))
model = nn.Sequential(nn.Flatten(), nn.Linear(3072, 512), nn.ReLU(), nn.Linear(512, 64), nn.ReLU(),
                      nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

def step(b):
    opt.zero_grad()
    nn.functional.cross_entropy(model(X[:b]), Y[:b]).backward()
    opt.step()

step(8)  # the user's loop has run: Adam's state exists
cap_address_space({cap})
guess = {guess!r}
earlier = None
if guess == "after":
    earlier = find_batch_size(step, device="cpu", restore=(model, opt), target=0.95)
plan = find_batch_size(step, device="cpu", restore=(model, opt),
                       first_guess=None if guess in ("default", "after") else int(guess))
print(json.dumps({{"answer": plan.batch_size, "trials": [(t.batch_size, t.outcome, t.peak_bytes, t.start_bytes,
                                                         t.end_bytes) for t in plan.trials],
                  "stop": plan.stop_reason, "limit": plan.limit_bytes, "base": plan.base_bytes,
                  "earlier": None if earlier is None else earlier.batch_size}}))
"""


def measure(guess: str, malloc: str, cap_mib: int) -> dict:
    code = _CHILD.format(here=str(HERE), cap=cap_mib * MiB, guess=guess)
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(malloc), capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode != 0:
        return {"guess": guess, "malloc": malloc, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return {"guess": guess, "malloc": malloc, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    from batchpilot.app.report import format_table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap-mib", type=int, default=448, help="address space allowed beyond what is mapped (default 448)")
    p.add_argument("--runs", type=int, default=3, help="fresh processes per arm and glibc setting (default 3)")
    p.add_argument("--guesses", type=lambda s: s.split(","), default=list(GUESSES),
                   help=f"comma-separated arms, from {','.join(GUESSES)}")
    p.add_argument("--malloc", type=lambda s: s.split(","), default=["dynamic", "fixed"])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    rows = []
    for run in range(args.runs):  # runs interleaved: a drift of the machine spreads over every arm
        for malloc in args.malloc:
            for guess in args.guesses:
                r = measure(guess, malloc, args.cap_mib)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"find_batch_size on X[:b] under RLIMIT_AS = mapped + {args.cap_mib} MiB, "
          f"{args.runs} fresh processes per arm, {datetime.date.today()}")
    table = []
    for malloc in args.malloc:
        every = [r["answer"] for r in rows if r["malloc"] == malloc and "answer" in r]
        for guess in args.guesses:
            mine = [r for r in rows if r["malloc"] == malloc and r["guess"] == guess]
            answers = [r["answer"] for r in mine if "answer" in r]
            failed = [r["error"] for r in mine if "error" in r]
            table.append((malloc, guess, " ".join(map(str, answers)) + (f" ({len(failed)} failed)" if failed else ""),
                          max(answers) - min(answers) if answers else "-",
                          f"{statistics.median(answers) / statistics.median(every):.3f}" if answers else "-",
                          " / ".join(str(len(r["trials"])) for r in mine if "trials" in r)))
    print(format_table(("malloc", "first guess", "answers", "spread", "median / all", "trials"), table))
    if args.json is not None:
        args.json.write_text(json.dumps({"benchmark": "first_guess", "date": datetime.date.today().isoformat(),
                                         "machine": machine(), "cap_mib": args.cap_mib, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
