"""Launch a script under torchrun for a test; a hang or a dead rank is a test failure.

torchrun's agent stops the other ranks when one exits non-zero and returns non-zero itself;
the workers' process-group timeout turns a rank waiting on a missing peer into an error; and
the subprocess timeout here is the last resort, killing the whole process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 120,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node=N script args``.

    Raises:
        AssertionError: the launch exited non-zero or ran past ``timeout`` (its output attached).
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
    if proc.returncode != 0:
        raise AssertionError(
            f"{Path(script).name} {' '.join(args)} failed (exit {proc.returncode})\n"
            f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{_tail(stderr)}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _tail(stderr: str) -> str:
    """The ranks' own error lines first (torchrun's summary can push them out), then the end."""
    errors = [line for line in stderr.splitlines() if line.startswith("[rank") and "Error" in line]
    return "\n".join(errors[-20:]) + "\n...\n" + stderr[-6000:]
