"""Memory that follows the tokens: a padded LM on long-tailed lengths, sized per step by its length.

TinyGPT (unfused attention, so its memory has a ``b × L²`` term) trains on batches of a fixed
global size whose samples have long-tailed lengths (most short, a few truncated at the maximum),
each batch padded to its own longest sample, under an emulated CPU capacity (exact tensor
bytes; past it a real ``torch.OutOfMemoryError``). Three arms, same batches, same start:

* ``fixed``: ``Engine(micro_batch_size=b_max)``, the micro-batch the finder gives at the
  longest length: what a user does who sizes for the worst case;
* ``by length``: ``Engine(start=find_batch_size_for(..., lengths=...))``: each step's
  micro-batch from the 2-D memory model at its padded length;
* ``by length + split``: the same with ``LengthConfig(split=True)``: samples sorted by real
  length, micro-batches cut to fit and trimmed to their own longest sample.

Reported per arm: OOMs after the first step, verification searches, mean padded tokens per
micro-batch against what the model allows at that length (capped at the global batch),
samples/s as a ratio to ``fixed`` (the thread's CPU time of the engine steps under the same
emulation, one intra-op thread; the wall-clock ratio beside it; and again in a plain replay of
each arm's micro-batches without the tracker, the fastest of a few rounds), and
the final parameters against the full-batch computation (fp32, rtol 1e-5).

    python benchmarks/lengths.py
    python benchmarks/lengths.py --quick --json lengths.json

Goals (issue 15): 0 OOMs after step 1 over >= 200 steps; padded tokens per micro-batch >= 80%
of what the model allows; samples/s >= 1.5x ``fixed``; final parameters equal.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import machine  # noqa: E402

from batchpilot import Engine, EngineConfig, find_batch_size_for  # noqa: E402
from batchpilot.app.report import format_table, write_json  # noqa: E402
from batchpilot.train.lengths import LengthConfig  # noqa: E402
from batchpilot.memory.probes import emulate_capacity  # noqa: E402
from batchpilot.memory.units import format_bytes, parse_bytes  # noqa: E402
from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch  # noqa: E402
from batchpilot.core.seqbatch import trim_batch  # noqa: E402

COLUMNS = ("arm", "steps", "OOMs after step 1", "over target", "verifications", "micro-batches", "tokens/micro-batch",
           "allowed", "use", "samples/s ratio", "wall ratio", "replay ratio", "max |Δparam| rel", "exact", "goal")
FULL = dict(steps=200, global_batch=32, min_len=16, max_len=512, dim=32, layers=2, heads=2, vocab=256,
            capacity="40MiB", fit_lengths=(128, 256, 512), table=(16, 32, 64, 128, 256, 384, 512))
QUICK = dict(steps=24, global_batch=8, min_len=4, max_len=64, dim=16, layers=1, heads=2, vocab=64,
             capacity="1MiB", fit_lengths=(16, 32, 64), table=(4, 16, 32, 64))


def long_tailed_lengths(n: int, *, lo: int, hi: int, generator: torch.Generator) -> list[int]:
    """Mostly short: ``lo`` + an exponential of mean ``(hi - lo) / 8``; 3% truncated at ``hi``."""
    scale = (hi - lo) / 8
    tail = torch.empty(n).exponential_(1 / scale, generator=generator)
    out = (lo + tail).clamp(max=hi).long()
    out[torch.rand(n, generator=generator) < 0.03] = hi
    return out.tolist()


class Batches:
    """The run's batches, built afresh on each read (as a data loader does), identical every time.

    Held tensors would distort the measurement: the tracker counts a storage from the first
    time a step reads it for as long as it lives.
    """

    def __init__(self, cfg: dict, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = [long_tailed_lengths(cfg["global_batch"], lo=cfg["min_len"], hi=cfg["max_len"], generator=g)
                        for _ in range(cfg["steps"])]
        self.vocab = cfg["vocab"]

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        for i, lens in enumerate(self.lengths):
            yield padded_lm_batch(lens, vocab=self.vocab, generator=torch.Generator().manual_seed(1000 + i))


def make_batches(cfg: dict, seed: int = 0) -> Batches:
    return Batches(cfg, seed)


def reference(model: TinyGPT, batches: list) -> TinyGPT:
    """The full-batch computation: the whole padded batch in one forward, one SGD step per batch."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        total, count = lm_loss(model, batch)
        (total / count).backward()
        opt.step()
    return model


def job_config(quick: bool, steps: int | None, capacity: str | None) -> dict:
    """The job: ``QUICK`` or ``FULL``, with the command line's steps and capacity when given."""
    cfg = dict(QUICK if quick else FULL)
    if steps is not None:
        cfg["steps"] = steps
    if capacity is not None:
        cfg["capacity"] = capacity
    return cfg


def build_model(cfg: dict) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=cfg["vocab"], dim=cfg["dim"], heads=cfg["heads"], layers=cfg["layers"],
                   max_len=cfg["max_len"])


def length_plan(model: TinyGPT, cfg: dict, *, max_batch_size: int) -> Any:
    """``find_batch_size_for(..., lengths=cfg["table"])`` on a copy of ``model``, at the job's longest length."""
    probe = copy.deepcopy(model)
    example = padded_lm_batch([cfg["max_len"]] * 2, vocab=cfg["vocab"])
    return find_batch_size_for(probe, example, optimizer=torch.optim.SGD(probe.parameters(), lr=0.05),
                               loss_fn=lm_loss, capacity=cfg["capacity"], lengths=cfg["table"],
                               max_batch_size=max_batch_size, timed_steps=0)


def arm_engine(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: dict, plan: Any) -> Engine:
    """The engine of arm ``name``: ``fixed`` at the plan's longest length, else sized by length (``split``)."""
    kwargs: dict[str, Any] = dict(global_batch_size=cfg["global_batch"], config=EngineConfig(capacity=cfg["capacity"]))
    if name == "fixed":
        kwargs["micro_batch_size"] = plan.per_length[max(plan.per_length)]
    else:
        kwargs.update(start=plan, lengths=LengthConfig(split=name.endswith("split")))
    return Engine(model, opt, lm_loss, noise=False, **kwargs)


def run_arm(name: str, model: TinyGPT, batches: list, cfg: dict, plan: Any) -> dict[str, Any]:
    """Train one arm under the emulated capacity; record every step's micro-batches."""
    model = copy.deepcopy(model)
    engine = arm_engine(name, model, torch.optim.SGD(model.parameters(), lr=0.05), cfg, plan)
    steps = []
    t0, c0 = time.perf_counter(), time.thread_time()
    with emulate_capacity(cfg["capacity"]):
        for i, batch in enumerate(batches):
            r = engine.step(batch)
            if (i + 1) % 50 == 0:
                print(f"  {name}: step {i + 1}/{len(batches)}, {time.perf_counter() - t0:.0f}s", file=sys.stderr,
                      flush=True)
            width = batch["input_ids"].shape[1]
            if engine.lengths is not None and engine.lengths.config.split:
                groups = [list(g) for g in engine.lengths.groups]
                widths = list(r.micro_batch_lengths)
            else:
                sizes, start, groups = list(r.micro_batch_sizes), 0, []
                for s in sizes:
                    groups.append(list(range(start, start + s)))
                    start += s
                widths = [width] * len(sizes)
            steps.append({"length": width, "ooms": r.ooms, "groups": groups, "widths": widths,
                          "peak": r.peak_bytes})
    # the thread's CPU time (one intra-op thread): what other processes on the shared cores cannot stretch
    return {"name": name, "model": model, "engine": engine, "steps": steps, "seconds": time.thread_time() - c0,
            "wall": time.perf_counter() - t0}


def replay_seconds(model: TinyGPT, batches: list, steps: list, *, rounds: int) -> float:
    """CPU time of a plain loop over an arm's micro-batches, no tracker (the fastest of ``rounds``)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    micro = []
    for batch, st in zip(batches, steps):
        for idx, w in zip(st["groups"], st["widths"]):
            rows = {k: v[torch.tensor(idx)] for k, v in batch.items()}
            micro.append(trim_batch(rows, w, seq_dim=1, copy=True) if w < batch["input_ids"].shape[1] else rows)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for mb in micro:
            total, count = lm_loss(model, mb)
            (total / max(int(count), 1)).backward()
        opt.zero_grad(set_to_none=True)
        best = min(best, time.thread_time() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model, short lengths, 24 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--capacity", default=None, help="emulated capacity (default 40MiB; 1MiB with --quick)")
    ap.add_argument("--replay-rounds", type=int, default=1, help="replays per arm, the fastest counting (default: %(default)s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = job_config(args.quick, args.steps, args.capacity)
    torch.set_num_threads(1)  # one thread: times by the thread's CPU time, which others cannot stretch
    model = build_model(cfg)
    batches = make_batches(cfg)
    t0 = time.perf_counter()
    plan = length_plan(model, cfg, max_batch_size=cfg["global_batch"])
    find_seconds = time.perf_counter() - t0
    print(f"per-length plan ({len(plan.length_plans)} searches, {sum(p.num_trials for p in plan.length_plans.values())} "
          f"trials, {find_seconds:.1f}s) under {cfg['capacity']}: "
          + ", ".join(f"L={L}: {b}" for L, b in sorted(plan.per_length.items())))
    print(f"fit: bytes/token {plan.length_fit.bytes_per_token:.0f}, bytes/(b·L²) "
          f"{plan.length_fit.bytes_per_token_squared:.1f}")
    expected = reference(model, batches)
    arms = [run_arm(name, model, batches, cfg, plan) for name in ("fixed", "by length", "by length + split")]
    fixed = arms[0]
    replay = {a["name"]: replay_seconds(model, batches, a["steps"], rounds=args.replay_rounds) for a in arms}
    rows, records = [], []
    samples = cfg["steps"] * cfg["global_batch"]
    for a in arms:
        budget = arms[1]["engine"].lengths.budget  # the model the length arms ended with
        tokens, allowed = [], []
        for st in a["steps"]:
            for idx, w in zip(st["groups"], st["widths"]):
                tokens.append(len(idx) * w)
                allowed.append(min(budget.micro_batch(w), cfg["global_batch"]) * w)
        ooms_after = sum(st["ooms"] for st in a["steps"][1:])
        diff = max(float(((p.detach() - q.detach()).abs() / q.detach().abs().clamp(min=1e-6)).max())
                   for p, q in zip(a["model"].parameters(), expected.parameters()))
        exact = all(torch.allclose(p, q, rtol=1e-5, atol=1e-7)
                    for p, q in zip(a["model"].parameters(), expected.parameters()))
        use = sum(tokens) / sum(allowed)
        ratio = fixed["seconds"] / a["seconds"]
        wall_ratio = fixed["wall"] / a["wall"]
        replay_ratio = replay["fixed"] / replay[a["name"]]
        verifications = a["engine"].lengths.verifications if a["engine"].lengths is not None else 0
        goal = ooms_after == 0 and exact and (a["name"] == "fixed" or (use >= 0.8 and ratio >= 1.5))
        over = sum(st["peak"] > plan.limit_bytes for st in a["steps"])
        rows.append((a["name"], len(a["steps"]), ooms_after, over, verifications, len(tokens),
                     round(sum(tokens) / len(tokens)), round(sum(allowed) / len(allowed)), f"{use:.0%}",
                     f"{ratio:.2f}x", f"{wall_ratio:.2f}x", f"{replay_ratio:.2f}x", f"{diff:.1e}", "yes" if exact else "NO",
                     "met" if goal else "not met"))
        records.append({"arm": a["name"], "steps": len(a["steps"]), "ooms_after_first": ooms_after,
                        "verifications": verifications, "steps_over_target": over, "micro_batches": len(tokens),
                        "mean_tokens": sum(tokens) / len(tokens), "mean_allowed_tokens": sum(allowed) / len(allowed),
                        "use": use, "seconds": a["seconds"], "wall_seconds": a["wall"],
                        "samples_per_second": samples / a["seconds"], "ratio_vs_fixed": ratio,
                        "wall_ratio_vs_fixed": wall_ratio, "replay_cpu_seconds": replay[a["name"]],
                        "replay_ratio_vs_fixed": replay_ratio, "max_rel_param_diff": diff, "exact": exact,
                        "max_peak": max(st["peak"] for st in a["steps"]),
                        "lengths": [st["length"] for st in a["steps"]],
                        "micro_batches_per_step": [len(st["groups"]) for st in a["steps"]]})
    print(f"\n{cfg['steps']} steps of {cfg['global_batch']} samples, lengths {cfg['min_len']}-{cfg['max_len']} "
          f"(long-tailed), capacity {cfg['capacity']} (limit {format_bytes(plan.limit_bytes)}), "
          f"fixed micro-batch {plan.per_length[max(plan.per_length)]}")
    print(format_table(COLUMNS, rows))
    if args.json:
        write_json({"benchmark": "lengths", "date": datetime.date.today().isoformat(), "machine": machine(),
                    "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
                    "capacity_bytes": parse_bytes(cfg["capacity"]),
                    "plan": plan.to_dict(), "arms": records}, args.json)
    # the exit status is correctness only (no OOM after step 1, exact parameters); speed is reported
    return 0 if all(r["ooms_after_first"] == 0 and r["exact"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
