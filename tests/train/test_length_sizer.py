"""LengthSizer (batchpilot.train.lengths) through its interface: decisions from real searches, applied by the caller.

The sizer is built from explicit values (a search function, the layout, the per-rank batch...)
and never touches an engine: here a plain loop applies its decisions, trains at them and
reports each step's peak back.
"""

from __future__ import annotations

import pytest
import torch

from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch
from batchpilot.core.batch import BatchLayout, BatchSplitter
from batchpilot.find.finder import find_batch_size
from batchpilot.memory.gauge import gauge_for
from batchpilot.memory.probes import emulate_capacity
from batchpilot.memory.tracker import active_tracker
from batchpilot.memory.units import parse_bytes
from batchpilot.policy.lengths import UnverifiedLengthError
from batchpilot.train.lengths import LengthConfig, LengthSizer, LengthStep, make_sizer

from engine_utils import one_thread  # noqa: F401

CAP = "1MiB"
N = 16
CPU = torch.device("cpu")


def _model() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=16, heads=2, layers=1, max_len=128)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(width: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (N,), generator=g).tolist()
    lens[0] = width
    return padded_lm_batch(lens, vocab=64, generator=g)


def _train(model, opt, batch, micro: int) -> None:
    """One optimizer step over ``batch`` in micro-batches of ``micro``, the exact (sum, count) mean."""
    count = int((batch["labels"][:, 1:] != -100).sum())
    for start in range(0, N, micro):
        total, _ = lm_loss(model, {k: v[start:start + micro] for k, v in batch.items()})
        (total / count).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sizer(model, opt, widths: list[int], **config) -> LengthSizer:
    """A sizer whose searches are real finder runs on the batch given (``widths`` records their lengths)."""

    def search(split: BatchSplitter):
        widths.append(split.batch["input_ids"].shape[1])
        return find_batch_size(lambda b: _train(model, opt, split.slice(0, b), b), restore=(model, opt),
                               device=CPU, capacity=CAP, max_batch_size=split.size, timed_steps=0)

    sizer = make_sizer(LengthConfig(**config), None, start=None, fixed=False, search=search,
                       layout=BatchLayout.of(None, None), per_rank=N,
                       param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                       target=0.8, high_water=0.95, world=1, group=None)
    assert isinstance(sizer, LengthSizer)
    return sizer


def test_each_step_is_sized_by_its_length_and_trains_at_the_decision():
    model, opt = _model()
    searched: list[int] = []
    sizer = _sizer(model, opt, searched)
    micro_at = {}
    with emulate_capacity(CAP):
        gauge = gauge_for(CPU, emulated_capacity=active_tracker(CPU).capacity)
        for step, width in enumerate([32, 8, 64, 32]):
            batch = _batch(width, seed=step)
            split = BatchSplitter(batch)
            sized = sizer.size_step(split, N)
            assert isinstance(sized, LengthStep) and sized.length == width
            assert sized.micro_batch_size == max(1, min(sized.allowed, N)) == min(sizer.budget.micro_batch(width), N)
            assert sized.reason == f"sized for length {width}: the memory model allows {sized.allowed} samples"
            sizer.start_step(sized.micro_batch_size)  # the caller adopts it as it is
            micro = sized.micro_batch_size
            sizes, widths = sizer.cut(split, micro, [micro] * (N // micro) + ([N % micro] if N % micro else []))
            assert widths is None and sizer.widths == [width] * len(sizes)  # no split: slices at the batch's length
            gauge.reset()
            _train(model, opt, batch, micro)  # no OOM: the model's answer runs
            assert not sizer.observe(gauge.peak(), parse_bytes(CAP))  # and peaks under the high-water mark
            micro_at[width] = micro
    # the first step fitted the model at its length, half and quarter; 64 was verified when it came
    assert searched == [32, 16, 8, 64] and sizer.verifications == 1 and sizer.budget.verified_max == 64
    assert micro_at[8] > micro_at[32] > micro_at[64] >= 1  # the short batch uses the memory the long one cannot
    # what the sizer learnt is a plain state another sizer continues from, with no search
    again: list[int] = []
    resumed = _sizer(*_model(), again)
    resumed.load_state_dict(sizer.state_dict())
    assert resumed.size_step(BatchSplitter(_batch(64, seed=9)), N).micro_batch_size == micro_at[64]
    assert again == []


def test_a_length_beyond_the_verified_is_refused_before_any_search_when_asked():
    model, opt = _model()
    searched: list[int] = []
    sizer = _sizer(model, opt, searched, beyond="error")
    with emulate_capacity(CAP):
        sizer.size_step(BatchSplitter(_batch(32, seed=0)), N)
        with pytest.raises(UnverifiedLengthError):
            sizer.size_step(BatchSplitter(_batch(64, seed=1)), N)
    assert searched == [32, 16, 8]


def test_make_sizer_refuses_what_it_cannot_size_before_any_work():
    common = dict(search=lambda split: pytest.fail("searched"), layout=None, per_rank=N, param_bytes=0,
                  target=0.8, high_water=0.95, world=1, group=None)
    assert make_sizer(None, None, start=None, fixed=False, **common) is None  # off, and no LengthPlan start
    assert make_sizer(False, None, start=4, fixed=False, **common) is None
    with pytest.raises(ValueError, match='needs micro_batch_size="auto"'):
        make_sizer(True, None, start=None, fixed=True, **common)
    with pytest.raises(ValueError, match="an int holds for one length only"):
        make_sizer(True, None, start=4, fixed=False, **common)
    with pytest.raises(ValueError, match="lengths must be a LengthConfig, True or None, got str"):
        make_sizer("yes", None, start=None, fixed=False, **common)
    with pytest.raises(TypeError, match="fsdp"):  # gone: a fully_shard model is sized as any other
        make_sizer(True, None, start=None, fixed=False, **(common | {"fsdp": True}))
