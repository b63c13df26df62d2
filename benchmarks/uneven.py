"""Uneven ranks: equal shares at the smaller rank's micro-batch vs ``shares="auto"`` (2 gloo ranks), and a fault table.

    python benchmarks/uneven.py                       # speed: skewed and alike ranks, 3 rounds each
    python benchmarks/uneven.py --parts faults --launches 20
    python benchmarks/uneven.py --quick

Every arm is one torchrun launch of ``examples/uneven_train.py`` (a small CNN on 32 x 32 images,
global batch 128) with rank r pinned to core r. *Skewed*: rank 1 has a third of rank 0's memory
(emulated capacities ``18MiB,6MiB``) and shares its core with a co-tenant
(``taskset -c 1 cotenant.py --procs 1 --threads 1 --off 0,0``: a real slowdown, no sleep), so it
runs at about half speed. *Alike*: no capacity, no co-tenant. ``equal`` is ``shares=None``, every
rank ``G / 2`` at the micro-batch the ranks agree on (the smaller rank's); ``auto`` is
``shares="auto"``. The arms take turns within each round; the table gives each arm's samples/s
over the timed steps (median over rounds) and the ratio of the medians.

*Faults*: each launch runs ``shares="auto"`` on the skewed setting with one rank's emulated
capacity lowered before a random step to what is in use plus 60% of what the last step's
activations took (its next micro-batch runs out of memory in the
emulated allocator); a launch that does not finish in ``--launch-timeout`` seconds is a hang. Every
complete epoch must hold every sample exactly once (across both ranks), the incomplete one none twice.
Run it under ``flock /work/bench.lock`` so that no other benchmark times beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "uneven_train.py"
COTENANT = Path("/work/shared/tools/cotenant.py")
SKEW_CAPACITY = "18MiB,6MiB"


def launch(args: list[str], timeout: float) -> tuple[dict | None, str, float]:
    """One torchrun launch of the example; (rank 0's result line or None, the output's tail, seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, "HANG\n" + out[-2000:], time.perf_counter() - began
    result = None
    for line in out.splitlines():
        if line.startswith("{") and '"samples_per_s"' in line:
            result = json.loads(line)
    return result, out[-2000:], time.perf_counter() - began


class Cotenant:
    """The co-tenant on core 1, for the skewed arms."""

    def __init__(self, seconds: float) -> None:
        self.proc = subprocess.Popen(
            ["taskset", "-c", "1", sys.executable, str(COTENANT), "--procs", "1", "--threads", "1",
             "--off", "0,0", "--seconds", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait()


def speed(rounds: int, steps: int, timed_from: int, timeout: float) -> list[dict]:
    rows = []
    for setting in ("skewed", "alike"):
        extra = ["--capacity", SKEW_CAPACITY] if setting == "skewed" else []
        rates: dict[str, list[float]] = {"equal": [], "auto": []}
        finals: dict[str, list] = {"equal": [], "auto": []}
        for r in range(rounds):
            arms = ["equal", "auto"] if r % 2 == 0 else ["auto", "equal"]
            for arm in arms:
                cotenant = Cotenant(timeout) if setting == "skewed" else None
                try:
                    result, tail, _ = launch(["--shares", arm, "--pin", "0,1", "--steps", str(steps),
                                              "--timed-from", str(timed_from), *extra], timeout)
                finally:
                    if cotenant is not None:
                        cotenant.stop()
                if result is None:
                    print(f"{setting} {arm}: no result\n{tail}", file=sys.stderr)
                    continue
                rates[arm].append(result["samples_per_s"])
                finals[arm].append((result["final_shares"], result["micro_batches"]))
                print(json.dumps({"setting": setting, "round": r, "arm": arm, **result}), flush=True)
        eq, au = statistics.median(rates["equal"]), statistics.median(rates["auto"])
        rows.append({"setting": setting, "equal": eq, "auto": au, "ratio": au / eq,
                     "equal_runs": rates["equal"], "auto_runs": rates["auto"],
                     "auto_final": finals["auto"][-1], "equal_final": finals["equal"][-1]})
    return rows


def faults(launches: int, seed: int, steps: int, timeout: float) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(launches):
        rank, step = rng.randrange(2), rng.randrange(3, steps - 2)
        with tempfile.TemporaryDirectory() as record:
            result, tail, seconds = launch(["--shares", "auto", "--capacity", SKEW_CAPACITY, "--steps", str(steps),
                                            "--timed-from", "1", "--shrink-at", f"{rank}:{step}:0.6",
                                            "--record", record], timeout)
            verdict = check_once(Path(record), dataset=2048) if result is not None else "no result"
        row = {"launch": i, "rank": rank, "step": step, "hang": tail.startswith("HANG"),
               "finished": result is not None, "ooms": None if result is None else result["ooms"],
               "final_shares": None if result is None else result["final_shares"], "data": verdict,
               "seconds": round(seconds, 1)}
        if result is None:
            row["tail"] = tail[-600:]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def check_once(record: Path, dataset: int) -> str:
    """``"exactly once"`` when every complete epoch holds every sample once and the last none twice."""
    ranks = [json.loads((record / f"rank{r}.json").read_text())["seen"] for r in (0, 1)]
    epochs = sorted({int(e) for rank in ranks for e in rank})
    for e in epochs:
        samples = [i for rank in ranks for i in rank.get(str(e), [])]
        if len(samples) != len(set(samples)):
            return f"epoch {e}: {len(samples) - len(set(samples))} repeated"
        if len(samples) >= dataset and sorted(samples) != list(range(dataset)):
            return f"epoch {e}: not every sample"
        if e != epochs[-1] and len(samples) != dataset:
            return f"epoch {e}: {len(samples)} of {dataset}"
    return "exactly once"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="speed", help="speed,faults")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--timed-from", type=int, default=20)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch-timeout", type=float, default=240)
    parser.add_argument("--quick", action="store_true", help="1 round of 24 steps, 2 fault launches")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.timed_from, args.launches = 1, 24, 12, 2
    out: dict = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv)}
    parts = args.parts.split(",")
    if "speed" in parts:
        out["speed"] = speed(args.rounds, args.steps, args.timed_from, args.launch_timeout)
        print("| ranks | equal shares (samples/s) | shares=\"auto\" (samples/s) | auto / equal | auto's final shares, micro-batches |")
        print("|---|---|---|---|---|")
        for row in out["speed"]:
            print(f"| {row['setting']} | {row['equal']:.1f} | {row['auto']:.1f} | {row['ratio']:.2f}x | "
                  f"{row['auto_final'][0]}, {row['auto_final'][1]} |")
    if "faults" in parts:
        rows = out["faults"] = faults(args.launches, args.seed, max(args.steps, 24), args.launch_timeout)
        hangs = sum(r["hang"] for r in rows)
        done = sum(r["finished"] for r in rows)
        once = sum(r["data"] == "exactly once" for r in rows)
        print(f"faults: {len(rows)} launches, {done} finished, {hangs} hangs, data exactly once in {once}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
