"""batchpilot's Lightning callback against Lightning's own ``BatchSizeFinder``, same module, same real cap.

Both are callbacks of a real ``lightning.Trainer`` on CPU that search at ``on_fit_start``
(``max_steps=0``: the fit ends after the search). Every (method, model) measurement is a fresh
process, forked from the server of ``benchmarks/peers.py``, that builds the model and its Adam
optimizer, warms up, runs one warm-up fit (Lightning's lazy set-up) and only then caps its
address space with ``RLIMIT_AS`` at what is mapped plus ``--cap-mib``: past it PyTorch raises its
real ``DefaultCPUAllocator`` error. The module is the one ``peers.py`` gives Lightning's Tuner
(same model, warmed-up optimizer, batch-at-a-time dataset, ``batch_size`` attribute starting at 2).

Methods:

- ``lightning-power`` / ``lightning-binsearch``: ``BatchSizeFinder(mode=...)`` with its defaults
  (``init_val=2``, ``steps_per_trial=3``, ``max_trials=25``, ``margin=0.05``, ``max_val=8192``).
- ``batchpilot-callback``: ``BatchSizeCallback(capacity=C, target=1.0)``, ``C`` the cap plus the
  bytes that exist before it (as ``peers.py`` gives ``find_batch_size``): the peers' goal, the
  largest batch that runs.
- ``batchpilot-callback (no capacity)``: told nothing; it must find the real limit itself.

"True max" is ``peers.py``'s (cached in ``benchmarks/.cache/peers_truth.json``). Trials are calls
of Lightning's ``_try_loop_run`` (observed, not changed) or the finder's trials; OOMs are trials
that ended in the real allocator error; seconds are the search alone (``on_fit_start``).

    python benchmarks/integrations.py                 # 3 models, 64 MiB
    python benchmarks/integrations.py --quick         # the small MLP, 16 MiB: a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402
from _harness import BENCH_MODELS, ForkRunner, is_allocator_oom, machine, passthrough  # noqa: E402

MiB = 2**20
METHODS = ("batchpilot-callback", "batchpilot-callback (no capacity)", "lightning-power", "lightning-binsearch")
REFERENCE = "lightning-power"
COLUMNS = ("method", "model", "found", "found/true", "trials", "OOMs", "seconds", "÷ lightning-power", "fit trains",
           "outcome")
# the fork server of peers.py, which also imports this module and the callback
peers._preload = peers.PRELOAD + ("integrations", "batchpilot.integrations.lightning")


def _fork(function: str, spec: dict[str, Any], timeout: float = 900) -> Any:
    malloc = spec["setting"]["malloc"]
    if malloc not in peers._runners:
        peers._runners[malloc] = ForkRunner(peers._preload, malloc=malloc)
    return peers._runners[malloc]("integrations", function, spec, timeout=timeout)


# ---------------------------------------------------------------------------
# the child: one measurement in a fresh process


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    import logging
    import tempfile
    import warnings

    import lightning as L
    import lightning.pytorch.tuner.batch_size_scaling as scaling
    from lightning.pytorch.callbacks import BatchSizeFinder
    from torch.utils.data import DataLoader

    from batchpilot.integrations.lightning import BatchSizeCallback

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    w, setting = peers._prepare(spec)
    method = spec["method"]

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
            return w.optimizer  # warmed up: its state exists before the cap, as for every method

    root = tempfile.mkdtemp(prefix="bp-integrations-")

    trainers: list[Any] = []

    def fit(callbacks: list, max_steps: int) -> Module:
        module = Module()
        trainers.append(L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  default_root_dir=root, callbacks=callbacks))
        trainers[-1].fit(module)
        return module

    runs: list[list[Any]] = []
    timing: dict[str, float] = {}

    if method.startswith("lightning"):
        base = BatchSizeFinder
        kwargs: dict[str, Any] = {"mode": method.split("-")[1]}
        try_loop_run = scaling._try_loop_run

        def observed(trainer: Any, params: Any) -> None:
            b = trainer.lightning_module.batch_size
            try:
                try_loop_run(trainer, params)
            except BaseException as exc:
                runs.append([b, "oom" if is_allocator_oom(exc) else "error"])
                raise
            runs.append([b, "ok"])

        scaling._try_loop_run = observed
    else:
        base = BatchSizeCallback
        capacity = None if "no capacity" in method else setting.cap_mib * MiB + w.state_bytes()
        kwargs = {"target": spec["target"], "capacity": capacity}

    class Timed(base):  # type: ignore[misc, valid-type]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            t0 = time.perf_counter()
            try:
                super().on_fit_start(trainer, pl_module)
                timing["searched"] = True  # the fit goes on from here: the training after the search
            finally:
                timing["seconds"] = time.perf_counter() - t0

    fit([], 1)  # Lightning's lazy imports and one-time set-up are not the search
    w.optimizer.zero_grad(set_to_none=True)
    callback = Timed(**kwargs)
    peers._cap(setting)
    found, outcome, train_error = None, "ok", None
    try:
        # the fit goes on at the answer after the search: it must train, in the process that searched
        fit([callback], peers.AFTER_STEPS)
    except BaseException as exc:  # reported as the row's outcome, never hidden
        if timing.get("searched"):
            train_error = peers._crashed(exc)  # the search answered; the training at its answer failed
        else:
            outcome = peers._crashed(exc)
    if timing.get("searched"):
        if method.startswith("lightning"):
            found = callback.optimal_batch_size
        else:
            setup = callback.setup
            found = setup.found_batch_size
            for t in setup.plan.trials:
                real = t.outcome == "oom" and "DefaultCPUAllocator" in (t.message or "")
                runs.append([t.batch_size, "oom" if real else ("emulated_oom" if t.outcome == "oom" else "ok")])
    trained = trainers[-1].global_step if timing.get("searched") else None
    return {"found": found, "runs": runs, "seconds": timing.get("seconds"), "outcome": outcome,
            "trained": trained, "train_error": train_error}


# ---------------------------------------------------------------------------
# the parent


def measure(method: str, model: str, setting: peers.Setting, truth: int, target: float) -> dict[str, Any]:
    spec = {"method": method, "model": model, "setting": asdict(setting), "target": target}
    r = _fork("_measure", spec)
    if r.ok:
        row = r.data
    else:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        row = {"found": None, "runs": None, "seconds": None, "outcome": f"failed: {last[:100]}", "error": r.stderr}
    row.update(method=method, model=model, true_max=truth)
    runs = row.get("runs")
    if runs is not None:
        row["trials"] = len(runs)
        row["ooms"] = sum(kind == "oom" for _, kind in runs)
        ran = [b for b, kind in runs if kind == "ok"]
        if row.get("found") and row["outcome"] == "ok" and (not ran or row["found"] > max(ran)):
            row["outcome"] = "returned an untried size"
    row["found_over_true"] = row["found"] / truth if row.get("found") and truth else None
    return row


def table(rows: list[dict[str, Any]]) -> str:
    from batchpilot.app.report import format_table

    f = peers._fmt
    return format_table(COLUMNS, [
        (r["method"], r["model"], f(r.get("found")), f(r.get("found_over_true")), f(r.get("trials")),
         f(r.get("ooms")), f(r.get("seconds"), 1), f(r.get("vs_peer")), peers._trained(r), r.get("outcome", ""))
        for r in rows
    ])


def run(args: argparse.Namespace) -> dict[str, Any]:
    models = args.models or (["mlp"] if args.quick else list(BENCH_MODELS))
    methods = args.methods or list(METHODS)
    cap = args.cap_mib if args.cap_mib is not None else (16 if args.quick else 64)
    setting = peers.Setting(cap_mib=cap, quick=args.quick, malloc=args.malloc, conv_backends=args.conv_backends)
    t0 = time.perf_counter()
    truth, rows = {}, []
    for model in models:
        print(f"[{model}] true max under {cap} MiB ...", flush=True)
        truth[model] = peers.true_max(model, setting, use_cache=not args.no_cache)
        model_rows = []
        for method in methods:
            print(f"[{model}] {method} ...", flush=True)
            model_rows.append(measure(method, model, setting, truth[model]["batch_size"], args.target))
        ref = next((r for r in model_rows if r["method"] == REFERENCE and r.get("seconds")), None)
        for r in model_rows:
            r["vs_peer"] = r["seconds"] / ref["seconds"] if ref and r.get("seconds") is not None else None
        rows += model_rows
    return {
        "benchmark": "integrations",
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/integrations.py " + " ".join(sys.argv[1:]),
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
    p.add_argument("--quick", action="store_true", help="the small MLP under a 16 MiB cap: a smoke test")
    p.add_argument("--target", type=float, default=1.0, help="batchpilot's target fraction of the capacity (default 1.0)")
    p.add_argument("--malloc", choices=peers.MALLOC_SETTINGS, default="fixed",
                   help="glibc mmap threshold in the measured processes (see peers.py; default fixed)")
    p.add_argument("--conv-backends", action="store_true", help="leave oneDNN and NNPACK on (off by default)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--no-cache", action="store_true", help="recompute the true max (and do not store it)")
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
    try:
        import lightning  # noqa: F401
    except ImportError:
        print("integrations: skipped, Lightning is not installed (pip install -e '.[integrations]')", flush=True)
        return 0
    result = run(args)
    print()
    print(f"integrations: Lightning callbacks at on_fit_start, cap {result['cap_mib']} MiB of address space per process "
          f"(RLIMIT_AS), malloc {result['malloc']}, oneDNN/NNPACK {'on' if result['conv_backends'] else 'off'}, "
          f"batchpilot target {result['target']}, "
          f"torch {result['machine']['torch']}, {result['date']}")
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
