"""The gradient noise scale: its accuracy, the benefit of following it, and its cost.

    python benchmarks/noise.py                         # every part (about 15 minutes on 2 busy cores)
    python benchmarks/noise.py --parts accuracy,cost   # some of them
    python benchmarks/noise.py --quick                 # smoke sizes (what the tests run)
    python benchmarks/noise.py --json noise.json

Parts, all on scikit-learn's bundled digits (1,437 training images, 360 held out; nothing
downloaded), CPU, one thread:

* ``accuracy``: at fixed parameters (an untrained, a briefly trained and a nearly fit MLP and
  CNN), the engine's estimate (global 128 = 16 × 8, reshuffled epochs) against the exact
  ``B_simple = tr(Σ) / |G|²`` from per-example gradients over the whole training split
  (``torch.func.vmap(grad)``). For each mode: after how many steps of plain averaging the
  estimate stays within 15% (median over seeds), and the typical error of EMAs with beta 0.95
  and 0.99 (the defaults of ``every`` and ``first``); for ``every``, the bias without the
  finite-population correction.
* ``tracking``: during training the engine's EMA (each mode's default beta) against the EMA,
  with the same beta, of the exact values at every step (the parameters move).
* ``benefit``: an MLP trained with SGD (momentum 0.9, LR linear in the batch from 0.1 at 128)
  to a held-out loss of 0.15, for fixed batches 16-512, a Megatron ramp and the adaptive
  schedule (k 0.25, 0.5 and 1 in ``every`` mode; k 1 with ``first``): optimizer steps and samples
  to the target, median and spread over seeds.
* ``cost``: ``Engine.step`` time with the noise scale off, ``first`` and ``every``, as paired
  ratios (the variants take turns step by step, as in ``overhead.py``), in CPU time of the
  step's thread (and wall time).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import machine  # noqa: E402

from batchpilot.app.datasets import load_digits  # noqa: E402
from batchpilot.app.models import MLP, SmallCNN, example_batch  # noqa: E402
from batchpilot.policy.schedule import AdaptiveSchedule, RampSchedule  # noqa: E402
from batchpilot.train.data import ElasticBatchSampler  # noqa: E402
from batchpilot.train.engine import Engine  # noqa: E402
from batchpilot.train.noise import (  # noqa: E402
    DEFAULT_BETA, NoiseConfig, NoiseMeter, population_factor, unbiased_estimates,
)

PARTS = ("accuracy", "tracking", "benefit", "cost")
EMA_BETAS = (0.95, 0.99)  # the defaults of `every` and `first`
GLOBAL, MICRO = 128, 16
TOLERANCE = 0.15


# ---------------------------------------------------------------------------
# data, models, the exact reference


class Digits:
    """The training split as tensors (flat for the MLP, 1×8×8 for the CNN) and the held-out part."""

    def __init__(self, layout: str) -> None:
        split = load_digits(held_out=0.2, seed=0, layout=layout)
        self.x, self.y = torch.from_numpy(split.train_x), torch.from_numpy(split.train_y)
        self.x_test, self.y_test = torch.from_numpy(split.test_x), torch.from_numpy(split.test_y)
        self.n = len(self.x)


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(in_features=64, width=128, depth=2, num_classes=10)
    # no BatchNorm: its batch statistics would tie a sample's gradient to the others'
    return SmallCNN(in_channels=1, widths=(16, 32, 64), num_classes=10, batch_norm=False)


def exact(model: nn.Module, data: Digits, chunk: int = 512) -> tuple[float, float]:
    """``(|G|², tr(Σ))`` over the whole training split from per-example gradients (``torch.func``).

    ``Σ`` is the population covariance (divided by N), the one the finite-population
    correction refers to.
    """
    names, params = zip(*[(n, p.detach()) for n, p in model.named_parameters()])

    def loss1(ps: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, dict(zip(names, ps)), (x.unsqueeze(0),)), y.unsqueeze(0))

    per_example = vmap(grad(loss1), in_dims=(None, 0, 0))
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    sq = torch.zeros((), dtype=torch.float64)
    for s in range(0, data.n, chunk):
        for i, g in enumerate(per_example(params, data.x[s:s + chunk], data.y[s:s + chunk])):
            total[i] += g.sum(0, dtype=torch.float64)
            flat = g.reshape(g.shape[0], -1).double()
            sq += (flat * flat).sum()
    g2 = sum(float((t / data.n).square().sum()) for t in total)
    return g2, float(sq) / data.n - g2


def ema_ratio(g2s: list[float], traces: list[float], beta: float) -> list[float]:
    """``B_simple`` from EMAs of the two series (bias correction cancels in the ratio)."""
    out, g, t = [], 0.0, 0.0
    for a, b in zip(g2s, traces):
        g, t = beta * g + (1 - beta) * a, beta * t + (1 - beta) * b
        out.append(max(t, 0.0) / g if g > 0 else math.inf)
    return out


def mean_ratio(g2s: list[float], traces: list[float]) -> list[float]:
    """``B_simple`` from plain running means of the two series."""
    out, g, t = [], 0.0, 0.0
    for a, b in zip(g2s, traces):
        g, t = g + a, t + b
        out.append(max(t, 0.0) / g if g > 0 else math.inf)
    return out


def settles_after(ratios: list[float], truth: float, tol: float = TOLERANCE) -> int | None:
    """The first step after which every estimate stays within ``tol`` of ``truth`` (``None``: never)."""
    last_bad = -1
    for i, r in enumerate(ratios):
        if not abs(r / truth - 1) <= tol:
            last_bad = i
    return None if last_bad == len(ratios) - 1 else last_bad + 2


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ---------------------------------------------------------------------------
# accuracy at fixed parameters


def train_points(name: str, data: Digits, points: tuple[int, ...]) -> dict[int, nn.Module]:
    """Copies of one training run (AdamW, the main job's LR, global 128) after each of ``points`` steps."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (GLOBAL / 256) ** 0.5, weight_decay=0.05)
    engine = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=GLOBAL, micro_batch_size=MICRO, noise=False)
    sampler = ElasticBatchSampler(data.n, GLOBAL, seed=100, drop_last=True, num_replicas=1, rank=0)
    out, step, epoch = {}, 0, 0
    while step <= max(points):
        sampler.set_epoch(epoch)
        for idx in sampler:
            if step in points:
                out[step] = copy.deepcopy(model)
            if step >= max(points):
                return out
            engine.step((data.x[idx], data.y[idx]))
            sampler.mark_consumed()
            step += 1
        epoch += 1
    return out


def without_correction(g2s: list[float], traces: list[float], n: int) -> tuple[list[float], list[float]]:
    """What an engine without the finite-population correction reports for the same steps.

    The two squared norms behind each estimate are recovered (``E x = |G|² + tr Σ · c``, with
    the corrected factors), then solved again with ``c = 1 / B``: the same norms, the other
    factors, no second run needed.
    """
    small_c, big_c = population_factor(MICRO, MICRO, n), population_factor(GLOBAL, GLOBAL, n)
    out_g, out_t = [], []
    for g2, tr in zip(g2s, traces):
        small_sq, big_sq = g2 + tr * small_c, g2 + tr * big_c
        g, t = unbiased_estimates(small_sq, population_factor(MICRO, MICRO), big_sq, population_factor(GLOBAL, GLOBAL))
        out_g.append(g)
        out_t.append(t)
    return out_g, out_t


def measure_fixed(model: nn.Module, data: Digits, *, steps: int, seed: int) -> dict[str, tuple[list, list]]:
    """Per-step ``(|G|², tr Σ)`` estimates of the two modes at the same frozen parameters, on the same batches;
    and ``every``'s without the finite-population correction."""
    variants = {"first": NoiseConfig(mode="first", dataset_size=data.n),
                "every": NoiseConfig(mode="every", dataset_size=data.n)}
    engines = {}
    for label, cfg in variants.items():
        frozen = copy.deepcopy(model)
        engines[label] = Engine(frozen, torch.optim.SGD(frozen.parameters(), lr=0.0), nn.CrossEntropyLoss(),
                                global_batch_size=GLOBAL, micro_batch_size=MICRO, noise=cfg)
    series: dict[str, tuple[list, list]] = {label: ([], []) for label in variants}
    sampler = ElasticBatchSampler(data.n, GLOBAL, seed=seed, drop_last=True, num_replicas=1, rank=0)
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for idx in sampler:
            batch = (data.x[idx], data.y[idx])
            for label, engine in engines.items():
                r = engine.step(batch)
                series[label][0].append(float(r.noise.grad_sq))
                series[label][1].append(float(r.noise.trace))
            sampler.mark_consumed()
            done += 1
            if done >= steps:
                break
        epoch += 1
    series["every, no FPC"] = without_correction(*series["every"], data.n)
    return series


def part_accuracy(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in args.models:
        data = Digits("flat" if name == "mlp" else "image")
        for step, model in train_points(name, data, args.points).items():
            g2, tr = exact(model, data)
            truth = tr / g2
            runs = [measure_fixed(model, data, steps=args.fixed_steps, seed=s) for s in range(args.seeds)]
            row: dict[str, Any] = {"model": name, "trained_steps": step, "exact_b_simple": truth,
                                   "regime": truth / GLOBAL, "exact_grad_sq": g2, "exact_trace": tr}
            for label in ("first", "every", "every, no FPC"):
                settle = [settles_after(mean_ratio(*run[label]), truth) for run in runs]
                whole = [mean_ratio(*run[label])[-1] / truth - 1 for run in runs]
                row[label] = {"settles_after": settle, "bias_after_all": statistics.median(whole), "ema": {}}
                for beta in EMA_BETAS:
                    skip = min(round(3 / (1 - beta)), args.fixed_steps // 2)  # the EMA's warm-up
                    errors = [abs(r / truth - 1) for run in runs for r in ema_ratio(*run[label], beta)[skip:]]
                    row[label]["ema"][str(beta)] = {"median_error": statistics.median(errors),
                                                    "within_tol": sum(e <= TOLERANCE for e in errors) / len(errors)}
            rows.append(row)
            print(f"  accuracy {name} @ step {step}: exact B_simple {truth:.0f}", flush=True)
    return {"rows": rows, "steps": args.fixed_steps, "seeds": args.seeds}


def _settle_text(values: list[int | None], steps: int) -> str:
    reached = [v for v in values if v is not None]
    if not reached:
        return f"> {steps} (0/{len(values)})"
    med = statistics.median([v if v is not None else math.inf for v in values])
    text = f"> {steps}" if math.isinf(med) else f"{med:.0f}"
    return f"{text} ({len(reached)}/{len(values)})"


def table_accuracy(doc: dict[str, Any]) -> str:
    steps = doc["steps"]
    lines = [
        f"fixed parameters, global {GLOBAL} = {MICRO} x {GLOBAL // MICRO}, {steps} steps per seed, {doc['seeds']} seeds; "
        f"'steps to 15%': plain running means, median (seeds that got there); EMA beta b: after 3/(1-b) steps, "
        "median |error| / share of steps within 15%",
        "| model | trained steps | exact B_simple | B_simple / global | mode | steps to 15% | "
        + " | ".join(f"EMA {b}" for b in EMA_BETAS) + " | bias of the mean |",
        "|---|---:|---:|---:|---|---:|" + "---:|" * len(EMA_BETAS) + "---:|",
    ]
    for r in doc["rows"]:
        for label in ("first", "every", "every, no FPC"):
            m = r[label]
            emas = " | ".join(f"{m['ema'][str(b)]['median_error']:.1%} / {m['ema'][str(b)]['within_tol']:.0%}"
                              for b in EMA_BETAS)
            lines.append(
                f"| {r['model']} | {r['trained_steps']} | {r['exact_b_simple']:.0f} | {r['regime']:.2f} | {label} | "
                f"{_settle_text(m['settles_after'], steps)} | {emas} | {m['bias_after_all']:+.1%} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# tracking during training


def part_tracking(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode with its default EMA (``DEFAULT_BETA``), against the exact values' EMA with the same beta."""
    rows = []
    for name in args.models:
        data = Digits("flat" if name == "mlp" else "image")
        models = {mode: build(name) for mode in ("first", "every")}
        engines = {}
        for mode, model in models.items():
            opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (GLOBAL / 256) ** 0.5, weight_decay=0.05)
            engines[mode] = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=GLOBAL, micro_batch_size=MICRO,
                                   noise=NoiseConfig(mode=mode, dataset_size=data.n))
        sampler = ElasticBatchSampler(data.n, GLOBAL, seed=7, drop_last=True, num_replicas=1, rank=0)
        exact_g2, exact_tr, est = [], [], {m: [] for m in engines}
        identical, step, epoch = True, 0, 0
        while step < args.track_steps:
            sampler.set_epoch(epoch)
            for idx in sampler:
                g2, tr = exact(models["first"], data)  # the parameters this step's gradients are taken at
                exact_g2.append(g2)
                exact_tr.append(tr)
                for mode, engine in engines.items():
                    est[mode].append(engine.step((data.x[idx], data.y[idx])).noise_scale)
                sampler.mark_consumed()
                identical &= all(torch.equal(a, b) for a, b in zip(models["first"].parameters(),
                                                                    models["every"].parameters()))
                step += 1
                if step >= args.track_steps:
                    break
            epoch += 1
        skip = min(40, step // 2)
        row: dict[str, Any] = {"model": name, "steps": step, "identical_training": identical,
                               "exact_b_simple": {"start": exact_tr[0] / exact_g2[0], "end": exact_tr[-1] / exact_g2[-1]},
                               "regime_share": sum(t / g <= GLOBAL for g, t in zip(exact_g2, exact_tr)) / step}
        for mode in engines:
            beta = DEFAULT_BETA[mode]
            reference = ema_ratio(exact_g2, exact_tr, beta)
            errors = [abs(e / r - 1) for e, r in zip(est[mode][skip:], reference[skip:])]
            row[mode] = {"beta": beta, "median_error": statistics.median(errors), "p90_error": quantile(errors, 0.9),
                         "within_tol": sum(e <= TOLERANCE for e in errors) / len(errors)}
        rows.append(row)
        print(f"  tracking {name}: done {step} steps", flush=True)
    return {"rows": rows}


def table_tracking(doc: dict[str, Any]) -> str:
    lines = [
        f"during training (AdamW, global {GLOBAL} = {MICRO} x {GLOBAL // MICRO}); the engine's EMA (each mode's default "
        "beta) against the EMA, with the same beta, of the exact values at every step; errors over steps 40+",
        "| model | steps | exact B_simple start -> end | steps with B_simple <= global | mode (beta) | median error | "
        "90th pct error | within 15% | training identical |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in doc["rows"]:
        for mode in ("first", "every"):
            m = r[mode]
            lines.append(
                f"| {r['model']} | {r['steps']} | {r['exact_b_simple']['start']:.0f} -> {r['exact_b_simple']['end']:.0f} | "
                f"{r['regime_share']:.0%} | {mode} ({m['beta']}) | {m['median_error']:.1%} | {m['p90_error']:.1%} | "
                f"{m['within_tol']:.0%} | {'yes' if r['identical_training'] else 'NO'} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# benefit: steps and samples to a held-out loss


def run_to_target(data: Digits, *, seed: int, target: float, max_epochs: int, fixed: int | None = None,
                  schedule: Any = None, reference: int = 512, mode: str = "every") -> dict[str, Any]:
    """Train until the held-out loss reaches ``target``; steps and samples it took (``None``: never)."""
    model = build("mlp", seed)
    batch = fixed if fixed is not None else reference
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * batch / 128, momentum=0.9)  # the linear rule
    engine = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=batch, micro_batch_size=8,
                    noise=NoiseConfig(mode=mode, dataset_size=data.n), schedule=schedule)
    sampler = ElasticBatchSampler(data.n, engine.per_rank_batch_size, seed=seed, drop_last=True, num_replicas=1, rank=0)
    steps = samples = 0
    for epoch in range(max_epochs):
        sampler.set_epoch(epoch)
        for idx in sampler:
            r = engine.step((data.x[idx], data.y[idx]))
            sampler.mark_consumed()
            sampler.set_batch_size(engine.per_rank_batch_size)
            steps += 1
            samples += r.samples
            with torch.no_grad():
                loss = float(F.cross_entropy(model(data.x_test), data.y_test))
            if loss <= target:
                return {"steps": steps, "samples": samples, "final_batch": r.global_batch_size}
    return {"steps": None, "samples": None, "final_batch": engine.global_batch_size}


def benefit_variants(quick: bool) -> dict[str, dict[str, Any]]:
    fixed = (16, 128) if quick else (16, 32, 64, 128, 256, 512)
    out = {f"fixed {b}": {"fixed": b} for b in fixed}
    out["ramp 16->256 over 6k samples"] = {"schedule": RampSchedule(start=16, increment=16, samples=6000),
                                           "reference": 256}
    for k in ((1.0,) if quick else (0.25, 0.5, 1.0)):
        out[f"adaptive k={k:g}"] = {"schedule": AdaptiveSchedule(k=k, min_batch_size=16, max_batch_size=512, every=5,
                                                                 granule=8), "reference": 512}
    if not quick:
        out["adaptive k=1, noise first"] = {**out["adaptive k=1"], "mode": "first"}
    return out


def part_benefit(args: argparse.Namespace) -> dict[str, Any]:
    data = Digits("flat")
    rows = []
    for label, spec in benefit_variants(args.quick).items():
        runs = [run_to_target(data, seed=s, target=args.target, max_epochs=args.max_epochs, **spec)
                for s in range(args.seeds)]
        rows.append({"variant": label, "runs": runs})
        print(f"  benefit {label}: {[r['steps'] for r in runs]}", flush=True)
    return {"rows": rows, "target": args.target, "seeds": args.seeds, "max_epochs": args.max_epochs}


def _spread(values: list[int | None]) -> tuple[float | None, str]:
    got = [v for v in values if v is not None]
    if len(got) < len(values) / 2:
        return None, f"not reached ({len(got)}/{len(values)})"
    padded = sorted(v if v is not None else math.inf for v in values)
    med = statistics.median(padded)
    return med, f"{med:.0f} [{quantile(padded, 0.25):.0f}-{quantile(padded, 0.75):.0f}]"


def table_benefit(doc: dict[str, Any]) -> str:
    stats = []
    for r in doc["rows"]:
        steps, steps_text = _spread([x["steps"] for x in r["runs"]])
        samples, samples_text = _spread([x["samples"] for x in r["runs"]])
        final = statistics.median(x["final_batch"] for x in r["runs"])
        stats.append((r["variant"], steps, steps_text, samples, samples_text, final))
    fixed = [s for s in stats if s[0].startswith("fixed") and s[3] is not None]
    best = min(fixed, key=lambda s: s[3]) if fixed else None
    small = next((s for s in stats if s[0] == "fixed 16"), None)
    lines = [
        f"MLP on digits, SGD momentum 0.9, lr 0.1 x batch / 128; held-out loss <= {doc['target']}; "
        f"{doc['seeds']} seeds: median [25th-75th percentile]; best fixed by samples: {best[0] if best else '-'}",
        "| variant | steps | samples | samples / best fixed | steps / fixed 16 | final batch (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, steps, steps_text, samples, samples_text, final in stats:
        vs_best = f"{samples / best[3]:.2f}" if best and samples else "-"
        vs_small = f"{steps / small[1]:.2f}" if small and small[1] and steps else "-"
        lines.append(f"| {name} | {steps_text} | {samples_text} | {vs_best} | {vs_small} | {final:.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# cost


COST_WORKLOADS: dict[str, dict[str, Any]] = {
    "overhead mlp": {"build": lambda: MLP(in_features=256, width=1024, depth=2), "global": 256, "micro": 64},
    "overhead cnn": {"build": lambda: SmallCNN(widths=(16, 32, 64), batch_norm=True), "global": 64, "micro": 16},
    "digits mlp": {"build": lambda: build("mlp"), "global": GLOBAL, "micro": MICRO},
    "digits cnn": {"build": lambda: build("cnn"), "global": GLOBAL, "micro": MICRO},
}
COST_VARIANTS = {"off": False, "first": NoiseConfig(mode="first"), "every": NoiseConfig(mode="every")}
METER_HOOKS = ("begin", "before_backward", "after_backward", "local_values", "measure", "commit", "micro_batch")


def meter_seconds(step: Callable[[Any], float], batch: Any, rounds: int) -> float:
    """CPU seconds per step spent inside the engine's noise hooks (``NoiseMeter``'s methods), measured in place."""
    spent = [0.0]
    originals = {name: getattr(NoiseMeter, name) for name in METER_HOOKS}

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.thread_time() - t0
        return wrapper

    try:
        for name, fn in originals.items():
            setattr(NoiseMeter, name, timed(fn))
        for _ in range(rounds):
            step(batch)
    finally:
        for name, fn in originals.items():
            setattr(NoiseMeter, name, fn)
    return spent[0] / rounds


def part_cost(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name, spec in COST_WORKLOADS.items():
        if args.quick and name != "digits mlp":
            continue
        steps: dict[str, Callable[[Any], float]] = {}
        for label, noise in COST_VARIANTS.items():
            torch.manual_seed(0)
            model = spec["build"]()
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            engine = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=spec["global"],
                            micro_batch_size=spec["micro"], noise=noise)
            steps[label] = lambda batch, engine=engine: engine.step(batch).loss
        template = spec["build"]()
        if name.startswith("digits"):
            data = Digits("flat" if name == "digits mlp" else "image")
            batch = (data.x[:spec["global"]], data.y[:spec["global"]])
        else:
            batch = example_batch(template, spec["global"], generator=torch.Generator().manual_seed(1))
        # CPU time of this thread (one intra-op thread: every kernel runs here) besides wall time:
        # on a shared machine a step's wall time mostly measures the other processes
        wall: dict[str, list[float]] = {k: [] for k in steps}
        cpu: dict[str, list[float]] = {k: [] for k in steps}
        order = list(steps)
        for r in range(args.warmup + args.rounds):
            for label in order[r % len(order):] + order[:r % len(order)]:
                t0, c0 = time.perf_counter(), time.thread_time()
                steps[label](batch)
                if r >= args.warmup:
                    wall[label].append(time.perf_counter() - t0)
                    cpu[label].append(time.thread_time() - c0)

        def paired(times: dict[str, list[float]], label: str) -> float:
            return statistics.median(a / b for a, b in zip(times[label], times["off"]))

        hooks = {label: meter_seconds(steps[label], batch, args.rounds) for label in ("first", "every")}

        rows.append({"workload": name, "global": spec["global"], "micro": spec["micro"],
                     "params": sum(p.numel() for p in template.parameters()),
                     "off_ms": 1e3 * statistics.median(cpu["off"]),
                     "first_ms": 1e3 * statistics.median(cpu["first"]),
                     "every_ms": 1e3 * statistics.median(cpu["every"]),
                     "first_ratio": paired(cpu, "first"), "every_ratio": paired(cpu, "every"),
                     "first_wall_ratio": paired(wall, "first"), "every_wall_ratio": paired(wall, "every"),
                     "first_hooks_ms": 1e3 * hooks["first"], "every_hooks_ms": 1e3 * hooks["every"]})
        print(f"  cost {name}: done", flush=True)
    return {"rows": rows, "rounds": args.rounds}


def table_cost(doc: dict[str, Any]) -> str:
    lines = [
        f"Engine.step with the noise scale off / first / every; {doc['rounds']} rounds, the variants in turn; "
        "ms: median CPU time of the step's thread; ratios: median of paired per-round ratios to off (CPU time; "
        "wall time in brackets, which on a shared machine mostly measures the neighbours); hooks: CPU time "
        "inside the engine's noise hooks per step, measured in place, and its share of the off step",
        "| workload | params | global = micro x accum | off ms | first ms | first / off | first hooks | "
        "every ms | every / off | every hooks |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['workload']} | {r['params']:,} | {r['global']} = {r['micro']} x {r['global'] // r['micro']} | "
            f"{r['off_ms']:.2f} | {r['first_ms']:.2f} | {r['first_ratio']:.3f} ({r['first_wall_ratio']:.3f}) | "
            f"{r['first_hooks_ms']:.3f} ms = {r['first_hooks_ms'] / r['off_ms']:.1%} | "
            f"{r['every_ms']:.2f} | {r['every_ratio']:.3f} ({r['every_wall_ratio']:.3f}) | "
            f"{r['every_hooks_ms']:.3f} ms = {r['every_hooks_ms'] / r['off_ms']:.1%} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", type=lambda s: s.split(","), default=list(PARTS), help=f"from {','.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="smoke sizes: a few steps, seeds and workloads")
    p.add_argument("--models", type=lambda s: s.split(","), default=None,
                   help="accuracy/tracking models (default mlp,cnn; quick: mlp)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per point / variant (default 3 accuracy, 8 benefit)")
    p.add_argument("--fixed-steps", type=int, default=None, help="steps per seed at fixed parameters (default 1000)")
    p.add_argument("--track-steps", type=int, default=None, help="training steps tracked (default 150)")
    p.add_argument("--target", type=float, default=None, help="held-out loss the benefit runs train to "
                   "(default 0.15; quick 0.6)")
    p.add_argument("--max-epochs", type=int, default=None, help="benefit budget in epochs (default 60)")
    p.add_argument("--rounds", type=int, default=None, help="cost: measured steps per variant (default 60)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    for part in args.parts:
        if part not in PARTS:
            p.error(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
    q = args.quick
    args.models = args.models or (["mlp"] if q else ["mlp", "cnn"])
    args.points = (0,) if q else (0, 30, 150)
    args.fixed_steps = args.fixed_steps or (20 if q else 1000)
    args.track_steps = args.track_steps or (3 if q else 150)
    args.max_epochs = args.max_epochs or (1 if q else 60)
    args.target = args.target or (2.0 if q else 0.15)
    args.rounds = args.rounds or (3 if q else 60)
    args.seed_count = args.seeds
    return args


TABLES = {"accuracy": table_accuracy, "tracking": table_tracking, "benefit": table_benefit, "cost": table_cost}
RUNNERS = {"accuracy": part_accuracy, "tracking": part_tracking, "benefit": part_benefit, "cost": part_cost}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    doc: dict[str, Any] = {"benchmark": "noise", "date": datetime.date.today().isoformat(),
                           "command": "python benchmarks/noise.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                           "machine": machine(), "parts": {}}
    for part in args.parts:
        t0 = time.perf_counter()
        seeds = args.seed_count or (1 if args.quick else 3 if part == "accuracy" else 8)
        args.seeds = seeds
        result = RUNNERS[part](args)
        result["seconds"] = time.perf_counter() - t0
        doc["parts"][part] = result
        print(f"\n## {part} ({result['seconds']:.0f} s)\n{TABLES[part](result)}\n", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
