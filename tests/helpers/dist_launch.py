"""Launch a script under torchrun for a test (a hang or a dead rank is a test failure), and read what it wrote.

torchrun's agent stops the other ranks when one exits non-zero and returns non-zero itself;
the workers' process-group timeout turns a rank waiting on a missing peer into an error; and
the subprocess timeout here is the last resort, killing the whole process group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 120,
             env: dict[str, str] | None = None,
             finished: Callable[[str], bool] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node=N script args``.

    ``finished(stdout)``: whether the script printed that its work is done. Such a launch counts
    as a success even when a rank then aborted in the interpreter's teardown (see
    :func:`teardown_abort_only`): it is judged by its result, not by that exit code.

    Raises:
        AssertionError: the launch exited non-zero (other than that abort) or ran past ``timeout``
            (its output attached).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    # a session of its own, so a timeout can kill torchrun's workers along with it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{Path(script).name} {' '.join(args)} hung: no exit after {timeout:.0f}s\n"
            f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{_tail(stderr)}"
        ) from None
    if proc.returncode != 0 and not (finished is not None and finished(stdout) and teardown_abort_only(stderr)):
        raise AssertionError(
            f"{Path(script).name} {' '.join(args)} failed (exit {proc.returncode})\n"
            f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{_tail(stderr)}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def torchrun_nodes(script: str | Path, *args: str, nnodes: int = 2, nproc: int = 1, timeout: float = 150,
                   env: dict[str, str] | None = None,
                   finished: Callable[[str], bool] | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``nnodes`` torchrun agents on this machine that meet by c10d rendezvous on localhost.

    What a multi-node job does (one agent per machine, the same command on each), with every
    "machine" here. Returns each agent's completed process, in start order.

    Raises:
        AssertionError: an agent exited non-zero or the launch ran past ``timeout`` (outputs attached).
    """
    with socket.socket() as s:  # a free port for the rendezvous store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id={uuid.uuid4().hex[:8]}",
           str(script), *args]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(nnodes)]
    deadline = time.monotonic() + timeout
    outputs = []
    hung = False
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            hung = True
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            outputs.append(proc.communicate())
    while len(outputs) < len(procs):
        outputs.append(procs[len(outputs)].communicate())
    report = "\n".join(f"--- agent {i} (exit {p.returncode}) stdout\n{o[0][-3000:]}\n--- stderr\n{_tail(o[1])}"
                        for i, (p, o) in enumerate(zip(procs, outputs)))
    if hung:
        raise AssertionError(f"{Path(script).name} {' '.join(args)} on {nnodes} nodes hung past {timeout:.0f}s\n{report}")
    done = finished is not None and finished("".join(o[0] for o in outputs))
    aborted = done and any(p.returncode != 0 and teardown_abort_only(o[1]) for p, o in zip(procs, outputs))
    if any(p.returncode != 0 and not (done and teardown_abort_only(o[1])) and not (aborted and rendezvous_lost_only(o[1]))
           for p, o in zip(procs, outputs)):
        raise AssertionError(f"{Path(script).name} {' '.join(args)} on {nnodes} nodes failed\n{report}")
    return [subprocess.CompletedProcess(cmd, p.returncode, o[0], o[1]) for p, o in zip(procs, outputs)]


def teardown_abort_only(stderr: str) -> bool:
    """Whether every rank that failed was aborted by torch 2.13's gloo teardown, after its work.

    A finished rank's interpreter teardown now and then dies with "terminate called without an
    active exception" (SIGABRT, exit -6) with every DDP object gone; nothing else exits -6 here.
    When that rank dies first, torchrun's agent sends the ranks still tearing down SIGTERM
    ("closing signal SIGTERM", exit -15): those were stopped by the agent, not failed by
    themselves. At least one rank must show the abort; any other exit code is a real failure.
    """
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)}
    stopped = {-15} if "closing signal SIGTERM" in stderr else set()
    return ("terminate called without an active exception" in stderr and -6 in codes
            and codes <= {-6} | stopped)


def rendezvous_lost_only(stderr: str) -> bool:
    """Whether an agent failed only because the rendezvous store closed under it as it shut down.

    On several nodes the store lives in the first agent; when that agent's worker dies in gloo's
    teardown abort (:func:`teardown_abort_only`) the agent exits, and another agent whose workers
    all finished then fails to shut its rendezvous down ("Connection was likely closed").
    Forgiven only next to such an abort, after the work, and only where none of this agent's
    workers failed (no failure summary of its own).
    """
    lost = "failed to shutdown the rendezvous" in stderr and "DistNetworkError" in stderr
    return lost and "ChildFailedError" not in stderr and not re.findall(r"exitcode\s*:\s*-?\d+", stderr)


def _tail(stderr: str) -> str:
    """The ranks' own error lines first (torchrun's summary can push them out), then the end."""
    errors = [line for line in stderr.splitlines() if line.startswith("[rank") and "Error" in line]
    return "\n".join(errors[-20:]) + "\n...\n" + stderr[-6000:]


def read_result(out: Path, name: str) -> dict:
    """The JSON document a launched worker wrote as ``out / name``."""
    return json.loads((out / name).read_text())


def assert_params_close(a: list, b: list) -> None:
    """Two lists of parameter tensors equal to fp32 rounding (rtol 1e-5, atol 1e-6)."""
    import torch

    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
