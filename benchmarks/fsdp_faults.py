"""One OOM on one FSDP2 rank, at a random point of a random step: does every launch train exactly or fail fast?

Each launch is a fresh ``torchrun`` of 2 gloo ranks training the held-out causal LM of
``tests/helpers/fsdp_lengths_common.py`` (dict batches, labels -100 at the pads, no mask, float64,
long-tailed lengths that differ between the ranks) with ``Engine(lengths=LengthConfig(...))`` on
an emulated 3 MiB device, ``split=True`` in every other launch. One rank raises one
``torch.OutOfMemoryError`` at a drawn point: after a forward of the step, inside a backward,
while FSDP allocates an all-gather or a reduce-scatter buffer, or after a forward of a search
trial (the first fit's or a verification's). The process group times out after 60 s, so a hang
shows as a launch that takes that long.

A launch passes when it trains exactly (both ranks' parameters equal one process taking a plain
step on both ranks' samples at once, rtol 1e-5) or exits non-zero within 60 s with an error that
names the rank; a fault that never fired is reported and drawn again.

    python benchmarks/fsdp_faults.py [--launches 20] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
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

from batchpilot.app.report import format_table, write_json  # noqa: E402

COLUMNS = ("launch", "split", "rank", "where", "step", "event", "OOMs (step)", "outcome", "seconds")
TIMEOUT_S = 60


def draw(rnd: random.Random, split: bool) -> dict:
    kind = rnd.choice(flc.KINDS)
    # a search runs at the first step and at the verification; the other kinds in every step
    step = rnd.choice([0, flc.VERIFY_STEP]) if kind == "search" else rnd.randrange(0, flc.STEPS - 1)
    return {"rank_at": rnd.randrange(flc.WORLD), "kind": kind, "step": step, "nth": rnd.randint(1, 3), "split": split}


def launch(spec: dict, out: Path) -> dict:
    env = dict(os.environ, FL_FAULT=json.dumps(spec), OMP_NUM_THREADS="1", PG_TIMEOUT_S=str(TIMEOUT_S))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={flc.WORLD}",
           str(HELPERS / "fsdp_lengths_worker.py"), str(out), "fault"]
    began = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=4 * TIMEOUT_S)
    seconds = time.monotonic() - began
    ranks = [json.loads(p.read_text()) if (p := out / f"fault_rank{r}.json").exists() else None
             for r in range(flc.WORLD)]
    fired = next((r["fired"] for r in ranks if r and r["fired"]), None)
    errors = [r["error"] for r in ranks if r and r["error"]]
    exact = None
    if proc.returncode == 0 and (out / "fault_params.pt").exists():
        got = torch.load(out / "fault_params.pt")
        exact = all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(got, flc.reference()))
    named = bool(errors) and all(f"rank {spec['rank_at']}" in e for e in errors)
    if exact:
        outcome = "trained exactly"
    elif proc.returncode and seconds < TIMEOUT_S and named:
        outcome = f"exit {proc.returncode} in {seconds:.0f}s naming rank {spec['rank_at']}"
    else:
        outcome = "FAILED: " + (errors[0][:120] if errors else f"exit {proc.returncode}, {proc.stderr[-300:]}")
    ooms = [s["ooms"] for s in ranks[0]["steps"]] if ranks[0] else []
    return {"spec": spec, "fired": fired, "rc": proc.returncode, "seconds": seconds, "exact": exact,
            "errors": errors, "outcome": outcome, "ooms": ooms,
            "passed": outcome == "trained exactly" or outcome.startswith("exit ")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    rows, records, drawn = [], [], 0
    with tempfile.TemporaryDirectory(prefix="fsdp_faults_") as tmp:
        while len(records) < args.launches:
            spec = draw(rnd, split=len(records) % 2 == 1)
            drawn += 1
            out = Path(tmp) / f"launch{drawn}"
            out.mkdir()
            result = launch(spec, out)
            if result["fired"] is None and result["rc"] == 0:
                continue  # the drawn event never came (a step with fewer of them, the last step)
            records.append(result)
            fired = result["fired"] or {}
            step_ooms = result["ooms"][fired["step"]] if fired and fired.get("step", 99) < len(result["ooms"]) else "-"
            rows.append((len(records), "yes" if spec["split"] else "no", spec["rank_at"], spec["kind"],
                         fired.get("step", "-"), fired.get("event", "-"), step_ooms, result["outcome"],
                         f"{result['seconds']:.1f}"))
            print(format_table(COLUMNS, rows[-1:]).splitlines()[-1], flush=True)
    passed = sum(r["passed"] for r in records)
    # a launch that trained exactly did not hang, however long a loaded machine took for it
    hangs = sum(r["seconds"] >= TIMEOUT_S and not r["exact"] for r in records)
    print(f"\n{len(records)} launches ({drawn} drawn), one OOM each on one of {flc.WORLD} FSDP2 ranks: {passed} passed, "
          f"{hangs} reached the {TIMEOUT_S}s process-group timeout")
    print(format_table(COLUMNS, rows))
    if args.json:
        write_json({"benchmark": "fsdp_faults", "date": datetime.date.today().isoformat(), "machine": machine(),
                    "launches": records, "passed": passed, "hangs": hangs}, args.json)
    return 0 if passed == len(records) and not hangs else 1


if __name__ == "__main__":
    sys.exit(main())
