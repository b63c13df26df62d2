"""``batchpilot find``: measure the largest batch that fits, on the device (or an emulated one)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

from ...dist.front import find_batch_size_for
from ...memory.units import format_bytes
from .. import report
from .common import (
    UsageError, add_find_options, add_length_options, add_model_options, add_verbose, device_or_fail,
    find_options_of,
)
from .workload import Workload

__all__ = ["add_parser", "run", "find_document"]
_STOPS = {
    "boundary": "exact: one more sample does not fit",
    "tolerance": "within 2% of the boundary, as close as real memory can be measured",
    "max_batch_size": "capped by --max-batch-size",
    "strategy": "where the strategy stops, not necessarily the boundary",
    "max_trials": "stopped after the most trials allowed",
    "plateau": "memory stopped growing with the batch: set --max-batch-size",
}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "find",
        help="measure the largest batch that fits on the device (or an emulated one)",
        description="Run real training steps at a few batch sizes and report the largest whose steady-state "
                    "peak memory (optimizer state included) stays under target x capacity. Model, optimizer and "
                    "RNG state are restored afterwards.",
    )
    add_model_options(p)
    d = p.add_argument_group("device")
    d.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the accelerator if any, else cpu)")
    add_find_options(d, ["capacity"], notes={
        "capacity": "on CPU an emulated device that raises a real OutOfMemoryError past it, on CUDA a per-process "
                    "memory fraction; on CPU without it, with --max-batch-size, the process's resident memory "
                    "against its container limit, RLIMIT_AS or free RAM, whichever is tightest"})
    add_find_options(p, ["target", "max_batch_size"])
    add_length_options(p)
    s = p.add_argument_group("search")
    add_find_options(s, ["strategy", "min_batch_size", "steps_per_trial"], notes={
        "strategy": "power and binsearch are Lightning's, decay is timm's"})
    s.add_argument("--plan-first", action="store_true",
                   help="plan the first real trial on fake tensors (one planning pass, no device memory), then "
                        "verify it: fewer real trials and OOMs where trials are expensive (GPUs); falls back "
                        "to an unseeded search if the model cannot be planned")
    s.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="size the torch.compile'd model (backend inductor unless named, e.g. aot_eager): its "
                        "trials run the compiled step on real memory (a GPU, or a CPU without --capacity); under "
                        "an emulated CPU capacity they run eagerly")
    s.add_argument("--seed", type=int, default=0, help="seed of the model weights and random inputs (default: %(default)s)")
    v = p.add_argument_group("speed")
    add_find_options(v, ["objective", "speed_tolerance", "timed_steps"], notes={
        "objective": "the throughput search times a few sizes below the largest that fits",
        "speed_tolerance": "0.05 is DeepSpeed's plateau rule"})
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="also write a PNG of peak memory and samples/s against batch size, the chosen one marked")
    p.add_argument("--json", action="store_true", help="print only the JSON plan on stdout")
    add_find_options(p, ["progress"])
    add_verbose(p)
    p.set_defaults(handler=run)
    return p


def find_document(workload: Workload, plan: Any, device: torch.device) -> dict[str, Any]:
    """The ``find`` JSON document (schema in :mod:`batchpilot.app.report`)."""
    return {
        "schema_version": report.SCHEMA_VERSION,
        "command": "find",
        **workload.describe(),
        "device": str(device),
        **report.plan_record(plan),
        **report.length_record(plan if getattr(plan, "length_plans", None) else None),
    }


def _human(doc: dict[str, Any]) -> str:
    lines = [
        f"find for {doc['model']} with input {'x'.join(map(str, doc['input_shape']))} on {doc['device']} "
        f"({doc['strategy']})", "",
        report.trials_table(doc["trials"]), "",
    ]
    fit = doc["fit"]
    if fit:
        lines.append(f"memory fit ({doc['memory']}): {format_bytes(fit['fixed_bytes'])} + "
                     f"{format_bytes(fit['bytes_per_sample'])} per sample")
    if doc["tensor_fit"]:
        tf = doc["tensor_fit"]
        lines.append(f"  of which tensors: {format_bytes(tf['fixed_bytes'])} + {format_bytes(tf['bytes_per_sample'])} "
                     "per sample; the rest is allocator, kernel scratch and the runtime")
    if doc["binding_limit"]:
        lines.append(f"capacity set by: {doc['binding_limit']}")
    if doc["compiled"]:
        ran = "the compiled step" if doc["compiled_trials"] else "eagerly (an emulated CPU capacity counts tensors)"
        lines.append(f"compiled model: trials ran {ran}; {doc['compilations']} graph(s) compiled during the search")
    tf = doc["time_fit"]
    if tf:
        lines.append(f"time fit: {report.format_seconds(tf['fixed_seconds'])} + "
                     f"{report.format_seconds(tf['seconds_per_sample'])} per sample per step "
                     f"(saturates at {_saturation(tf)} samples/s)")
    if doc["per_length"] is not None:
        lines += ["", report.lengths_table(doc), "", f"at the longest length, {doc['input_shape'][0]}:"]
    largest = doc["largest_fitting"]
    stop = _STOPS.get(doc["stop_reason"], doc["stop_reason"])
    memory = (f"limit {format_bytes(doc['limit_bytes'])} = {doc['target']:.0%} of "
              f"{format_bytes(doc['capacity_bytes'])}")
    if doc["objective"] == "memory":
        lines.append(f"batch size: {doc['batch_size']}  ({memory}; {stop}; {doc['num_trials']} trials, "
                     f"{doc['num_ooms']} OOM, {doc['seconds']:.2f} s)")
    else:
        lines.append(f"largest that fits: {largest}  ({memory}; {stop})")
        lines.append(f"batch size: {doc['batch_size']}  ({doc['reason']}; {doc['num_trials']} trials, "
                     f"{doc['num_ooms']} OOM, {doc['seconds']:.2f} s)")
    return "\n".join(lines)


def _saturation(tf: dict[str, float]) -> str:
    return f"{1 / tf['seconds_per_sample']:,.0f}" if tf["seconds_per_sample"] > 0 else "no limit"


def _compile_backend(name: str | None) -> str | None:
    """The ``--compile`` backend, checked against dynamo's list before anything is built."""
    if name is None:
        return None
    import torch._dynamo  # 2-3 s: only for --compile

    if name not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"--compile {name}: no such torch.compile backend; choose one of "
                         f"{', '.join(torch._dynamo.list_backends())}")
    return name


def run(args: argparse.Namespace) -> int:
    workload = Workload(model_spec=args.model, input_shape=args.input_shape, num_classes=args.num_classes,
                        optimizer=args.optimizer, amp=args.amp)
    device = device_or_fail(args.device)
    if device.type == "cpu" and args.capacity is None and args.max_batch_size is None:
        # the search would be safe (trials judged on real memory, none past a limit that kills),
        # but the largest batch a machine's RAM holds is far past a useful one, and its trials
        # take minutes each
        raise UsageError(
            "on CPU give --capacity (an emulated device, e.g. --capacity 2GiB) or --max-batch-size (to "
            "size for this machine's real memory up to that batch): the largest batch all the RAM holds "
            "takes minutes per trial"
        )
    if args.max_batch_size is not None and args.max_batch_size < args.min_batch_size:
        raise UsageError(f"--min-batch-size {args.min_batch_size} is above --max-batch-size {args.max_batch_size}")
    if args.plan_first and args.strategy != "predict":
        raise UsageError("--plan-first seeds the predict strategy; drop --strategy or --plan-first")
    if args.objective == "throughput" and args.timed_steps == 0:
        raise UsageError("--objective throughput compares timed steps; drop --timed-steps 0")
    if args.seq_lens is not None:
        if args.objective == "throughput":
            raise UsageError("--seq-lens answers the largest batch per length; drop --objective throughput")
        workload = workload.at_lengths(args.seq_lens)
    options = find_options_of(args)  # every finder flag, checked before anything is built
    backend = _compile_backend(args.compile)
    torch.manual_seed(args.seed)
    model = workload.build_model().to(device)
    workload.check(model, seed=args.seed)
    optimizer = workload.make_optimizer(model)
    if backend is not None:
        model = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(args.seed)
    with report.logging_through_progress(options.progress):
        # a fresh host batch per step (only its inputs are live, as when a loader feeds the
        # device); the finder moves it to the device, the planner (--plan-first) makes it fake
        if args.seq_lens is None:
            batch: Any = lambda b: workload.make_batch(b, generator=generator)  # noqa: E731
            lengths: dict[str, Any] = {}
        else:
            batch = lambda b, L: workload.batch_at(b, L, generator=generator)  # noqa: E731
            lengths = {"lengths": args.seq_lens, "seq_dim": 1}  # the sequence is the inputs' first dim
        plan = find_batch_size_for(model, batch, optimizer=optimizer, **lengths, loss_fn=nn.CrossEntropyLoss(),
                                   amp=args.amp, plan_first=args.plan_first, device=device, options=options)
    if args.plan_first and plan.seeded_by is None:
        print("batchpilot find: note: --plan-first found no plan to start from (-v says why); searched unseeded",
              file=sys.stderr)
    doc = find_document(workload, plan, device)
    if args.plot is not None:
        report.save_find_plot(doc, args.plot, title=f"batchpilot find: {doc['model']} on {doc['device']}, "
                                                    f"objective {doc['objective']}")
    print(report.to_json(doc) if args.json else _human(doc))
    sys.stdout.flush()
    return 0
