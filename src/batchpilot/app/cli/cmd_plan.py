"""``batchpilot plan``: the batch size for a capacity or a named GPU, without the device; with a list
of GPUs (``--gpu A6000-48GB,RTX2080Ti-11GB``), each rank's share of one global batch."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ...memory.units import format_bytes
from ...plan.generation import GenerationPlanResult, plan_generation
from ...plan.gpus import GPUS, gpu_spec
from ...plan.lengths import LengthPlanResult, plan_per_length
from ...plan.planner import plan_batch_size
from ...plan.result import ClusterPlanResult, PlanningError, PlanResult
from ...policy.search import NothingFitsError
from .. import report
from ..trainjob import make_optimizer
from .common import (
    UsageError, add_fit_options, add_length_options, add_model_options, add_verbose, byte_size, lengths, positive_int,
    speeds,
)
from .workload import Workload

__all__ = ["add_parser", "run", "plan_document"]

_BREAKDOWN = ("parameters", "buffers", "inputs", "gradients", "optimizer_state", "activations",
              "unsharded_parameters", "communication")
#: parts that exist only when the model is sharded
_SHARDED_ONLY = ("unsharded_parameters", "communication")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="plan the batch size for a capacity or a named GPU, without the device",
        description="Run the training step on fake tensors (no data, no device) and give the largest "
                    "batch whose peak memory fits target x capacity. Exact on CPU; on CUDA it models the "
                    "caching allocator, cuBLAS workspaces and the CUDA context.",
        epilog=f"Known GPUs: {', '.join(GPUS)}. With --fsdp --world-size N the plan is one rank's of N "
               "sharding the model with FSDP2 (each block, then the root), on a fake process group: no "
               "other process and no GPU is needed. With --prompt-lens and --new-tokens the plan is of "
               "generate() (greedy, a KV cache growing to prompt + new tokens): the largest batch of prompts "
               "for every pair, from the prefill and the last decoding step on fake tensors.",
    )
    add_model_options(p)
    where = p.add_argument_group("capacity (one of)")
    mx = where.add_mutually_exclusive_group(required=True)
    mx.add_argument("--capacity", metavar="SIZE", type=byte_size,
                    help="memory to plan for, e.g. 80GiB, 24GB, 512MiB or a number of bytes")
    mx.add_argument("--gpu", metavar="NAME[,NAME...]",
                    help="a named GPU, e.g. H100-80GB (implies --device cuda); a comma-separated list, one per rank "
                         "(e.g. A6000-48GB,A6000-48GB,RTX2080Ti-11GB,RTX2080Ti-11GB), plans a data-parallel job "
                         "over GPUs that differ: each rank's micro-batch, accumulation and share of one global batch")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="whose memory accounting to model: cpu (exact tensor bytes) or cuda (allocator rounding, "
                        "workspaces, context). Default: cuda with --gpu, else cpu")
    add_fit_options(p)
    add_length_options(p)
    gen = p.add_argument_group("generation (generate() of a causal LM with a KV cache)")
    gen.add_argument("--prompt-lens", metavar="P1,P2,...", type=lengths, default=None,
                     help="plan model.generate for prompts of these lengths (with --new-tokens): a table of the "
                          "largest batch per (prompt length, new tokens). --model must be a factory returning a "
                          "Hugging Face causal LM; it is built on the meta device (no memory for the weights)")
    gen.add_argument("--new-tokens", metavar="N1,N2,...", type=lengths, default=None,
                     help="max_new_tokens to plan generate for (with --prompt-lens)")
    shard = p.add_argument_group("sharding")
    shard.add_argument("--fsdp", action="store_true",
                       help="shard the model with FSDP2 (fully_shard each block, then the root) and plan one rank")
    shard.add_argument("--world-size", metavar="N", type=positive_int, default=None,
                       help="ranks to shard over with --fsdp (default 1); the batch size is per rank")
    mixed = p.add_argument_group("a mixed cluster (with a list of GPUs in --gpu)")
    mixed.add_argument("--global-batch-size", metavar="N", type=positive_int, default=None,
                       help="samples per optimizer step over all ranks, split by speed (default: the largest that "
                            "every rank takes in one micro-batch)")
    mixed.add_argument("--speeds", metavar="S1,S2,...", type=speeds, default=None,
                       help="one figure per rank proportional to its samples/s, e.g. 1,1,0.4,0.4 (default: the GPU "
                            "table's peak dense FP16 tensor TFLOPS)")
    p.add_argument("--steps", metavar="N", type=positive_int, default=2,
                   help="training steps per estimate; 2 or more count the optimizer state (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print only the JSON plan on stdout")
    add_verbose(p)
    p.set_defaults(handler=run)
    return p


def plan_document(workload: Workload, result: PlanResult, lengths: LengthPlanResult | None = None,
                  generation: GenerationPlanResult | None = None,
                  cluster: ClusterPlanResult | None = None) -> dict[str, Any]:
    """The ``plan`` JSON document (schema in :mod:`batchpilot.app.report`); with ``lengths``, at the longest;
    with ``generation``, the table per (prompt length, new tokens), and the rest for its smallest batch; with
    ``cluster``, each rank's share, and the rest for the GPU with the smallest batch."""
    est = result.estimate
    return {
        **report.length_record(lengths),
        "generation": None if generation is None else generation.to_dict(),
        "cluster": None if cluster is None else cluster.to_dict(),
        "schema_version": report.SCHEMA_VERSION,
        "command": "plan",
        **workload.describe(),
        "gpu": result.gpu,
        "device": result.device,
        "target": result.target,
        "capacity_bytes": result.capacity,
        "limit_bytes": result.limit,
        "world_size": result.world_size,
        "sharding": result.sharding,
        "batch_size": result.batch_size,
        "stopped_by": result.stopped_by,
        "estimate": None if est is None else {
            "peak_bytes": est.peak_bytes,
            **{k: getattr(est, k) for k in _BREAKDOWN},
            "allocated_bytes": est.allocated_bytes,
            "reserved_bytes": est.reserved_bytes,
            "context_bytes": est.context_bytes,
            "required_bytes": est.required_bytes,
        },
        "next_required_bytes": None if result.next_estimate is None else result.next_estimate.required_bytes,
        "evaluations": [{"batch_size": b, "required_bytes": n} for b, n in sorted(result.evaluations.items())],
        "seconds": result.seconds,
    }


def _human(doc: dict[str, Any]) -> str:
    where = doc["gpu"] or f"{format_bytes(doc['capacity_bytes'])} ({doc['device']})"
    sharded = doc["sharding"] is not None
    ranks = f", sharded with {doc['sharding'].upper()} over {doc['world_size']} ranks (per rank)" if sharded else ""
    lines = [f"plan for {doc['model']} with input {'x'.join(map(str, doc['input_shape']))} on {where}{ranks}", ""]
    lines.append(report.format_table(
        ("batch", "required"),
        [(e["batch_size"], format_bytes(e["required_bytes"])) for e in doc["evaluations"]],
    ))
    est = doc["estimate"]
    if est is not None:
        lines += ["", f"memory at batch {doc['batch_size']}:"]
        parts = [k for k in _BREAKDOWN if sharded or k not in _SHARDED_ONLY]
        rows = [(k.replace("_", " "), format_bytes(est[k])) for k in (*parts, "peak_bytes")]
        if doc["device"] == "cuda":
            rows += [("allocated (allocator)", format_bytes(est["allocated_bytes"])),
                     ("reserved (allocator)", format_bytes(est["reserved_bytes"])),
                     ("CUDA context", format_bytes(est["context_bytes"])),
                     ("required (reserved + context)", format_bytes(est["required_bytes"]))]
        lines.append(report.format_table(("part", "memory"), rows))
    per = f" per rank, {doc['batch_size'] * doc['world_size']} over {doc['world_size']} ranks" if sharded else ""
    if doc["generation"] is not None:
        rows = [(r["prompt_length"], r["new_tokens"], r["batch_size"], r["limited_by"], r["prefill_batch_size"],
                 r["decode_batch_size"]) for r in doc["generation"]["rows"]]
        lines += ["", "generate(): the largest batch of prompts per (prompt length, new tokens)",
                  report.format_table(("prompt", "new tokens", "batch", "limited by", "prefill", "last step"), rows)]
        per += " for every row of the table"
    elif doc["per_length"] is not None:
        lines += ["", report.lengths_table(doc)]
        per += f" at the longest length, {doc['input_shape'][0]}"
    if doc["stopped_by"] == "max_batch_size":
        per += (f", the planner's search cap, not memory: pass --max-batch-size larger than {doc['batch_size']} "
                "to search further")
    lines += [
        "",
        f"batch size: {doc['batch_size']}{per}  (limit {format_bytes(doc['limit_bytes'])} = "
        f"{doc['target']:.0%} of {format_bytes(doc['capacity_bytes'])}; planned in {doc['seconds']:.2f} s)",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    workload = Workload(model_spec=args.model, input_shape=args.input_shape, num_classes=args.num_classes,
                        optimizer=args.optimizer, amp=args.amp)
    gpus = _gpu_list(args)
    if gpus is not None:
        return _run_cluster(args, workload, gpus)
    if args.world_size is not None and args.world_size > 1 and not args.fsdp:
        raise UsageError(f"--world-size {args.world_size} needs --fsdp: a data-parallel (DDP) rank holds the whole "
                         "model, so its plan is the one without --world-size")
    generating = _generation_args(args)
    if generating:
        return _run_generation(args, workload)
    if args.seq_lens is not None:
        workload = workload.at_lengths(args.seq_lens)
    model = workload.build_model()
    workload.check(model)
    optimizer_name = workload.optimizer
    options = dict(
        capacity=args.gpu or args.capacity, target=args.target,
        optimizer=lambda params: make_optimizer(optimizer_name, params, lr=1e-3), steps=args.steps,
        amp=workload.amp, device=args.device, max_batch_size=args.max_batch_size or 1 << 20,
        world_size=args.world_size or 1, sharding="fsdp2" if args.fsdp else None,
    )
    lengths = None
    try:
        if args.seq_lens is None:
            result = plan_batch_size(model, lambda b: workload.make_batch(b), **options)
        else:
            lengths = plan_per_length(model, lambda b, L: workload.batch_at(b, L), lengths=args.seq_lens, **options)
            result = lengths.longest
    except PlanningError as exc:
        raise UsageError(f"cannot plan this model on fake tensors: {exc}") from None
    doc = plan_document(workload, result, lengths)
    if result.batch_size == 0:
        need = result.evaluations.get(1)
        raise NothingFitsError(
            f"nothing fits: batch size 1 needs {format_bytes(need or 0)}, over the limit {format_bytes(result.limit)} "
            f"({result.target:.0%} of {format_bytes(result.capacity)})",
            batch_size=1, peak_bytes=need, limit_bytes=result.limit, capacity_bytes=result.capacity,
        )
    return _print(args, doc)


def _gpu_list(args: argparse.Namespace) -> list[str] | None:
    """The GPUs of a mixed cluster (``--gpu`` with a comma), or ``None`` for one GPU; names checked early."""
    names = [] if args.gpu is None else [n.strip() for n in args.gpu.split(",")]
    for name in names:
        try:
            gpu_spec(name)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if names and args.device == "cpu":
        raise UsageError("--gpu plans for a CUDA device; drop --device cpu")
    if len(names) > 1:
        return names
    if args.global_batch_size is not None or args.speeds is not None:
        raise UsageError("--global-batch-size and --speeds split a batch over ranks that differ: give --gpu a list, "
                         "one GPU per rank (e.g. --gpu A6000-48GB,A6000-48GB,RTX2080Ti-11GB,RTX2080Ti-11GB)")
    return None


def _run_cluster(args: argparse.Namespace, workload: Workload, gpus: list[str]) -> int:
    clash = [flag for flag, on in (("--seq-lens", args.seq_lens is not None), ("--prompt-lens", args.prompt_lens is not None),
                                   ("--new-tokens", args.new_tokens is not None),
                                   ("--world-size", args.world_size is not None)) if on]
    if clash:
        raise UsageError(f"{', '.join(clash)} cannot go with a list of GPUs: the mixed-cluster plan is of one training "
                         "step at --input-shape, one rank per GPU (with --fsdp the world size is the list's length)")
    if args.speeds is not None and len(args.speeds) != len(gpus):
        raise UsageError(f"--speeds has {len(args.speeds)} figures for {len(gpus)} GPUs: give one per rank")
    model = workload.build_model()
    workload.check(model)
    optimizer_name = workload.optimizer
    try:
        cluster = plan_batch_size(
            model, lambda b: workload.make_batch(b), capacity=gpus, target=args.target,
            optimizer=lambda params: make_optimizer(optimizer_name, params, lr=1e-3), steps=args.steps,
            amp=workload.amp, device=args.device, max_batch_size=args.max_batch_size or 1 << 20,
            sharding="fsdp2" if args.fsdp else None, global_batch_size=args.global_batch_size, speeds=args.speeds)
    except PlanningError as exc:
        raise UsageError(f"cannot plan this model on fake tensors: {exc}") from None
    except ValueError as exc:
        if isinstance(exc, NothingFitsError):
            raise
        raise UsageError(str(exc)) from None
    assert isinstance(cluster, ClusterPlanResult)
    smallest = min(cluster.ranks, key=lambda r: r.max_micro_batch).plan
    doc = plan_document(workload, smallest, cluster=cluster)
    doc["seconds"] = cluster.seconds
    if args.json:
        print(report.to_json(doc))
    else:
        print(f"plan for {doc['model']} with input {'x'.join(map(str, doc['input_shape']))} on {len(gpus)} GPUs\n")
        print(cluster.describe())
    sys.stdout.flush()
    return 0


def _print(args: argparse.Namespace, doc: dict[str, Any]) -> int:
    if args.json:
        print(report.to_json(doc))
    else:
        print(_human(doc))
    sys.stdout.flush()
    return 0


def _generation_args(args: argparse.Namespace) -> bool:
    """Whether generation is planned; the options it cannot go with are refused."""
    if (args.prompt_lens is None) != (args.new_tokens is None):
        raise UsageError("--prompt-lens and --new-tokens go together: the table has one row per pair")
    if args.prompt_lens is None:
        return False
    clash = [flag for flag, on in (("--seq-lens", args.seq_lens is not None), ("--fsdp", args.fsdp),
                                   ("--amp", args.amp is not None)) if on]
    if clash:
        raise UsageError(f"{', '.join(clash)} cannot go with --prompt-lens: generate() runs the model unsharded, in "
                         "the dtype the factory gives it")
    if args.model in (None, "mlp", "cnn", "transformer"):
        raise UsageError("--prompt-lens plans generate(): --model must name a factory returning a Hugging Face "
                         "causal LM (MODULE:FUNCTION or path/to/file.py:FUNCTION)")
    return True


def _run_generation(args: argparse.Namespace, workload: Workload) -> int:
    import dataclasses

    import torch

    workload = dataclasses.replace(workload, input_shape=(max(args.prompt_lens),))
    with torch.device("meta"):  # shapes only: a model larger than this machine's memory plans all the same
        model = workload.build_model()
    try:
        gen = plan_generation(
            model, prompt_lengths=args.prompt_lens, new_tokens=args.new_tokens, capacity=args.gpu or args.capacity,
            target=args.target, device=args.device, max_batch_size=args.max_batch_size or 1 << 20)
    except PlanningError as exc:
        raise UsageError(f"cannot plan generate() for this model on fake tensors: {exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    result = gen.limiting
    doc = plan_document(workload, result, generation=gen)
    doc["seconds"] = gen.seconds
    if result.batch_size == 0:
        need = result.evaluations.get(1)
        raise NothingFitsError(
            f"nothing fits: generating for one prompt needs {format_bytes(need or 0)}, over the limit "
            f"{format_bytes(result.limit)} ({result.target:.0%} of {format_bytes(result.capacity)})",
            batch_size=1, peak_bytes=need, limit_bytes=result.limit, capacity_bytes=result.capacity,
        )
    return _print(args, doc)
