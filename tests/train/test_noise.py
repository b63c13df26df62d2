"""batchpilot.train.noise: the gradient noise scale, from the pure estimator to the engine's measurement.

The reference problem is linear regression with Gaussian inputs and noise, where the true
values are known in closed form: with ``x ~ N(0, I_d)``, ``y = x·w* + ε``, ``ε ~ N(0, σ²)``
and the loss ``½ (x·w - y)²`` at ``w = w* + δ``, the per-sample gradient ``x (x·δ - ε)`` has
mean ``G = δ`` and ``E|g|² = (d + 2)|δ|² + d σ²``, so ``tr(Σ) = (d + 1)|δ|² + d σ²``. The
optimizer's learning rate is 0, so the parameters (and the truth) stay put while the engine
measures. Every test is seeded: deterministic, and chosen so that a broken estimator fails.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from batchpilot.app.models import example_batch
from batchpilot.dist.coordinator import check_coordinator
from batchpilot.policy.schedule import AdaptiveSchedule
from batchpilot.train import noise as noise_module
from batchpilot.train.data import ElasticBatchSampler
from batchpilot.train.engine import Engine
from batchpilot.train.noise import NoiseConfig, NoiseScale, population_factor, squared_norm, unbiased_estimates

from engine_utils import CE, assert_params_close, batches, make, one_thread, params  # noqa: F401

D, SIGMA = 16, 0.5


def regression(seed: int = 0, d: int = D, delta_norm: float = 1.0):
    """A linear model at ``w* + δ`` with |δ| = delta_norm, an optimizer that never moves it, and the truth."""
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=g)
    delta = torch.randn(d, generator=g)
    delta = delta / delta.norm() * delta_norm
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta).unsqueeze(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g2 = float(delta @ delta)
    trace = (d + 1) * g2 + d * SIGMA**2
    return model, opt, w_star, {"grad_sq": g2, "trace": trace, "b_simple": trace / g2}


def draw(w_star: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, len(w_star), generator=g)
    return x, x @ w_star + SIGMA * torch.randn(n, generator=g)


def half_mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return 0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()


def run(model, opt, w_star, *, steps: int, global_batch: int, micro: int, seed: int = 1, loss_fn=half_mse, **kw):
    kw.setdefault("noise", True)  # the engine measures nothing unless asked
    engine = Engine(model, opt, loss_fn, global_batch_size=global_batch, micro_batch_size=micro, **kw)
    g = torch.Generator().manual_seed(seed)
    results = [engine.step(draw(w_star, global_batch, g)) for _ in range(steps)]
    return engine, results


def assert_unbiased(values: list[float], truth: float, what: str) -> None:
    """The mean of per-step estimates is within 4 standard errors of the truth (and the error is small)."""
    t = torch.tensor(values, dtype=torch.float64)
    mean, sem = float(t.mean()), float(t.std() / math.sqrt(len(t)))
    assert abs(mean - truth) < 4 * sem + 1e-9, f"{what}: mean {mean:.4g} vs truth {truth:.4g} (sem {sem:.3g})"


# -- the pure estimator ------------------------------------------------------------------------


def test_population_factor_and_the_two_batch_solution():
    assert population_factor(16, 16) == 1 / 16
    assert population_factor(16, 16, 1000) == pytest.approx(984 / 999 / 16)
    assert population_factor(40.0, 8, 8) == 0.0  # the whole population: no sampling noise
    assert unbiased_estimates(5.0, 1 / 2, 3.0, 1 / 4) == (1.0, 8.0)
    # McCandlish's appendix A.1 formulas, written out, at B_small 8 and B_big 64
    gs, gb = 7.3, 2.1
    g2, tr = unbiased_estimates(gs, 1 / 8, gb, 1 / 64)
    assert g2 == pytest.approx((64 * gb - 8 * gs) / (64 - 8))
    assert tr == pytest.approx((gs - gb) / (1 / 8 - 1 / 64))


def test_ema_is_bias_corrected_and_the_ratio_is_in_samples():
    s = NoiseScale(beta=0.5)
    assert s.noise_scale is None and s.grad_sq is None
    s.update(2.0, 20.0)
    assert s.grad_sq == 2.0 and s.trace == 20.0 and s.noise_scale == 10.0  # one update: the value itself
    s.update(4.0, 20.0)
    assert s.grad_sq == pytest.approx(10 / 3) and s.noise_scale == pytest.approx(6.0)  # the docstring's example
    counted = NoiseScale(beta=0.5)
    counted.update(1.0, 64.0, elements_per_sample=8.0)  # 64 tokens of noise scale = 8 samples of 8 tokens
    assert counted.noise_scale_elements == 64.0 and counted.noise_scale == 8.0
    negative = NoiseScale(beta=0.9)
    negative.update(-1.0, 5.0)
    assert negative.noise_scale == math.inf
    restored = NoiseScale(beta=0.5)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict() and restored.noise_scale == s.noise_scale


def test_squared_norm_is_exact_and_safe_for_fp16():
    ts = [torch.randn(5, 3), torch.randn(7)]
    assert float(squared_norm(ts)) == pytest.approx(sum(float((t.double() ** 2).sum()) for t in ts), rel=1e-6)
    big = [torch.full((1000,), 300.0, dtype=torch.float16)]  # |t|² = 9e7: past fp16's 65504
    assert float(squared_norm(big)) == pytest.approx(9e7, rel=1e-3)


def test_squared_norm_accumulates_float64_in_float64_and_bf16_in_float32():
    g = torch.Generator().manual_seed(0)
    wide = [torch.randn(300, dtype=torch.float64, generator=g), torch.randn(4, 5, dtype=torch.float64, generator=g)]
    got = squared_norm(wide)  # torch refuses to narrow float64 to a float32 norm
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(sum(float((t**2).sum()) for t in wide), rel=1e-13)  # fp32 is off by ~1e-7
    low = [t.to(torch.bfloat16) for t in wide]
    got = squared_norm(low)
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(sum(float((t.double() ** 2).sum()) for t in low), rel=1e-5)
    mixed = squared_norm([wide[0], low[1]])
    assert mixed.dtype == torch.float64
    assert float(mixed) == pytest.approx(float((wide[0] ** 2).sum()) + float((low[1].double() ** 2).sum()), rel=1e-6)


def test_the_engine_measures_nothing_unless_asked_or_a_schedule_follows_it():
    model, opt = make("mlp")
    plain = Engine(model, opt, CE, global_batch_size=16, micro_batch_size=4)
    assert plain.noise_meter is None and "noise" not in plain.describe()
    assert plain.step(next(batches(model, 16, 1))).noise is None and plain.state_dict()["noise"] is None
    following = Engine(model, opt, CE, global_batch_size=16, micro_batch_size=4, schedule=AdaptiveSchedule())
    assert following.noise_meter is not None
    assert following.step(next(batches(model, following.per_rank_batch_size, 1))).noise is not None


def test_a_config_without_a_mode_gets_the_schedules_mode_and_describe_names_it(caplog):
    """NoiseConfig(dataset_size=N) under a schedule that follows the noise scale is the same
    measurement as noise=True there (every, beta 0.95): adding the correction changes no mode."""
    model, opt = make("mlp")

    def meter(noise, schedule=None):
        engine = Engine(model, opt, CE, global_batch_size=64, micro_batch_size=16, noise=noise, schedule=schedule)
        return engine, engine.noise_meter.config

    engine, cfg = meter(NoiseConfig(dataset_size=400), AdaptiveSchedule())
    assert (cfg.mode, cfg.beta, cfg.dataset_size) == ("every", 0.95, 400)
    assert engine.describe().endswith("; noise every (beta 0.95, a lone micro-batch split)")
    assert meter(True, AdaptiveSchedule())[1] == NoiseConfig(mode="every", dataset_size=None)
    engine, cfg = meter(NoiseConfig(dataset_size=400))
    assert (cfg.mode, cfg.beta) == ("first", 0.99)
    assert engine.describe() == "global 64 = micro 16 × world 1 × accum 4; noise first (beta 0.99)"
    # a mode asked for is kept, and under a following schedule its cost in accuracy is announced
    with caplog.at_level("INFO", logger="batchpilot.train.noise"):
        engine, cfg = meter(NoiseConfig(mode="first", dataset_size=400), AdaptiveSchedule())
    assert (cfg.mode, cfg.beta) == ("first", 0.99)
    assert "noise first (beta 0.99" in engine.describe()
    assert any("noise mode first (beta 0.99) under the adaptive" in r.getMessage() and "as asked" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match="needs a NoiseConfig with a mode"):
        noise_module.NoiseMeter(NoiseConfig(), world=1, deferred=False, split=False)


def test_under_a_following_schedule_a_config_without_a_mode_measures_like_noise_true():
    """The same steps, batch changes and estimates: nothing switches to the slow first mode."""
    runs = {}
    for label, noise in (("true", True), ("config", NoiseConfig(split="auto"))):
        model, opt = make("mlp", lr=0.05)
        engine = Engine(model, opt, CE, global_batch_size=64, micro_batch_size=8, noise=noise,
                        schedule=AdaptiveSchedule(min_batch_size=16, max_batch_size=64, every=2))
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(8):
            r = engine.step(example_batch(model, engine.per_rank_batch_size, generator=g))
            out.append((r.global_batch_size, r.noise.small_count, float(r.noise.trace_ema)))
        runs[label] = out
    assert runs["config"] == runs["true"]
    assert all(count >= 2 for _, count, _ in runs["true"])  # every micro-batch, a lone one split


@pytest.mark.parametrize("mode", ["first", "every"])
def test_a_float64_model_is_measured_in_float64_and_unbiased(mode):
    """The issue's float64 model with accumulation: no dtype error, and the estimates are those of float64."""
    model, opt, w_star, truth = regression()
    model.double()
    engine = Engine(model, opt, half_mse, global_batch_size=64, micro_batch_size=8,
                    noise=NoiseConfig(mode=mode, beta=0.99))
    g = torch.Generator().manual_seed(1)
    results = [engine.step(tuple(t.double() for t in draw(w_star, 64, g))) for _ in range(200)]
    assert all(r.noise is not None and isinstance(r.noise.grad_sq, float) for r in results)
    assert_unbiased([r.noise.grad_sq for r in results], truth["grad_sq"], "|G|² in float64")
    assert_unbiased([r.noise.trace for r in results], truth["trace"], "tr(Σ) in float64")
    assert engine.noise_scale == pytest.approx(truth["b_simple"], rel=0.10 if mode == "every" else 0.15)


@pytest.mark.parametrize("case", ["bf16 autocast", "bf16 parameters"])
def test_bf16_runs_are_measured_and_agree_with_fp32(case):
    out = {}
    for label in ("fp32", case):
        model, opt, w_star, _ = regression()
        if label == "bf16 parameters":
            model.to(torch.bfloat16)
        engine = Engine(model, opt, half_mse, global_batch_size=64, micro_batch_size=8,
                        amp="bf16" if label == "bf16 autocast" else None, noise=NoiseConfig(mode="every"))
        g = torch.Generator().manual_seed(1)
        dtype = torch.bfloat16 if label == "bf16 parameters" else torch.float32
        results = [engine.step(tuple(t.to(dtype) for t in draw(w_star, 64, g))) for _ in range(60)]
        assert all(r.noise is not None and math.isfinite(r.noise_scale) for r in results), label
        out[label] = (results[-1].noise.grad_sq_ema, results[-1].noise.trace_ema)
    assert out[case][0] == pytest.approx(out["fp32"][0], rel=0.1)
    assert out[case][1] == pytest.approx(out["fp32"][1], rel=0.1)


def test_defaults_follow_what_each_mode_needs():
    assert (NoiseConfig(mode="first").beta, NoiseConfig(mode="every").beta, NoiseConfig(beta=0.9).beta) == (0.99, 0.95, 0.9)
    model, opt = make("mlp")
    asked = Engine(model, opt, CE, global_batch_size=16, noise=True).noise_meter.config
    assert (asked.mode, asked.beta) == ("first", 0.99)
    # a schedule that follows the noise scale needs an estimate that settles in tens of steps
    following = Engine(model, opt, CE, global_batch_size=16, schedule=AdaptiveSchedule())
    assert following.noise_meter.config.mode == "every" and following.noise_meter.split
    assert (following.noise_meter.config.beta) == 0.95


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="noise mode must be one of first, every"):
        NoiseConfig(mode="all")
    with pytest.raises(ValueError, match=r"beta must be an EMA factor in \[0, 1\)"):
        NoiseConfig(beta=1.0)
    with pytest.raises(ValueError, match="dataset_size must be >= 2"):
        NoiseConfig(dataset_size=1)
    with pytest.raises(ValueError, match='split must be True, False or "auto"'):
        NoiseConfig(split="yes")
    model, opt = make("mlp")
    with pytest.raises(TypeError, match="noise must be True, False or a batchpilot.train.noise.NoiseConfig"):
        Engine(model, opt, CE, global_batch_size=8, noise="first")
    with pytest.raises(ValueError, match="follows the gradient noise scale; leave noise on"):
        Engine(model, opt, CE, global_batch_size=8, noise=False, schedule=AdaptiveSchedule())


# -- the engine against the known truth ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["first", "every"])
def test_engine_estimates_are_unbiased_on_linear_regression(mode):
    model, opt, w_star, truth = regression()
    engine, results = run(model, opt, w_star, steps=200, global_batch=64, micro=8,
                          noise=NoiseConfig(mode=mode, beta=0.99))
    samples = [r.noise for r in results]
    assert all(s is not None for s in samples)
    assert samples[0].small_count == (1 if mode == "first" else 8) and samples[0].big_batch == 64
    assert_unbiased([float(s.grad_sq) for s in samples], truth["grad_sq"], "|G|²")
    assert_unbiased([float(s.trace) for s in samples], truth["trace"], "tr(Σ)")
    # B_simple = 18 here, under the global batch of 64: the EMA lands within 10% (every) / 15% (first)
    tolerance = 0.10 if mode == "every" else 0.15
    assert engine.noise_scale == pytest.approx(truth["b_simple"], rel=tolerance)
    assert results[-1].noise_scale == engine.noise_scale


def test_every_micro_batch_gives_a_tighter_estimate_than_the_first():
    spreads = {}
    for mode in ("first", "every"):
        model, opt, w_star, truth = regression()
        _, results = run(model, opt, w_star, steps=100, global_batch=64, micro=8, noise=NoiseConfig(mode=mode))
        spreads[mode] = float(torch.tensor([float(r.noise.trace) for r in results]).std())
    # eight small batches per step instead of one: the spread of tr(Σ) falls by about sqrt(8)
    assert spreads["every"] < spreads["first"] / 2


def token_batch(w_star: torch.Tensor, n: int, g: torch.Generator, pad_first: bool = False):
    """``n`` samples of 1..6 tokens (the rest padding), each token an independent regression example."""
    x = torch.randn(n, 6, D, generator=g)
    y = x @ w_star + SIGMA * torch.randn(n, 6, generator=g)
    lengths = torch.randint(1, 7, (n,), generator=g)
    if pad_first:
        lengths[:4] = 0  # the first micro-batch is all padding: nothing to measure there
    mask = torch.arange(6) < lengths[:, None]
    return {"x": x, "y": y, "mask": mask}


def token_loss(m, b):
    r = m(b["x"]).squeeze(-1) - b["y"]
    return (0.5 * r**2 * b["mask"]).sum(), b["mask"].sum()


def test_token_weighted_losses_measure_per_token_and_report_samples():
    """(sum, count) losses: each sample holds 1..6 tokens, each token an independent regression example."""
    model, opt, w_star, truth = regression()
    g = torch.Generator().manual_seed(3)
    engine = Engine(model, opt, token_loss, global_batch_size=32, micro_batch_size=4,
                    noise=NoiseConfig(mode="every", beta=0.99))
    results = [engine.step(token_batch(w_star, 32, g)) for _ in range(200)]
    assert_unbiased([float(r.noise.grad_sq) for r in results], truth["grad_sq"], "|G|² per token")
    assert_unbiased([float(r.noise.trace) for r in results], truth["trace"], "tr(Σ) per token")
    per_sample = float(results[-1].noise.elements_per_sample)
    assert per_sample == pytest.approx(3.5, rel=0.05)  # E[lengths] for 1..6
    scale = engine.noise_meter.scale
    assert scale.noise_scale_elements == pytest.approx(truth["b_simple"], rel=0.10)
    assert engine.noise_scale == pytest.approx(scale.noise_scale_elements / per_sample, rel=1e-6)


def test_finite_population_correction_removes_the_reshuffling_bias():
    """Epochs over N = 160 samples (global 80 = 8 × 10): with the correction the estimates match the
    population's exact values; without it |G|² comes out low by tr(Σ)/(N - 1), as derived."""
    n_data = 160
    g = torch.Generator().manual_seed(5)
    model, opt, w_star, _ = regression(delta_norm=0.6)
    x, y = draw(w_star, n_data, g)
    w = model.weight.detach().squeeze(0)
    per_example = x * (x @ w - y)[:, None]  # the exact per-sample gradients
    mean = per_example.mean(0)
    pop_g2 = float(mean @ mean)
    pop_trace = float(((per_example - mean) ** 2).sum(1).mean())
    sampler = ElasticBatchSampler(n_data, 80, seed=0, drop_last=True, num_replicas=1, rank=0)
    estimates = {}
    for fpc in (True, False):
        engine = Engine(model, opt, half_mse, global_batch_size=80, micro_batch_size=10,
                        noise=NoiseConfig(mode="every", dataset_size=n_data if fpc else None))
        g2s, traces = [], []
        for epoch in range(100):
            sampler.set_epoch(epoch)
            for idx in sampler:
                r = engine.step((x[idx], y[idx]))
                sampler.mark_consumed()
                g2s.append(float(r.noise.grad_sq))
                traces.append(float(r.noise.trace))
        estimates[fpc] = (g2s, traces)
    assert_unbiased(estimates[True][0], pop_g2, "|G|² with the correction")
    assert_unbiased(estimates[True][1], pop_trace, "tr(Σ) with the correction")
    raw_g2 = sum(estimates[False][0]) / len(estimates[False][0])
    predicted = pop_g2 - pop_trace / (n_data - 1)
    assert raw_g2 == pytest.approx(predicted, rel=0.05)
    assert abs(raw_g2 - pop_g2) > 0.1 * pop_g2  # B_simple / (N - 1) = 17% here


def test_measuring_leaves_training_bit_identical():
    """Real training (SGD with momentum): every mode's set-aside-and-add-back, and the first
    mode's norm, change no parameter by a single bit."""
    runs = {}
    for noise in (False, NoiseConfig(mode="first"), NoiseConfig(mode="every")):
        model, opt = make("mlp", lr=0.05)
        engine = Engine(model, opt, CE, global_batch_size=64, micro_batch_size=16, noise=noise, grad_clip=5.0)
        for batch in batches(model, 64, 10):
            engine.step(batch)
        runs[str(noise)] = params(model)
    base = runs["False"]
    for name, got in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(base, got)), name


def test_clipping_norm_is_reused_before_clipping():
    """With clipping on, the big batch's norm is clipping's pre-clip norm: a clip far below the norm
    changes nothing in the estimates (measured after clipping, |G|² would collapse)."""
    out = {}
    for clip in (None, 1e-4):
        model, opt, w_star, _ = regression()
        _, results = run(model, opt, w_star, steps=40, global_batch=64, micro=8, grad_clip=clip)
        out[clip] = [(float(r.noise.grad_sq), float(r.noise.trace)) for r in results]
        if clip is not None:
            assert float(results[0].grad_norm) > 100 * clip
    for (a_g, a_t), (b_g, b_t) in zip(out[None], out[1e-4]):
        assert b_g == pytest.approx(a_g, rel=1e-5, abs=1e-6) and b_t == pytest.approx(a_t, rel=1e-5)


def test_fp16_gradients_are_unscaled():
    """Under fp16 autocast the gradients carry GradScaler's 65536: the estimates must not."""
    out = {}
    for amp in (None, "fp16"):
        model, opt, w_star, truth = regression()
        engine, results = run(model, opt, w_star, steps=60, global_batch=64, micro=8, amp=amp,
                              noise=NoiseConfig(mode="every"))
        if amp:
            assert engine.scaler.get_scale() >= 2**15
        out[amp] = (float(results[-1].noise.grad_sq_ema), float(results[-1].noise.trace_ema))
    assert out["fp16"][0] == pytest.approx(out[None][0], rel=0.02)
    assert out["fp16"][1] == pytest.approx(out[None][1], rel=0.02)


def test_single_micro_batch_steps_are_split_only_when_asked():
    model, opt, w_star, _ = regression()
    _, plain = run(copy.deepcopy(model), copy.deepcopy(opt), w_star, steps=3, global_batch=16, micro=16)
    assert plain[-1].noise is None and plain[-1].accum_steps == 1
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    _, split = run(model2, opt2, w_star, steps=3, global_batch=16, micro=16, noise=NoiseConfig(split=True))
    assert split[-1].noise is not None and (split[-1].micro_batch_size, split[-1].accum_steps) == (8, 2)
    # the same update as one micro-batch of 16 (no BatchNorm here), to float rounding
    model3 = copy.deepcopy(model)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.1)
    run(model3, opt3, w_star, steps=3, global_batch=16, micro=16, noise=False)
    assert_params_close(params(model2), params(model3))


def test_noise_off_and_the_checkpoint_continues_the_emas_exactly():
    model, opt, w_star, _ = regression()
    off, results = run(model, opt, w_star, steps=2, global_batch=32, micro=8, noise=False)
    assert results[-1].noise is None and off.noise_scale is None and off.state_dict()["noise"] is None

    straight, _ = run(*regression()[:3], steps=20, global_batch=32, micro=8, seed=7)
    first, _ = run(*regression()[:3], steps=10, global_batch=32, micro=8, seed=7)
    buffer = io.BytesIO()
    torch.save({"engine": first.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["engine"]  # plain numbers: nothing to unpickle
    model, opt, w_star, _ = regression()
    second = Engine(model, opt, half_mse, global_batch_size=32, micro_batch_size=8, noise=True)
    second.load_state_dict(state)
    g = torch.Generator().manual_seed(7)
    for _ in range(10):
        draw(w_star, 32, g)  # the batches the first half consumed
    for _ in range(10):
        r = second.step(draw(w_star, 32, g))
    assert second.noise_meter.scale.updates == 20
    assert float(r.noise.grad_sq_ema) == pytest.approx(straight.noise_meter.scale.grad_sq, rel=1e-6)
    assert second.noise_scale == pytest.approx(straight.noise_scale, rel=1e-6)


@pytest.mark.parametrize("case", ["mean", "tokens", "fp16"])
def test_the_accelerator_path_keeps_tensors_and_agrees(monkeypatch, case):
    """On an accelerator the meter keeps every value a device tensor (no wait for the device);
    forcing that path on CPU must give the numbers of the float path."""
    def measure(keep_tensors: bool):
        if keep_tensors:
            monkeypatch.setattr(noise_module, "_host", lambda t: t)
        model, opt, w_star, _ = regression()
        g = torch.Generator().manual_seed(11)
        if case == "tokens":
            engine = Engine(model, opt, token_loss, global_batch_size=16, micro_batch_size=4,
                            noise=NoiseConfig(mode="every"))
            results = [engine.step(token_batch(w_star, 16, g, pad_first=i % 2 == 0)) for i in range(6)]
        else:
            engine = Engine(model, opt, half_mse, global_batch_size=32, micro_batch_size=8,
                            amp="fp16" if case == "fp16" else None, noise=NoiseConfig(mode="every"))
            results = [engine.step(draw(w_star, 32, g)) for _ in range(6)]
        monkeypatch.undo()
        return results

    floats, tensors = measure(False), measure(True)
    assert isinstance(tensors[-1].noise.trace_ema, torch.Tensor) and isinstance(floats[-1].noise.trace_ema, float)
    for a, b in zip(floats, tensors):
        assert a.noise.small_count == b.noise.small_count
        for key in ("grad_sq", "trace", "grad_sq_ema", "trace_ema"):
            assert float(getattr(b.noise, key)) == pytest.approx(getattr(a.noise, key), rel=1e-5), key
    assert tensors[-1].noise_scale == pytest.approx(floats[-1].noise_scale, rel=1e-5)


@pytest.mark.gpu
def test_on_cuda_the_measurement_adds_no_host_sync_and_keeps_tensors():
    import warnings

    device = torch.device("cuda")

    def syncs(noise) -> tuple[int, Engine]:
        model, opt, w_star, _ = regression()
        model.to(device)
        engine = Engine(model, opt, half_mse, global_batch_size=64, micro_batch_size=8, noise=noise)
        g = torch.Generator().manual_seed(1)
        batch = tuple(t.to(device) for t in draw(w_star, 64, g))
        engine.step(batch)  # warm-up: lazy state, kernels
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = engine.step(batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught), result

    # the first engine of the process pays one-time syncs of its own (on the H200 the base run, first,
    # counted one more than the measured runs after it): compare each against a base measured after it
    syncs(False)
    base, _ = syncs(False)
    for mode in ("first", "every"):
        extra, result = syncs(NoiseConfig(mode=mode))
        assert extra == base, f"{mode}: {extra - base} more host syncs per step"
        assert isinstance(result.noise.trace_ema, torch.Tensor) and result.noise.trace_ema.is_cuda
        assert math.isfinite(result.noise_scale)


def test_a_coordinator_that_cannot_sum_the_norms_is_refused_before_any_work():
    class OldWorld:  # a user's coordinator from before the noise scale: no sync_gradients_and_sum
        world_size, defer_grad_sync = 2, True

        def agree_oom(self, oom):
            return oom

        def agree_micro_batch(self, size):
            return size

        def agree(self, oom, size):
            return oom, size

        def total_count(self, count):
            return count

        def sync_gradients(self, model):
            return None

    # the meter is told what it needs of the coordinator (its world and whether the sync is
    # deferred), not handed one to probe: the protocol guarantees the sums over ranks
    meter = noise_module.make_meter(True, world=2, deferred=OldWorld.defer_grad_sync)
    assert (meter.world, meter.deferred, meter.config.mode) == (2, True, "first")
    with pytest.raises(TypeError, match="OldWorld lacks .*sync_gradients_and_sum, sum_over_ranks"):
        check_coordinator(OldWorld())
    # the engine refuses such a coordinator before any work: the Coordinator protocol declares
    # every member it calls, and LocalCoordinator holds their defaults
    model, opt = make("mlp")
    with pytest.raises(TypeError, match="OldWorld lacks .*sync_gradients_and_sum, sum_over_ranks.*subclass "
                                        "batchpilot.dist.coordinator.LocalCoordinator"):
        Engine(model, opt, CE, global_batch_size=16, micro_batch_size=4, coordinator=OldWorld())
