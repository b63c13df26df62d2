"""The host's real memory: what this process holds, its peak, and what limits it.

On a CPU the memory that runs out is the process's resident set, and what limits it is the
smallest of: the memory cgroup it lives in (a container's limit, ancestors included; past it the
kernel kills the process, it does not raise), its ``RLIMIT_AS`` (past it an allocation fails
and PyTorch raises), and the RAM the machine has available. Linux only; elsewhere the figures
fall back to ``getrusage`` and the physical memory, and no limit is found. This module reads the
figures; :mod:`batchpilot.memory.limits` says which limit binds and what follows from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

__all__ = [
    "rlimit_as_bytes", "cgroup_dirs", "cgroup_limit_and_use", "available_bytes", "resident_bytes", "address_space_bytes",
    "address_space_peak", "ResidentPeak", "physical_bytes", "trim_host_memory", "pin_malloc_threshold",
    "malloc_threshold_pinned", "env_malloc_threshold", "malloc_threshold_held",
]

logger = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# cgroup v1 reports "no limit" as a huge number near 2**63
_NO_LIMIT = 2**60


def _read(path: Path | str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``VmSize``) in bytes."""
    text = _read("/proc/self/status")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def resident_bytes() -> int:
    """This process's resident set size now."""
    text = _read("/proc/self/statm")
    if text is not None:
        return int(text.split()[1]) * _PAGE
    if resource is not None:  # not Linux: the peak is all getrusage knows
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return 0


def address_space_bytes() -> int | None:
    """This process's mapped address space now (``VmSize``: what ``RLIMIT_AS`` counts); ``None`` off Linux."""
    text = _read("/proc/self/statm")
    return None if text is None else int(text.split()[0]) * _PAGE


def address_space_peak() -> int | None:
    """The largest address space this process has had (``VmPeak``); ``None`` off Linux.

    The kernel keeps it from the process's start and offers no reset: a later peak shows only
    when it rises above every earlier one.
    """
    return _status_kib("VmPeak")


def physical_bytes() -> int | None:
    """The machine's RAM (``MemTotal``; the physical pages off Linux), or ``None`` where neither is known."""
    text = _read("/proc/meminfo")
    if text is not None:
        for line in text.splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


#: the sampler's program: it reads this process's ``statm`` every ``interval`` seconds while a window
#: is open and answers one line per command on stdin: ``r`` opens a window, ``p`` gives its peak (in
#: pages), ``s`` closes it. It ends at the end of its input (its parent is gone or done with it) and
#: after ``idle`` seconds without a window, so that none outlives the search that started it for long
_SAMPLER = r"""
import os, select, sys
fd = os.open("/proc/%s/statm" % sys.argv[1], os.O_RDONLY)
interval, idle = float(sys.argv[2]), float(sys.argv[3])
inp = sys.stdin.fileno()
top = None
while True:
    ready = select.select([inp], [], [], idle if top is None else interval)[0]
    if top is not None:
        top = max(top, int(os.pread(fd, 256, 0).split()[1]))
    if not ready:
        if top is None:
            break
        continue
    data = os.read(inp, 64)
    if not data:
        break
    for cmd in data.split():
        now = int(os.pread(fd, 256, 0).split()[1])
        top = now if cmd == b"r" else None if cmd == b"s" else max(top or 0, now)
        os.write(1, b"%d\n" % (top or 0))
"""
#: seconds a sampler waits for the next window before it ends (a new one starts when needed)
_SAMPLER_IDLE = 10.0


def _high_water() -> int | None:
    """The process's resident high-water mark (``VmHWM``; ``ru_maxrss`` off Linux), never reset by batchpilot."""
    hwm = _status_kib("VmHWM")
    if hwm is None and resource is not None:
        hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return hwm


class ResidentPeak:
    """The peak resident set size in a window (from :meth:`reset` to :meth:`peak`), read without resetting anything.

    The kernel's high-water mark (``VmHWM``) is what ``ru_maxrss``, ``/usr/bin/time`` and a job
    scheduler report for the process; resetting it (``/proc/self/clear_refs``) would change the
    user's own accounting, so it is only read: a window that rose above it has the new mark as
    its exact peak. Below the mark, a small process of its own samples this process's resident
    size every ``interval`` seconds during the window: a thread of this process would map a
    stack and a malloc arena (72 MiB of address space, which ``RLIMIT_AS`` counts), and would
    wait for the GIL. A spike shorter than ``interval`` between two samples can be missed;
    steps whose peak decides a batch size hold it for longer. The sampler starts at the first
    window and ends after ten seconds without one (the next window starts another). Where no sampler can start (no
    ``/proc``, no interpreter to run), the window's peak is the larger of the kernel's mark if
    it rose and the resident size when read.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self._proc: subprocess.Popen | None = None
        self._failed = False
        self._mark: int | None = None
        self._window = False

    def reset(self) -> None:
        """Open a window: its peak starts at the resident size now."""
        self._mark = _high_water()
        self._window = self._ask(b"r") is not None

    def peak(self) -> int:
        """The largest resident size seen since :meth:`reset` (the size now, when it was not reset)."""
        now = resident_bytes()
        sampled = self._ask(b"p") if self._window else None
        best = max(now, 0 if sampled is None else sampled * _PAGE)
        mark = _high_water()
        if mark is not None and self._mark is not None and mark > self._mark:
            best = max(best, mark)  # the window set a new high-water mark: that is its peak
        return best

    def close(self) -> None:
        """Close the window (the sampler stops sampling until the next :meth:`reset`)."""
        if self._window:
            self._ask(b"s")
            self._window = False

    def _ask(self, command: bytes) -> int | None:
        """Send one command to the sampler; its answer in pages, or ``None`` without one.

        A sampler that ended while idle is started again (a window's ``r``: nothing was lost);
        one that fails otherwise is given up for the life of this object.
        """
        for _ in range(2):
            proc = self._sampler()
            if proc is None:
                return None
            try:
                proc.stdin.write(command + b"\n")
                proc.stdin.flush()
                return int(proc.stdout.readline())
            except (OSError, ValueError):
                ended_idle = proc.poll() == 0
                self._stop()
                if not (ended_idle and command == b"r"):
                    break
        self._failed = True
        logger.info("the resident-size sampler stopped; window peaks are read when they end")
        return None

    def _sampler(self) -> subprocess.Popen | None:
        if self._proc is not None or self._failed:
            return self._proc
        if not os.path.exists(f"/proc/{os.getpid()}/statm") or not sys.executable:
            self._failed = True
            return None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _SAMPLER, str(os.getpid()), repr(self.interval),
                 repr(_SAMPLER_IDLE)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:
            self._failed = True
            logger.info("cannot start the resident-size sampler (%s); window peaks are read when they end", exc)
            return None
        # it ends by itself: idle, or at the end of its input (this object or the process gone)
        return self._proc

    def __del__(self) -> None:
        # its input closed, the sampler ends at once; waited for, so that no zombie or
        # "still running" ResourceWarning is left behind
        with contextlib.suppress(Exception):
            self._stop()

    def _stop(self) -> None:
        if self._proc is not None:
            _end_sampler(self._proc)
            self._proc = None
        self._window = False


def _end_sampler(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            stream.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cgroup_dirs(proc_cgroup: str, mountinfo: str) -> list[tuple[int, Path]]:
    """``(version, directory)`` of a process's memory cgroup and its ancestors, innermost first.

    Pure: ``proc_cgroup`` is the text of ``/proc/<pid>/cgroup`` and ``mountinfo`` that of
    ``/proc/<pid>/mountinfo``. v1 lines name the ``memory`` controller, the v2 line has an empty
    controller list; a mount whose root is not ``/`` (a container's namespaced view) shows the
    cgroup path relative to that root.
    """
    paths: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths.setdefault(2, path)
        elif "memory" in controllers.split(","):
            paths[1] = path
    found: list[tuple[int, Path]] = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        root, mount_point = fields[3], Path(fields[4])
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and "memory" in options.split(",") else 0
        if version == 0 or version not in paths:
            continue
        rel = paths[version]
        if root != "/" and rel.startswith(root):
            rel = rel[len(root):]
        d = mount_point / rel.lstrip("/")
        while True:
            found.append((version, d))
            if d == mount_point or d.parent == d:
                break
            d = d.parent
    return found


def _cgroup_dirs() -> list[tuple[int, Path]]:
    own, mounts = _read("/proc/self/cgroup"), _read("/proc/self/mountinfo")
    return [] if own is None or mounts is None else cgroup_dirs(own, mounts)


def cgroup_limit_and_use() -> tuple[int | None, int | None]:
    """The tightest limit among this process's memory cgroups, and the working set of that cgroup."""
    best: tuple[int, int | None] | None = None
    for version, d in _cgroup_dirs():
        if version == 2:
            raw, usage, stat_key = _read(d / "memory.max"), _read(d / "memory.current"), "inactive_file"
        else:
            raw, usage, stat_key = _read(d / "memory.limit_in_bytes"), _read(d / "memory.usage_in_bytes"), \
                "total_inactive_file"
        if raw is None or not raw.strip().isdigit():
            continue  # "max" (v2) or unreadable
        limit = int(raw)
        if limit >= _NO_LIMIT:
            continue
        used = None
        if usage is not None and usage.strip().isdigit():
            used = int(usage)
            stat = _read(d / "memory.stat") or ""
            for line in stat.splitlines():
                key, _, value = line.partition(" ")
                if key == stat_key and value.strip().isdigit():
                    used -= int(value)
        if best is None or limit < best[0]:
            best = (limit, used)
    return (None, None) if best is None else best


def available_bytes() -> int:
    """The machine's ``MemAvailable`` (the physical memory where ``/proc/meminfo`` is missing)."""
    text = _read("/proc/meminfo")
    if text is not None:
        for line in text.splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    if hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0


def rlimit_as_bytes() -> int | None:
    """This process's soft ``RLIMIT_AS``, or ``None`` when unlimited (or not on a POSIX system)."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


_libc = None
_trim_checked = False
_pinned: bool | None = None
# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's initial mmap threshold: blocks this large or larger get mappings of their own
MMAP_THRESHOLD = 128 * 1024


def trim_host_memory() -> float:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``); the seconds it took.

    glibc keeps freed blocks in its arenas, so a process's resident size stays at its high-water
    mark after a large step; trimming makes the resident size measure what is live again. A no-op
    where the C library has no ``malloc_trim``.
    """
    lib = _glibc()
    if lib is None:
        return 0.0
    began = time.perf_counter()
    lib.malloc_trim(0)
    return time.perf_counter() - began


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``malloc_trim`` and ``mallopt``), else ``None``."""
    global _libc, _trim_checked
    if not _trim_checked:
        _trim_checked = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None
        except OSError:
            _libc = None
    return _libc


def malloc_threshold_pinned() -> bool:
    """True when glibc's mmap threshold is fixed at 128 KiB or below in this process (by
    :func:`pin_malloc_threshold`, inside :func:`malloc_threshold_held`, or by the environment), so
    freed large blocks leave the address space. A threshold the environment fixes higher keeps
    the blocks below it in the heap."""
    if _pinned or _held_lowered:
        return True
    fixed = env_malloc_threshold()
    return fixed is not None and fixed <= MMAP_THRESHOLD


def _env_fixes_threshold(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment sets glibc's mmap threshold, which turns its dynamic rule off for good:
    ``MALLOC_MMAP_THRESHOLD_``, or ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``."""
    env = os.environ if environ is None else environ
    if "MALLOC_MMAP_THRESHOLD_" in env:
        return True
    return any(item.partition("=")[0].strip() == "glibc.malloc.mmap_threshold"
               for item in env.get("GLIBC_TUNABLES", "").split(":"))


def env_malloc_threshold(environ: Mapping[str, str] | None = None) -> int | None:
    """The mmap threshold in bytes the environment fixes (``glibc.malloc.mmap_threshold`` in
    ``GLIBC_TUNABLES``, else ``MALLOC_MMAP_THRESHOLD_``), or ``None`` where it fixes none or the
    value is no number glibc reads (decimal, or hex with ``0x``)."""
    env = os.environ if environ is None else environ
    raw = None
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        key, _, value = item.partition("=")
        if key.strip() == "glibc.malloc.mmap_threshold":
            raw = value
    if raw is None:
        raw = env.get("MALLOC_MMAP_THRESHOLD_")
    if raw is None:
        return None
    try:
        return int(raw.strip(), 0)
    except ValueError:
        return None


def pin_malloc_threshold() -> bool:
    """Fix glibc's mmap threshold at its initial 128 KiB for the rest of the process; True if this call did it.

    By default glibc raises the threshold to the size of each large block freed (up to 32 MiB),
    after which blocks of that size come from the heap, whose freed memory stays mapped: a
    process's address space, and under ``RLIMIT_AS`` what it can still allocate, then depends on
    the sizes it ran before. With the threshold fixed, every block of 128 KiB or more is a mapping
    of its own, returned to the OS when freed, and a step needs the same memory whatever ran
    before it -- a batch-size search does not change what the batch it answers needs. glibc
    offers no way back to the dynamic threshold (``mallopt`` turns it off for good), so the
    process keeps this setting. A no-op off glibc and where the environment already fixes the
    threshold (``MALLOC_MMAP_THRESHOLD_``, or ``glibc.malloc.mmap_threshold`` in
    ``GLIBC_TUNABLES``); freed heap is trimmed either way.
    """
    global _pinned
    lib = _glibc()
    if _pinned is not None or lib is None or _env_fixes_threshold():
        trim_host_memory()
        return False
    # the trim threshold too: the dynamic rule raised it with the mmap threshold
    _pinned = bool(lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        lib.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD))
    if _pinned:
        logger.info("glibc's mmap threshold fixed at %d KiB for this process: freed large blocks leave the "
                    "address space, so what a step needs does not depend on what ran before it",
                    MMAP_THRESHOLD // 1024)
    trim_host_memory()
    return _pinned


_held = 0  # depth of nested malloc_threshold_held blocks
_held_lowered = False  # the outermost one lowered a threshold the environment fixed
_lowered_logged = False


@contextlib.contextmanager
def malloc_threshold_held() -> Iterator[None]:
    """glibc's mmap threshold at 128 KiB while the block measures and sizes; a threshold the user fixed comes back.

    What a step needs under ``RLIMIT_AS`` is a figure of the address space, which only measures
    the step when its large blocks leave the address space once freed. Below the mmap threshold
    they come from the heap, which keeps what it frees mapped, and a later block reuses it: a
    trial then grows the address space by what no earlier trial left free, so figures depend on
    the sizes run before and stop growing with the batch (no model of memory is left). The block
    holds the threshold at 128 KiB:

    * glibc's dynamic threshold (the default) is fixed for good (:func:`pin_malloc_threshold`:
      glibc has no way back to it);
    * a threshold the user fixed above 128 KiB (``MALLOC_MMAP_THRESHOLD_=1048576``, or in
      ``GLIBC_TUNABLES``) is lowered for the block and set back to the user's value when the
      outermost block ends, so the process leaves as it came (logged once, at INFO);
    * a threshold fixed at 128 KiB or below already maps every large block: nothing changes.

    Freed heap is trimmed on entry either way. Blocks nest: only the outermost one restores.
    A no-op off glibc.
    """
    global _held, _held_lowered, _lowered_logged
    lib = _glibc()
    fixed = env_malloc_threshold()
    if lib is None or _held or fixed is None or fixed <= MMAP_THRESHOLD:
        if lib is not None and not _held:
            pin_malloc_threshold()  # dynamic: fixed for good; a small fixed one: only the trim
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    lowered = bool(lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if lowered and not _lowered_logged:
        _lowered_logged = True
        logger.info("glibc's mmap threshold (%d KiB, set by the environment) is held at %d KiB while batchpilot "
                    "measures and runs its batches, then set back: below the threshold freed blocks stay mapped, "
                    "and what a batch needs would depend on what ran before it", fixed // 1024, MMAP_THRESHOLD // 1024)
    trim_host_memory()
    _held, _held_lowered = _held + 1, lowered
    try:
        yield
    finally:
        _held -= 1
        if lowered:
            lib.mallopt(_M_MMAP_THRESHOLD, fixed)
            _held_lowered = False
