"""The composition matrix's cells, shared by tests/train/test_composition.py and its torchrun worker.

A cell is (engine option, batch layout, dtype, launch). Every cell trains a small held-out causal
LM (built here, not batchpilot's own models) for one engine step on one global batch, and its
outcome is judged against one plain PyTorch step on the whole global batch from the same weights:
the engine either trains exactly or refuses before any work with an error that says what to do.

The loss is ``(sum, count)`` over labels that are not -100, so uneven micro-batches (and ranks) give
the exact global mean over tokens. SGD without momentum: its update is the gradient itself, so a
mis-weighted micro-batch shows in the parameters (Adam's first step, ``lr · sign(g)``, would hide it).
"""

from __future__ import annotations

import contextlib
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from batchpilot import Engine, EngineConfig, LengthConfig
from batchpilot import find_batch_size_for
from batchpilot.memory.probes import emulate_capacity
from batchpilot.train.noise import NoiseConfig

VOCAB, DIM, MAX_LEN = 32, 16, 16
GLOBAL = 12  # samples per optimizer step over all ranks: 6 per rank on two
LR = 0.5
FIXED_MICRO = 4  # does not divide 12 or 6: the last micro-batch is smaller
#: the emulated device the "auto" cells plan against; small enough that the finder splits the batch
#: (each auto cell also asserts that it did), per dtype since fp64 doubles every byte
CAPACITY = {"fp32": 96 * 1024, "fp64": 160 * 1024, "bf16": 96 * 1024}
COMPILE_BACKEND = "eager"  # dynamo's graph capture without inductor: compile's semantics at CPU-test cost

OPTIONS = ("fixed", "auto", "lengths", "lengths_plan", "lengths_fn", "split", "noise", "schedule", "schedule_cfg",
           "compile")
LAYOUTS = ("tuple", "dict_mask", "dict_labels", "list")
DTYPES = ("fp32", "fp64", "bf16")


class TinyLM(nn.Module):
    """Token and learned position embeddings, one causal self-attention block and a feed-forward block."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        # causal: a right-padded position never reaches a real one, so trimming pads changes nothing
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = x + self.ff(x)
        return self.head(x)


def build(dtype: str) -> nn.Module:
    torch.manual_seed(0)
    model = TinyLM()
    return model.double() if dtype == "fp64" else model


def sample_lengths() -> list[int]:
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(3, MAX_LEN + 1, (GLOBAL,), generator=g).tolist()
    lens[5] = MAX_LEN  # the batch is padded to its longest sample, as a collate function does
    return lens


def global_ids() -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(4)
    lens = sample_lengths()
    ids = torch.randint(1, VOCAB, (GLOBAL, MAX_LEN), generator=g)
    for i, n in enumerate(lens):
        ids[i, n:] = 0
    return ids, lens


def make_batch(layout: str, rows: slice | None = None) -> Any:
    """The global batch (or ``rows`` of it) in ``layout``; right-padded to the longest sample."""
    ids, lens = global_ids()
    index = list(range(GLOBAL))[rows] if rows is not None else list(range(GLOBAL))
    ids, lens = ids[index].clone(), [lens[i] for i in index]
    mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lens)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    if layout == "tuple":
        return ids, labels
    if layout == "dict_mask":
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if layout == "dict_labels":
        return {"input_ids": ids, "labels": labels}
    if layout == "list":  # one tensor per sample, each its own length: the loss pads them
        return [ids[i, :n].clone() for i, n in enumerate(lens)]
    raise ValueError(layout)


def list_batch(b: int, length: int) -> list[torch.Tensor]:
    """``b`` samples of ``length`` tokens as a list batch: what the finder searches a list layout on per length."""
    g = torch.Generator().manual_seed(100 * b + length)
    return [torch.randint(1, VOCAB, (length,), generator=g) for _ in range(b)]


def longest_sample(batch: list[torch.Tensor]) -> int:
    """A list batch's padded length: its longest sample (the loss pads each micro-batch to it)."""
    return max(len(t) for t in batch)


def _ids_labels(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, tuple):
        return batch
    if isinstance(batch, dict):
        return batch["input_ids"], batch["labels"]
    width = max(len(t) for t in batch)  # list: pad this micro-batch to its longest sample
    ids = torch.stack([F.pad(t, (0, width - len(t))) for t in batch])
    labels = torch.stack([F.pad(t, (0, width - len(t)), value=-100) for t in batch])
    return ids, labels


def lm_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` next-token cross-entropy over the labels that are not -100."""
    ids, labels = _ids_labels(batch)
    logits = model(ids)[:, :-1]
    target = labels[:, 1:]
    total = F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (target != -100).sum()


def _autocast(dtype: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def reference_params(layout: str, dtype: str) -> list[torch.Tensor]:
    """One plain step on the whole global batch (under the same autocast for bf16)."""
    model = build(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with _autocast(dtype):
        total, count = lm_loss(model, make_batch(layout))
    (total / count).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def tolerance(dtype: str) -> dict[str, float]:
    """fp32/fp64: rounding only (the micro-batches sum in another order). bf16 autocast: each
    micro-batch's matmuls round to bf16 (8 significant bits, eps 2^-8 = 3.9e-3) before the fp32
    gradients add up, so the split batch's gradient differs from the whole batch's by a few bf16
    roundings of each micro-batch's share. Measured on dict_mask (fixed, auto, lengths, split,
    noise): at most 2.1e-4 off the autocast reference, where the step moves a weight by up to
    5.4e-2; 1e-3 + 5e-3·|w| leaves a 5× margin over that."""
    if dtype == "bf16":
        return {"rtol": 5e-3, "atol": 1e-3}
    return {"rtol": 1e-5, "atol": 1e-6}


# -- cells ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    option: str
    layout: str
    dtype: str
    launch: str = "one"  # "one" process, "ddp" (2 ranks) or "fsdp" (FSDP2, 2 ranks)

    @property
    def parts(self) -> frozenset[str]:
        """The options the cell combines (``"lengths+noise"``: both)."""
        return frozenset(self.option.split("+"))

    @property
    def id(self) -> str:
        return f"{self.option}-{self.layout}-{self.dtype}" + ("" if self.launch == "one" else f"-{self.launch}")


def by_design_refusal(cell: Cell) -> str | None:
    """The message (a regex) a cell must refuse with, when refusing is its right outcome; else ``None``."""
    parts = cell.parts
    if cell.layout == "list" and parts & {"lengths", "split"}:
        return r"seq_dim=1 is missing from the batch.*pass length_fn="
    if cell.layout == "list" and "lengths_plan" in parts:
        # find_batch_size_for trims its example batch on seq_dim, which a list of samples does not have
        return r"seq_dim=1 is missing from the batch.*pass length_fn="
    if cell.layout == "tuple" and "split" in parts:
        return r"length-aware splitting needs .*attention_mask.*turn split off"
    return None


def _cross(options: tuple[str, ...], layouts: tuple[str, ...], dtypes: tuple[str, ...], launch: str) -> list[Cell]:
    return [Cell(o, l, d, launch) for o in options for l in layouts for d in dtypes]


def one_process_cells() -> list[Cell]:
    """fixed and auto: every layout × dtype; the other options: every layout in fp32, fp64 and bf16 on dict
    batches with an attention_mask; a few pairs of options; compile on a few cells."""
    cells = _cross(("fixed", "auto"), LAYOUTS, DTYPES, "one")
    heavy = ("lengths", "lengths_plan", "split", "noise", "schedule")
    cells += _cross(heavy, LAYOUTS, ("fp32",), "one")
    cells += _cross(heavy, ("dict_mask",), ("fp64", "bf16"), "one")
    cells += [Cell("schedule_cfg", "dict_mask", "fp32"), Cell("lengths_fn", "list", "fp32"),
              Cell("lengths_fn", "list", "bf16")]
    # options together (each pair a user may set at once)
    cells += [Cell(o, "dict_mask", "fp32") for o in ("lengths+noise", "split+noise", "lengths+schedule",
                                                      "split+schedule", "fixed+noise")]
    # compile is dynamo's capture with the "eager" backend (no inductor): slow on CPU, so a few cells
    cells += [Cell("compile", l, d) for l, d in (("tuple", "fp32"), ("dict_mask", "fp32"), ("dict_mask", "bf16"),
                                                  ("list", "fp32"))]
    return cells


def ddp_cells() -> list[Cell]:
    """2-rank DDP: every option × layout in fp32; auto and noise in fp64 and bf16; a few pairs of options."""
    cells = _cross(("fixed", "auto", "lengths", "lengths_plan", "split", "noise", "schedule"), LAYOUTS, ("fp32",), "ddp")
    cells += _cross(("auto", "noise"), ("dict_mask",), ("fp64", "bf16"), "ddp")
    cells += [Cell("lengths_fn", "list", "fp32", "ddp"), Cell("compile", "dict_mask", "fp32", "ddp")]
    cells += [Cell(o, "dict_mask", "fp32", "ddp") for o in ("lengths+noise", "split+noise", "lengths+schedule",
                                                             "fixed+noise", "compile+lengths")]
    return cells


def fsdp_cells() -> list[Cell]:
    """2-rank FSDP2 (fully_shard): every option on tuple and dict batches, sizing by length on every layout it
    reads, and an OOM on one rank only in a finder trial (``oom1``)."""
    return _cross(("fixed", "auto", "lengths", "split", "noise"), ("tuple", "dict_mask"), ("fp32",), "fsdp") + [
        Cell(o, l, d, "fsdp") for o, l, d in (
            ("auto", "dict_labels", "fp32"), ("auto", "list", "fp32"), ("auto", "dict_mask", "bf16"),
            ("auto", "dict_mask", "fp64"), ("schedule", "dict_mask", "fp32"), ("fixed+noise", "dict_mask", "fp32"),
            ("compile", "dict_mask", "fp32"), ("lengths_fn", "list", "fp32"), ("auto+oom1", "dict_mask", "fp32"),
            ("lengths_plan", "dict_mask", "fp32"), ("split", "dict_labels", "fp32"), ("lengths", "dict_mask", "fp64"),
            ("split+noise", "dict_mask", "fp32"))]


@dataclass
class Outcome:
    """What a cell did: ``trained`` with its parameters, or ``raised`` (type, message, and whether the
    parameters and the loss function were touched before it)."""

    trained: bool
    params: list[torch.Tensor] | None = None
    error: str = ""
    message: str = ""
    untouched: bool = True
    loss_calls: int = 0
    micro_batch_sizes: tuple[int, ...] = ()
    noise_mode: str | None = None
    reference_noise_mode: str | None = None
    trace: str = ""

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["params"] = None if self.params is None else [p.double().tolist() for p in self.params]
        d["micro_batch_sizes"] = list(self.micro_batch_sizes)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Outcome:
        d = dict(d)
        d["params"] = None if d["params"] is None else [torch.tensor(p, dtype=torch.float64) for p in d["params"]]
        d["micro_batch_sizes"] = tuple(d["micro_batch_sizes"])
        return cls(**d)


class Counting:
    """The loss function, counting its calls (a refusal "before any work" made none); ``oom_at``: the
    call that raises ``torch.OutOfMemoryError`` instead (as a device that ran out there)."""

    def __init__(self, fn: Callable[..., Any], oom_at: int | None = None) -> None:
        self.fn, self.calls, self.oom_at = fn, 0, oom_at

    def __call__(self, model: nn.Module, batch: Any) -> Any:
        self.calls += 1
        if self.calls == self.oom_at:
            raise torch.OutOfMemoryError("injected: out of memory on this rank only")
        return self.fn(model, batch)


def run_cell(cell: Cell, *, wrap: Callable[[nn.Module], nn.Module] | None = None,
             rows: slice | None = None, world: int = 1) -> Outcome:
    """Run the engine for one step on ``cell`` (``wrap``: DDP or ``fully_shard``; ``rows``: this rank's
    samples); never raises: an exception is the outcome."""
    model = build(cell.dtype)
    net = model if wrap is None else wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    before = [p.detach().clone() for p in _full(model)]
    rank = torch.distributed.get_rank() if world > 1 else 0
    # "oom1": rank 1 alone runs out of memory at the 6th forward: the second finder trial (batch 2), its
    # first step's second micro-batch; the peers are in that trial's collectives until rank 1 replays it
    loss = Counting(lm_loss, oom_at=6 if "oom1" in cell.parts and rank == 1 else None)
    batch = make_batch(cell.layout, rows)
    cap = CAPACITY[cell.dtype]
    kwargs: dict[str, Any] = dict(global_batch_size=GLOBAL, amp="bf16" if cell.dtype == "bf16" else None,
                                  noise=False, config=EngineConfig(capacity=cap))
    parts = cell.parts
    if "fixed" in parts:
        kwargs.update(micro_batch_size=FIXED_MICRO, config=None)
    if "lengths" in parts:
        kwargs.update(lengths=LengthConfig(seq_dim=1))
    if "split" in parts:
        kwargs.update(lengths=LengthConfig(seq_dim=1, split=True))
    if "noise" in parts:
        kwargs.update(noise=True)
    if parts & {"schedule", "schedule_cfg"}:
        # starts at the global batch (granule 2: no rounding up), so step 1 is a plain step at it; it
        # follows the noise scale, so the meter is on and measures every micro-batch
        kwargs.update(noise=True if "schedule" in parts else NoiseConfig(dataset_size=10 * GLOBAL),
                      schedule=f"adaptive:start={GLOBAL},min={GLOBAL // 2},max={4 * GLOBAL},granule=2")
    if "compile" in parts:
        net = torch.compile(net, backend=COMPILE_BACKEND)
    out = Outcome(trained=False)
    if "schedule_cfg" in parts:
        # the mode noise=True runs under the same schedule: a NoiseConfig that only fills in another field
        # (its dataset_size) must not silently switch it
        twin = build(cell.dtype)
        ref = Engine(twin, torch.optim.SGD(twin.parameters(), lr=LR), lm_loss, **{**kwargs, "noise": True})
        out.reference_noise_mode = ref.noise_meter.config.mode
    # a fixed micro-batch is the user's own choice of memory: it runs on the real CPU, not the small device
    emulated = contextlib.nullcontext() if "fixed" in parts else emulate_capacity(cap)
    try:
        with emulated:
            if "lengths_fn" in parts:
                # a list of samples has no seq dim: its length comes from length_fn, its plan from a function
                # (batch_size, length) -> batch, as the refusal of seq_dim on such batches advises
                plan = find_batch_size_for(model, list_batch, optimizer=opt, loss_fn=lm_loss, lengths=(8, MAX_LEN),
                                           capacity=cap, amp=kwargs["amp"], max_batch_size=GLOBAL // world)
                kwargs.update(start=plan, lengths=LengthConfig(length_fn=longest_sample))
            if "lengths_plan" in parts:
                # what a user does with the finder's length-aware answer: find, then start the engine on it
                plan = find_batch_size_for(model, batch, optimizer=opt, loss_fn=lm_loss, lengths=(8, MAX_LEN),
                                           seq_dim=1, capacity=cap, amp=kwargs["amp"],
                                           max_batch_size=GLOBAL // world)
                kwargs.update(start=plan)
            engine = Engine(net, opt, loss, **kwargs)
            if "schedule_cfg" in parts:
                out.noise_mode = engine.noise_meter.config.mode
            result = engine.step(batch)
        out.trained = True
        out.micro_batch_sizes = result.micro_batch_sizes
    except Exception as exc:  # the outcome of the cell: judged by the test
        out.error, out.message, out.trace = type(exc).__name__, str(exc), traceback.format_exc()[-3000:]
        if world > 1:  # the parameters are gathered next: a rank stuck in a collective shows here first
            print(f"{cell.id}: {out.trace}", file=sys.stderr, flush=True)
    out.loss_calls = loss.calls
    after = [p.detach().clone() for p in _full(model)]
    out.untouched = all(torch.equal(a, b) for a, b in zip(before, after))
    if out.trained:
        out.params = after
    return out


def _full(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (a ``fully_shard`` one gathered from all ranks: a collective)."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]


def judge(cell: Cell, out: Outcome) -> None:
    """Assert the cell trained exactly, or refused before any work with the message it must give."""
    refusal = by_design_refusal(cell)
    if refusal is not None:
        assert not out.trained, f"{cell.id} trained; expected the refusal {refusal!r}"
        assert re.search(refusal, out.message, re.S), f"{cell.id}: {out.error}: {out.message}\n{out.trace}"
        assert out.untouched, f"{cell.id} refused after changing the parameters"
        assert out.loss_calls == 0, f"{cell.id} refused after {out.loss_calls} forward passes"
        return
    assert out.trained, f"{cell.id} failed: {out.error}: {out.message}\n{out.trace}"
    expected = reference_params(cell.layout, cell.dtype)
    start = [p.detach() for p in build(cell.dtype).parameters()]
    assert not all(torch.allclose(a, b) for a, b in zip(start, expected))  # the step moves the weights
    for got, want in zip(out.params, expected):
        torch.testing.assert_close(got.to(want.dtype), want, **tolerance(cell.dtype))
    if not cell.parts & {"fixed", "noise", "schedule", "schedule_cfg"}:
        assert len(out.micro_batch_sizes) > 1, f"{cell.id}: the emulated capacity did not split the batch"
    if "schedule_cfg" in cell.parts:
        assert out.noise_mode == out.reference_noise_mode, (
            f"{cell.id}: NoiseConfig(dataset_size=...) under the schedule runs mode {out.noise_mode!r}, "
            f"noise=True under it {out.reference_noise_mode!r}")
