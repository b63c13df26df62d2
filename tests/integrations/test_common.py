"""What the integrations share, without any framework: options, the batch choice, the report, lazy imports."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys

import pytest

from batchpilot.find.options import FindOptions
from batchpilot.find.result import BatchPlan
from batchpilot.integrations import BatchSetup, SizingOptions
from batchpilot.integrations._common import choose_batches, note_equal_shares
from batchpilot.policy.search import BatchSizeError, Trial

FRAMEWORKS = ("lightning", "transformers", "accelerate", "lm_eval")


@pytest.mark.parametrize(
    ("found", "world", "global_", "accum", "whole", "expected"),
    [
        # a global batch, equal micro-batches (Lightning / HF / Accelerate accumulation)
        (47, 1, 256, 1, True, (32, 8, 256, (32,) * 8)),
        (47, 2, 256, 1, True, (32, 4, 128, (32,) * 4)),
        (500, 2, 256, 1, True, (128, 1, 128, (128,))),
        # a global batch, the engine's balanced micro-batches, as Engine.step cuts them
        (65, 1, 128, 1, False, (64, 2, 128, (64, 64))),
        (50, 1, 128, 1, False, (43, 3, 128, (43, 43, 42))),
        (39, 2, 128, 1, False, (32, 2, 64, (32, 32))),
        (200, 1, 128, 1, False, (128, 1, 128, (128,))),
        # 35 micro-batches: 22 of 15 and 13 of 14 (not 34 of 15 and a last one of 2)
        (15, 1, 512, 1, False, (15, 35, 512, (15,) * 22 + (14,) * 13)),
        # no global batch: the micro-batch found, the accumulation kept
        (47, 2, None, 3, True, (47, 3, 141, (47,) * 3)),
        (47, 1, None, 1, False, (47, 1, 47, (47,))),
    ],
)
def test_choose_batches(found, world, global_, accum, whole, expected):
    micro, steps, per_rank, sizes = choose_batches(found, world_size=world, global_batch_size=global_,
                                                   accum_steps=accum, whole_micro_batches=whole)
    assert (micro, steps, per_rank, sizes) == expected
    assert micro <= found and sum(sizes) == per_rank and len(sizes) == steps
    if global_ is not None:
        assert per_rank * world == global_


def test_choose_batches_names_the_global_batches_that_would_use_the_memory(caplog):
    choose_batches(15, world_size=1, global_batch_size=64, accum_steps=1, whole_micro_batches=True)
    assert "a global batch of 60 or 75 would use the memory fully" in caplog.text


def _sizing(**kw):
    """SizingOptions as every integration builds it: its own fields, and the finder's options as keywords."""
    own = {k: kw.pop(k) for k in ("global_batch_size", "lr_base_size", "lr_rule") if k in kw}
    return SizingOptions(**own, find=FindOptions.build(kw.pop("options", None), **kw))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr_rule": "cubic"}, ValueError, "unknown lr_rule 'cubic'; use one of auto, linear, sqrt, none"),
        ({"global_batch_size": -4}, ValueError, "global_batch_size must be a positive int"),
        ({"lr_base_size": True}, ValueError, "lr_base_size must be a positive int"),
        ({"target": 0}, BatchSizeError, "target must be a fraction"),
        ({"capacity": "lots"}, BatchSizeError, "lots"),
        ({"strategy": "guess"}, BatchSizeError, "unknown strategy 'guess'"),
        ({"steps_per_trial": 0}, BatchSizeError, "steps_per_trial must be a positive int"),
        # the integration sets what to restore and the device itself: they are no finder options
        ({"restore": ()}, BatchSizeError, "unknown finder option 'restore'"),
        ({"tolerence": 0.1}, BatchSizeError, "unknown finder option 'tolerence'; did you mean 'tolerance'"),
        ({"max_trials": 0}, BatchSizeError, "max_trials must be a positive int"),
        ({"find_options": {"max_trials": 9}}, BatchSizeError, r"find_options= is not a finder option any more: "
                                                                r"pass its keys as keywords"),
        ({"options": {"max_trials": 9}}, BatchSizeError, "options must be a batchpilot.FindOptions, got dict"),
    ],
)
def test_sizing_options_are_checked_before_anything_runs(kwargs, error, match):
    with pytest.raises(error, match=match):
        _sizing(**kwargs)


def test_sizing_options_embed_the_finder_options_and_refuse_anything_else():
    with pytest.raises(TypeError, match="find must be a batchpilot.FindOptions, got dict"):
        SizingOptions(find={"max_trials": 9})
    # changing only the batch size, as the peers' finders do, is the default
    assert SizingOptions().lr_rule == "none" and SizingOptions().find == FindOptions()


def test_sizing_options_give_the_finder_the_tighter_limit():
    opts = _sizing(capacity="2MiB", max_batch_size=100, max_trials=9)
    assert opts.find.capacity == 2 * 2**20
    found = opts.finder_options(64)
    assert found.changed() == {"max_trials": 9, "capacity": 2 * 2**20, "max_batch_size": 64}
    assert (found.target, found.strategy, found.steps_per_trial) == (0.8, "predict", 2)
    assert opts.finder_options(None).max_batch_size == 100
    assert opts.find.max_batch_size == 100  # the options themselves are left as they were
    assert SizingOptions().finder_options(None).max_batch_size is None


def test_batch_setup_describes_itself_and_is_json():
    s = BatchSetup(micro_batch_size=43, accum_steps=3, world_size=2, global_batch_size=256, per_rank_batch_size=128,
                   micro_batch_sizes=[43, 43, 42], found_batch_size=50, limited_by_rank=1, lr_base_size=64,
                   lr_rule="sqrt", lr_factor=2.0, learning_rates=(2e-3,))
    assert s.describe() == "global 256 = micro 43 × world 2 × accum 3 (2 of 43, 1 of 42); lr × 2 (sqrt from 64)"
    doc = json.loads(json.dumps(s.to_dict()))
    assert doc["plan"] is None and doc["learning_rates"] == [2e-3] and doc["limited_by_rank"] == 1
    assert doc["micro_batch_sizes"] == [43, 43, 42] and s.micro_batch_sizes == (43, 43, 42)
    equal = BatchSetup(micro_batch_size=16, accum_steps=4, world_size=1, global_batch_size=64, per_rank_batch_size=64,
                       micro_batch_sizes=(16,) * 4, lr_base_size=64, lr_rule="none")
    assert equal.describe() == "global 64 = micro 16 × world 1 × accum 4"


@pytest.mark.parametrize("sizes", [(14,) * 13 + (15,) * 22, (15,) * 35, (15,) * 34, ()])
def test_batch_setup_refuses_micro_batches_that_are_not_its_step(sizes):
    # the sizes must be the step: accum_steps of them, the first the largest, summing to the per-rank batch
    with pytest.raises(ValueError, match="micro_batch_sizes"):
        BatchSetup(micro_batch_size=15, accum_steps=35, world_size=1, global_batch_size=512, per_rank_batch_size=512,
                   micro_batch_sizes=sizes, lr_base_size=512, lr_rule="none")


def test_importing_the_package_imports_no_framework():
    code = ("import sys, batchpilot.integrations as i\n"
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules), i.__all__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("[] ")


def test_each_integration_names_the_extra_when_its_framework_is_missing():
    # None in sys.modules makes an import fail as if the package were not installed
    code = ("import sys\n"
            f"for m in {FRAMEWORKS!r}: sys.modules[m] = None\n"
            f"for m in {FRAMEWORKS!r}:\n"
            "    try:\n        __import__('batchpilot.integrations.' + m)\n"
            "    except ImportError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert len(lines) == len(FRAMEWORKS)
    for name, line in zip(FRAMEWORKS, lines):
        assert line == (f"batchpilot.integrations.{name} needs {name}, which is not installed: "
                        f"pip install 'batchpilot[integrations]' (or pip install {name})")


def test_each_integration_imports_without_the_other_two():
    present = [f for f in FRAMEWORKS if importlib.util.find_spec(f) is not None]
    if not present:
        pytest.skip("needs lightning, transformers, accelerate or lm_eval: pip install -e '.[integrations]'")
    # Each framework is imported first: what it imports of the others (Lightning looks for
    # transformers) is its own business. Then the others are made uninstalled (None in
    # sys.modules) while batchpilot's module is imported. The Trainer needs Accelerate itself
    # (transformers[torch] requires it), and lm-eval's HFLM both, so only Lightning is blocked there.
    code = f"""
import importlib, sys
frameworks = {FRAMEWORKS!r}
for name in {present!r}:
    importlib.import_module(name)
    if name == "transformers":
        import transformers.trainer
    needs = {{"transformers": ("accelerate",), "lm_eval": ("transformers", "accelerate")}}.get(name, ())
    blocked = [f for f in frameworks if f != name and f not in needs]
    saved = {{f: sys.modules.pop(f, None) for f in blocked}}
    sys.modules.update(dict.fromkeys(blocked))
    importlib.import_module("batchpilot.integrations." + name)
    for f, mod in saved.items():
        del sys.modules[f]
        if mod is not None:
            sys.modules[f] = mod
    print(name)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == present


def test_equal_shares_are_said_only_on_a_rank_that_fits_more(caplog):
    def plan(agreed: int, fits: list[int]) -> BatchPlan:
        trials = [Trial(batch_size=b, outcome="fit", peak_bytes=1000 * b) for b in fits]
        return BatchPlan(batch_size=agreed, target=0.8, capacity=1 << 20, limit_bytes=1 << 19, strategy="predict",
                         device="cpu", trials=trials, limited_by_rank=1)

    with caplog.at_level(logging.WARNING, logger="batchpilot.integrations._common"):
        assert not note_equal_shares(plan(64, [32, 64]), 2, "Accelerate", "its sampler")  # this rank set the size
        assert not note_equal_shares(plan(64, [32, 96]), 1, "Accelerate", "its sampler")  # one process: no ranks
        assert not note_equal_shares(None, 2, "Lightning", "its sampler")  # nothing searched
        assert caplog.text == ""
        assert note_equal_shares(plan(64, [32, 96]), 2, "Lightning", "its DistributedSampler")
    assert caplog.text.count("\n") == 1
    assert "fits a batch of 96 but takes 64, rank 1's: Lightning gives every rank the same per-device batch" in caplog.text
