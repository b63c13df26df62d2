"""The public API is a contract: names, where they live, and the parameters users pass by keyword."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys

import pytest

import batchpilot

#: exactly what ``from batchpilot import ...`` offers: find, plan, train, their configs, the errors
TOP_LEVEL = [
    "find_batch_size", "find_batch_size_for", "FindOptions", "BatchPlan", "plan_batch_size",
    "Engine", "EngineConfig", "StepResult", "LengthConfig", "NoiseConfig",
    "emulate_capacity",
    "BatchSizeError", "NothingFitsError", "BatchDoesNotFitError", "PlanningError", "UnverifiedLengthError",
    "__version__",
]
SUBPACKAGES = ["batchpilot.memory", "batchpilot.policy", "batchpilot.find", "batchpilot.plan", "batchpilot.dist",
               "batchpilot.train"]

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
    "policy.RampSchedule": ["start", "increment", "samples", "granule", "lr_rule", "scale_weight_decay"],
    "policy.AdaptiveSchedule": ["k", "min_batch_size", "max_batch_size", "granule", "every", "max_factor", "decrease",
                         "start", "lr_rule", "scale_weight_decay"],
    "train.rescale_weight_decay": ["optimizer", "old_global", "new_global", "lr_factor"],
    "train.BatchConfig": ["global_batch_size", "micro_batch_size", "accum_steps", "world_size"],
    "train.scale_lr": ["lr_base", "global_batch_size", "lr_base_size", "rule", "optimizer"],
    "train.rescale_lr": ["optimizer", "old_global", "new_global", "rule", "scheduler"],
    "train.ElasticBatchSampler": ["dataset_size", "batch_size", "shuffle", "seed", "drop_last", "num_replicas", "rank"],
    "memory.track_peak": ["device", "track"],
    "emulate_capacity": ["capacity", "device", "track"],
    "plan.estimate_peak_memory": ["model", "sample", "batch_size", "optimizer", "loss_fn", "mode", "amp", "device"],
    "plan_batch_size": ["model", "sample", "capacity", "target", "optimizer", "loss_fn", "max_batch_size"],
    "memory.is_oom": ["exc"],
    "memory.attempt": ["fn", "device", "on_oom"],
}


#: the top level of 0.2.0: each name is kept (TOP_LEVEL) or moved to a subpackage (batchpilot._MOVED)
TOP_LEVEL_0_2 = [
    "is_oom", "free_memory", "attempt", "get_probe", "track_peak", "emulate_capacity", "parse_bytes", "StorageTracker",
    "find_batch_size", "find_batch_size_for", "BatchPlan", "BatchSizeError", "NothingFitsError",
    "BatchConfig", "scale_lr", "rescale_lr", "rescale_weight_decay", "ElasticBatchSampler", "ElasticLoader",
    "Engine", "EngineConfig", "StepResult", "BatchDoesNotFitError",
    "LengthConfig", "LengthPlan", "LengthFit", "LengthBudget", "UnverifiedLengthError",
    "NoiseConfig", "NoiseSample", "ConstantSchedule", "RampSchedule", "AdaptiveSchedule", "parse_schedule",
    "estimate_peak_memory", "plan_batch_size", "PlanningError", "MemoryEstimate", "PlanResult",
    "DistributedCoordinator", "find_batch_size_distributed", "init_distributed", "FSDPCoordinator",
    "CollectiveOOMError", "find_batch_size_fsdp", "TrainConfig", "run_training", "__version__",
]


def _resolve(dotted: str):
    """``"Engine"`` -> ``batchpilot.Engine``; ``"memory.is_oom"`` -> ``batchpilot.memory.is_oom``."""
    module, _, name = f"batchpilot.{dotted}".rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_top_level_is_the_small_api():
    assert batchpilot.__all__ == TOP_LEVEL
    assert sorted(dir(batchpilot)) == sorted(TOP_LEVEL)
    namespace: dict = {}
    exec("from batchpilot import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(TOP_LEVEL)


def test_every_public_name_resolves():
    for name in batchpilot.__all__:
        assert getattr(batchpilot, name) is not None, name


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_name_a_subpackage_exports_exists(package):
    module = importlib.import_module(package)
    assert module.__all__, f"{package} exports nothing"
    assert len(set(module.__all__)) == len(module.__all__), f"{package}.__all__ repeats a name"
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"{package}.__all__ names {missing}, which it does not have"
    # the re-export is the defining module's own object, listed in that module's __all__ too
    for name in module.__all__:
        value = getattr(module, name)
        home = importlib.import_module(getattr(value, "__module__", None) or package)
        if home.__name__.startswith(package + "."):
            assert name in getattr(home, "__all__", ()), f"{package}.{name}: not in {home.__name__}.__all__"
    namespace: dict = {}
    exec(f"from {package} import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(module.__all__)


def test_every_name_of_0_2_is_kept_or_moved():
    moved = batchpilot._MOVED
    new_in_0_3 = {"FindOptions"}  # the finder's options, one dataclass (CHANGELOG 0.3.0)
    assert sorted(TOP_LEVEL_0_2) == sorted([*(n for n in TOP_LEVEL if n not in new_in_0_3), *moved])
    assert not set(TOP_LEVEL) & set(moved)


@pytest.mark.parametrize("name", sorted(batchpilot._MOVED))
def test_a_moved_name_is_found_at_its_new_home(name):
    home = importlib.import_module(batchpilot._MOVED[name])
    assert name in home.__all__
    assert getattr(home, name) is not None


@pytest.mark.parametrize("name", sorted(batchpilot._MOVED))
def test_a_moved_name_tells_where_it_went(name):
    home = batchpilot._MOVED[name]
    fix = f"from {home} import {name}"
    with pytest.raises(AttributeError, match=f"batchpilot.{name} moved in 0.3.0") as info:
        getattr(batchpilot, name)
    assert fix in str(info.value)
    assert not hasattr(batchpilot, name)
    # Python would replace an AttributeError here by a bare "cannot import name": the fix stays in the message
    with pytest.raises(ImportError, match=f"batchpilot.{name} moved in 0.3.0") as info:
        exec(f"from batchpilot import Engine, {name}", {})
    assert fix in str(info.value)


def test_the_changelog_gives_each_moved_name_its_new_import():
    import re
    from pathlib import Path

    changelog = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    imports = {name.strip(): home for home, names in re.findall(r"`from (batchpilot[\w.]*) import ([\w, ]+)`", changelog)
               for name in names.split(",")}
    wrong = {name: imports.get(name) for name, home in batchpilot._MOVED.items() if imports.get(name) != home}
    assert not wrong, f"CHANGELOG.md gives these moved names no import, or another: {wrong}"


def test_an_unknown_name_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="module 'batchpilot' has no attribute 'no_such_name'"):
        batchpilot.no_such_name  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        exec("from batchpilot import no_such_name", {})
    for package in ("batchpilot.plan", "batchpilot.dist"):  # the lazy ones
        with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'no_such_name'"):
            getattr(importlib.import_module(package), "no_such_name")


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
    accepted = _accepted(_resolve(name))
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


def test_the_planner_and_the_distributed_modules_load_on_first_use():
    heavy = ["batchpilot.plan.planner", "batchpilot.dist.distributed", "batchpilot.dist.fsdp", "torch.distributed.fsdp",
             "batchpilot.app.trainjob"]
    code = (
        "import sys, batchpilot, batchpilot.plan, batchpilot.dist\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
        "from batchpilot.dist import find_batch_size_distributed\n"
        "batchpilot.plan_batch_size\n"
        "print(sorted(m for m in ('batchpilot.plan.planner', 'batchpilot.dist.distributed') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "['batchpilot.dist.distributed', 'batchpilot.plan.planner']"]


def test_import_probes_no_device_and_stays_light():
    code = (
        "import sys, batchpilot;"
        "heavy = [m for m in ('torch._subclasses.fake_tensor', 'matplotlib', 'tqdm', 'sklearn') if m in sys.modules];"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # torch itself imports tqdm (torch.hub) and fake tensors; batchpilot adds neither plots nor data
    assert "matplotlib" not in out and "sklearn" not in out
