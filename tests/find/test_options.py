"""The finder's options: one dataclass, validated early, overridable by keyword, the one home of the defaults."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import batchpilot
from batchpilot.find.finder import find_batch_size
from batchpilot.find.front import find_batch_size_for
from batchpilot.find.options import FindOptions, option_default, option_help
from batchpilot.policy.search import BatchSizeError, Trial

PACKAGE_DIR = Path(batchpilot.__file__).resolve().parent
NAMES = [f.name for f in dataclasses.fields(FindOptions)]


def _never_called(b):
    raise AssertionError(f"a trial ran at {b}: bad options must fail before any trial")


@pytest.mark.parametrize(("typo", "closest"), [
    ("tolerence", "tolerance"), ("max_trails", "max_trials"), ("steps_per_trail", "steps_per_trial"),
    ("capcity", "capacity"), ("timed_step", "timed_steps"),
])
def test_a_misspelt_option_fails_before_any_trial_with_the_closest_name(typo, closest):
    with pytest.raises(BatchSizeError, match=rf"unknown finder option '{typo}'; did you mean '{closest}'\?"):
        find_batch_size(_never_called, capacity="1MiB", **{typo: 1})
    with pytest.raises(BatchSizeError, match=rf"did you mean '{closest}'"):
        FindOptions.build(FindOptions(), **{typo: 1})


def test_a_keyword_far_from_every_option_lists_them_all():
    with pytest.raises(BatchSizeError) as info:
        find_batch_size(_never_called, zzz=1)
    message = str(info.value)
    assert "did you mean" not in message and message.startswith("unknown finder option 'zzz'.")
    assert message.endswith("The options are the fields of FindOptions: " + ", ".join(NAMES))


def test_the_removed_dict_of_options_says_where_its_keys_go():
    with pytest.raises(BatchSizeError, match=r"find_options= is not a finder option any more: pass its keys as "
                                             r"keywords of their own \(max_trials=9\) or options=FindOptions"):
        FindOptions.build(find_options={"max_trials": 9})


def test_find_batch_size_for_refuses_a_misspelt_option_before_any_work():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def batch(b):
        raise AssertionError("the batch was built: bad options must fail first")

    with pytest.raises(BatchSizeError, match="did you mean 'max_batch_size'"):
        find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.MSELoss(), max_batchsize=8)
    with pytest.raises(BatchSizeError, match="options must be a batchpilot.FindOptions, got dict"):
        find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.MSELoss(), options={"max_trials": 3})


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"target": 0}, r"target must be a fraction of device memory in \(0, 1\], got 0; 0.6-0.8 leaves room"),
    ({"target": 1.2}, r"target must be a fraction"),
    ({"target": True}, r"target must be a fraction"),
    ({"capacity": "lots"}, "lots"),
    ({"strategy": "guess"}, "unknown strategy 'guess'; choose one of predict"),
    ({"min_batch_size": 0}, "min_batch_size must be a positive int"),
    ({"max_trials": 2.5}, "max_trials must be a positive int"),
    ({"min_batch_size": 8, "max_batch_size": 4}, "min_batch_size 8 is larger than max_batch_size 4; lower"),
    ({"progress": "yes"}, "progress must be True, False or None"),
    ({"tolerance": 0.5}, r"tolerance must be a fraction in \[0, 0.5\)"),
    ({"snapshot": "cloud"}, "snapshot must be 'auto', 'memory' or 'disk'"),
    ({"objective": "speed"}, "objective must be one of"),
    ({"speed_tolerance": 0.7}, r"speed_tolerance must be a fraction in \[0, 0.5\)"),
    ({"objective": "throughput", "timed_steps": 0}, r"throughput objective needs timed steps"),
    ({"timed_steps": -1}, "timed_steps must be >= 0"),
])
def test_values_are_validated_where_they_are_declared(kwargs, match):
    with pytest.raises(BatchSizeError, match=match):
        FindOptions(**kwargs)
    with pytest.raises(BatchSizeError, match=match):  # and when a base is overridden
        FindOptions.build(FindOptions(), **kwargs)


def test_build_overrides_a_base_and_leaves_it_as_it_was():
    base = FindOptions(capacity="2MiB", max_batch_size=64, max_trials=9)
    merged = FindOptions.build(base, max_batch_size=16, strategy="binsearch")
    assert (merged.capacity, merged.max_batch_size, merged.strategy, merged.max_trials) == (2 << 20, 16, "binsearch", 9)
    assert (base.max_batch_size, base.strategy) == (64, "predict")
    assert FindOptions.build(base) is base and FindOptions.build() == FindOptions()
    assert FindOptions.build(None, target=0.5) == FindOptions(target=0.5)
    # an override that makes the whole inconsistent is refused like a new instance
    with pytest.raises(BatchSizeError, match="min_batch_size 32 is larger than max_batch_size 16"):
        FindOptions.build(merged, min_batch_size=32)


def test_changed_names_what_differs_from_the_defaults():
    assert FindOptions().changed() == {}
    assert FindOptions(target=0.6, capacity="1KiB", max_trials=25).changed() == {"target": 0.6, "capacity": 1024}


def test_resolved_decides_the_objective_and_the_timed_steps_left_open():
    assert (FindOptions().objective, FindOptions().timed_steps) == (None, None)
    memory = FindOptions().resolved()
    assert (memory.objective, memory.timed_steps) == ("memory", 1)
    fast = FindOptions().resolved("throughput")
    assert (fast.objective, fast.timed_steps) == ("throughput", 3)
    given = FindOptions(objective="memory", timed_steps=0)
    assert given.resolved("throughput") is given  # what was set stays
    with pytest.raises(BatchSizeError, match="throughput objective needs timed steps"):
        FindOptions(timed_steps=0).resolved("throughput")


def test_every_option_is_documented_where_it_is_declared_and_the_docstring_is_built_from_it():
    doc = inspect.getdoc(FindOptions)
    for f in dataclasses.fields(FindOptions):
        text = option_help(f.name)
        assert text and text == f.metadata["help"]
        assert option_default(f.name) == f.default
        # the docstring's entry: the name, then the same words (wrapped), then the default
        entry = re.search(rf"^    {f.name}: (.*?)(?=^    \w+: |\nRaises:)", doc, re.MULTILINE | re.DOTALL)
        assert entry is not None, f"FindOptions' docstring has no entry for {f.name}"
        assert " ".join(entry.group(1).split()) == f"{text}; default {f.default!r}."
    with pytest.raises(BatchSizeError, match="did you mean 'target'"):
        option_help("targte")


def test_the_first_signature_a_user_reads_is_short_and_every_option_still_works_by_keyword():
    assert list(inspect.signature(find_batch_size).parameters) == [
        "step", "device", "target", "restore", "options", "lockstep", "overrides"]
    front = inspect.signature(find_batch_size_for).parameters
    assert not set(front) & (set(NAMES) - {"target"}), "an option named twice: keep it in FindOptions"
    assert list(front)[-4:] == ["device", "target", "options", "overrides"]


def _linear_job():
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)

    def step(b):
        opt.zero_grad(set_to_none=True)
        model(x[:b]).sum().backward()
        opt.step()

    return model, opt, step


def test_options_and_keyword_overrides_reach_the_search():
    model, opt, step = _linear_job()
    base = FindOptions(capacity="4MiB", max_batch_size=48, strategy="binsearch")
    plan = find_batch_size(step, device="cpu", restore=(model, opt), options=base, max_batch_size=8, target=0.5)
    # the override's bound and target, the base's capacity and strategy
    assert plan.batch_size == 8 and plan.stop_reason == "max_batch_size"
    assert max(t.batch_size for t in plan.trials) == 8
    assert (plan.target, plan.capacity, plan.strategy) == (0.5, 4 << 20, "binsearch")
    assert (plan.objective, plan.steps_per_trial) == ("memory", 2)
    assert base.max_batch_size == 48  # the caller's options are theirs
    # the same search spelt as keywords alone (what every existing caller does)
    again = find_batch_size(step, device="cpu", restore=(model, opt), capacity="4MiB", strategy="binsearch",
                            max_batch_size=8, target=0.5)
    assert [t.batch_size for t in again.trials] == [t.batch_size for t in plan.trials]


def test_the_mode_decides_an_objective_left_open():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    kw = dict(loss_fn=nn.CrossEntropyLoss(), capacity="2MiB", max_batch_size=16)
    assert find_batch_size_for(model, batch, optimizer=opt, **kw).objective == "memory"
    assert find_batch_size_for(model, batch, mode="eval", **kw).objective == "throughput"
    # set in the options, it is kept whatever the mode
    fixed = FindOptions(objective="memory")
    assert find_batch_size_for(model, batch, mode="eval", options=fixed, **kw).objective == "memory"


# the copies of the finder's defaults that issue 24 counted (signatures, dataclasses, dict lookups)
_DEFAULT_COPIES = re.compile(
    r"target: float = 0\.8|steps_per_trial: int = 2\b|target=0\.8\b|steps_per_trial=2\b"
    r"|\"target\", 0\.8\)|\"steps_per_trial\", 2\)|\"min_batch_size\", 1\)"
)
#: where a copy is allowed: the home itself, and the planner, which sits below the finder in the
#: layers (tests/test_layering.py), cannot import it, and has options of its own (plan_batch_size(target=),
#: plan_generation(target=))
_HOMES = {"find/options.py", "plan/planner.py", "plan/generation.py"}


def test_the_scan_sees_a_copied_default():
    code = 'def f(*, target: float = 0.8, steps_per_trial: int = 2):\n    return o.get("steps_per_trial", 2)\n'
    assert len(_DEFAULT_COPIES.findall(code)) == 3


def test_the_finder_defaults_are_written_only_in_find_options():
    copies = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        if rel in _HOMES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _DEFAULT_COPIES.search(line):
                copies.append(f"{rel}:{number}: {line.strip()}")
    assert not copies, ("a default of the finder written outside batchpilot/find/options.py; read it from "
                        "FindOptions (option_default, or embed FindOptions):\n" + "\n".join(copies))


def test_a_plan_records_the_steps_per_trial_default_of_the_options():
    plan = batchpilot.BatchPlan(batch_size=1, target=0.8, capacity=1, limit_bytes=1, strategy="predict",
                                device="cpu", trials=[Trial(batch_size=1, outcome="fit", peak_bytes=1)])
    assert plan.steps_per_trial == option_default("steps_per_trial") == FindOptions().steps_per_trial
