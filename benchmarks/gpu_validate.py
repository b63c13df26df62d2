"""GPU validation: does batchpilot's arithmetic hold on a real accelerator? One command, one table.

For each model (an MLP, a ResNet-50-sized bottleneck CNN and a GPT-2-small-sized
transformer, all written here) it checks:

1. planner: ``estimate_peak_memory`` against the measured ``max_memory_allocated`` and
   ``max_memory_reserved`` of two real training steps, at three batch sizes (error %); and the
   FSDP2 plan (``sharding="fsdp2"``, one rank, on a fake process group) against the same steps
   of the model under ``fully_shard`` on a real one-rank process group (NCCL on CUDA);
2. finder: ``find_batch_size`` (predict, ``--target``) under an emulated capacity
   (``set_per_process_memory_fraction`` on CUDA) against the exhaustive truth, found by
   bisection over real two-step runs under the same cap;
3. throughput: samples/s at the batch the finder found against batch 32;
4. OOM recovery: the seconds one OOM costs in the ``Engine`` (the first step of an engine whose
   first micro-batch runs out of memory, minus the first step of a fresh engine started at the
   micro-batch the first one settled on);
5. noise cost: ``Engine.step`` time with the gradient noise scale measured (``first``, the
   default, and ``every``) against off, at 4 micro-batches of the finder's batch, as paired
   ratios; and the host syncs the measurement adds per step (CUDA's sync debug mode; 0 expected);
6. speed (``benchmarks/speed.py``'s method): the throughput objective's batch against an
   interleaved sweep of samples/s over 10 sizes (small: 8) up to the largest fit (its samples/s over the
   sweep's best, its peak over the largest fit's), and the engine's balanced split of
   ``1.28 ×`` the largest fit against the largest micro-batch first (step time, peak).
7. torch.compile (``--compile``, inductor by default on CUDA, off on CPU): the compiled step's
   peak against the eager one's and against the planner (which plans the eager program), and
   ``find_batch_size_for`` on the compiled model under the same capacity, with the graphs
   dynamo compiled during the search (one at most: the warm-up's).

On CUDA (default when available) the models are full size with bf16 autocast and the
whole run takes a few minutes on one H200. ``--device cpu --small`` runs the same
pipeline at tiny sizes on CPU, where memory is exact tensor bytes (the storage tracker),
capacities are emulated by the tracker and the run takes well under a minute: that is
what the tests run.

    python benchmarks/gpu_validate.py --json gpu_validate.json
    python benchmarks/gpu_validate.py --device cpu --small
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import allocator_peak, largest_fitting, machine  # noqa: E402
from speed import geometric_sizes, interleaved_sweep  # noqa: E402

from batchpilot.app.report import format_table, write_json  # noqa: E402
from batchpilot.core.compiled import CompileCounter, mark_batch_dynamic  # noqa: E402
from batchpilot.train.engine import Engine, EngineConfig  # noqa: E402
from batchpilot.find.finder import find_batch_size  # noqa: E402
from batchpilot.find.front import find_batch_size_for  # noqa: E402
from batchpilot.plan.gpus import CudaAccounting, gpu_spec, known_gpus  # noqa: E402
from batchpilot.memory.probes import emulate_capacity, track_peak  # noqa: E402
from batchpilot.memory.units import format_bytes, parse_bytes  # noqa: E402
from batchpilot.app.models import MLP, ResNet  # noqa: E402
from batchpilot.train.noise import NoiseConfig  # noqa: E402
from batchpilot.memory.oom import attempt, free_memory  # noqa: E402
from batchpilot.plan.planner import default_step, estimate_peak_memory  # noqa: E402
from batchpilot.core.sharding import shard_model  # noqa: E402
from batchpilot.find.snapshot import StateSnapshot  # noqa: E402
from batchpilot.policy.speed import choose_split  # noqa: E402
from batchpilot.find.timing import step_clock  # noqa: E402

COLUMNS = ("model", "check", "setting", "batchpilot", "measured", "error / ratio")
MODELS = ("mlp", "resnet50", "gpt2")


# ---------------------------------------------------------------------------
# models written here, sized by arguments


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; the defaults are GPT-2 small (124M params, tied embeddings)."""

    def __init__(self, vocab: int = 50257, seq_len: int = 1024, layers: int = 12, dim: int = 768,
                 heads: int = 12) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.Sequential(*(GPTBlock(dim, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.lm_head(self.ln(self.blocks(self.wte(idx) + self.wpe(pos))))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def class_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets)


@dataclass
class Case:
    """One model to validate: how to build it, make a batch of ``b``, and score it."""

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    plan_sizes: tuple[int, int, int]


def _images(size: int, classes: int) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    return lambda b, dev: (torch.randn(b, 3, size, size, device=dev), torch.randint(0, classes, (b,), device=dev))


def _vectors(features: int, classes: int) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    return lambda b, dev: (torch.randn(b, features, device=dev), torch.randint(0, classes, (b,), device=dev))


def _tokens(vocab: int, seq: int) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    return lambda b, dev: (torch.randint(0, vocab, (b, seq), device=dev), torch.randint(0, vocab, (b, seq), device=dev))


def cases(small: bool) -> dict[str, Case]:
    """Full sizes for a GPU, or tiny ones (``small``) that run in seconds on a CPU."""
    if small:
        return {
            "mlp": Case("mlp", lambda: MLP(64, 64, 8, 10), _vectors(64, 10), class_loss, (8, 32, 128)),
            "resnet50": Case("resnet50", lambda: ResNet((1, 1), (4, 8), 10, imagenet_stem=False),
                             _images(16, 10), class_loss, (2, 8, 16)),
            "gpt2": Case("gpt2", lambda: GPT(vocab=128, seq_len=16, layers=2, dim=32, heads=2), _tokens(128, 16),
                         lm_loss, (2, 8, 16)),
        }
    return {
        "mlp": Case("mlp", lambda: MLP(3072, 2048, 4, 1000), _vectors(3072, 1000), class_loss, (256, 1024, 4096)),
        "resnet50": Case("resnet50", lambda: ResNet(), _images(224, 1000), class_loss, (16, 64, 128)),
        "gpt2": Case("gpt2", lambda: GPT(seq_len=512), _tokens(50257, 512), lm_loss, (2, 8, 16)),
    }


# ---------------------------------------------------------------------------
# measurement helpers


class Runner:
    """A model, its Adam optimizer and the training step every check runs."""

    def __init__(self, case: Case, device: torch.device, amp: str | None) -> None:
        torch.manual_seed(0)
        self.case, self.device, self.amp = case, device, amp
        self.model = case.build().to(device)
        self.optimizer = self.new_optimizer()

    def new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=1e-4)

    def step(self, b: int) -> None:
        """forward / backward / Adam on a fresh batch of ``b``; the planner's ``default_step``."""
        default_step(self.model, self.optimizer, self.case.make_batch(b, self.device), loss_fn=self.engine_loss,
                     amp=self.amp)

    def engine_loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.case.loss(model(batch[0]), batch[1])

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.optimizer = self.new_optimizer()
        free_memory(self.device)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def measure_peak(r: Runner, b: int, steps: int = 2) -> tuple[int, int]:
    """``(max allocated, max reserved)`` bytes of ``steps`` real steps from a fresh optimizer."""
    r.release()
    batch = r.case.make_batch(b, r.device)
    if r.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(r.device)
        for _ in range(steps):
            default_step(r.model, r.optimizer, batch, loss_fn=r.engine_loss, amp=r.amp)
        r.sync()
        out = (torch.cuda.max_memory_allocated(r.device), torch.cuda.max_memory_reserved(r.device))
    else:  # exact tensor bytes; a CPU has no reserve beyond them
        with track_peak("cpu", track=(r.model, r.optimizer, batch)) as m:
            for _ in range(steps):
                default_step(r.model, r.optimizer, batch, loss_fn=r.engine_loss, amp=r.amp)
        out = (m.peak_bytes, m.peak_bytes)
    del batch
    r.release()
    return out


def cuda_accounting(device: torch.device) -> Any:
    """The planner's accounting for this card: a known GPU by name (closest memory), else the default."""
    name = torch.cuda.get_device_name(device).upper()
    total = torch.cuda.get_device_properties(device).total_memory
    matches = [g for g in known_gpus() if g.split("-")[0].upper() in name.replace(" ", "")]
    if not matches:
        return CudaAccounting(), None
    best = min(matches, key=lambda g: abs(gpu_spec(g).capacity - total))
    return CudaAccounting.for_gpu(best), best


def check_planner(r: Runner, rows: list, doc: dict) -> None:
    plan_device = "cuda" if r.device.type == "cuda" else "cpu"
    accounting, gpu = cuda_accounting(r.device) if plan_device == "cuda" else (None, None)
    doc["planner"] = {"gpu_profile": gpu, "sizes": []}
    sample = r.case.make_batch(2, torch.device("cpu"))
    for b in r.case.plan_sizes:
        est = estimate_peak_memory(r.model, sample, b, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4),
                                   loss_fn=r.engine_loss, steps=2, amp=r.amp, device=plan_device, accounting=accounting)
        alloc, reserved = measure_peak(r, b)
        entry = {"batch_size": b, "predicted_allocated": est.allocated_bytes, "measured_allocated": alloc,
                 "predicted_reserved": est.reserved_bytes, "measured_reserved": reserved,
                 "error_allocated_pct": 100 * (est.allocated_bytes - alloc) / alloc,
                 "error_reserved_pct": 100 * (est.reserved_bytes - reserved) / reserved,
                 "plan_seconds": est.seconds}
        doc["planner"]["sizes"].append(entry)
        rows.append((r.case.name, "plan allocated", f"b={b}", format_bytes(est.allocated_bytes), format_bytes(alloc),
                     f"{entry['error_allocated_pct']:+.1f}%"))
        if r.device.type == "cuda":
            rows.append((r.case.name, "plan reserved", f"b={b}", format_bytes(est.reserved_bytes),
                         format_bytes(reserved), f"{entry['error_reserved_pct']:+.1f}%"))


def check_fsdp_planner(r: Runner, rows: list, doc: dict) -> None:
    """The FSDP2 plan of one rank against a real ``fully_shard`` step on a one-rank process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    plan_device = "cuda" if r.device.type == "cuda" else "cpu"
    accounting, _ = cuda_accounting(r.device) if plan_device == "cuda" else (None, None)
    b = r.case.plan_sizes[1]
    # the fake process group first: the planner refuses to run next to a real one
    est = estimate_peak_memory(r.model, r.case.make_batch(2, torch.device("cpu")), b,
                               optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4), loss_fn=r.engine_loss, steps=2,
                               amp=r.amp, device=plan_device, accounting=accounting, world_size=1, sharding="fsdp2")
    dist.init_process_group("nccl" if r.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        r.release()
        r.model.to("cpu")  # only the sharded copy on the device, as in the plan
        free_memory(r.device)
        model = shard_model(copy.deepcopy(r.model).to(r.device), mesh=init_device_mesh(r.device.type, (1,)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        batch = r.case.make_batch(b, r.device)
        if r.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(r.device)
            for _ in range(2):
                default_step(model, opt, batch, loss_fn=r.engine_loss, amp=r.amp)
            r.sync()
            measured = torch.cuda.max_memory_allocated(r.device)
        else:
            with track_peak("cpu", track=(model, opt, batch)) as m:
                for _ in range(2):
                    default_step(model, opt, batch, loss_fn=r.engine_loss, amp=r.amp)
            measured = m.peak_bytes
        del model, opt, batch
    finally:
        dist.destroy_process_group()
        r.model.to(r.device)
    r.release()
    predicted = est.allocated_bytes
    doc["fsdp_planner"] = {"batch_size": b, "predicted_allocated": predicted, "measured_allocated": measured,
                           "error_allocated_pct": 100 * (predicted - measured) / measured}
    rows.append((r.case.name, "plan fsdp", f"b={b}, 1 rank", format_bytes(predicted), format_bytes(measured),
                 f"{doc['fsdp_planner']['error_allocated_pct']:+.1f}%"))


def fits(r: Runner, b: int, capacity: int, snapshot: Any) -> bool:
    """Do two real steps at ``b`` run under the capacity? State is put back afterwards."""
    def two_steps() -> None:
        for _ in range(2):
            r.step(b)

    with emulate_capacity(capacity, r.device, track=(r.model, r.optimizer)):
        ok = attempt(two_steps, device=r.device, on_oom=snapshot.restore).ok
    snapshot.restore()
    free_memory(r.device)
    return ok


def true_max(r: Runner, capacity: int, start: int) -> tuple[int, int]:
    """Largest batch that fits, by bisection from ``start``; returns ``(batch, probes)``.

    Every probe runs two real steps under the cap. The start (the finder's answer) only
    saves probes: the result is a batch that fits next to one that does not, whatever the
    start, and a start at the boundary costs two probes.
    """
    snapshot = StateSnapshot([r.model, r.optimizer])
    probes = 0

    def probe(b: int) -> bool:
        nonlocal probes
        probes += 1
        return fits(r, b, capacity, snapshot)

    return largest_fitting(probe, start, check_next=True), probes


def check_finder(r: Runner, capacity: int, target: float, rows: list, doc: dict) -> int:
    r.release()
    plan = find_batch_size(r.step, device=r.device, target=target, capacity=capacity, strategy="predict",
                           restore=(r.model, r.optimizer))
    # the answer trains in the process that asked: ten steps at it, in the allocator state the search left
    trained = 0
    with emulate_capacity(capacity, r.device, track=(r.model, r.optimizer)):
        for _ in range(10):
            if attempt(r.step, plan.batch_size, device=r.device).oom:
                break
            trained += 1
    r.release()
    t0 = time.perf_counter()
    truth, probes = true_max(r, capacity, plan.batch_size)
    truth_seconds = time.perf_counter() - t0
    r.release()
    doc["finder"] = {"capacity": capacity, "target": target, "batch_size": plan.batch_size,
                     "num_trials": plan.num_trials, "num_ooms": plan.num_ooms, "seconds": plan.seconds,
                     "trials": [t.batch_size for t in plan.trials], "true_max": truth, "truth_probes": probes,
                     "truth_seconds": truth_seconds, "found_over_true": plan.batch_size / truth if truth else None,
                     "verified": plan.verified, "trained_after": trained}
    rows.append((r.case.name, "finder vs truth", f"cap {format_bytes(capacity)}, target {target}",
                 f"{plan.batch_size} ({plan.num_trials} trials, {plan.num_ooms} OOM, {plan.seconds:.1f} s, "
                 f"trains after: {trained}/10)",
                 f"{truth} ({probes} probes)", f"{plan.batch_size / truth:.2f}" if truth else "-"))
    return plan.batch_size


def samples_per_second(r: Runner, b: int, steps: int) -> float:
    r.release()
    r.step(b)  # warm-up: kernels, allocator, optimizer state
    r.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        r.step(b)
    r.sync()
    seconds = time.perf_counter() - t0
    r.release()
    return b * steps / seconds


def check_throughput(r: Runner, found: int, steps: int, rows: list, doc: dict) -> None:
    base = 32
    # alternate the two sizes and keep each one's best: other load on the machine only slows a run down
    fast = slow = 0.0
    for _ in range(2):
        fast = max(fast, samples_per_second(r, found, steps))
        slow = max(slow, samples_per_second(r, base, steps))
    doc["throughput"] = {"found": found, "base": base, "found_samples_per_s": fast, "base_samples_per_s": slow,
                         "ratio": fast / slow}
    rows.append((r.case.name, "samples/s", f"b={found} vs b={base}", f"{fast:,.0f}", f"{slow:,.0f}",
                 f"{fast / slow:.2f}x"))


def check_oom_recovery(r: Runner, capacity: int, truth_like: int, repeats: int, rows: list, doc: dict) -> None:
    """Seconds one OOM costs the Engine: the first step of an engine whose first micro-batch (the
    whole global batch) runs out of memory, minus the first step of a fresh engine that starts
    at the micro-batch the first one settled on (same one-time set-up, no OOM)."""
    global_batch = max(2, int(truth_like * 1.5))  # the whole batch does not fit, half of it does
    snapshot = StateSnapshot([r.model, r.optimizer])

    def first_step(start: int, batch: Any) -> tuple[float, Any]:
        engine = Engine(r.model, r.optimizer, r.engine_loss, global_batch_size=global_batch,
                        micro_batch_size="auto", start=start, device=r.device, amp=r.amp,
                        config=EngineConfig(adapt=False))
        r.sync()
        t0 = time.perf_counter()
        res = engine.step(batch)
        r.sync()
        seconds = time.perf_counter() - t0
        snapshot.restore()
        return seconds, res

    records = []
    for i in range(repeats + 1):  # the first round only warms up: kernels for both micro-batch shapes
        r.release()
        batch = r.case.make_batch(global_batch, r.device)
        with emulate_capacity(capacity, r.device, track=(r.model, r.optimizer, batch)):
            t_oom, res_oom = first_step(global_batch, batch)
            t_clean, res_clean = first_step(res_oom.micro_batch_size, batch)
        del batch
        records.append({"oom_step_s": t_oom, "clean_step_s": t_clean, "ooms": res_oom.ooms,
                        "micro_batch_size": res_oom.micro_batch_size, "accum_steps": res_oom.accum_steps,
                        "clean_ooms": res_clean.ooms, "warm_up": i == 0})
    r.release()
    valid = [rec for rec in records if rec["ooms"] and not rec["clean_ooms"] and not rec["warm_up"]]
    # fastest of each kind: load from other processes only ever adds time
    oom_step = min((rec["oom_step_s"] for rec in valid), default=None)
    clean_step = min((rec["clean_step_s"] for rec in valid), default=None)
    cost = None if oom_step is None else (oom_step - clean_step) / valid[0]["ooms"]
    doc["oom_recovery"] = {"global_batch": global_batch, "repeats": records, "cost_s": cost,
                           "oom_step_s": oom_step, "clean_step_s": clean_step}
    micro = records[0]["micro_batch_size"]
    setting = f"global {global_batch}: micro {global_batch} -> {micro}"
    if cost is None:
        rows.append((r.case.name, "OOM recovery", setting, "no clean OOM to time", "-", "-"))
        return
    rows.append((r.case.name, "OOM recovery", setting, f"{cost:+.3f} s per OOM", f"clean step {clean_step:.3f} s",
                 f"{cost / clean_step:.2f} steps"))


def check_compiled(r: Runner, backend: str, capacity: int, target: float, rows: list, doc: dict) -> None:
    """The compiled program against the eager one: peak, the eager plan's error on it, the found batch.

    Peaks: ``max_memory_allocated`` / ``_reserved`` on CUDA; on CPU the allocator's own figure
    (``torch.profiler``) for both programs, since a storage tracker would run the compiled
    model eagerly. The finder's trials run the compiled step where no tracker counts them (CUDA);
    under the CPU's emulated capacity they run eagerly (``compiled_trials`` false).
    """
    b = r.case.plan_sizes[1]
    r.release()
    compiled = torch.compile(r.model, backend=backend)
    batch = mark_batch_dynamic(r.case.make_batch(b, r.device))

    def steps(model: nn.Module) -> None:
        for _ in range(2):
            default_step(model, r.optimizer, batch, loss_fn=r.engine_loss, amp=r.amp)
        r.sync()

    counter = CompileCounter()
    t0 = time.perf_counter()
    default_step(compiled, r.optimizer, batch, loss_fn=r.engine_loss, amp=r.amp)  # compiles
    r.sync()
    compile_s, graphs = time.perf_counter() - t0, counter.count
    peaks = {}
    for name, model in (("eager", r.model), ("compiled", compiled)):
        r.release()
        if r.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(r.device)
            steps(model)
            peaks[name] = (torch.cuda.max_memory_allocated(r.device), torch.cuda.max_memory_reserved(r.device))
        else:  # what was allocated before (weights, the batch; no optimizer state yet) plus the steps' peak
            state = sum(t.untyped_storage().nbytes() for t in (*r.model.parameters(), *r.model.buffers(), *batch))
            peak = state + allocator_peak(lambda m=model: steps(m))
            peaks[name] = (peak, peak)
    del batch
    r.release()
    plan_device = "cuda" if r.device.type == "cuda" else "cpu"
    accounting = cuda_accounting(r.device)[0] if plan_device == "cuda" else None
    est = estimate_peak_memory(compiled, r.case.make_batch(2, torch.device("cpu")), b,
                               optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4), loss_fn=r.engine_loss, steps=2,
                               amp=r.amp, device=plan_device, accounting=accounting)
    (c_alloc, c_res), (e_alloc, e_res) = peaks["compiled"], peaks["eager"]
    pool = r.case.make_batch(64, r.device)
    found = {}
    for name, model in (("eager", r.model), ("compiled", compiled)):  # the same search, the same example batch
        found[name] = find_batch_size_for(model, pool, optimizer=r.optimizer, loss_fn=r.engine_loss, amp=r.amp,
                                          capacity=capacity, target=target)
        r.release()
    plan, eager_found = found["compiled"], found["eager"].batch_size
    del pool
    doc["compiled"] = {
        "backend": backend, "batch_size": b, "compile_seconds": compile_s, "warmup_graphs": graphs,
        "compiled_allocated": c_alloc, "compiled_reserved": c_res, "eager_allocated": e_alloc, "eager_reserved": e_res,
        "plan_allocated": est.allocated_bytes, "plan_error_pct": 100 * (est.allocated_bytes - c_alloc) / c_alloc,
        "found": plan.batch_size, "eager_found": eager_found, "trials": [t.batch_size for t in plan.trials],
        "search_graphs": plan.compilations, "compiled_trials": plan.compiled_trials, "search_seconds": plan.seconds,
    }
    rows.append((r.case.name, "compiled peak", f"b={b}, {backend} ({compile_s:.0f} s, {graphs} graphs)",
                 format_bytes(c_alloc), f"eager {format_bytes(e_alloc)}", f"{c_alloc / e_alloc:.2f}"))
    rows.append((r.case.name, "plan vs compiled", f"b={b}", format_bytes(est.allocated_bytes), format_bytes(c_alloc),
                 f"{doc['compiled']['plan_error_pct']:+.1f}%"))
    rows.append((r.case.name, "compiled finder", f"cap {format_bytes(capacity)}, target {target}",
                 f"{plan.batch_size} ({plan.num_trials} trials, {plan.compilations} graphs, "
                 f"{'compiled' if plan.compiled_trials else 'eager'} trials)",
                 f"eager {eager_found}", f"{plan.batch_size / eager_found:.2f}" if eager_found else "-"))
    del compiled
    torch._dynamo.reset()
    free_memory(r.device)


def check_speed(r: Runner, capacity: int, target: float, tolerance: float, rounds: int, count: int, rows: list,
                doc: dict) -> None:
    """The throughput objective against an interleaved sweep; the balanced split against the largest first."""
    r.release()
    plan = find_batch_size(r.step, device=r.device, target=target, capacity=capacity, objective="throughput",
                           speed_tolerance=tolerance, restore=(r.model, r.optimizer))
    r.release()
    largest, chosen = plan.largest_fitting, plan.batch_size
    sizes = sorted(set(geometric_sizes(largest, count)) | {chosen})
    snapshot = StateSnapshot([r.model, r.optimizer])
    sweep = interleaved_sweep(r.step, sizes, rounds=rounds, steps=2, sync=r.sync, clock=step_clock(r.device),
                              restore=snapshot.restore)
    snapshot.close()
    r.release()
    peaks = {b: measure_peak(r, b)[1] for b in (chosen, largest)}  # reserved on CUDA, tensor bytes on CPU
    best = max(sweep, key=lambda b: sweep[b]["samples_per_second"])
    top = sweep[best]["samples_per_second"]
    ratio = sweep[chosen]["samples_per_second"] / top
    doc["speed"] = {"tolerance": tolerance, "largest_fitting": largest, "batch_size": chosen, "reason": plan.reason,
                    "trials": [t.to_dict() for t in plan.trials], "sizes": sizes, "sweep": sweep, "best": best,
                    "choice_over_best": ratio, "peaks": peaks, "peak_over_largest": peaks[chosen] / peaks[largest]}
    rows.append((r.case.name, "throughput choice", f"tol {tolerance}, {len(sizes)} sizes x {rounds}",
                 f"b={chosen} ({plan.num_trials} trials; peak {peaks[chosen] / peaks[largest]:.2f} of b={largest})",
                 f"best b={best}: {top:,.0f}/s", f"{ratio:.3f}"))
    # the split: a batch the largest micro-batch does not divide
    total = max(2, round(1.28 * largest))
    split = choose_split(total, largest)
    batch = r.case.make_batch(total, r.device)
    weights = StateSnapshot([r.model])
    timing, peak = {}, {}
    for label, micro in (("first", min(largest, total)), ("balanced", split.micro_batch_size)):
        r.release()
        engine = Engine(r.model, r.optimizer, r.engine_loss, global_batch_size=total, micro_batch_size=micro,
                        device=r.device, amp=r.amp)
        engine.step(batch)  # warm-up
        if r.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(r.device)
            engine.step(batch)
            r.sync()
            peak[label] = torch.cuda.max_memory_reserved(r.device)
        else:
            with track_peak("cpu", track=(r.model, r.optimizer, batch)) as m:
                engine.step(batch)
            peak[label] = m.peak_bytes
        read = step_clock(r.device)  # the wall clock on CUDA, the thread's CPU time on a one-thread CPU
        times = []
        for _ in range(max(3, rounds)):
            r.sync()
            t0 = read()
            engine.step(batch)
            r.sync()
            times.append(read() - t0)
        timing[label] = min(times)
        weights.restore()  # the other split starts from the same weights
    del batch
    weights.close()
    r.release()
    k = split.accum_steps
    doc["split"] = {"total": total, "largest": largest, "balanced_micro": split.micro_batch_size, "accum": k,
                    "seconds": timing, "peak": peak, "time_ratio": timing["balanced"] / timing["first"],
                    "peak_ratio": peak["balanced"] / peak["first"]}
    rows.append((r.case.name, "balanced split", f"{total} at most {largest} per micro-batch",
                 f"{k} x ~{split.micro_batch_size}: {1e3 * timing['balanced']:.1f} ms, "
                 f"{format_bytes(peak['balanced'])}",
                 f"{largest} + {total - largest}: {1e3 * timing['first']:.1f} ms, {format_bytes(peak['first'])}",
                 f"{timing['balanced'] / timing['first']:.3f}x"))


def count_syncs(r: Runner, fn: Callable[[], Any]) -> int | None:
    """Host-device synchronisations ``fn`` makes (CUDA's sync debug mode warns on each); ``None`` off CUDA."""
    if r.device.type != "cuda":
        return None
    import warnings

    r.sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_noise_cost(r: Runner, found: int, steps: int, rows: list, doc: dict) -> None:
    """Step time with the noise scale off / first / every at 4 micro-batches of ``found``; syncs it adds."""
    micro = max(1, min(found, 4096))
    global_batch = 4 * micro
    r.release()
    frozen = torch.optim.SGD(r.model.parameters(), lr=0.0)  # timing only: no optimizer state, weights kept
    engines = {label: Engine(r.model, frozen, r.engine_loss, global_batch_size=global_batch, micro_batch_size=micro,
                             device=r.device, amp=r.amp, noise=noise)
               for label, noise in (("off", False), ("first", NoiseConfig(mode="first")),
                                    ("every", NoiseConfig(mode="every")))}
    batch = r.case.make_batch(global_batch, r.device)
    times: dict[str, list[float]] = {k: [] for k in engines}
    order = list(engines)
    for i in range(steps + 2):  # two warm-up rounds
        for label in order[i % 3:] + order[:i % 3]:
            r.sync()
            t0 = time.perf_counter()
            engines[label].step(batch)
            r.sync()
            if i >= 2:
                times[label].append(time.perf_counter() - t0)
    syncs = {label: count_syncs(r, lambda e=e: e.step(batch)) for label, e in engines.items()}
    del batch
    r.release()

    def ratio(label: str) -> float:
        return statistics.median(a / b for a, b in zip(times[label], times["off"]))

    doc["noise_cost"] = {"global": global_batch, "micro": micro, "step_s": {k: statistics.median(v) for k, v in times.items()},
                         "first_ratio": ratio("first"), "every_ratio": ratio("every"), "syncs_per_step": syncs}
    extra = "-" if syncs["off"] is None else f"syncs {syncs['first'] - syncs['off']:+d} / {syncs['every'] - syncs['off']:+d}"
    rows.append((r.case.name, "noise cost", f"{global_batch} = {micro} x 4", f"first {ratio('first'):.3f}x",
                 f"every {ratio('every'):.3f}x", extra))


# ---------------------------------------------------------------------------


def check_lengths(device: torch.device, small: bool, target: float, rows: list, doc: dict) -> None:
    """The per-length finder (``lengths=``) on a causal LM with unfused attention: its answer at a
    length it did not search against a real search there, and the fit's ``L²`` term.

    On CPU the tracker's peaks are exactly quadratic in the length, so the answers agree exactly;
    on a GPU the caching allocator rounds every block, and this measures what that costs.
    """
    from batchpilot.app.models import TinyGPT, lm_loss as token_loss, padded_lm_batch

    torch.manual_seed(0)
    if small:
        dims, lengths, held, capacity = dict(vocab=64, dim=16, heads=2, layers=1, max_len=64), (16, 32, 64), 48, "1MiB"
    else:
        dims, lengths, held, capacity = (dict(vocab=8192, dim=256, heads=8, layers=4, max_len=2048),
                                         (512, 1024, 2048), 1536, "4GiB")
    model = TinyGPT(**dims).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def at(b: int, L: int) -> dict[str, torch.Tensor]:
        return padded_lm_batch([L] * b, vocab=dims["vocab"])

    plan = find_batch_size_for(model, at, optimizer=opt, loss_fn=token_loss, capacity=capacity, target=target,
                               lengths=(*lengths, held), timed_steps=0)
    real = find_batch_size_for(model, lambda b: at(b, held), optimizer=opt, loss_fn=token_loss, capacity=capacity,
                               target=target, timed_steps=0)
    answer = plan.per_length[held]
    doc["lengths"] = {"capacity": parse_bytes(capacity), "per_length": plan.per_length, "held_out": held,
                      "model_answer": answer, "real_answer": real.batch_size,
                      "fit": plan.length_fit.to_dict(), "trials": sum(p.num_trials for p in plan.length_plans.values()),
                      "over_real": answer / real.batch_size if real.batch_size else None}
    rows.append(("tinygpt", "lengths", f"cap {capacity}, searched {', '.join(map(str, lengths))}",
                 f"{answer} at L={held} (model)", f"{real.batch_size} (search)",
                 f"{answer / real.batch_size:.2f}" if real.batch_size else "-"))


def guarded(rows: list, doc: dict, model: str, check: str, fn: Callable[[], Any]) -> Any:
    """Run one check; on an error add a row saying so (traceback to stderr) and return ``None``."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  reported in the table, never hidden
        traceback.print_exc()
        free_memory()
        first = str(exc).splitlines()[0][:60] if str(exc) else ""
        doc.setdefault("errors", {})[check] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        rows.append((model, check, "-", f"error: {type(exc).__name__}: {first}", "-", "-"))
        return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu --small")
    if device.type == "cpu":
        # One thread: with two on a shared 2-core machine, every parallel region waits for a
        # thread another process has descheduled (seen here: 5 ms steps taking 760 ms).
        torch.set_num_threads(1)
    amp = None if args.amp == "none" else args.amp
    capacity = parse_bytes(args.capacity)
    table = cases(args.small)
    rows: list[tuple] = []
    doc: dict[str, Any] = {
        "benchmark": "gpu_validate", "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/gpu_validate.py " + " ".join(sys.argv[1:]),
        "machine": machine(), "device": str(device), "small": args.small, "amp": amp, "capacity": capacity,
        "models": {},
    }
    t_start = time.perf_counter()
    for name in args.models:
        t0 = time.perf_counter()
        r = Runner(table[name], device, amp)
        mdoc: dict[str, Any] = {"params": r.params}
        doc["models"][name] = mdoc
        print(f"[{name}] {r.params / 1e6:.1f}M params", flush=True)
        # A check that fails leaves an error row and the next check still runs: one run on a lent
        # GPU must bring back everything that worked.
        guarded(rows, mdoc, name, "plan", lambda: check_planner(r, rows, mdoc))
        guarded(rows, mdoc, name, "plan fsdp", lambda: check_fsdp_planner(r, rows, mdoc))
        found = guarded(rows, mdoc, name, "finder vs truth", lambda: check_finder(r, capacity, args.target, rows, mdoc))
        if found is not None:
            guarded(rows, mdoc, name, "samples/s", lambda: check_throughput(r, found, args.steps, rows, mdoc))
            guarded(rows, mdoc, name, "OOM recovery", lambda: check_oom_recovery(
                r, capacity, mdoc["finder"]["true_max"], args.repeats, rows, mdoc))
            guarded(rows, mdoc, name, "noise cost", lambda: check_noise_cost(r, found, args.steps, rows, mdoc))
        guarded(rows, mdoc, name, "speed", lambda: check_speed(r, capacity, args.target, args.speed_tolerance,
                                                              args.sweep_rounds, 8 if args.small else 10, rows, mdoc))
        if args.compile != "none":
            guarded(rows, mdoc, name, "compiled", lambda: check_compiled(
                r, args.compile, capacity, args.target, rows, mdoc))
        mdoc["seconds"] = time.perf_counter() - t0
        # each model's rows as soon as they exist: a run cut short still leaves them in the log
        print(format_table(COLUMNS, [row for row in rows if row[0] == name]), flush=True)
        print(f"[{name}] done in {mdoc['seconds']:.0f} s", flush=True)
        del r
        gc.collect()
        free_memory(device)
    ldoc = doc["models"]["tinygpt"] = {}
    guarded(rows, ldoc, "tinygpt", "lengths", lambda: check_lengths(device, args.small, args.target, rows, ldoc))
    print(format_table(COLUMNS, [row for row in rows if row[0] == "tinygpt"]), flush=True)
    doc["rows"] = [dict(zip(COLUMNS, row)) for row in rows]
    doc["seconds"] = time.perf_counter() - t_start
    return doc


def format_result(doc: dict[str, Any]) -> str:
    head = (f"gpu_validate on {doc['machine'].get('gpu', 'CPU')} ({doc['device']}), amp {doc['amp']}, "
            f"capacity {format_bytes(doc['capacity'])}, torch {doc['machine']['torch']}, {doc['date']}")
    body = format_table(COLUMNS, [tuple(r[c] for c in COLUMNS) for r in doc["rows"]])
    return f"{head}\n{body}\ntotal {doc['seconds']:.0f} s"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--small", action="store_true", help="tiny models (implied on CPU unless --full)")
    p.add_argument("--full", action="store_true", help="full-size models even on CPU (slow)")
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS), help=f"from {','.join(MODELS)}")
    p.add_argument("--capacity", default=None, help="emulated capacity for the finder (default 16GiB; small: 4MiB)")
    p.add_argument("--target", type=float, default=1.0, help="finder target; 1.0 = the largest batch that fits")
    p.add_argument("--amp", choices=("bf16", "fp16", "none"), default=None, help="default bf16 on CUDA, none on CPU")
    p.add_argument("--steps", type=int, default=None, help="timed steps per throughput point (default 10; small 3)")
    p.add_argument("--repeats", type=int, default=None, help="OOM-recovery repetitions (default 3; small 1)")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="torch.compile backend of the compiled checks, or none (default inductor on CUDA, none on CPU)")
    p.add_argument("--speed-tolerance", type=float, default=0.05, help="the throughput objective's tolerance")
    p.add_argument("--sweep-rounds", type=int, default=None, help="interleaved sweep rounds (default 5; small 1)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    cpu = torch.device(args.device).type == "cpu"
    args.small = args.small or (cpu and not args.full)
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    args.capacity = args.capacity or ("4MiB" if args.small else "16GiB")
    args.amp = args.amp or ("none" if cpu else "bf16")
    args.compile = args.compile or ("none" if cpu else "inductor")
    args.steps = args.steps or (3 if args.small else 10)
    args.repeats = args.repeats or (1 if args.small else 3)
    args.sweep_rounds = args.sweep_rounds or (1 if args.small else 5)
    if not math.isfinite(args.target) or not 0 < args.target <= 1:
        p.error("--target must be in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    print()
    print(format_result(doc))
    if args.json is not None:
        write_json(doc, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
