"""Tables, JSON, plots and progress bars of batchpilot.app.report; the bundled digits of batchpilot.app.datasets."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

from batchpilot.app import report
from batchpilot.app.datasets import load_digits
from batchpilot.app.trainjob import TrainConfig
from batchpilot.find.result import BatchPlan, MemoryFit
from batchpilot.policy.search import Trial
from batchpilot.policy.speed import TimeFit


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (no imaging library needed)."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _plan() -> BatchPlan:
    trials = [
        Trial(batch_size=1, outcome="fit", peak_bytes=1_000_000, start_bytes=900_000, seconds=0.1),
        Trial(batch_size=8, outcome="fit", peak_bytes=1_160_000, start_bytes=900_000, seconds=0.1),
        Trial(batch_size=120, outcome="oom", peak_bytes=None, start_bytes=None, seconds=0.2),
        Trial(batch_size=90, outcome="over_target", peak_bytes=2_900_000, start_bytes=900_000, seconds=0.1),
        Trial(batch_size=80, outcome="fit", peak_bytes=2_600_000, start_bytes=900_000, seconds=0.1),
    ]
    return BatchPlan(batch_size=80, target=0.8, capacity=3_500_000, limit_bytes=2_800_000, strategy="predict",
                     device="cpu", trials=trials, fit=MemoryFit(fixed_bytes=980_000.4, bytes_per_sample=20_000.6),
                     seconds=0.6, stop_reason="boundary", steps_per_trial=2)


def _steps(n: int = 30) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        micro = 64 if i < 10 or i >= 20 else 32
        out.append({"step": i, "epoch": i // 10, "loss": 1.0 / i, "micro_batch_size": micro, "accum_steps": 128 // micro,
                    "ooms": int(i == 10), "peak_bytes": 1_000_000 + 10_000 * micro,
                    "capacity_bytes": 2_000_000 if micro == 64 else 1_000_000, "seconds": 0.01})
    return out


# ---------------------------------------------------------------------------
# JSON


def test_to_json_is_strict_and_plain():
    doc = {"nan": float("nan"), "inf": math.inf, "np": np.int64(3), "t": torch.tensor(2.5), "tuple": (1, 2),
           "path": Path("a/b"), "nested": {1: np.float32(0.5)}}
    text = report.to_json(doc)
    back = json.loads(text)
    assert back == {"nan": None, "inf": None, "np": 3, "t": 2.5, "tuple": [1, 2], "path": "a/b", "nested": {"1": 0.5}}
    assert "NaN" not in text and "Infinity" not in text


def test_write_json_creates_parents(tmp_path):
    path = report.write_json({"a": 1}, tmp_path / "x" / "y" / "run.json")
    assert json.loads(path.read_text()) == {"a": 1}


def test_plan_record_has_exactly_the_schema_keys():
    rec = report.plan_record(_plan())
    assert set(rec) == report.SCHEMAS["train.plan"]
    assert set(rec["fit"]) == report.SCHEMAS["fit"]
    assert all(set(t) == report.SCHEMAS["trial"] for t in rec["trials"])
    assert rec["capacity_bytes"] == 3_500_000 and rec["batch_size"] == 80
    assert rec["fit"] == {"fixed_bytes": 980_000, "bytes_per_sample": 20_001}
    assert rec["num_trials"] == 5 and rec["num_ooms"] == 1
    assert rec["trials"][2]["peak_bytes"] is None
    json.loads(report.to_json(rec))  # serialisable as is


def test_plan_record_accepts_the_dict_form_and_a_missing_fit():
    d = _plan().to_dict()
    d["fit"] = None
    d["some_new_field"] = 1  # a new finder field must not leak into the stable schema
    rec = report.plan_record(d)
    assert rec["fit"] is None
    assert set(rec) == report.SCHEMAS["train.plan"]


def test_find_schema_is_the_job_plus_the_plan():
    assert report.SCHEMAS["train.plan"] < report.SCHEMAS["find"]
    assert report.SCHEMAS["find"] - report.SCHEMAS["train.plan"] == {
        "schema_version", "command", "model", "input_shape", "num_classes", "optimizer", "amp", "device",
        "per_length", "length_fit", "fitted_lengths"}  # --seq-lens: the answer per length (null without)


def test_train_config_schema_matches_the_dataclass():
    assert report.SCHEMAS["train.config"] == {f.name for f in fields(TrainConfig)}
    assert set(TrainConfig().to_dict()) == report.SCHEMAS["train.config"]


# ---------------------------------------------------------------------------
# Tables


def test_format_table_aligns_numbers_right_and_text_left():
    out = report.format_table(("name", "n"), [("a", 5), ("bbbb", 123)])
    lines = out.splitlines()
    assert lines[0] == "name    n"
    assert lines[1] == "----  ---"
    assert lines[2] == "a       5"
    assert lines[3] == "bbbb  123"


def test_format_seconds():
    assert [report.format_seconds(x) for x in (1.234, 0.0015, 2.26e-5, 3e-9, 0)] == [
        "1.23 s", "1.5 ms", "22.6 µs", "3 ns", "0 s"]


def test_trials_table_lists_every_trial_in_order():
    rec = report.plan_record(_plan())
    lines = report.trials_table(rec["trials"]).splitlines()
    assert len(lines) == 2 + 5
    assert [ln.split()[1] for ln in lines[2:]] == ["1", "8", "120", "90", "80"]
    oom = lines[4].split()
    assert oom[2] == "oom" and oom[3] == "-"  # an OOM has no measured peak
    assert "over_target" in lines[5]


def test_micro_batch_changes():
    why = ["split", "split", "oom", "oom", "pressure", "grown"]
    steps = [{"step": i, "micro_batch_size": m, "micro_batch_reason": r}
             for i, (m, r) in enumerate(zip([8, 8, 4, 4, 2, 8], why), 1)]
    assert report.micro_batch_changes(steps) == [
        {"step": 3, "from": 8, "to": 4, "reason": "oom"}, {"step": 5, "from": 4, "to": 2, "reason": "pressure"},
        {"step": 6, "from": 2, "to": 8, "reason": "grown"}]
    assert report.micro_batch_changes([]) == []
    assert all(set(c) == report.SCHEMAS["micro_batch_change"] for c in report.micro_batch_changes(steps))


# ---------------------------------------------------------------------------
# Plots


def test_run_plot_is_a_png_of_the_fixed_size(tmp_path):
    path = report.save_run_plot(report.plan_record(_plan()), _steps(), tmp_path / "sub" / "run.png", title="t")
    assert path.stat().st_size > 10_000  # two panels with lines and text, not an empty canvas
    assert png_size(path) == report.FIGURE_SIZE_PX


def test_run_plot_without_finder_or_capacity(tmp_path):
    steps = [dict(s, capacity_bytes=None) for s in _steps(5)]
    path = report.save_run_plot(None, steps, tmp_path / "run.png")
    assert png_size(path) == report.FIGURE_SIZE_PX


def test_batch_changes_and_the_batch_and_noise_panel(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [dict(s, global_batch_size=32 if s["step"] <= 10 else 64,
                  noise_scale=None if s["step"] < 3 else (math.inf if s["step"] == 4 else 10.0 * s["step"]))
             for s in _steps(20)]
    assert report.batch_changes(steps) == [{"step": 10, "from": 32, "to": 64}]
    assert report.batch_changes(_steps(5)) == []
    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    report.plot_batch_and_noise(ax, steps)
    batch_line, noise_line = ax.get_lines()
    assert list(batch_line.get_ydata()) == [s["global_batch_size"] for s in steps]
    # unmeasured and infinite values are left out of the noise line
    assert list(noise_line.get_xdata()) == [s["step"] for s in steps if s["step"] >= 3 and s["step"] != 4]
    assert ax.get_yscale() == "log"
    path = report.save_run_plot(None, steps, tmp_path / "run.png")
    assert png_size(path) == report.FIGURE_SIZE_PX


def test_run_plot_draws_what_the_run_did(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    plan = report.plan_record(_plan())
    report.plot_memory_fit(left, plan)
    report.plot_run_timeline(right, _steps())
    labels = left.get_legend_handles_labels()[1]
    assert any(lb.startswith("fit:") for lb in labels)
    assert {"trial: fits", "trial: out of memory", "trial: over target"} <= set(labels)
    # the micro-batch line follows the steps exactly
    micro_line = right.get_lines()[0]
    assert list(micro_line.get_ydata()) == [s["micro_batch_size"] for s in _steps()]


def _timed_plan() -> BatchPlan:
    """A throughput plan: the fitting trials timed on 10 ms + 1 ms per sample."""
    plan = _plan()
    for t in plan.trials:
        if t.fits:
            t.step_seconds = 0.01 + 0.001 * t.batch_size
    plan.objective, plan.largest_fitting, plan.batch_size = "throughput", 80, 8
    plan.time_fit = TimeFit(fixed_seconds=0.01, seconds_per_sample=0.001)
    plan.reason = "smallest within 5% of the fastest"
    return plan


def test_speed_is_in_the_record_the_table_and_the_plot(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rec = report.plan_record(_timed_plan())
    assert rec["objective"] == "throughput" and (rec["batch_size"], rec["largest_fitting"]) == (8, 80)
    assert rec["samples_per_second"] == pytest.approx(8 / 0.018)
    assert rec["time_fit"] == {"fixed_seconds": 0.01, "seconds_per_sample": 0.001}
    speeds = [t["samples_per_second"] for t in rec["trials"]]
    assert speeds[0] == pytest.approx(1 / 0.011) and speeds[2] is None and speeds[3] is None  # oom, over target
    rows = report.trials_table(rec["trials"]).splitlines()
    assert rows[0].split()[-1] == "samples/s" and rows[3].split()[-1] == "444" and rows[4].split()[-1] == "-"
    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots(1, 1)
    report.plot_memory_fit(ax, rec)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "trial: samples/s" in labels
    assert "time fit: 10 ms + 1 ms/sample" in labels
    assert any(lb.startswith("chosen: 444 samples/s") for lb in labels)
    assert any(lb == "chosen batch 8 (throughput)" for lb in labels)
    path = report.save_find_plot(rec, tmp_path / "find.png", title="t")
    assert png_size(path) == report.FIGURE_SIZE_PX


# ---------------------------------------------------------------------------
# Progress and lazy imports


def test_progress_is_tqdm_and_silent_when_disabled(capsys):
    from tqdm import tqdm

    bar = report.progress(total=3, enabled=False)
    assert isinstance(bar, tqdm)
    for _ in range(3):
        bar.update(1)
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_report_imports_neither_matplotlib_nor_tqdm():
    # torch may import tqdm itself, so compare what importing report adds
    code = (
        "import sys, torch; before = set(sys.modules); import batchpilot.app.report; "
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('matplotlib', 'tqdm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------
# The bundled digits


def test_digits_split_is_stratified_and_deterministic():
    a = load_digits(seed=3)
    b = load_digits(seed=3)
    assert a.num_train + a.num_test == 1797
    assert a.num_test == 360
    assert a.sample_shape == (64,)
    np.testing.assert_array_equal(a.train_y, b.train_y)
    np.testing.assert_array_equal(a.test_x, b.test_x)
    # every class keeps its share (about 1/10) in the held-out part
    counts = np.bincount(a.test_y, minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38
    assert 0.0 <= a.train_x.min() and a.train_x.max() <= 1.0
    assert a.train_x.dtype == np.float32 and a.train_y.dtype == np.int64
    c = load_digits(seed=4)
    assert not np.array_equal(a.test_y, c.test_y)


def test_digits_image_layout_and_batches():
    split = load_digits(layout="image", held_out=0.25)
    assert split.sample_shape == (1, 8, 8)
    x, y = split.batch([0, 5, 7])
    assert x.shape == (3, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    np.testing.assert_array_equal(x.numpy(), split.train_x[[0, 5, 7]])
    x[:] = -1  # a batch owns its memory: writing to it leaves the data set alone
    assert split.train_x.min() >= 0
    hx, hy = split.batch(np.arange(4), held_out=True)
    np.testing.assert_array_equal(hy.numpy(), split.test_y[:4])


@pytest.mark.parametrize("kwargs", [{"held_out": 0.0}, {"held_out": 1.0}, {"layout": "nchw"}])
def test_digits_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_digits(**kwargs)
