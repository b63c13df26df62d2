"""The public API is a contract: names, and the parameters users pass by keyword."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

import batchpilot

CONTRACT = {
    "find_batch_size": ["step", "device", "target", "capacity", "strategy", "min_batch_size", "max_batch_size",
                        "steps_per_trial", "restore", "first_guess", "progress"],
    "find_batch_size_for": ["model", "batch", "optimizer", "loss_fn", "mode", "lengths", "seq_dim", "objective"],
    "FindOptions": ["target", "capacity", "strategy", "min_batch_size", "max_batch_size", "steps_per_trial",
                    "first_guess", "max_trials", "progress", "objective", "timed_steps"],
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


def _accepted(fn) -> set[str]:
    """The keywords ``fn`` takes: its parameters, and the finder's options where it takes them as overrides."""
    params = inspect.signature(fn).parameters
    names = set(params)
    takes_overrides = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes_overrides and "options" in params:  # options: FindOptions | None, and its fields by keyword
        names |= {f.name for f in dataclasses.fields(batchpilot.FindOptions)}
    return names


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_documented_parameters_exist(name):
    accepted = _accepted(getattr(batchpilot, name))
    missing = [p for p in CONTRACT[name] if p not in accepted]
    assert not missing, f"{name} lost parameters {missing}"


def test_the_finder_options_taken_by_keyword_reach_the_options():
    # what _accepted counts for the finder: every such keyword builds the options (an unknown one is refused)
    opts = batchpilot.FindOptions.build(capacity="1MiB", strategy="binsearch", min_batch_size=2, max_batch_size=8,
                                        steps_per_trial=3, first_guess=4, progress=True)
    assert opts.changed() == {"capacity": 1 << 20, "strategy": "binsearch", "min_batch_size": 2, "max_batch_size": 8,
                              "steps_per_trial": 3, "first_guess": 4, "progress": True}
    with pytest.raises(batchpilot.BatchSizeError, match="unknown finder option"):
        batchpilot.find_batch_size(lambda b: None, not_an_option=1)


def test_import_probes_no_device_and_stays_light():
    code = (
        "import sys, batchpilot;"
        "heavy = [m for m in ('torch._subclasses.fake_tensor', 'matplotlib', 'tqdm', 'sklearn') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # torch itself imports tqdm (torch.hub) and fake tensors; batchpilot adds neither plots nor data
    assert "matplotlib" not in out and "sklearn" not in out
