"""Shared pieces of the benchmark scripts: workloads, real memory caps, fresh-process runs.

A *real* cap on CPU is ``RLIMIT_AS`` set in a fresh process after imports, model
construction and a warm-up step, so that it limits only what the measured method
allocates from then on; PyTorch then raises its real ``DefaultCPUAllocator`` error.
Children run in processes forked from a clean server (:class:`ForkRunner`) and send their
result back through a pipe.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from batchpilot.app.models import build_model, example_batch

__all__ = [
    "ROOT",
    "CACHE_DIR",
    "BENCH_MODELS",
    "QUICK_MODELS",
    "SampleDataset",
    "passthrough",
    "Workload",
    "ChildResult",
    "child_env",
    "ForkRunner",
    "vm_bytes",
    "cap_address_space",
    "is_allocator_oom",
    "allocator_peak",
    "CallLog",
    "merge_calls",
    "emit",
    "load_cache",
    "store_cache",
    "machine",
]

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = ROOT / "benchmarks" / ".cache"
MiB = 2**20

# CPU-sized versions of the three reference models, chosen so that activations (not
# weights) fill peers.py's 64 MiB cap and the largest batch lies between a hundred and a
# few thousand: below 4096, where Lightning's doubling would reach its max_val (8192), with
# steps short enough (< 0.5 s on one thread) to bisect the truth in fresh processes. The MLP is deep and narrow because
# memory per sample grows with depth x width but compute with depth x width^2.
BENCH_MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"model": "mlp", "kwargs": {"in_features": 1024, "width": 128, "depth": 32}},
    "cnn": {"model": "cnn", "kwargs": {"widths": (8, 16, 32)}},
    "transformer": {"model": "transformer", "kwargs": {"dim": 64, "heads": 4, "layers": 2, "seq_len": 64}},
}
# --quick: smaller models (faster steps, fewer samples to move) for the tests.
QUICK_MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"model": "mlp", "kwargs": {"in_features": 256, "width": 64, "depth": 16}},
    "cnn": {"model": "cnn", "kwargs": {"widths": (4, 8, 16)}},
    "transformer": {"model": "transformer", "kwargs": {"dim": 32, "heads": 2, "layers": 1, "seq_len": 32}},
}


class SampleDataset(Dataset):
    """``length`` samples cycling over a small pool built up front, fetched a batch at a time.

    ``DataLoader`` calls :meth:`__getitems__` with a batch's indices, which gathers the
    batch into one fresh tensor per field (as a pre-batched pipeline does): every method
    allocates its batch under the cap the same way, and no per-sample Python objects
    (about 1 KiB each) blur the memory figures. Use :func:`passthrough` as ``collate_fn``.
    """

    def __init__(self, xs: torch.Tensor, ys: torch.Tensor, length: int = 1 << 20) -> None:
        self.xs, self.ys, self.length = xs, ys, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = i % len(self.xs)
        return self.xs[j], self.ys[j]

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long).remainder_(len(self.xs))
        return self.xs.index_select(0, idx), self.ys.index_select(0, idx)


def passthrough(batch: Any) -> Any:
    """``collate_fn`` for :class:`SampleDataset`: the batch is already gathered."""
    return batch


@dataclass
class Workload:
    """A model, its Adam optimizer and its data: the job whose batch size is sought."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    dataset: SampleDataset

    @classmethod
    def build(cls, name: str, *, quick: bool = False, seed: int = 0) -> Workload:
        table = QUICK_MODELS if quick else BENCH_MODELS
        if name not in table:
            raise ValueError(f"unknown benchmark model {name!r}; choose from {', '.join(table)}")
        spec = table[name]
        torch.manual_seed(seed)
        model = build_model(spec["model"], **spec["kwargs"])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        xs, ys = example_batch(model, 64, generator=torch.Generator().manual_seed(seed))
        return cls(name, model, optimizer, SampleDataset(xs, ys))

    def batch(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh batch of ``b`` samples, gathered exactly as a ``DataLoader`` over the dataset does."""
        return self.dataset.__getitems__(range(b))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def train_step(self, b: int) -> float:
        """One forward / backward / Adam step on a fresh batch of ``b``."""
        batch = self.batch(b)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def warm_up(self) -> None:
        """One tiny step: loads kernels, creates Adam's state; gradients are freed after."""
        self.train_step(2)
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        """Bytes of parameters, buffers, optimizer state and the sample pool (live before the cap)."""
        seen: set[int] = set()
        total = 0
        tensors = [*self.model.parameters(), *self.model.buffers(), self.dataset.xs, self.dataset.ys]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            st = t.untyped_storage()
            if id(st) not in seen:
                seen.add(id(st))
                total += st.nbytes()
        return total


# ---------------------------------------------------------------------------
# fresh processes


def child_env(malloc: str = "fixed", extra: dict[str, str | None] | None = None) -> dict[str, str]:
    """Environment for measured children: one thread, one malloc arena, unbuffered output.

    One intra-op thread makes times comparable on a shared 2-core machine; one glibc
    arena keeps address space close to the heap actually used (each extra arena
    reserves 64 MiB of address space, which RLIMIT_AS would count).

    ``malloc="fixed"`` pins glibc's mmap threshold at 128 KiB. By default glibc raises
    the threshold to the size of every mapped block freed (up to 32 MiB), after which
    blocks of that size come from a heap that never shrinks: the address space of a
    process then depends on its history, and a batch that fits in a fresh process
    fails after a search (measured on the MLP of benchmarks/peers.py at 64 MiB: every method's
    in-process limit at 0.56-0.67 of the fresh-process one, against 0.85-1.02 with the threshold fixed;
    see benchmarks/README.md).
    Pinned, every tensor buffer of 128 KiB or more is mapped and unmapped on its own,
    so the cap bounds the live bytes, as a device's capacity does.
    ``malloc="dynamic"`` keeps glibc's default.

    ``extra`` is applied last, as a user would set up their own process (``{"MALLOC_MMAP_THRESHOLD_":
    "1048576"}``); a value of ``None`` removes the variable (``{"MALLOC_ARENA_MAX": None}``: glibc's
    arenas per core).
    """
    if malloc not in ("fixed", "dynamic"):
        raise ValueError(f"malloc must be 'fixed' or 'dynamic', got {malloc!r}")
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="1", PYTHONUNBUFFERED="1",
               PYTHONWARNINGS="ignore")
    if malloc == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass
class ChildResult:
    """One child's exit: its JSON document (or ``None``), return code, wall time and stderr tail."""

    data: dict[str, Any] | None
    returncode: int
    seconds: float
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.data is not None


class ForkRunner:
    """Run ``module.function(spec)`` in a fresh process forked from a clean, pre-imported server.

    A ``multiprocessing`` forkserver imports torch (and the peers) once; every call forks a
    child from it, so a child starts with those imports done and nothing else: it builds its
    model, warms up and caps itself exactly as a fresh interpreter would, in a fraction of
    a second instead of the seconds an import of torch and Lightning takes. The server is
    started with :func:`child_env`'s settings (``env``: its ``extra``). The child's stdout and stderr go to
    ``/dev/null``; its result, or its traceback, comes back through a pipe.

    ``multiprocessing`` keeps one fork server per parent process, so all runners of a process
    must share one environment (one ``malloc`` setting).

    Raises:
        RuntimeError: a second runner asks for another environment.
    """

    def __init__(self, preload: Sequence[str] = ("torch",), *, malloc: str = "fixed",
                 env: dict[str, str | None] | None = None) -> None:
        import multiprocessing as mp

        self._ctx = mp.get_context("forkserver")
        self._preload = list(preload)
        self._env = child_env(malloc, env)
        self._started = False

    def _start(self) -> None:
        global _SERVER_ENV
        if _SERVER_ENV is not None and _SERVER_ENV != self._env:
            raise RuntimeError("the fork server already runs with another environment; use one malloc setting "
                               "per process")
        # the server is spawned once, with the parent's environment at that moment
        os.environ.clear()
        os.environ.update(self._env)
        self._ctx.set_forkserver_preload(self._preload)
        _SERVER_ENV = self._env
        self._started = True

    def __call__(self, module: str, function: str, spec: dict[str, Any], *, timeout: float = 600) -> ChildResult:
        if not self._started:
            self._start()
        t0 = time.perf_counter()
        recv, send = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_fork_entry, args=(module, function, spec, send), daemon=True)
        proc.start()
        send.close()
        data, err = None, ""
        if recv.poll(timeout):
            try:
                kind, payload = recv.recv()
                data, err = (payload, "") if kind == "ok" else (None, payload)
            except EOFError:  # the child died before answering
                pass
        proc.join(5 if data is not None or err else 0.1)
        if proc.is_alive():
            proc.kill()
            proc.join()
            err = err or f"timed out after {timeout:.0f} s"
        recv.close()
        rc = proc.exitcode if proc.exitcode is not None else -9
        if data is None and not err:
            err = f"child exited with {rc} without a result"
        return ChildResult(data, rc if data is None else 0, time.perf_counter() - t0, err)


_SERVER_ENV: dict[str, str] | None = None


def _fork_entry(module: str, function: str, spec: dict[str, Any], conn: Any) -> None:
    import importlib
    import traceback

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        result = getattr(importlib.import_module(module), function)(spec)
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()[-4000:]))
    finally:
        conn.close()


def emit(doc: dict[str, Any]) -> None:
    """A child's result: one JSON line on stdout, flushed."""
    print(json.dumps(doc), flush=True)


def vm_bytes() -> int:
    """This process's mapped address space (what RLIMIT_AS limits)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def cap_address_space(headroom_bytes: int) -> int:
    """Allow ``headroom_bytes`` of address space beyond what is mapped now; return the cap."""
    cap = vm_bytes() + headroom_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def allocator_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator handed out while ``fn`` ran, above what was allocated before.

    Read from ``torch.profiler``'s allocation records (every ``c10`` CPU allocation and free,
    in order), so it sees what no dispatch mode can: the buffers of an inductor-compiled
    kernel and the scratch memory inside eager kernels (im2col). Not the whole process: the
    Python heap and anything outside PyTorch's allocator are not in it.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))  # frees are negative
        stack.extend(event.children)
    live = peak = 0
    for _, size in sorted(sizes, key=lambda s: s[0]):
        live += size
        peak = max(peak, live)
    return peak


def is_allocator_oom(exc: BaseException) -> bool:
    """The real CPU allocator failure (not batchpilot's emulated ``OutOfMemoryError``)."""
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def largest_fitting(fits: Callable[[int], bool], start: int, *, shrink: float = 2.0,
                    check_next: bool = False) -> int:
    """Largest ``b`` with ``fits(b)`` (0 if not even 1 fits), assuming ``fits`` is monotone.

    Brackets from ``start`` (up by x1.5 while it fits, down by /``shrink`` while it does not),
    then bisects to a size that fits next to one that does not. ``start`` only saves probes.
    ``check_next`` probes ``start + 1`` first when ``start`` fits: two probes in all when the
    start is already the boundary (e.g. a finder's answer).
    """
    lo, hi = 0, None  # lo fits (0: nothing known), hi does not
    b = max(1, start)
    if fits(b):
        lo = b
        if check_next and not fits(b + 1):
            hi = b + 1
        while hi is None:
            b = max(lo + 1, int(lo * 1.5))
            if fits(b):
                lo = b
            else:
                hi = b
    else:
        hi = b
        while lo == 0 and hi > 1:
            b = max(1, int(hi / shrink))
            if fits(b):
                lo = b
            else:
                hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


class CallLog:
    """Wraps a ``step(b)`` callable: records each call's batch size and how it ended.

    Kinds: ``"ok"``, ``"oom"`` (the real allocator error), ``"emulated_oom"`` (batchpilot's
    tracker past its capacity), ``"error"`` (anything else; re-raised like the others).
    ``on_event(b, kind)``, if given, is told ``"start"`` before each call and the kind after
    it: a journal that outlives a process the kernel kills mid-call.
    """

    def __init__(self, fn: Callable[[int], Any], on_event: Callable[[int, str], None] | None = None) -> None:
        self.fn = fn
        self.on_event = on_event
        self.calls: list[tuple[int, str]] = []  # (batch size, kind)

    def _record(self, b: int, kind: str) -> None:
        self.calls.append((b, kind))
        if self.on_event is not None:
            self.on_event(b, kind)

    def __call__(self, b: int) -> Any:
        if self.on_event is not None:
            self.on_event(b, "start")
        try:
            out = self.fn(b)
        except BaseException as exc:
            if is_allocator_oom(exc):
                kind = "oom"
            elif isinstance(exc, torch.OutOfMemoryError):
                kind = "emulated_oom"
            else:
                kind = "error"
            self._record(b, kind)
            raise
        self._record(b, "ok")
        return out

    def trials(self) -> list[tuple[int, set[str]]]:
        """Calls merged into trials (consecutive calls at one size; a failure ends a trial).

        Returns ``[(batch size, kinds of the calls)]``, kinds as in :attr:`calls`.
        """
        return merge_calls(self.calls)


def merge_calls(calls: Sequence[tuple[int, str]]) -> list[tuple[int, set[str]]]:
    """``[(b, kind)]`` calls merged into trials: consecutive calls at one size, until one fails."""
    out: list[tuple[int, set[str]]] = []
    for b, kind in calls:
        if out and out[-1][0] == b and out[-1][1] == {"ok"}:
            out[-1][1].add(kind)
        else:
            out.append((b, {kind}))
    return out


# ---------------------------------------------------------------------------
# cache and provenance


def load_cache(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def store_cache(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def machine() -> dict[str, Any]:
    """Where a table was measured: CPU count, torch version, accelerator."""
    import platform

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
