"""The Accelerate drop-in against Accelerate's own decorator and the finder, on real memory.

Every measurement is a fresh interpreter (``subprocess``, no fork server) that builds a CNN with
BatchNorm, its Adam optimizer and a dataset of images, runs one tiny training step (kernels
loaded), and only then caps its address space with ``RLIMIT_AS`` at what is mapped plus
``--cap-mib``. The decorated function is Accelerate's pattern: it prepares the model, optimizer and
loader with an ``Accelerator`` and trains one epoch. Methods:

- ``accelerate``: ``accelerate.utils.find_executable_batch_size`` (x0.9 per OOM) from ``--start``;
- ``drop-in``: ``batchpilot.integrations.accelerate.find_executable_batch_size(target=0.99)``
  from the same start, told nothing about the cap;
- ``finder``: ``batchpilot.find_batch_size(step, target=0.99, restore=(model, optimizer))`` on one
  training step of the same model, then the same epoch at its answer.

"True max" is the largest batch whose epoch completes under the same cap in a fresh process,
found by bisection (each probe its own process), per glibc setting (``fixed``:
``MALLOC_MMAP_THRESHOLD_=131072``; ``dynamic``: glibc's default). Cached in
``benchmarks/.cache/accelerate_dropin_truth.json``.

    python benchmarks/accelerate_dropin.py [--cap-mib 768] [--malloc fixed,dynamic] [--runs 3]
                                           [--methods accelerate,drop-in,finder] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import largest_fitting  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / ".cache" / "accelerate_dropin_truth.json"
MiB = 2**20
#: images in the dataset: one epoch is this many samples
SAMPLES = 4096
METHODS = ("accelerate", "drop-in", "finder")


def _env(malloc: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    if malloc == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    elif malloc == "dynamic":
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        raise ValueError(f"malloc must be 'fixed' or 'dynamic', got {malloc!r}")
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ---------------------------------------------------------------------------------------------------
# the child: one measurement in a fresh process


def _child(method: str, cap_mib: int, batch: int, start: int) -> dict[str, Any]:
    import resource

    import torch
    from accelerate import Accelerator
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(SAMPLES, 3, 32, 32), torch.randint(0, 10, (SAMPLES,)))
    accelerator = Accelerator(cpu=True)
    calls: list[list[Any]] = []

    def is_oom(exc: BaseException) -> bool:
        return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc) or isinstance(
            exc, torch.OutOfMemoryError)

    def epoch(batch_size: int) -> int:
        accelerator.free_memory()
        loader = DataLoader(data, batch_size=batch_size)
        m, opt, loader = accelerator.prepare(model, optimizer, loader)
        steps = 0
        try:
            for x, y in loader:
                opt.zero_grad(set_to_none=True)
                accelerator.backward(nn.functional.cross_entropy(m(x), y))
                opt.step()  # the drop-in's trials stop the function here after their steps
                steps += 1
        except BaseException as exc:
            calls.append([batch_size, "oom" if is_oom(exc) else "error" if isinstance(exc, Exception) else "trial"])
            raise
        calls.append([batch_size, "ok"])
        return steps

    def one_step(b: int) -> None:
        x, y = next(iter(DataLoader(data, batch_size=b)))  # a batch as the epoch's loader makes it
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    one_step(2)  # kernels loaded, Adam's state created
    cap = _vm_bytes() + cap_mib * MiB
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    t0 = time.perf_counter()
    out: dict[str, Any] = {"method": method}
    try:
        if method == "probe":
            epoch(batch)
            out["found"] = batch
        elif method == "accelerate":
            from accelerate.utils import find_executable_batch_size as accelerate_find

            def run_accelerate(batch_size: int) -> int:
                epoch(batch_size)
                return batch_size

            out["found"] = accelerate_find(run_accelerate, starting_batch_size=start)()
        elif method == "drop-in":
            from batchpilot.integrations.accelerate import find_executable_batch_size

            def run_drop_in(batch_size: int) -> int:
                return epoch(batch_size)

            wrapped = find_executable_batch_size(run_drop_in, starting_batch_size=start, target=0.99)
            wrapped()
            out["found"] = wrapped.batch_size
            out["finder_trials"] = _trials(wrapped.plan)
        elif method == "finder":
            from batchpilot import find_batch_size

            plan = find_batch_size(one_step, target=0.99, restore=(model, optimizer), max_batch_size=start)
            out["finder_trials"] = _trials(plan)
            epoch(plan.batch_size)
            out["found"] = plan.batch_size
        else:
            raise ValueError(f"unknown method {method!r}")
        out["outcome"] = "ok"
    except BaseException as exc:  # the row's outcome, reported
        out["outcome"] = "oom" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:200]}"
    out["seconds"] = time.perf_counter() - t0
    out["calls"] = calls
    out["ooms"] = sum(1 for c in calls if c[1] == "oom")
    return out


def _trials(plan: Any) -> list[list[Any]]:
    """Each trial's size, outcome, and its peak, start and end address space in MiB."""
    def mib(x: int | None) -> float | None:
        return None if x is None else round(x / MiB, 1)

    return [[t.batch_size, t.outcome, mib(t.peak_bytes), mib(t.start_bytes), mib(t.end_bytes)] for t in plan.trials]


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------------------
# the parent


def run_child(method: str, malloc: str, cap_mib: int, batch: int = 0, start: int = SAMPLES,
              timeout: float = 1800) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", method, "--cap-mib", str(cap_mib), "--batch", str(batch),
           "--start", str(start)]
    proc = subprocess.run(cmd, env=_env(malloc), capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"method": method, "outcome": f"crashed (rc {proc.returncode}): {proc.stderr[-300:]}"}
    return json.loads(lines[-1])


def true_max(malloc: str, cap_mib: int, *, guess: int = 1024, fresh: bool = False) -> int:
    """The largest batch whose epoch completes in a fresh process under the cap (bisection, cached)."""
    import torch

    key = f"{malloc}|{cap_mib}|{SAMPLES}|torch {torch.__version__}"
    cache = json.loads(CACHE.read_text()) if CACHE.exists() and not fresh else {}
    if key in cache:
        return int(cache[key])

    def fits(b: int) -> bool:
        ok = run_child("probe", malloc, cap_mib, batch=b).get("outcome") == "ok"
        print(f"  truth probe {malloc} b={b}: {'fits' if ok else 'fails'}", file=sys.stderr, flush=True)
        return ok

    if fits(SAMPLES):
        raise SystemExit(f"the whole dataset fits in {cap_mib} MiB: lower --cap-mib")
    lo = largest_fitting(fits, guess, shrink=8 / 7)
    cache[key] = lo
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True))
    return lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap-mib", type=int, default=768)
    p.add_argument("--malloc", default="fixed,dynamic")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--runs", type=int, default=3, help="fresh processes per (setting, method)")
    p.add_argument("--start", type=int, default=SAMPLES, help="starting_batch_size of both decorators")
    p.add_argument("--guess", type=int, default=1024, help="where the truth's bisection starts (a size near it)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.cap_mib, args.batch, args.start)), flush=True)
        return
    rows = []
    for malloc in args.malloc.split(","):
        truth = true_max(malloc, args.cap_mib, guess=args.guess, fresh=args.no_cache)
        print(f"true max ({malloc}, +{args.cap_mib} MiB): {truth}", flush=True)
        for method in args.methods.split(","):
            for i in range(args.runs):
                r = run_child(method, malloc, args.cap_mib, start=args.start)
                r.update(malloc=malloc, truth=truth, run=i)
                if r.get("found") is not None and r.get("outcome") == "ok":
                    r["fraction"] = round(r["found"] / truth, 3)
                rows.append(r)
                print(json.dumps({k: r.get(k) for k in ("malloc", "method", "run", "found", "fraction", "ooms",
                                                          "seconds", "outcome")}), flush=True)
                print("   calls:", r.get("calls"), " finder:", r.get("finder_trials"), flush=True)
    print(f"\n{datetime.date.today()}, +{args.cap_mib} MiB, {SAMPLES} samples, start {args.start}\n")
    print("| malloc | method | found / true (runs) | calls | OOMs | seconds ÷ accelerate |")
    print("|---|---|---|---|---|---|")
    for malloc in args.malloc.split(","):
        base = [r["seconds"] for r in rows if r["malloc"] == malloc and r["method"] == "accelerate" and "seconds" in r]
        ref = sum(base) / len(base) if base else None
        for method in args.methods.split(","):
            rs = [r for r in rows if r["malloc"] == malloc and r["method"] == method]
            fr = ", ".join(str(r.get("fraction", r.get("outcome"))) for r in rs)
            calls = ", ".join(str(len(r.get("calls", []))) for r in rs)
            ooms = ", ".join(str(r.get("ooms")) for r in rs)
            secs = [r["seconds"] for r in rs if "seconds" in r]
            ratio = f"{sum(secs) / len(secs) / ref:.2f}" if ref and secs else "-"
            print(f"| {malloc} | {method} | {fr} | {calls} | {ooms} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
