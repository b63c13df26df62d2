"""TRL's GRPOTrainer against batchpilot's ResilientGRPOTrainer under the same memory caps: issue #39's side by side.

A Llama built from a config (random weights, float32) and a word-level tokenizer built locally
(tests/helpers/tiny_llama.py); 256 prompts with long-tailed lengths (10% of 300-600 words, the rest
log-normal around 12), 4 generations each, ``max_completion_length`` 64, a cheap reward, beta 0,
TRL's defaults otherwise (gradient checkpointing on). Every arm runs in a fresh process forked from
a server that has imported torch, transformers and trl; it builds the model and the trainer, and
only then, just before ``train()``, caps its address space with ``RLIMIT_AS`` at what is mapped
plus the headroom (none: uncapped). Every arm does the same work: ``--steps`` optimizer steps of 32
completions (8 prompts × 4), the same prompts in the same order.

Arms: ``trl B×A``: ``GRPOTrainer`` with ``per_device_train_batch_size=B``,
``gradient_accumulation_steps=A`` (B × A = 32, generation batch 32), the hand-picked settings a
patient user would try; ``batchpilot 32×1``: ``ResilientGRPOTrainer`` on the config as asked
(per-device 32), told nothing about the cap.

Columns: completed, the OOMs survived (training + generation) and how many after the first step,
completions per second over ``train()`` (sizing included), ``generate`` calls.

    python benchmarks/trl_grpo.py                      # the full run (many minutes on 2 cores)
    python benchmarks/trl_grpo.py --mid                # a smaller workload, caps scaled to it
    python benchmarks/trl_grpo.py --quick              # a small model, one cap: a smoke test
    python benchmarks/trl_grpo.py --exactness          # the update against TRL's per loss_type, and TRL's own spread
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from _harness import ForkRunner, cap_address_space, is_allocator_oom, machine  # noqa: E402

MiB = 2**20
PRELOAD = ("torch", "_harness", "trl_grpo", "tiny_llama", "transformers", "datasets", "trl",
           "batchpilot.integrations.trl")

FULL = {"context": 1024, "layers": 4, "hidden": 64, "words": 1000, "prompts": 256, "new": 64, "steps": 4,
        "caps": [None, 1280, 1024, 512, 256], "trl": [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2), (32, 1)]}
#: a smaller workload with caps scaled to it, for a machine where FULL's 25 fresh processes take hours
MID = {"context": 512, "layers": 2, "hidden": 64, "words": 1000, "prompts": 256, "new": 16, "steps": 2,
       "caps": [None, 256, 128, 64], "trl": [(4, 8), (8, 4), (32, 1)]}
QUICK = {"context": 256, "layers": 2, "hidden": 32, "words": 200, "prompts": 32, "new": 8, "steps": 2,
         "caps": [None], "trl": [(32, 1)]}


def prompts(config: dict[str, Any]) -> list[str]:
    """The prompts: long-tailed word counts, 10% long (300-600 words, or a quarter of a small context)."""
    import random

    import tiny_llama

    n, ctx = config["prompts"], config["context"]
    rng = random.Random(0)
    lo, hi = (300, 600) if ctx >= 1024 else (ctx // 4, ctx // 2) if ctx < 512 else (150, 300)
    long = n // 10
    counts = [max(2, min(lo - 1, round(rng.lognormvariate(0, 0.6) * 12))) for _ in range(n - long)]
    counts += [rng.randint(lo, hi) for _ in range(long)]
    rng.shuffle(counts)
    return tiny_llama.texts(counts, words=config["words"], seed=1)


def arm(spec: dict[str, Any]) -> dict[str, Any]:
    """One arm in this (fresh) process: build, cap, train; what happened."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    import tiny_llama
    from batchpilot.integrations.trl import ResilientGRPOTrainer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    config = spec["config"]
    tok = tiny_llama.tokenizer(config["words"])
    model = tiny_llama.model(context=config["context"], layers=config["layers"], hidden=config["hidden"],
                             words=config["words"]).train()
    per_device, accum = spec["per_device"], spec["accum"]
    args = GRPOConfig(
        output_dir=spec["out"], per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
        generation_batch_size=32, num_generations=4, max_completion_length=config["new"],
        max_steps=config["steps"], report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        logging_steps=1, beta=0.0,
    )

    def reward(completions, **kwargs):
        return [len(set(c.split())) / 10 for c in completions]

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    steps = Steps()
    cls = ResilientGRPOTrainer if spec["method"] == "batchpilot" else GRPOTrainer
    trainer = cls(model=model, reward_funcs=reward, args=args, processing_class=tok, callbacks=[steps],
                  train_dataset=Dataset.from_dict({"prompt": prompts(config)}))
    calls = []
    if cls is GRPOTrainer:  # count TRL's generate calls
        original = trainer.model.generate

        def counted(*a, **k):
            calls.append(1)
            return original(*a, **k)

        trainer.model.generate = counted
    if spec["headroom_mib"] is not None:
        cap_address_space(spec["headroom_mib"] * MiB)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"completed": False, "steps": 0}
    try:
        trainer.train()
        out["completed"] = True
    except Exception as exc:  # a crash is the arm's result
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
        out["oom"] = is_allocator_oom(exc)
    seconds = time.perf_counter() - t0
    out["steps"] = trainer.state.global_step
    out["seconds"] = seconds
    out["completions_per_s"] = 32 * out["steps"] / seconds if out["completed"] else None
    if cls is ResilientGRPOTrainer:
        gens = trainer.batchpilot_generation
        engine = trainer.batchpilot_engine
        out["generate_calls"] = sum(g.calls for g in gens)
        out["generation_ooms"] = sum(g.ooms for g in gens)
        out["generation_ooms_after_first"] = sum(g.ooms for g in gens[1:])
        out["sizing_seconds"] = sum(g.sizing_seconds for g in gens)
        out["train_ooms"] = sum(trainer.batchpilot_step_ooms)
        out["train_ooms_after_first"] = sum(trainer.batchpilot_step_ooms[1:])
        out["micro_batch"] = None if engine is None else engine.micro_batch_size
    else:
        out["generate_calls"] = len(calls)
    return out


#: what each loss_type needs besides its name (TRL refuses luspo at token level)
LOSS_CONFIG = {"luspo": {"importance_sampling_level": "sequence"}}


def exactness(loss_types: list[str]) -> list[dict[str, Any]]:
    """Relative gradient error ``‖a − b‖ / ‖b‖`` on test_trl's fixed rollouts, per loss_type, dtype and LM head.

    Heads: ``trl``, TRL's fused LM head as it ships (float32 statistics and head gradients whatever the
    dtype); ``exact``, the same function in the model's dtype (tests/helpers/trl_exact_head.py).
    ``vs TRL``: against ``GRPOTrainer`` at per-device 4 × accumulation 2 with the same dtype and head
    (the issue's measure): TRL itself at 8 × 1 and 2 × 4 (bnpo: another objective, not shown), and
    batchpilot at micro-batches of 8, 3 and 1. ``vs exact``: every run against the float64 update with
    the exact head (``GRPOTrainer`` 4 × 2), i.e. how far each lies from the true update.
    """
    import importlib
    from contextlib import nullcontext

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
    t = importlib.import_module("test_trl")
    from trl import GRPOTrainer
    from trl_exact_head import exact_head

    from batchpilot.integrations.trl import ResilientGRPOTrainer

    rows = []
    tmp = Path("/tmp/bp_trl_exactness")
    for loss in loss_types:
        cfg = LOSS_CONFIG.get(loss, {})
        runs: dict[tuple[str, str, str], dict] = {}
        for head in ("exact", "trl"):
            with exact_head() if head == "exact" else nullcontext():
                for dtype in (torch.float64, torch.float32):
                    name = str(dtype).replace("torch.", "")
                    for b, a in ((4, 2), (8, 1), (2, 4)):
                        runs[head, name, f"trl {b}x{a}"] = t._run(
                            GRPOTrainer, loss_type=loss, dtype=dtype, tmp_path=tmp, per_device=b, accum=a,
                            config=cfg)[1][0]
                    for micro in (8, 3, 1):
                        runs[head, name, f"batchpilot micro {micro}"] = t._run(
                            ResilientGRPOTrainer, loss_type=loss, dtype=dtype, tmp_path=tmp, config=cfg,
                            micro_batch_size=micro)[1][0]
        truth = runs["exact", "float64", "trl 4x2"]
        for (head, name, arm), grads in runs.items():
            ref = runs[head, name, "trl 4x2"]
            other_objective = loss == "bnpo" and arm in ("trl 8x1", "trl 2x4")
            row = {"loss_type": loss, "head": head, "dtype": name, "arm": arm,
                   "vs_trl": None if arm == "trl 4x2" or other_objective else t._relative_error(grads, ref),
                   "vs_exact": t._relative_error({k: v.double() for k, v in grads.items()}, truth)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def exactness_table(rows: list[dict[str, Any]]) -> str:
    """One line per (loss_type, head, dtype): vs TRL 4×2 (and vs the exact float64 update) for each arm."""
    arms = ["trl 4x2", "trl 8x1", "trl 2x4", "batchpilot micro 8", "batchpilot micro 3", "batchpilot micro 1"]
    lines = ["| loss_type | LM head | dtype | " + " | ".join(arms) + " |", "|---|---|---|" + "---|" * len(arms)]
    keys = sorted({(r["loss_type"], r["head"], r["dtype"]) for r in rows}, key=lambda k: (
        [r["loss_type"] for r in rows].index(k[0]), k[1] != "trl", k[2] != "float32"))
    for key in keys:
        cells = []
        for arm in arms:
            r = next(r for r in rows if (r["loss_type"], r["head"], r["dtype"], r["arm"]) == (*key, arm))
            vs = "-" if r["vs_trl"] is None else f"{r['vs_trl']:.1e}"
            cells.append(f"{vs} ({r['vs_exact']:.1e})")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(config: dict[str, Any], caps: list[int | None], out_dir: Path, timeout: float,
        only: list[str] | None = None) -> list[dict[str, Any]]:
    runner = ForkRunner(PRELOAD)
    rows = []
    arms = [("batchpilot", 32, 1)] + [("trl", b, a) for b, a in config["trl"]]
    if only:
        arms = [(m, b, a) for m, b, a in arms if f"{m} {b}x{a}" in only]
    for cap in caps:
        for method, b, a in arms:
            spec = {"config": config, "method": method, "per_device": b, "accum": a, "headroom_mib": cap,
                    "out": str(out_dir / f"{method}_{b}x{a}_{cap}")}
            res = runner("trl_grpo", "arm", spec, timeout=timeout)
            row = {"cap_mib": cap, "arm": f"{method} {b}x{a}", **(res.data or {"completed": False,
                                                                             "error": res.stderr[-300:]})}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| headroom | arm | completes | steps | OOMs survived: train, gen (after step 1) | completions/s | generate calls |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cap = "none" if r["cap_mib"] is None else f"{r['cap_mib']} MiB"
        speed = "-" if not r.get("completions_per_s") else f"{r['completions_per_s']:.2f}"
        gen = "-" if r.get("train_ooms") is None else (
            f"{r['train_ooms']}, {r['generation_ooms']} ({r['train_ooms_after_first'] + r['generation_ooms_after_first']})")
        lines.append(f"| {cap} | {r['arm']} | {'yes' if r.get('completed') else 'no: ' + str(r.get('error', ''))[:60]} "
                     f"| {r.get('steps', 0)} | {gen} | {speed} | {r.get('generate_calls', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model, uncapped: a smoke test")
    p.add_argument("--mid", action="store_true", help="a 2-layer model, 150-300-word long prompts, 16 new tokens, "
                   "2 steps, caps none,256,128,64 MiB")
    p.add_argument("--caps", type=lambda s: [None if c == "none" else int(c) for c in s.split(",")], default=None,
                   help="headrooms in MiB, 'none' for uncapped (default: none,1280,1024,512,256)")
    p.add_argument("--exactness", action="store_true", help="the gradient table per loss_type instead")
    p.add_argument("--loss-types", type=lambda s: s.split(","), default=None,
                   help="with --exactness: these loss_types (default: every one TRL offers)")
    p.add_argument("--arms", type=lambda s: s.split(","), default=None,
                   help="only these arms, e.g. 'batchpilot 32x1,trl 4x8' (default: all)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per process")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    if args.exactness:
        from batchpilot.integrations.trl import LOSS_SHARES

        rows = exactness(args.loss_types or list(LOSS_SHARES))
        print(f"\n{datetime.date.today()} {machine()}\n")
        print(exactness_table(rows))
    else:
        config = QUICK if args.quick else MID if args.mid else FULL
        out = Path("/tmp/bp_trl_grpo")
        rows = run(config, args.caps or config["caps"], out, args.timeout, args.arms)
        print(f"\n{datetime.date.today()} {machine()}\n")
        print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
