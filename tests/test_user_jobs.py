"""Jobs as a new user brings them: a dict-batch GPT with a padded (sum, count) loss, find then
train, an all-padding batch, and a checkpoint that loads with ``weights_only=True``."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import batchpilot.train.engine as engine_module
from batchpilot import Engine, EngineConfig, find_batch_size_for
from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch
from batchpilot.memory.probes import emulate_capacity
from batchpilot.policy.microbatch import efficient_size
from batchpilot.train import ElasticBatchSampler, ElasticLoader


def gpt_batch(n: int, seed: int = 0, pad_to: int | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 24, (n,), generator=g).tolist()
    batch = padded_lm_batch(lengths, generator=g, pad_to=pad_to)
    batch["names"] = [f"doc{i}" for i in range(n)]  # per-sample strings ride along
    batch["source"] = "wiki"
    return batch


def gpt(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(vocab=256, dim=32, heads=2, layers=2, max_len=32)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def plain_step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    total, count = lm_loss(model, batch)
    (total / count).backward()
    opt.step()


def test_dict_gpt_with_a_sum_count_loss_through_the_finder_and_the_engine():
    model, opt = gpt()
    before = copy.deepcopy(model.state_dict())
    plan = find_batch_size_for(model, gpt_batch(8), optimizer=opt, loss_fn=lm_loss, capacity="4MiB",
                               max_batch_size=256)
    assert 1 <= plan.batch_size < 256 and plan.stop_reason == "boundary"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # all put back

    ref_model, ref_opt = gpt()
    engine = Engine(model, opt, lm_loss, global_batch_size=16, micro_batch_size=4)
    for step in range(3):
        batch = gpt_batch(16, seed=10 + step)
        r = engine.step(batch)
        plain_step(ref_model, ref_opt, batch)
        assert (r.micro_batch_size, r.accum_steps) == (4, 4)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_engine_started_from_a_plan_runs_no_trial(monkeypatch):
    model, opt = gpt()
    # padded to one width, as the finder's example and the training batches must be to compare
    plan = find_batch_size_for(model, gpt_batch(8, pad_to=24), optimizer=opt, loss_fn=lm_loss, capacity="4MiB",
                               max_batch_size=256)

    def no_trials(*args, **kwargs):
        raise AssertionError("the engine ran the finder although it was given a plan")

    monkeypatch.setattr(engine_module, "find_batch_size", no_trials)
    engine = Engine(model, opt, lm_loss, global_batch_size=64, start=plan)
    with emulate_capacity("4MiB", track=(model, opt)):
        r = engine.step(gpt_batch(64, seed=1, pad_to=24))
    assert engine.plan is plan
    assert r.ooms == 0 and r.micro_batch_size == efficient_size(64, plan.batch_size)
    assert engine.fit.prior is not None and engine.fit.prior[1] == pytest.approx(plan.fit.bytes_per_sample)


def test_a_global_batch_of_only_padding_skips_the_step_instead_of_writing_nan():
    model, opt = gpt()
    engine = Engine(model, opt, lm_loss, global_batch_size=8, micro_batch_size=4)
    engine.step(gpt_batch(8))
    before = [p.detach().clone() for p in model.parameters()]
    batch = gpt_batch(8, seed=3)
    batch["labels"].fill_(-100)
    r = engine.step(batch)
    assert r.skipped and r.skip_reason == "empty" and r.loss != r.loss  # nan: nothing to average
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    r = engine.step(gpt_batch(8, seed=4))  # and training goes on
    assert not r.skipped and r.skip_reason is None


def test_the_documented_checkpoint_loads_with_weights_only():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=16, start=8, amp="bf16",
                    config=EngineConfig(grow_after=2))
    loader = ElasticLoader(data, ElasticBatchSampler(len(data), 16, seed=0))
    for i, batch in enumerate(loader):
        with emulate_capacity("1MiB", track=(model, opt)):
            engine.step(batch)
        if i == 2:
            break
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "engine": engine.state_dict(),
                "data": loader.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # no arbitrary unpickling
    engine2 = Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=16, amp="bf16",
                     config=EngineConfig(grow_after=2))
    engine2.load_state_dict(ckpt["engine"])
    loader2 = ElasticLoader(data, ElasticBatchSampler(len(data), 16, seed=0))
    loader2.load_state_dict(ckpt["data"])
    assert engine2.micro_batch_size == engine.micro_batch_size and engine2.steps == engine.steps
    assert engine2.policy.state_dict() == engine.policy.state_dict()
    assert engine2.fit.state_dict() == engine.fit.state_dict()
    assert loader2.sampler.consumed_samples == loader.sampler.consumed_samples == 48
