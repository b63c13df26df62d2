"""The DDP, FSDP2 and RL (FSDP2 by length) examples as two-node jobs: two torchrun agents meeting by c10d rendezvous.

The examples' own tests: a two-node launch runs the same script, world size and collectives as
``--standalone --nproc-per-node=2`` (which the other torchrun tests use), plus the rendezvous.

Each agent stands for one machine (``--nnodes=2 --nproc-per-node=1``, the same command on
both); here both run on this machine and meet at a rendezvous store on localhost, as they would
at ``--rdzv-endpoint=HOST:PORT`` across machines. The two launches run side by side.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HELPERS))
from dist_launch import ROOT, torchrun_nodes  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def _steps(results) -> list[str]:
    """Rank 0's step lines, whichever agent it ran under."""
    lines = [line for r in results for line in r.stdout.splitlines() if line.startswith("epoch 0 step")]
    assert len(lines) == STEPS, "\n".join(r.stdout + r.stderr[-2000:] for r in results)
    return lines


def test_ddp_and_fsdp_examples_run_on_two_nodes(tmp_path):
    examples = ROOT / "examples"
    # rank 1's emulated device is the smaller one in both: its finder sets every rank's micro-batch
    jobs = {
        "ddp": (examples / "ddp_train.py", "--steps", str(STEPS), "--capacity", "1MiB,740KiB",
                "--checkpoint", str(tmp_path / "ckpt.pt")),
        "fsdp": (examples / "fsdp_train.py", "--steps", str(STEPS), "--capacity", "6MiB,3MiB"),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        # judged by the steps rank 0 printed (a rank aborted by gloo's teardown after them still passes)
        futures = {name: pool.submit(torchrun_nodes, *job, nnodes=2, nproc=1, timeout=240,
                                     finished=lambda out: out.count("epoch 0 step") == STEPS)
                   for name, job in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    for name, res in results.items():
        assert len(res) == 2
        header = [line for r in res for line in r.stdout.splitlines() if "rank(s) on" in line]
        assert header and header[0].startswith("2 rank(s) on cpu"), name  # one world over both agents
        lines = _steps(res)
        assert all("x 2 rank(s)" in line and "limited by rank 1" in line for line in lines), lines
    assert "FSDP2" in "".join(r.stdout for r in results["fsdp"])
    assert "checkpoint written to" in "".join(r.stdout for r in results["ddp"])
    assert (tmp_path / "ckpt.pt").exists()


def test_rl_example_sized_by_length_runs_on_two_nodes_equal_to_one_process():
    # FSDP2 with lengths known only after each rollout (the sharded policy generates them), one rank
    # per "machine"; --check replays the same rollouts in one process and compares the parameters
    res = torchrun_nodes(ROOT / "examples" / "rl_fsdp.py", "--steps", "4", "--capacity", "3MiB", "--check",
                         nnodes=2, nproc=1, timeout=240, finished=lambda out: "one process on the same rollouts" in out)
    out = "".join(r.stdout for r in res)
    assert "one process on the same rollouts: equal" in out, out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all("OOMs 0" in line for line in steps[1:]), steps
