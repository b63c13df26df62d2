"""A good guest: after a search on the host's real memory the user's process is as they left it.

Each case is a fresh process (tests/helpers/guest_search.py): its resident high-water mark and
``ru_maxrss`` (which ``/usr/bin/time`` and job schedulers report), the torch / Python / numpy RNG
states, torch's thread count, every logger's configuration and the warning filters are compared
before and after two searches; the one deliberate change, glibc's mmap threshold, is logged once
(and not made where the environment already fixes the threshold).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "guest_search.py"

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")]


@pytest.mark.parametrize("malloc", ["default", "fixed"])
def test_a_host_search_leaves_the_process_as_the_user_left_it(malloc):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    if malloc == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    proc = subprocess.run([sys.executable, str(HELPER)], capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["memory"] == ["resident", "resident"], out  # measured on real memory, where the peak is read
    assert all(out["same"].values()), out  # high-water mark, ru_maxrss, RNGs, threads, logging, warning filters
    assert out["new_loggers_untouched"], out
    assert out["pinned"], out
    # the deliberate change is said once in the process, and not made over the user's own setting
    assert out["pin_logged"] == (1 if malloc == "default" else 0), out
