"""Continuous batching under a real memory limit: transformers' defaults, hand-tuned budgets, batchpilot's config.

transformers' ``model.generate_batch`` sizes its paged KV cache from ``max_memory_percent`` of the
memory it sees (on CPU 0.6 of the host's RAM) with 8192 batch tokens. Here a 4-layer Llama built
from a config (random weights, float32, context 1024) generates for 200 requests of long-tailed
prompt lengths (median ~44 tokens, 10 over 500; 48 new tokens each, greedy), each arm in a fresh
process under a real ``RLIMIT_AS`` at what the process maps + ``--headroom`` MiB:

* ``transformers defaults``: no config;
* ``hand-tuned N MB``: ``max_memory_percent`` set so that transformers' own budget (the memory it
  turns into cache, masks and batch tensors) is N MB, with 1024 batch tokens (issue #26's hand
  tuning);
* ``batchpilot``: ``continuous_batching_config(model, gen, inputs=prompts)``, imported and sized in
  the capped process itself (its seconds, import included, are reported apart, and counted in
  ``req/s incl. sizing``).

A reference arm runs the same requests without a cap (a 256 MB budget) for the outputs. Reported per
arm: whether every request completed, the cache and batch tokens it ran with, requests per second
of ``generate_batch`` (one intra-op thread) and their ratio to the best hand-tuned budget's, and
whether the greedy outputs equal the reference's, request by request.

    python benchmarks/continuous_batching.py
    python benchmarks/continuous_batching.py --quick --json cb.json
    python benchmarks/continuous_batching.py --jobs 8      # arms side by side, one core each

Goal (issue 26): batchpilot's config completes under the cap with identical outputs, at >= 0.9x
the requests per second of the best hand-tuned budget, with 0 allocation failures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

FULL = dict(requests=200, long=10, new_tokens=48, hidden=128, layers=4, heads=4, vocab=4096, context=1024,
            headroom=176, budgets=(50, 80, 100, 120))
QUICK = dict(requests=24, long=2, new_tokens=8, hidden=64, layers=2, heads=4, vocab=512, context=512,
             headroom=128, budgets=(20, 40))
REFERENCE_BUDGET_MB = 256
COLUMNS = ("arm", "budget", "cache", "batch tokens", "completed", "seconds", "req/s", "ratio", "req/s incl. sizing",
           "identical", "note")


# ---------------------------------------------------------------------------
# One arm, in its own process


def _model_and_requests(p: dict[str, Any]):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # a wide initialisation spreads the logits, so that greedy choices are far from ties
    cfg = LlamaConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=4 * p["hidden"],
                      num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_key_value_heads=p["heads"],
                      max_position_embeddings=p["context"], initializer_range=0.2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    short = p["requests"] - p["long"]
    room = p["context"] - p["new_tokens"]
    lengths = [max(4, min(room // 2, int(n))) for n in torch.distributions.LogNormal(3.75, 0.55).sample((short,))]
    lengths += [int(n) for n in torch.randint(room // 2, room, (p["long"],), generator=g)]
    order = torch.randperm(len(lengths), generator=g).tolist()
    prompts = [torch.randint(1, p["vocab"], (lengths[i],), generator=g).tolist() for i in order]
    gen = GenerationConfig(max_new_tokens=p["new_tokens"], do_sample=False, eos_token_id=-1, pad_token_id=0)
    return model, prompts, gen


def _percent_for(budget_bytes: int) -> float:
    """The ``max_memory_percent`` at which transformers' own budget is ``budget_bytes`` in this process now."""
    from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown

    _, total, reserved, allocated = get_device_and_memory_breakdown()
    return budget_bytes / max(1, total - max(allocated, reserved))


def run_arm(arm: str, p: dict[str, Any], out_path: str) -> None:
    """Run one arm in this (fresh) process and write its record as JSON."""
    import torch
    from transformers import ContinuousBatchingConfig
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    caches = _capture_cache_sizes()
    torch.set_num_threads(1)
    model, prompts, gen = _model_and_requests(p)
    rec: dict[str, Any] = {"arm": arm, "sizing_seconds": 0.0, "note": ""}
    if arm != "reference":
        _cap(p["headroom"] * 2**20)
    cfg = None
    try:
        if arm == "batchpilot":
            began = time.perf_counter()
            # imported under the cap, as in a process its user capped first: the import is paid from the room
            from batchpilot.integrations.transformers import size_continuous_batching

            plan = size_continuous_batching(model, gen, inputs=prompts)
            rec["sizing_seconds"] = time.perf_counter() - began
            cfg = plan.config
            rec["budget"] = plan.predicted_bytes
            rec["runs"] = plan.runs
            rec["note"] = f"{len(plan.runs)} sizing runs; limit {plan.limit_bytes / 2**20:.0f} MiB"
        elif arm.startswith("hand-tuned") or arm == "reference":
            mb = REFERENCE_BUDGET_MB if arm == "reference" else int(arm.split()[1])
            rec["budget"] = mb * 10**6
            cfg = ContinuousBatchingConfig(max_memory_percent=_percent_for(mb * 10**6), max_batch_tokens=1024)
        began, cpu = time.perf_counter(), time.process_time()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cfg)
        rec["seconds"] = time.perf_counter() - began
        rec["cpu_seconds"] = time.process_time() - cpu  # every thread of the process: the generation thread too
        results = list(out.values())
        errors = [r.error for r in results if r.error]
        rec["completed"] = len(results) - len(errors)
        if errors:
            rec["note"] = _note(RuntimeError(errors[0]))
        rec["outputs"] = [list(r.generated_tokens) for r in results] if len(results) == len(prompts) else None
    except Exception as exc:
        rec.update(completed=0, seconds=None, outputs=None, note=_note(exc))
    if caches:
        rec["batch_tokens"], rec["cache"] = caches[-1]  # the run's own (sizing runs came before it)
    Path(out_path).write_text(json.dumps(rec))


def _cap(headroom: int) -> None:
    """``RLIMIT_AS`` at what this process maps now + ``headroom`` bytes.

    Read from ``/proc`` here rather than through ``_harness``, which imports batchpilot: the
    batchpilot arm must pay for every batchpilot module it imports from the room under the cap.
    """
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, mapped + headroom))


def _note(exc: BaseException) -> str:
    import re

    m = re.search(r"tried to allocate (\d+) bytes", str(exc))
    if m:
        return f"out of memory allocating {int(m.group(1)) / 10**6:.0f} MB"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


def _capture_cache_sizes() -> list[tuple[int, int]]:
    """``(max_batch_tokens, cache bytes)`` of every paged cache transformers sizes in this process (read off
    its sizing, whether or not the allocation then succeeds); its log (a traceback per failed request) muted."""
    import logging

    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    found: list[tuple[int, int]] = []
    infer = PagedAttentionMemoryHandler.infer_max_batch_tokens_and_num_sectors

    def recorded(self: Any) -> tuple[int, int]:
        tokens, sectors = infer(self)
        found.append((tokens, sectors * self.bytes_per_sector))
        return tokens, sectors

    PagedAttentionMemoryHandler.infer_max_batch_tokens_and_num_sectors = recorded
    return found


# ---------------------------------------------------------------------------
# The side-by-side table


def arms(p: dict[str, Any]) -> list[str]:
    return ["reference", "transformers defaults", *(f"hand-tuned {mb} MB" for mb in p["budgets"]), "batchpilot"]


def launch(arm: str, p: dict[str, Any], workdir: Path, cpu: int | None) -> dict[str, Any]:
    path = workdir / f"{arm.replace(' ', '_')}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(HERE), "--arm", arm, "--params", json.dumps(p), "--out", str(path)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0 or not path.exists():
        return {"arm": arm, "completed": 0, "seconds": None, "outputs": None, "sizing_seconds": 0.0,
                "note": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1][:90] if proc.stderr else ''}"}
    return json.loads(path.read_text())


def table(records: list[dict[str, Any]], p: dict[str, Any]) -> tuple[list[tuple], dict[str, Any]]:
    n = p["requests"]
    ref = next(r for r in records if r["arm"] == "reference")
    for r in records:
        ok = r.get("completed") == n and r.get("seconds")
        r["req_s"] = n / r["seconds"] if ok else None
        r["req_s_with_sizing"] = n / (r["seconds"] + r["sizing_seconds"]) if ok else None
        r["identical"] = ok and ref.get("outputs") is not None and r.get("outputs") == ref["outputs"]
    hand = [r["req_s"] for r in records if r["arm"].startswith("hand-tuned") and r["req_s"]]
    best = max(hand) if hand else None
    rows = []
    for r in records:
        ratio = r["req_s"] / best if best and r["req_s"] and r["arm"] != "reference" else None
        r["ratio"] = ratio
        rows.append((
            r["arm"], _mb(r.get("budget")), _mb(r.get("cache")), r.get("batch_tokens") or "-",
            f"{r.get('completed', 0)}/{n}", f"{r['seconds']:.1f}" if r.get("seconds") else "-",
            f"{r['req_s']:.2f}" if r["req_s"] else "-", f"{ratio:.2f}" if ratio else "-",
            f"{r['req_s_with_sizing']:.2f}" if r["req_s_with_sizing"] else "-",
            "(reference)" if r["arm"] == "reference" else "yes" if r["identical"] else "no", r.get("note", ""),
        ))
    bp = next(r for r in records if r["arm"] == "batchpilot")
    verdict = {"best_hand_tuned_req_s": best, "batchpilot_ratio": bp.get("ratio"),
               "goal_met": bool(bp["identical"] and bp.get("ratio") and bp["ratio"] >= 0.9)}
    return rows, verdict


def _mb(n: Any) -> str:
    return f"{n / 10**6:.0f} MB" if isinstance(n, (int, float)) and n else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model and 24 requests (a smoke run)")
    ap.add_argument("--headroom", type=int, default=None, help="MiB of address space over what each arm maps")
    ap.add_argument("--jobs", type=int, default=1, help="arms side by side, each pinned to a core of its own")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of the capped arms, their order rotated each round (the reference and "
                         "transformers' defaults run once); ratios are taken within a round (default 1)")
    ap.add_argument("--json", default=None, help="write the records and the table here")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm:
        run_arm(args.arm, json.loads(args.params), args.out)
        return 0
    p = dict(QUICK if args.quick else FULL)
    if args.headroom is not None:
        p["headroom"] = args.headroom
    from _harness import machine
    from batchpilot.app.report import format_table

    import tempfile
    names = arms(p)
    once = [a for a in names if a in ("reference", "transformers defaults")]
    every = [a for a in names if a not in once]
    rounds: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="bp-cb-") as tmp:
        cpus = sorted(os.sched_getaffinity(0)) if args.jobs > 1 else None
        for k in range(args.rounds):
            order = (once if k == 0 else []) + every[k % len(every):] + every[:k % len(every)]
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
                futures = [pool.submit(launch, arm, p, Path(tmp), cpus[i % len(cpus)] if cpus else None)
                           for i, arm in enumerate(order)]
                records = [f.result() for f in futures]
            if k > 0:  # the outputs are compared with the first round's reference
                records.append(rounds[0][0])
            records.sort(key=lambda r: names.index(r["arm"]))
            rounds.append(records)
    verdicts = []
    for k, records in enumerate(rounds):
        rows, verdict = table(records, p)
        verdicts.append(verdict)
        print(f"continuous batching under RLIMIT_AS = mapped + {p['headroom']} MiB; {p['requests']} requests, "
              f"{p['new_tokens']} new tokens; {p['layers']}-layer Llama, hidden {p['hidden']}, float32"
              + (f"; round {k + 1} of {args.rounds}" if args.rounds > 1 else ""))
        print(format_table(COLUMNS, rows))
        ratio = verdict["batchpilot_ratio"]
        print(f"\nbatchpilot at {ratio:.2f}x the best hand-tuned budget's req/s" if ratio else
              "\nbatchpilot did not complete", "(goal >= 0.9x, identical outputs):",
              "met" if verdict["goal_met"] else "NOT met")
    if args.rounds > 1:
        import statistics
        cpu = []  # the same ratio by CPU seconds, which the load of other work stretches less than the wall clock
        for records in rounds:
            hand = [r["cpu_seconds"] for r in records if r["arm"].startswith("hand-tuned") and r.get("req_s")]
            ours = next(r for r in records if r["arm"] == "batchpilot")
            cpu.append(min(hand) / ours["cpu_seconds"] if hand and ours.get("req_s") else 0.0)
        print(f"by CPU seconds: batchpilot / best hand-tuned median {statistics.median(cpu):.2f} "
              f"(rounds: {', '.join(f'{r:.2f}' for r in cpu)})")
        ratios = [v["batchpilot_ratio"] or 0.0 for v in verdicts]
        print(f"\nover {args.rounds} rounds: batchpilot / best hand-tuned median {statistics.median(ratios):.2f} "
              f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); goal met in "
              f"{sum(v['goal_met'] for v in verdicts)} of {args.rounds}")
    if args.json:
        for records in rounds:
            for r in records:
                r.pop("outputs", None)
        doc = {"date": datetime.date.today().isoformat(), "machine": machine(), "params": p, "records": rounds[0],
               "rounds": rounds, "verdict": verdicts[0], "verdicts": verdicts}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
