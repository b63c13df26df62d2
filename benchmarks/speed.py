"""Fastest, not largest: the throughput objective and the engine's split against an independent sweep.

For each reference model (CPU, emulated capacity, Adam, one intra-op thread):

1. **Sweep.** Samples/s at 8-12 batch sizes, geometric from small to the largest that fits
   (``objective="memory"``), plus the throughput objective's answer: the sizes take turns,
   in a rotated order each round (``--rounds``); at each visit one warm-up step, then
   ``--steps`` timed steps, the fastest counting; a size's figure is the median over rounds.
   Times are the thread's CPU time, as the finder times a one-thread CPU (other processes on
   a shared machine stretch the wall clock several-fold); the wall-clock ratios are printed too.
   Each size's peak is the exact tensor bytes of two steps (the storage tracker).
2. **Choice.** ``find_batch_size(..., objective="throughput")`` in the same process: its
   answer's swept samples/s against the best swept, and its peak against the largest fit's.
3. **Split.** A per-rank batch of ``1.28 ×`` the largest fit through ``Engine``: the largest
   micro-batch first (``micro_batch_size=largest``: ``largest + rest``) against the engine's
   balanced split (``start=largest``: two equal halves); step time as the median of paired
   per-round ratios (interleaved), peak as exact tensor bytes.

    python benchmarks/speed.py
    python benchmarks/speed.py --quick --json speed.json
    python benchmarks/speed.py --models transformer --mode eval

The goals (issue 14): the choice reaches >= 0.97 of the best swept samples/s, with <= 0.8 of
the largest fit's peak wherever the curve saturates (some swept size within 3% of the best
uses <= 0.8 of that peak); the balanced split's step time is <= 1.01x the largest-first one's,
at a lower peak. Times on a shared CPU are noisy: read the ratios, never the milliseconds.
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import machine  # noqa: E402

from batchpilot.app.report import format_table, write_json  # noqa: E402
from batchpilot.train.engine import Engine, EngineConfig  # noqa: E402
from batchpilot.find.finder import find_batch_size  # noqa: E402
from batchpilot.core.batch import make_batch_fn  # noqa: E402
from batchpilot.memory.units import format_bytes, parse_bytes  # noqa: E402
from batchpilot.memory.probes import track_peak  # noqa: E402
from batchpilot.app.models import MODEL_NAMES, build_model, example_batch  # noqa: E402
from batchpilot.find.snapshot import StateSnapshot  # noqa: E402
from batchpilot.policy.speed import choose_split  # noqa: E402
from batchpilot.find.timing import step_clock  # noqa: E402

SWEEP_COLUMNS = ("model", "mode", "run", "tol", "largest", "sweep sizes", "best (swept)", "choice", "trials",
                 "choice/best s/s", "halves", "wall", "noise", "choice/largest peak", "saturates", "goal")
SPLIT_COLUMNS = ("model", "batch", "largest first", "balanced", "time ratio", "wall", "peak first",
                 "peak balanced", "peak ratio", "goal")
QUICK_SIZES = {"mlp": {"width": 128}, "cnn": {"widths": (4, 8, 16)}, "transformer": {"dim": 16, "layers": 1}}


# ---------------------------------------------------------------------------
# shared with gpu_validate.py: the sweep, the geometric sizes


def geometric_sizes(largest: int, count: int, smallest: int = 1) -> list[int]:
    """``count`` sizes from ``smallest`` to ``largest``, evenly spaced in log, distinct, ``largest`` last.

    ``geometric_sizes(1000, 4) == [1, 10, 100, 1000]``.
    """
    if largest <= smallest:
        return [largest]
    ratio = (largest / smallest) ** (1 / max(1, count - 1))
    sizes = sorted({max(smallest, min(largest, round(smallest * ratio ** i))) for i in range(count)})
    return sizes


def interleaved_sweep(step: Callable[[int], Any], sizes: list[int], *, rounds: int, steps: int,
                      sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter,
                      restore: Callable[[], None] = lambda: None) -> dict[int, dict[str, Any]]:
    """Samples/s of ``step(b)`` at each size: sizes in turn, rotated each round; per visit a warm-up
    step, then ``steps`` timed ones (the fastest counts); the median over rounds.

    ``clock`` is what is judged (the wall clock, or on a one-thread CPU the thread's CPU time,
    as the finder does); the wall time is kept alongside. ``restore`` runs after each visit
    (the model and optimizer as they were)."""
    times: dict[int, list[float]] = {b: [] for b in sizes}
    walls: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(rounds):
        order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        if r % 2:
            order.reverse()  # neither the small nor the large sizes always come after the other
        for b in order:
            step(b)  # warm-up: this size's kernels and caches
            best = wall = math.inf
            for _ in range(steps):
                sync()
                t0, c0 = time.perf_counter(), clock()
                step(b)
                sync()
                best = min(best, clock() - c0)
                wall = min(wall, time.perf_counter() - t0)
            times[b].append(best)
            walls[b].append(wall)
            restore()
    return {b: {"seconds": statistics.median(ts), "samples_per_second": b / statistics.median(ts),
                "wall_seconds": statistics.median(walls[b]), "wall_samples_per_second": b / statistics.median(walls[b]),
                "seconds_all": ts, "wall_seconds_all": walls[b]} for b, ts in times.items()}


# ---------------------------------------------------------------------------
# CPU reference models


class Job:
    """A reference model, its Adam optimizer and its data, with a train or eval step."""

    def __init__(self, name: str, *, mode: str, quick: bool) -> None:
        torch.manual_seed(0)
        self.name, self.mode = name, mode
        self.model = build_model(name, **(QUICK_SIZES[name] if quick else {}))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.make = make_batch_fn(example_batch(self.model, 8, generator=torch.Generator().manual_seed(0)))
        self.loss = nn.CrossEntropyLoss()

    def step(self, b: int) -> None:
        x, y = self.make(b)
        if self.mode == "eval":
            with torch.inference_mode():
                self.model(x)
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.model(x), y).backward()
        self.optimizer.step()

    def peak(self, b: int) -> int:
        """Exact tensor bytes of two steps at ``b`` on copies (optimizer state created in the first)."""
        model, opt = copy.deepcopy((self.model, self.optimizer))
        job = copy.copy(self)
        job.model, job.optimizer = model, opt
        with track_peak("cpu", track=(model, opt)) as m:
            job.step(b)
            job.step(b)
        return m.peak_bytes


def measure_choice(job: Job, capacity: int, target: float, tolerances: list[float], counts: int, rounds: int,
                   steps: int) -> list[dict[str, Any]]:
    """The throughput objective at each tolerance, and one interleaved sweep that includes every answer."""
    restore = (job.model, job.optimizer)
    plans = {}
    for tol in tolerances:
        with _mode(job):
            t0 = time.perf_counter()
            plan = find_batch_size(job.step, objective="throughput", speed_tolerance=tol, restore=restore,
                                   capacity=capacity, target=target)
            plans[tol] = (plan, time.perf_counter() - t0)
    largest = max(p.largest_fitting for p, _ in plans.values())
    sizes = sorted(set(geometric_sizes(largest, counts)) | {p.batch_size for p, _ in plans.values()}
                   | {p.largest_fitting for p, _ in plans.values()})
    snap = StateSnapshot([job.model, job.optimizer])
    with _mode(job):
        sweep = interleaved_sweep(job.step, sizes, rounds=rounds, steps=steps, sync=lambda: None,
                                  clock=step_clock(torch.device("cpu")), restore=snap.restore)
    snap.close()
    peaks = {b: job.peak(b) for b in sizes}
    best = max(sweep, key=lambda b: sweep[b]["samples_per_second"])
    top = sweep[best]["samples_per_second"]
    wall_best = max(s["wall_samples_per_second"] for s in sweep.values())
    # where the curve saturates, some swept size within 3% of the best uses <= 0.8 of the largest's peak
    saturates = any(sweep[b]["samples_per_second"] >= 0.97 * top and peaks[b] <= 0.8 * peaks[largest] for b in sizes)
    # the sweep's own noise: each size's spread over rounds (IQR / median), the median over sizes;
    # and the choice's ratio to the best in each half of the rounds, measured apart
    spread = statistics.median(_iqr(s["seconds_all"]) / s["seconds"] for s in sweep.values())
    halves = [_half_sps(sweep, part) for part in (0, 1)]
    rows = []
    for tol, (plan, seconds) in plans.items():
        chosen = plan.batch_size
        sps_ratio = sweep[chosen]["samples_per_second"] / top
        peak_ratio = peaks[chosen] / peaks[plan.largest_fitting]
        rows.append({
            "model": job.name, "mode": job.mode, "tolerance": tol, "largest": plan.largest_fitting, "choice": chosen,
            "best": best, "sizes": sizes, "sweep": sweep, "peaks": peaks, "choice_over_best": sps_ratio,
            "wall_choice_over_best": sweep[chosen]["wall_samples_per_second"] / wall_best,
            "choice_peak_over_largest": peak_ratio, "saturates": saturates, "noise": spread,
            "halves": [h[chosen] / max(h.values()) for h in halves],
            "goal_met": sps_ratio >= 0.97 and (peak_ratio <= 0.8 or not saturates), "reason": plan.reason,
            "find_seconds": seconds, "find_trials": plan.num_trials, "trials": [t.to_dict() for t in plan.trials],
            "time_fit": None if plan.time_fit is None else vars(plan.time_fit),
        })
    return rows


class _mode:
    """The model in eval mode for an eval job's search and sweep, put back after."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def __enter__(self) -> None:
        self.flags = [(m, m.training) for m in self.job.model.modules()]
        if self.job.mode == "eval":
            self.job.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for m, flag in self.flags:
            m.training = flag


def measure_split(job: Job, largest: int, rounds: int) -> dict[str, Any]:
    """The engine's balanced split against the largest micro-batch first, on the same batch.

    Both run as a fixed ``micro_batch_size`` (``largest``, which the engine cuts as
    ``largest + rest``, and the balanced size the engine's ``"auto"`` picks from ``largest``), so
    that the two differ in the split alone; an ``"auto"`` engine started at ``largest`` is
    checked to pick the same sizes.
    """
    total = max(2, round(1.28 * largest))
    batch = job.make(total)
    loss = lambda m, b: job.loss(m(b[0]), b[1])  # noqa: E731
    balanced = choose_split(total, largest).micro_batch_size
    model, opt = copy.deepcopy((job.model, job.optimizer))
    auto = Engine(model, opt, loss, global_batch_size=total, start=min(largest, total),
                  config=EngineConfig(adapt=False)).step(batch)
    assert auto.micro_batch_size == balanced, (auto.micro_batch_size, balanced)
    engines, sizes = {}, {}
    for label, micro in (("first", min(largest, total)), ("balanced", balanced)):
        model, opt = copy.deepcopy((job.model, job.optimizer))
        eng = Engine(model, opt, loss, global_batch_size=total, micro_batch_size=micro)
        engines[label] = (eng, model, opt)
        k = -(-total // micro)
        sizes[label] = [micro] * (k - 1) + [total - micro * (k - 1)]
        eng.step(batch)  # warm-up
    read = step_clock(torch.device("cpu"))
    times: dict[str, list[float]] = {label: [] for label in engines}
    walls: dict[str, list[float]] = {label: [] for label in engines}
    labels = list(engines)
    for r in range(rounds):
        for label in labels[r % 2:] + labels[:r % 2]:
            eng = engines[label][0]
            t0, c0 = time.perf_counter(), read()
            eng.step(batch)
            times[label].append(read() - c0)
            walls[label].append(time.perf_counter() - t0)
    peaks = {}
    for label, (eng, model, opt) in engines.items():
        with track_peak("cpu", track=(model, opt, batch)) as m:
            eng.step(batch)
        peaks[label] = m.peak_bytes
    ratio = statistics.median(b / a for a, b in zip(times["first"], times["balanced"]))
    wall_ratio = statistics.median(b / a for a, b in zip(walls["first"], walls["balanced"]))
    return {
        "model": job.name, "batch": total, "largest": largest, "sizes": sizes,
        "first_ms": 1e3 * statistics.median(times["first"]), "balanced_ms": 1e3 * statistics.median(times["balanced"]),
        "time_ratio": ratio, "wall_time_ratio": wall_ratio, "peak_first": peaks["first"],
        "peak_balanced": peaks["balanced"], "peak_ratio": peaks["balanced"] / peaks["first"],
        "goal_met": ratio <= 1.01 and peaks["balanced"] < peaks["first"],
    }


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[2] - q[0]


def _half_sps(sweep: dict[int, dict[str, Any]], part: int) -> dict[int, float]:
    """Samples/s per size from the first (``part`` 0) or second half of the rounds alone."""
    out = {}
    for b, s in sweep.items():
        ts = s["seconds_all"]
        half = ts[: max(1, len(ts) // 2)] if part == 0 else ts[len(ts) // 2:]
        out[b] = b / statistics.median(half)
    return out


def _sizes(sizes: list[int]) -> str:
    return " + ".join(map(str, sizes)) if len(sizes) <= 3 else f"{len(sizes)} x ~{sizes[0]}"


def sweep_row(r: dict[str, Any]) -> tuple:
    sw = r["sweep"]
    return (r["model"], r["mode"], r["repeat"], r["tolerance"], r["largest"],
            f"{len(r['sizes'])}: {r['sizes'][0]}..{r['sizes'][-1]}",
            f"{r['best']} ({sw[r['best']]['samples_per_second']:,.0f})",
            f"{r['choice']} ({sw[r['choice']]['samples_per_second']:,.0f})", r["find_trials"],
            f"{r['choice_over_best']:.3f}", "/".join(f"{h:.2f}" for h in r["halves"]),
            f"{r['wall_choice_over_best']:.3f}", f"{r['noise']:.2f}", f"{r['choice_peak_over_largest']:.2f}",
            "yes" if r["saturates"] else "no",
            "met" if r["goal_met"] else "missed")


def split_row(r: dict[str, Any]) -> tuple:
    return (r["model"], r["batch"], f"{_sizes(r['sizes']['first'])}: {r['first_ms']:.1f} ms",
            f"{_sizes(r['sizes']['balanced'])}: {r['balanced_ms']:.1f} ms", f"{r['time_ratio']:.3f}",
            f"{r['wall_time_ratio']:.3f}",
            format_bytes(r["peak_first"]), format_bytes(r["peak_balanced"]), f"{r['peak_ratio']:.2f}",
            "met" if r["goal_met"] else "missed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODEL_NAMES),
                   help=f"comma-separated, from {','.join(MODEL_NAMES)}")
    p.add_argument("--mode", choices=("train", "eval", "both"), default="train", help="the step timed (default train)")
    p.add_argument("--capacity", default="16MiB", help="emulated capacity (default 16MiB)")
    p.add_argument("--target", type=float, default=0.8, help="the finder's target (default 0.8)")
    p.add_argument("--tolerances", type=lambda s: [float(x) for x in s.split(",")], default=[0.05, 0.03],
                   help="the throughput objective's speed_tolerance, one row each (default 0.05,0.03)")
    p.add_argument("--sizes", type=int, default=10, help="swept sizes besides the choices (8-12; default 10)")
    p.add_argument("--rounds", type=int, default=10, help="sweep rounds (default 10)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per visit, the fastest counting (default 3)")
    p.add_argument("--split-rounds", type=int, default=20, help="paired rounds of the split comparison (default 20)")
    p.add_argument("--repeats", type=int, default=3,
                   help="independent runs of the search and the sweep per model (default 3): the spread is the noise")
    p.add_argument("--quick", action="store_true", help="smaller models and fewer rounds (the tests)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--compare", nargs="+", metavar="LABEL=PATH", default=None,
                   help="print the throughput objective's answers of earlier runs' JSON files side by side, "
                        "grouped by label (e.g. before=a.json after=b.json before=c.json ...) and exit")
    args = p.parse_args(argv)
    if args.compare:
        print(format_compare(args.compare))
        return 0
    for m in args.models:
        if m not in MODEL_NAMES:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODEL_NAMES)}")
    if args.quick:
        args.rounds, args.split_rounds, args.sizes = min(args.rounds, 2), min(args.split_rounds, 4), min(args.sizes, 8)
        args.tolerances, args.repeats = args.tolerances[:1], 1
    torch.set_num_threads(1)  # a shared 2-core machine: threads waiting on descheduled peers add noise
    capacity = parse_bytes(args.capacity)
    modes = ("train", "eval") if args.mode == "both" else (args.mode,)
    doc: dict[str, Any] = {
        "benchmark": "speed", "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(), "capacity": capacity, "target": args.target, "tolerances": args.tolerances,
        "rounds": args.rounds, "steps": args.steps, "sweeps": [], "splits": [],
    }
    t_start = time.perf_counter()
    for name in args.models:
        for mode in modes:
            job = Job(name, mode=mode, quick=args.quick)
            for repeat in range(1, args.repeats + 1):
                rows = measure_choice(job, capacity, args.target, args.tolerances, args.sizes, args.rounds, args.steps)
                for r in rows:
                    r["repeat"] = repeat
                    print(f"[{name} {mode} run {repeat}] tolerance {r['tolerance']}: largest {r['largest']}, choice "
                          f"{r['choice']} ({r['reason']}); sweep {len(r['sizes'])} sizes", flush=True)
                doc["sweeps"] += rows
            if mode == "train":
                s = measure_split(job, rows[0]["largest"], args.split_rounds)
                doc["splits"].append(s)
    doc["seconds"] = time.perf_counter() - t_start
    print()
    print(format_result(doc))
    if args.json is not None:
        write_json(doc, args.json)
        print(f"wrote {args.json}")
    return 0


def format_result(doc: dict[str, Any]) -> str:
    head = (f"speed: capacity {format_bytes(doc['capacity'])} (emulated, CPU), target {doc['target']}, "
            f"{doc['rounds']} rounds x {doc['steps']} timed steps, "
            f"torch {doc['machine']['torch']}, {doc['date']}")
    out = [head, "", "throughput objective vs an interleaved sweep (samples/s: median over rounds of the fastest "
                     "timed step, by the thread's CPU time as the finder times a one-thread CPU; 'halves': the "
                     "same ratio from each half of the rounds alone; 'wall': by the wall clock; 'noise': the "
                     "sweep's spread over rounds, IQR / median, the median over sizes)",
           format_table(SWEEP_COLUMNS, [sweep_row(r) for r in doc["sweeps"]])]
    tally: dict[tuple, list[bool]] = {}
    for r in doc["sweeps"]:
        tally.setdefault((r["model"], r["mode"], r["tolerance"]), []).append(r["goal_met"])
    out.append("goal met: " + ", ".join(f"{m} {mode} {tol}: {sum(v)}/{len(v)}"
                                        for (m, mode, tol), v in tally.items()))
    if doc["splits"]:
        out += ["", "engine split: balanced vs the largest micro-batch first (time ratio = balanced / first, "
                    "median of paired rounds, CPU time; 'wall': by the wall clock)",
                format_table(SPLIT_COLUMNS, [split_row(r) for r in doc["splits"]])]
    out.append(f"total {doc['seconds']:.0f} s")
    return "\n".join(out)


COMPARE_COLUMNS = ("model", "mode", "tol", "label", "runs", "choices (largest)", "choice/best s/s per run", "median",
                   "worst", "< 0.95", "choice/largest peak (median)", "trials (median)")


def format_compare(items: list[str]) -> str:
    """The throughput objective's answers of several runs, by label: how close each came to its own sweep's best.

    Each run's ratio is against the best size of the sweep in that run's own process, so runs of
    two versions of the library taking turns compare on the same footing.
    """
    groups: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for item in items:
        label, eq, path = item.partition("=")
        if not eq:
            raise SystemExit(f"--compare takes LABEL=PATH items, got {item!r}")
        doc = json.loads(Path(path).read_text())
        for r in doc["sweeps"]:
            groups.setdefault((r["model"], r["mode"], r["tolerance"]), {}).setdefault(label, []).append(r)
    rows = []
    for (model, mode, tol), by_label in groups.items():
        for label, rs in by_label.items():
            ratios = [r["choice_over_best"] for r in rs]
            rows.append((model, mode, tol, label, len(rs), ", ".join(f"{r['choice']} ({r['largest']})" for r in rs),
                         ", ".join(f"{x:.3f}" for x in ratios), f"{statistics.median(ratios):.3f}",
                         f"{min(ratios):.3f}", f"{sum(x < 0.95 for x in ratios)}/{len(rs)}",
                         f"{statistics.median(r['choice_peak_over_largest'] for r in rs):.2f}",
                         f"{statistics.median(r['find_trials'] for r in rs):.0f}"))
    return format_table(COMPARE_COLUMNS, rows)


if __name__ == "__main__":
    sys.exit(main())
