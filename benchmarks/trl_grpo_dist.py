"""ResilientGRPOTrainer under torchrun with an OOM injected on one rank at a random phase: hangs, outcome, update.

Each launch is ``torchrun --nproc-per-node=2 tests/helpers/trl_dist_worker.py OUT PHASE-RANK``
(2 gloo ranks, DDP, use_cpu): one real ``torch.OutOfMemoryError`` raised once on RANK in PHASE
(generation, scoring, forward, backward), drawn at random per launch (seeded). The update is
compared with one clean launch's (no OOM): the fixed-rollout phases train in float64 with TRL's
LM head in float64, so "identical" means a relative gradient difference under 1e-10; generation
samples, and its completions after an OOM differ from a clean run's draws, so for it only the two
ranks' updates are compared. A hang is a launch still running after ``--timeout`` seconds or a rank
that timed out in a collective (the process-group timeout is ``--pg-timeout``).

    python benchmarks/trl_grpo_dist.py [--launches 20] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import machine  # noqa: E402
from dist_launch import teardown_abort_only  # noqa: E402

WORKER = ROOT / "tests" / "helpers" / "trl_dist_worker.py"
PHASES = ("generation", "scoring", "forward", "backward")


def launch(out: Path, scenario: str, timeout: float, pg_timeout: float) -> dict:
    """One torchrun launch; what it did: exit, hang, seconds."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PG_TIMEOUT_S=str(pg_timeout))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           str(out), scenario]
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = True
    finished = f'"scenario": "{scenario}"' in stdout
    collective_timeout = "Timed out waiting" in stderr or "timed out" in stderr.lower() and "gloo" in stderr
    ok = proc.returncode == 0 or (finished and teardown_abort_only(stderr))
    return {"seconds": round(time.perf_counter() - began, 1), "exit": proc.returncode, "finished": finished,
            "hang": timed_out or collective_timeout, "completed": ok and not timed_out,
            "stderr_tail": "" if ok else stderr[-1500:]}


def read(out: Path, scenario: str) -> list[dict] | None:
    import torch

    files = [out / f"{scenario}_rank{r}.pt" for r in (0, 1)]
    if not all(f.exists() for f in files):
        return None
    return [torch.load(f, weights_only=False) for f in files]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="seconds before a launch counts as hung")
    p.add_argument("--pg-timeout", type=float, default=120, help="the workers' process-group timeout")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "integrations"))
    from test_trl import _relative_error

    base = Path(tempfile.mkdtemp(prefix="bp_trl_dist_"))
    ref = launch(base / "clean", "clean", args.timeout, args.pg_timeout)
    clean = read(base / "clean", "clean")
    if clean is None:
        print(json.dumps(ref), flush=True)
        raise SystemExit("the clean reference launch failed")
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.launches):
        phase, rank = rng.choice(PHASES), rng.randrange(2)
        scenario = f"{phase}-{rank}"
        row = {"launch": i + 1, "phase": phase, "rank": rank, **launch(base / str(i), scenario, args.timeout,
                                                                          args.pg_timeout)}
        got = read(base / str(i), scenario)
        if got is not None:
            row["fired"] = [r["fired"] for r in got]
            row["micro"] = [r["micro"] for r in got]
            row["train_ooms"] = [r["train_ooms"] for r in got]
            row["scoring_ooms"] = [r["scoring_ooms"] for r in got]
            row["generate_calls"] = [sum(g[1] for g in r["generation"]) for r in got]
            row["ranks_differ"] = _relative_error(got[0]["grads"], got[1]["grads"])
            row["vs_clean"] = None if phase == "generation" else _relative_error(got[0]["grads"], clean[0]["grads"])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "stderr_tail" or v}), flush=True)
    print(f"\n{datetime.date.today()} {machine()}\n")
    print("| launch | OOM on | completed | hang | s | micro-batches rank 0 / 1 | OOMs train (scoring) | "
          "ranks' updates differ by | vs clean run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "-" if r.get("ranks_differ") is None else f"{r['ranks_differ']:.1e}"
        vs = "n/a (sampled)" if r["phase"] == "generation" else (
            "-" if r.get("vs_clean") is None else f"{r['vs_clean']:.1e}")
        ooms = "-" if "train_ooms" not in r else f"{r['train_ooms'][0]}/{r['train_ooms'][1]} " \
                                                 f"({r['scoring_ooms'][0]}/{r['scoring_ooms'][1]})"
        micro = "-" if "micro" not in r else f"{r['micro'][0]} / {r['micro'][1]}"
        print(f"| {r['launch']} | {r['phase']}, rank {r['rank']} | {'yes' if r['completed'] else 'no'} | "
              f"{'yes' if r['hang'] else 'no'} | {r['seconds']} | {micro} | {ooms} | {same} | {vs} |")
    hangs = sum(r["hang"] for r in rows)
    done = sum(r["completed"] for r in rows)
    exact = sum(1 for r in rows if r.get("vs_clean") is not None and r["vs_clean"] < 1e-10)
    fixed = sum(1 for r in rows if r["phase"] != "generation")
    print(f"\n{len(rows)} launches: {hangs} hangs, {done} completed, ranks identical in "
          f"{sum(1 for r in rows if r.get('ranks_differ') == 0.0)}, the clean update (< 1e-10) in {exact} of {fixed} "
          "fixed-rollout launches")
    if args.json:
        args.json.write_text(json.dumps({"clean": {k: v for k, v in ref.items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
