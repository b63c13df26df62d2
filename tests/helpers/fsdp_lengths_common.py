"""FSDP2 sized by length: scenarios shared by tests/helpers/fsdp_lengths_worker.py and its tests.

A causal LM the project never ships (tests/helpers/heldout_lm.py: dict batches, labels -100 at
the pads, no ``attention_mask``), in float64, sharded block by block over 2 gloo ranks, each rank
with its own long-tailed lengths. The reference is one process taking one plain SGD step on both
ranks' samples at once.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import torch

import heldout_lm as hl
from scenario_main import settle
from batchpilot.core.sharding import shard_model
from batchpilot.dist import distributed as bd
from batchpilot.memory.probes import emulate_capacity
from batchpilot.train.engine import Engine, EngineConfig
from batchpilot.train.lengths import LengthConfig

PER_RANK = 16
WORLD = 2
STEPS = 5
MAX_POSITIONS = 160
LR = 0.1
VERIFY_STEP = 2


def build() -> torch.nn.Module:
    return hl.model(dim=16, layers=2, max_positions=MAX_POSITIONS).double()


def sample_lengths(step: int, rank: int) -> list[int]:
    """Long-tailed real lengths: most samples short, a few near the position table's end."""
    g = torch.Generator().manual_seed(9000 + 31 * step + rank)
    u = torch.rand(PER_RANK, generator=g)
    lens = (6 * torch.exp(2.2 * u**3)).long().clamp(2, 60)  # mostly 6-15, a tail to ~54
    if (step + rank) % 3 == 0:  # now and then one long sample on one rank
        lens[int(torch.randint(0, PER_RANK, (1,), generator=g))] = int(torch.randint(90, 150, (1,), generator=g))
    if (step, rank) == (VERIFY_STEP, 0):  # beyond every length fitted so far: a verification search
        lens[0] = MAX_POSITIONS - 2
    return lens.tolist()


def rank_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    return hl.batch(sample_lengths(step, rank), seed=100 * step + rank)


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Both ranks' samples in one batch, padded to the longer of their widths."""
    parts = [rank_batch(step, r) for r in range(WORLD)]
    width = max(p["input_ids"].shape[1] for p in parts)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return {"input_ids": torch.cat([pad(p["input_ids"], 0) for p in parts]),
            "labels": torch.cat([pad(p["labels"], -100) for p in parts])}


def reference(steps: int = STEPS) -> list[torch.Tensor]:
    net = build()
    net = hl.plain_steps(net, [global_batch(s) for s in range(steps)], lr=LR)
    return [p.detach().clone() for p in net.parameters()]


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def dump(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def run(out: Path, name: str, *, split: bool, capacity: int | str, squeeze: tuple[int, float] | None = None,
        steps: int = STEPS) -> None:
    rank = bd.rank()
    model = shard_model(build())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = Engine(model, opt, hl.loss, global_batch_size=PER_RANK * WORLD,
                    lengths=LengthConfig(seq_dim=1, split=split), config=EngineConfig(capacity=capacity))
    cap = engine.config.capacity
    rows = []
    for step in range(steps):
        device = cap if squeeze is None or step < squeeze[0] or rank == 0 else int(cap * squeeze[1])
        with emulate_capacity(device, track=(model, opt)):
            r = engine.step(rank_batch(step, rank))
        rows.append({"length": r.length, "sizes": list(r.micro_batch_sizes), "lengths": list(r.micro_batch_lengths),
                     "ooms": r.ooms, "peak": r.peak_bytes, "limit": engine.lengths.budget.limit_bytes})
    params = full_params(model)
    if rank == 0:
        torch.save(params, out / f"{name}_params.pt")
    dump(out / f"{name}_rank{rank}.json", {"steps": rows, "verifications": engine.lengths.verifications})


# -- an OOM injected on one rank at one point of one step --------------------------------------------

KINDS = ("forward", "backward", "all-gather", "reduce-scatter", "search")


class Fault:
    """Raise one ``torch.OutOfMemoryError`` on this rank: the ``nth`` event of ``kind`` from step ``step`` on.

    Events are counted from the start of ``step`` (a step with fewer moves the fault to the next),
    so every fault fires. ``forward``: after a forward of the engine's own attempt; ``backward``:
    inside its backward (a hook on the logits); ``all-gather`` / ``reduce-scatter``: when FSDP
    allocates the collective's buffer (attempts and searches); ``search``: after a forward of a
    search trial (the first fit's or a verification's).
    """

    def __init__(self, kind: str, step: int, nth: int) -> None:
        assert kind in KINDS, kind
        self.kind, self.step, self.nth = kind, step, nth
        self.now = -1  # the engine step being run
        self.searching = False
        self.count = 0
        self.fired: dict[str, Any] | None = None

    def hit(self, kind: str) -> bool:
        if self.fired is not None or kind != self.kind or self.now < self.step:
            return False
        self.count += 1
        if self.count < self.nth:
            return False
        self.fired = {"kind": kind, "step": self.now, "event": self.count}
        return True

    def raise_(self, where: str) -> None:
        raise torch.OutOfMemoryError(f"injected OOM ({where}, step {self.now}, event {self.count})")


def faulty_loss(fault: Fault | None):
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if fault is None:
            return hl.loss(model, batch)
        logits = model(batch["input_ids"])
        if fault.hit("search" if fault.searching else "forward"):
            fault.raise_("after a forward")
        if not fault.searching and fault.kind == "backward":
            def hook(grad: torch.Tensor) -> torch.Tensor:
                if fault.hit("backward"):
                    fault.raise_("inside a backward")
                return grad

            logits.register_hook(hook)
        logits = logits[:, :-1]
        labels = batch["labels"][:, 1:]
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, hl.VOCAB), labels.reshape(-1), reduction="sum")
        return total, (labels != -100).sum()

    return loss


def install_comm_faults(model: torch.nn.Module, fault: Fault) -> None:
    """Route FSDP's all-gather and reduce-scatter buffers through ``fault`` (before the engine's ledger)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class AG(DefaultAllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if fault.hit("all-gather"):
                fault.raise_("allocating an all-gather buffer")
            return super().allocate(size, dtype=dtype, device=device)

    class RS(DefaultReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if fault.hit("reduce-scatter"):
                fault.raise_("allocating a reduce-scatter buffer")
            return super().allocate(size, dtype=dtype, device=device)

    for m in model.modules():
        if hasattr(m, "set_custom_all_gather"):
            m.set_custom_all_gather(AG())
            m.set_custom_reduce_scatter(RS())


#: one OOM each, on one rank, for the suite's launch: (rank, kind, step, nth, split); 3 steps each
SUITE_FAULTS = (
    (1, "forward", 1, 2, False),  # the second micro-batch's forward on rank 1
    (0, "backward", 1, 1, True),  # inside the first backward of the step
    (1, "all-gather", 1, 3, True),  # while FSDP prepares an all-gather, mid-forward
    (0, "reduce-scatter", 2, 1, False),  # in the last micro-batch's backward, after the verification
    (1, "search", VERIFY_STEP, 2, True),  # in the verification search at a length beyond the first fit
)
FAULT_STEPS = 3


def run_suite_faults(out: Path) -> None:
    for i, (rank_at, kind, step, nth, split) in enumerate(SUITE_FAULTS):
        run_fault(out, f"fault{i}", rank_at=rank_at, kind=kind, step=step, nth=nth, split=split, capacity="3MiB",
                  steps=FAULT_STEPS)
        settle()  # each run leaves FSDP's state


def run_fault(out: Path, name: str, *, rank_at: int, kind: str, step: int, nth: int, split: bool,
              capacity: int | str, steps: int = STEPS) -> None:
    """One launch's job: ``run`` with one OOM on rank ``rank_at``; writes what fired and the outcome."""
    rank = bd.rank()
    fault = Fault(kind, step, nth) if rank == rank_at else None
    model = shard_model(build())
    if fault is not None:
        install_comm_faults(model, fault)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = Engine(model, opt, faulty_loss(fault), global_batch_size=PER_RANK * WORLD,
                    lengths=LengthConfig(seq_dim=1, split=split), config=EngineConfig(capacity=capacity))
    if fault is not None:
        search = engine.lengths._search  # the sizer's real search, marked so that the fault can tell

        def marked(batch: Any) -> Any:
            fault.searching = True
            try:
                return search(batch)
            finally:
                fault.searching = False

        engine.lengths._search = marked
    cap = engine.config.capacity
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"steps": rows, "error": None}
    try:
        for s in range(steps):
            if fault is not None:
                fault.now = s
            with emulate_capacity(cap, track=(model, opt)):
                r = engine.step(rank_batch(s, rank))
            rows.append({"length": r.length, "sizes": list(r.micro_batch_sizes), "ooms": r.ooms})
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        result["fired"] = None if fault is None else fault.fired
        result["verifications"] = engine.lengths.verifications
        dump(out / f"{name}_rank{rank}.json", result)
    params = full_params(model)
    if rank == 0:
        torch.save(params, out / f"{name}_params.pt")


# -- the finder and the planner by length, against the real 2-rank peak ------------------------------

TABLE = (24, 48, 96, 158)  # the lengths asked; the finder and the planner fit three of them (24, 48, 158)
# lengths neither fits, each checked at the per-rank batch the finder's budget gives it: the peaks
# that decide a batch, near the capacity
PEAK_LENGTHS = (40, 64, 120, 140)


def example(length: int = MAX_POSITIONS - 2, n: int = 8) -> dict[str, torch.Tensor]:
    return hl.batch([length] * n, seed=5)


def tracked_peak(batch_size: int, length: int) -> tuple[int, int]:
    """The peak of two plain steps at ``(batch_size, length)`` per rank, from a fresh optimizer (every rank).

    With the bytes of the largest counted storage freed on another thread in them: 0, since the
    tracker runs collectives on copies (gloo's worker thread would otherwise free FSDP's collective
    buffers when its work ends, before or after this thread's next allocation). The collector is
    paused as the finder pauses it in its trials.
    """
    from batchpilot.memory.probes import track_peak

    model = shard_model(build())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = hl.batch([length] * batch_size, seed=7)
    gc.collect(1)
    gc.disable()
    try:
        with track_peak("cpu", track=(model, opt)) as m:
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                total, count = hl.loss(model, data)
                (total / count).backward()
                opt.step()
    finally:
        gc.enable()
    return int(m.peak_bytes), int(m.extra["foreign_release_bytes"])


def run_find(out: Path) -> None:
    """``find_batch_size_for(..., lengths=)`` on the sharded model (no search= given), then tracked peaks."""
    from batchpilot import find_batch_size_for

    rank = bd.rank()
    model = shard_model(build())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    before = [p.to_local().clone() for p in model.parameters()]
    plan = find_batch_size_for(model, example(), optimizer=opt, loss_fn=hl.loss, lengths=TABLE, seq_dim=1,
                               capacity="3MiB", max_batch_size=64)
    dump(out / f"find_rank{rank}.json", {
        "per_length": {str(k): v for k, v in plan.per_length.items()},
        "fit": plan.length_fit.to_dict(),
        "fitted": sorted(plan.length_plans),
        "trials": {str(L): [(t.batch_size, t.outcome, t.peak_bytes) for t in p.trials]
                   for L, p in plan.length_plans.items()},
        "restored": all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())),
        "peaks": [[b, L, *tracked_peak(b, L)] for L, b in plan.budget(64).table(PEAK_LENGTHS).items()],
        "capacity": plan.capacity,
    })
