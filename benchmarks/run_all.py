"""Run every benchmark script in benchmarks/, one after another, and print their tables.

    python benchmarks/run_all.py                  # every script with its defaults
    python benchmarks/run_all.py --quick          # smoke sizes, where a script has them
    python benchmarks/run_all.py --only peers,gpu_validate --json-dir runs/bench

Each script runs in its own interpreter with its output streamed as it comes; a failing
script is reported and the others still run (the exit status says whether all passed).
Scripts not listed in ``KNOWN`` (any other ``benchmarks/*.py`` without a leading
underscore) run with no arguments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Script:
    """How to run one benchmark: its quick arguments and how it writes JSON."""

    name: str
    quick: tuple[str, ...] = ()
    json_flag: bool = True  # accepts ``--json PATH``


# In the order the issues list them; their flags as each script defines them.
KNOWN = (
    Script("finder", quick=("--capacity", "4MiB")),
    Script("planner", quick=("--quick",)),
    Script("overhead", quick=("--rounds", "10", "--warmup", "2")),
    Script("ddp_overhead", quick=("--quick",), json_flag=False),
    Script("fsdp_overhead", quick=("--quick",), json_flag=False),
    Script("peers", quick=("--quick",)),
    Script("speed", quick=("--quick",)),
    Script("integrations", quick=("--quick",)),
    Script("gpu_validate", quick=("--small",)),
    Script("compiled", quick=("--quick",)),
    Script("noise", quick=("--quick",)),
    Script("lengths", quick=("--quick",)),
    Script("lengths_ddp", quick=("--quick", "--capacity", "400KiB")),
    Script("lm_eval_side_by_side", quick=("--quick",)),
    Script("continuous_batching", quick=("--quick",)),
    Script("rl_fsdp", quick=("--quick",)),
    Script("fsdp_faults", quick=("--launches", "2")),
    Script("fsdp_length_model"),
    Script("left_behind", quick=("--models", "transformer", "--cap-mib", "256")),
    Script("first_guess", quick=("--runs", "1", "--guesses", "default,3300", "--malloc", "fixed")),
    Script("split_busy", quick=("--quick",)),
    Script("uneven", quick=("--quick",)),
)


def discover() -> list[Script]:
    """The known scripts that exist, then any other benchmark script found here."""
    present = {p.stem for p in HERE.glob("*.py") if not p.stem.startswith("_") and p.stem != "run_all"}
    scripts = [s for s in KNOWN if s.name in present]
    known = {s.name for s in KNOWN}
    scripts += [Script(name, json_flag=False) for name in sorted(present - known)]
    return scripts


def command(script: Script, *, quick: bool, json_dir: Path | None) -> list[str]:
    cmd = [sys.executable, str(HERE / f"{script.name}.py")]
    if quick:
        cmd += list(script.quick)
    if json_dir is not None and script.json_flag:
        cmd += ["--json", str(json_dir / f"{script.name}.json")]
    return cmd


def run_one(script: Script, cmd: list[str], timeout: float) -> tuple[int, float]:
    """Stream the script's output; return its exit status (124 on timeout) and seconds."""
    print(f"\n=== {script.name}: {' '.join(Path(c).name if i < 2 else c for i, c in enumerate(cmd))}", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        rc = subprocess.run(cmd, cwd=HERE.parent, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"--- {script.name} timed out after {timeout:.0f} s", flush=True)
        rc = 124
    return rc, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="each script's smoke size, where it has one")
    p.add_argument("--only", type=lambda s: s.split(","), default=None, help="comma-separated script names")
    p.add_argument("--skip", type=lambda s: s.split(","), default=[], help="comma-separated script names")
    p.add_argument("--json-dir", type=Path, default=None, help="each script that can writes NAME.json here")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per script (default 3600)")
    p.add_argument("--list", action="store_true", help="print the scripts that would run, and exit")
    args = p.parse_args(argv)

    scripts = discover()
    names = {s.name for s in scripts}
    for n in (args.only or []) + args.skip:
        if n not in names:
            p.error(f"no benchmark {n!r}; found {', '.join(sorted(names))}")
    scripts = [s for s in scripts if (args.only is None or s.name in args.only) and s.name not in args.skip]
    if args.json_dir is not None:
        args.json_dir.mkdir(parents=True, exist_ok=True)
    if args.list:
        for s in scripts:
            print(" ".join(command(s, quick=args.quick, json_dir=args.json_dir)))
        return 0

    results = []
    for s in scripts:
        rc, seconds = run_one(s, command(s, quick=args.quick, json_dir=args.json_dir), args.timeout)
        results.append((s.name, rc, seconds))
    print("\n=== summary")
    for name, rc, seconds in results:
        print(f"{name:14s} {'ok' if rc == 0 else f'FAILED (exit {rc})':18s} {seconds:7.0f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
