"""torch.compile: tracked work leaves models compiled; searches and engine runs compile once.

A counting backend (``backend=`` callable) records every dynamo compilation and every call of a
compiled graph, so "still compiled" and "compiled once" are read from dynamo itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import batchpilot as bp
from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch
from batchpilot.core.batch import BatchLayout
from batchpilot.core.compiled import (
    compilations, compiled_floor, compiled_modules, eager_while_tracked, is_compiled, mark_batch_dynamic,
    no_single_tail,
)
from batchpilot.memory.probes import track_peak
from batchpilot.plan import estimate_peak_memory
from batchpilot.train.engine import EngineConfig


class CountingBackend:
    """A dynamo backend that counts compilations and calls of the compiled graphs.

    ``oom_above``: a compiled graph called with a batch (a non-parameter tensor's dim 0) larger
    than this raises ``torch.OutOfMemoryError``, as an allocator would from inside compiled code.
    """

    def __init__(self, oom_above: int | None = None) -> None:
        self.compiles = 0
        self.calls = 0
        self.oom_above = oom_above
        self.batches: list[int] = []

    def __call__(self, gm, example_inputs):
        self.compiles += 1

        def run(*args):
            self.calls += 1
            rows = [a.shape[0] for a in args if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter)
                    and a.dim() > 0]
            self.batches.append(max(rows, default=0))
            if self.oom_above is not None and self.batches[-1] > self.oom_above:
                raise torch.OutOfMemoryError(f"injected OOM inside the compiled graph at batch {self.batches[-1]}")
            return gm.forward(*args)

        return run


class Net(nn.Module):
    """Holds an ``nn.Sequential``: a de-compilation would reach that class's code too."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no graph or skip left from another test
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def _data(n: int = 64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def _assert_still_compiled(model: nn.Module, backend: CountingBackend) -> None:
    compiles, calls = backend.compiles, backend.calls
    model(torch.randn(5, 16)).sum().backward()
    assert backend.compiles >= max(1, compiles), "the compiled model no longer compiles"
    assert backend.calls > calls, "the compiled model no longer runs its compiled graph"
    fresh = CountingBackend()
    torch.compile(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), backend=fresh)(torch.randn(2, 3))
    assert fresh.compiles == 1, "a fresh nn.Sequential no longer compiles"


# ---------------------------------------------------------------------------
# pure pieces


def test_no_single_tail_moves_one_sample_to_the_last_micro_batch():
    assert no_single_tail([32, 32, 1]) == [32, 31, 2]
    assert no_single_tail([3, 1]) == [2, 2]
    assert no_single_tail([2, 2, 1]) == [2, 2, 1]
    assert no_single_tail([1]) == [1]
    assert no_single_tail([25, 25, 25, 25]) == [25, 25, 25, 25]
    for sizes in ([32, 32, 1], [3, 1], [7, 7, 7, 1]):
        assert sum(no_single_tail(sizes)) == sum(sizes)


def test_compiled_floor_starts_at_two_when_allowed():
    assert compiled_floor(1, None) == 2
    assert compiled_floor(1, 1) == 1
    assert compiled_floor(1, 2) == 2
    assert compiled_floor(4, 64) == 4


def test_is_compiled_finds_wrapped_in_place_and_nested_modules():
    plain = Net()
    assert not is_compiled(plain, None, torch.optim.SGD(plain.parameters(), lr=0.1))
    wrapped = torch.compile(Net(), backend=CountingBackend())
    assert is_compiled(wrapped) and compiled_modules(wrapped) == [wrapped]
    in_place = Net()
    in_place.compile(backend=CountingBackend())
    assert is_compiled(in_place)
    outer = nn.Sequential(nn.Linear(16, 16), torch.compile(Net(), backend=CountingBackend()))
    assert is_compiled(outer) and len(compiled_modules(outer)) == 1


def test_mark_batch_dynamic_marks_per_sample_tensors_only():
    batch = {"ids": torch.zeros(8, 5, dtype=torch.long), "positions": torch.arange(8), "mask": torch.ones(8, 5)}
    mark_batch_dynamic(batch, BatchLayout.of(shared={"positions"}))
    marked = {k for k, t in batch.items() if 0 in getattr(t, "_dynamo_weak_dynamic_indices", ())}
    assert marked == {"ids", "mask"}


def test_mark_batch_dynamic_marks_the_tokens_dim_where_it_is_the_padded_length():
    batch = {"ids": torch.zeros(4, 12, dtype=torch.long), "labels": torch.zeros(4, 12), "cls": torch.zeros(4, 3),
             "positions": torch.arange(12)}
    mark_batch_dynamic(batch, BatchLayout.of(shared={"positions"}), seq_dim=1)
    dims = {k: getattr(t, "_dynamo_weak_dynamic_indices", set()) for k, t in batch.items()}
    assert dims == {"ids": {0, 1}, "labels": {0, 1}, "cls": {0}, "positions": set()}


# ---------------------------------------------------------------------------
# 1. tracked work never de-compiles


def _finder(model, opt):
    x, y = _data()
    plan = bp.find_batch_size_for(model, (x, y), optimizer=opt, loss_fn=nn.CrossEntropyLoss(), capacity="256KiB")
    assert plan.compiled and not plan.compiled_trials  # the tracker measured the eager program
    assert plan.batch_size > 1


def _planner(model, opt):
    x, y = _data(4)
    eager = estimate_peak_memory(Net(), (x, y), 64, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    est = estimate_peak_memory(model, (x, y), 64, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert est.peak_bytes == eager.peak_bytes  # the eager program's plan
    assert bp.plan_batch_size(model, (x, y), capacity="256KiB", optimizer=opt).batch_size > 1


def _engine(model, opt):
    x, y = _data()
    engine = bp.Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=32, start=8)
    with bp.emulate_capacity("1MiB", track=(model, opt)):
        for i in range(2):
            engine.step((x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)]))


def _tracker(model, opt):
    with track_peak("cpu", track=(model, opt)) as m:
        model(torch.randn(4, 16)).sum().backward()
    assert m.peak_bytes > m.start_bytes


@pytest.mark.parametrize("work", [_finder, _planner, _engine, _tracker], ids=lambda f: f.__name__.strip("_"))
def test_tracked_work_leaves_the_model_compiled(work):
    backend = CountingBackend()
    model = torch.compile(Net(), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    work(model, opt)
    assert backend.compiles == 0  # under a dispatch mode the model ran eagerly, as documented
    _assert_still_compiled(model, backend)


def test_a_model_compiled_and_run_before_stays_compiled_and_warm():
    backend = CountingBackend()
    model = torch.compile(Net(), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 16))
    _finder(model, opt)
    calls = backend.calls
    model(torch.randn(4, 16))
    assert backend.compiles == 1 and backend.calls == calls + 1  # the same graph, not recompiled


def test_without_the_stance_dynamo_is_reset_after_tracked_work(monkeypatch):
    """Where the stance cannot be set (torch < 2.6), the skips dynamo cached are forgotten at the end."""

    def no_stance(*args, **kwargs):
        raise AttributeError("set_stance")

    monkeypatch.setattr(torch.compiler, "set_stance", no_stance)
    backend = CountingBackend()
    model = torch.compile(Net(), backend=backend)
    with eager_while_tracked(), track_peak("cpu"):
        model(torch.randn(4, 16))
    monkeypatch.undo()
    _assert_still_compiled(model, backend)


# ---------------------------------------------------------------------------
# 2. one compilation per search, per engine run


def test_a_search_on_real_memory_compiles_once_over_five_sizes():
    backend = CountingBackend()
    model = torch.compile(Net(), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    plan = bp.find_batch_size_for(model, (x, y), optimizer=opt, loss_fn=nn.CrossEntropyLoss(),
                                  strategy="binsearch", max_batch_size=32)
    sizes = [t.batch_size for t in plan.trials]
    assert len(set(sizes)) >= 5 and min(sizes) == 2, sizes  # no trial at 1: it would compile alone
    assert plan.memory == "resident" and plan.compiled and plan.compiled_trials
    assert backend.compiles == 1 == plan.compilations  # the warm-up compiled the dynamic graph
    assert all(t.tensor_bytes is None for t in plan.trials)  # no tracker ran: the compiled step did
    assert backend.calls >= 2 * len(sizes) + 1  # warm-up and every step ran the compiled graph
    assert set(backend.batches) >= set(sizes)
    _assert_still_compiled(model, backend)


def test_nothing_fits_at_two_then_the_search_tries_one():
    """The floor of 2 is a compilation saving, never a lost answer: 1 is tried when 2 does not fit."""
    backend = CountingBackend(oom_above=1)
    model = torch.compile(Net(), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()
    plan = bp.find_batch_size_for(model, (x, y), optimizer=opt, loss_fn=nn.CrossEntropyLoss(), max_batch_size=64)
    assert plan.batch_size == 1
    assert [(t.batch_size, t.outcome) for t in plan.trials] == [(2, "oom"), (1, "fit")]


def test_engine_compiles_once_across_micro_batch_changes_and_ragged_tails():
    backend = CountingBackend()
    model = torch.compile(Net(), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(512)
    engine = bp.Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=101, start=34,
                       config=EngineConfig(grow_after=1))
    micro, runs, start = [], [], 0
    for n in (35, 101, 101, 101, 69):  # a short batch first: 35 at micro-batch 34
        before = len(backend.batches)
        r = engine.step((x[start:start + n], y[start:start + n]))
        start += n
        micro.append(r.micro_batch_size)
        runs.append(backend.batches[before:])
    assert runs[0] == [18, 17]  # balanced micro-batches: no tail of one to compile a graph for
    assert len(set(micro)) >= 2, (micro, runs)  # the micro-batch grew
    assert len({b for run in runs for b in run}) >= 4, runs
    assert backend.compiles == 1, runs  # every size after the first ran the same dynamic graph
    assert min(b for run in runs for b in run) >= 2


def test_engine_oom_inside_compiled_code_retries_without_recompiling():
    backend = CountingBackend(oom_above=20)
    model = torch.compile(Net(), backend=backend)
    reference = copy.deepcopy(model._orig_mod)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _data(64)
    engine = bp.Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=64, start=64)
    r = engine.step((x, y))
    assert r.ooms >= 1 and r.micro_batch_size <= 20
    assert backend.compiles == 1 and r.compilations == 1
    ref_opt.zero_grad()
    nn.functional.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    r2 = engine.step((x, y))
    assert r2.ooms == 0 and r2.compilations == 0


def test_engine_with_aot_autograd_matches_an_eager_step_exactly():
    """aot_eager runs AOT autograd's forward and backward graphs: the update of one eager step."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    net = copy.deepcopy(eager)
    model = torch.compile(net, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    x, y = _data(99)
    before = compilations()
    engine = bp.Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=99, micro_batch_size=49)
    for _ in range(3):
        r = engine.step((x, y))  # 49 + 49 + 1 -> 49 + 48 + 2
        ref_opt.zero_grad()
        nn.functional.cross_entropy(eager(x), y).backward()
        ref_opt.step()
    assert r.accum_steps == 3 and compilations() - before == 1
    for p, q in zip(net.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_engine_auto_start_on_a_compiled_model_compiles_once():
    backend = CountingBackend()
    model = torch.compile(Net(), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(96)
    # split="fewest": the default "time" may split 96 into more micro-batches when the trials' times
    # predict that faster, and on a loaded CPU they sometimes do; this test is about the graph
    engine = bp.Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=96,
                       config=bp.EngineConfig(split="fewest"))
    r = engine.step((x, y))
    assert engine.plan.compiled_trials and engine.plan.compilations == 1
    assert backend.compiles == 1 == r.compilations  # finder warm-up, trials and the step: one graph
    assert r.micro_batch_size == engine.plan.batch_size


def test_searches_and_steps_at_many_lengths_compile_one_graph():
    """Sized by length, the tokens' dim is marked dynamic with the batch's: a new length reuses the graph.

    Unmarked, dynamo compiles a static graph at the first length and a dynamic one at the next
    (its automatic dynamic shapes): 2 graphs, not 1.
    """
    gpt = TinyGPT(vocab=256, dim=32, heads=2, layers=2, max_len=64)
    backend = CountingBackend()
    model = torch.compile(gpt, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = bp.find_batch_size_for(model, padded_lm_batch([64, 64], pad_to=64), optimizer=opt, loss_fn=lm_loss,
                                  max_batch_size=8, lengths=(16, 32, 64))  # real memory: compiled trials
    assert sorted(plan.length_plans) == [16, 32, 64]
    assert all(p.compiled_trials for p in plan.length_plans.values())
    assert backend.compiles == 1 == plan.compilations
    # the engine on its own (the search's graph gone): it marks the tokens' dim itself
    torch._dynamo.reset()
    backend = CountingBackend()
    model = torch.compile(gpt, backend=backend)
    engine = bp.Engine(model, opt, lm_loss, global_batch_size=16, start=plan, lengths=bp.LengthConfig(split=True))
    shapes, compiles = set(), []
    for widths in ([9, 64, 3, 30] * 4, [12] * 16, [40, 7] * 8, [50, 5] * 8):
        r = engine.step(padded_lm_batch(widths))
        shapes |= set(zip(r.micro_batch_sizes, r.micro_batch_lengths))
        compiles.append(r.compilations)
    assert len({L for _, L in shapes}) >= 4, shapes
    assert backend.compiles == 1 and compiles == [1, 0, 0, 0], (compiles, shapes)


def _ran_compiled(fn) -> bool:
    """Whether ``fn`` entered a compiled region (the profiler's record of a dynamo graph running)."""
    with torch.profiler.profile() as prof:
        fn()
    return any(e.name.startswith("Torch-Compiled Region") for e in prof.events())


@pytest.mark.slow
def test_inductor_search_engine_and_emulation_keep_one_compiled_program():
    """The one test with the default backend (inductor compiles C++ with gcc: slow on 2 cores)."""
    model = torch.compile(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(48)
    plan = bp.find_batch_size_for(model, (x, y), optimizer=opt, loss_fn=nn.CrossEntropyLoss(), max_batch_size=48)
    assert plan.compiled_trials and plan.compilations == 1 and min(t.batch_size for t in plan.trials) == 2
    before = compilations()
    engine = bp.Engine(model, opt, nn.CrossEntropyLoss(), global_batch_size=48, start=20)  # 20 + 20 + 8
    with bp.emulate_capacity("1MiB", track=(model, opt)):
        assert not _ran_compiled(lambda: engine.step((x, y)))  # eager under the tracker
    assert _ran_compiled(lambda: engine.step((x, y)))  # compiled again, on the search's graph
    assert compilations() == before
    model(torch.randn(2, 3, 16))  # a new rank: dynamo must still compile this code
    assert compilations() == before + 1
