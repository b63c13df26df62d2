"""Tests for batchpilot.train.batching: batch arithmetic, LR scaling rules, mid-run LR rescaling."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from batchpilot.policy.schedule import LR_SCALE_RULES
from batchpilot.train.batching import (
    config_for_limit,
    ADAPTIVE_OPTIMIZERS,
    BatchConfig,
    is_adaptive,
    rescale_lr,
    scale_lr,
    split_sizes,
)


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default world size reads these; a test run under torchrun or SLURM must not leak in.
    for var in ("WORLD_SIZE", "SLURM_NTASKS", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


# -- BatchConfig --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # (global, micro, accum, world)
        (dict(global_batch_size=256, micro_batch_size=32, world_size=2), (256, 32, 4, 2)),
        (dict(global_batch_size=256, accum_steps=4, world_size=2), (256, 32, 4, 2)),
        (dict(micro_batch_size=32, accum_steps=4, world_size=2), (256, 32, 4, 2)),
        (dict(global_batch_size=256, micro_batch_size=32, accum_steps=4, world_size=2), (256, 32, 4, 2)),
        (dict(global_batch_size=256, world_size=2), (256, 128, 1, 2)),
        (dict(global_batch_size=256), (256, 256, 1, 1)),
        (dict(micro_batch_size=8), (8, 8, 1, 1)),
        (dict(micro_batch_size=8, world_size=3), (24, 8, 1, 3)),
        (dict(global_batch_size=7, micro_batch_size=1), (7, 1, 7, 1)),
        (dict(global_batch_size=6, micro_batch_size=6, world_size=1), (6, 6, 1, 1)),
    ],
)
def test_batch_config_fills_in_the_missing_value(kwargs: dict, expected: tuple) -> None:
    config = BatchConfig(**kwargs)
    got = (config.global_batch_size, config.micro_batch_size, config.accum_steps, config.world_size)
    assert got == expected
    assert config.global_batch_size == config.micro_batch_size * config.world_size * config.accum_steps


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        # global not a multiple of micro × world: nearest globals and micro divisors of global/world.
        (
            dict(global_batch_size=250, micro_batch_size=32, world_size=2),
            ["global_batch_size=250", "micro_batch_size 32 × world_size 2 = 64", "192 or 256",
             "micro_batch_size 25 or 125", "global / world = 125"],
        ),
        (
            dict(global_batch_size=256, micro_batch_size=48, world_size=2),
            ["192 or 288", "micro_batch_size 32 or 64", "global / world = 128"],
        ),
        (
            dict(global_batch_size=256, accum_steps=3, world_size=2),
            ["accum_steps 3 × world_size 2 = 6", "252 or 258", "accum_steps 2 or 4"],
        ),
        (
            dict(global_batch_size=250, world_size=3),
            ["global_batch_size=250 is not divisible by world_size 3", "249 or 252"],
        ),
        (
            dict(global_batch_size=256, micro_batch_size=32, world_size=3),
            ["192 or 288", "must be a multiple of world_size 3"],
        ),
        (
            dict(global_batch_size=20, micro_batch_size=32, world_size=1),
            ["32 × world_size 1 = 32", "nearest valid global_batch_size: 32",
             "micro_batch_size 20 (divisors"],
        ),
        # All three given and inconsistent: the product, and the accum that would fit.
        (
            dict(global_batch_size=256, micro_batch_size=32, accum_steps=3, world_size=2),
            ["256 != micro_batch_size 32 × world_size 2 × accum_steps 3 = 192",
             "global_batch_size=192", "accum_steps=4"],
        ),
        (
            dict(global_batch_size=250, micro_batch_size=32, accum_steps=3, world_size=2),
            ["= 192", "global_batch_size=192", "leave one of the three out"],
        ),
        (dict(accum_steps=4), ["needs global_batch_size or micro_batch_size", "accum_steps=4"]),
        (dict(), ["needs global_batch_size or micro_batch_size", "nothing"]),
        (dict(global_batch_size=0), ["global_batch_size must be a positive int, got 0"]),
        (dict(micro_batch_size=-4), ["micro_batch_size must be a positive int, got -4"]),
        (dict(global_batch_size=True), ["global_batch_size must be a positive int", "bool"]),
        (dict(global_batch_size=64.0), ["global_batch_size must be a positive int", "float"]),
        (dict(global_batch_size=64, world_size=0), ["world_size must be a positive int, got 0"]),
    ],
)
def test_batch_config_errors_say_what_disagrees_and_suggest(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as excinfo:
        BatchConfig(**kwargs)
    for fragment in fragments:
        assert fragment in str(excinfo.value)


def test_batch_config_suggestions_are_valid() -> None:
    # Every global batch the error suggests must itself be accepted with the same micro and world.
    with pytest.raises(ValueError, match="nearest valid global_batch_size: 192 or 256"):
        BatchConfig(global_batch_size=250, micro_batch_size=32, world_size=2)
    for suggested in (192, 256):
        BatchConfig(global_batch_size=suggested, micro_batch_size=32, world_size=2)
    for micro in (25, 125):
        BatchConfig(global_batch_size=250, micro_batch_size=micro, world_size=2)


def test_batch_config_accepts_numpy_ints_and_stores_python_ints() -> None:
    np = pytest.importorskip("numpy")
    config = BatchConfig(global_batch_size=np.int64(64), micro_batch_size=np.int32(16), world_size=1)
    assert type(config.global_batch_size) is int and type(config.micro_batch_size) is int
    assert config.accum_steps == 4


def test_describe() -> None:
    config = BatchConfig(global_batch_size=256, micro_batch_size=32, world_size=2)
    assert config.describe() == "global 256 = micro 32 × world 2 × accum 4"


def test_batch_config_is_frozen() -> None:
    config = BatchConfig(global_batch_size=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.micro_batch_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("micro", "expected_accum"),
    [(32, 4), (16, 8), (128, 1), (1, 128)],
)
def test_with_micro_batch_size_keeps_global(micro: int, expected_accum: int) -> None:
    config = BatchConfig(global_batch_size=256, micro_batch_size=32, world_size=2)
    new = config.with_micro_batch_size(micro)
    assert (new.global_batch_size, new.micro_batch_size, new.accum_steps, new.world_size) == (
        256, micro, expected_accum, 2,
    )
    assert config.micro_batch_size == 32  # the original is unchanged


def test_with_micro_batch_size_error_suggests_divisors() -> None:
    config = BatchConfig(global_batch_size=256, micro_batch_size=32, world_size=2)
    with pytest.raises(ValueError, match=r"micro_batch_size 32 or 64 \(divisors of global / world = 128"):
        config.with_micro_batch_size(48)
    with pytest.raises(ValueError, match="micro_batch_size 128"):
        config.with_micro_batch_size(256)


@pytest.mark.parametrize(
    ("world", "expected_accum"),
    [(1, 8), (2, 4), (4, 2), (8, 1)],
)
def test_with_world_size_keeps_global_and_micro(world: int, expected_accum: int) -> None:
    config = BatchConfig(global_batch_size=256, micro_batch_size=32, world_size=2)
    new = config.with_world_size(world)
    assert (new.global_batch_size, new.micro_batch_size, new.accum_steps, new.world_size) == (
        256, 32, expected_accum, world,
    )


@pytest.mark.parametrize(
    ("world", "fragments"),
    [
        (3, ["32 × world_size 3 = 96", "192 or 288", "multiple of world_size 3"]),
        (16, ["32 × world_size 16 = 512", "global_batch_size: 512", "micro_batch_size 16"]),
    ],
)
def test_with_world_size_errors_suggest(world: int, fragments: list[str]) -> None:
    config = BatchConfig(global_batch_size=256, micro_batch_size=32, world_size=2)
    with pytest.raises(ValueError) as excinfo:
        config.with_world_size(world)
    for fragment in fragments:
        assert fragment in str(excinfo.value)


def test_world_size_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert BatchConfig(global_batch_size=64).world_size == 1
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert BatchConfig(global_batch_size=64).world_size == 4
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's variable wins over SLURM's
    config = BatchConfig(global_batch_size=64)
    assert (config.world_size, config.micro_batch_size) == (2, 32)
    assert BatchConfig(global_batch_size=64, world_size=8).world_size == 8


@pytest.mark.parametrize("raw", ["two", "0", "-1"])
def test_bad_world_size_env_is_reported(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", raw)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        BatchConfig(global_batch_size=64)


def test_world_size_from_initialised_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # The live group (1 rank) wins over a stale environment variable.
        assert BatchConfig(global_batch_size=64).world_size == 1
    finally:
        dist.destroy_process_group()


# -- split_sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "micro", "expected"),
    [
        (10, 4, [4, 4, 2]),
        (12, 4, [4, 4, 4]),
        (3, 4, [3]),
        (1, 1, [1]),
        (0, 4, []),
        (7, 1, [1] * 7),
    ],
)
def test_split_sizes(total: int, micro: int, expected: list[int]) -> None:
    assert split_sizes(total, micro) == expected
    assert sum(split_sizes(total, micro)) == total


@pytest.mark.parametrize(
    ("total", "micro", "fragment"),
    [(10, 0, "micro must be a positive int"), (10, True, "micro must be a positive int"),
     (-1, 4, "total must be >= 0"), (2.5, 4, "total must be an int")],
)
def test_split_sizes_rejects(total, micro, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        split_sizes(total, micro)


@pytest.mark.parametrize(
    ("global_", "limit", "world", "expected"),
    [
        (256, 47, 1, (32, 8)),    # the largest divisor of 256 up to 47
        (256, 300, 1, (256, 1)),  # the whole batch fits
        (96, 40, 1, (32, 3)),
        (256, 47, 2, (32, 4)),    # per rank 128
        (97, 10, 1, (1, 97)),     # a prime: only 1 divides it
        (120, 7, 4, (6, 5)),      # per rank 30
        (8, 1, 8, (1, 1)),
    ],
)
def test_config_for_limit_takes_the_largest_dividing_micro_batch(global_, limit, world, expected) -> None:
    cfg = config_for_limit(global_, limit, world_size=world)
    assert (cfg.micro_batch_size, cfg.accum_steps) == expected
    assert cfg.global_batch_size == global_ and cfg.micro_batch_size * world * cfg.accum_steps == global_
    per_rank = global_ // world
    # nothing between it and the limit divides the per-rank batch
    assert not [d for d in range(cfg.micro_batch_size + 1, min(limit, per_rank) + 1) if per_rank % d == 0]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"global_batch_size": 255, "max_micro_batch_size": 8, "world_size": 2}, "nearest valid global_batch_size: 254 or 256"),
     ({"global_batch_size": 64, "max_micro_batch_size": 0}, "max_micro_batch_size must be a positive int"),
     ({"global_batch_size": 0, "max_micro_batch_size": 4}, "global_batch_size must be a positive int")],
)
def test_config_for_limit_rejects(kwargs, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        config_for_limit(**kwargs)


# -- is_adaptive / scale_lr ---------------------------------------------------------------------

# Optimizers from other libraries, identified by class name only (their update rule is irrelevant
# to the LR rule, so bare Optimizer subclasses with the real names are what is under test).
Lamb = type("Lamb", (torch.optim.Optimizer,), {})
Lars = type("Lars", (torch.optim.Optimizer,), {})
Adafactor = type("Adafactor", (torch.optim.Optimizer,), {})
AdaBelief = type("AdaBelief", (torch.optim.Optimizer,), {})
FusedLAMB = type("FusedLAMB", (torch.optim.Optimizer,), {})
MyAdam = type("MyOptimizer", (torch.optim.Adam,), {})  # subclass with an unrelated name
MyLambVariant = type("Trust", (Lamb,), {})  # matched through the MRO


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (None, False),
        (torch.optim.SGD, False),
        (torch.optim.RMSprop, False),
        (torch.optim.ASGD, False),
        (torch.optim.Rprop, False),
        (torch.optim.LBFGS, False),
        (Lars, False),
        (torch.optim.Adam, True),
        (torch.optim.AdamW, True),
        (torch.optim.Adamax, True),
        (torch.optim.NAdam, True),
        (torch.optim.RAdam, True),
        (torch.optim.Adagrad, True),
        (torch.optim.Adadelta, True),
        (torch.optim.SparseAdam, True),
        (Lamb, True),
        (FusedLAMB, True),
        (Adafactor, True),
        (AdaBelief, True),
        (MyAdam, True),
        (MyLambVariant, True),
    ],
)
def test_is_adaptive(optimizer, expected: bool) -> None:
    assert is_adaptive(optimizer) is expected


def test_is_adaptive_accepts_instances() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert is_adaptive(torch.optim.AdamW(params, lr=1e-3))
    assert not is_adaptive(torch.optim.SGD(params, lr=0.1))
    assert all(is_adaptive(cls) for cls in ADAPTIVE_OPTIMIZERS)


@pytest.mark.parametrize(
    ("rule", "optimizer", "gbs", "expected"),
    [
        ("linear", None, 1024, 0.4),
        ("linear", torch.optim.Adam, 1024, 0.4),  # an explicit rule ignores the optimizer
        ("linear", None, 128, 0.05),
        ("sqrt", None, 1024, 0.2),
        ("sqrt", None, 64, 0.05),
        ("none", torch.optim.Adam, 1024, 0.1),
        ("auto", None, 1024, 0.4),
        ("auto", torch.optim.SGD, 1024, 0.4),
        ("auto", torch.optim.Adam, 1024, 0.2),
        ("auto", Lamb, 4096, 0.4),
        ("auto", torch.optim.SGD, 256, 0.1),
    ],
)
def test_scale_lr_rules(rule: str, optimizer, gbs: int, expected: float) -> None:
    assert scale_lr(0.1, gbs, rule=rule, optimizer=optimizer) == pytest.approx(expected)


def _timm_lr(lr_base: float, global_batch_size: int, lr_base_size: int, opt_name: str) -> float:
    """timm train.py's LR rule, written out from its description, keyed on the optimizer name."""
    on = opt_name.lower()
    lr_base_scale = "sqrt" if any(o in on for o in ("ada", "lamb")) else "linear"
    batch_ratio = global_batch_size / lr_base_size
    if lr_base_scale == "sqrt":
        batch_ratio = batch_ratio**0.5
    return lr_base * batch_ratio


TIMM_OPTIMIZERS = [
    ("sgd", torch.optim.SGD),
    ("momentum", torch.optim.SGD),
    ("rmsprop", torch.optim.RMSprop),
    ("adam", torch.optim.Adam),
    ("adamw", torch.optim.AdamW),
    ("adamax", torch.optim.Adamax),
    ("nadam", torch.optim.NAdam),
    ("radam", torch.optim.RAdam),
    ("adagrad", torch.optim.Adagrad),
    ("adadelta", torch.optim.Adadelta),
    ("sparseadam", torch.optim.SparseAdam),
    ("lamb", Lamb),
    ("lars", Lars),
    ("adafactor", Adafactor),
    ("adabelief", AdaBelief),
]


@pytest.mark.parametrize(("opt_name", "opt_class"), TIMM_OPTIMIZERS)
@pytest.mark.parametrize(
    ("lr_base", "gbs", "lr_base_size"),
    [(0.1, 256, 256), (5e-4, 1024, 256), (1e-3, 96, 256), (0.05, 7, 512), (3e-4, 4096, 128)],
)
def test_scale_lr_matches_timm(
    opt_name: str, opt_class: type, lr_base: float, gbs: int, lr_base_size: int
) -> None:
    expected = _timm_lr(lr_base, gbs, lr_base_size, opt_name)
    # Exactly equal: the same float operations, not just close.
    assert scale_lr(lr_base, gbs, lr_base_size=lr_base_size, optimizer=opt_class) == expected


def test_scale_lr_default_base_size_is_256() -> None:
    assert scale_lr(0.1, 512) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(lr_base=0.1, global_batch_size=256, rule="cubic"), "unknown LR scaling rule 'cubic'"),
        (dict(lr_base=0.0, global_batch_size=256), "lr_base must be a finite number > 0"),
        (dict(lr_base=-0.1, global_batch_size=256), "lr_base must be a finite number > 0"),
        (dict(lr_base=float("nan"), global_batch_size=256), "lr_base must be a finite number > 0"),
        (dict(lr_base=True, global_batch_size=256), "lr_base must be a finite number > 0"),
        (dict(lr_base=0.1, global_batch_size=0), "global_batch_size must be a positive int"),
        (dict(lr_base=0.1, global_batch_size=-8), "global_batch_size must be a positive int"),
        (dict(lr_base=0.1, global_batch_size=256, lr_base_size=0), "lr_base_size must be a positive"),
    ],
)
def test_scale_lr_rejects(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        scale_lr(**kwargs)


def test_unknown_rule_lists_accepted_rules() -> None:
    with pytest.raises(ValueError) as excinfo:
        scale_lr(0.1, 256, rule="Linear")
    for rule in LR_SCALE_RULES:
        assert rule in str(excinfo.value)


# -- rescale_lr ---------------------------------------------------------------------------------


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3))]


def _run(optimizer: torch.optim.Optimizer, scheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def _warmup_lambda(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))


def _step(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def _warmup_cosine(optimizer):
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10),
        ],
        milestones=[4],
    )


@pytest.mark.parametrize("make_scheduler", [_warmup_lambda, _step, _warmup_cosine])
@pytest.mark.parametrize(
    ("opt_class", "expected_factor"),
    [(torch.optim.SGD, 4.0), (torch.optim.Adam, 2.0)],
)
@pytest.mark.parametrize("steps_before", [2, 6])
def test_rescale_lr_continues_the_schedule_of_the_new_base_lr(
    make_scheduler, opt_class: type, expected_factor: float, steps_before: int
) -> None:
    base = 0.1
    optimizer = opt_class(_params(), lr=base)
    scheduler = make_scheduler(optimizer)
    _run(optimizer, scheduler, steps_before)

    factor = rescale_lr(optimizer, 256, 1024, scheduler=scheduler)
    assert factor == pytest.approx(expected_factor)
    assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(base * factor)
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]

    reference_optimizer = opt_class(_params(), lr=base * factor)
    reference = make_scheduler(reference_optimizer)
    _run(reference_optimizer, reference, steps_before)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_optimizer.param_groups[0]["lr"])
    assert _run(optimizer, scheduler, 12) == pytest.approx(_run(reference_optimizer, reference, 12))


def test_rescale_lr_without_scheduler_scales_every_group_and_defaults() -> None:
    p1, p2 = _params(), _params()
    optimizer = torch.optim.SGD([{"params": p1}, {"params": p2, "lr": 0.5}], lr=0.1)
    assert rescale_lr(optimizer, 512, 256) == 0.5
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.25])
    assert optimizer.defaults["lr"] == pytest.approx(0.05)
    assert "initial_lr" not in optimizer.param_groups[0]


def test_rescale_lr_scales_tensor_lr_in_place() -> None:
    optimizer = torch.optim.Adam(_params(), lr=torch.tensor(0.01))
    lr_tensor = optimizer.param_groups[0]["lr"]
    assert rescale_lr(optimizer, 100, 400) == pytest.approx(2.0)
    assert optimizer.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(0.02)


@pytest.mark.parametrize(("rule", "expected"), [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_rescale_lr_explicit_rule(rule: str, expected: float) -> None:
    optimizer = torch.optim.Adam(_params(), lr=0.1)
    assert rescale_lr(optimizer, 64, 256, rule=rule) == pytest.approx(expected)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * expected)


def test_rescale_lr_rejects() -> None:
    optimizer = torch.optim.SGD(_params(), lr=0.1)
    other = torch.optim.SGD(_params(), lr=0.1)
    with pytest.raises(ValueError, match="different optimizer"):
        rescale_lr(optimizer, 64, 128, scheduler=_step(other))
    with pytest.raises(ValueError, match="new_global must be a positive int"):
        rescale_lr(optimizer, 64, 0)
    with pytest.raises(ValueError, match="unknown LR scaling rule"):
        rescale_lr(optimizer, 64, 128, rule="quadratic")
    assert optimizer.param_groups[0]["lr"] == 0.1  # nothing changed on error
