"""find_batch_size on CPU: exact boundaries under an emulated capacity, state restore, OOM recovery,
bad input, and a real RLIMIT_AS cap in a subprocess."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from batchpilot.app.models import build_model, example_batch
from batchpilot.core.batch import make_batch_fn
from batchpilot.find.finder import find_batch_size
from batchpilot.find.front import find_batch_size_for
from batchpilot.find.result import BatchPlan
from batchpilot.find.snapshot import StateSnapshot
from batchpilot.memory.probes import emulate_capacity, track_peak
from batchpilot.memory.tracker import active_tracker
from batchpilot.memory.units import parse_bytes
from batchpilot.policy.search import BatchSizeError, NothingFitsError, OOM

CAPACITY = parse_bytes("4MiB")


def setup(name: str, seed: int = 0, **sizes):
    torch.manual_seed(seed)
    model = build_model(name, **sizes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = example_batch(model, 4, generator=torch.Generator().manual_seed(seed))
    return model, optimizer, batch


def direct_peak(model: nn.Module, optimizer: torch.optim.Optimizer, batch, b: int, steps: int = 2) -> int:
    """The peak of ``steps`` training steps at batch b, measured on fresh copies (no finder involved)."""
    model = copy.deepcopy(model)
    opt = type(optimizer)(model.parameters(), **optimizer.defaults)
    make, loss_fn = make_batch_fn(batch), nn.CrossEntropyLoss()
    with track_peak("cpu", track=(model, opt)) as m:
        for _ in range(steps):
            x, y = make(b)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
    return m.peak_bytes


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    out = {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "grads": {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }
    if optimizer is not None:
        out["optimizer"] = copy.deepcopy(optimizer.state_dict())
    return out


def assert_same_state(a: dict, b: dict) -> None:
    for kind in ("params", "buffers", "grads"):
        assert a[kind].keys() == b[kind].keys()
        for k in a[kind]:
            x, y = a[kind][k], b[kind][k]
            assert (x is None) == (y is None), f"{kind} {k}"
            if x is not None:
                assert torch.equal(x, y) and x.dtype == y.dtype, f"{kind} {k} changed"
    assert a["training"] == b["training"]
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    na, nb = a["numpy_rng"], b["numpy_rng"]
    assert na[0] == nb[0] and np.array_equal(na[1], nb[1]) and na[2:] == nb[2:]
    assert a["python_rng"] == b["python_rng"]
    if "optimizer" in a:
        sa, sb = a["optimizer"], b["optimizer"]
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for i in sa["state"]:
            assert sa["state"][i].keys() == sb["state"][i].keys()
            for k in sa["state"][i]:
                assert torch.equal(sa["state"][i][k], sb["state"][i][k]), f"optimizer state {i}.{k} changed"


# ---------------------------------------------------------------------------
# the contract: exact boundary, state bit-identical


@pytest.mark.parametrize("target", [0.6, 0.9])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_exact_boundary_and_state_restored(name, target):
    model, opt, batch = setup(name)
    np.random.seed(1)
    random.seed(2)
    before = state_of(model, opt)
    plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(),
                               capacity=CAPACITY, target=target)
    assert_same_state(before, state_of(model, opt))
    b, limit = plan.batch_size, plan.limit_bytes
    assert limit == int(target * CAPACITY) and plan.stop_reason == "boundary"
    peak_b = direct_peak(model, opt, batch, b)
    assert peak_b <= limit < direct_peak(model, opt, batch, b + 1)
    assert [t.peak_bytes for t in plan.trials if t.batch_size == b] == [peak_b]
    # the MLP's optimizer step outweighs its activations up to ~200 samples: a flat start costs trials
    assert plan.num_ooms == 0 and plan.num_trials <= {"mlp": 8, "cnn": 3, "transformer": 4}[name], plan.trials


def test_restores_existing_optimizer_state_grads_scheduler_and_batchnorm():
    model, opt, batch = setup("cnn")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch
    for _ in range(2):  # Adam state, BatchNorm statistics and a decayed LR exist before the search
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    nn.functional.cross_entropy(model(x), y).backward()  # and gradients are pending
    ema = torch.randn(7)
    before, sched_before, ema_before = state_of(model, opt), copy.deepcopy(sched.state_dict()), ema.clone()

    def step(b: int) -> None:
        xb, yb = make_batch_fn(batch)(b)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        sched.step()
        ema.mul_(0.5).add_(torch.rand(7))
        np.random.rand(3)
        random.random()

    plan = find_batch_size(step, device="cpu", capacity=CAPACITY, restore=(model, opt, sched, ema))
    assert plan.batch_size > 1
    assert_same_state(before, state_of(model, opt))
    assert sched.state_dict() == sched_before
    assert opt.param_groups[0]["lr"] == sched_before["_last_lr"][0]
    assert torch.equal(ema, ema_before)


def test_grad_scaler_state_is_restored():
    model, opt, batch = setup("mlp")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    before = copy.deepcopy(scaler.state_dict())
    plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), scaler=scaler,
                               amp="bf16", capacity=CAPACITY, strategy="power", max_batch_size=8)
    assert plan.batch_size == 8
    assert scaler.state_dict() == before


def test_oom_leaves_nothing_behind():
    model, opt, batch = setup("cnn")
    x, y = batch
    with emulate_capacity(CAPACITY, "cpu", track=(model, opt, x, y)):
        tracker = active_tracker("cpu")
        live = tracker.live
        plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), strategy="power")
        assert plan.num_ooms >= 1 and plan.capacity == CAPACITY
        oom = next(t for t in plan.trials if t.outcome == OOM)
        assert "emulated capacity" in oom.message
        assert tracker.live == live


def test_non_oom_errors_propagate_untouched_and_state_is_restored():
    model, opt, batch = setup("mlp")
    before = state_of(model, opt)
    boom = KeyError("not an OOM")
    calls = []

    def step(b: int) -> None:
        calls.append(b)
        x, y = make_batch_fn(batch)(b)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if b > 1:
            raise boom

    with pytest.raises(KeyError) as info:
        find_batch_size(step, device="cpu", capacity=CAPACITY, restore=(model, opt))
    assert info.value is boom and calls[0] == 1 and len(calls) >= 3
    assert_same_state(before, state_of(model, opt))


def test_an_error_of_the_users_step_keeps_its_type_and_gains_a_note_naming_the_batch_size():
    model, opt, batch = setup("mlp")
    calls = []

    def step(b: int) -> None:
        calls.append(b)
        x, y = make_batch_fn(batch)(b)
        nn.functional.cross_entropy(model(x), y).backward()
        if b > 2:
            raise ValueError("the user's own check")

    with pytest.raises(ValueError, match="the user's own check") as info:
        find_batch_size(step, device="cpu", capacity=CAPACITY, restore=(model, opt))
    assert info.value.__notes__ == [f"batchpilot: raised by the step during a trial at batch size {calls[-1]}"]
    assert calls[-1] > 2


def test_an_index_error_from_the_model_in_a_trial_names_the_batch_size_also_through_the_engine():
    from batchpilot.train.engine import Engine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Flatten(), nn.Linear(8 * 4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.full((4, 4), 20)  # a token past the table: the model's own IndexError
    batch = (ids, torch.zeros(4, dtype=torch.long))
    with pytest.raises(IndexError) as info:
        find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY)
    (note,) = info.value.__notes__
    assert re.fullmatch(r"batchpilot: raised by the step during a trial at batch size \d+", note)
    engine = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=4)
    with pytest.raises(IndexError) as info:
        engine.step(batch)  # the engine's first step asks the finder for its micro-batch
    (note,) = info.value.__notes__
    assert re.fullmatch(r"batchpilot: raised by the step during a trial at batch size \d+", note)


def test_nested_trials_leave_one_note_with_both_figures():
    from batchpilot.find.notes import note_trial_error

    exc = IndexError("index out of range in self")
    note_trial_error(exc, batch_size=64)
    note_trial_error(exc, batch_size=128, length=300)  # an outer search: the inner batch size stands
    assert exc.__notes__ == ["batchpilot: raised by the step during a trial at batch size 64, sequence length 300"]
    note_trial_error(exc)
    assert len(exc.__notes__) == 1


# ---------------------------------------------------------------------------
# strategies, eval mode, options


def test_strategies_agree_on_the_boundary():
    model, opt, batch = setup("cnn", widths=(8, 16))
    kw = dict(optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity="2MiB", target=0.8)
    predict = find_batch_size_for(model, batch, **kw)
    binsearch = find_batch_size_for(model, batch, strategy="binsearch", **kw)
    power = find_batch_size_for(model, batch, strategy="power", **kw)
    decay = find_batch_size_for(model, batch, strategy="decay", first_guess=64, **kw)
    assert binsearch.batch_size == predict.batch_size
    assert predict.batch_size // 2 < power.batch_size <= predict.batch_size
    assert decay.batch_size <= predict.batch_size and decay.trials[0].batch_size == 64
    assert predict.num_trials < binsearch.num_trials


def test_first_guess_from_a_planner_is_verified_in_two_trials():
    model, opt, batch = setup("cnn")
    kw = dict(optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY)
    answer = find_batch_size_for(model, batch, **kw).batch_size
    plan = find_batch_size_for(model, batch, first_guess=answer, **kw)
    assert plan.batch_size == answer and [t.batch_size for t in plan.trials] == [answer, answer + 1]


def test_a_caller_first_guess_is_recorded_but_not_as_a_plan():
    model, opt, batch = setup("cnn")
    plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY,
                               first_guess=3)
    assert plan.trials[0].batch_size == 3 and plan.first_guess == 3 and plan.seeded_by is None


def test_a_step_slicing_a_dataset_tensor_gets_one_answer_whatever_the_order_of_the_trials():
    # the README's pattern: each trial pays for its own slice X[:b], not for the widest slice of
    # the search so far (that charge made the answers 3016 / 2992 / 3078 and the default search 8 trials)
    torch.manual_seed(0)
    X, Y = torch.randn(20000, 256), torch.randint(0, 10, (20000,))
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(b: int) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[:b]), Y[:b]).backward()
        opt.step()

    plans = [find_batch_size(step, capacity="40MiB", device="cpu", restore=(model, opt), first_guess=guess)
             for guess in (None, 4096, 700)]
    assert [p.batch_size for p in plans] == [plans[0].batch_size] * 3, [p.batch_size for p in plans]
    assert 2000 < plans[0].batch_size < 4096
    assert all(p.num_trials <= 5 for p in plans), [[t.batch_size for t in p.trials] for p in plans]
    # the answer's trial is charged its own slice: the same peak in every search
    peaks = {t.peak_bytes for p in plans for t in p.trials if t.batch_size == p.batch_size}
    assert len(peaks) == 1 and peaks.pop() <= 0.8 * parse_bytes("40MiB")


def test_a_trial_that_reads_the_whole_dataset_tensor_leaves_no_charge_for_later_trials():
    # a trial at the dataset's length reads all of X: X is still host data, charged by that trial
    # only. Charged as the step's own memory from then on, it made every later trial pay for all of
    # X: the answer then depended on whether a search (its first guess, its policy) ever got there
    torch.manual_seed(0)
    n = 2048
    X, Y = torch.randn(n, 512), torch.randint(0, 10, (n,))
    model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(b: int) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[:b]), Y[:b]).backward()
        opt.step()

    kw = dict(capacity="12MiB", device="cpu", restore=(model, opt), max_batch_size=n)
    # an earlier search with room for all of X, then searches from every side of the answer
    assert find_batch_size(step, **{**kw, "capacity": "40MiB"}).batch_size == n
    plans = [find_batch_size(step, first_guess=guess, **kw) for guess in (None, n, 300, 1700, 1900)]
    answers = [p.batch_size for p in plans]
    assert answers == [answers[0]] * len(plans), answers
    assert n // 2 < answers[0] < n
    # the user's own step at the full size before searching (Adam's state then exists) changes nothing
    step(n)
    assert find_batch_size(step, first_guess=n, **kw).batch_size == answers[0]
    # one figure per size, whatever ran before it
    peaks: dict[int, set[int]] = {}
    for p in plans:
        for t in p.trials:
            peaks.setdefault(t.batch_size, set()).add(t.peak_bytes)
    assert all(len(v) == 1 for v in peaks.values()), {b: v for b, v in peaks.items() if len(v) > 1}


def test_a_step_whose_memory_stops_growing_stops_the_search_and_says_so(caplog):
    # X[:b] of 256 rows: past 256 every size costs the same; with no max_batch_size the search
    # climbed to 1e25 in 25 trials
    torch.manual_seed(0)
    X, Y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(b: int) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[:b]), Y[:b]).backward()
        opt.step()

    with caplog.at_level(logging.WARNING, logger="batchpilot.find.finder"):
        plan = find_batch_size(step, capacity="4MiB", device="cpu", restore=(model, opt))
    assert plan.stop_reason == "plateau" and plan.num_trials <= 6, [t.batch_size for t in plan.trials]
    assert 256 <= plan.batch_size < 10 * 256
    below = max(t.batch_size for t in plan.trials if t.fits and t.batch_size < plan.batch_size)
    assert below < 256 <= plan.batch_size  # the interval named holds the dataset's length
    assert f"memory stopped growing somewhere between {below} and {plan.batch_size}" in plan.reason
    assert "set max_batch_size (e.g. your dataset's length)" in plan.reason
    assert "max_batch_size" in plan.to_raise() and plan.reason in caplog.text


# ---------------------------------------------------------------------------
# planner-seeded search (plan_first)


@pytest.mark.parametrize("name,mode", [("mlp", "train"), ("cnn", "train"), ("transformer", "train"), ("cnn", "eval")])
def test_plan_first_verifies_the_plan_in_two_trials_with_the_same_answer(name, mode):
    model, opt, batch = setup(name)
    # the memory objective (eval's default is throughput): the plan is about memory
    kw = dict(optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY, mode=mode, objective="memory")
    alone = find_batch_size_for(model, batch, **kw)
    before = state_of(model, opt)
    seeded = find_batch_size_for(model, batch, plan_first=True, **kw)
    assert_same_state(before, state_of(model, opt))
    b = alone.batch_size
    assert seeded.batch_size == b and seeded.stop_reason == "boundary"
    # the plan is exact on CPU: its size fits and the next one, the check, does not
    assert [t.batch_size for t in seeded.trials] == [b, b + 1] and seeded.num_ooms == 0
    assert seeded.first_guess == b and seeded.seeded_by == "plan"
    assert 0 < seeded.plan_seconds <= seeded.seconds
    assert alone.num_trials > seeded.num_trials


def test_plan_first_leaves_out_the_example_batch_the_finder_keeps():
    from batchpilot.plan.planner import plan_batch_size

    model, opt, _ = setup("mlp")
    pool = example_batch(model, 256, generator=torch.Generator().manual_seed(0))  # 66 KiB: ~15 samples' worth
    kw = dict(optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY)
    alone = find_batch_size_for(model, pool, **kw)
    seeded = find_batch_size_for(model, pool, plan_first=True, **kw)
    b = alone.batch_size
    assert seeded.batch_size == b and [t.batch_size for t in seeded.trials] == [b, b + 1]
    # planned against the whole limit, the pool the finder's trials hold would be missed
    naive = plan_batch_size(model, pool, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY)
    assert naive.batch_size > b + 1


class _ItemMLP(nn.Module):
    """An MLP whose forward reads a value back with ``.item()``: it runs, but cannot be planned."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = build_model("mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        return y / (1.0 + y.detach().abs().max().item())


def test_plan_first_falls_back_to_the_finder_when_the_step_cannot_be_planned(caplog):
    torch.manual_seed(0)
    model = _ItemMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = example_batch(model.mlp, 4, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="batchpilot.find.front"):
        plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY,
                                   plan_first=True)
    why = [r for r in caplog.records if "cannot be planned" in r.getMessage()]
    assert len(why) == 1 and why[0].levelno == logging.INFO and ".item()" in why[0].getMessage()
    assert plan.seeded_by is None and plan.first_guess is None and plan.plan_seconds > 0
    assert plan.trials[0].batch_size == 1 and plan.stop_reason == "boundary"
    b = plan.batch_size
    assert direct_peak(model, opt, batch, b) <= plan.limit_bytes < direct_peak(model, opt, batch, b + 1)


def test_plan_first_and_first_guess_are_exclusive_and_options_are_checked_before_planning(monkeypatch):
    import batchpilot.plan.planner

    model, opt, batch = setup("mlp")
    kw = dict(optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY, plan_first=True)
    planned = []
    monkeypatch.setattr(batchpilot.plan.planner, "plan_batch_size", lambda *a, **k: planned.append(1))
    with pytest.raises(BatchSizeError, match="first_guess or plan_first"):
        find_batch_size_for(model, batch, first_guess=8, **kw)
    with pytest.raises(BatchSizeError, match="target"):
        find_batch_size_for(model, batch, target=1.5, **kw)
    assert planned == []


def test_max_batch_size_bounds_the_search():
    model, opt, batch = setup("cnn")
    plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY,
                               max_batch_size=5)
    assert plan.batch_size == 5 and plan.stop_reason == "max_batch_size"
    assert max(t.batch_size for t in plan.trials) == 5


def test_search_runs_the_built_step_under_another_search():
    from batchpilot.dist.distributed import find_batch_size_distributed

    model, opt, batch = setup("cnn")
    calls = []

    def search(step, **kw):
        calls.append(kw)
        return find_batch_size_distributed(step, **kw)

    kw = dict(optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY)
    plan = find_batch_size_for(model, batch, search=search, **kw)
    # the search gets the step's device and what to restore, and every option in one FindOptions
    assert [sorted(c) for c in calls] == [["device", "options", "restore"]]
    assert calls[0]["options"].changed() == {"capacity": CAPACITY, "objective": "memory"}
    # no process group: the distributed search is the local one, rank 0 limiting
    assert plan.limited_by_rank == 0 and plan.batch_size == find_batch_size_for(model, batch, **kw).batch_size


def test_eval_mode_runs_under_inference_mode_and_fits_more():
    model, opt, batch = setup("cnn")
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append((torch.is_inference_mode_enabled(), m.training)))
    kw = dict(capacity=CAPACITY, target=0.8)
    train = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), **kw)
    seen.clear()
    evaluate = find_batch_size_for(model, batch, mode="eval", objective="memory", **kw)
    assert seen and all(inf and not training for inf, training in seen)
    assert model.training and evaluate.batch_size > 2 * train.batch_size
    x, _ = batch
    with track_peak("cpu", track=(model,)) as m, torch.inference_mode():
        model.eval()
        model(make_batch_fn(x)(evaluate.batch_size + 1))
        model.train()
    assert m.peak_bytes > evaluate.limit_bytes


def test_plan_to_dict_is_json_and_logs_one_line_per_trial(caplog):
    model, opt, batch = setup("transformer")
    with caplog.at_level(logging.INFO, logger="batchpilot.find.finder"):
        plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY)
    assert isinstance(plan, BatchPlan)
    d = json.loads(json.dumps(plan.to_dict()))
    for key in ("batch_size", "target", "capacity", "limit_bytes", "strategy", "device", "trials", "fit",
                "num_trials", "num_ooms", "seconds", "limited_by_rank", "first_guess", "seeded_by", "plan_seconds"):
        assert key in d
    assert d["strategy"] == "predict" and d["device"] == "cpu" and d["num_trials"] == len(d["trials"])
    assert d["first_guess"] is None and d["seeded_by"] is None and d["plan_seconds"] == 0.0
    assert set(d["trials"][0]) >= {"batch_size", "outcome", "peak_bytes", "seconds"}
    assert d["fit"]["bytes_per_sample"] > 0 and d["limited_by_rank"] is None
    lines = [r for r in caplog.records if r.getMessage().startswith("trial ")]
    assert len(lines) == plan.num_trials and all(r.levelno == logging.INFO for r in lines)


def test_progress_bar(capsys):
    model, opt, batch = setup("cnn")
    find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=CAPACITY,
                        progress=True)
    assert "trial" in capsys.readouterr().err


def test_make_batch_fn():
    x, y = torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 2])
    make = make_batch_fn({"x": x, "y": y, "flag": True})
    out = make(5)
    assert out["flag"] is True and out["x"].shape == (5, 2)
    assert out["y"].tolist() == [0, 1, 2, 0, 1]
    assert out["x"].untyped_storage().nbytes() == 5 * 2 * 4  # owns exactly b rows
    fn = lambda b: b  # noqa: E731
    assert make_batch_fn(fn) is fn
    with pytest.raises(ValueError, match="disagree on the batch size"):
        make_batch_fn((torch.zeros(3), torch.zeros(4)))


def test_snapshot_refuses_unknown_objects():
    with pytest.raises(TypeError, match="cannot snapshot"):
        StateSnapshot([object()])


# ---------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("target", [0, -0.5, 1.01, 2, True])
def test_target_outside_unit_interval_is_rejected_before_any_trial(target):
    calls = []
    with pytest.raises(BatchSizeError, match="target"):
        find_batch_size(calls.append, device="cpu", capacity=CAPACITY, target=target)
    assert calls == []


def test_bad_bounds_and_strategy():
    calls = []
    with pytest.raises(BatchSizeError, match="larger than max_batch_size") as info:
        find_batch_size(calls.append, device="cpu", capacity=CAPACITY, min_batch_size=8, max_batch_size=4)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match="predict, power, binsearch, decay"):
        find_batch_size(calls.append, device="cpu", capacity=CAPACITY, strategy="lightning")
    with pytest.raises(BatchSizeError, match="steps_per_trial"):
        find_batch_size(calls.append, device="cpu", capacity=CAPACITY, steps_per_trial=0)
    assert calls == []
    model, opt, batch = setup("mlp")
    with pytest.raises(ValueError, match="optimizer"):
        find_batch_size_for(model, batch, loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="mode"):
        find_batch_size_for(model, batch, mode="predict")


@pytest.mark.parametrize("capacity", ["600KiB", "1500KiB"])  # an OOM at batch 1, then over the target only
def test_nothing_fits_reports_the_smallest_peak_and_capacity(capacity):
    model, opt, batch = setup("cnn")
    before = state_of(model, opt)
    with pytest.raises(NothingFitsError) as info:
        find_batch_size_for(model, batch, optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity=capacity,
                            target=0.4)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError) and isinstance(err, BatchSizeError)
    cap = parse_bytes(capacity)
    assert err.capacity_bytes == cap and err.batch_size == 1 and err.peak_bytes is not None
    assert "batch size 1" in str(err) and f"({cap} bytes)" in str(err)
    from batchpilot.memory.units import format_bytes
    assert format_bytes(err.peak_bytes) in str(err)
    assert_same_state(before, state_of(model, opt))


def test_trial_peaks_under_the_tracker_do_not_depend_on_when_the_collector_runs():
    import gc

    def step(b: int) -> None:
        keep = torch.ones(b * 1000)
        cycle: list = [torch.ones(b * 500)]
        cycle.append(cycle)  # garbage only the cyclic collector frees
        del cycle
        for _ in range(100):  # allocations that let a collection run here, or not
            [[]]
        more = torch.ones(b * 2000)
        del keep, more

    def peaks() -> list:
        plan = find_batch_size(step, capacity="1MiB", device="cpu", max_batch_size=16, steps_per_trial=1,
                               strategy="binsearch")
        return [(t.batch_size, t.peak_bytes) for t in plan.trials]

    before = gc.get_threshold()
    try:
        gc.set_threshold(1)  # a young collection at almost every allocation
        eager = peaks()
        gc.set_threshold(100_000)
        lazy = peaks()
    finally:
        gc.set_threshold(*before)
    assert eager == lazy


def test_an_oom_at_the_smallest_size_is_run_once_more_before_nothing_fits(caplog):
    # one passing failure at batch 1 (another process held the memory a moment) does not end a job
    # that fits; a shortage that stays fails again, after one more trial only
    calls: list[int] = []

    def flaky(b: int) -> None:
        calls.append(b)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. a moment's shortage")
        torch.ones(b * 1000)

    with caplog.at_level(logging.WARNING, logger="batchpilot.find.finder"):
        plan = find_batch_size(flaky, capacity="1MiB", device="cpu", max_batch_size=8, steps_per_trial=1)
    assert plan.batch_size == 8 and calls[:2] == [1, 1]
    assert "once more" in caplog.text
    assert [t.outcome for t in plan.trials][0] == "fit"  # the confirmed trial replaced the failed one

    calls.clear()

    def short(b: int) -> None:
        calls.append(b)
        raise torch.OutOfMemoryError("CUDA out of memory. it stays")

    with pytest.raises(NothingFitsError, match="batch size 1 ran out of memory"):
        find_batch_size(short, capacity="1MiB", device="cpu", steps_per_trial=1)
    assert calls == [1, 1]


# ---------------------------------------------------------------------------
# a real address-space cap


_RLIMIT_WORKER = textwrap.dedent('''
    import json, resource, sys
    import torch
    torch.set_num_threads(1)  # threads reserve stacks and malloc arenas: keep the address space predictable
    from batchpilot.find.front import find_batch_size_for
    from batchpilot.app.models import MLP
    from batchpilot.find.snapshot import StateSnapshot

    def vm_size():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    model = MLP(in_features=128, width=256, depth=2)
    opt = torch.optim.Adam(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    batch = (torch.randn(64, 128), torch.randint(0, 10, (64,)))

    def train(b, steps):
        x, y = batch
        idx = torch.arange(b) % 64
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()

    snap = StateSnapshot([model, opt])
    train(64, 2)  # load kernels and warm the allocator, then forget the training
    snap.restore()
    del snap
    headroom = int(sys.argv[1]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + headroom, resource.RLIM_INFINITY))
    out = {}
    try:
        torch.empty(2 * headroom, dtype=torch.uint8)
        out["probe"] = "allocated"
    except RuntimeError as exc:
        out["probe"] = str(exc)
    # below: the emulated capacity is a quarter of the real headroom; above: eight times it,
    # so the search runs into the real allocator's OOM and must recover from it
    for name, capacity, strategy in (("below", headroom // 4, "predict"), ("above", 8 * headroom, "power")):
        plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=loss_fn, capacity=capacity,
                                   target=0.9, strategy=strategy)
        train(plan.batch_size, 5)
        out[name] = {"batch_size": plan.batch_size, "limit": plan.limit_bytes,
                     "trials": [[t.batch_size, t.outcome, t.peak_bytes, t.message] for t in plan.trials]}
    print(json.dumps(out))
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux features")
@pytest.mark.timeout(240)
def test_under_a_real_address_space_cap():
    env = dict(os.environ)
    # a fixed mmap threshold stops glibc from moving freed large blocks into the heap, so the
    # address space a batch needs does not depend on what ran before it
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _RLIMIT_WORKER, "64"], capture_output=True, text=True,
                          env=env, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "DefaultCPUAllocator" in out["probe"]  # the cap is real
    below = out["below"]
    assert all(t[1] != OOM for t in below["trials"]) and below["batch_size"] > 1
    fitted = {t[0]: t[2] for t in below["trials"]}
    assert fitted[below["batch_size"]] <= below["limit"]
    above = out["above"]
    ooms = [t for t in above["trials"] if t[1] == OOM]
    assert ooms and all("DefaultCPUAllocator" in t[3] for t in ooms)  # real OOMs, recovered
    assert above["batch_size"] >= below["batch_size"]


def test_a_trial_predicted_past_a_killing_limit_is_refused_and_never_run():
    """The 42-million-sample trial of a machine-sized capacity: refused from the measured line, not run."""
    from types import SimpleNamespace

    from batchpilot.find.trials import TrialRunner as _TrialRunner
    from batchpilot.policy.search import FIT, REFUSED, SearchSpace, Trial

    ran: list[int] = []
    gauge = SimpleNamespace(kills=True, limits=SimpleNamespace(binding="cgroup"))  # a limit that kills
    runner = _TrialRunner(ran.append, torch.device("cpu"), gauge, 1, [], snapshot=None)
    runner.space = SearchSpace(limit_bytes=900 * 2**20, capacity_bytes=1000 * 2**20, min_batch_size=1,
                               max_batch_size=10**9)
    runner.done = [Trial(batch_size=b, outcome=FIT, peak_bytes=100 * 2**20 + b * 2**10, start_bytes=0)
                   for b in (64, 128)]  # 1 KiB per sample
    trial = runner(42_250_455)
    assert trial.outcome == REFUSED and ran == [] and trial.peak_bytes > 1000 * 2**20
    assert runner.done[-1] is trial
    ok = (980 * 2**20 - 100 * 2**20) // 2**10 - 1000  # predicted under the hard limit (1000 MiB less 2%)
    assert runner._refuse(ok) is None  # a size predicted to fit is run as usual
    gauge.kills = False  # RLIMIT_AS raises instead of killing: the trial may run and fail
    assert runner._refuse(42_250_455) is None


# ---------------------------------------------------------------------------
# a host's real memory: what a trial runs at the large sizes


def _host_search(keep: list | None = None, peak_at: int = 48, **options: Any) -> tuple[list[int], BatchPlan, int]:
    """A search on this process's real memory (no cap: the resident set against the RAM), up to batch 48:
    the step's calls, the plan, and the tracked peak of two plain steps at ``peak_at`` afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data, labels = torch.randn(4096, 32), torch.randint(0, 4, (4096,))  # a dataset tensor, sliced per batch
    calls: list[int] = []

    def step(b: int) -> None:
        calls.append(b)
        opt.zero_grad(set_to_none=True)
        out = model(data[:b])
        nn.functional.cross_entropy(out, labels[:b]).backward()
        opt.step()
        if keep is not None:
            keep[:] = [out.detach()]  # the step keeps its output alive into the next one

    plan = find_batch_size(step, device="cpu", restore=(model, opt), max_batch_size=48, **options)
    searched = list(calls)
    # the host's view: the dataset is in the process already, and its slices add nothing to it
    with track_peak("cpu", track=(model, opt), host_data=False) as m:
        step(peak_at)
        step(peak_at)
    return searched, plan, m.peak_bytes


def test_after_the_two_recorded_sizes_a_trial_starts_with_one_step_at_the_smaller_and_then_runs_the_large_one():
    calls, plan, peak = _host_search()
    assert plan.memory == "resident" and plan.batch_size == 48
    # 2 and 3 record both steps' timelines (then time a third); they carry the same tensors from
    # one step to the next (the dataset's slices are host data, not carried state), so the trial
    # at 48 makes the optimizer's moments with one step at 2 and then runs 48 once, untracked and timed
    assert calls == [2, 2, 2, 3, 3, 3, 2, 48], calls
    last = plan.trials[-1]
    assert last.batch_size == 48 and last.tensor_bytes is None and last.step_seconds is not None
    # the tensors' line at the answer is the model's (exact), not a line through the tiny trials
    tf = plan.tensor_fit
    assert tf.fixed_bytes + 48 * tf.bytes_per_sample == peak


def test_a_step_that_keeps_something_growing_with_the_batch_runs_every_step_of_a_trial_at_its_size():
    calls, plan, _ = _host_search(keep=[])
    # the output kept into the next step is 4 floats a sample: only a step at 48 hands 48 to the next
    assert plan.batch_size == 48 and calls == [2, 2, 2, 3, 3, 3, 48, 48], calls
    assert plan.trials[-1].tensor_bytes is not None


def test_a_trial_of_one_step_after_the_two_recorded_sizes_runs_it_untracked():
    # a scorer's search (one forward a trial, none timed): nothing to warm, and no second step for a
    # kept output to weigh on, so the trial at 48 runs its one step untracked whether or not the step
    # keeps its output
    for keep in (None, []):
        calls, plan, _ = _host_search(keep=keep, steps_per_trial=1, timed_steps=0)
        assert plan.batch_size == 48 and calls == [2, 3, 48], (keep, calls)
        assert [t.tensor_bytes is None for t in plan.trials] == [False, False, True], keep
