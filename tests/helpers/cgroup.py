"""A memory cgroup to run processes under a container's limit, for tests and benchmarks.

Past a memory cgroup's limit the kernel's OOM killer SIGKILLs a process of the group:
nothing raises, the process is gone. That is what a container does to a job, and what
``RLIMIT_AS`` (a catchable allocator error) cannot show.

    reason = cgroup_unavailable_reason()
    if reason:
        pytest.skip(reason)
    with memory_cgroup(256 * 2**20) as cg:
        proc = cg.run([sys.executable, "-c", "..."])
    print(proc.returncode, cg.oom_kills)        # -9 and 1 when the kernel killed it

Where the v1 ``memory`` controller is mounted the group is a v1 one
(``memory.limit_in_bytes``); otherwise a cgroup2 group (``memory.max``) under a parent
whose ``cgroup.subtree_control`` enables ``memory``. The group is made inside the
calling process's own cgroup where that is allowed, so the limits above it still hold.
Swap is switched off for the group where the knob exists, so the limit kills instead of
swapping. Memory a process charged before it joined stays with its old group (a forked
child's inherited pages count only once it writes them).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = ["Cgroup", "cgroup_unavailable_reason", "join_cgroup", "memory_cgroup"]

_COUNTER = itertools.count()
_PROBE_LIMIT = 64 * 2**20


@dataclass(frozen=True)
class _Parent:
    path: Path
    version: int  # 1 or 2


def _mounts() -> list[tuple[Path, str, set[str]]]:
    """(mount point, filesystem type, mount and super options) of every cgroup mount."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mount = Path(fields[4].replace("\\040", " "))
        out.append((mount, tail[0], set(fields[5].split(",")) | set(tail[2].split(","))))
    return out


def _own_path(version: int) -> str | None:
    """This process's cgroup path in the v1 memory hierarchy (1) or the unified one (2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (version == 1 and "memory" in controllers.split(",")) or (version == 2 and controllers == ""):
            return path
    return None


def _parent() -> tuple[_Parent | None, str | None]:
    """Where a child group can go, or why none can (the reason)."""
    mounts = _mounts()
    v1 = [m for m, kind, opts in mounts if kind == "cgroup" and "memory" in opts]
    v2 = [(m, opts) for m, kind, opts in mounts if kind == "cgroup2"]
    if v1:
        mount, version, read_only = v1[0], 1, "ro" in next(o for m, k, o in mounts if m == v1[0])
    elif v2:
        (mount, opts), version = v2[0], 2
        read_only = "ro" in opts
    else:
        return None, "no cgroup filesystem with the memory controller is mounted (no v1 'memory' hierarchy, no cgroup2)"
    if read_only:
        return None, f"the memory cgroup hierarchy at {mount} is mounted read-only"
    own = _own_path(version)
    candidates = [mount / own.lstrip("/")] if own and own != "/" else []
    candidates.append(mount)
    for path in candidates:
        if not path.is_dir():
            continue
        if version == 2:
            try:
                enabled = (path / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            if "memory" not in enabled:
                continue
        return _Parent(path, version), None
    if version == 2:
        return None, (f"cgroup2 at {mount}: no parent group enables the memory controller for its children "
                      f"(cgroup.subtree_control of {', '.join(map(str, candidates))} lacks 'memory')")
    return None, f"cannot find this process's memory cgroup under {mount}"


def _write(path: Path, value: Any) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read_keyed(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def join_cgroup(path: str | os.PathLike[str]) -> None:
    """Move the calling process into the group at ``path`` (what a forked child calls first).

    Raises:
        OSError: the group is gone or this process may not write its ``cgroup.procs``.
    """
    _write(Path(path) / "cgroup.procs", os.getpid())


class Cgroup:
    """A memory cgroup made by :func:`memory_cgroup`: run processes in it, read what happened.

    Attributes:
        path: the group's directory.
        version: 1 (``memory.limit_in_bytes``) or 2 (``memory.max``).
        limit_bytes: the memory limit, as the kernel stored it (page-rounded).
    """

    def __init__(self, path: Path, version: int, limit_bytes: int) -> None:
        self.path, self.version, self.limit_bytes = path, version, limit_bytes

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen`` whose child joins the group before it execs ``args``.

        Raises:
            subprocess.SubprocessError: the child could not join the group.
        """
        procs = str(self.path / "cgroup.procs")

        def enter() -> None:  # runs in the child between fork and exec
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.Popen(args, preexec_fn=enter, **kwargs)

    def run(self, args: Sequence[str], *, timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``args`` in the group to completion; output captured as text unless ``kwargs`` say otherwise.

        A non-zero exit (-9 when the kernel killed it) is returned, not raised.

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout`` (the child is killed first).
        """
        kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
        with self.popen(args, **kwargs) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def pids(self) -> list[int]:
        """Processes in the group now."""
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    @property
    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this group (v1 ``oom_control``, v2 ``memory.events``)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return _read_keyed(self.path / name).get("oom_kill", 0)

    @property
    def limit_hits(self) -> int:
        """Times usage reached the limit (v1 ``memory.failcnt``, v2 ``memory.events`` ``max``), kills or not."""
        if self.version == 1:
            try:
                return int((self.path / "memory.failcnt").read_text())
            except (OSError, ValueError):
                return 0
        return _read_keyed(self.path / "memory.events").get("max", 0)

    @property
    def peak_bytes(self) -> int | None:
        """The group's highest memory usage (v1 ``max_usage_in_bytes``, v2 ``memory.peak`` where present)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def __repr__(self) -> str:
        return f"Cgroup({str(self.path)!r}, v{self.version}, limit {self.limit_bytes})"


def _create(parent: _Parent, limit_bytes: int) -> Cgroup:
    path = parent.path / f"batchpilot-{os.getpid()}-{next(_COUNTER)}"
    path.mkdir()
    try:
        if parent.version == 1:
            _write(path / "memory.limit_in_bytes", limit_bytes)
            # memory + swap may not be set below memory alone, so after it; both absent without swap accounting
            for knob, value in (("memory.memsw.limit_in_bytes", limit_bytes), ("memory.swappiness", 0)):
                if (path / knob).exists():
                    _write(path / knob, value)
            stored = int((path / "memory.limit_in_bytes").read_text())
        else:
            _write(path / "memory.max", limit_bytes)
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", 0)
            raw = (path / "memory.max").read_text().strip()
            stored = int(raw) if raw.isdigit() else limit_bytes
    except BaseException:
        _remove(path)
        raise
    return Cgroup(path, parent.version, stored)


def _remove(path: Path, timeout: float = 10.0) -> None:
    """Kill what is left in the group (its processes are ours), wait for them, remove it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return
        except OSError:
            pids = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:  # EBUSY while a killed process is still exiting
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
        elif time.monotonic() > deadline:
            raise TimeoutError(f"processes {pids} stayed in {path} after SIGKILL")
        time.sleep(0.02)


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Cgroup]:
    """A fresh memory cgroup limited to ``limit_bytes``, removed on exit (also on error).

    Leftover processes in the group are SIGKILLed before it is removed.

    Raises:
        ValueError: ``limit_bytes`` is not a positive int.
        RuntimeError: no cgroup can be made here; the message says why
            (:func:`cgroup_unavailable_reason`).
        OSError: the kernel refused a setting.
    """
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be a positive int of bytes, got {limit_bytes!r}")
    parent, reason = _parent()
    if parent is None:
        raise RuntimeError(f"cannot create a memory cgroup: {reason}")
    cg = _create(parent, limit_bytes)
    try:
        yield cg
    finally:
        _remove(cg.path)


def cgroup_unavailable_reason() -> str | None:
    """Why no memory cgroup can be made here, or ``None`` when one can.

    Tries for real: creates a group, sets a limit, runs a process in it, removes it. The
    reason names what failed (no controller, read-only hierarchy, not root and not
    delegated, a cgroup2 parent that may not take processes).
    """
    if not Path("/proc/self/mountinfo").exists():
        return "no /proc/self/mountinfo: not Linux, or /proc is not mounted"
    parent, reason = _parent()
    if parent is None:
        return reason
    try:
        with memory_cgroup(_PROBE_LIMIT) as cg:
            proc = cg.run([sys.executable, "-S", "-c", "pass"], timeout=60)
        if proc.returncode != 0:
            return f"a process in a memory cgroup under {parent.path} exited with {proc.returncode}: {proc.stderr[-200:]}"
    except subprocess.SubprocessError as exc:  # the child could not write its pid into cgroup.procs
        return f"cannot move a process into a memory cgroup under {parent.path}: {exc}"
    except PermissionError as exc:
        who = "not root" if os.geteuid() != 0 else "root"
        return f"{who} (uid {os.geteuid()}) and not allowed to create a memory cgroup under {parent.path}: {exc}"
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return f"the memory cgroup hierarchy at {parent.path} is read-only: {exc}"
        return f"creating a memory cgroup under {parent.path} failed: {exc}"
    return None
