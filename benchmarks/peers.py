"""batchpilot against Lightning and Accelerate, on the same models under the same real memory cap.

Every (method, model) measurement runs in a fresh process (forked from a server that has only
imported torch, the peers and batchpilot) that builds the model and its Adam optimizer, runs
one tiny warm-up step and only then caps its address space with ``RLIMIT_AS`` at what is
mapped plus ``--cap-mib``. Past the cap PyTorch raises its real ``DefaultCPUAllocator`` error,
which every method must survive.

Methods (the peers are the installed packages, run as themselves):

- ``batchpilot-predict`` / ``-power`` / ``-binsearch``: ``find_batch_size`` with
  ``capacity`` = the cap plus the bytes of the model, buffers and optimizer state that
  exist before the cap (the tracker counts those; the cap does not), ``target=1.0`` (the
  same goal as the peers: the largest batch that runs) -- see benchmarks/README.md.
- ``batchpilot-predict@0.8``: the finder's default target, for reference (full runs only).
- ``batchpilot-predict (no capacity)``: ``find_batch_size`` told nothing about the cap: it
  must find the real limit itself, from the allocator's errors.
- ``lightning-power`` / ``lightning-binsearch``: ``Tuner.scale_batch_size`` with its
  defaults (``init_val=2``, ``steps_per_trial=3``, ``max_trials=25``, ``margin=0.05``,
  ``max_val=8192``) on a LightningModule wrapping the same model, optimizer and data. Lightning
  2.6.6's power mode never goes past 8192, whatever ``max_val`` says: it doubles through
  ``_adjust_batch_size`` without passing ``max_val`` on, whose default caps at 8192.
- ``accelerate``: ``find_executable_batch_size`` from 4x the true max (x0.9 per OOM).

"True max" is the largest batch that trains 2 steps (forward, backward, Adam) under the
same cap, found by bisection with every probe in a fresh process, cached in
``benchmarks/.cache/peers_truth.json`` keyed by model, configuration, cap, allocator settings,
torch version and harness version. Method, counting and results: benchmarks/README.md.

``--container`` replaces the address-space cap by a container's: every process (each
measurement and each truth probe) joins a fresh memory cgroup limited to ``--container-mib``
(tests/helpers/cgroup.py) as its first act, and nothing caps its address space. Past the
limit the kernel SIGKILLs it: no error to catch, no answer. A journal file, written line by
line as trials start and end, keeps the trials of a killed process. Without a cgroup the
mode prints why and skips.

    python benchmarks/peers.py                       # 3 models, 64 MiB
    python benchmarks/peers.py --quick               # 1 small model, 16 MiB: a smoke test
    python benchmarks/peers.py --models cnn --cap-mib 256 --json peers.json
    python benchmarks/peers.py --container           # 3 models, each process in a 1.5 GiB cgroup
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from _harness import (  # noqa: E402
    BENCH_MODELS,
    CACHE_DIR,
    QUICK_MODELS,
    CallLog,
    ForkRunner,
    Workload,
    cap_address_space,
    emit,
    is_allocator_oom,
    largest_fitting,
    load_cache,
    machine,
    merge_calls,
    passthrough,
    store_cache,
)
from cgroup import cgroup_unavailable_reason, join_cgroup, memory_cgroup  # noqa: E402

MiB = 2**20
#: glibc's mmap threshold in the measured processes (see ``_harness.child_env``)
MALLOC_SETTINGS = ("fixed", "dynamic")
TRUTH_CACHE = CACHE_DIR / "peers_truth.json"
TRUTH_STEPS = 2
# Bump when the harness changes what a probe allocates (data pipeline, warm-up): cached truths then expire.
HARNESS_VERSION = 4
BATCHPILOT = ("batchpilot-predict", "batchpilot-power", "batchpilot-binsearch")
NO_CAPACITY = " (no capacity)"  # a batchpilot method told nothing about the cap
LIGHTNING = ("lightning-power", "lightning-binsearch")
# told nothing, at the finder's default target and at 0.99 ("the largest that still trains"): issue #23's goals
NO_CAPACITY_TARGETS = ("batchpilot-predict@0.8" + NO_CAPACITY, "batchpilot-predict@0.99" + NO_CAPACITY)
# batchpilot.integrations.accelerate's drop-in, told nothing, in Accelerate's own pattern
DROP_IN = "batchpilot-accelerate@0.99" + NO_CAPACITY
METHODS = (*BATCHPILOT, "batchpilot-predict" + NO_CAPACITY, *NO_CAPACITY_TARGETS, "batchpilot-predict@0.8", *LIGHTNING,
           "accelerate", DROP_IN)
QUICK_METHODS = (*BATCHPILOT, "batchpilot-predict" + NO_CAPACITY, *LIGHTNING, "accelerate")
# --container: a capacity would be the limit itself, so batchpilot runs only without one
CONTAINER_METHODS = ("batchpilot-predict@0.9" + NO_CAPACITY, "batchpilot-predict" + NO_CAPACITY, *LIGHTNING,
                     "accelerate")
CONTAINER_DEFAULT = ("batchpilot-predict@0.9" + NO_CAPACITY, "lightning-power", "accelerate")
REFERENCE = "batchpilot-predict"
PEER_REFERENCE = "lightning-power"
COLUMNS = ("malloc", "method", "model", "found", "found/true", "trials", "OOMs", "emulated", "seconds", "x predict",
           "÷ lightning-power", "trains after", "outcome")
CONTAINER_COLUMNS = ("malloc", "method", "model", "found", "found/true", "trials", "OOMs", "killed", "seconds",
                     "÷ lightning-power", "trains after", "outcome")
#: training steps run at the answer after the search, in the process that searched (column "trains after")
AFTER_STEPS = 10
# Imported once by the fork server, so that every measurement starts with them loaded.
# torch._dynamo (and sympy with it, ~100 MB) is what the first optimizer step imports: without
# it here every child of a server without Lightning would pay it, and in a cgroup that counts.
PRELOAD = ("torch", "torch._dynamo", "_harness", "peers", "batchpilot.find.finder", "batchpilot.app.report",
           "lightning", "lightning.pytorch.tuner", "accelerate", "accelerate.utils", "batchpilot.integrations.accelerate")
# A peer is preloaded only when one of its methods runs: Lightning's imports add about 140 MB of
# resident memory to every child (measured 2026-12-01: 297 MB with torch alone, 435 MB with
# Lightning, 303 MB with Accelerate), which a child without a capacity counts as its own.
_PEER_MODULES = {"lightning": ("lightning", "lightning.pytorch.tuner"),
                 "accelerate": ("accelerate", "accelerate.utils", "batchpilot.integrations.accelerate")}
_preload: tuple[str, ...] = PRELOAD
_runners: dict[str, ForkRunner] = {}


def preload_for(methods: list[str]) -> tuple[str, ...]:
    """:data:`PRELOAD` without the peers that none of ``methods`` uses."""
    # the drop-in for Accelerate's decorator needs Accelerate
    families = {"accelerate" if parse_method(m)[1] == "accelerate" else parse_method(m)[0] for m in methods}
    unused = {mod for peer, mods in _PEER_MODULES.items() if peer not in families for mod in mods}
    return tuple(m for m in PRELOAD if m not in unused)


@dataclass(frozen=True)
class Setting:
    """What every process of one comparison shares.

    Attributes:
        cap_mib: address space allowed beyond what is mapped after the warm-up.
        quick: the smaller models of ``_harness.QUICK_MODELS``.
        malloc: ``"fixed"`` or ``"dynamic"`` glibc mmap threshold (see ``_harness.child_env``).
        conv_backends: leave oneDNN and NNPACK on. Off by default: both allocate outside
            PyTorch's allocator and fail in ways no OOM predicate (batchpilot's, Lightning's,
            Accelerate's) recognises. oneDNN's convolution primitives (JIT code and scratch
            buffers, one set per input shape) raise "could not create a primitive" or crash the
            process (SIGSEGV); NNPACK's workspace raises "posix_memalign failed: Cannot allocate
            memory (12)". Off, convolutions use PyTorch's native kernels and every allocation
            failure is the allocator's "DefaultCPUAllocator: can't allocate memory".
        container_mib: when not 0, the memory cgroup limit each process runs under instead
            of the address-space cap (``cap_mib`` is then 0 and unused).
    """

    cap_mib: int
    quick: bool = False
    malloc: str = "fixed"
    conv_backends: bool = False
    container_mib: int = 0


def _crashed(exc: BaseException) -> str:
    """A row's outcome for a method that raised: the error's type and first line."""
    first = str(exc).splitlines()[0][:80] if str(exc) else ""
    return f"crashed: {type(exc).__name__}: {first}"


def _fork(function: str, spec: dict[str, Any], timeout: float = 900) -> Any:
    malloc = spec["setting"]["malloc"]
    if malloc not in _runners:
        _runners[malloc] = ForkRunner(_preload, malloc=malloc)
    return _runners[malloc]("peers", function, spec, timeout=timeout)


def _fork_capped(function: str, spec: dict[str, Any], setting: Setting,
                 timeout: float = 900) -> tuple[Any, dict[str, Any] | None]:
    """:func:`_fork`; in container mode inside a fresh memory cgroup, whose kill count comes back too."""
    if not setting.container_mib:
        return _fork(function, spec, timeout), None
    with memory_cgroup(setting.container_mib * MiB) as cg:
        r = _fork(function, {**spec, "cgroup": str(cg.path)}, timeout)
        return r, {"oom_kills": cg.oom_kills, "peak_bytes": cg.peak_bytes, "limit_bytes": cg.limit_bytes}


def parse_method(method: str) -> tuple[str, str, float | None, bool]:
    """``"batchpilot-predict@0.9 (no capacity)"`` -> ``("batchpilot", "predict", 0.9, True)``.

    Raises:
        ValueError: not a method name of this benchmark.
    """
    m = re.fullmatch(r"(batchpilot|lightning)-(\w+)(?:@([0-9.]+))?( \(no capacity\))?|accelerate", method)
    if m is None:
        raise ValueError(f"unknown method {method!r}")
    if method == "accelerate":
        return "accelerate", "", None, False
    return m.group(1), m.group(2), float(m.group(3)) if m.group(3) else None, bool(m.group(4))


# ---------------------------------------------------------------------------
# children: one measurement each, in a fresh process


def _enter(spec: dict[str, Any]) -> None:
    """A child's first act in container mode: join the fresh cgroup the parent made for it.

    What the child inherited from the fork server is charged to the group only when written.
    ``gc.freeze()`` first (it relinks lists, writing no object): otherwise the first
    ``gc.collect()`` (Accelerate's, Lightning's, batchpilot's recovery) writes the GC header
    of every inherited object and copies the whole imported heap into the group: about
    100 MB more for the methods that collect garbage (quick MLP, 2026-12-01: Accelerate's
    process peaked at 114 MB instead of 14 MB, Lightning power's at 139 MB instead of 48 MB).
    """
    if spec.get("cgroup"):
        gc.freeze()
        join_cgroup(spec["cgroup"])


def _cap(setting: Setting) -> None:
    """The address-space cap, after the warm-up; none in container mode (the cgroup limits)."""
    if not setting.container_mib:
        cap_address_space(setting.cap_mib * MiB)


def _journal(spec: dict[str, Any]) -> Callable[[Any, str], None] | None:
    """Container mode: a line per event, written before the next step, so a SIGKILL keeps it."""
    path = spec.get("journal")
    if not path:
        return None
    f = open(path, "a", buffering=1)  # line-buffered: each line is one write() the kernel already holds

    def note(b: Any, kind: str) -> None:
        f.write(json.dumps([b, kind, time.time()]) + "\n")

    return note


def _prepare(spec: dict[str, Any]) -> tuple[Workload, Setting]:
    import torch

    setting = Setting(**spec["setting"])
    torch.set_num_threads(1)  # one thread: times comparable on a shared machine
    torch.backends.mkldnn.enabled = setting.conv_backends
    torch.backends.nnpack.set_flags(setting.conv_backends)
    w = Workload.build(spec["model"], quick=setting.quick)
    w.warm_up()
    return w, setting


def _probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Does ``batch`` train ``TRUTH_STEPS`` steps under the cap? (In a container, "no" is a SIGKILL.)"""
    _enter(spec)
    w, setting = _prepare(spec)
    _cap(setting)
    try:
        for _ in range(TRUTH_STEPS):
            w.train_step(spec["batch"])
    except RuntimeError as exc:
        if not is_allocator_oom(exc):
            raise
        return {"ok": False}
    return {"ok": True}


def _batchpilot(w: Workload, setting: Setting, spec: dict[str, Any]) -> dict[str, Any]:
    from batchpilot.find.finder import find_batch_size

    _, strategy, target, no_capacity = parse_method(spec["method"])
    target = spec["target"] if target is None else target
    # the tracker counts what exists before the cap; the cap does not
    capacity = None if no_capacity else setting.cap_mib * MiB + w.state_bytes()
    note = _journal(spec)
    log = CallLog(w.train_step, on_event=note)
    _cap(setting)
    if note is not None:
        note(None, "begin")
    t0 = time.perf_counter()
    found, outcome, doc = None, "ok", {}
    try:
        plan = find_batch_size(log, device="cpu", target=target, capacity=capacity, strategy=strategy,
                               steps_per_trial=2, restore=(w.model, w.optimizer))
        found, doc = plan.batch_size, plan.to_dict()
    except BaseException as exc:  # reported as the row's outcome, never hidden
        outcome = _crashed(exc)
    seconds = time.perf_counter() - t0
    runs = [[b, next((k for k in ("error", "oom", "emulated_oom") if k in kinds), "ok")] for b, kinds in log.trials()]
    return {
        "found": found,
        "runs": runs,
        "seconds": seconds,
        "outcome": outcome,
        "finder": {k: doc.get(k) for k in ("num_trials", "num_ooms", "stop_reason", "limit_bytes", "capacity", "fit")},
        "capacity_bytes": capacity,
        "target": target,
    }


def _lightning(w: Workload, setting: Setting, spec: dict[str, Any]) -> dict[str, Any]:
    import logging
    import tempfile
    import warnings

    import lightning as L
    import lightning.pytorch.tuner.batch_size_scaling as scaling
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = w.model
            self.batch_size = 2

        def train_dataloader(self) -> DataLoader:
            return DataLoader(w.dataset, batch_size=self.batch_size, collate_fn=passthrough, num_workers=0)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return w.loss(batch)

        def configure_optimizers(self) -> Any:
            return w.optimizer  # the warmed-up optimizer: its state exists before the cap, as for every method

    # Each trial of scale_batch_size is one call of this module-level function; wrapping it only
    # observes (it calls through and re-raises), so a trial that fails before its first batch counts too.
    runs: list[list[Any]] = []
    try_loop_run = scaling._try_loop_run
    note = _journal(spec) or (lambda b, kind: None)

    def observed(trainer: Any, params: Any) -> None:
        b = trainer.lightning_module.batch_size
        note(b, "start")
        try:
            try_loop_run(trainer, params)
        except BaseException as exc:
            runs.append([b, "oom" if is_allocator_oom(exc) else "error"])
            note(*runs[-1])
            raise
        runs.append([b, "ok"])
        note(b, "ok")

    root = tempfile.mkdtemp(prefix="bp-peers-")

    def trainer(**kw: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, **kw)

    # Warm-up fit before the cap: Lightning's lazy imports and one-time set-up are not the search.
    trainer(max_steps=1).fit(Module())
    module, tuner_trainer = Module(), trainer()
    mode = parse_method(spec["method"])[1]
    scaling._try_loop_run = observed
    _cap(setting)
    note(None, "begin")
    t0 = time.perf_counter()
    found, outcome = None, "ok"
    try:
        found = Tuner(tuner_trainer).scale_batch_size(module, mode=mode)
    except BaseException as exc:  # reported as the row's outcome, never hidden
        outcome = _crashed(exc)
    seconds = time.perf_counter() - t0
    scaling._try_loop_run = try_loop_run
    return {
        "found": found,
        "runs": runs,
        "seconds": seconds,
        "outcome": outcome,
    }


def _accelerate(w: Workload, setting: Setting, spec: dict[str, Any]) -> dict[str, Any]:
    from accelerate.utils import find_executable_batch_size
    from accelerate.utils.memory import clear_device_cache
    from torch.utils.data import DataLoader

    calls: list[tuple[int, str]] = []  # (batch size, "ok" | "oom" | "error")
    note = _journal(spec) or (lambda b, kind: None)

    @find_executable_batch_size(starting_batch_size=spec["start"])
    def train(batch_size: int) -> int:
        note(batch_size, "start")
        loader = iter(DataLoader(w.dataset, batch_size=batch_size, collate_fn=passthrough))
        try:
            for _ in range(TRUTH_STEPS):
                batch = next(loader)
                w.optimizer.zero_grad(set_to_none=True)
                w.loss(batch).backward()
                w.optimizer.step()
        except BaseException as exc:
            calls.append((batch_size, "oom" if is_allocator_oom(exc) else "error"))
            note(*calls[-1])
            raise
        calls.append((batch_size, "ok"))
        note(batch_size, "ok")
        return batch_size

    clear_device_cache(garbage_collection=True)  # its first call imports and probes backends: before the cap
    _cap(setting)
    note(None, "begin")
    t0 = time.perf_counter()
    found, outcome = None, "ok"
    try:
        found = train()
    except BaseException as exc:
        outcome = _crashed(exc)
    return {
        "found": found,
        "runs": [[b, kind] for b, kind in calls],
        "seconds": time.perf_counter() - t0,
        "outcome": outcome,
        "start": spec["start"],
    }


def _batchpilot_accelerate(w: Workload, setting: Setting, spec: dict[str, Any]) -> dict[str, Any]:
    """batchpilot's drop-in for Accelerate's decorator, told nothing about the cap, in Accelerate's pattern:
    the decorated function prepares the model, optimizer and loader and trains; its final call trains
    :data:`AFTER_STEPS` steps at the answer (the decorator's own retry on an OOM there is counted)."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from batchpilot.integrations.accelerate import find_executable_batch_size

    target = parse_method(spec["method"])[2] or spec["target"]
    calls: list[tuple[int, str]] = []  # every call of the function: the trials, then the final run(s)
    note = _journal(spec) or (lambda b, kind: None)
    accelerator = Accelerator(cpu=True)

    @find_executable_batch_size(starting_batch_size=spec["start"], target=target)
    def train(batch_size: int) -> int:
        note(batch_size, "start")
        accelerator.free_memory()
        loader = DataLoader(w.dataset, batch_size=batch_size, collate_fn=passthrough)
        model, optimizer, loader = accelerator.prepare(w.model, w.optimizer, loader)
        steps = 0
        try:
            for batch in loader:
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(w.loss(batch))
                optimizer.step()  # in a trial, the decorator stops the function here after its steps
                steps += 1
                if steps == AFTER_STEPS:
                    break
        except BaseException as exc:
            calls.append((batch_size, "oom" if is_allocator_oom(exc) else "error" if isinstance(exc, Exception)
                          else "ok"))  # a BaseException is the decorator ending a trial
            note(*calls[-1])
            raise
        calls.append((batch_size, "ok"))
        note(batch_size, "ok")
        return steps

    _cap(setting)
    note(None, "begin")
    t0 = time.perf_counter()
    found, outcome, trained = None, "ok", None
    try:
        trained = train()
        found = train.batch_size
    except BaseException as exc:  # reported as the row's outcome, never hidden
        outcome = _crashed(exc)
    finals = len(calls) - len(train.plan.trials) if train.plan is not None else 0
    return {
        "found": found,
        "runs": [[b, kind] for b, kind in calls],
        "seconds": time.perf_counter() - t0,
        "outcome": outcome,
        "final_runs": finals,  # calls of the function after the search: 1 unless the final run ran out
        "function_steps": trained,
        "start": spec["start"],
    }


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    _enter(spec)
    family = parse_method(spec["method"])[0]
    if family == "lightning":
        import lightning  # noqa: F401  imported before the cap, as a user's script would
    if family == "accelerate":
        import accelerate  # noqa: F401
    if family == "batchpilot" and parse_method(spec["method"])[1] == "accelerate":
        import accelerate  # noqa: F401,F811
        family = "batchpilot-accelerate"
    w, setting = _prepare(spec)
    row = {"batchpilot": _batchpilot, "lightning": _lightning, "accelerate": _accelerate,
           "batchpilot-accelerate": _batchpilot_accelerate}[family](w, setting, spec)
    if row.get("found") and row["outcome"] == "ok":
        row.update(_train_after(w, row["found"], _journal(spec)))
    return row


def _train_after(w: Workload, b: int, note: Callable[[Any, str], None] | None) -> dict[str, Any]:
    """What the answer is for: :data:`AFTER_STEPS` training steps at it, in the process that searched.

    Everything the search left behind (allocator state, JIT code, freed-but-mapped heap, oneDNN's
    state after a failure) is still there, as it is for the user's training loop that follows.
    """
    done, error = 0, None
    for _ in range(AFTER_STEPS):
        if note is not None:
            note(b, "after")
        try:
            w.train_step(b)
        except RuntimeError as exc:  # an OOM of any kind here is the row's finding, not the harness's
            error = _crashed(exc)
            break
        done += 1
    w.optimizer.zero_grad(set_to_none=True)
    return {"trained": done, "train_error": error}


# ---------------------------------------------------------------------------
# parent: truth, measurements, table


def _truth_key(model: str, setting: Setting) -> str:
    import torch

    cfg = (QUICK_MODELS if setting.quick else BENCH_MODELS)[model]
    cap = asdict(setting)
    if not cap["container_mib"]:  # keys from before container mode stay valid
        del cap["container_mib"]
    return json.dumps({"model": model, "config": cfg, **cap, "steps": TRUTH_STEPS,
                       "torch": torch.__version__, "harness": HARNESS_VERSION}, sort_keys=True)


def _guess(model: str, cap_mib: int, quick: bool) -> int:
    """A starting point for the bisection: tracked peak at two small batches, solved for the cap."""
    import torch

    from batchpilot.memory.probes import track_peak

    torch.set_num_threads(1)
    w = Workload.build(model, quick=quick)
    w.warm_up()
    peaks = []
    # large enough that activations, not the optimizer step, make the peak
    for b in (256, 512):
        with track_peak("cpu", track=(w.model, w.optimizer)) as m:
            w.train_step(b)
        peaks.append(m.peak_bytes - w.state_bytes())
    slope = max((peaks[1] - peaks[0]) / 256, 1.0)
    return max(1, int((cap_mib * MiB - (peaks[0] - 256 * slope)) / slope))


def true_max(model: str, setting: Setting, *, use_cache: bool = True, log=print) -> dict[str, Any]:
    """Largest batch that trains under the cap, by bisection over fresh-process probes (cached).

    In container mode each probe runs in its own fresh cgroup with the same limit, and a
    batch does not fit when the kernel kills the probe.

    Raises:
        RuntimeError: a probe failed for another reason than the cap.
    """
    key = _truth_key(model, setting)
    cache = load_cache(TRUTH_CACHE) if use_cache else {}
    if key in cache:
        return {**cache[key], "cached": True}
    t0 = time.perf_counter()
    probes: dict[int, bool] = {}

    def fits(b: int) -> bool:
        spec = {"kind": "probe", "model": model, "batch": b, "setting": asdict(setting)}
        r, cg = _fork_capped("_probe", spec, setting, timeout=600)
        if cg is not None and not r.ok and r.returncode == -9 and cg["oom_kills"]:
            probes[b] = False  # the container's answer to "does not fit"
            return False
        if not r.ok:
            raise RuntimeError(f"truth probe {model} b={b} failed (rc {r.returncode}, cgroup {cg}):\n{r.stderr}")
        probes[b] = r.data["ok"]
        return probes[b]

    cap = setting.container_mib or setting.cap_mib
    g = _guess(model, cap, setting.quick)
    lo = largest_fitting(fits, g, shrink=1.5)
    doc = {"batch_size": lo, "probes": dict(sorted((str(k), v) for k, v in probes.items())),
           "seconds": time.perf_counter() - t0, "guess": g}
    log(f"  true max {model} @ {_cap_text(setting)}: {lo} ({len(probes)} fresh-process probes, {doc['seconds']:.0f} s)")
    if use_cache:
        cache = load_cache(TRUTH_CACHE)
        cache[key] = doc
        store_cache(TRUTH_CACHE, cache)
    return {**doc, "cached": False}


def _cap_text(setting: Setting) -> str:
    return f"{setting.container_mib} MiB cgroup" if setting.container_mib else f"{setting.cap_mib} MiB"


def _journal_runs(path: Path, batchpilot: bool) -> tuple[list[list[Any]], float | None, list[int]]:
    """A killed child's trials from its journal, the one it died in last as ``"killed"``; when its search
    began; and the batch of each training step it began after the search (the last one is where it died)."""
    calls: list[tuple[int, str]] = []
    after: list[int] = []
    began, started = None, None
    for line in path.read_text().splitlines():
        try:
            b, kind, t = json.loads(line)
        except ValueError:  # a line cut short by the kill
            continue
        if kind == "begin":
            began = t
        elif kind == "after":  # a training step at the answer, after the search: not a trial
            after.append(b)
            started = None
        elif kind == "start":
            started = b
        else:
            calls.append((b, kind))
            started = None
    if started is not None:
        calls.append((started, "killed"))
    if not batchpilot:  # Lightning's and Accelerate's calls are trials already
        return [[b, kind] for b, kind in calls], began, after
    return [[b, _trial_kind(kinds)] for b, kinds in merge_calls(calls)], began, after


def _trial_kind(kinds: set[str]) -> str:
    return next((k for k in ("error", "killed", "oom", "emulated_oom") if k in kinds), "ok")


def measure(method: str, model: str, setting: Setting, truth: int, *, target: float = 1.0,
            start_factor: float = 4.0, timeout: float = 900) -> dict[str, Any]:
    spec = {"kind": "measure", "method": method, "model": model, "setting": asdict(setting),
            "target": target, "start": max(2, int(start_factor * truth))}
    journal = None
    if setting.container_mib:
        fd, name = tempfile.mkstemp(prefix="bp-peers-", suffix=".jsonl")
        os.close(fd)
        journal = Path(name)
        spec["journal"] = name
    try:
        r, cg = _fork_capped("_measure", spec, setting, timeout=timeout)
        ended = time.time()
        killed = cg is not None and not r.ok and r.returncode == -9
        if r.ok:
            row = r.data
        elif killed:  # the kernel's answer: no result, only the journal
            runs, began, after = _journal_runs(journal, parse_method(method)[0] == "batchpilot")
            last = runs[-1][0] if runs and runs[-1][1] == "killed" else None
            how = f"killed (SIGKILL{'' if cg['oom_kills'] else ', not by the OOM killer'})"
            if after:  # the search answered; the kernel killed the training that followed
                row = {"found": after[0], "runs": runs, "seconds": None, "outcome": "ok",
                       "trained": len(after) - 1, "train_error": f"{how} in training step {len(after)}"}
            else:
                row = {"found": None, "runs": runs, "seconds": ended - began if began else None,
                       "outcome": how + (f" at b={last}" if last is not None else "")}
        else:  # an error outside the method, or a process killed outside Python's reach: still a row
            last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
            row = {"found": None, "trials": None, "ooms": None, "seconds": None,
                   "outcome": f"failed: {last[:100]}", "error": r.stderr}
    finally:
        if journal is not None:
            journal.unlink(missing_ok=True)
    row.update(method=method, model=model, true_max=truth, malloc=setting.malloc)
    if cg is not None:
        row.update(killed=killed, cgroup=cg)
    runs = row.get("runs")
    if runs is not None:
        # the finder's own count where it reports one: its runs of the step include the one small step
        # a trial makes the lazily created state with (docs/real-memory.md), which is no trial of its own
        finder = row.get("finder") or {}
        row["trials"] = finder["num_trials"] if finder.get("num_trials") is not None else len(runs)
        row["ooms"] = sum(kind == "oom" for _, kind in runs)
        if method.startswith("batchpilot"):
            row["emulated"] = sum(kind == "emulated_oom" for _, kind in runs)
        ran = [b for b, kind in runs if kind == "ok"]
        row["largest_ok"] = max(ran, default=None)
        if row.get("found") and row["outcome"] == "ok" and (not ran or row["found"] > max(ran)):
            # e.g. Lightning stops doubling at max_val and returns it without a trial
            row["outcome"] = "returned an untried size"
    row["found_over_true"] = row["found"] / truth if row.get("found") and truth else None
    return row


def _fmt(v: Any, digits: int = 2) -> Any:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return round(v, digits) if isinstance(v, float) else v


def _trained(r: dict[str, Any]) -> str:
    """The "trains after" cell: ``10/10``, or the steps that ran and how the next one failed."""
    if r.get("trained") is None:
        return "-"
    cell = f"{r['trained']}/{AFTER_STEPS}"
    return cell if not r.get("train_error") else f"{cell} ({r['train_error'][:60]})"


def table(rows: list[dict[str, Any]], *, container: bool = False) -> str:
    from batchpilot.app.report import format_table

    if container:
        return format_table(CONTAINER_COLUMNS, [
            (r.get("malloc", "-"), r["method"], r["model"], _fmt(r.get("found")), _fmt(r.get("found_over_true")),
             _fmt(r.get("trials")), _fmt(r.get("ooms")), _fmt(r.get("killed")), _fmt(r.get("seconds"), 1),
             _fmt(r.get("vs_peer")), _trained(r), r.get("outcome", ""))
            for r in rows
        ])
    return format_table(COLUMNS, [
        (r.get("malloc", "-"), r["method"], r["model"], _fmt(r.get("found")), _fmt(r.get("found_over_true")),
         _fmt(r.get("trials")), _fmt(r.get("ooms")), _fmt(r.get("emulated")), _fmt(r.get("seconds"), 1),
         _fmt(r.get("relative")), _fmt(r.get("vs_peer")), _trained(r), r.get("outcome", ""))
        for r in rows
    ])


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's seconds ÷ batchpilot-predict's (``relative``) and ÷ Lightning power's (``vs_peer``), same model."""
    for key, ref_method in (("relative", REFERENCE), ("vs_peer", PEER_REFERENCE)):
        ref = next((r for r in rows if r["method"] == ref_method and r.get("seconds")), None)
        for r in rows:
            r[key] = r["seconds"] / ref["seconds"] if ref and r.get("seconds") is not None else None


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The comparison; ``None`` when container mode cannot make a cgroup here (the reason is printed)."""
    container = args.container
    if container:
        reason = cgroup_unavailable_reason()
        if reason is not None:
            print(f"peers --container skipped: no memory cgroup can be created here: {reason}", flush=True)
            return None
    models = args.models or (["mlp"] if args.quick else list(BENCH_MODELS))
    default = CONTAINER_DEFAULT if container else (QUICK_METHODS if args.quick else METHODS)
    methods = args.methods or list(default)
    global _preload
    if not _runners:  # the fork server is started once per process, with the first measurement
        _preload = preload_for(methods)
    if container:
        limit = args.container_mib if args.container_mib is not None else (256 if args.quick else 1536)
        setting = Setting(cap_mib=0, quick=args.quick, malloc=args.malloc[0],
                          conv_backends=args.conv_backends, container_mib=limit)
    else:
        cap = args.cap_mib if args.cap_mib is not None else (16 if args.quick else 64)
        setting = Setting(cap_mib=cap, quick=args.quick, malloc=args.malloc[0], conv_backends=args.conv_backends)
    t0 = time.perf_counter()
    truth, rows = {}, []
    for model in models:
        print(f"[{model}] true max under {_cap_text(setting)} ...", flush=True)
        truth[model] = true_max(model, setting, use_cache=not args.no_cache)
        tm = truth[model]["batch_size"]
        model_rows = []
        for method in methods:
            print(f"[{model}] {method} ...", flush=True)
            row = measure(method, model, setting, tm, target=args.target, start_factor=args.accelerate_start)
            model_rows.append(row)
        _ratios(model_rows)
        rows += model_rows
    return {
        "benchmark": "peers",
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        **asdict(setting),
        "target": args.target,
        "truth": truth,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cap-mib", type=int, default=None, help="address-space headroom per process, MiB (default 64; --quick 16)")
    p.add_argument("--container", action="store_true",
                   help="run every process in a fresh memory cgroup instead of under RLIMIT_AS (a container's "
                        f"limit: past it the kernel kills); default methods {','.join(CONTAINER_DEFAULT)}")
    p.add_argument("--container-mib", type=int, default=None,
                   help="--container: the cgroup memory limit per process, MiB (default 1536; --quick 256)")
    p.add_argument("--models", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated, from {','.join(BENCH_MODELS)} (default all; --quick: mlp)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated, from {','.join(METHODS)}; --container: from {','.join(CONTAINER_METHODS)}")
    p.add_argument("--quick", action="store_true", help="smaller models, 16 MiB cap, one model (mlp): a smoke test")
    p.add_argument("--target", type=float, default=1.0,
                   help="batchpilot's target fraction of the capacity where the method name gives none (default 1.0)")
    p.add_argument("--accelerate-start", type=float, default=4.0, help="accelerate's starting batch, x true max (default 4)")
    p.add_argument("--malloc", type=lambda s: s.split(","), default=["fixed"],
                   help="glibc mmap threshold: fixed at 128 KiB (default), dynamic (glibc's history-dependent "
                        "default), or fixed,dynamic: both, each in a process of its own, one table keyed by it")
    p.add_argument("--conv-backends", action="store_true",
                   help="leave oneDNN and NNPACK on (off by default; see Setting.conv_backends)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--no-cache", action="store_true", help="recompute the true max (and do not store it)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    allowed = CONTAINER_METHODS if args.container else METHODS
    for m in args.methods or ():
        if m not in allowed:
            p.error(f"unknown method {m!r}{' in --container mode' if args.container else ''}; "
                    f"choose from {', '.join(allowed)}")
    for m in args.models or ():
        if m not in BENCH_MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(BENCH_MODELS)}")
    for m in args.malloc:
        if m not in MALLOC_SETTINGS:
            p.error(f"unknown --malloc {m!r}; choose from {', '.join(MALLOC_SETTINGS)} (or both, comma-separated)")
    if len(set(args.malloc)) != len(args.malloc):
        p.error(f"--malloc names a setting twice: {','.join(args.malloc)}")
    if args.container and args.cap_mib is not None:
        p.error("--cap-mib is the address-space cap; with --container the limit is --container-mib")
    if args.container_mib is not None and not args.container:
        p.error("--container-mib needs --container")
    return args


def _without(argv: list[str], *options: str) -> list[str]:
    """``argv`` less ``options`` and their values (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(o + "=") for o in options):
            out.append(a)
    return out


def run_each_malloc(argv: list[str], settings: list[str]) -> dict[str, Any] | None:
    """The comparison once per glibc setting, each in a process of its own (a fork server has one
    environment), merged into one result whose rows carry their ``malloc``."""
    base = _without(argv, "--malloc", "--json")
    docs = []
    with tempfile.TemporaryDirectory(prefix="bp-peers-") as tmp:
        for m in settings:
            out = Path(tmp) / f"{m}.json"
            print(f"== malloc {m}", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), *base, "--malloc", m, "--json", str(out)],
                           check=True)
            doc = json.loads(out.read_text())
            if doc.get("skipped"):
                return None
            docs.append(doc)
    first = docs[0]
    return {**first, "command": "python benchmarks/peers.py " + " ".join(argv), "malloc": ",".join(settings),
            "truth": {d["malloc"]: d["truth"] for d in docs}, "rows": [r for d in docs for r in d["rows"]],
            "seconds": sum(d["seconds"] for d in docs)}


def _truth_text(result: dict[str, Any]) -> str:
    if "," not in result["malloc"]:
        return ", ".join(f"{m} {t['batch_size']}" for m, t in result["truth"].items())
    return "; ".join(f"{malloc}: " + ", ".join(f"{m} {t['batch_size']}" for m, t in truth.items())
                     for malloc, truth in result["truth"].items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        emit(_probe(spec) if spec["kind"] == "probe" else _measure(spec))
        return 0
    if len(args.malloc) > 1:
        result = run_each_malloc(list(sys.argv[1:] if argv is None else argv), args.malloc)
    else:
        result = run(args)
    if result is None:
        if args.json is not None:
            from batchpilot.app.report import write_json

            write_json({"benchmark": "peers", "container": True, "skipped": cgroup_unavailable_reason()}, args.json)
        return 0
    print()
    if result["container_mib"]:
        print(f"peers --container: each process in a fresh {result['container_mib']} MiB memory cgroup (no RLIMIT_AS; "
              f"past the limit the kernel kills), malloc {result['malloc']}, oneDNN/NNPACK "
              f"{'on' if result['conv_backends'] else 'off'}, torch {result['machine']['torch']}, {result['date']}")
    else:
        print(f"peers: cap {result['cap_mib']} MiB of address space per process (RLIMIT_AS), "
              f"malloc {result['malloc']}, oneDNN/NNPACK {'on' if result['conv_backends'] else 'off'}, batchpilot target {result['target']}, torch {result['machine']['torch']}, {result['date']}")
    print("true max: " + _truth_text(result))
    print(table(result["rows"], container=bool(result["container_mib"])))
    print(f"total {result['seconds']:.0f} s")
    if args.json is not None:
        from batchpilot.app.report import write_json

        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
