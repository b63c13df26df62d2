"""The planner: fake-tensor estimates against the CPU tracker, and their cost.

Two tables, one command:

1. *Estimates*: per reference model and batch size (up to 65536), the seconds one
   fake estimate takes, the estimated peak, and for small batches the CPU tracker's
   measured peak of the same two real steps with the difference (must be 0). The
   CUDA columns are the allocator model's predictions for an H100 (allocated,
   reserved): predictions only, to be checked by the GPU validation script.
2. *Plans*: the planned batch for a named GPU and for a CPU capacity, the number of
   fake runs and the seconds the whole plan took.
3. *Sharded plans*: one rank of 64 (FSDP2 over a fake process group) for an H100, for a GPT of
   about 1B parameters built on the meta device (a GPT-2-small-sized one with ``--quick``): the
   per-rank batch, its breakdown, the fake runs, wall and CPU seconds.

The planner-seeded finder (``find_batch_size_for(plan_first=True)``) is compared with
the finder alone in ``benchmarks/finder.py --plan-first``.

Times on a shared 2-core machine are noisy: compare them within one run.

    python benchmarks/planner.py                 # everything
    python benchmarks/planner.py --quick         # batches up to 4096
    python benchmarks/planner.py --json out.json
    python benchmarks/planner.py --sharded-only  # table 3 alone (the ~1B model at world 64)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from batchpilot.app.models import MODEL_NAMES, TinyGPT, build_model, example_batch, lm_loss, padded_lm_batch
from batchpilot.memory.probes import track_peak
from batchpilot.memory.units import format_bytes
from batchpilot.plan.gpus import CudaAccounting
from batchpilot.plan.planner import default_step, estimate_peak_memory, plan_batch_size

BATCHES = (1, 16, 256, 4096, 65536)
REAL_UP_TO = 256  # real CPU steps beyond this take too long for a benchmark run


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def real_peak(name: str, b: int) -> int:
    torch.manual_seed(0)
    model = build_model(name)
    opt = adam(model.parameters())
    batch = example_batch(model, b)
    with track_peak("cpu", track=(model, opt, batch)) as m:
        for _ in range(2):
            default_step(model, opt, batch)
    return m.peak_bytes


def estimates_table(batches: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    h100 = CudaAccounting.for_gpu("H100-80GB")
    for name in MODEL_NAMES:
        model = build_model(name)
        sample = example_batch(model, 2)
        estimate_peak_memory(model, sample, 2, optimizer=adam)  # warm-up: imports, first dispatch
        for b in batches:
            cpu = estimate_peak_memory(model, sample, b, optimizer=adam)
            cuda = estimate_peak_memory(model, sample, b, optimizer=adam, device="cuda", accounting=h100)
            real = real_peak(name, b) if b <= REAL_UP_TO else None
            rows.append({
                "model": name, "batch": b, "fake_seconds": round(cpu.seconds, 3), "estimate_bytes": cpu.peak_bytes,
                "tracker_bytes": real, "difference": None if real is None else cpu.peak_bytes - real,
                "cuda_allocated": cuda.allocated_bytes, "cuda_reserved": cuda.reserved_bytes,
                "activations": cpu.activations,
            })
    return rows


def plans_table() -> list[dict[str, Any]]:
    rows = []
    for name in MODEL_NAMES:
        model = build_model(name)
        sample = example_batch(model, 2)
        for capacity in ("H100-80GB", "24GiB"):
            plan = plan_batch_size(model, sample, optimizer=adam, capacity=capacity)
            rows.append({
                "model": name, "capacity": capacity, "device": plan.device, "batch": plan.batch_size,
                "fake_runs": len(plan.evaluations), "seconds": round(plan.seconds, 2),
                "required_at_b": plan.estimate.required_bytes, "limit": plan.limit,
            })
    return rows


#: (name, vocab, dim, heads, layers, sequence): ~1.0B parameters, and a GPT-2-small-sized one for --quick
SHARDED_MODELS = {"gpt-1b": (32000, 2048, 16, 18, 1024), "gpt-124m": (50257, 768, 12, 12, 1024)}


def sharded_table(names: list[str], world: int = 64) -> list[dict[str, Any]]:
    """One rank of ``world`` sharding with FSDP2, planned for an H100 (bf16 autocast, AdamW)."""
    rows = []
    for name in names:
        vocab, dim, heads, layers, seq = SHARDED_MODELS[name]
        with torch.device("meta"):  # no real weights: a 1B model would take 4 GB to build
            model = TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, max_len=seq)
        sample = padded_lm_batch([seq, seq], vocab=vocab)
        wall, cpu = time.perf_counter(), time.process_time()
        plan = plan_batch_size(model, sample, capacity="H100-80GB", optimizer=lambda ps: torch.optim.AdamW(ps),
                               loss_fn=lm_loss, amp="bf16", world_size=world, sharding="fsdp2")
        est = plan.estimate
        rows.append({
            "model": name, "params": sum(p.numel() for p in model.parameters()), "world": world,
            "batch": plan.batch_size, "fake_runs": len(plan.evaluations),
            "seconds": round(time.perf_counter() - wall, 1), "cpu_seconds": round(time.process_time() - cpu, 1),
            "required_at_b": est.required_bytes, "shards": est.parameters + est.gradients + est.optimizer_state,
            "unsharded": est.unsharded_parameters, "communication": est.communication,
            "activations": est.activations, "limit": plan.limit,
        })
    return rows


_BYTE_COLUMNS = ("estimate_bytes", "tracker_bytes", "cuda_allocated", "cuda_reserved", "required_at_b", "limit",
                 "shards", "unsharded", "communication", "activations")


def _fmt(column: str, v: Any) -> str:
    if v is None:
        return "-"
    if column in _BYTE_COLUMNS:
        return f"{v} ({format_bytes(v)})" if v < 1 << 24 else format_bytes(v)
    return str(v)


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        print("| " + " | ".join(_fmt(c, r[c]) for c in columns) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batches up to 4096")
    p.add_argument("--json", type=Path, help="also write the tables as JSON")
    p.add_argument("--sharded-only", action="store_true", help="only the sharded plans (table 3)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # one thread: comparable times on a shared machine

    batches = BATCHES[:-1] if args.quick else BATCHES
    est, plans = [], []
    if not args.sharded_only:
        est = estimates_table(batches)
        print_table("Fake estimates (Adam, 2 steps) vs the CPU tracker; CUDA columns: H100 allocator model",
                    est, ["model", "batch", "fake_seconds", "estimate_bytes", "tracker_bytes", "difference",
                          "cuda_allocated", "cuda_reserved"])
        plans = plans_table()
        print_table("Plans (target 0.8)", plans,
                    ["model", "capacity", "device", "batch", "fake_runs", "seconds", "required_at_b", "limit"])
    sharded = sharded_table(["gpt-124m"] if args.quick else ["gpt-1b"])
    print_table("Sharded plans: one rank of 64, FSDP2 on a fake process group, H100-80GB, bf16, AdamW, "
                "sequence 1024", sharded, ["model", "params", "world", "batch", "fake_runs", "seconds", "cpu_seconds",
                                           "required_at_b", "shards", "unsharded", "communication", "activations"])
    bad = [r for r in est if r["difference"] not in (None, 0)]
    if bad:
        print(f"\nMISMATCH: {len(bad)} estimates differ from the tracker", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"estimates": est, "plans": plans, "sharded": sharded}, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
