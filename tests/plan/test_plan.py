"""The fake-tensor planner: byte-exact against the CPU tracker, exact boundaries, clear refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from batchpilot.app.models import MLP, SmallCNN, build_model, example_batch
from batchpilot.memory.probes import track_peak
from batchpilot.plan.gpus import GPUS, CudaAccounting
from summary import assert_explains
from batchpilot.plan.planner import _search_boundary, default_step, estimate_peak_memory, plan_batch_size
from batchpilot.plan.result import MemoryEstimate, PlanningError


class Checkpointed(nn.Module):
    """Runs the wrapped module under non-reentrant activation checkpointing."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


def build(name: str, checkpointed: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    # small inputs keep the real CPU steps quick; the planner takes any shape
    model = build_model(name, **({"seq_len": 16} if name == "transformer" else {}))
    sample = example_batch(model, 3)
    if name == "cnn":
        sample = (sample[0][..., :16, :16].contiguous(), sample[1])
    if checkpointed:
        if isinstance(model, MLP):
            for i, layer in enumerate(model.net):
                if isinstance(layer, nn.Linear):
                    model.net[i] = Checkpointed(layer)
        elif isinstance(model, SmallCNN):
            model.features = Checkpointed(model.features)
        else:
            model.blocks = Checkpointed(model.blocks)
    return model, sample


def rows(sample: tuple[torch.Tensor, ...], b: int) -> tuple[torch.Tensor, ...]:
    """A real batch of b rows shaped like the sample (targets in range)."""
    x, y = sample
    if x.is_floating_point():
        x = torch.randn(b, *x.shape[1:])
    else:
        x = torch.randint(0, 8, (b, *x.shape[1:]))
    return x, torch.randint(0, 10, (b,))


def measured_peak(model: nn.Module, opt, batch, *, steps: int = 2, **kw) -> int:
    """The CPU tracker's peak over ``steps`` real steps, the accounting the planner reproduces."""
    with track_peak("cpu", track=(model, opt, batch)) as m:
        for _ in range(steps):
            default_step(model, opt, batch, **kw)
    return m.peak_bytes


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


# ---------------------------------------------------------------------------
# byte-exact agreement with the tracker


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("variant", ["fp32", "bf16", "checkpoint", "checkpoint+bf16"])
def test_estimate_equals_tracker_byte_for_byte(name, variant):
    amp = "bf16" if "bf16" in variant else None
    model, sample = build(name, checkpointed="checkpoint" in variant)
    for b in (1, 5, 16) if variant == "fp32" else (3, 12):
        fake = estimate_peak_memory(model, sample, b, optimizer=adam, amp=amp)
        real_model, _ = build(name, checkpointed="checkpoint" in variant)
        real = measured_peak(real_model, adam(real_model.parameters()), rows(sample, b), amp=amp)
        assert fake.peak_bytes == real, (name, variant, b)
        assert fake.allocated_bytes == fake.reserved_bytes == real and fake.context_bytes == 0


@pytest.mark.parametrize(
    "name, optimizer, mode",
    [
        ("transformer", None, "train"),
        ("cnn", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "train"),
        ("transformer", lambda p: torch.optim.AdamW(p, foreach=True), "train"),
        ("mlp", lambda p: torch.optim.Adam(p, fused=True), "train"),
        ("cnn", None, "eval"),
        ("transformer", None, "eval"),
    ],
    ids=["no-optimizer", "sgd-momentum", "adamw-foreach", "adam-fused", "eval-cnn", "eval-transformer"],
)
def test_estimate_equals_tracker_for_other_steps(name, optimizer, mode):
    model, sample = build(name)
    fake = estimate_peak_memory(model, sample, 8, optimizer=optimizer, mode=mode)
    real_model, _ = build(name)
    real_model.train(mode == "train")
    opt = optimizer(real_model.parameters()) if optimizer else None
    assert fake.peak_bytes == measured_peak(real_model, opt, rows(sample, 8), mode=mode)


def test_one_step_misses_optimizer_state_that_two_steps_count():
    # At a batch where activations dominate, the first step peaks in backward
    # before Adam has state; the second carries both moments through backward.
    model, sample = build("mlp")
    one = estimate_peak_memory(model, sample, 1024, optimizer=adam, steps=1)
    two = estimate_peak_memory(model, sample, 1024, optimizer=adam, steps=2)
    n = len(list(model.parameters()))
    assert one.optimizer_state == 0
    assert two.peak_bytes - one.peak_bytes == two.optimizer_state == 2 * two.parameters + 4 * n
    real_model, _ = build("mlp")
    assert one.peak_bytes == measured_peak(real_model, adam(real_model.parameters()), rows(sample, 1024), steps=1)


def test_breakdown_adds_up_and_names_each_part():
    model, sample = build("cnn")
    est = estimate_peak_memory(model, sample, 32, optimizer=adam)
    parts = (est.parameters, est.buffers, est.inputs, est.gradients, est.optimizer_state, est.activations)
    assert sum(parts) == est.peak_bytes
    assert est.parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.buffers == sum(b.numel() * b.element_size() for b in model.buffers())
    x, y = rows(sample, 32)
    assert est.inputs == x.numel() * x.element_size() + y.numel() * y.element_size()
    # the peak falls in the second step: both Adam moments and every step counter exist
    n = len(list(model.parameters()))
    assert est.optimizer_state == 2 * est.parameters + 4 * n
    assert 0 < est.gradients <= est.parameters
    assert est.activations > est.parameters
    d = est.to_dict()
    assert d["required_bytes"] == est.peak_bytes and d["batch_size"] == 32


def test_sample_as_callable_and_meta_model_give_the_same_estimate():
    model, sample = build("cnn")
    ref = estimate_peak_memory(model, sample, 8, optimizer=adam).peak_bytes

    def make(b):  # runs under FakeTensorMode: nothing is allocated
        return torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))

    assert estimate_peak_memory(model, make, 8, optimizer=adam).peak_bytes == ref
    with torch.device("meta"):
        meta_model = build_model("cnn")
    assert estimate_peak_memory(meta_model, sample, 8, optimizer=adam).peak_bytes == ref


def test_an_optimizer_instance_is_rebuilt_not_used():
    model, sample = build("transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    from_instance = estimate_peak_memory(model, sample, 4, optimizer=opt)
    from_factory = estimate_peak_memory(model, sample, 4, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4))
    assert from_instance.peak_bytes == from_factory.peak_bytes
    assert opt.state == {}


def test_planning_leaves_model_optimizer_rng_and_outer_tracker_alone():
    model, sample = build("cnn")
    opt = adam(model.parameters())
    default_step(model, opt, sample)  # real state: grads, Adam moments, BN statistics
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    rng = torch.get_rng_state()
    with track_peak("cpu", track=(model, opt, sample)) as outer:
        plan_batch_size(model, sample, optimizer=opt, capacity="64MiB")
        estimate_peak_memory(model, sample, 4096, optimizer=opt, device="cuda")
    assert outer.peak_bytes == outer.start_bytes == outer.end_bytes  # fake tensors are invisible to it
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, opt.state.values()))
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training


def test_a_huge_batch_is_estimated_without_allocating_it():
    model, sample = build("transformer")
    est = estimate_peak_memory(model, sample, 65536, optimizer=adam)
    assert est.peak_bytes > 4 * 2**30  # estimated on a machine that need not have it
    small = estimate_peak_memory(model, sample, 16, optimizer=adam)
    assert est.activations > 4000 * small.activations


# ---------------------------------------------------------------------------
# CUDA accounting


def test_cuda_accounting_rounds_adds_workspaces_and_context():
    model, sample = build("mlp")
    loop = lambda p: torch.optim.Adam(p, foreach=False)  # noqa: E731 - same optimizer code on both
    cpu = estimate_peak_memory(model, sample, 7, optimizer=loop)
    acc = CudaAccounting(blas_workspace=8 * 2**20, context=300 * 2**20, extra=12345)
    cuda = estimate_peak_memory(model, sample, 7, optimizer=loop, device="cuda", accounting=acc)
    assert cuda.peak_bytes == cpu.peak_bytes
    workspaces = 2 * 8 * 2**20  # forward thread + autograd thread
    assert cuda.allocated_bytes >= cpu.peak_bytes + workspaces + 12345
    assert cuda.allocated_bytes % 512 == 12345 % 512  # every block a multiple of 512 B
    assert cuda.reserved_bytes >= cuda.allocated_bytes
    assert (cuda.reserved_bytes - 12345) % (2 * 2**20) == 0  # segments of 2 MiB multiples
    assert cuda.context_bytes == 300 * 2**20
    # what cudaMalloc runs out of: the reserved segments plus the context
    assert cuda.required_bytes == cuda.reserved_bytes + cuda.context_bytes
    bare = estimate_peak_memory(model, sample, 7, optimizer=loop, device="cuda",
                                accounting=CudaAccounting(blas_workspace=0, context=0))
    assert cpu.peak_bytes <= bare.allocated_bytes <= cpu.peak_bytes + 512 * 64
    inference = estimate_peak_memory(model, sample, 7, mode="eval", device="cuda", accounting=acc)
    assert 8 * 2**20 <= inference.allocated_bytes < workspaces


def test_a_plan_never_fits_on_allocated_bytes_when_reserved_does_not():
    # 20 MiB segments for large blocks: at some batch sizes the reserved memory is far above
    # the allocated; the plan must judge the reserved figure (plus the context)
    model, sample = build("cnn")
    acc = CudaAccounting(blas_workspace=0, context=64 * 2**20)
    plan = plan_batch_size(model, sample, capacity=300 * 2**20, target=1.0, optimizer=adam, device="cuda",
                           accounting=acc)
    est, nxt = plan.estimate, plan.next_estimate
    assert est.reserved_bytes + est.context_bytes <= plan.limit
    assert nxt.reserved_bytes + nxt.context_bytes > plan.limit
    assert est.reserved_bytes > est.allocated_bytes  # the case that matters: segments left unfilled
    # judged on allocated bytes, the next batch would have looked like it fit
    assert nxt.allocated_bytes + nxt.context_bytes <= plan.limit


def test_cuda_estimates_use_the_foreach_optimizer_torch_picks_on_cuda():
    # Adam on CUDA tensors defaults to foreach: one temporary list as large as all
    # parameters. The CPU loop holds two temporaries of the largest parameter.
    model = MLP(in_features=256, width=256, depth=8)
    sample = (torch.randn(2, 256), torch.randint(0, 10, (2,)))
    acc = CudaAccounting(blas_workspace=0, context=0)
    auto = estimate_peak_memory(model, sample, 1, optimizer=adam, device="cuda", accounting=acc)
    loop = estimate_peak_memory(model, sample, 1, optimizer=lambda p: torch.optim.Adam(p, foreach=False),
                                device="cuda", accounting=acc)
    assert auto.activations >= auto.parameters > 2 * loop.activations
    assert estimate_peak_memory(model, sample, 1, optimizer=adam).peak_bytes == loop.peak_bytes


# ---------------------------------------------------------------------------
# planning


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_plan_boundary_is_exact_against_the_estimate(name):
    model, sample = build(name)
    plan = plan_batch_size(model, sample, optimizer=adam, capacity="96MiB", target=0.75)
    b = plan.batch_size
    assert b > 1 and plan.limit == int(0.75 * 96 * 2**20) and plan.device == "cpu"
    at = estimate_peak_memory(model, sample, b, optimizer=adam)
    after = estimate_peak_memory(model, sample, b + 1, optimizer=adam)
    assert at.required_bytes <= plan.limit < after.required_bytes
    assert plan.estimate.peak_bytes == at.peak_bytes and plan.next_estimate.peak_bytes == after.peak_bytes
    assert plan.evaluations[b] == at.required_bytes and len(plan.evaluations) <= 12
    assert plan.to_dict()["estimate"]["batch_size"] == b


def test_plan_for_a_named_gpu_is_exact_against_the_cuda_estimate():
    model, sample = build("cnn")
    plan = plan_batch_size(model, sample, optimizer=adam, capacity="rtx4090-24gb")
    assert plan.gpu == "RTX4090-24GB" and plan.device == "cuda" and plan.capacity == GPUS["RTX4090-24GB"].capacity
    acc = CudaAccounting.for_gpu("RTX4090-24GB")
    b = plan.batch_size
    at = estimate_peak_memory(model, sample, b, optimizer=adam, device="cuda", accounting=acc)
    after = estimate_peak_memory(model, sample, b + 1, optimizer=adam, device="cuda", accounting=acc)
    assert at.required_bytes <= plan.limit < after.required_bytes
    assert at.context_bytes == acc.context > 0


def test_plan_edges_nothing_fits_and_everything_fits():
    model, sample = build("mlp")
    nothing = plan_batch_size(model, sample, optimizer=adam, capacity="1MiB")
    assert nothing.batch_size == 0 and nothing.estimate is None and nothing.next_estimate.batch_size == 1
    everything = plan_batch_size(model, sample, optimizer=adam, capacity="1TiB", max_batch_size=300)
    assert everything.batch_size == 300 and everything.next_estimate is None


@pytest.mark.parametrize(
    "cost, limit, most",
    [
        (lambda b: 1000 + 7 * b, 50_000, 4),  # linear
        (lambda b: max(5000, 30 * b), 90_001, 5),  # flat until activations overtake a fixed phase
        (lambda b: 1000 + 7 * b + 900 * (b // 50), 60_000, 6),  # upward steps (allocator segments)
        (lambda b: b * b, 10**8, 24),  # superlinear
    ],
    ids=["linear", "kink", "steps", "quadratic"],
)
def test_search_finds_the_exact_boundary(cost, limit, most):
    b, seen = _search_boundary(cost, limit, 1 << 20)
    assert cost(b) <= limit < cost(b + 1)
    assert len(seen) <= most


def test_search_takes_four_evaluations_on_a_line():
    b, seen = _search_boundary(lambda b: 10_000 + 123 * b, 10**7, 1 << 20)
    assert b == (10**7 - 10_000) // 123 and len(seen) == 4


@settings(max_examples=60, deadline=None)
@given(fixed=st.integers(0, 10**6), slope=st.integers(1, 10**4), step=st.integers(0, 10**4),
       period=st.integers(1, 5000), frac=st.floats(0.0, 1.0), max_b=st.integers(1, 1 << 20))
def test_search_boundary_property(fixed, slope, step, period, frac, max_b):
    def cost(b):
        return fixed + slope * b + step * (b // period)

    limit = int(cost(1) + frac * (cost(max_b + 1) - cost(1)))
    b, _ = _search_boundary(cost, limit, max_b)
    if b == 0:
        assert cost(1) > limit
    else:
        assert cost(b) <= limit and (b == max_b or cost(b + 1) > limit)


# ---------------------------------------------------------------------------
# bad input


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)


class _UsesItem(_Linear):
    def forward(self, x):
        y = self.fc(x)
        return y / y.abs().max().item()


class _DataDependentShape(_Linear):
    def forward(self, x):
        y = self.fc(x)
        return y + y[y > 0].sum()


class _HardCodedCuda(_Linear):
    def forward(self, x):
        return self.fc(x) + torch.zeros(4, device="cuda")


_LIB = torch.library.Library("batchpilot_test_plan", "DEF")
_LIB.define("cpu_only(Tensor x) -> Tensor")
_LIB.impl("cpu_only", lambda x: x * 2, "CPU")


class _CustomOp(_Linear):
    def forward(self, x):
        return torch.ops.batchpilot_test_plan.cpu_only(self.fc(x))


@pytest.mark.parametrize("cls", [_UsesItem, _DataDependentShape, _HardCodedCuda, _CustomOp])
def test_unplannable_models_raise_a_planning_error_that_points_to_the_finder(cls):
    batch = (torch.randn(2, 8), torch.randint(0, 4, (2,)))
    with pytest.raises(PlanningError, match="find_batch_size") as info:
        plan_batch_size(cls(), batch, optimizer=adam, capacity="1GiB")
    assert "planning" in str(info.value) and isinstance(info.value, RuntimeError)


def test_unknown_gpu_lists_the_known_ones():
    model, sample = build("mlp")
    with pytest.raises(ValueError, match="H100-80GB.*MI300X-192GB|known GPUs") as info:
        plan_batch_size(model, sample, capacity="Quantum-Card")  # nothing close: every known name
    assert all(name in str(info.value) for name in GPUS)
    with pytest.raises(ValueError, match="did you mean 'A100-40GB' or 'A100-80GB'"):
        plan_batch_size(model, sample, capacity="A100")  # close names: those, not all thirteen


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, "steps"),
        ({"mode": "predict"}, "mode"),
        ({"amp": "int8"}, "amp"),
        ({"device": "xpu"}, "device"),
        ({"accounting": CudaAccounting()}, "accounting"),
    ],
)
def test_bad_arguments_are_rejected_before_running(kwargs, match):
    model, sample = build("mlp")
    with pytest.raises(ValueError, match=match):
        estimate_peak_memory(model, sample, 4, **kwargs)


def test_bad_plan_arguments():
    model, sample = build("mlp")
    with pytest.raises(ValueError, match="target"):
        plan_batch_size(model, sample, capacity="1GiB", target=1.5)
    with pytest.raises(ValueError, match="device='cuda'"):
        plan_batch_size(model, sample, capacity="H100-80GB", device="cpu")
    with pytest.raises(ValueError, match="batch_size"):
        estimate_peak_memory(model, sample, 0)
    with pytest.raises(ValueError, match="sample"):
        estimate_peak_memory(model, {"x": 3}, 4)
    with pytest.raises(ValueError, match=r"needs batches of \(inputs, targets\).*loss_fn=lambda model, batch"):
        estimate_peak_memory(model, torch.randn(2, 64), 4)
    with pytest.raises(ValueError, match="reduction='none'"):
        estimate_peak_memory(model, sample, 4, loss_fn=nn.CrossEntropyLoss(reduction="none"))


def test_custom_step_fn_is_what_runs():
    model, sample = build("mlp")
    calls = []

    def step(m, opt, batch):
        calls.append(batch[0].shape[0])
        default_step(m, opt, batch)

    est = estimate_peak_memory(model, sample, 6, optimizer=adam, step_fn=step, steps=3)
    assert calls == [6, 6, 6] and isinstance(est, MemoryEstimate)


def test_a_plan_prints_its_answer_limit_make_up_and_the_next_size():
    model, sample = build("mlp")
    plan = plan_batch_size(model, sample, optimizer=adam(model.parameters()), capacity="16MiB")
    text = str(plan)
    assert text == plan.describe()
    assert text.splitlines()[0] == f"batch size {plan.batch_size} on cpu: planned on fake tensors, nothing ran"
    assert_explains(text, figure="tensor bytes", target="80% of 16.00 MiB", model="per sample (between the last two")
    assert f"at {plan.batch_size + 1}: " in text and "optimizer state" in text
    assert repr(plan).startswith(f"PlanResult(batch_size={plan.batch_size}, ") and len(repr(plan)) < 250
