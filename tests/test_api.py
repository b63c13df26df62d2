"""The public API is a contract: names, and the parameters users pass by keyword."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import batchpilot

CONTRACT = {
    "find_batch_size": ["step", "device", "target", "capacity", "strategy", "min_batch_size", "max_batch_size",
                        "steps_per_trial", "restore", "first_guess", "progress"],
    "find_batch_size_for": ["model", "batch", "optimizer", "loss_fn", "mode", "lengths", "seq_dim"],
    "Engine": ["model", "optimizer", "loss_fn", "global_batch_size", "micro_batch_size", "device", "amp",
               "grad_clip", "target", "scheduler", "coordinator", "config", "noise", "schedule", "lengths"],
    "LengthConfig": ["seq_dim", "length_fn", "split", "beyond"],
    "NoiseConfig": ["mode", "beta", "dataset_size", "split"],
    "RampSchedule": ["start", "increment", "samples", "granule", "lr_rule", "scale_weight_decay"],
    "AdaptiveSchedule": ["k", "min_batch_size", "max_batch_size", "granule", "every", "max_factor", "decrease",
                         "start", "lr_rule", "scale_weight_decay"],
    "rescale_weight_decay": ["optimizer", "old_global", "new_global", "lr_factor"],
    "BatchConfig": ["global_batch_size", "micro_batch_size", "accum_steps", "world_size"],
    "scale_lr": ["lr_base", "global_batch_size", "lr_base_size", "rule", "optimizer"],
    "rescale_lr": ["optimizer", "old_global", "new_global", "rule", "scheduler"],
    "ElasticBatchSampler": ["dataset_size", "batch_size", "shuffle", "seed", "drop_last", "num_replicas", "rank"],
    "track_peak": ["device", "track"],
    "emulate_capacity": ["capacity", "device", "track"],
    "estimate_peak_memory": ["model", "sample", "batch_size", "optimizer", "loss_fn", "mode", "amp", "device"],
    "plan_batch_size": ["model", "sample", "capacity", "target", "optimizer", "loss_fn", "max_batch_size"],
    "is_oom": ["exc"],
    "attempt": ["fn", "device", "on_oom"],
}


def test_every_public_name_resolves():
    for name in batchpilot.__all__:
        assert getattr(batchpilot, name) is not None, name


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_documented_parameters_exist(name):
    params = inspect.signature(getattr(batchpilot, name)).parameters
    missing = [p for p in CONTRACT[name] if p not in params]
    assert not missing, f"{name} lost parameters {missing}"


def test_import_probes_no_device_and_stays_light():
    code = (
        "import sys, batchpilot;"
        "heavy = [m for m in ('torch._subclasses.fake_tensor', 'matplotlib', 'tqdm', 'sklearn') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # torch itself imports tqdm (torch.hub) and fake tensors; batchpilot adds neither plots nor data
    assert "matplotlib" not in out and "sklearn" not in out
