"""tests/helpers/cgroup.py: a container's memory limit, where the kernel kills instead of raising."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from cgroup import cgroup_unavailable_reason, memory_cgroup
from conftest import HELPERS

REASON = cgroup_unavailable_reason()
needs_cgroup = pytest.mark.skipif(REASON is not None, reason=f"no memory cgroup here: {REASON}")

MiB = 2**20
LIMIT = 64 * MiB


def touch(mib: int, then: str = "") -> str:
    """A python child that writes every page of ``mib`` MiB (a page charges the group only once written)."""
    return (f"b = bytearray({mib} * 2**20)\n"
            "for i in range(0, len(b), 4096):\n    b[i] = 1\n"
            f"{then}print('survived', flush=True)\n")


@needs_cgroup
def test_a_child_past_the_limit_is_killed_and_reported():
    with memory_cgroup(LIMIT) as cg:
        assert cg.limit_bytes == LIMIT
        proc = cg.run([sys.executable, "-c", touch(4 * LIMIT // MiB)], timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc
        assert "survived" not in proc.stdout
        assert cg.oom_kills == 1
    assert not cg.path.exists()


@needs_cgroup
def test_a_child_under_the_limit_exits_normally():
    with memory_cgroup(LIMIT) as cg:
        proc = cg.run([sys.executable, "-c", touch(LIMIT // MiB // 4)], timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "survived"
        assert cg.oom_kills == 0
        assert cg.peak_bytes is None or cg.peak_bytes >= LIMIT // 4
    assert not cg.path.exists()


@needs_cgroup
def test_a_process_that_joins_by_itself_is_limited_too():
    # how a benchmark's forked child enters: it writes its own pid, then allocates
    join = f"import sys; sys.path.insert(0, {str(HELPERS)!r}); from cgroup import join_cgroup; join_cgroup(sys.argv[1])\n"
    with memory_cgroup(LIMIT) as cg:
        proc = subprocess.run([sys.executable, "-c", join + touch(4 * LIMIT // MiB), str(cg.path)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc
        assert cg.oom_kills == 1


@needs_cgroup
def test_leftover_processes_are_killed_and_the_group_removed_on_error():
    with pytest.raises(KeyError):
        with memory_cgroup(LIMIT) as cg:
            sleeper = cg.popen([sys.executable, "-c", "import time; time.sleep(120)"])
            assert cg.pids() == [sleeper.pid]
            raise KeyError("the caller failed")
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert not cg.path.exists()


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "64MiB"])
def test_memory_cgroup_rejects_a_limit_that_is_not_bytes(limit):
    with pytest.raises(ValueError, match="limit_bytes must be a positive int"):
        with memory_cgroup(limit):
            pass
