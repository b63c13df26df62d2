"""Engine: exactness under OOM retries, loss weighting, AMP, state, bad input."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from batchpilot.core.loss import supervised_loss
from batchpilot.memory.probes import emulate_capacity
from batchpilot.memory.tracker import active_tracker
from batchpilot.train.engine import BatchDoesNotFitError, Engine, EngineConfig, StepResult
from batchpilot.train.noise import NoiseConfig

from engine_utils import CE, GLOBAL, InjectOOM, assert_params_close, batches, make, one_thread, params, peak_at  # noqa: F401

STEPS = 20


# ---------------------------------------------------------------------------
# The headline: the same 20 updates with and without OOMs


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_oom_retries_give_the_same_training(name):
    n = GLOBAL[name]
    # between the peaks of half and all of the global batch (optimizer state included): the
    # global batch does not fit, at the latest from the second step on
    capacity = (peak_at(name, n, n // 2) + peak_at(name, n, n)) // 2

    model, opt = make(name)
    ref = Engine(model, opt, CE, global_batch_size=n, micro_batch_size=n)
    ref_losses = [ref.step(b).loss for b in batches(model, n, STEPS)]
    ref_params = params(model)

    model, opt = make(name)
    # injected OOMs on top of the real ones: (step, loss_fn call within the step), some in the
    # middle of a global batch, one twice in a row
    inject = InjectOOM(CE, in_step={(3, 1), (8, 0), (13, 1), (13, 2)})
    eng = Engine(model, opt, inject, global_batch_size=n, start=n, config=EngineConfig(grow_after=3))
    results = []
    with emulate_capacity(capacity, track=(model, opt)):
        for b in batches(model, n, STEPS):
            inject.begin_step()
            results.append(eng.step(b))

    assert_params_close(params(model), ref_params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close([r.loss for r in results], ref_losses, rtol=1e-5, atol=1e-6)
    ooms = sum(r.ooms for r in results)
    assert inject.injected == 4
    assert ooms >= inject.injected + 1  # every injected one, and real ones
    assert min(r.micro_batch_size for r in results) <= n // 4  # the injected ones shrank further
    assert any(r.next_micro_batch_size > r.micro_batch_size for r in results)  # and it grew back
    assert all(r.samples == n and r.measured for r in results)
    assert len({r.micro_batch_size for r in results}) >= 2  # the schedule really changed
    assert eng.steps == STEPS


def test_uneven_micro_batches_give_the_global_mean():
    model, opt = make("mlp")
    data = list(batches(model, 10, 5))
    ref = [Engine(model, opt, CE, global_batch_size=10, micro_batch_size=10).step(b).loss for b in data]
    ref_params = params(model)
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=10, micro_batch_size=4)
    results = [eng.step(b) for b in data]
    assert [r.accum_steps for r in results] == [3] * 5  # 4 + 4 + 2
    assert_params_close(params(model), ref_params)
    torch.testing.assert_close([r.loss for r in results], ref, rtol=1e-6, atol=1e-7)


def test_last_smaller_batch_is_the_mean_over_its_own_samples():
    # A plain loop with drop_last=False: the short batch's loss is the mean over the samples it has.
    model, opt = make("mlp")
    batch = next(batches(model, 7, 1))
    plain = Engine(model, opt, CE, global_batch_size=7, micro_batch_size=7)
    ref_loss = plain.step(batch).loss
    ref_params = params(model)
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=10, micro_batch_size=3)
    r = eng.step(batch)
    assert (r.samples, r.accum_steps, r.micro_batch_size) == (7, 3, 3)  # 3 + 3 + 1
    assert r.loss == pytest.approx(ref_loss, rel=1e-6)
    assert_params_close(params(model), ref_params)


# ---------------------------------------------------------------------------
# Token-level (sum, count) losses


class TinyLM(nn.Module):
    def __init__(self, vocab=17, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.out(self.embed(tokens))


def token_batch(n=10, seq=12, vocab=17, seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    labels = torch.randint(0, vocab, (n, seq), generator=g)
    lengths = torch.tensor([12, 1, 2, 12, 3, 11, 1, 12, 2, 5])[:n]  # very uneven
    labels[torch.arange(seq) >= lengths[:, None]] = -100
    return {"tokens": tokens, "labels": labels}


def token_sum_loss(model, batch):
    logits = model(batch["tokens"])
    labels = batch["labels"]
    total = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def token_mean_loss(model, batch):
    total, count = token_sum_loss(model, batch)
    return total / count


def _reference_grads(batch):
    torch.manual_seed(0)
    model = TinyLM()
    total, count = token_sum_loss(model, batch)
    (total / count).backward()
    return total.item() / count.item(), [p.grad.clone() for p in model.parameters()]


def _engine_update(loss_fn, batch, micro):
    torch.manual_seed(0)
    model = TinyLM()
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    r = Engine(model, opt, loss_fn, global_batch_size=10, micro_batch_size=micro).step(batch)
    # with plain SGD at lr 1 the update is minus the gradient
    return r, [b - a for a, b in zip(params(model), before)]


@pytest.mark.parametrize("micro", [1, 3, 4, 10])
def test_token_level_sum_count_is_exact(micro):
    batch = token_batch()
    ref_loss, ref = _reference_grads(batch)
    r, grads = _engine_update(token_sum_loss, batch, micro)
    assert r.loss == pytest.approx(ref_loss, rel=1e-6)
    assert_params_close(grads, ref, rtol=1e-5, atol=1e-6)


def test_per_micro_batch_token_means_are_not_the_token_mean():
    # The gradient-accumulation bug the (sum, count) form avoids: the test above can fail.
    batch = token_batch()
    _, ref = _reference_grads(batch)
    _, grads = _engine_update(token_mean_loss, batch, 3)
    assert not all(torch.allclose(g, r, rtol=1e-3, atol=1e-5) for g, r in zip(grads, ref))


def test_sum_count_survives_oom_retries():
    batch = token_batch()
    ref_loss, ref = _reference_grads(batch)
    torch.manual_seed(0)
    model = TinyLM()
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    inject = InjectOOM(token_sum_loss, at={0, 2})  # the batch of 10, then the second micro-batch of 5
    r = Engine(model, opt, inject, global_batch_size=10, start=10).step(batch)
    assert (r.ooms, r.micro_batch_size, r.accum_steps) == (2, 2, 5)
    assert r.loss == pytest.approx(ref_loss, rel=1e-6)
    assert_params_close([b - a for a, b in zip(params(model), before)], ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# BatchNorm: statistics depend on the micro-batch (by design); everything else holds


def _hand_accumulation(model, opt, batch, micro):
    x, y = batch
    n = x.shape[0]
    for s in range(0, n, micro):
        xs, ys = x[s:s + micro], y[s:s + micro]
        (nn.functional.cross_entropy(model(xs), ys) * (xs.shape[0] / n)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_batchnorm_matches_the_same_schedule_by_hand_despite_retries():
    n = 16
    model, opt = make("cnn", batch_norm=True)
    data = list(batches(model, n, 6))
    inject = InjectOOM(CE, at={0, 2, 7})
    eng = Engine(model, opt, inject, global_batch_size=n, start=n)
    schedule = [eng.step(b).micro_batch_size for b in data]
    assert schedule[0] < n  # the retries shrank it
    state = {k: v.clone() for k, v in model.state_dict().items()}

    hand, hopt = make("cnn", batch_norm=True)
    for b, micro in zip(data, schedule):
        _hand_accumulation(hand, hopt, b, micro)
    # the failed attempts' BatchNorm updates were rolled back: running stats and weights agree
    for k, v in hand.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)

    whole, wopt = make("cnn", batch_norm=True)
    for b in data:
        _hand_accumulation(whole, wopt, b, n)
    # ...and differ from the whole-batch run, as in every accumulation scheme
    assert not torch.allclose(whole.features[1].running_mean, state["features.1.running_mean"])


# ---------------------------------------------------------------------------
# AMP, clipping, scheduler


def test_bf16_autocast_trains_close_to_fp32():
    model, opt = make("mlp")
    data = list(batches(model, 32, 5))
    ref = [Engine(model, opt, CE, global_batch_size=32, micro_batch_size=8).step(b).loss for b in data]
    model, opt = make("mlp")
    eng = Engine(model, opt, CE, global_batch_size=32, micro_batch_size=8, amp="bf16")
    seen = []
    eng.loss_fn = lambda m, b: (seen.append(m(b[0]).dtype), CE(m, b))[1]
    losses = [eng.step(b).loss for b in data]
    assert seen[0] == torch.bfloat16
    assert losses == pytest.approx(ref, rel=0.05)


@pytest.mark.parametrize("noise", [None, True, NoiseConfig(mode="every")], ids=["defaults", "noise first", "noise every"])
def test_a_float64_model_trains_exactly_with_accumulation(noise):
    """float64 parameters and data, 4 micro-batches a step: each update is one plain float64 step on the whole
    batch, whether the noise scale is measured or not (its norms once refused float64 gradients)."""
    model, opt = make("mlp")
    model.double()
    data = [(x.double(), y) for x, y in batches(model, 32, 4)]
    ref_losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        ref_losses.append(loss.detach())
        opt.step()
    ref = params(model)
    model, opt = make("mlp")
    model.double()
    eng = Engine(model, opt, CE, global_batch_size=32, micro_batch_size=8, noise=noise)
    results = [eng.step(b) for b in data]
    assert [r.accum_steps for r in results] == [4] * 4
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all((r.noise is None) == (noise is None) for r in results)
    assert_params_close(params(model), ref, rtol=1e-12, atol=1e-12)
    # the reported loss keeps the model's precision: float32 would be ~1e-7 off
    assert all(r.loss_tensor.dtype == torch.float64 for r in results)
    torch.testing.assert_close([r.loss_tensor for r in results], ref_losses, rtol=1e-13, atol=1e-13)


def test_a_float64_model_with_a_sum_and_count_loss_is_divided_by_the_count_in_float64():
    """A (sum, count) loss whose count is a tensor: the gradients are divided by the global count once; that
    factor, an integer division, came out in float32 and rounded float64 updates at 1e-8."""
    def sum_count(m, b):
        x, y = b
        return nn.functional.cross_entropy(m(x), y, reduction="sum"), (y != -100).sum()

    model, opt = make("mlp")
    model.double()
    # a quarter of the labels ignored: 22 of 30 count, and 30 / 22 is no float32
    data = [(x.double(), y.index_fill(0, torch.arange(0, 30, 4), -100)) for x, y in batches(model, 30, 3)]
    ref_losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        ref_losses.append(loss.detach())
        opt.step()
    ref = params(model)
    model, opt = make("mlp")
    model.double()
    eng = Engine(model, opt, sum_count, global_batch_size=30, micro_batch_size=7)
    results = [eng.step(b) for b in data]
    assert [r.micro_batch_sizes for r in results] == [(7, 7, 7, 7, 2)] * 3
    assert_params_close(params(model), ref, rtol=1e-12, atol=1e-12)
    assert all(r.loss_tensor.dtype == torch.float64 for r in results)
    torch.testing.assert_close([r.loss_tensor for r in results], ref_losses, rtol=1e-13, atol=1e-13)


def test_a_bf16_autocast_loss_is_reported_in_float32():
    # the sum of the micro-batches' losses is at least float32, whatever autocast computed them in
    model, opt = make("mlp")
    eng = Engine(model, opt, lambda m, b: CE(m, b).bfloat16(), global_batch_size=16, micro_batch_size=4)
    assert eng.step(next(batches(model, 16, 1))).loss_tensor.dtype == torch.float32


def test_fp16_scaler_skips_inf_steps_and_checkpoints():
    model, opt = make("mlp")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    poison = {"on": False}

    def loss_fn(m, b):
        loss = CE(m, b)
        return loss * float("inf") if poison["on"] else loss

    eng = Engine(model, opt, loss_fn, global_batch_size=16, micro_batch_size=4, amp="fp16",
                 grad_clip=1.0, scheduler=sched)
    data = list(batches(model, 16, 3))
    assert not eng.step(data[0]).skipped
    scale = eng.scaler.get_scale()
    before = params(model)
    poison["on"] = True
    r = eng.step(data[1])
    assert r.skipped and eng.scaler.get_scale() == scale / 2
    assert_params_close(params(model), before, rtol=0, atol=0)  # the optimizer did not step
    assert sched.last_epoch == 1  # nor did the scheduler
    poison["on"] = False
    assert not eng.step(data[2]).skipped and sched.last_epoch == 2
    state = eng.state_dict()
    assert state["scaler"]["scale"] == scale / 2
    other = Engine(model, opt, loss_fn, global_batch_size=16, micro_batch_size=4, amp="fp16")
    other.load_state_dict(state)
    assert other.scaler.get_scale() == scale / 2


@pytest.mark.parametrize("amp", [None, "fp16"])
def test_grad_clip_clips_the_unscaled_norm(amp):
    model, opt = make("mlp")
    batch = next(batches(model, 16, 1))
    ref_model, _ = make("mlp")
    CE(ref_model, batch).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = params(model)
    r = Engine(model, opt, CE, global_batch_size=16, micro_batch_size=4, amp=amp, grad_clip=0.01).step(batch)
    tol = 1e-5 if amp is None else 2e-2  # fp16 autocast matmuls
    assert float(r.grad_norm) == pytest.approx(float(norm), rel=tol)
    step = torch.cat([(a - b).flatten() for a, b in zip(before, params(model))])
    assert float(step.norm()) == pytest.approx(0.01, rel=1e-3)


def test_scheduler_steps_once_per_optimizer_step():
    model, opt = make("mlp")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    eng = Engine(model, opt, InjectOOM(CE, at={0, 1}), global_batch_size=32, start=32, scheduler=sched)
    for b in batches(model, 32, 4):
        eng.step(b)
    assert len(steps) == 4 and sched.last_epoch == 4


# ---------------------------------------------------------------------------
# Results, loss conventions, pytrees


def test_step_result_fields():
    model, opt = make("mlp")
    r = Engine(model, opt, CE, global_batch_size=12, micro_batch_size=5).step(next(batches(model, 12, 1)))
    assert isinstance(r, StepResult)
    assert (r.micro_batch_size, r.accum_steps, r.samples, r.ooms, r.skipped) == (5, 3, 12, 0, False)
    assert isinstance(r.loss, float) and math.isfinite(r.loss)
    assert r.loss_tensor.dim() == 0 and not r.loss_tensor.requires_grad
    assert r.peak_bytes > 0 and r.measured and r.memory == "resident" and r.seconds > 0  # a real CPU: its RSS


def _polling_children() -> dict[int, int]:
    """This process's resident-size samplers (children reading its ``statm``): ``{pid: CPU clock ticks}``."""
    me, out = os.getpid(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if int(stat[1]) == me and b"statm" in cmdline:
            out[int(entry.name)] = int(stat[11]) + int(stat[12])  # utime + stime
    return out


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/statm").exists(), reason="the resident sampler needs /proc")
def test_the_resident_sampler_rests_between_steps():
    """A real CPU's step peak comes from a sampler polling the resident size every millisecond; it stops with
    the step, so the caller's own work between steps (data, generation, evaluation) is not polled."""
    model, opt = make("mlp")
    engine = Engine(model, opt, CE, global_batch_size=12, micro_batch_size=5)
    for batch in batches(model, 12, 2):
        assert engine.step(batch).memory == "resident"
    before = _polling_children()
    time.sleep(2.0)  # polling costs ~3% of a core, ~6 clock ticks in 2 s; resting, none (one: the tick its
    after = _polling_children()  # last command's few microseconds may round up to)
    assert before and after.keys() == before.keys()
    assert all(after[pid] - before[pid] <= 1 for pid in before), (before, after)


def test_criterion_module_and_dict_batches():
    model, opt = make("mlp")
    x, y = next(batches(model, 8, 1))

    def dict_loss(m, b):
        assert b["meta"] == "kept" and b["scale"].dim() == 0
        return nn.functional.cross_entropy(m(b["x"]), b["y"]) * b["scale"]

    a = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=8, micro_batch_size=3).step((x, y)).loss
    model, opt = make("mlp")
    batch = {"x": x, "y": y, "meta": "kept", "scale": torch.tensor(1.0)}
    b = Engine(model, opt, dict_loss, global_batch_size=8, micro_batch_size=3).step(batch).loss
    assert a == pytest.approx(b, rel=1e-6)


def test_sum_reduction_criterion_is_averaged():
    model, opt = make("mlp")
    batch = next(batches(model, 8, 1))
    a = Engine(model, opt, nn.CrossEntropyLoss(reduction="sum"), global_batch_size=8, micro_batch_size=3).step(batch)
    model, opt = make("mlp")
    b = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=8, micro_batch_size=8).step(batch)
    assert a.loss == pytest.approx(b.loss, rel=1e-6)


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("value", [0, -4, 2.5, True, "64", None])
def test_global_batch_must_be_a_positive_int(value):
    model, opt = make("mlp")
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        Engine(model, opt, CE, global_batch_size=value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(micro_batch_size=20), "micro_batch_size=20 is larger than global_batch_size=10"),
    (dict(micro_batch_size=0), "micro_batch_size must be a positive int"),
    (dict(micro_batch_size="big"), "micro_batch_size must be a positive int or \"auto\""),
    (dict(start=11), "start=11 is larger than global_batch_size=10"),
    (dict(micro_batch_size=2, start=2), "start only applies"),
    (dict(amp="fp8"), "amp must be None, 'bf16' or 'fp16'"),
    (dict(target=1.5), "target must be a fraction"),
    (dict(target=0.97), "must be below config.high_water"),
    (dict(grad_clip=-1.0), "grad_clip must be a positive"),
])
def test_bad_engine_arguments(kwargs, match):
    model, opt = make("mlp")
    with pytest.raises(ValueError, match=match):
        Engine(model, opt, CE, global_batch_size=10, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(grow_after=0), dict(backoff=0.5), dict(high_water=1.5), dict(capacity="lots")])
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_bad_losses_and_batches():
    model, opt = make("mlp")
    x, y = next(batches(model, 10, 1))
    per_sample = Engine(model, opt, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"),
                        global_batch_size=10, micro_batch_size=5)
    with pytest.raises(ValueError, match=r"loss of shape \(5,\), not a scalar"):
        per_sample.step((x, y))
    assert all(p.grad is None for p in model.parameters())  # nothing half-accumulated is left
    detached = Engine(model, opt, lambda m, b: CE(m, b).detach(), global_batch_size=10)
    with pytest.raises(ValueError, match="does not require grad"):
        detached.step((x, y))
    with pytest.raises(ValueError, match="reduction='none'"):
        supervised_loss(nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(TypeError, match="must be callable"):
        Engine(model, opt, "ce", global_batch_size=10)
    eng = Engine(model, opt, CE, global_batch_size=4)
    with pytest.raises(ValueError, match="the batch has 10 samples but global_batch_size is 4"):
        eng.step((x, y))
    with pytest.raises(ValueError, match="disagree on the batch size"):
        eng.step((x[:4], y[:3]))


def test_oom_at_one_sample_is_a_clear_error():
    model, opt = make("mlp")
    inject = InjectOOM(CE, always=True)
    eng = Engine(model, opt, inject, global_batch_size=8, start=8)
    with pytest.raises(BatchDoesNotFitError, match="micro-batch of 1 sample on cpu"):
        eng.step(next(batches(model, 8, 1)))
    assert inject.calls == 4  # 8, 4, 2, 1
    assert all(p.grad is None for p in model.parameters())


def test_fixed_micro_batch_lets_the_oom_through():
    model, opt = make("mlp")
    eng = Engine(model, opt, InjectOOM(CE, at={1}), global_batch_size=8, micro_batch_size=4)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        eng.step(next(batches(model, 8, 1)))
    assert all(p.grad is None for p in model.parameters())  # the first micro-batch's grads are gone


# ---------------------------------------------------------------------------
# State


def test_state_dict_resumes_without_probing(monkeypatch):
    n = GLOBAL["mlp"]
    capacity = peak_at("mlp", n, n // 2) - 1
    model, opt = make("mlp")
    data = batches(model, n, 4)
    eng = Engine(model, opt, CE, global_batch_size=n, start=n, config=EngineConfig(grow_after=100))
    with emulate_capacity(capacity, track=(model, opt)):
        for _ in range(3):
            eng.step(next(data))
    state = eng.state_dict()
    # each part's state under a key of its own; the micro-batch is saved once, by its owner, the policy
    assert set(state) == {"version", "steps", "global_batch", "micro_batch", "scaler", "noise", "lengths", "shares"}
    assert set(state["global_batch"]) == {"global_batch_size", "world_size", "samples", "reference_batch_size",
                                          "last_batch_change", "schedule"}
    assert set(state["micro_batch"]) == {"policy", "fit", "micro_cap"}
    assert state["lengths"] is None  # no lengths=: nothing to size by length
    assert (state["global_batch"]["global_batch_size"], state["global_batch"]["world_size"]) == (n, 1)
    micro = state["micro_batch"]["policy"]["micro"]
    assert micro == eng.micro_batch_size < n and state["steps"] == 3
    clean = state["micro_batch"]["policy"]["clean"]

    resumed = Engine(model, opt, CE, global_batch_size=n, config=EngineConfig(grow_after=100))
    monkeypatch.setattr(Engine, "_find_start", lambda *a: pytest.fail("resumed engine probed again"))
    resumed.load_state_dict(state)
    assert resumed.micro_batch_size == micro
    with emulate_capacity(capacity, track=(model, opt)):
        r = resumed.step(next(data))
    assert r.ooms == 0 and r.micro_batch_size == micro
    assert resumed.policy.clean == clean + 1 and resumed.steps == 4
    assert resumed.fit.sizes == eng.fit.sizes

    with pytest.raises(ValueError, match="version"):
        resumed.load_state_dict({**state, "version": 99})
    smaller = Engine(model, opt, CE, global_batch_size=8)
    smaller.load_state_dict(state)
    assert smaller.micro_batch_size == 8  # clamped to the new global batch


#: an engine state as version 2 wrote it (before the micro-batch had one home): the run of
#: test_state_dict_resumes_without_probing, saved by that version after its third step
STATE_V2 = {
    "version": 2, "global_batch_size": 64, "world_size": 1, "micro_batch_size": 16, "steps": 3,
    "policy": {"limit": 64, "micro": 16, "grow_after": 100, "backoff": 2.0, "max_wait": None, "wait": 100,
               "clean": 1, "previous": None, "ceiling": None},
    "fit": {"increase": [[64, 34096], [16, 20152]], "prior": None}, "scaler": None, "samples": 192,
    "reference_batch_size": 64, "last_batch_change": 0, "micro_cap": None, "noise": None, "schedule": None,
    "lengths": None,
}


#: the same run as version 3 wrote it: one flat dict, the micro-batch in "policy" only
STATE_V3 = {k: v for k, v in STATE_V2.items() if k != "micro_batch_size"} | {"version": 3}


def _as_version_4(flat: dict) -> dict:
    """A flat state of versions 2-3 in version 4's layout: each part's keys under its own."""
    parts = {"global_batch": ("global_batch_size", "world_size", "samples", "reference_batch_size",
                              "last_batch_change", "schedule"),
             "micro_batch": ("policy", "fit", "micro_cap")}
    rest = {k: v for k, v in flat.items() if k != "micro_batch_size" and not any(k in keys for keys in parts.values())}
    # version 4 gained "shares" (uneven shares of the global batch), None when they are equal
    return {**rest, "version": 4, "shares": None, **{part: {k: flat[k] for k in keys} for part, keys in parts.items()}}


def test_a_version_2_state_resumes_as_it_was_saved(monkeypatch):
    n = GLOBAL["mlp"]
    assert n == STATE_V2["global_batch_size"]
    capacity = peak_at("mlp", n, n // 2) - 1
    model, opt = make("mlp")
    data = batches(model, n, 4)
    # the run that version 2 saved, trained again here: the state this version writes is the same
    eng = Engine(model, opt, CE, global_batch_size=n, start=n, config=EngineConfig(grow_after=100))
    with emulate_capacity(capacity, track=(model, opt)):
        for _ in range(3):
            eng.step(next(data))
    # the same run: every counter and the micro-batch; the fit's figures are bytes as this
    # version counts them (the global batch is host data, charged by the micro-batches read)
    saved = _as_version_4(STATE_V2)
    assert eng.state_dict()["micro_batch"]["fit"] == {"increase": [[32, 30648], [16, 22328]], "prior": None}
    now = {**eng.state_dict(), "micro_batch": {**eng.state_dict()["micro_batch"], "fit": saved["micro_batch"]["fit"]}}
    assert now == saved

    resumed = Engine(model, opt, CE, global_batch_size=n, config=EngineConfig(grow_after=100))
    monkeypatch.setattr(Engine, "_find_start", lambda *a: pytest.fail("resumed engine probed again"))
    resumed.load_state_dict(STATE_V2)
    assert resumed.state_dict() == saved  # every counter, the fit and the micro-batch, as saved
    assert resumed.micro_batch_reason == "resumed from a checkpoint at micro-batch 16"
    with emulate_capacity(capacity, track=(model, opt)):
        r = resumed.step(next(data))
    assert (r.ooms, r.micro_batch_size, resumed.policy.clean, resumed.steps) == (0, 16, 2, 4)

    # version 3 (one flat dict, the micro-batch in "policy" only) resumes alike
    v3 = Engine(model, opt, CE, global_batch_size=n, config=EngineConfig(grow_after=100))
    v3.load_state_dict(STATE_V3)
    assert v3.state_dict() == now and v3.micro_batch_reason == "resumed from a checkpoint at micro-batch 16"

    # a fixed micro-batch's version-2 state held it only at the top: an "auto" engine starts there
    fixed_v2 = {**STATE_V2, "micro_batch_size": 8, "policy": None, "fit": {"increase": [], "prior": None}}
    auto = Engine(model, opt, CE, global_batch_size=n)
    auto.load_state_dict(fixed_v2)
    assert auto.micro_batch_size == 8 and auto.policy.clean == 0




def test_a_global_batch_a_loader_stacked_under_the_emulation_is_host_data():
    # The loader stacks the global batch while the emulated device's tracker runs; a device holds
    # only the micro-batch that runs, as the finder's trials held it: the first step runs the
    # plan's micro-batch, with no OOM
    from torch.utils.data import DataLoader, TensorDataset

    from batchpilot.find.front import find_batch_size_for
    from batchpilot.policy.microbatch import efficient_size

    torch.manual_seed(0)
    n = 3072
    x, y = torch.randn(n, 128), torch.randint(0, 10, (n,))
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = find_batch_size_for(model, (x[:16], y[:16]), optimizer=opt, loss_fn=CE, capacity="4MiB")
    # the global batch is a third of the capacity: charged whole, the plan's micro-batch cannot run beside it
    assert n * x[0].nbytes > (4 << 20) // 3 and n > 4 * plan.batch_size, plan
    engine = Engine(model, opt, CE, global_batch_size=n, start=plan)
    with emulate_capacity("4MiB", track=(model, opt)):
        batch = next(iter(DataLoader(TensorDataset(x, y), batch_size=n)))
        r = engine.step(batch)
        assert (r.ooms, r.micro_batch_size) == (0, efficient_size(n, plan.batch_size)), (plan, r)
        # the step is over: its micro-batches left the device, the batch the caller holds is host data
        assert active_tracker("cpu").charged(batch[0]) == 0
