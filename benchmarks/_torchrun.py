"""What the multi-rank benchmarks share: launching themselves under torchrun, timing variants in turn, ending.

Used by ``ddp_overhead.py``, ``fsdp_overhead.py``, ``lengths_ddp.py`` and ``rl_fsdp.py``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch


def launch_under_torchrun(script: str, nproc: int) -> None:
    """Outside torchrun, run ``script`` with this command line under it on ``nproc`` ranks, and exit with its status."""
    if "WORLD_SIZE" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))


def median_step_seconds(variants: dict[str, Callable[[Any], Any]], batch: Any, steps: int) -> dict[str, float]:
    """This rank's median seconds per step of each variant, after two warm-up steps each.

    The variants take turns one step at a time, the order rotated each round, so that drift and
    neighbours hit all alike; every step starts at a barrier (not timed), so ranks start together.
    """
    for step in variants.values():  # warm-up: allocator, lazy init, bucket rebuilds, optimizer state
        step(batch)
        step(batch)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(steps):
        for name in names[i % len(names):] + names[: i % len(names)]:
            torch.distributed.barrier()
            began = time.perf_counter()
            variants[name](batch)
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def finish(status: int = 0) -> None:
    """End a rank whose work is done: leave the process group, then exit without the interpreter's teardown.

    In that teardown torch 2.13's gloo threads now and then abort a finished rank ("terminate
    called without an active exception", exit -6), and torchrun then fails a run whose results
    are all printed.
    """
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def slowest_rank_ms(local: dict[str, float]) -> dict[str, float]:
    """Each figure's maximum over ranks, in milliseconds: a step is as fast as its slowest rank."""
    gathered: list[dict] = [None] * torch.distributed.get_world_size()  # type: ignore[list-item]
    torch.distributed.all_gather_object(gathered, local)
    return {name: 1000 * max(r[name] for r in gathered) for name in local}
