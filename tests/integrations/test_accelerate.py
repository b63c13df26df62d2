"""batchpilot.integrations.accelerate: the drop-in decorator, one process and a 2-process launch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate", reason="needs Accelerate: pip install -e '.[integrations]'")

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dist_launch import torchrun  # noqa: E402  (tests/helpers)

from batchpilot.integrations.accelerate import find_executable_batch_size  # noqa: E402
from batchpilot.memory.probes import emulate_capacity  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps one process-wide state: a Trainer test earlier in this worker leaves its
    bf16 mixed precision there, and every Accelerator here would then run bf16 (half the memory)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))


def make_train(accelerator: Accelerator, calls: list, *, oom_above: int | None = None, steps: int = 3, **options):
    """Accelerate's canonical pattern: the whole training function, decorated.

    ``calls`` gets ``[batch size, optimizer steps begun]`` per call. With ``oom_above``, the third
    step (which trials, stopped after two, never reach) runs out of memory above that size.
    """

    @find_executable_batch_size(starting_batch_size=512, **options)
    def train(batch_size, tag):
        accelerator.free_memory()
        calls.append([batch_size, 0])
        model, opt = network(), None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(TensorDataset(X, Y), batch_size=batch_size, shuffle=True)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        for step, (x, y) in enumerate(loader):
            if oom_above is not None and batch_size > oom_above and step == 2:
                raise torch.OutOfMemoryError("out of memory (injected in the third step)")
            accelerator.backward(F.cross_entropy(model(x), y))
            calls[-1][1] += 1
            opt.step()
            opt.zero_grad()
            if step + 1 == steps:
                break
        return tag, batch_size

    return train


def test_the_drop_in_searches_with_short_trials_then_runs_once():
    accelerator, calls = Accelerator(cpu=True), []
    train = make_train(accelerator, calls)
    with emulate_capacity("1MiB"):
        assert train("done") == ("done", train.batch_size)
    plan = train.plan
    # the finder's search: few trials, the exact boundary of the emulated device, no x0.9 walk
    assert plan.stop_reason == "boundary" and plan.num_trials <= 6 and plan.num_ooms == 0
    assert [b for b, _ in calls[:-1]] == [t.batch_size for t in plan.trials]
    # each trial stopped after two optimizer steps; the final run trained its three
    assert all(steps == 2 for _, steps in calls[:-1]) and calls[-1] == [train.batch_size, 3]
    # Accelerate is itself again after the search
    assert Accelerator.prepare_model.__qualname__ == "Accelerator.prepare_model"
    assert AcceleratedOptimizer.step.__qualname__ == "AcceleratedOptimizer.step"


def test_a_global_batch_searches_only_the_micro_batches_that_divide_it():
    from batchpilot.train.batching import BatchConfig

    seen: list[int] = []

    @find_executable_batch_size(global_batch_size=96, capacity="400KiB")
    def train(batch_size):
        seen.append(batch_size)
        accum = BatchConfig(global_batch_size=96, micro_batch_size=batch_size).accum_steps
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accum)
        accelerator.free_memory()
        model = network()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(TensorDataset(X, Y), batch_size=batch_size)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        steps = 0
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
            steps += accelerator.sync_gradients
            if steps == 2:
                break
        return accum

    with emulate_capacity("400KiB"):
        accum = train()
    divisors = [d for d in range(1, 97) if 96 % d == 0]
    assert set(seen) <= set(divisors) and train.batch_size * accum == 96
    fits = {t.batch_size for t in train.plan.trials if t.outcome == "fit"}
    fails = {t.batch_size for t in train.plan.trials if t.outcome != "fit"}
    # the largest divisor that fits, next to the next divisor up that does not
    assert train.batch_size == max(fits) and divisors[divisors.index(train.batch_size) + 1] in fails
    assert train.plan.strategy == "binsearch" and train.plan.fit is None


def test_an_oom_in_the_final_run_retries_ten_percent_lower_on_the_memory_line(caplog):
    accelerator, calls = Accelerator(cpu=True), []
    train = make_train(accelerator, calls, oom_above=100)
    with emulate_capacity("1MiB"), caplog.at_level(logging.WARNING, logger="batchpilot.integrations.accelerate"):
        tag, b = train("x")
    fit = train.plan.fit
    finals = [size for size, _ in calls[train.plan.num_trials:]]
    assert finals[0] == train.plan.batch_size > 100 and finals[-1] == b == train.batch_size <= 100
    for a, c in zip(finals, finals[1:]):  # each retry: the largest size predicted 10% below the failed peak
        assert fit.predict(c) <= 0.9 * fit.predict(a) < fit.predict(c + 1)
    assert caplog.text.count("whose predicted peak is 10% lower") == len(finals) - 1


def test_refused_options_and_a_batch_size_passed_twice():
    with pytest.raises(ValueError, match="reduce_batch_size_fn"):
        find_executable_batch_size(lambda b: b, reduce_batch_size_fn=lambda: 1)
    with pytest.raises(ValueError, match="target must be a fraction"):
        find_executable_batch_size(lambda b: b, target=2.0)

    @find_executable_batch_size(starting_batch_size=8)
    def f(batch_size, x):
        return x

    with pytest.raises(TypeError, match=r"call `f\(x=2\)`"):
        f(8, 2)


def test_a_function_without_a_prepared_optimizer_is_warned_about(caplog):
    @find_executable_batch_size(starting_batch_size=4, capacity="1MiB")
    def f(batch_size):
        return batch_size

    with caplog.at_level(logging.WARNING, logger="batchpilot.integrations.accelerate"):
        assert f() == 4
    assert "not prepared by the accelerator" in caplog.text


@pytest.mark.timeout(300)
def test_two_processes_agree_on_the_smaller_ranks_batch_and_hold_the_global_batch():
    # rank 1 emulates the smaller device; examples/accelerate_train.py holds a global batch of 256
    proc = torchrun(ROOT / "examples" / "accelerate_train.py", "--capacity", "1MiB,600KiB", "--steps", "3",
                    nproc=2, timeout=240,
                    finished=lambda out: sum(line.startswith("{") for line in out.splitlines()) == 2)
    reports = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    r0, r1 = reports
    for key in ("found_batch_size", "limited_by_rank", "micro_batch_size", "accum_steps", "params"):
        assert r0[key] == r1[key], key  # one batch size; the same parameters after DDP training
    assert r0["limited_by_rank"] == 1
    # rank 0 alone fits more than the agreed size: its own trials went past it
    assert max(b for b, outcome in r0["trials"] if outcome == "fit") > r0["found_batch_size"]
    # and it says, in one line, why it keeps the smaller size (Accelerate's sampler cannot take uneven shares)
    said = [ln for ln in proc.stderr.splitlines() if "uneven shares cannot be handed out" in ln]
    assert len(said) == 1 and "Accelerate gives every rank the same per-device batch" in said[0], proc.stderr[-3000:]
    assert r0["micro_batch_size"] <= r0["found_batch_size"]
    assert r0["micro_batch_size"] * 2 * r0["accum_steps"] == r0["global_batch_size"] == 256
    # every optimizer step saw the whole global batch: 128 samples on each of the two ranks
    assert r0["samples_per_step_this_rank"] == r1["samples_per_step_this_rank"] == [128] * 3
    assert r0["optimizer_steps"] == 3


def _rlimit_run(method: str, malloc: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", **malloc)
    helper = ROOT / "tests" / "helpers" / "accelerate_rlimit.py"
    proc = subprocess.run([sys.executable, str(helper), method, "160"], env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("malloc", [{}, {"MALLOC_MMAP_THRESHOLD_": "131072"}], ids=["dynamic", "fixed"])
def test_under_rlimit_as_the_drop_in_reaches_what_the_finder_reaches_for_the_same_function(malloc):
    # real memory, each sizing in a fresh process: the decorator's trials run the function itself, so
    # they must not be more cautious than the finder on one step of it, nor run out of memory
    dropin, finder = _rlimit_run("drop-in", malloc), _rlimit_run("finder", malloc)
    assert dropin["calls"][-1] == [dropin["batch_size"], "ok"], dropin  # the final epoch trained
    assert not any(kind == "oom" for _, kind in dropin["calls"]), dropin
    assert dropin["batch_size"] >= 0.95 * finder["batch_size"], (dropin, finder)
