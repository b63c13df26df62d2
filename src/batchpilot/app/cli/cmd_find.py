"""``batchpilot find``: measure the largest batch that fits, on the device (or an emulated one)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

from ...find.front import find_batch_size_for
from ...memory.units import format_bytes
from ...policy.search import STRATEGIES
from ...policy.speed import OBJECTIVES, SPEED_TOLERANCE
from .. import report
from .common import (
    UsageError, add_fit_options, add_length_options, add_model_options, add_verbose, byte_size, device_or_fail,
    non_negative_int, positive_int, speed_fraction,
)
from .workload import Workload

__all__ = ["add_parser", "run", "find_document"]
_STOPS = {
    "boundary": "exact: one more sample does not fit",
    "tolerance": "within 2% of the boundary, as close as real memory can be measured",
    "max_batch_size": "capped by --max-batch-size",
    "strategy": "where the strategy stops, not necessarily the boundary",
    "max_trials": "stopped after the most trials allowed",
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
    d.add_argument("--capacity", metavar="SIZE", type=byte_size, default=None,
                   help="size the batch for this much memory, e.g. 2GiB: on CPU an emulated device that raises "
                        "a real OutOfMemoryError past it, on CUDA a per-process memory fraction (default: the "
                        "device's real memory; on CPU, with --max-batch-size, the process's resident memory "
                        "against its container limit, RLIMIT_AS or free RAM, whichever is tightest)")
    add_fit_options(p)
    add_length_options(p)
    s = p.add_argument_group("search")
    s.add_argument("--strategy", choices=tuple(STRATEGIES), default="predict",
                   help="predict: fit memory = fixed + per-sample x batch from small trials and verify the answer "
                        "(fewest trials); power, binsearch: Lightning's; decay: timm's (default: %(default)s)")
    s.add_argument("--min-batch-size", metavar="N", type=positive_int, default=1,
                   help="smallest batch to consider (default: %(default)s)")
    s.add_argument("--steps-per-trial", metavar="N", type=positive_int, default=2,
                   help="training steps per trial; 2 or more count the optimizer state (default: %(default)s)")
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
    v.add_argument("--objective", choices=OBJECTIVES, default="memory",
                   help="memory: the largest batch that fits; throughput: the smallest fitting batch whose samples/s "
                        "is within --speed-tolerance of the fastest measured, found by timing a few smaller sizes "
                        "(default: %(default)s)")
    v.add_argument("--speed-tolerance", metavar="FRACTION", type=speed_fraction, default=SPEED_TOLERANCE,
                   help="share of the best samples/s the throughput objective may give up, in [0, 0.5) "
                        "(default: %(default)s, DeepSpeed's plateau rule)")
    v.add_argument("--timed-steps", metavar="N", type=non_negative_int, default=None,
                   help="steps timed per fitting trial after a warm-up step, the fastest counting (default: 1 "
                        "for memory, 3 for throughput; 0 times nothing)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="also write a PNG of peak memory and samples/s against batch size, the chosen one marked")
    p.add_argument("--json", action="store_true", help="print only the JSON plan on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    backend = _compile_backend(args.compile)
    torch.manual_seed(args.seed)
    model = workload.build_model().to(device)
    workload.check(model, seed=args.seed)
    optimizer = workload.make_optimizer(model)
    if backend is not None:
        model = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(args.seed)
    with report.logging_through_progress(not args.no_progress):
        # a fresh host batch per step (only its inputs are live, as when a loader feeds the
        # device); the finder moves it to the device, the planner (--plan-first) makes it fake
        if args.seq_lens is None:
            batch: Any = lambda b: workload.make_batch(b, generator=generator)  # noqa: E731
            lengths: dict[str, Any] = {}
        else:
            batch = lambda b, L: workload.batch_at(b, L, generator=generator)  # noqa: E731
            lengths = {"lengths": args.seq_lens, "seq_dim": 1}  # the sequence is the inputs' first dim
        plan = find_batch_size_for(
            model, batch, optimizer=optimizer, **lengths,
            loss_fn=nn.CrossEntropyLoss(), amp=args.amp, plan_first=args.plan_first, device=device, target=args.target,
            capacity=args.capacity, strategy=args.strategy, min_batch_size=args.min_batch_size,
            max_batch_size=args.max_batch_size, steps_per_trial=args.steps_per_trial,
            progress=not args.no_progress, objective=args.objective, speed_tolerance=args.speed_tolerance,
            timed_steps=args.timed_steps,
        )
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
