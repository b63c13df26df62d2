"""Tables, plots, progress bars and JSON for batchpilot's command line.

The optional ``cli`` extra provides matplotlib and tqdm; both are imported only
by the functions that need them, so ``import batchpilot.app.report`` imports neither.
Plots use matplotlib's object API with the Agg canvas (no pyplot, no global
backend switch), at a fixed size: :data:`FIGURE_SIZE_PX`.

JSON documents are plain dicts; :func:`to_json` renders them (strict JSON: NaN and
infinities become ``null``) and :data:`SCHEMAS` lists the exact keys of each kind and of
their nested records. That is a stable contract, version :data:`SCHEMA_VERSION`: keys
are never renamed or removed without a version bump. Sizes are bytes, times seconds.

``find`` (``batchpilot find --json``)::

    schema_version, command="find",
    model, input_shape [int], num_classes, optimizer, amp (null|"bf16"|"fp16"), device,
    strategy, target, capacity_bytes, limit_bytes,
    batch_size                the answer: the largest batch whose peak <= limit_bytes (objective
                              "memory"), or the smallest such batch within speed_tolerance of the
                              fastest measured samples/s ("throughput")
    objective                 "memory" | "throughput"
    speed_tolerance           the share of the best samples/s "throughput" may give up
    largest_fitting           the largest batch whose peak <= limit_bytes (= batch_size for "memory")
    reason                    one line: why batch_size
    samples_per_second        measured at batch_size, or null when it was not timed
    time_fit                  {fixed_seconds, seconds_per_sample}: seconds per step ~ fixed +
                              per_sample x batch through the timed trials that fitted | null
    stop_reason               the memory search's: "boundary" | "tolerance" | "max_batch_size" |
                              "strategy" | "max_trials" | "plateau" (the peak stopped growing with the
                              batch: set a max batch size) | "verification" (the answer did not run again
                              after the search and a smaller one did)
    steps_per_trial,
    memory                    the figure judged, the limit kind's name (batchpilot.memory.limits; docs/cli.md
                              lists them): "tensors" (emulated CPU) | "address_space" (RLIMIT_AS) | ...
    binding_limit             on a real CPU, the binding limit's name: "cgroup" | "rlimit_as" | ...; else null
    verified                  the answer ran again after the search, in the state it left
    base_bytes                on a real CPU, the memory in use when the search began: limit_bytes =
                              base + target x (capacity - base); null elsewhere
    fit                       {fixed_bytes, bytes_per_sample} | null
    tensor_fit                on a real CPU, the tensor bytes alone at the answer (the tensor model's line), same keys | null
    snapshot                  {bytes, seconds, on_disk}: the restore snapshot's cost
    compiled                  the model is (or holds) a torch.compile'd module
    compiled_trials           the trials ran the compiled program (false: eagerly, under an
                              emulated CPU capacity)
    compilations              graphs dynamo compiled during the search, warm-up included
    trials                    [{batch_size, outcome "fit"|"over_target"|"oom"|"refused",
                                peak_bytes|null, start_bytes|null, seconds,
                                tensor_bytes|null, bound_bytes|null,
                                step_seconds|null (fastest timed step, fits only),
                                samples_per_second|null, alloc_retries|null (CUDA),
                                end_bytes|null (real memory: the figure once the trial was put back;
                                end - start is what it left behind)}]
    num_trials, num_ooms, seconds
    per_length                with --seq-lens: [{length, batch_size}], the largest batch at each
                              length (the search's keys above are at the longest) | null
    length_fit                with --seq-lens: the memory model peak = F(L) + b x P(L),
                              {fixed [f0, f1, f2], per_sample [p0, p1, p2] (bytes, powers of L),
                              lengths (fitted on), bytes_per_token (p1),
                              bytes_per_token_squared (p2: unfused attention)} | null
    fitted_lengths            with --seq-lens: the lengths searched | null

``plan`` (``batchpilot plan --json``)::

    schema_version, command="plan",
    model, input_shape, num_classes, optimizer, amp,
    gpu (name|null), device ("cpu"|"cuda"), target, capacity_bytes, limit_bytes,
    world_size                ranks the model is sharded over (1 unsharded)
    sharding                  "fsdp2" | null
    batch_size                the largest batch whose required bytes <= limit_bytes
                              (required: reserved + context on CUDA, tensor bytes on CPU);
                              sharded: the batch of one rank
    stopped_by                "memory" (batch_size + 1 is over the limit) | "max_batch_size" (the
                              search cap stopped it under the limit: memory may hold more)
    estimate                  at batch_size: {peak_bytes, parameters, buffers, inputs,
                                gradients, optimizer_state, activations, unsharded_parameters,
                                communication, allocated_bytes, reserved_bytes,
                                context_bytes, required_bytes}
    next_required_bytes       at batch_size + 1 (over the limit), or null
    evaluations               [{batch_size, required_bytes}], every size tried
    seconds
    per_length, length_fit, fitted_lengths   as for ``find`` (with --seq-lens the other keys
                              are the plan at the longest length)
    generation                with --prompt-lens / --new-tokens: {prompt_lengths, new_tokens, rows
                                [{prompt_length, new_tokens, batch_size, limited_by, prefill_batch_size,
                                decode_batch_size}], seconds} (the other keys: its smallest batch) | null
    cluster                   with a list of GPUs (--gpu A,B,...): {global_batch_size (samples per
                                optimizer step, all ranks), speeds_from "table"|"given", target, device,
                                speedup (predicted step time of equal shares over these, by the same
                                speeds), evaluations (fake steps run), seconds,
                                ranks [{rank, gpu, capacity_bytes, limit_bytes, share, micro_batch_size,
                                accumulation, max_micro_batch_size (its memory's, or the search
                                cap), stopped_by ("memory" | "max_batch_size"), speed, time (its
                                share / speed over the slowest rank's), required_bytes (at
                                max_micro_batch_size)}]} (the other keys: the GPU with the smallest
                                batch) | null

``train`` (``run.json``, and ``batchpilot train --json``)::

    schema_version, command="train",
    config                    every TrainConfig option, by name
    dataset                   {name, num_train, num_held_out, num_classes, sample_shape}
    device,
    plan                      the finder's plan: the ``find`` keys from strategy on, or
                              null when --grad-accum-steps skipped the finder
    lr                        {base, base_size, rule "linear"|"sqrt"|"none", scaled}
                              (scaled: the LR at config.batch_size; a schedule rescales it)
    split                     the engine's first split of the batch: {micro_batch_size,
                                accum_steps, largest_fitting, predicted_seconds|null,
                                fewest_seconds|null, reason} | null
    steps                     [{step, epoch, loss, micro_batch_size, accum_steps, ooms,
                                peak_bytes, capacity_bytes|null, seconds, micro_batch_reason,
                                global_batch_size, lr (this step's),
                                noise_scale (B_simple in samples, EMA) | null,
                                noise {grad_sq, trace, grad_sq_ema, trace_ema, small_batch,
                                       small_count, big_batch} | null,
                                length (the batch's padded sequence length, when the engine
                                  sizes by length) | null,
                                micro_batch_sizes [int] (samples per micro-batch),
                                micro_batch_lengths [int] (each one's padded length; empty when
                                  the engine does not size by length)}]
    micro_batch_changes       [{step, from, to, reason}]
    schedule                  {spec, lr_rule, scale_weight_decay}
    batch_changes             [{step, from, to}]: the global batch after ``step`` differs
    noise_scale               B_simple at the end (EMA, samples) | null
    accuracy                  held-out accuracy in [0, 1]
    samples_seen, optimizer_steps, total_ooms, seconds
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .._progress import interactive
from ..memory.units import format_bytes

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMAS",
    "FIGURE_SIZE_PX",
    "length_record",
    "lengths_table",
    "plan_record",
    "to_json",
    "write_json",
    "format_table",
    "format_seconds",
    "trials_table",
    "micro_batch_changes",
    "batch_changes",
    "plot_memory_fit",
    "plot_run_timeline",
    "plot_batch_and_noise",
    "save_run_plot",
    "save_find_plot",
    "progress",
    "logging_through_progress",
]

#: 2: ``plan``'s ``required_bytes`` is reserved + context (was allocated + context), the figure
#: cudaMalloc runs out of; ``find`` gained ``memory``, ``binding_limit``, ``tensor_fit``,
#: ``snapshot`` and per-trial ``tensor_bytes`` / ``bound_bytes``. Since, with no key changing
#: meaning: ``find`` gained ``objective``, ``speed_tolerance``, ``largest_fitting``, ``reason``,
#: ``samples_per_second``, ``time_fit`` and per-trial ``step_seconds`` / ``samples_per_second`` /
#: ``alloc_retries``; ``train`` gained ``split``, per-step ``micro_batch_reason`` and per-change ``reason``;
#: ``find`` gained ``verified``, ``base_bytes`` and per-trial ``end_bytes``, and ``memory`` on a real
#: CPU names the binding limit's figure (``"address_space"``, ``"cgroup"`` or ``"resident"``);
#: ``plan`` gained ``generation`` (generate()'s table with ``--prompt-lens`` / ``--new-tokens``, else null)
#: and ``cluster`` (each rank's share with a list of GPUs, else null).
SCHEMA_VERSION = 2

_PLAN_KEYS = frozenset({
    "strategy", "target", "capacity_bytes", "limit_bytes", "batch_size", "stop_reason", "steps_per_trial",
    "fit", "trials", "num_trials", "num_ooms", "seconds", "memory", "binding_limit", "tensor_fit", "snapshot",
    "compiled", "compiled_trials", "compilations",
    "objective", "speed_tolerance", "largest_fitting", "reason", "samples_per_second", "time_fit",
    "verified", "base_bytes",
})
_JOB_KEYS = frozenset({"schema_version", "command", "model", "input_shape", "num_classes", "optimizer", "amp"})
#: ``--seq-lens``: the answer per length (null without it)
_LENGTH_KEYS = frozenset({"per_length", "length_fit", "fitted_lengths"})

#: The exact keys of each JSON document (and of its nested records).
SCHEMAS: dict[str, frozenset[str]] = {
    "find": _JOB_KEYS | _PLAN_KEYS | _LENGTH_KEYS | {"device"},
    "plan": _JOB_KEYS | _LENGTH_KEYS | {
        "gpu", "device", "target", "capacity_bytes", "limit_bytes", "batch_size", "stopped_by", "estimate",
        "next_required_bytes", "evaluations", "seconds", "world_size", "sharding", "generation", "cluster",
    },
    #: a list of GPUs: each rank's share of one global batch (null otherwise)
    "plan.cluster": frozenset({"global_batch_size", "speeds_from", "target", "device", "speedup", "evaluations",
                               "seconds", "ranks"}),
    "plan.cluster.rank": frozenset({"rank", "gpu", "capacity_bytes", "limit_bytes", "share", "micro_batch_size",
                                    "accumulation", "max_micro_batch_size", "stopped_by", "speed", "time", "required_bytes"}),
    #: ``--prompt-lens`` / ``--new-tokens``: generate()'s table (null without them)
    "plan.generation": frozenset({"prompt_lengths", "new_tokens", "rows", "seconds"}),
    "plan.generation.row": frozenset({"prompt_length", "new_tokens", "batch_size", "limited_by",
                                      "prefill_batch_size", "decode_batch_size"}),
    "plan.estimate": frozenset({
        "peak_bytes", "parameters", "buffers", "inputs", "gradients", "optimizer_state", "activations",
        "unsharded_parameters", "communication", "allocated_bytes", "reserved_bytes", "context_bytes",
        "required_bytes",
    }),
    "plan.evaluation": frozenset({"batch_size", "required_bytes"}),
    "per_length": frozenset({"length", "batch_size"}),
    "length_fit": frozenset({"fixed", "per_sample", "lengths", "bytes_per_token", "bytes_per_token_squared"}),
    "train": frozenset({
        "schema_version", "command", "config", "dataset", "device", "plan", "lr", "steps",
        "micro_batch_changes", "accuracy", "samples_seen", "optimizer_steps", "total_ooms", "seconds", "split",
        "schedule", "batch_changes", "noise_scale",
    }),
    "split": frozenset({"micro_batch_size", "accum_steps", "largest_fitting", "predicted_seconds",
                        "fewest_seconds", "reason"}),
    "train.plan": _PLAN_KEYS,
    "trial": frozenset({"batch_size", "outcome", "peak_bytes", "start_bytes", "seconds", "tensor_bytes",
                        "bound_bytes", "step_seconds", "samples_per_second", "alloc_retries", "end_bytes"}),
    "time_fit": frozenset({"fixed_seconds", "seconds_per_sample"}),
    "snapshot": frozenset({"bytes", "seconds", "on_disk"}),
    "fit": frozenset({"fixed_bytes", "bytes_per_sample"}),
    "lr": frozenset({"base", "base_size", "rule", "scaled"}),
    "step": frozenset({
        "step", "epoch", "loss", "micro_batch_size", "accum_steps", "ooms", "peak_bytes",
        "capacity_bytes", "seconds", "micro_batch_reason", "global_batch_size", "lr", "noise_scale", "noise",
        "length", "micro_batch_sizes", "micro_batch_lengths",
    }),
    "noise": frozenset({"grad_sq", "trace", "grad_sq_ema", "trace_ema", "small_batch", "small_count", "big_batch"}),
    "schedule": frozenset({"spec", "lr_rule", "scale_weight_decay"}),
    "batch_change": frozenset({"step", "from", "to"}),
    "dataset": frozenset({"name", "num_train", "num_held_out", "num_classes", "sample_shape"}),
    "train.config": frozenset({
        "model", "image_inputs", "epochs", "batch_size", "batch_schedule", "noise", "scale_weight_decay",
        "grad_accum_steps", "optimizer", "lr_base",
        "lr_base_size", "lr_base_scale", "weight_decay", "sched", "clip_grad", "amp", "device", "target",
        "capacity", "strategy", "grow_after", "squeeze_at", "squeeze_steps", "squeeze_capacity", "held_out",
        "seed", "out", "plot", "progress",
    }),
    "micro_batch_change": frozenset({"step", "from", "to", "reason"}),
}

#: Width and height in pixels of every PNG written here (three panels side by side).
FIGURE_SIZE_PX = (1800, 450)
_DPI = 100

_OUTCOME_STYLE = {  # outcome -> (colour, marker, legend label)
    "fit": ("tab:green", "o", "fits"),
    "over_target": ("tab:orange", "s", "over target"),
    "oom": ("tab:red", "x", "out of memory"),
}


# ---------------------------------------------------------------------------
# JSON


def _plain(obj: Any) -> Any:
    # numpy / torch scalars, tuples and paths reach the JSON documents from many places
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, bool, int)) or obj is None:
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None  # JSON has no NaN / inf
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "item"):
        return _plain(obj.item())
    return str(obj)


def to_json(doc: Mapping[str, Any], *, indent: int | None = 2) -> str:
    """Render a document as strict JSON (NaN and infinities become ``null``)."""
    return json.dumps(_plain(doc), indent=indent, allow_nan=False)


def write_json(doc: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write ``doc`` to ``path`` (parents created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(doc) + "\n")
    return path


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)


def length_record(lengths: Any) -> dict[str, Any]:
    """The ``per_length`` / ``length_fit`` / ``fitted_lengths`` keys of a ``find`` or ``plan`` document.

    ``lengths`` is a :class:`~batchpilot.find.lengths.LengthPlan`, a
    :class:`~batchpilot.plan.lengths.LengthPlanResult`, or ``None`` (all three ``null``).
    """
    if lengths is None:
        return {"per_length": None, "length_fit": None, "fitted_lengths": None}
    d = lengths.to_dict()
    return {k: d[k] for k in ("per_length", "length_fit", "fitted_lengths")}


def lengths_table(doc: Mapping[str, Any]) -> str:
    """The per-length table of a ``find`` / ``plan`` document: length, batch, tokens per batch."""
    fit = doc["length_fit"]
    head = (f"memory over (batch, length): peak = F(L) + b x P(L), {format_bytes(fit['bytes_per_token'])}/token, "
            f"{fit['bytes_per_token_squared']:.1f} B per b x L^2; fitted at {', '.join(map(str, doc['fitted_lengths']))}")
    rows = [(r["length"], r["batch_size"], r["length"] * r["batch_size"],
             "searched" if r["length"] in doc["fitted_lengths"] else "model")
            for r in doc["per_length"]]
    return head + "\n" + format_table(("length", "batch", "tokens", "from"), rows)


def plan_record(plan: Any) -> dict[str, Any]:
    """The finder's plan (``BatchPlan`` or its ``to_dict()``) in this module's stable schema.

    Only the documented keys are kept, under the documented names, so that a new field in
    the finder never changes a JSON document by accident.
    """
    d = plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)
    fit, tensor_fit = _fit_record(d.get("fit")), _fit_record(d.get("tensor_fit"))
    trials = [
        {"batch_size": int(t["batch_size"]), "outcome": t["outcome"],
         "peak_bytes": _int_or_none(t.get("peak_bytes")), "start_bytes": _int_or_none(t.get("start_bytes")),
         "seconds": float(t["seconds"]), "tensor_bytes": _int_or_none(t.get("tensor_bytes")),
         "bound_bytes": _int_or_none(t.get("bound_bytes")), "step_seconds": _float_or_none(t.get("step_seconds")),
         "samples_per_second": _sps(t), "alloc_retries": _int_or_none(t.get("alloc_retries")),
         "end_bytes": _int_or_none(t.get("end_bytes"))}
        for t in (x.to_dict() if hasattr(x, "to_dict") else x for x in d["trials"])
    ]
    largest = d.get("largest_fitting")
    chosen = [t for t in trials if t["batch_size"] == int(d["batch_size"]) and t["outcome"] == "fit"]
    return {
        "strategy": d["strategy"],
        "target": float(d["target"]),
        "capacity_bytes": int(d["capacity"] if "capacity" in d else d["capacity_bytes"]),
        "limit_bytes": int(d["limit_bytes"]),
        "batch_size": int(d["batch_size"]),
        "stop_reason": d.get("stop_reason"),
        "steps_per_trial": d.get("steps_per_trial"),
        "fit": fit,
        "trials": trials,
        "num_trials": len(trials),
        "num_ooms": sum(t["outcome"] == "oom" for t in trials),
        "seconds": float(d["seconds"]),
        "memory": d.get("memory", "tensors"),
        "binding_limit": d.get("binding_limit"),
        "tensor_fit": tensor_fit,
        "snapshot": {"bytes": int(d.get("snapshot_bytes", 0)), "seconds": float(d.get("snapshot_seconds", 0.0)),
                     "on_disk": bool(d.get("snapshot_on_disk", False))},
        "compiled": bool(d.get("compiled", False)),
        "compiled_trials": bool(d.get("compiled_trials", False)),
        "compilations": int(d.get("compilations", 0)),
        "objective": d.get("objective", "memory"),
        "speed_tolerance": float(d.get("speed_tolerance", 0.05)),
        "largest_fitting": int(largest) if largest is not None else int(d["batch_size"]),
        "reason": d.get("reason") or "",
        "samples_per_second": chosen[-1]["samples_per_second"] if chosen else None,
        "time_fit": _time_fit_record(d.get("time_fit")),
        "verified": bool(d.get("verified", False)),
        "base_bytes": _int_or_none(d.get("base_bytes")),
    }


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def _sps(trial: Mapping[str, Any]) -> float | None:
    seconds = trial.get("step_seconds")
    return float(trial["batch_size"]) / float(seconds) if seconds else None


def _time_fit_record(fit: Any) -> dict[str, float] | None:
    if fit is None:
        return None
    if not isinstance(fit, Mapping):
        fit = {"fixed_seconds": fit.fixed_seconds, "seconds_per_sample": fit.seconds_per_sample}
    return {"fixed_seconds": float(fit["fixed_seconds"]), "seconds_per_sample": float(fit["seconds_per_sample"])}


def _fit_record(fit: Any) -> dict[str, int] | None:
    if fit is None:
        return None
    if not isinstance(fit, Mapping):
        fit = {"fixed_bytes": fit.fixed_bytes, "bytes_per_sample": fit.bytes_per_sample}
    return {"fixed_bytes": int(round(fit["fixed_bytes"])), "bytes_per_sample": int(round(fit["bytes_per_sample"]))}


# ---------------------------------------------------------------------------
# Tables


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Plain aligned columns: text left-aligned, numbers right-aligned."""
    rows = [["" if v is None else v for v in row] for row in rows]
    cells = [[str(h) for h in headers]] + [[str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] == "" for r in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def format_seconds(seconds: float) -> str:
    """A duration with its unit and three significant digits: ``"1.5 ms"``, ``"22.6 µs"``, ``"1.2 s"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns" if seconds else "0 s"


def trials_table(trials: Sequence[Mapping[str, Any]]) -> str:
    """The finder's trials, one row each, in the order they ran; samples/s where a trial was timed."""
    def peak(t: Mapping[str, Any]) -> str:
        if t.get("peak_bytes") is None:
            return "-"
        # an OOM's figure is what was live when it failed: a lower bound of its peak
        return (">= " if t["outcome"] == "oom" else "") + format_bytes(t["peak_bytes"])

    def speed(t: Mapping[str, Any]) -> str:
        return f"{t['samples_per_second']:,.0f}" if t.get("samples_per_second") else "-"

    rows = [
        (i, t["batch_size"], t["outcome"], peak(t), f"{t['seconds']:.3f}" if t.get("seconds") is not None else "-",
         speed(t))
        for i, t in enumerate(trials, 1)
    ]
    return format_table(("#", "batch", "outcome", "peak memory", "seconds", "samples/s"), rows)


def batch_changes(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, int]]:
    """Where the global batch changed over a run: ``[{step, from, to}]``, ``step`` the last at ``from``."""
    changes = []
    for prev, cur in zip(steps, steps[1:]):
        if cur.get("global_batch_size") != prev.get("global_batch_size"):
            changes.append({"step": prev["step"], "from": prev["global_batch_size"], "to": cur["global_batch_size"]})
    return changes


def micro_batch_changes(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Where the micro-batch size changed over a run, and why: ``[{step, from, to, reason}]``."""
    changes = []
    for prev, cur in zip(steps, steps[1:]):
        if cur["micro_batch_size"] != prev["micro_batch_size"]:
            changes.append({"step": cur["step"], "from": prev["micro_batch_size"], "to": cur["micro_batch_size"],
                            "reason": cur.get("micro_batch_reason", "")})
    return changes


# ---------------------------------------------------------------------------
# Plots

_MIB = 1024**2


def plot_memory_fit(ax: Any, plan: Mapping[str, Any] | None) -> None:
    """Peak memory against batch size: the trials by outcome, the fitted line, capacity and target."""
    ax.set_xlabel("batch size (samples)")
    ax.set_ylabel("peak memory (MiB)")
    ax.grid(alpha=0.3)
    if plan is None:
        ax.set_title("memory vs batch size")
        ax.text(0.5, 0.5, "finder not run\n(micro-batch given by --grad-accum-steps)", ha="center",
                va="center", transform=ax.transAxes, color="tab:gray")
        return
    trials = plan.get("trials") or []
    capacity = plan.get("capacity_bytes")
    limit = plan.get("limit_bytes")
    chosen = plan.get("batch_size")
    sizes = [t["batch_size"] for t in trials] + ([chosen] if chosen else [])
    x_max = max(sizes, default=1) * 1.15
    for outcome, (colour, marker, label) in _OUTCOME_STYLE.items():
        pts = [t for t in trials if t["outcome"] == outcome]
        if not pts:
            continue
        # an OOM has no measured peak: draw it on the capacity line, where it broke through
        ys = [(t["peak_bytes"] if t.get("peak_bytes") is not None else capacity or 0) / _MIB for t in pts]
        ax.scatter([t["batch_size"] for t in pts], ys, c=colour, marker=marker, s=46, zorder=3, label=f"trial: {label}")
    fit = plan.get("fit")
    if fit:
        xs = [0.0, x_max]
        ax.plot(xs, [(fit["fixed_bytes"] + fit["bytes_per_sample"] * x) / _MIB for x in xs], color="tab:blue",
                lw=1.5, label=f"fit: {format_bytes(fit['fixed_bytes'])} + {format_bytes(fit['bytes_per_sample'])}/sample")
    if capacity:
        ax.axhline(capacity / _MIB, color="black", ls="--", lw=1, label=f"capacity {format_bytes(capacity)}")
    if limit:
        ax.axhline(limit / _MIB, color="tab:purple", ls=":", lw=1.2, label=f"target {format_bytes(limit)}")
    if chosen:
        ax.axvline(chosen, color="tab:gray", ls="-.", lw=1,
                   label=f"chosen batch {chosen} ({plan.get('objective', 'memory')})")
    ax.set_xlim(0, x_max)
    ax.set_ylim(bottom=0)
    ax.set_title(f"memory and speed vs batch size (finder: {plan.get('strategy', '?')})")
    handles, labels = ax.get_legend_handles_labels()
    speed = _plot_speed(ax, plan, x_max)
    if speed is not None:
        more = speed.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, fontsize=7, loc="upper left")


def _plot_speed(ax: Any, plan: Mapping[str, Any], x_max: float) -> Any:
    """Samples/s of the timed trials on a right-hand axis, the time fit's curve, the chosen point."""
    timed = [t for t in plan.get("trials") or [] if t.get("samples_per_second")]
    if not timed:
        return None
    sp = ax.twinx()
    sp.set_ylabel("samples/s", color="tab:cyan")
    sp.scatter([t["batch_size"] for t in timed], [t["samples_per_second"] for t in timed], c="tab:cyan",
               marker="D", s=30, zorder=3, label="trial: samples/s")
    fit = plan.get("time_fit")
    if fit and fit["fixed_seconds"] + fit["seconds_per_sample"] > 0:
        xs = [x_max * i / 200 for i in range(1, 201)]
        sp.plot(xs, [x / (fit["fixed_seconds"] + fit["seconds_per_sample"] * x) for x in xs], color="tab:cyan",
                lw=1, ls="--", label=f"time fit: {format_seconds(fit['fixed_seconds'])} + "
                                     f"{format_seconds(fit['seconds_per_sample'])}/sample")
    chosen = plan.get("batch_size")
    best = [t for t in timed if t["batch_size"] == chosen]
    if best:
        sp.scatter([chosen], [best[-1]["samples_per_second"]], s=140, facecolors="none", edgecolors="black",
                   zorder=4, label=f"chosen: {best[-1]['samples_per_second']:,.0f} samples/s")
    sp.set_ylim(bottom=0)
    return sp


def plot_run_timeline(ax: Any, steps: Sequence[Mapping[str, Any]]) -> None:
    """Micro-batch size (left axis) and peak memory with the capacity (right axis) over the steps."""
    xs = [s["step"] for s in steps]
    ax.step(xs, [s["micro_batch_size"] for s in steps], where="post", color="tab:blue", lw=1.8, label="micro-batch size")
    oom_steps = [s for s in steps if s.get("ooms")]
    if oom_steps:
        ax.scatter([s["step"] for s in oom_steps], [s["micro_batch_size"] for s in oom_steps], color="tab:red",
                   marker="v", s=40, zorder=3, label="OOM recovered")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("micro-batch size (samples)", color="tab:blue")
    ax.set_ylim(0, max((s["micro_batch_size"] for s in steps), default=1) * 1.3)
    ax.grid(alpha=0.3)
    mem = ax.twinx()
    mem.plot(xs, [(s.get("peak_bytes") or 0) / _MIB for s in steps], color="tab:orange", lw=1.2, label="peak memory")
    if any(s.get("capacity_bytes") for s in steps):
        mem.step(xs, [(s.get("capacity_bytes") or math.nan) / _MIB for s in steps], where="post", color="black",
                 ls="--", lw=1, label="capacity")
    mem.set_ylabel("memory (MiB)", color="tab:orange")
    top = max([s.get("peak_bytes") or 0 for s in steps] + [s.get("capacity_bytes") or 0 for s in steps], default=0)
    mem.set_ylim(0, max(top, 1) / _MIB * 1.6)
    lines = ax.get_legend_handles_labels()
    more = mem.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper center", ncol=4)
    ax.set_title("micro-batch and peak memory over the run")


def plot_batch_and_noise(ax: Any, steps: Sequence[Mapping[str, Any]]) -> None:
    """The global batch and the gradient noise scale ``B_simple`` (both in samples, log axis) over the steps."""
    xs = [s["step"] for s in steps]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("samples")
    ax.grid(alpha=0.3, which="both")
    ax.set_title("global batch and gradient noise scale")
    batches = [s.get("global_batch_size") for s in steps]
    if any(b for b in batches):
        ax.step(xs, batches, where="post", color="tab:green", lw=1.8, label="global batch")
    noise = [(x, s["noise_scale"]) for x, s in zip(xs, steps)
             if isinstance(s.get("noise_scale"), (int, float)) and math.isfinite(s["noise_scale"]) and s["noise_scale"] > 0]
    if noise:
        ax.plot([x for x, _ in noise], [v for _, v in noise], color="tab:purple", lw=1.2,
                label="noise scale B_simple (EMA)")
    if not noise and not any(b for b in batches):
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="tab:gray")
        return
    if not noise:
        ax.text(0.5, 0.9, "noise scale not measured", ha="center", va="center", transform=ax.transAxes,
                color="tab:gray", fontsize=8)
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper left")


def save_run_plot(plan: Mapping[str, Any] | None, steps: Sequence[Mapping[str, Any]], path: str | os.PathLike,
                  *, title: str | None = None) -> Path:
    """Write the run figure as a PNG: :func:`plot_memory_fit`, :func:`plot_run_timeline`, :func:`plot_batch_and_noise`.

    The image is exactly :data:`FIGURE_SIZE_PX` pixels.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'batchpilot[cli]'``).
    """
    fig = _figure()
    left, middle, right = fig.subplots(1, 3)
    plot_memory_fit(left, plan)
    plot_run_timeline(middle, steps)
    plot_batch_and_noise(right, steps)
    return _save_figure(fig, path, title)


def save_find_plot(plan: Mapping[str, Any], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Write the finder's figure (:func:`plot_memory_fit`: memory and samples/s vs batch size) as a PNG.

    The image is exactly :data:`FIGURE_SIZE_PX` pixels.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'batchpilot[cli]'``).
    """
    fig = _figure()
    plot_memory_fit(fig.subplots(1, 1), plan)
    return _save_figure(fig, path, title)


def _figure() -> Any:
    """A matplotlib ``Figure`` of :data:`FIGURE_SIZE_PX` pixels on the Agg canvas (no display needed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'batchpilot[cli]'") from exc
    w, h = FIGURE_SIZE_PX
    fig = Figure(figsize=(w / _DPI, h / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save_figure(fig: Any, path: str | os.PathLike, title: str | None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if title:
        fig.suptitle(title, fontsize=10)
    # no bbox_inches="tight": it would change the pixel size the schema promises
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, format="png")
    return path


# ---------------------------------------------------------------------------
# Progress


def progress(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
             enabled: bool = True, unit: str = "it") -> Iterator[Any] | Any:
    """A tqdm progress bar on stderr when ``enabled`` and stderr is a terminal or a notebook.

    Off a terminal (a CI log, ``nohup``, a file) a bar would write its redraws and its cursor
    moves (``ESC[A`` between nested bars) into the log: there it is off, and the finder's plain
    lines and the final report say what happened.

    Raises:
        ImportError: tqdm is not installed (``pip install 'batchpilot[cli]'``).
    """
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ImportError("progress bars need tqdm: pip install 'batchpilot[cli]'") from exc
    shown = enabled and interactive(sys.stderr)
    return tqdm(iterable, total=total, desc=desc, disable=not shown, unit=unit, dynamic_ncols=True, leave=True)


@contextlib.contextmanager
def logging_through_progress(enabled: bool = True, logger: str = "batchpilot") -> Iterator[None]:
    """Route ``logger``'s console output through ``tqdm.write`` while bars are shown.

    A warning printed straight to stderr would tear a progress bar in two; through tqdm it
    lands above the bar. The command line logs through the ``batchpilot`` logger, not the
    root one; Python's warnings (``warnings.warn``, torch's among them) go through logging
    meanwhile too (``logging.captureWarnings``), as they were after. Does nothing when not
    ``enabled`` or when stderr is no terminal (no bar is drawn there).
    """
    if not enabled or not interactive(sys.stderr):
        yield
        return
    try:
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError as exc:
        raise ImportError("progress bars need tqdm: pip install 'batchpilot[cli]'") from exc
    captured = logging.getLogger("py.warnings")
    was_captured = getattr(warnings.showwarning, "__module__", "") == "logging"
    logging.captureWarnings(True)
    try:
        with logging_redirect_tqdm(loggers=[logging.getLogger(logger), captured]):
            yield
    finally:
        logging.captureWarnings(was_captured)
