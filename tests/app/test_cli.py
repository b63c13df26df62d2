"""The ``batchpilot`` command line, driven as a user drives it: find, plan, train, exit codes, JSON, PNG."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchpilot.app import report
from batchpilot.app.cli import build_parser
from batchpilot.app.models import MLP

from test_report import png_size

BIN = Path(sys.executable).parent


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m batchpilot ARGS`` in a fresh interpreter, as a user would run it."""
    # one OpenMP thread: the shared CI cores are busy, and spinning threads only slow the tiny models down
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "batchpilot", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_user_error(proc_or_err: str, status: int, expected: int) -> None:
    assert status == expected, proc_or_err
    assert "Traceback" not in proc_or_err
    lines = [ln for ln in proc_or_err.strip().splitlines() if not ln.startswith("WARNING")]
    assert len(lines) == 1, proc_or_err  # one line, no traceback
    assert lines[0].startswith("batchpilot ")


# ---------------------------------------------------------------------------
# The command and its help


def test_console_script_and_module_run():
    script = BIN / "batchpilot"
    assert script.exists(), "the console script is not installed (pip install -e .)"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("find", "plan", "train"):
        assert command in proc.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_explains_every_option():
    parser = build_parser()
    subs = _subparsers(parser)
    assert set(subs) == {"find", "plan", "train"}
    for name, sub in [("batchpilot", parser), *subs.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.option_strings} has no help"
        sub.format_help()  # every %(default)s expands


def test_train_uses_timm_option_names():
    opts = {o for a in _subparsers(build_parser())["train"]._actions for o in a.option_strings}
    assert {"--batch-size", "--grad-accum-steps", "--lr-base", "--lr-base-size", "--lr-base-scale", "--opt",
            "--epochs", "--clip-grad", "--sched", "--weight-decay", "--amp", "--seed"} <= opts


# ---------------------------------------------------------------------------
# find


def test_find_json_follows_the_schema():
    proc = run_cli("find", "--model", "mlp", "--input-shape", "64", "--capacity", "4MiB", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # stdout is the JSON document and nothing else
    assert set(doc) == report.SCHEMAS["find"]
    assert doc["schema_version"] == report.SCHEMA_VERSION and doc["command"] == "find"
    assert doc["model"] == "mlp" and doc["input_shape"] == [64] and doc["device"] == "cpu"
    assert doc["capacity_bytes"] == 4 * 1024**2
    assert doc["limit_bytes"] == int(0.8 * 4 * 1024**2)
    assert set(doc["fit"]) == report.SCHEMAS["fit"]
    assert doc["num_trials"] == len(doc["trials"]) >= 2
    for t in doc["trials"]:
        assert set(t) == report.SCHEMAS["trial"]
        assert t["outcome"] in ("fit", "over_target", "oom")
    # the answer is a trial that fitted, and nothing larger fitted
    fitting = [t["batch_size"] for t in doc["trials"] if t["outcome"] == "fit"]
    assert doc["batch_size"] == max(fitting)
    answer = next(t for t in doc["trials"] if t["batch_size"] == doc["batch_size"])
    assert answer["peak_bytes"] <= doc["limit_bytes"]


def test_find_compile_sizes_the_compiled_model_on_real_memory(cli):
    status, out, err = cli("find", "--compile", "aot_eager", "--input-shape", "32", "--max-batch-size", "64",
                           "--json", "--no-progress")
    assert status == 0, err
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["find"]
    assert doc["compiled"] and doc["compiled_trials"] and doc["memory"] == "resident"
    assert doc["compilations"] == 1  # the warm-up's dynamic graph served every trial
    assert min(t["batch_size"] for t in doc["trials"]) == 2
    status, out, err = cli("find", "--compile", "aot_eager", "--input-shape", "32", "--capacity", "4MiB", "--no-progress")
    assert status == 0, err
    assert "compiled model: trials ran eagerly" in out
    # by length: the sequence dim is dynamic too, one graph for the searches at three lengths
    status, out, err = cli("find", "--compile", "aot_eager", "--model", "transformer", "--seq-lens", "8,16,32",
                           "--max-batch-size", "16", "--json", "--no-progress")
    assert status == 0, err
    doc = json.loads(out)
    assert doc["fitted_lengths"] == [8, 16, 32] and doc["compilations"] == 1, doc


def test_find_throughput_objective_json_and_plot(cli, tmp_path):
    png = tmp_path / "find.png"
    status, out, err = cli("find", "--model", "mlp", "--input-shape", "64", "--capacity", "4MiB", "--json",
                           "--no-progress", "--objective", "throughput", "--plot", str(png))
    assert status == 0, err
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["find"] and doc["objective"] == "throughput"
    assert doc["speed_tolerance"] == 0.05 and set(doc["time_fit"]) == report.SCHEMAS["time_fit"]
    fits = [t for t in doc["trials"] if t["outcome"] == "fit"]
    # memory stays a hard limit: the answer is a trial that fitted, at most the largest that did
    assert doc["largest_fitting"] == max(t["batch_size"] for t in fits)
    assert doc["batch_size"] in [t["batch_size"] for t in fits] and doc["batch_size"] <= doc["largest_fitting"]
    assert all(t["samples_per_second"] > 0 and t["step_seconds"] > 0 for t in fits)
    assert all(t["samples_per_second"] is None for t in doc["trials"] if t["outcome"] != "fit")
    # the answer's figure is its own trial's (the choice among noisy timings is tested with an injected
    # clock in tests/find/test_find_speed.py; a real clock here would make the test flaky)
    assert doc["samples_per_second"] in [t["samples_per_second"] for t in fits if t["batch_size"] == doc["batch_size"]]
    assert doc["reason"] and png_size(png) == report.FIGURE_SIZE_PX
    status, out, err = cli("find", "--model", "mlp", "--input-shape", "64", "--capacity", "4MiB", "--no-progress",
                           "--objective", "throughput")
    assert status == 0, err
    assert "largest that fits:" in out and "time fit:" in out and "samples/s" in out


def test_find_prints_a_table_of_the_trials(cli):
    status, out, err = cli("find", "--model", "mlp", "--input-shape", "32", "--capacity", "3MiB",
                           "--strategy", "power", "--no-progress")
    assert status == 0, err
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["#", "batch", "outcome"])
    rows = []
    for ln in lines[header + 2:]:
        if not ln.strip():
            break
        rows.append(ln.split())
    assert len(rows) >= 2 and all(r[2] in ("fit", "over_target", "oom") for r in rows)
    powers = [int(r[1]) for r in rows]
    assert powers[:2] == [1, 2]  # the power strategy doubles from 1
    assert any(ln.startswith("batch size: ") for ln in lines)


# ---------------------------------------------------------------------------
# plan


def test_plan_json_for_a_named_gpu(cli):
    status, out, err = cli("plan", "--model", "mlp", "--input-shape", "32768", "--gpu", "H100-80GB", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["plan"]
    assert doc["gpu"] == "H100-80GB" and doc["device"] == "cuda" and doc["command"] == "plan"
    assert doc["capacity_bytes"] == 80 * 1024**3
    assert set(doc["estimate"]) == report.SCHEMAS["plan.estimate"]
    assert all(set(e) == report.SCHEMAS["plan.evaluation"] for e in doc["evaluations"])
    # the plan sits on the boundary: the answer fits, one more sample does not
    assert doc["estimate"]["required_bytes"] <= doc["limit_bytes"] < doc["next_required_bytes"]
    assert doc["batch_size"] > 10_000


def test_plan_human_output_and_model_factories(cli, tmp_path):
    factory = tmp_path / "my_model.py"
    factory.write_text(textwrap.dedent("""
        import torch.nn as nn

        def build(num_classes):
            return nn.Sequential(nn.Flatten(), nn.Linear(48, num_classes))
    """))
    status, out, err = cli("plan", "--model", f"{factory}:build", "--input-shape", "3,4,4", "--num-classes", "7",
                           "--capacity", "1MiB", "--optimizer", "sgd", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert doc["estimate"]["parameters"] == (48 * 7 + 7) * 4  # the factory was given num_classes=7
    assert doc["model"] == f"{factory}:build"

    status, out, err = cli("plan", "--model", "batchpilot.app.models:MLP", "--input-shape", "64", "--num-classes", "3",
                           "--capacity", "16MiB", "--json")
    assert status == 0, err
    params = sum(p.numel() for p in MLP(num_classes=3).parameters())
    assert json.loads(out)["estimate"]["parameters"] == params * 4

    status, out, err = cli("plan", "--model", "mlp", "--capacity", "16MiB")
    assert status == 0, err
    assert "batch size: " in out and "activations" in out


# ---------------------------------------------------------------------------
# Exit status: 2 for bad arguments, 3 when nothing fits; one line on stderr, no traceback


def test_bad_arguments_exit_2_without_traceback():
    proc = run_cli("find", "--capacity", "2MiB", "--target", "1.5")  # argparse checks the value
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--target" in proc.stderr
    proc = run_cli("plan", "--gpu", "NOPE-1GB")  # our own check
    assert_user_error(proc.stderr, proc.returncode, 2)
    assert "known GPUs" in proc.stderr  # nothing close: the whole list


@pytest.mark.parametrize("argv, needle", [
    (("plan", "--capacity", "lots"), "memory size"),
    (("plan",), "--capacity"),
    (("find", "--model", "no_such_module_xyz:build", "--capacity", "1MiB"), "cannot import"),
    (("find", "--model", "not-a-spec", "--capacity", "1MiB"), "MODULE:FUNCTION"),
    (("find", "--model", "mlp", "--input-shape", "3,8,8", "--capacity", "1MiB"), "1-dim"),
    (("find", "--model", "mlp"), "--capacity"),
    (("plan", "--gpu", "H100", "--model", "mlp", "--input-shape", "64"), "unknown GPU 'H100'; did you mean 'H100-80GB'?"),
    (("find", "--device", "tpu", "--capacity", "1MiB"), "--device"),
    (("train", "--batch-size", "0"), "--batch-size"),
    (("train", "--batch-size", "5000", "--no-progress"), "larger than the"),
    (("train", "--target", "0.97", "--no-progress"), "target"),
    (("train", "--capacity", "2MiB", "--squeeze-capacity", "3MiB"), "below"),
    (("train", "--grad-accum-steps", "300"), "grad-accum-steps"),
    (("find", "--compile", "inductr", "--capacity", "1MiB"), "no such torch.compile backend"),
    (("find", "--capacity", "1MiB", "--objective", "throughput", "--timed-steps", "0"), "--timed-steps 0"),
    (("train", "--batch-schedule", "adaptive", "--noise", "off"), "follows the gradient noise scale"),
    (("train", "--batch-schedule", "adaptive:min=20,max=30,granule=16", "--no-progress"), "no multiple of"),
])
def test_user_errors_exit_2(cli, argv, needle):
    status, out, err = cli(*argv)
    assert status == 2, err
    assert needle in err
    assert "Traceback" not in err and out == ""


def test_nothing_fits_exits_3_with_one_line():
    proc = run_cli("find", "--model", "mlp", "--input-shape", "64", "--capacity", "200KiB", "--no-progress")
    assert_user_error(proc.stderr, proc.returncode, 3)
    assert "nothing fits" in proc.stderr


def test_nothing_fits_exits_3_for_plan_and_train(cli):
    status, _, err = cli("plan", "--model", "mlp", "--capacity", "64KiB")
    assert status == 3 and "nothing fits" in err
    status, _, err = cli("train", "--capacity", "300KiB", "--no-progress", "--no-plot", "--epochs", "1")
    assert status == 3 and "nothing fits" in err and "Traceback" not in err


# ---------------------------------------------------------------------------
# train, the main job


def test_train_default_run_learns_and_adapts(tmp_path):
    """The README's first command, in its default settings: it must learn, and show the adaptation."""
    out_dir = tmp_path / "run"
    proc = run_cli("train", "--out", str(out_dir), "--json", "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    log = json.loads(proc.stdout)
    assert log == json.loads((out_dir / "run.json").read_text())

    assert set(log) == report.SCHEMAS["train"]
    assert set(log["config"]) == report.SCHEMAS["train.config"]
    assert set(log["dataset"]) == report.SCHEMAS["dataset"]
    assert set(log["plan"]) == report.SCHEMAS["train.plan"]
    assert set(log["lr"]) == report.SCHEMAS["lr"]
    assert all(set(s) == report.SCHEMAS["step"] for s in log["steps"])

    # digits with a small CNN: a linear model gets about 95%; 97% means the CNN really learnt
    assert log["accuracy"] >= 0.97, log["accuracy"]
    assert log["dataset"]["num_held_out"] == 360 and log["dataset"]["name"] == "sklearn-digits"

    # the global batch is fixed; the LR scaled by the sqrt rule for AdamW
    gbs = log["config"]["batch_size"]
    assert log["samples_seen"] == gbs * log["optimizer_steps"] == gbs * len(log["steps"])
    assert log["lr"]["rule"] == "sqrt"
    assert math.isclose(log["lr"]["scaled"], log["lr"]["base"] * math.sqrt(gbs / log["lr"]["base_size"]))

    # the finder answered below the global batch, so the engine accumulated from the first step
    first = log["steps"][0]
    assert log["plan"]["batch_size"] < gbs
    assert first["micro_batch_size"] <= log["plan"]["batch_size"]
    assert first["micro_batch_size"] * first["accum_steps"] >= gbs
    # the squeeze forced an OOM and a shrink; the engine grew back when the memory returned
    assert log["total_ooms"] >= 1
    sizes = [c["to"] for c in log["micro_batch_changes"]]
    assert min(sizes) < first["micro_batch_size"]
    assert log["steps"][-1]["micro_batch_size"] > min(sizes)
    # no step ever used more than its capacity
    assert all(s["peak_bytes"] <= s["capacity_bytes"] for s in log["steps"])
    # why each micro-batch: the first split, then every change
    assert set(log["split"]) == report.SCHEMAS["split"]
    assert log["split"]["micro_batch_size"] == first["micro_batch_size"]
    assert first["micro_batch_reason"] == log["split"]["reason"]
    assert all(set(c) == report.SCHEMAS["micro_batch_change"] and c["reason"] for c in log["micro_batch_changes"])
    assert any(c["reason"].startswith("shrunk after an out-of-memory error") for c in log["micro_batch_changes"])

    png = out_dir / "run.png"
    assert png.stat().st_size > 10_000
    assert png_size(png) == report.FIGURE_SIZE_PX


def test_train_with_fixed_accumulation_and_no_capacity(cli, tmp_path):
    status, out, err = cli("train", "--model", "mlp", "--grad-accum-steps", "4", "--epochs", "2", "--capacity", "none",
                           "--no-progress", "--no-plot", "--json", "--out", str(tmp_path), "--opt", "sgd",
                           "--lr-base", "0.2")
    assert status == 0, err
    log = json.loads(out)
    assert log["plan"] is None  # --grad-accum-steps skips the finder
    assert log["steps"][0]["micro_batch_size"] == 32 and log["steps"][0]["accum_steps"] == 4
    assert log["steps"][0]["capacity_bytes"] is None
    assert log["lr"]["rule"] == "linear" and math.isclose(log["lr"]["scaled"], 0.2 * 128 / 256)
    assert (tmp_path / "run.json").exists() and not (tmp_path / "run.png").exists()
    assert log["accuracy"] > 0.5  # two epochs: learning, not yet done


def test_train_a_factory_model_on_images(cli, tmp_path):
    factory = tmp_path / "digits_net.py"
    factory.write_text(textwrap.dedent("""
        import math
        import torch.nn as nn

        def build(num_classes, input_shape):
            return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
    """))
    status, out, err = cli("train", "--model", f"{factory}:build", "--image-inputs", "--epochs", "3", "--capacity",
                           "none", "--no-progress", "--no-plot", "--json", "--out", str(tmp_path / "run"))
    assert status == 0, err
    log = json.loads(out)
    assert log["dataset"]["sample_shape"] == [1, 8, 8]
    assert log["config"]["model"].endswith(":build")
    assert log["accuracy"] > 0.8  # softmax regression on digits


def test_train_ramp_moves_the_global_batch_and_the_lr(cli, tmp_path):
    """Megatron's ramp from 32 to --batch-size 128 over 1500 samples: the sampler follows (each
    sample once per epoch), the LR follows by the sqrt rule (AdamW), the noise scale is logged."""
    status, out, err = cli("train", "--model", "mlp", "--epochs", "2", "--capacity", "none", "--no-progress",
                           "--no-plot", "--json", "--out", str(tmp_path), "--batch-schedule", "ramp:32,32,1500",
                           "--grad-accum-steps", "16")
    assert status == 0, err
    log = json.loads(out)
    assert set(log) == report.SCHEMAS["train"] and set(log["schedule"]) == report.SCHEMAS["schedule"]
    assert all(set(s) == report.SCHEMAS["step"] for s in log["steps"])
    assert all(set(c) == report.SCHEMAS["batch_change"] for c in log["batch_changes"])
    assert log["schedule"] == {"spec": "ramp:32,32,1500", "lr_rule": "sqrt", "scale_weight_decay": False}
    globals_ = [s["global_batch_size"] for s in log["steps"]]
    consumed, want = 0, []
    for g in globals_:  # Megatron's formula: 3 increments, one per 500 samples
        want.append(min(128, 32 + 32 * (consumed * 3 // 1500)))
        consumed += g
    assert globals_ == want and globals_[0] == 32 and globals_[-1] == 128
    assert [c["to"] for c in log["batch_changes"]] == [64, 96, 128]
    assert log["samples_seen"] == sum(globals_)
    # within each epoch no sample twice: at most one short tail dropped (drop_last) per epoch
    per_epoch = [sum(g for s, g in zip(log["steps"], globals_) if s["epoch"] == e) for e in (0, 1)]
    assert all(log["dataset"]["num_train"] - 128 < n <= log["dataset"]["num_train"] for n in per_epoch)
    # the LR is the one for --batch-size, rescaled by sqrt(global / 128), under a cosine over samples
    scaled = log["lr"]["scaled"]
    first = log["steps"][0]
    assert math.isclose(first["lr"], scaled * math.sqrt(32 / 128), rel_tol=1e-9)
    done = 0
    for s in log["steps"]:
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, done / (2 * log["dataset"]["num_train"]))))
        assert math.isclose(s["lr"], scaled * math.sqrt(s["global_batch_size"] / 128) * cosine, rel_tol=1e-6)
        done += s["global_batch_size"]
    # micro-batches of 128 / 16 = 8: the first of each step measures the noise scale
    assert all(set(s["noise"]) == report.SCHEMAS["noise"] for s in log["steps"] if s["noise"] is not None)
    assert log["steps"][0]["noise"]["small_batch"] == 8 and log["steps"][0]["noise"]["big_batch"] == 32
    assert log["noise_scale"] > 0 and log["accuracy"] > 0.8


def test_train_adaptive_follows_the_noise_scale(cli, tmp_path):
    status, out, err = cli("train", "--model", "mlp", "--epochs", "2", "--capacity", "none", "--no-progress",
                           "--out", str(tmp_path), "--batch-schedule", "adaptive:min=16,every=4", "--noise", "every",
                           "--batch-size", "256", "--scale-weight-decay", "--opt", "adamw")
    assert status == 0, err
    assert "global batch (adaptive:k=1,min=16,every=4,granule=8,max_factor=2): 16 -> " in out
    assert "gradient noise scale B_simple at the end: " in out
    assert "the schedule starts at" in out
    log = json.loads((tmp_path / "run.json").read_text())
    globals_ = [s["global_batch_size"] for s in log["steps"]]
    assert globals_ == sorted(globals_) and all(g % 8 == 0 and 16 <= g <= 256 for g in globals_)
    assert len(set(globals_)) > 2
    assert all(s["noise"]["small_count"] >= 2 for s in log["steps"])  # every micro-batch (a lone one is split)
    png = tmp_path / "run.png"
    assert png_size(png) == report.FIGURE_SIZE_PX


def test_train_human_output(cli, tmp_path):
    status, out, err = cli("train", "--model", "mlp", "--epochs", "1", "--no-progress", "--out", str(tmp_path),
                           "--no-squeeze", "--capacity", "3MiB")
    assert status == 0, err
    assert "held-out accuracy: " in out
    assert "lr: 0.01 at batch 256 -> " in out
    assert "#  batch  outcome" in out
    assert f"plot: {tmp_path / 'run.png'}" in out


def test_find_plan_first_verifies_the_plan_in_two_trials():
    args = ("find", "--model", "mlp", "--input-shape", "64", "--capacity", "4MiB", "--json", "--no-progress")
    plain = json.loads(run_cli(*args).stdout)
    proc = run_cli(*args, "--plan-first")
    assert proc.returncode == 0, proc.stderr
    seeded = json.loads(proc.stdout)
    assert set(seeded) == report.SCHEMAS["find"]
    assert seeded["batch_size"] == plain["batch_size"]
    assert seeded["stop_reason"] == "boundary"
    # the planned batch fits and one more does not: the verification certifies it
    assert [t["batch_size"] for t in seeded["trials"]] == [plain["batch_size"], plain["batch_size"] + 1]
    assert plain["num_trials"] > seeded["num_trials"] == 2


def test_find_plan_first_needs_predict():
    proc = run_cli("find", "--model", "mlp", "--input-shape", "64", "--capacity", "4MiB", "--plan-first",
                   "--strategy", "power", "--no-progress")
    assert proc.returncode == 2
    assert "--plan-first" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------
# A user's mistake is one or two lines on stderr that name the fix: never a traceback, never torch's logs

# torch's own log format (glog: level letter, MMDD, time, pid, file:line) and its internal loggers
_TORCH_LOG = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d|torch\._subclasses|fake_tensor|torch\._dynamo", re.M)


def assert_clean_error(err: str, status: int, expected: int, *needles: str) -> None:
    """Exit ``expected``, at most two lines starting ``batchpilot``, each of ``needles`` named."""
    assert status == expected, err
    assert "Traceback" not in err, err
    assert not _TORCH_LOG.search(err), err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("batchpilot "), err
    for needle in needles:
        assert needle in err, (needle, err)


def _write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


_RAISING_FACTORY = """
    def build(**kw):
        raise ValueError("bad config")
"""
# an MLP that expects 64 features, and one that gives 5 class scores
_MLP64_FACTORY = """
    import torch.nn as nn

    def build(num_classes):
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, num_classes))

    def five(**kw):
        return nn.Linear(64, 5)
"""


@pytest.mark.parametrize("command", [
    ("find", "--capacity", "2MiB", "--no-progress"),
    ("plan", "--capacity", "1GiB"),
    ("train", "--no-progress", "--no-plot", "--epochs", "1"),
])
def test_a_factory_that_raises_exits_2(cli, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)  # train would write runs/latest here
    factory = _write(tmp_path / "bad_factory.py", _RAISING_FACTORY)
    status, out, err = cli(*command, "--model", f"{factory}:build")
    assert_clean_error(err, status, 2, "build(", "raised ValueError: bad config", "fix the factory")
    assert out == ""


@pytest.mark.parametrize("command", [("find", "--capacity", "2MiB", "--no-progress"), ("plan", "--capacity", "1GiB")])
def test_an_input_shape_the_model_cannot_take_exits_2(cli, tmp_path, command):
    factory = _write(tmp_path / "mlp64.py", _MLP64_FACTORY)
    status, out, err = cli(*command, "--model", f"{factory}:build", "--input-shape", "32")
    assert_clean_error(err, status, 2, "input shape (2, 32)", "mat1 and mat2 shapes cannot be multiplied",
                       "check --input-shape")
    assert out == ""


def test_too_few_class_scores_exits_2_before_any_trial(cli, tmp_path):
    # with 10 classes a target of 9 would be out of range: an IndexError on CPU, a device assert on CUDA
    factory = _write(tmp_path / "mlp64.py", _MLP64_FACTORY)
    status, out, err = cli("find", "--model", f"{factory}:five", "--input-shape", "64", "--capacity", "2MiB",
                           "--no-progress")
    assert_clean_error(err, status, 2, "shape (2, 5)", "10 classes", "--num-classes")


def test_train_checks_a_factory_model_against_the_digits(cli, tmp_path):
    factory = _write(tmp_path / "wrong_width.py", """
        import torch.nn as nn

        def build(num_classes):
            return nn.Linear(32, num_classes)
    """)
    status, out, err = cli("train", "--model", f"{factory}:build", "--no-progress", "--no-plot", "--epochs", "1",
                           "--out", str(tmp_path))
    assert_clean_error(err, status, 2, "input shape (2, 64)", "64 features", "--image-inputs")
    assert not (tmp_path / "run.json").exists()


def test_very_verbose_shows_the_traceback_of_a_user_error(cli, tmp_path):
    factory = _write(tmp_path / "bad_factory.py", _RAISING_FACTORY)
    status, _, err = cli("plan", "-vv", "--capacity", "1GiB", "--model", f"{factory}:build")
    assert status == 2
    assert err.startswith("batchpilot plan: error: the model factory build")
    assert "Traceback" in err and 'raise ValueError("bad config")' in err  # the user's own line


@pytest.mark.parametrize("model", [
    # .item() on data: fake tensors have no data
    """
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            return self.lin(x) * (int((x > 0).sum().item()) % 3 + 1)
    """,
    # runs on a batch of 2 only, so the smoke check passes and the planner's meta kernel fails
    # at batch 1, which torch logs with its whole traceback
    """
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(128, 20)

        def forward(self, x):
            return self.lin(x.reshape(1, -1)).reshape(-1, 10)
    """,
], ids=["item", "meta-kernel-error"])
def test_plan_on_a_model_fake_tensors_cannot_run_is_one_line(tmp_path, model):
    factory = _write(tmp_path / "unplannable.py", textwrap.dedent(model) + "\n\ndef build(**kw):\n    return Net()\n")
    proc = run_cli("plan", "--model", f"{factory}:build", "--input-shape", "64", "--capacity", "1GiB")
    assert_clean_error(proc.stderr, proc.returncode, 2, "fake tensors", "run the finder")
    assert proc.stdout == ""


def test_version(cli):
    import batchpilot

    status, out, err = cli("--version")
    assert status == 0 and err == ""
    assert out.strip() == f"batchpilot {batchpilot.__version__}"


def test_module_function_is_found_in_the_current_directory(cli, tmp_path, monkeypatch):
    # as with `python -m`: the console script's sys.path starts with its bin directory, not the cwd
    name = "cwd_model_for_batchpilot"
    _write(tmp_path / f"{name}.py", _MLP64_FACTORY)
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    try:
        status, out, err = cli("plan", "--model", f"{name}:build", "--input-shape", "64", "--capacity", "1MiB",
                               "--json")
    finally:
        sys.modules.pop(name, None)
    assert status == 0, err
    assert json.loads(out)["model"] == f"{name}:build"
    assert sys.path == path_before  # the cwd was on the path for that import only


@pytest.mark.parametrize("argv, needle", [
    (("fnd",), "invalid choice: 'fnd'"),
    (("find", "--capcity", "2GiB"), "unrecognized arguments: --capcity"),
    (("plan", "--gpu", "H100-80GB", "--capacity", "1GiB"), "not allowed with"),
    (("find", "--capacity", "1MiB", "--objective", "fastest"), "invalid choice: 'fastest'"),
    (("find", "--capacity", "1MiB", "--speed-tolerance", "5%"), "expected a number"),
    (("find", "--capacity", "1MiB", "--speed-tolerance", "0.7"), "must be in [0, 0.5)"),
    (("train", "--batch-schedule", "rmp:32,32,1000"), "unknown batch schedule 'rmp:32,32,1000'"),
    (("train", "--batch-schedule", "ramp:32,32"), "a ramp is ramp:START,INCR,SAMPLES"),
    (("train", "--batch-schedule", "adaptive:kk=2"), "unknown adaptive key 'kk'"),
    (("train", "--noise", "all"), "invalid choice: 'all'"),
])
def test_typos_are_argparse_usage_errors(cli, argv, needle):
    status, out, err = cli(*argv)
    assert status == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    # one usage (wrapped to the terminal's width for a command's many options), then the error
    assert lines[0].startswith("usage: batchpilot") and err.count("usage:") == 1, err
    assert lines[-1].startswith("batchpilot") and needle in lines[-1], err


@pytest.mark.parametrize("argv, hint", [
    (("fnd",), "; did you mean 'find'?"),
    (("trian", "--capacity", "1MiB"), "; did you mean 'train'?"),
    (("find", "--capcity", "2GiB"), "; did you mean --capacity?"),
    (("plan", "--gpu", "H100-80GB", "--modle=mlp", "--wrld-size", "2"), "; did you mean --model, --world-size?"),
    (("train", "--noise", "firts"), "; did you mean 'first'?"),
    (("find", "--zzz"), "unrecognized arguments: --zzz"),  # nothing near: no guess after it
])
def test_a_typo_is_answered_with_the_near_miss(cli, argv, hint):
    status, _, err = cli(*argv)
    last = err.strip().splitlines()[-1]
    assert status == 2 and last.endswith(hint), err


def test_find_plan_first_on_an_unplannable_model_notes_it_and_searches(cli, tmp_path):
    factory = _write(tmp_path / "item_net.py", """
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(64, 10)

            def forward(self, x):
                return self.lin(x) * (int((x > 0).sum().item()) % 3 + 1)

        def build(**kw):
            return Net()
    """)
    status, out, err = cli("find", "--model", f"{factory}:build", "--input-shape", "64", "--capacity", "4MiB",
                           "--plan-first", "--json", "--no-progress")
    assert status == 0, err
    assert err.strip().splitlines() == [
        "batchpilot find: note: --plan-first found no plan to start from (-v says why); searched unseeded"]
    doc = json.loads(out)
    assert doc["stop_reason"] == "boundary" and doc["num_trials"] > 2


def test_strategy_choices_are_the_library_strategies():
    from batchpilot.policy.search import STRATEGIES

    subs = _subparsers(build_parser())
    for command in ("find", "train"):
        action = next(a for a in subs[command]._actions if "--strategy" in a.option_strings)
        assert set(action.choices) == set(STRATEGIES), command


def test_main_shows_only_the_batchpilot_logger_and_puts_logging_back(cli):
    ours, root = logging.getLogger("batchpilot"), logging.getLogger()
    fake = logging.getLogger("torch._subclasses.fake_tensor")
    before = (ours.handlers[:], ours.level, ours.propagate, root.handlers[:], root.level, fake.level)
    status, _, err = cli("plan", "-v", "--model", "mlp", "--capacity", "16MiB")
    assert status == 0
    assert "INFO batchpilot.plan.planner: planned batch" in err  # -v: our INFO lines, through our handler
    assert (ours.handlers, ours.level, ours.propagate, root.handlers, root.level, fake.level) == before


def test_plan_fsdp_plans_one_rank_of_the_world(cli):
    status, out, err = cli("plan", "--model", "mlp", "--input-shape", "32768", "--gpu", "H100-80GB", "--fsdp",
                           "--world-size", "64", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["plan"] and set(doc["estimate"]) == report.SCHEMAS["plan.estimate"]
    assert (doc["world_size"], doc["sharding"]) == (64, "fsdp2")
    est = doc["estimate"]
    assert est["required_bytes"] <= doc["limit_bytes"] < doc["next_required_bytes"]
    status, out, err = cli("plan", "--model", "mlp", "--input-shape", "32768", "--gpu", "H100-80GB", "--fsdp",
                           "--world-size", "64")
    assert status == 0 and "sharded with FSDP2 over 64 ranks" in out and "unsharded parameters" in out
    assert f"per rank, {doc['batch_size'] * 64} over 64 ranks" in out
    plain = json.loads(cli("plan", "--model", "mlp", "--input-shape", "32768", "--gpu", "H100-80GB", "--json")[1])
    assert (plain["world_size"], plain["sharding"]) == (1, None)
    assert plain["estimate"]["unsharded_parameters"] == plain["estimate"]["communication"] == 0
    # each rank holds a 64th of the parameters (shards padded to equal sizes)
    assert plain["estimate"]["parameters"] / 64 <= est["parameters"] < plain["estimate"]["parameters"] / 60


def test_plan_world_size_without_fsdp_is_a_usage_error(cli):
    status, out, err = cli("plan", "--model", "mlp", "--gpu", "H100-80GB", "--world-size", "8")
    assert status == 2 and "--world-size 8 needs --fsdp" in err and "Traceback" not in err
    status, out, err = cli("plan", "--model", "mlp", "--gpu", "H100-80GB", "--fsdp", "--world-size", "0")
    assert status == 2 and "must be at least 1" in err


_LM_FACTORY = """
from transformers import LlamaConfig, LlamaForCausalLM

def tiny():
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
"""


def test_plan_generate_gives_a_table_per_prompt_length_and_new_tokens(cli, tmp_path):
    pytest.importorskip("transformers")
    from batchpilot.plan.generation import plan_generation

    factory = tmp_path / "lm.py"
    factory.write_text(_LM_FACTORY)
    args = ("plan", "--model", f"{factory}:tiny", "--capacity", "8MiB", "--prompt-lens", "32,256",
            "--new-tokens", "16,128")
    status, out, err = cli(*args, "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert set(doc) == report.SCHEMAS["plan"] and set(doc["generation"]) == report.SCHEMAS["plan.generation"]
    rows = doc["generation"]["rows"]
    assert all(set(r) == report.SCHEMAS["plan.generation.row"] for r in rows)
    assert [(r["prompt_length"], r["new_tokens"]) for r in rows] == [(32, 16), (32, 128), (256, 16), (256, 128)]
    # the library's answer, row by row; the document's batch is the one that fits every row
    lib = plan_generation(_load(factory).tiny(), prompt_lengths=[32, 256], new_tokens=[16, 128], capacity="8MiB")
    assert {(r["prompt_length"], r["new_tokens"]): r["batch_size"] for r in rows} == lib.table
    assert doc["batch_size"] == min(lib.table.values())
    assert doc["estimate"]["required_bytes"] <= doc["limit_bytes"] < doc["next_required_bytes"]
    status, out, err = cli(*args)
    assert status == 0 and "generate(): the largest batch of prompts" in out and "for every row of the table" in out
    plain = json.loads(cli("plan", "--model", "mlp", "--capacity", "16MiB", "--json")[1])
    assert plain["generation"] is None  # without the options the document is as before, the new key null


def _load(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm_factory_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra, message", [
    (("--prompt-lens", "32"), "--prompt-lens and --new-tokens go together"),
    (("--prompt-lens", "32", "--new-tokens", "8", "--model", "transformer"), "must name a factory"),
    (("--prompt-lens", "32", "--new-tokens", "8", "--seq-lens", "8,16"), "--seq-lens cannot go with --prompt-lens"),
    (("--prompt-lens", "0", "--new-tokens", "8"), "must be at least 1"),
])
def test_plan_generate_usage_errors(cli, extra, message):
    args = ["plan", "--capacity", "1GiB", *extra]
    if "--model" not in extra:
        args += ["--model", "x.py:f"]
    status, out, err = cli(*args)
    assert status == 2 and message in err and "Traceback" not in err, err
