"""Per-step time of ``Engine.step`` against a hand-written accumulation loop, as a ratio.

    python benchmarks/overhead.py
    python benchmarks/overhead.py --rounds 60 --json overhead.json
    python benchmarks/overhead.py --clock cpu   # the step thread's CPU time: a loaded machine's preemption left out

Each workload trains three copies of the same model at the same fixed micro-batch and
accumulation count, on CPU:

* ``hand``: the loop one writes by hand: slice, forward, ``loss * (n_i / N)``, backward,
  ``optimizer.step()``, ``zero_grad(set_to_none=True)``, one ``.item()`` for the log.
* ``engine``: ``Engine(micro_batch_size=m).step(batch)`` and ``.loss``, with the defaults.
* ``noise``: the same with ``noise=True`` (the gradient noise scale, ``first`` mode), what
  measuring it costs beside the defaults.
* ``auto``: ``Engine(micro_batch_size="auto", start=m)``: the same micro-batch with the OOM
  retry armed (RNG / BatchNorm snapshot, the ``attempt`` wrapper, the policy update).

The variants take turns step by step, the order rotated every round, so that drift on a shared
machine hits all of them alike. Times are median steps; a ratio is the median over rounds of
the round's ``variant / hand`` (paired, so slow phases of the machine cancel). Times on a busy
2-core CPU are noisy: read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from batchpilot.app.models import MLP, SmallCNN, example_batch
from batchpilot.train.engine import Engine

WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp": {"build": lambda: MLP(in_features=256, width=1024, depth=2), "global": 256, "micro": 64},
    "cnn": {"build": lambda: SmallCNN(widths=(16, 32, 64), batch_norm=True), "global": 64, "micro": 16},
    # parameter-heavy: 9.5M parameters, a cheap step per parameter (where a gradient norm shows)
    "wide": {"build": lambda: MLP(in_features=512, width=2048, depth=3), "global": 64, "micro": 16},
}
#: the engine variants beside ``hand``, and the keywords each adds to Engine(...)
VARIANTS: dict[str, dict[str, Any]] = {"engine": {}, "noise": {"noise": True}, "auto": {}}


def hand_step_fn(model: nn.Module, opt: torch.optim.Optimizer, micro: int) -> Callable[[Any], float]:
    crit = nn.CrossEntropyLoss()

    def step(batch: Any) -> float:
        x, y = batch
        n = x.shape[0]
        total = None
        for s in range(0, n, micro):
            xs, ys = x[s:s + micro], y[s:s + micro]
            loss = crit(model(xs), ys) * (xs.shape[0] / n)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()

    return step


def engine_step_fn(engine: Engine) -> Callable[[Any], float]:
    return lambda batch: engine.step(batch).loss


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def run(name: str, rounds: int, warmup: int, clock: str = "wall") -> dict[str, Any]:
    spec = WORKLOADS[name]
    n, micro = spec["global"], spec["micro"]
    variants: dict[str, Callable[[Any], float]] = {}
    for label in ("hand", *VARIANTS):
        torch.manual_seed(0)
        model = spec["build"]()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if label == "hand":
            variants[label] = hand_step_fn(model, opt, micro)
            continue
        size = {"start": micro} if label == "auto" else {"micro_batch_size": micro}
        variants[label] = engine_step_fn(Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=n,
                                                **size, **VARIANTS[label]))
    g = torch.Generator().manual_seed(1)
    batch = example_batch(spec["build"](), n, generator=g)
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    now = CLOCKS[clock]
    for r in range(warmup + rounds):
        for label in order[r % len(order):] + order[:r % len(order)]:
            t0 = now()
            variants[label](batch)
            if r >= warmup:
                times[label].append(now() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}

    def paired(label: str) -> float:
        return statistics.median(a / b for a, b in zip(times[label], times["hand"]))

    row: dict[str, Any] = {"workload": name, "global": n, "micro": micro, "accum": -(-n // micro), "rounds": rounds,
                           "hand_ms": 1e3 * med["hand"]}
    for label in VARIANTS:
        row[f"{label}_ms"], row[f"{label}_ratio"] = 1e3 * med[label], paired(label)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | global = micro x accum | hand ms | " + " | ".join(f"{v} ms | ratio" for v in VARIANTS) + " |",
        "|---|---|---:|" + "---:|---:|" * len(VARIANTS),
    ]
    for r in rows:
        cells = " | ".join(f"{r[f'{v}_ms']:.2f} | {r[f'{v}_ratio']:.3f}" for v in VARIANTS)
        lines.append(f"| {r['workload']} | {r['global']} = {r['micro']} x {r['accum']} | {r['hand_ms']:.2f} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=100, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: the step thread's CPU time (one thread: all of the step's work)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [run(name, args.rounds, args.warmup, args.clock) for name in args.workloads]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "clock": args.clock, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
