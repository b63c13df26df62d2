"""lm-eval's HFLM against BatchpilotLM on the same model, requests and memory: issue #26's side-by-side run.

A 4-layer Llama built from a config (random weights, float32, context 1024) and a word-level
tokenizer built locally (tests/helpers/tiny_llama.py), requests built by hand with long-tailed
lengths: 360 ``loglikelihood`` (median context 43 tokens, 20 over 800), 200 greedy
``generate_until`` (median prompt 44, 10 over 500, ``max_gen_toks`` 48) and 24
``loglikelihood_rolling`` documents (3 longer than the context).

Every (task, method) runs in a fresh process (forked from a server that has imported torch,
transformers and lm-eval) that builds the model and its requests, warms up with one tiny forward
and ``generate``, and only then caps its address space with ``RLIMIT_AS`` at what is mapped plus
``--headroom-mib`` (176). Past it PyTorch raises its real ``DefaultCPUAllocator`` error. Methods:

- ``hflm auto``: ``HFLM(batch_size="auto")`` as released (Accelerate's search from 64, ×0.9 per OOM);
- ``hflm N``: ``HFLM(batch_size=N)``, a fixed size (1, and for generation the sizes ``--fixed``);
- ``batchpilot``: ``BatchpilotLM`` told nothing about the cap (it measures the real memory).

Columns: requests per second over the whole call (sizing included), the model's forward calls
(``_model_call``) or ``generate`` calls, the allocator OOMs among them, and whether the results
equal ``hflm 1``'s (log-likelihoods to 1e-4 relative, greedy flags and generations exactly);
``× best fixed by cpu``: the best fixed size's CPU seconds for the call over this method's (one
torch thread, so the load of other work on a shared machine does not stretch it as it does the
wall clock); ``minor_faults``: pages the call touched first (a block with a mapping of its own faults
in every page each time). ``--rounds N`` runs every method but the reference N times, in turns.

    python benchmarks/lm_eval_side_by_side.py                 # the full run (minutes)
    python benchmarks/lm_eval_side_by_side.py --quick         # a small model and a few requests: a smoke test
    python benchmarks/lm_eval_side_by_side.py --tasks loglikelihood --json out.json
    python benchmarks/lm_eval_side_by_side.py --tasks generate_until --methods "batchpilot,hflm 13" \
        --env MALLOC_MMAP_THRESHOLD_=1048576,MALLOC_ARENA_MAX=1,TOKENIZERS_PARALLELISM=false

Children run with one torch thread, one glibc arena and glibc's mmap threshold fixed at 128 KiB
(``_harness.child_env``), unless ``--env`` says how the user set up their process: then glibc's
threshold is left as the user's variables leave it (dynamic unless they set one), ``KEY=VALUE``
sets a variable and ``KEY=`` removes one (``MALLOC_ARENA_MAX=``: glibc's arenas per core).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from _harness import ForkRunner, cap_address_space, is_allocator_oom, machine  # noqa: E402

MiB = 2**20
TASKS = ("loglikelihood", "generate_until", "loglikelihood_rolling")
PRELOAD = ("torch", "_harness", "lm_eval_side_by_side", "tiny_llama", "transformers", "tokenizers", "lm_eval.models.huggingface",
           "batchpilot.integrations.lm_eval", "batchpilot.find.finder")
HAS_GENERATE = importlib.util.find_spec("batchpilot.infer.generate") is not None

#: the workload of issue #26, and the smoke test's
FULL = {"context": 1024, "layers": 4, "hidden": 64, "words": 1000, "headroom_mib": 176,
        "loglikelihood": {"n": 360, "median": 43, "long": 20, "long_from": 800},
        "generate_until": {"n": 200, "median": 44, "long": 10, "long_from": 500, "max_gen_toks": 48},
        "loglikelihood_rolling": {"n": 24, "median": 300, "long": 3}, "fixed": (8, 13, 16)}
QUICK = {"context": 256, "layers": 2, "hidden": 32, "words": 200, "headroom_mib": 48,
         "loglikelihood": {"n": 60, "median": 20, "long": 4, "long_from": 200},
         "generate_until": {"n": 16, "median": 16, "long": 2, "long_from": 120, "max_gen_toks": 8},
         "loglikelihood_rolling": {"n": 6, "median": 80, "long": 1}, "fixed": (8,)}


# ---------------------------------------------------------------------------
# the workload: built alike in every process from the config


def _lengths(n: int, median: int, long: int, lo: int, hi: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    out = [max(2, min(lo - 1, round(rng.lognormvariate(0, 0.6) * median))) for _ in range(n - long)]
    out += [rng.randint(lo, hi) for _ in range(long)]
    rng.shuffle(out)
    return out


def requests(config: dict[str, Any], task: str) -> list[Any]:
    """The requests of ``task``, as lm-eval ``Instance`` objects (deterministic)."""
    import tiny_llama
    from lm_eval.api.instance import Instance

    ctx, spec, words = config["context"], config[task], config["words"]
    if task == "loglikelihood":
        counts = _lengths(spec["n"], spec["median"], spec["long"], spec["long_from"], ctx - 4, seed=1)
        texts = tiny_llama.texts(counts, words=words, seed=1)
        conts = tiny_llama.texts([1 + k % 3 for k in range(spec["n"])], words=words, seed=2)
        return [Instance("loglikelihood", {}, (t, " " + c), i) for i, (t, c) in enumerate(zip(texts, conts))]
    if task == "generate_until":
        counts = _lengths(spec["n"], spec["median"], spec["long"], spec["long_from"], ctx - spec["max_gen_toks"] - 8,
                          seed=3)
        kwargs = {"until": ["w0 w0 w0"], "max_gen_toks": spec["max_gen_toks"], "do_sample": False}
        return [Instance("generate_until", {}, (t, dict(kwargs)), i)
                for i, t in enumerate(tiny_llama.texts(counts, words=words, seed=3))]
    counts = _lengths(spec["n"], spec["median"], spec["long"], ctx + 1, 2 * ctx + ctx // 2, seed=5)
    return [Instance("loglikelihood_rolling", {}, (t,), i)
            for i, t in enumerate(tiny_llama.texts(counts, words=words, seed=5))]


# ---------------------------------------------------------------------------
# a child: one (task, method) in a fresh process


class _Counted:
    """Calls of a bound method, and the allocator OOMs among them (re-raised as they came)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls, self.ooms = fn, 0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            return self.fn(*args, **kwargs)
        except RuntimeError as exc:
            if is_allocator_oom(exc):
                self.ooms += 1
            raise


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import tiny_llama
    from lm_eval.models.huggingface import HFLM

    from batchpilot.integrations.lm_eval import BatchpilotLM

    config, task, method = spec["config"], spec["task"], spec["method"]
    torch.set_num_threads(1)
    model = tiny_llama.model(context=config["context"], layers=config["layers"], hidden=config["hidden"],
                             words=config["words"])
    tok = tiny_llama.tokenizer(words=config["words"])
    asks = requests(config, task)
    if method == "batchpilot":
        lm = BatchpilotLM(pretrained=model, tokenizer=tok)
    else:
        size = method.split()[-1]
        lm = HFLM(pretrained=model, tokenizer=tok, batch_size=size if size == "auto" else int(size))
    with torch.no_grad():  # lazy initialisation (kernels, generation config) before the cap
        model(torch.ones(1, 8, dtype=torch.long))
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False, pad_token_id=1)
    forward = _Counted(lm._model_call)
    lm._model_call = forward
    generate = _Counted(model.generate)
    model.generate = generate
    cap_address_space(config["headroom_mib"] * MiB)
    started, cpu = time.perf_counter(), time.process_time()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    try:
        out = getattr(lm, task)(asks, disable_tqdm=True)
        error = None
    except Exception as exc:  # a method that dies under the cap is a row, not a crash of the benchmark
        out, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    seconds = time.perf_counter() - started
    doc: dict[str, Any] = {"task": task, "method": method, "seconds": seconds, "results": out, "error": error,
                           "cpu_seconds": time.process_time() - cpu,
                           # pages first touched: each fresh mapping of a large block costs one per 4 KiB
                           "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                           "forward_calls": forward.calls, "generate_calls": generate.calls,
                           "ooms": forward.ooms + generate.ooms, "n": len(asks)}
    if method == "batchpilot" and task != "generate_until":
        batches = lm.scorer.batches
        doc["trials"] = sum(b.trial for b in batches)
        doc["trials_per_length"] = {str(L): p.num_trials for L, p in (lm.scorer.plan.length_plans.items()
                                                                       if lm.scorer.plan else ())}
        first_real = next((k for k, b in enumerate(batches) if not b.trial), len(batches))
        doc["ooms_after_first_batch"] = sum(b.oom for b in batches[first_real + 1:])
        doc["sizing_seconds"] = lm.scorer.plan.seconds if lm.scorer.plan else 0.0
    if method == "batchpilot" and task == "generate_until":
        runs = lm.generations
        per_length: dict[str, int] = {}
        for g in runs:
            for t in g.trials:
                per_length[str(t.prompt_length)] = per_length.get(str(t.prompt_length), 0) + 1
        doc["trials"] = sum(len(g.trials) for g in runs)
        doc["trials_per_length"] = per_length
        doc["prompts_in_trials"] = sum(len(t.prompts) for g in runs for t in g.trials if t.outputs)
        doc["batches"] = [b[:2] for g in runs for b in g.batches]
        doc["ooms_after_first_batch"] = sum(g.ooms for g in runs)
        doc["sizing_seconds"] = sum(g.sizing_seconds for g in runs)
    if method == "hflm auto":
        doc["batch_sizes"] = sorted(set(lm.batch_sizes.values())) if lm.batch_sizes else None
    return doc


# ---------------------------------------------------------------------------
# the parent: every row, compared with batch size 1


def methods_for(task: str, config: dict[str, Any], only: list[str] | None = None) -> list[str]:
    """The methods run for ``task`` (``only``: those of them, with ``hflm 1``, the reference, always)."""
    fixed = [f"hflm {n}" for n in config["fixed"]] if task == "generate_until" else []
    ours = ["batchpilot"] if task != "generate_until" or HAS_GENERATE else []
    every = ["hflm 1", "hflm auto", *fixed, *ours]
    return every if only is None else [m for m in every if m == "hflm 1" or m in only]


def parse_env(text: str) -> dict[str, str | None]:
    """``"K=V,K2=,..."`` -> ``{"K": "V", "K2": None}`` (an empty value removes the variable)."""
    out: dict[str, str | None] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--env takes KEY=VALUE items separated by commas, got {item!r}")
        out[key] = value or None
    return out


def _same(task: str, got: Any, want: Any) -> str:
    if got is None or want is None:
        return "-"
    if task == "generate_until":
        return "yes" if got == want else f"no ({sum(a != b for a, b in zip(got, want))} differ)"
    if task == "loglikelihood":
        flags = all(a[1] == b[1] for a, b in zip(got, want))
        got, want = [a[0] for a in got], [b[0] for b in want]
    else:
        flags = True
    close = all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-3) for a, b in zip(got, want))
    return "yes" if close and flags and len(got) == len(want) else "no"


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = QUICK if args.quick else FULL
    config = {**config, "headroom_mib": args.headroom_mib or config["headroom_mib"]}
    # a user's own set-up: glibc's threshold as their variables leave it
    runner = ForkRunner(PRELOAD, malloc="dynamic", env=args.env) if args.env else ForkRunner(PRELOAD)
    rows = []
    started = time.perf_counter()

    def one(task: str, method: str) -> dict[str, Any]:
        r = runner("lm_eval_side_by_side", "measure", {"config": config, "task": task, "method": method},
                   timeout=args.timeout)
        doc = r.data if r.ok else {"task": task, "method": method, "error": r.stderr.splitlines()[-1][:120]
                                   if r.stderr else f"exit {r.returncode}", "results": None}
        print(f"  {task:22s} {method:11s} {doc.get('seconds', float('nan')):7.1f} s"
              f"{'  ' + doc['error'] if doc.get('error') else ''}", flush=True)
        return doc

    for task in args.tasks:
        methods = methods_for(task, config, args.methods)
        # the reference (hflm 1) runs once; the others take turns, their order rotated each round, so
        # that the arms compared share the machine's load of the same minutes
        others = [m for m in methods if m != "hflm 1"]
        base = one(task, "hflm 1")
        for k in range(args.rounds):
            docs = {"hflm 1": base}
            for method in others[k % max(1, len(others)):] + others[:k % max(1, len(others))]:
                docs[method] = one(task, method)
            docs = {m: docs[m] for m in methods}
            rows += _rows(task, docs, base, round_=k + 1 if args.rounds > 1 else None)
        if task == "generate_until" and not HAS_GENERATE:
            rows.append({"task": task, "method": "batchpilot", "error": "batchpilot.infer.generate is not in this "
                         "tree (generate_by_length): no row"})
    return {"benchmark": "lm_eval_side_by_side", "quick": args.quick, "config": config, "env": args.env, "rows": rows,
            "rounds": args.rounds, "seconds": time.perf_counter() - started, "machine": machine(),
            "date": datetime.date.today().isoformat()}


def _rows(task: str, docs: dict[str, dict[str, Any]], base: dict[str, Any], round_: int | None) -> list[dict[str, Any]]:
    """One row per method of one task (one round of it), its ratios against the same round's arms."""
    rows = []
    auto = docs.get("hflm auto", {})
    for method, doc in docs.items():
        calls = doc.get("generate_calls") if task == "generate_until" else doc.get("forward_calls")
        row = {"task": task, "method": method, "n": doc.get("n"), "seconds": doc.get("seconds"),
               "req/s": doc["n"] / doc["seconds"] if doc.get("seconds") and doc.get("results") else None,
               "calls": calls, "ooms": doc.get("ooms"), "same as hflm 1": _same(task, doc.get("results"),
                                                                                 base.get("results")),
               "error": doc.get("error")}
        for key in ("minor_faults", "trials", "trials_per_length", "ooms_after_first_batch", "sizing_seconds", "batch_sizes",
                    "prompts_in_trials", "batches"):
            if key in doc:
                row[key] = doc[key]
        if row["req/s"] and auto.get("seconds") and auto.get("results"):
            row["× auto req/s"] = row["req/s"] / (auto["n"] / auto["seconds"])
        fixed = [d["n"] / d["seconds"] for m, d in docs.items() if m.startswith("hflm ") and m != "hflm auto"
                 and d.get("seconds") and d.get("results")]
        if row["req/s"] and fixed:
            row["× best fixed req/s"] = row["req/s"] / max(fixed)
        # the same by the process's CPU time (one torch thread): what the load of other work does not stretch
        fixed_cpu = [d["cpu_seconds"] for m, d in docs.items() if m.startswith("hflm ") and m != "hflm auto"
                     and d.get("cpu_seconds") and d.get("results")]
        if row["req/s"] and doc.get("cpu_seconds") and fixed_cpu:
            row["cpu s"] = doc["cpu_seconds"]
            row["× best fixed by cpu"] = min(fixed_cpu) / doc["cpu_seconds"]
        if round_ is not None:
            row["round"] = round_
        rows.append(row)
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (task, method) over the rounds: the median req/s and the median of each round's ratios."""
    out = []
    keys = list(dict.fromkeys((r["task"], r["method"]) for r in rows if "round" in r))
    for task, method in keys:
        mine = [r for r in rows if r["task"] == task and r["method"] == method and "round" in r]
        row: dict[str, Any] = {"task": task, "method": method, "round": f"median of {len(mine)}"}
        for col in ("req/s", "× best fixed req/s", "× best fixed by cpu", "cpu s", "× auto req/s", "calls", "ooms",
                    "minor_faults"):
            got = [r[col] for r in mine if r.get(col) is not None]
            row[col] = statistics.median(got) if len(got) == len(mine) else None
        row["same as hflm 1"] = "yes" if all(r.get("same as hflm 1") == "yes" for r in mine) else "no"
        row["seconds"] = statistics.median(r["seconds"] for r in mine if r.get("seconds")) if any(
            r.get("seconds") for r in mine) else None
        out.append(row)
    return out


COLUMNS = ("task", "round", "method", "req/s", "× auto req/s", "× best fixed req/s", "× best fixed by cpu", "calls", "ooms",
           "same as hflm 1", "seconds", "cpu s", "minor_faults", "note")


def _cell(row: dict[str, Any], col: str) -> str:
    if col == "note":
        bits = []
        if row.get("batch_sizes"):
            bits.append(f"sizes {row['batch_sizes']}")
        if "prompts_in_trials" in row:  # generate: the trials ran real prompts, whose outputs are kept
            bits.append(f"{row['trials']} trials {row.get('trials_per_length')} holding {row['prompts_in_trials']} "
                        f"prompts, sizing {row['sizing_seconds']:.1f} s, then batches (size, padded) "
                        f"{[tuple(b) for b in row['batches']]}")
        elif "trials" in row:
            bits.append(f"{row['trials']} trials {row.get('trials_per_length')}, sizing {row['sizing_seconds']:.1f} s, "
                        f"{row['ooms_after_first_batch']} OOMs after the first batch")
        if row.get("error"):
            bits.append(row["error"])
        return "; ".join(bits)
    v = row.get(col)
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and a few requests (a smoke test)")
    p.add_argument("--tasks", type=lambda s: [t for t in s.split(",") if t], default=list(TASKS),
                   help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--headroom-mib", type=int, default=None,
                   help="address space allowed beyond what each process maps after its warm-up (default 176; --quick 48)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per process")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of every method but the reference (hflm 1, run once), their order rotated each "
                        "round; ratios are taken within a round and their medians reported (default 1)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--methods", type=lambda s: [m.strip() for m in s.split(",") if m.strip()], default=None,
                   help="comma-separated methods to run (hflm 1, the reference, always runs), e.g. 'batchpilot,hflm 13'")
    p.add_argument("--env", type=parse_env, default=None,
                   help="the user's own process set-up, e.g. MALLOC_MMAP_THRESHOLD_=1048576,MALLOC_ARENA_MAX=1 "
                        "(KEY= removes a variable); glibc's threshold is then theirs, not the harness's 128 KiB")
    args = p.parse_args(argv)
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        p.error(f"unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    c = result["config"]
    setup = ("env " + ",".join(f"{k}={v or ''}" for k, v in args.env.items())) if args.env else \
        "glibc threshold fixed at 128 KiB, one arena"
    print(f"\nlm_eval side by side: {c['layers']}-layer Llama (hidden {c['hidden']}, context {c['context']}, "
          f"{c['words']} words), each run in a fresh process under RLIMIT_AS = its address space + "
          f"{c['headroom_mib']} MiB, {setup}; torch {result['machine']['torch']}, {result['date']}")
    print(table(result["rows"]))
    if result["rounds"] > 1:
        print(f"\nmedians over {result['rounds']} rounds (ratios: the median of each round's own)")
        print(table(medians(result["rows"])))
    print(f"total {result['seconds']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
