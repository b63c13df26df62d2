"""torch.compile on CPU: the compiled program's memory and batch against the eager one's.

One fresh process per model and program (eager, then ``torch.compile`` with each of
``--backends``: inductor, and ``aot_eager_decomp_partition``, which runs AOT autograd's
min-cut-partitioned forward and backward graphs (inductor's decompositions and partitioner)
op by op without fusing them: what a planner following the compiled graph would count), each
doing the same three things:

1. warm-up: one training step at batch 2 with the batch dimension marked dynamic, as the
   finder's warm-up does (the compilation happens here: seconds and graphs are reported);
2. peak at ``--batch``: two AdamW steps measured by the CPU allocator itself
   (``torch.profiler``'s allocation records, which see inductor's buffers and eager kernels'
   scratch alike), added to the bytes of the state that exists before (parameters, buffers,
   Adam's moments, the batch); next to it the planner's estimate, which plans the eager
   program for compiled models too;
3. found batch: ``find_batch_size_for`` on the process's real memory under an address-space
   cap of ``--cap-mib`` MiB set after the warm-up (``RLIMIT_AS``, the real-memory finder's
   ``rlimit_as`` limit) at target 1.0 (the largest batch that fits: the runtime itself takes a
   few hundred MiB of the resident set), with the graphs dynamo compiled during the search.

oneDNN and NNPACK are off in every child, as in ``peers.py``: they allocate outside PyTorch and
crash under the cap. Times are noisy on a shared machine, and inductor's guards (hence the
graphs counted) depend on what its on-disk cache already holds.

    python benchmarks/compiled.py                       # the reference models
    python benchmarks/compiled.py --quick               # smaller models
    python benchmarks/compiled.py --backends aot_eager --models mlp
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import BENCH_MODELS, QUICK_MODELS, allocator_peak, cap_address_space, child_env, machine  # noqa: E402

from batchpilot.app.report import format_table, write_json  # noqa: E402
from batchpilot.memory.units import format_bytes  # noqa: E402

MiB = 2**20
COLUMNS = ("model", "program", "compile s", "graphs", "peak @b (allocator)", "plan @b", "plan / peak",
           "found", "trials", "search graphs", "found / eager")


# ---------------------------------------------------------------------------
# the child: one model, one program


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> int:
    """Bytes of the distinct storages alive before a step: weights, buffers, optimizer state, the batch."""
    tensors = [*model.parameters(), *model.buffers(), *batch]
    tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from batchpilot.core.compiled import CompileCounter, mark_batch_dynamic
    from batchpilot.find.front import find_batch_size_for
    from batchpilot.app.models import build_model, example_batch
    from batchpilot.plan.planner import estimate_peak_memory

    torch.set_num_threads(1)
    # oneDNN and NNPACK allocate outside PyTorch's allocator and crash under RLIMIT_AS (SIGSEGV:
    # benchmarks/README.md, peers --conv-backends; seen here too with inductor's oneDNN convolutions)
    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)
    torch.manual_seed(0)
    cfg = spec["model_spec"]
    net = build_model(cfg["model"], **cfg["kwargs"])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    backend = spec["backend"]
    model = net if backend == "eager" else torch.compile(net, backend=backend)
    loss_fn = nn.CrossEntropyLoss()

    def step(batch: Any) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batch[0]), batch[1]).backward()
        opt.step()

    out: dict[str, Any] = {"model": spec["model"], "program": backend}
    counter = CompileCounter()
    t0 = time.perf_counter()
    step(mark_batch_dynamic(example_batch(net, 2)))
    out["compile_seconds"] = time.perf_counter() - t0
    out["warmup_graphs"] = counter.count

    b = spec["batch"]
    batch = mark_batch_dynamic(example_batch(net, b))
    opt.zero_grad(set_to_none=True)
    state = _state_bytes(net, opt, batch)
    counter = CompileCounter()
    out["peak_bytes"] = state + allocator_peak(lambda: (step(batch), step(batch)))
    out["peak_graphs"] = counter.count
    sample = example_batch(net, 2)
    est = estimate_peak_memory(model, sample, b, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                               loss_fn=loss_fn)
    out["plan_bytes"] = est.peak_bytes
    del batch

    pool = example_batch(net, 64)
    opt.zero_grad(set_to_none=True)
    cap_address_space(spec["cap_mib"] * MiB)
    plan = find_batch_size_for(model, pool, optimizer=opt, loss_fn=loss_fn, max_batch_size=spec["max_batch_size"],
                               target=1.0)
    out.update(found=plan.batch_size, trials=plan.num_trials, ooms=plan.num_ooms, search_graphs=plan.compilations,
               compiled_trials=plan.compiled_trials, search_seconds=plan.seconds, stop_reason=plan.stop_reason,
               sizes=[t.batch_size for t in plan.trials])
    return out


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"model": spec["model"], "program": spec["backend"],
                "error": f"child exited with {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------


def row(r: dict[str, Any], eager: dict[str, Any] | None) -> tuple:
    if "error" in r:
        return (r["model"], r["program"], "-", "-", "-", "-", "-", "-", "-", "-", r["error"][:80])
    ratio = f"{r['found'] / eager['found']:.2f}" if eager and "error" not in eager and eager["found"] else "-"
    graphs = f"{r['warmup_graphs']} + {r['peak_graphs']}"
    return (r["model"], r["program"], f"{r['compile_seconds']:.1f}", graphs, format_bytes(r["peak_bytes"]),
            format_bytes(r["plan_bytes"]), f"{r['plan_bytes'] / r['peak_bytes']:.2f}", r["found"], r["trials"],
            r["search_graphs"], ratio)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--models", type=lambda s: s.split(","), default=["mlp", "cnn", "transformer"])
    p.add_argument("--backends", type=lambda s: s.split(","), default=["inductor", "aot_eager_decomp_partition"],
                   help="torch.compile backends to compare with eager (default inductor,aot_eager_decomp_partition)")
    p.add_argument("--batch", type=int, default=None, help="batch of the peak column (default 256; quick 64)")
    p.add_argument("--cap-mib", type=int, default=None,
                   help="address-space headroom for the finder, MiB (default 256; quick 64)")
    p.add_argument("--max-batch-size", type=int, default=1 << 14)
    p.add_argument("--quick", action="store_true", help="the smaller models of benchmarks/_harness.py")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child (compiling is slow on CPU)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    table = QUICK_MODELS if args.quick else BENCH_MODELS
    for m in args.models:
        if m not in table:
            p.error(f"unknown model {m!r}; choose from {', '.join(table)}")
    batch = args.batch or (64 if args.quick else 256)
    cap = args.cap_mib or (64 if args.quick else 256)
    started = time.perf_counter()
    results, rows = [], []
    for name in args.models:
        eager = None
        for program in ("eager", *args.backends):
            spec = {"model": name, "model_spec": table[name], "backend": program, "batch": batch, "cap_mib": cap,
                    "max_batch_size": args.max_batch_size}
            r = run_child(spec, args.timeout)
            results.append(r)
            rows.append(row(r, eager))
            print("  ".join(str(v) for v in rows[-1]), flush=True)
            eager = r if program == "eager" else eager
    seconds = time.perf_counter() - started
    head = (f"compiled vs eager on CPU, AdamW, peak at batch {batch}, finder under "
            f"RLIMIT_AS +{cap} MiB, torch {torch.__version__}, {datetime.date.today().isoformat()}")
    print()
    print(head)
    print(format_table(COLUMNS, rows))
    print(f"total {seconds:.0f} s")
    if args.json is not None:
        write_json({"benchmark": "compiled", "date": datetime.date.today().isoformat(),
                    "command": "python benchmarks/compiled.py " + " ".join(sys.argv[1:]), "machine": machine(),
                    "backends": args.backends, "batch": batch, "cap_mib": cap, "results": results,
                    "rows": [dict(zip(COLUMNS, r)) for r in rows], "seconds": seconds}, args.json)
        print(f"wrote {args.json}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
