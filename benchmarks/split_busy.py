"""The engine's default split, on a busy machine and on a quiet one: against ``split="fewest"`` and the old rule.

1. **Busy** (``--runs``, default 8): the reproduction of issue 36 item 1. A Hugging Face GPT-2
   built from a config (4 layers, width 256, vocab 5000), padded dict batches (labels -100 at
   the padding), a ``(sum, count)`` loss; ``find_batch_size_for(..., capacity="256MiB")``, then
   ``Engine(..., start=plan)`` with its defaults, global batch 64. Each run is a fresh process
   (the plan's trial times are that process's), beside a co-tenant (``--cotenant PATH``: the
   shared ``cotenant.py``, started before the first run and stopped after the last). In each
   process the engines train copies of the model on the same batches, taking turns step by
   step (the order rotated each round): the default, ``split="fewest"``, and, where the plan
   nominates a finer split, that split held fixed, which is what the engine kept before
   the real steps checked it (``old``). A step's time is its ``StepResult.seconds`` (wall);
   each engine's figure is the median over its steps: the default's ``--steps``, its first (at
   the nominated split, where the check starts) and the check's included; the others' after a
   first step that warms them up.
2. **Quiet** (``--quiet-runs``, default 3; no co-tenant): ``speed.py``'s CNN (train, one
   thread), where a split genuinely pays (its largest micro-batch is past a cache cliff). The
   engine's own search (``EngineConfig(find=FindOptions(capacity="16MiB"))``: it times 3 steps
   per trial) on a global batch of 96 (about twice the largest fit); the default against the
   old rule's split held fixed, and the fewest, in turns as above.

    python benchmarks/split_busy.py --cotenant ../shared/tools/cotenant.py
    python benchmarks/split_busy.py --quick --json split.json

Goals: busy, the default's median step time <= 1.10x ``split="fewest"``'s over the runs, none
over 1.5x; quiet, the default's samples/s >= 0.95x the old rule's split where that split pays.
Times on a shared CPU are noisy: read the ratios, measured side by side in one process.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import machine  # noqa: E402

from batchpilot.app.report import format_table, write_json  # noqa: E402
from batchpilot.find.front import find_batch_size_for  # noqa: E402
from batchpilot.find.options import FindOptions  # noqa: E402
from batchpilot.train.engine import Engine, EngineConfig  # noqa: E402

BUSY_COLUMNS = ("run", "fewest", "nominated", "default ran", "default", "fewest s", "control", "old", "default/fewest",
                "paired", "control/fewest", "control paired", "old/fewest", "goal")
FORCED_COLUMNS = ("run", "forced timing", "nominated", "verdict", "after steps", "pair ratios (split/fewest)",
                  "forced ran", "forced/fewest")
QUIET_COLUMNS = ("run", "largest", "fewest", "old split", "default ran", "default/old", "fewest/old", "wall d/o",
                 "goal")
VOCAB = 5000


# ---------------------------------------------------------------------------
# the busy reproduction: one fresh process per run


def gpt2(quick: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64 if quick else 256, n_layer=1 if quick else 4,
                     n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def padded_batch(g: torch.Generator, size: int, longest: int) -> dict[str, torch.Tensor]:
    """``size`` sequences of 8..``longest`` tokens, right-padded to the batch's longest; labels -100 there."""
    lengths = torch.randint(8, longest + 1, (size,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(1, VOCAB, (size, width), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy as ``(sum, count)`` over the real (not padded) positions."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def interleave(engines: dict[str, Engine], batches: list[Any], label: str = "") -> dict[str, list[dict[str, Any]]]:
    """Each engine trains on every batch; the engines take turns step by step, the order rotated each round."""
    names = list(engines)
    steps: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i, batch in enumerate(batches):
        for n in names[i % len(names):] + names[:i % len(names)]:
            c0 = time.thread_time()
            r = engines[n].step(batch)
            steps[n].append({"seconds": r.seconds, "cpu": time.thread_time() - c0, "micro": r.micro_batch_size,
                             "accum": r.accum_steps, "reason": r.micro_batch_reason})
        print(f"  {label}step {i + 2}: " + ", ".join(f"{n} {steps[n][-1]['accum']} x {steps[n][-1]['micro']} "
                                               f"{steps[n][-1]['seconds']:.2f} s" for n in names),
              file=sys.stderr, flush=True)
    return steps


def busy_worker(args: argparse.Namespace) -> dict[str, Any]:
    model = gpt2(args.quick)
    g = torch.Generator().manual_seed(args.seed)
    example = padded_batch(g, 64, args.longest)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    plan = find_batch_size_for(model, example, optimizer=opt, loss_fn=lm_loss, capacity=args.capacity)
    find_seconds = time.perf_counter() - t0
    print(f"  [run {args.seed}] plan {plan.batch_size} in {find_seconds:.0f} s, timed {plan.timed_points()}", file=sys.stderr, flush=True)
    engines = {}
    plans = {"default": plan, "fewest": plan}
    if args.control:
        plans["control"] = plan
    if args.force_factor:
        plans["forced"] = forced_plan(plan, 64, args.force_factor)
    for name, p in plans.items():
        m, o = copy.deepcopy((model, opt))
        cfg = EngineConfig(split="fewest") if name in ("fewest", "control") else EngineConfig()
        engines[name] = Engine(m, o, lm_loss, global_batch_size=64, start=p, config=cfg)
    batches = [padded_batch(g, 64, args.longest) for _ in range(args.steps)]
    first = engines["default"].step(batches[0])  # the split is nominated on the first step
    nominated = engines["default"].split
    engines["fewest"].step(batches[0])
    if "control" in engines:
        engines["control"].step(batches[0])
    assert nominated is not None
    fewest_split = engines["fewest"].split
    forced_first = engines["forced"].step(batches[0]) if "forced" in engines else None
    if nominated.accum_steps != fewest_split.accum_steps:
        m, o = copy.deepcopy((model, opt))
        # what the engine kept before its real steps checked the split: the nomination, balanced, held
        engines["old"] = Engine(m, o, lm_loss, global_batch_size=64, start=nominated.micro_batch_size,
                                config=EngineConfig(split="fewest", adapt=False))
        engines["old"].step(batches[0])
    steps = interleave(engines, batches[1:], f"[run {args.seed}] ")
    steps["default"].insert(0, {"seconds": first.seconds, "micro": first.micro_batch_size,
                                "accum": first.accum_steps, "reason": first.micro_batch_reason})
    forced: dict[str, Any] | None = None
    if forced_first is not None:
        steps["forced"].insert(0, {"seconds": forced_first.seconds, "micro": forced_first.micro_batch_size,
                                   "accum": forced_first.accum_steps, "reason": forced_first.micro_batch_reason})
        fc, fs = engines["forced"].batcher.check, engines["forced"].split
        assert fs is not None
        forced = {"nominated": [fs.micro_batch_size, fs.accum_steps], "nominated_reason": fs.reason,
                  "timed": {str(b): t for b, t in plans["forced"].timed_points().items()},
                  "verdict": None if fc is None else fc.verdict, "ratios": None if fc is None else fc.ratios(),
                  "check_steps": None if fc is None else len(fc.seconds),
                  "final": [engines["forced"].micro_batch_size, engines["forced"].micro_batch_reason]}
    check = engines["default"].batcher.check
    return {
        "forced": forced,
        "find_seconds": find_seconds, "plan": {"batch_size": plan.batch_size, "timed": plan.timed_points()},
        "fewest": [fewest_split.micro_batch_size, fewest_split.accum_steps],
        "nominated": [nominated.micro_batch_size, nominated.accum_steps], "nominated_reason": nominated.reason,
        "verdict": None if check is None else check.verdict,
        "ratios": None if check is None else check.ratios(),
        "final": [engines["default"].micro_batch_size, engines["default"].micro_batch_reason],
        "steps": steps,
        "median": {n: statistics.median(s["seconds"] for s in st) for n, st in steps.items()},
        "paired": {n: paired(st, steps["fewest"]) for n, st in steps.items() if n != "fewest"},
    }


def paired(steps: list[dict[str, Any]], fewest: list[dict[str, Any]]) -> float:
    """The median over batches of one engine's step time over the fewest's on the same batch.

    The two steps of a pair ran one right after the other, so a burst of the co-tenant's work
    tends to stretch both: the ratio cancels what the medians of each alone keep. Only the
    batches both trained in turns count (the default's first step, at its nomination, does not).
    """
    offset = len(steps) - len(fewest)
    return statistics.median(s["seconds"] / f["seconds"] for s, f in zip(steps[offset:], fewest))


def forced_plan(plan: Any, total: int, factor: float) -> Any:
    """``plan`` with the trials smaller than the fewest micro-batch timed ``factor`` times their time.

    What a quiet moment during the small trials (and load during the large ones) does to the
    figures a split is nominated from: the issue's batch-1 trial read 0.29 s in one run and
    3.36 s in another. The default engine started from it nominates a finer split, which is
    wrong on this model, and the check against the real steps has to catch it.
    """
    forced = copy.deepcopy(plan)
    largest = min(int(forced.batch_size), total)
    fewest = -(-total // -(-total // largest))
    for t in forced.trials:
        if t.step_seconds and t.batch_size < fewest:
            t.step_seconds *= factor
    return forced


# ---------------------------------------------------------------------------
# the quiet check: speed.py's CNN, in this process


def quiet_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    from batchpilot.app.models import build_model, example_batch
    from batchpilot.core.batch import make_batch_fn

    torch.manual_seed(run)
    model = build_model("cnn", **({"widths": (4, 8, 16)} if args.quick else {}))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    make = make_batch_fn(example_batch(model, 8, generator=torch.Generator().manual_seed(run)))
    ce = torch.nn.CrossEntropyLoss()

    def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return ce(m(b[0]), b[1])

    total = args.quiet_batch
    find = FindOptions(capacity=args.quiet_capacity)
    m, o = copy.deepcopy((model, opt))
    default = Engine(m, o, loss, global_batch_size=total, config=EngineConfig(find=find))
    batches = [make(total) for _ in range(args.quiet_steps)]
    c0 = time.thread_time()
    first = default.step(batches[0])
    first_cpu = time.thread_time() - c0
    nominated = default.split
    assert nominated is not None
    engines = {"default": default}
    m, o = copy.deepcopy((model, opt))
    engines["fewest"] = Engine(m, o, loss, global_batch_size=total, start=nominated.largest_fitting,
                               config=EngineConfig(split="fewest", adapt=False))
    m, o = copy.deepcopy((model, opt))
    engines["old"] = Engine(m, o, loss, global_batch_size=total, start=nominated.micro_batch_size,
                            config=EngineConfig(split="fewest", adapt=False))
    for name in ("fewest", "old"):
        engines[name].step(batches[0])
    steps = interleave(engines, batches[1:])
    steps["default"].insert(0, {"seconds": first.seconds, "cpu": first_cpu, "micro": first.micro_batch_size,
                                "accum": first.accum_steps, "reason": first.micro_batch_reason})
    # one intra-op thread: a step's CPU time is its cost, as the finder and the check time it (the
    # wall clock of a shared machine measures the neighbours); the search is in the default's step 1
    med = {n: statistics.median(s["cpu"] for s in st[1:]) for n, st in steps.items()}
    walls = {n: statistics.median(s["seconds"] for s in st[1:]) for n, st in steps.items()}
    check = default.batcher.check
    return {"run": run, "total": total, "largest": nominated.largest_fitting,
            "nominated": [nominated.micro_batch_size, nominated.accum_steps], "nominated_reason": nominated.reason,
            "fewest": [steps["fewest"][-1]["micro"], steps["fewest"][-1]["accum"]],
            "verdict": None if check is None else check.verdict,
            "ratios": None if check is None else check.ratios(),
            "final": [default.micro_batch_size, default.micro_batch_reason], "steps": steps, "median": med,
            "wall_median": walls, "pays": med["old"] < 0.95 * med["fewest"]}


# ---------------------------------------------------------------------------


def run_busy(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    runs = list(range(args.first_run, args.first_run + args.runs))
    outputs: dict[int, str] = {}
    for start in range(0, len(runs), args.parallel):
        procs = {}
        for run in runs[start:start + args.parallel]:
            cmd = [sys.executable, __file__, "--worker", "--seed", str(run), "--steps", str(args.steps),
                   "--longest", str(args.longest), "--capacity", args.capacity,
                   "--force-factor", str(args.force_factor)] + (["--quick"] if args.quick else []) + (
                       [] if args.control else ["--no-control"])
            # its progress (stderr) passes through; its result is the line on stdout
            procs[run] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
        for run, proc in procs.items():
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"run {run} failed ({proc.returncode}):\n{out[-2000:]}")
            outputs[run] = out
    for run in runs:
        line = next(x for x in outputs[run].splitlines() if x.startswith("RESULT "))
        r = json.loads(line[len("RESULT "):])
        r["run"] = run
        med = r["median"]
        r["default_over_fewest"] = med["default"] / med["fewest"]
        r["old_over_fewest"] = med["old"] / med["fewest"] if "old" in med else None
        print(f"[busy run {run}] plan {r['plan']['batch_size']}, nominated {r['nominated']}, verdict {r['verdict']}, "
              f"default/fewest {r['default_over_fewest']:.3f}" +
              (f", old/fewest {r['old_over_fewest']:.3f}" if r["old_over_fewest"] else ""), flush=True)
        rows.append(r)
    return rows


def _split(micro_accum: list[int]) -> str:
    return f"{micro_accum[1]} x {micro_accum[0]}"


def busy_row(r: dict[str, Any]) -> tuple:
    ran = sorted({(s["accum"], s["micro"]) for s in r["steps"]["default"]})
    old, control = r["median"].get("old"), r["median"].get("control")
    pair = r.get("paired", {})
    return (r["run"], _split(r["fewest"]), _split(r["nominated"]),
            ", ".join(f"{k} x {m}: {sum(1 for s in r['steps']['default'] if s['accum'] == k)}" for k, m in ran),
            f"{r['median']['default']:.2f} s", f"{r['median']['fewest']:.2f} s",
            "-" if control is None else f"{control:.2f} s",
            "-" if old is None else f"{old:.2f} s", f"{r['default_over_fewest']:.3f}",
            f"{pair['default']:.3f}" if "default" in pair else "-",
            "-" if control is None else f"{control / r['median']['fewest']:.3f}",
            f"{pair['control']:.3f}" if "control" in pair else "-",
            "-" if r["old_over_fewest"] is None else f"{r['old_over_fewest']:.3f}",
            "met" if r["default_over_fewest"] <= 1.5 else "missed")


def forced_row(r: dict[str, Any]) -> tuple:
    f = r["forced"]
    ran = sorted({(s["accum"], s["micro"]) for s in r["steps"]["forced"]})
    timed = ", ".join(f"{b}: {t:.2f}" for b, t in sorted(((int(b), t) for b, t in f["timed"].items())))
    return (r["run"], timed, _split(f["nominated"]), f["verdict"] or "not checked",
            "-" if f["check_steps"] is None else f["check_steps"],
            "-" if not f["ratios"] else ", ".join(f"{x:.2f}" for x in f["ratios"]),
            ", ".join(f"{k} x {m}: {sum(1 for s in r['steps']['forced'] if s['accum'] == k)}" for k, m in ran),
            f"{r['median']['forced'] / r['median']['fewest']:.3f}")


def quiet_row(r: dict[str, Any]) -> tuple:
    ran = sorted({(s["accum"], s["micro"]) for s in r["steps"]["default"]})
    med = r["median"]
    ratio = med["default"] / med["old"]
    return (r["run"], r["largest"], f"{med['fewest'] * 1e3:.1f} ms", f"{_split(r['nominated'])}: "
            f"{med['old'] * 1e3:.1f} ms", ", ".join(f"{k} x {m}" for k, m in ran), f"{ratio:.3f}",
            f"{med['fewest'] / med['old']:.3f}", f"{r['wall_median']['default'] / r['wall_median']['old']:.3f}",
            ("met" if ratio <= 1 / 0.95 else "missed") if r["pays"] else "split does not pay")


def format_result(doc: dict[str, Any]) -> str:
    out = [f"split_busy: torch {doc['machine']['torch']}, {doc['date']}, co-tenant: {doc['cotenant'] or 'none'}"]
    if doc["busy"]:
        rows = doc["busy"]
        ratios = [r["default_over_fewest"] for r in rows]
        out += ["", f"busy: GPT-2 (4 x 256, vocab 5000), global 64, capacity {doc['capacity']}, {doc['steps']} steps "
                    "per engine, median step seconds (wall, StepResult.seconds); 'default ran': the splits the "
                    "default's steps ran (the check's included) and how many steps each",
                format_table(BUSY_COLUMNS, [busy_row(r) for r in rows]),
                f"default/fewest: median {statistics.median(ratios):.3f} over {len(rows)} runs, worst "
                f"{max(ratios):.3f}; goal (median <= 1.10, none over 1.5): "
                + ("met" if statistics.median(ratios) <= 1.10 and max(ratios) <= 1.5 else "missed")]
        controls = [r["median"]["control"] / r["median"]["fewest"] for r in rows if "control" in r["median"]]
        if controls:
            out.append(f"control/fewest (two engines at split='fewest', the noise of this measurement): median "
                       f"{statistics.median(controls):.3f} over {len(controls)} runs, range "
                       f"{min(controls):.3f}-{max(controls):.3f}")
        forced = [r for r in rows if r.get("forced")]
        if forced:
            fr = [r["median"]["forced"] / r["median"]["fewest"] for r in forced]
            out += ["", f"forced: the default engine from the plan with the trials below the fewest micro-batch "
                        f"timed x{doc['force_factor']} ('forced timing': s/step per size), trained beside the others; "
                        "'after steps': the real steps the check took to its verdict",
                    format_table(FORCED_COLUMNS, [forced_row(r) for r in forced]),
                    f"forced/fewest: median {statistics.median(fr):.3f} over {len(fr)} runs, worst {max(fr):.3f}; "
                    f"reverted in {sum(r['forced']['verdict'] == 'fewest' for r in forced)} of {len(forced)}"]
    if doc["quiet"]:
        out += ["", f"quiet: speed.py's CNN (train, one thread), the engine's own search at {doc['quiet_capacity']}, "
                    f"global batch {doc['quiet'][0]['total']}, median step CPU time over the steps after the first "
                    "('wall d/o': default/old by the wall clock); 'old split': the split the old rule kept; 'pays': "
                    "old <= 0.95 x fewest; goal default/old <= 1/0.95 where it pays",
                format_table(QUIET_COLUMNS, [quiet_row(r) for r in doc["quiet"]])]
    out.append(f"total {doc['seconds']:.0f} s")
    return "\n".join(out)


def merge(paths: list[Path]) -> dict[str, Any]:
    """One document from several runs' JSON files (e.g. one run each, every one under the bench lock)."""
    docs = [json.loads(p.read_text()) for p in paths]
    doc = dict(docs[0])
    doc["busy"] = sorted((r for d in docs for r in d["busy"]), key=lambda r: r["run"])
    doc["quiet"] = [r for d in docs for r in d["quiet"]]
    doc["seconds"] = sum(d["seconds"] for d in docs)
    doc["command"] = [d["command"] for d in docs]
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=8, help="busy runs, each a fresh process (default 8)")
    p.add_argument("--steps", type=int, default=8, help="steps per engine per busy run (default 8)")
    p.add_argument("--longest", type=int, default=32, help="longest sequence of the busy batches (default 32)")
    p.add_argument("--capacity", default="256MiB", help="the busy search's emulated capacity (default 256MiB)")
    p.add_argument("--first-run", type=int, default=1, help="the first busy run's number, its seed (default 1)")
    p.add_argument("--parallel", type=int, default=1,
                   help="busy runs at once (default 1); more shares the machine among them as a co-tenant does")
    p.add_argument("--cotenant", type=Path, default=None, help="cotenant.py to run beside the busy runs")
    p.add_argument("--cotenant-args", default="--procs 2 --threads 2 --on 0.1,1.5 --off 0.1,1.5",
                   help="its arguments (default: 2 processes, bursts of 0.1-1.5 s on and off)")
    p.add_argument("--force-factor", type=float, default=0.0,
                   help="also train an engine (default config) from the plan with the trials below the fewest "
                        "micro-batch timed this many times their time (e.g. 0.05): a split nominated wrongly, "
                        "which the check against real steps must catch (default 0: none)")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="leave out the control: a second engine at split='fewest' beside the first, whose ratio "
                        "to it is the noise of the measurement (default: trained)")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="print one table from the JSON files of earlier runs (each its own --runs/--first-run)")
    p.add_argument("--quiet-runs", type=int, default=3, help="quiet CNN runs (default 3; 0 skips)")
    p.add_argument("--quiet-steps", type=int, default=24, help="steps per engine per quiet run (default 24)")
    p.add_argument("--quiet-batch", type=int, default=96,
                   help="the quiet runs' global batch (default 96: twice the CNN's largest fit at 16MiB)")
    p.add_argument("--quiet-capacity", default="16MiB", help="the quiet search's emulated capacity (default 16MiB)")
    p.add_argument("--quick", action="store_true", help="tiny models, 1 run each, few steps (the tests)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.steps, args.longest = min(args.runs, 1), min(args.steps, 3), min(args.longest, 12)
        args.quiet_runs, args.quiet_steps = min(args.quiet_runs, 1), min(args.quiet_steps, 3)
        args.quiet_batch = min(args.quiet_batch, 16)
    if args.worker:
        print("RESULT " + json.dumps(busy_worker(args)), flush=True)
        return 0
    if args.merge:
        print(format_result(merge(args.merge)))
        return 0
    doc: dict[str, Any] = {
        "benchmark": "split_busy", "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/split_busy.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(), "capacity": args.capacity, "quiet_capacity": args.quiet_capacity, "steps": args.steps,
        "force_factor": args.force_factor,
        "cotenant": None if args.cotenant is None else f"{args.cotenant.name} {args.cotenant_args}",
        "busy": [], "quiet": [],
    }
    t_start = time.perf_counter()
    cotenant = None
    if args.cotenant is not None:
        # a session of its own: its worker processes are stopped with it, as one group
        cotenant = subprocess.Popen([sys.executable, str(args.cotenant), *args.cotenant_args.split(),
                                     "--seconds", "3600"], start_new_session=True)
    try:
        doc["busy"] = run_busy(args) if args.runs > 0 else []
    finally:
        if cotenant is not None:
            os.killpg(cotenant.pid, signal.SIGTERM)
            cotenant.wait()
    if args.quiet_runs > 0:
        torch.set_num_threads(1)  # as speed.py: a shared 2-core machine
        for run in range(1, args.quiet_runs + 1):
            r = quiet_run(args, run)
            print(f"[quiet run {run}] nominated {r['nominated']}, verdict {r['verdict']}, default/old "
                  f"{r['median']['default'] / r['median']['old']:.3f}", flush=True)
            doc["quiet"].append(r)
    doc["seconds"] = time.perf_counter() - t_start
    print()
    print(format_result(doc))
    if args.json is not None:
        write_json(doc, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
