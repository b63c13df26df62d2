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
- ``lightning-power`` / ``lightning-binsearch``: ``Tuner.scale_batch_size`` with its
  defaults (``init_val=2``, ``steps_per_trial=3``, ``max_trials=25``, ``margin=0.05``,
  ``max_val=8192``) on a LightningModule wrapping the same model, optimizer and data.
- ``accelerate``: ``find_executable_batch_size`` from 4x the true max (x0.9 per OOM).

"True max" is the largest batch that trains 2 steps (forward, backward, Adam) under the
same cap, found by bisection with every probe in a fresh process, cached in
``benchmarks/.cache/peers_truth.json`` keyed by model, configuration, cap, allocator settings,
torch version and harness version. Method, counting and results: benchmarks/README.md.

    python benchmarks/peers.py                       # 3 models, 64 MiB
    python benchmarks/peers.py --quick               # 1 small model, 16 MiB: a smoke test
    python benchmarks/peers.py --models cnn --cap-mib 256 --json peers.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
    passthrough,
    store_cache,
)

MiB = 2**20
TRUTH_CACHE = CACHE_DIR / "peers_truth.json"
TRUTH_STEPS = 2
# Bump when the harness changes what a probe allocates (data pipeline, warm-up): cached truths then expire.
HARNESS_VERSION = 4
BATCHPILOT = ("batchpilot-predict", "batchpilot-power", "batchpilot-binsearch")
LIGHTNING = ("lightning-power", "lightning-binsearch")
METHODS = (*BATCHPILOT, "batchpilot-predict@0.8", *LIGHTNING, "accelerate")
QUICK_METHODS = (*BATCHPILOT, *LIGHTNING, "accelerate")
REFERENCE = "batchpilot-predict"
COLUMNS = ("method", "model", "found", "found/true", "trials", "OOMs", "emulated", "seconds", "x predict", "outcome")
# Imported once by the fork server, so that every measurement starts with them loaded.
PRELOAD = ("torch", "_harness", "peers", "batchpilot.find", "batchpilot.app.report", "lightning",
           "lightning.pytorch.tuner", "accelerate", "accelerate.utils")
_runners: dict[str, ForkRunner] = {}


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
    """

    cap_mib: int
    quick: bool = False
    malloc: str = "fixed"
    conv_backends: bool = False


def _crashed(exc: BaseException) -> str:
    """A row's outcome for a method that raised: the error's type and first line."""
    first = str(exc).splitlines()[0][:80] if str(exc) else ""
    return f"crashed: {type(exc).__name__}: {first}"


def _fork(function: str, spec: dict[str, Any], timeout: float = 900) -> Any:
    malloc = spec["setting"]["malloc"]
    if malloc not in _runners:
        _runners[malloc] = ForkRunner(PRELOAD, malloc=malloc)
    return _runners[malloc]("peers", function, spec, timeout=timeout)


# ---------------------------------------------------------------------------
# children: one measurement each, in a fresh process


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
    """Does ``batch`` train ``TRUTH_STEPS`` steps under the cap?"""
    w, setting = _prepare(spec)
    cap_address_space(setting.cap_mib * MiB)
    try:
        for _ in range(TRUTH_STEPS):
            w.train_step(spec["batch"])
    except RuntimeError as exc:
        if not is_allocator_oom(exc):
            raise
        return {"ok": False}
    return {"ok": True}


def _batchpilot(w: Workload, setting: Setting, spec: dict[str, Any]) -> dict[str, Any]:
    from batchpilot.find import find_batch_size

    strategy = spec["method"].split("-", 1)[1].split("@")[0]
    target = float(spec["method"].split("@")[1]) if "@" in spec["method"] else spec["target"]
    capacity = setting.cap_mib * MiB + w.state_bytes()
    log = CallLog(w.train_step)
    cap_address_space(setting.cap_mib * MiB)
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

    def observed(trainer: Any, params: Any) -> None:
        b = trainer.lightning_module.batch_size
        try:
            try_loop_run(trainer, params)
        except BaseException as exc:
            runs.append([b, "oom" if is_allocator_oom(exc) else "error"])
            raise
        runs.append([b, "ok"])

    root = tempfile.mkdtemp(prefix="bp-peers-")

    def trainer(**kw: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, **kw)

    # Warm-up fit before the cap: Lightning's lazy imports and one-time set-up are not the search.
    trainer(max_steps=1).fit(Module())
    module, tuner_trainer = Module(), trainer()
    mode = spec["method"].split("-", 1)[1]
    scaling._try_loop_run = observed
    cap_address_space(setting.cap_mib * MiB)
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

    @find_executable_batch_size(starting_batch_size=spec["start"])
    def train(batch_size: int) -> int:
        loader = iter(DataLoader(w.dataset, batch_size=batch_size, collate_fn=passthrough))
        try:
            for _ in range(TRUTH_STEPS):
                batch = next(loader)
                w.optimizer.zero_grad(set_to_none=True)
                w.loss(batch).backward()
                w.optimizer.step()
        except BaseException as exc:
            calls.append((batch_size, "oom" if is_allocator_oom(exc) else "error"))
            raise
        calls.append((batch_size, "ok"))
        return batch_size

    clear_device_cache(garbage_collection=True)  # its first call imports and probes backends: before the cap
    cap_address_space(setting.cap_mib * MiB)
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


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    method = spec["method"]
    if method.startswith("lightning"):
        import lightning  # noqa: F401  imported before the cap, as a user's script would
    if method == "accelerate":
        import accelerate  # noqa: F401
    w, setting = _prepare(spec)
    if method.startswith("batchpilot"):
        return _batchpilot(w, setting, spec)
    if method.startswith("lightning"):
        return _lightning(w, setting, spec)
    if method == "accelerate":
        return _accelerate(w, setting, spec)
    raise ValueError(f"unknown method {method!r}")


# ---------------------------------------------------------------------------
# parent: truth, measurements, table


def _truth_key(model: str, setting: Setting) -> str:
    import torch

    cfg = (QUICK_MODELS if setting.quick else BENCH_MODELS)[model]
    return json.dumps({"model": model, "config": cfg, **asdict(setting), "steps": TRUTH_STEPS,
                       "torch": torch.__version__, "harness": HARNESS_VERSION}, sort_keys=True)


def _guess(model: str, cap_mib: int, quick: bool) -> int:
    """A starting point for the bisection: tracked peak at two small batches, solved for the cap."""
    import torch

    from batchpilot.memory import track_peak

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
    """Largest batch that trains under the cap, by bisection over fresh-process probes (cached)."""
    key = _truth_key(model, setting)
    cache = load_cache(TRUTH_CACHE) if use_cache else {}
    if key in cache:
        return {**cache[key], "cached": True}
    t0 = time.perf_counter()
    probes: dict[int, bool] = {}

    def fits(b: int) -> bool:
        spec = {"kind": "probe", "model": model, "batch": b, "setting": asdict(setting)}
        r = _fork("_probe", spec, timeout=600)
        if not r.ok:
            raise RuntimeError(f"truth probe {model} b={b} failed (rc {r.returncode}):\n{r.stderr}")
        probes[b] = r.data["ok"]
        return probes[b]

    g = _guess(model, setting.cap_mib, setting.quick)
    lo = largest_fitting(fits, g, shrink=1.5)
    doc = {"batch_size": lo, "probes": dict(sorted((str(k), v) for k, v in probes.items())),
           "seconds": time.perf_counter() - t0, "guess": g}
    log(f"  true max {model} @ {setting.cap_mib} MiB: {lo} ({len(probes)} fresh-process probes, {doc['seconds']:.0f} s)")
    if use_cache:
        cache = load_cache(TRUTH_CACHE)
        cache[key] = doc
        store_cache(TRUTH_CACHE, cache)
    return {**doc, "cached": False}


def measure(method: str, model: str, setting: Setting, truth: int, *, target: float = 1.0,
            start_factor: float = 4.0, timeout: float = 900) -> dict[str, Any]:
    spec = {"kind": "measure", "method": method, "model": model, "setting": asdict(setting),
            "target": target, "start": max(2, int(start_factor * truth))}
    r = _fork("_measure", spec, timeout=timeout)
    if r.ok:
        row = r.data
    else:  # an error outside the method, or a process killed outside Python's reach: still a row
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        row = {"found": None, "trials": None, "ooms": None, "seconds": None, "outcome": f"failed: {last[:100]}",
               "error": r.stderr}
    row.update(method=method, model=model, true_max=truth)
    runs = row.get("runs")
    if runs is not None:
        row["trials"] = len(runs)
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
    return round(v, digits) if isinstance(v, float) else v


def table(rows: list[dict[str, Any]]) -> str:
    from batchpilot.app.report import format_table

    return format_table(COLUMNS, [
        (r["method"], r["model"], _fmt(r.get("found")), _fmt(r.get("found_over_true")), _fmt(r.get("trials")),
         _fmt(r.get("ooms")), _fmt(r.get("emulated")), _fmt(r.get("seconds"), 1), _fmt(r.get("relative")), r.get("outcome", ""))
        for r in rows
    ])


def run(args: argparse.Namespace) -> dict[str, Any]:
    models = args.models or (["mlp"] if args.quick else list(BENCH_MODELS))
    methods = args.methods or list(QUICK_METHODS if args.quick else METHODS)
    cap = args.cap_mib if args.cap_mib is not None else (16 if args.quick else 64)
    setting = Setting(cap_mib=cap, quick=args.quick, malloc=args.malloc, conv_backends=args.conv_backends)
    t0 = time.perf_counter()
    truth, rows = {}, []
    for model in models:
        print(f"[{model}] true max under {cap} MiB ...", flush=True)
        truth[model] = true_max(model, setting, use_cache=not args.no_cache)
        tm = truth[model]["batch_size"]
        model_rows = []
        for method in methods:
            print(f"[{model}] {method} ...", flush=True)
            row = measure(method, model, setting, tm, target=args.target, start_factor=args.accelerate_start)
            model_rows.append(row)
        ref = next((r for r in model_rows if r["method"] == REFERENCE and r.get("seconds")), None)
        for r in model_rows:
            r["relative"] = r["seconds"] / ref["seconds"] if ref and r.get("seconds") is not None else None
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
    p.add_argument("--models", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated, from {','.join(BENCH_MODELS)} (default all; --quick: mlp)")
    p.add_argument("--methods", type=lambda s: s.split(","), default=None, help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--quick", action="store_true", help="smaller models, 16 MiB cap, one model (mlp): a smoke test")
    p.add_argument("--target", type=float, default=1.0, help="batchpilot's target fraction of the capacity (default 1.0)")
    p.add_argument("--accelerate-start", type=float, default=4.0, help="accelerate's starting batch, x true max (default 4)")
    p.add_argument("--malloc", choices=("fixed", "dynamic"), default="fixed",
                   help="glibc mmap threshold: fixed at 128 KiB (default) or glibc's history-dependent default")
    p.add_argument("--conv-backends", action="store_true",
                   help="leave oneDNN and NNPACK on (off by default; see Setting.conv_backends)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--no-cache", action="store_true", help="recompute the true max (and do not store it)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for m in args.methods or ():
        if m not in METHODS:
            p.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    for m in args.models or ():
        if m not in BENCH_MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(BENCH_MODELS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        emit(_probe(spec) if spec["kind"] == "probe" else _measure(spec))
        return 0
    result = run(args)
    print()
    print(f"peers: cap {result['cap_mib']} MiB of address space per process (RLIMIT_AS), "
          f"malloc {result['malloc']}, oneDNN/NNPACK {'on' if result['conv_backends'] else 'off'}, batchpilot target {result['target']}, torch {result['machine']['torch']}, {result['date']}")
    print("true max: " + ", ".join(f"{m} {t['batch_size']}" for m, t in result["truth"].items()))
    print(table(result["rows"]))
    print(f"total {result['seconds']:.0f} s")
    if args.json is not None:
        from batchpilot.app.report import write_json

        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
