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
    phases = _log_phases(GRPOTrainer)
    cls = ResilientGRPOTrainer if spec["method"] == "batchpilot" else GRPOTrainer
    trainer = cls(model=model, reward_funcs=reward, args=args, processing_class=tok, callbacks=[steps],
                  train_dataset=Dataset.from_dict({"prompt": prompts(config)}))
    calls = []
    original = trainer.model.generate

    def counted(*a, **k):  # TRL's generate calls (batchpilot counts its own), each logged with its size
        ids = k.get("input_ids", a[0] if a else None)
        began = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            calls.append(1)
            phases.append(("generate", *_shape(ids), time.perf_counter() - began))

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
    out["phases"] = phases
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


def _shape(t: Any) -> tuple[int, int]:
    return (int(t.size(0)), int(t.size(1))) if t is not None and t.dim() == 2 else (0, 0)


def _log_phases(trl_class: Any) -> list[tuple[str, int, int, float]]:
    """Log every phase call of this (fresh) process: ``(phase, rows, width, seconds)``.

    Phases: ``generate`` (one ``generate`` call, rows × padded prompt width; logged by the caller),
    ``score`` (a log-prob forward without gradients), ``forward`` (a training forward, rows × width
    of the micro-batch), ``step`` (one optimizer step's ``training_step``, generation and backward
    included; rows are the step's). Patched on TRL's class, which both arms run through.
    """
    log: list[tuple[str, int, int, float]] = []
    logps = trl_class._get_per_token_logps_and_entropies
    training_step = trl_class.training_step

    def timed_logps(self, model, input_ids, *a, **k):
        began = time.perf_counter()
        try:
            return logps(self, model, input_ids, *a, **k)
        finally:
            import torch

            phase = "forward" if torch.is_grad_enabled() else "score"
            log.append((phase, *_shape(input_ids), time.perf_counter() - began))

    def timed_step(self, model, inputs, *a, **k):
        began = time.perf_counter()
        try:
            return training_step(self, model, inputs, *a, **k)
        finally:
            log.append(("step", len(inputs), 0, time.perf_counter() - began))

    trl_class._get_per_token_logps_and_entropies = timed_logps
    trl_class.training_step = timed_step
    return log


def phase_summary(rows: list[dict[str, Any]]) -> str:
    """Per arm: the sizes each phase ran at (rows × width, count) and its seconds in all."""
    lines = ["| headroom | arm | phase | calls | rows × width (calls) | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        cap = "none" if r["cap_mib"] is None else f"{r['cap_mib']} MiB"
        for phase in ("generate", "score", "forward", "step"):
            calls = [c for c in r.get("phases") or [] if c[0] == phase]
            if not calls:
                continue
            sizes: dict[str, int] = {}
            for c in calls:
                key = f"{c[1]}" if phase == "step" else f"{c[1]}×{c[2]}"
                sizes[key] = sizes.get(key, 0) + 1
            shown = ", ".join(f"{k} ({v})" if v > 1 else k for k, v in sizes.items())
            lines.append(f"| {cap} | {r['arm']} | {phase} | {len(calls)} | {shown} | {sum(c[3] for c in calls):.1f} |")
    return "\n".join(lines)


#: what each loss_type needs besides its name (TRL refuses luspo at token level)
LOSS_CONFIG = {"luspo": {"importance_sampling_level": "sequence"}}


#: TRL's own accumulations of the 8 completions of one step: the reference (4 × 2) and the same objective cut otherwise
TRL_SPLITS = ((4, 2), (8, 1), (2, 4), (1, 8))
#: batchpilot's micro-batches on the reference's config (per-device 4 × accumulation 2): rows sorted by length,
#: so micro-batches of 3 cross TRL's of 4
BP_MICROS = (8, 4, 3, 1)


def exactness(loss_types: list[str], dtypes: list[str], heads: list[str] = ("trl", "exact"),
              seeds: list[int] = (1,)) -> list[dict[str, Any]]:
    """Relative gradient error ``‖a − b‖ / ‖b‖`` on test_trl's fixed rollouts, per loss_type, dtype, LM head and seed.

    Heads: ``trl``, TRL's fused LM head as it ships (float32 statistics and head gradients whatever the
    dtype); ``exact``, the same function in the model's dtype (tests/helpers/trl_exact_head.py).
    ``vs_trl``: against ``GRPOTrainer`` at per-device 4 × accumulation 2 with the same dtype and head
    (the issue's measure): TRL itself at 8 × 1, 2 × 4 and 1 × 8 (bnpo: another objective, not shown), and
    batchpilot at micro-batches of 8, 4, 3 and 1. ``vs_exact``: every run against the float64 update with
    the exact head (``GRPOTrainer`` 4 × 2), i.e. how far each lies from the true update. ``trl_spread``:
    the largest distance between two of TRL's own splits (None for bnpo). A seed draws the model's
    weights and the prompts' words (seed 1: the tests' rollouts).
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
    for seed in seeds:
        for loss in loss_types:
            cfg = LOSS_CONFIG.get(loss, {})
            runs: dict[tuple[str, str, str], dict] = {}
            with exact_head():  # the true update: float64, exact head, TRL 4 × 2
                truth = t._run(GRPOTrainer, loss_type=loss, dtype=torch.float64, tmp_path=tmp, config=cfg,
                               seed=seed)[1][0]
            for head in heads:
                with exact_head() if head == "exact" else nullcontext():
                    for name in dtypes:
                        dtype = getattr(torch, name)
                        for b, a in TRL_SPLITS:
                            runs[head, name, f"trl {b}x{a}"] = t._run(
                                GRPOTrainer, loss_type=loss, dtype=dtype, tmp_path=tmp, per_device=b, accum=a,
                                config=cfg, seed=seed)[1][0]
                        for micro in BP_MICROS:
                            runs[head, name, f"batchpilot micro {micro}"] = t._run(
                                ResilientGRPOTrainer, loss_type=loss, dtype=dtype, tmp_path=tmp, config=cfg,
                                micro_batch_size=micro, seed=seed)[1][0]
            for (head, name, arm), grads in runs.items():
                ref = runs[head, name, "trl 4x2"]
                other_objective = loss == "bnpo" and arm.startswith("trl") and arm != "trl 4x2"
                # TRL's spread: the largest distance between two of its own splits (the same objective but bnpo's)
                splits = [runs[head, name, f"trl {b}x{a}"] for b, a in TRL_SPLITS]
                spread = None if loss == "bnpo" else max(
                    t._relative_error(x, y) for i, x in enumerate(splits) for y in splits[i + 1:])
                row = {"seed": seed, "loss_type": loss, "head": head, "dtype": name, "arm": arm,
                       "vs_trl": None if arm == "trl 4x2" or other_objective else t._relative_error(grads, ref),
                       "vs_exact": t._relative_error({k: v.double() for k, v in grads.items()}, truth),
                       "trl_spread": spread}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


EXACT_ARMS = [f"trl {b}x{a}" for b, a in TRL_SPLITS] + [f"batchpilot micro {m}" for m in BP_MICROS]


def exactness_table(rows: list[dict[str, Any]]) -> str:
    """One line per (loss_type, head, dtype): vs TRL 4×2 (and vs the exact float64 update) for each arm."""
    lines = ["| loss_type | LM head | dtype | seed | " + " | ".join(EXACT_ARMS) + " |",
             "|---|---|---|---|" + "---|" * len(EXACT_ARMS)]
    for key in _exact_keys(rows):
        cells = []
        for arm in EXACT_ARMS:
            r = next(r for r in rows if _key(r) == key and r["arm"] == arm)
            vs = "-" if r["vs_trl"] is None else f"{r['vs_trl']:.1e}"
            cells.append(f"{vs} ({r['vs_exact']:.1e})")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _key(r: dict[str, Any]) -> tuple[str, str, str, int]:
    return r["loss_type"], r["head"], r["dtype"], r.get("seed", 1)


def _exact_keys(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, int]]:
    order = list(dict.fromkeys(r["loss_type"] for r in rows))
    return sorted({(r["loss_type"], r["head"], r["dtype"], r.get("seed", 1)) for r in rows},
                  key=lambda k: (order.index(k[0]), k[1] != "trl", k[2] != "float32", k[3]))


def floor_table(rows: list[dict[str, Any]]) -> str:
    """TRL's own floor against batchpilot's largest difference, per (loss_type, head, dtype).

    The floor is how far TRL moves its own update when only its accumulation changes (the same
    objective, the same rollouts): ``trl 8x1`` against ``trl 4x2`` (B × 1 against B/2 × 2), and TRL's
    spread, the largest distance between two of its splits 4 × 2, 8 × 1, 2 × 4, 1 × 8. batchpilot is
    within it when its largest difference from TRL 4 × 2 (its own configuration) over micro-batches of
    8, 4, 3, 1 is at most that spread. bnpo has no such split (its normaliser is TRL's micro-batch:
    another split is another objective); there each run's distance from the true update is compared.
    """
    lines = ["| loss_type | LM head | dtype | seed | TRL 8×1 against TRL 4×2 | TRL's spread (its 4 splits) | "
             "batchpilot against TRL 4×2 (largest of micro 8, 4, 3, 1) | within TRL's spread | "
             "from the true update: TRL 4×2, batchpilot (largest) |", "|---|---|---|---|---|---|---|---|---|"]
    for key in _exact_keys(rows):
        at = [r for r in rows if _key(r) == key]
        b_half = next(r["vs_trl"] for r in at if r["arm"] == "trl 8x1")
        spread = at[0]["trl_spread"]
        ours = max(r["vs_trl"] for r in at if r["arm"].startswith("batchpilot"))
        ref_truth = next(r["vs_exact"] for r in at if r["arm"] == "trl 4x2")
        our_truth = max(r["vs_exact"] for r in at if r["arm"].startswith("batchpilot"))
        if spread is not None:
            within = "yes" if ours <= spread else f"no ({ours / spread:.2f}×)"
            cells = f"{b_half:.1e} | {spread:.1e}"
        else:  # bnpo: no other split with the same objective; judged by the distance from the true update
            within = (f"{our_truth / ref_truth:.2f}× TRL's distance from the true update")
            cells = "- (another objective) | -"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {cells} | {ours:.1e} | {within} | "
                     f"{ref_truth:.1e}, {our_truth:.1e} |")
    return "\n".join(lines)


def floor_summary(rows: list[dict[str, Any]]) -> str:
    """Per (loss_type, head, dtype) over the seeds: batchpilot's largest difference as a multiple of TRL's spread."""
    lines = ["| loss_type | LM head | dtype | seeds | TRL's spread (range) | batchpilot against TRL 4×2 (range) | "
             "batchpilot / spread: median, largest | batchpilot / TRL 4×2, from the true update: largest |",
             "|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys(k[:3] for k in _exact_keys(rows)))
    for key in keys:
        seeds = sorted({r.get("seed", 1) for r in rows if _key(r)[:3] == key})
        spreads, ours, ratios, truth = [], [], [], []
        for seed in seeds:
            at = [r for r in rows if _key(r) == (*key, seed)]
            worst = max(r["vs_trl"] for r in at if r["arm"].startswith("batchpilot"))
            ref_truth = next(r["vs_exact"] for r in at if r["arm"] == "trl 4x2")
            ours.append(worst)
            truth.append(max(r["vs_exact"] for r in at if r["arm"].startswith("batchpilot")) / ref_truth)
            if at[0]["trl_spread"] is not None:
                spreads.append(at[0]["trl_spread"])
                ratios.append(worst / at[0]["trl_spread"])
        ratio = "-" if not ratios else f"{sorted(ratios)[len(ratios) // 2]:.2f}, {max(ratios):.2f}"
        spread = "- (another objective)" if not spreads else f"{min(spreads):.1e} - {max(spreads):.1e}"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(seeds)} | {spread} | {min(ours):.1e} - {max(ours):.1e} "
                     f"| {ratio} | {max(truth):.3f} |")
    return "\n".join(lines)


def run(config: dict[str, Any], caps: list[int | None], out_dir: Path, timeout: float,
        only: list[str] | None = None, rounds: int = 1) -> list[dict[str, Any]]:
    """Every arm under every cap, ``rounds`` times; within a cap the arms interleave, in reverse order every
    other round, so that the machine's load drifting over minutes falls on every arm alike."""
    runner = ForkRunner(PRELOAD)
    rows = []
    arms = [("batchpilot", 32, 1)] + [("trl", b, a) for b, a in config["trl"]]
    if only:
        arms = [(m, b, a) for m, b, a in arms if f"{m} {b}x{a}" in only]
    for cap in caps:
        for round_ in range(rounds):
            for method, b, a in arms if round_ % 2 == 0 else arms[::-1]:
                spec = {"config": config, "method": method, "per_device": b, "accum": a, "headroom_mib": cap,
                        "out": str(out_dir / f"{method}_{b}x{a}_{cap}")}
                res = runner("trl_grpo", "arm", spec, timeout=timeout)
                row = {"cap_mib": cap, "arm": f"{method} {b}x{a}", "round": round_,
                       **(res.data or {"completed": False, "error": res.stderr[-300:]})}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def speed_summary(rows: list[dict[str, Any]]) -> str:
    """Per cap and arm over the rounds: completed runs, median completions/s, and its ratio to the best arm's."""
    import statistics

    lines = ["| headroom | arm | completed / runs | completions/s per round | median | × best hand-picked |",
             "|---|---|---|---|---|---|"]
    for cap in dict.fromkeys(r["cap_mib"] for r in rows):
        at = [r for r in rows if r["cap_mib"] == cap]
        medians = {}
        for name in dict.fromkeys(r["arm"] for r in at):
            speeds = [r["completions_per_s"] for r in at if r["arm"] == name and r.get("completed")]
            runs = sum(r["arm"] == name for r in at)
            medians[name] = (statistics.median(speeds) if len(speeds) == runs else None, speeds, runs)
        best = max((m for n, (m, _, _) in medians.items() if n.startswith("trl") and m), default=None)
        for name, (median, speeds, runs) in medians.items():
            ratio = "-" if not (median and best) else f"{median / best:.2f}"
            lines.append(f"| {'none' if cap is None else f'{cap} MiB'} | {name} | {len(speeds)} / {runs} | "
                         f"{', '.join(f'{v:.2f}' for v in speeds) or '-'} | "
                         f"{'-' if median is None else f'{median:.2f}'} | {ratio} |")
    return "\n".join(lines)


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
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "float64"],
                   help="with --exactness: these dtypes (default: float32,float64; the true update is float64 always)")
    p.add_argument("--heads", type=lambda s: s.split(","), default=["trl", "exact"],
                   help="with --exactness: these LM heads (trl: TRL's fused head as it ships; exact: in the model's dtype)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="with --exactness: rollouts drawn with these seeds (model weights and prompts; 1: the tests')")
    p.add_argument("--arms", type=lambda s: s.split(","), default=None,
                   help="only these arms, e.g. 'batchpilot 32x1,trl 4x8' (default: all)")
    p.add_argument("--rounds", type=int, default=1, help="run every arm this many times, interleaved")
    p.add_argument("--timeout", type=float, default=900, help="seconds per process")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    if args.exactness:
        from batchpilot.integrations.trl import LOSS_SHARES

        rows = exactness(args.loss_types or list(LOSS_SHARES), args.dtypes, args.heads, args.seeds)
        print(f"\n{datetime.date.today()} {machine()}\n")
        print(exactness_table(rows))
        print()
        print(floor_table(rows))
        print()
        print(floor_summary(rows))
    else:
        config = QUICK if args.quick else MID if args.mid else FULL
        out = Path("/tmp/bp_trl_grpo")
        rows = run(config, args.caps or config["caps"], out, args.timeout, args.arms, args.rounds)
        print(f"\n{datetime.date.today()} {machine()}\n")
        print(table(rows))
        print()
        print(speed_summary(rows))
        print()
        print(phase_summary(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
