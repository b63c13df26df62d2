"""The planner's answers (:class:`MemoryEstimate`, :class:`PlanResult`, :class:`ClusterPlanResult`) and its one error."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ..memory.units import format_bytes
from ..policy.shares import RankShare, step_seconds

__all__ = ["PlanningError", "MemoryEstimate", "PlanResult", "RankPlan", "ClusterPlanResult"]


class PlanningError(RuntimeError):
    """The step cannot be planned on fake tensors; measure it on the device instead."""


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Peak memory of a step at one batch size, with its make-up at the peak.

    ``parameters + buffers + inputs + gradients + optimizer_state +
    activations + unsharded_parameters + communication == peak_bytes`` (exact
    tensor bytes, as the CPU tracker counts them). Sharded (``sharding="fsdp2"``
    over ``world_size`` ranks), the figures are one rank's: ``parameters``,
    ``gradients`` and ``optimizer_state`` its shards (and the unsharded
    gradients of a backward), ``unsharded_parameters`` the all-gathered
    parameters alive at the peak, ``communication`` the all-gather and
    reduce-scatter buffers; both are 0 unsharded. On CUDA, ``allocated_bytes`` / ``reserved_bytes`` predict
    ``max_memory_allocated`` / ``max_memory_reserved`` (allocator rounding,
    cached segments and cuBLAS workspaces included) and ``context_bytes`` is
    the CUDA context outside the allocator; on CPU both equal ``peak_bytes``
    and the context is 0.
    """

    batch_size: int
    device: str
    peak_bytes: int
    parameters: int
    buffers: int
    inputs: int
    gradients: int
    optimizer_state: int
    activations: int
    allocated_bytes: int
    reserved_bytes: int
    context_bytes: int
    seconds: float
    unsharded_parameters: int = 0
    communication: int = 0
    world_size: int = 1
    sharding: str | None = None

    @property
    def required_bytes(self) -> int:
        """Device memory the step needs: the reserved peak plus the context.

        ``cudaMalloc`` fails on the memory the caching allocator has reserved (cached blocks
        included) plus what lives outside it, not on the bytes tensors hold: a plan that
        fits its allocated peak can still run out.
        """
        return self.reserved_bytes + self.context_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "required_bytes": self.required_bytes}


@dataclass(frozen=True, kw_only=True, repr=False)
class PlanResult:
    """The largest batch whose estimate fits ``target × capacity``.

    ``batch_size`` is 0 when even a batch of one does not fit. ``estimate``
    is the estimate at ``batch_size`` and ``next_estimate`` the one at
    ``batch_size + 1`` (``None`` past ``max_batch_size``); ``evaluations``
    maps every batch size tried to its ``required_bytes``. :attr:`stopped_by` says whether
    memory or the search cap ``max_batch_size`` ended the search.
    """

    batch_size: int
    capacity: int
    target: float
    limit: int
    device: str
    gpu: str | None
    estimate: MemoryEstimate | None
    next_estimate: MemoryEstimate | None
    evaluations: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    world_size: int = 1
    sharding: str | None = None

    @property
    def stopped_by(self) -> str:
        """``"memory"``: ``batch_size + 1`` is over the limit (or not even 1 fits); ``"max_batch_size"``:
        ``batch_size`` is the search cap, and memory may hold more."""
        return "max_batch_size" if self.batch_size > 0 and self.next_estimate is None else "memory"

    def describe(self) -> str:
        """A few lines: the answer, the limit, the make-up of its peak, the next size, what would raise it (``str()``)."""
        where = self.device + (f" ({self.gpu})" if self.gpu else "")
        ranks = "" if self.world_size == 1 else f", {self.world_size} ranks ({self.sharding or 'replicated'})"
        capped = (f" (the planner's search cap max_batch_size={self.batch_size}, not memory)"
                  if self.stopped_by == "max_batch_size" else "")
        lines = [f"batch size {self.batch_size} on {where}{ranks}{capped}: planned on fake tensors, nothing ran",
                 f"  limit {format_bytes(self.limit)} of "
                 + ("the reserved peak plus the CUDA context" if self.device.startswith("cuda") else "tensor bytes")
                 + f": {self.target:.0%} of {format_bytes(self.capacity)}"]
        e = self.estimate
        if e is not None:
            parts = [("parameters", e.parameters), ("gradients", e.gradients), ("optimizer state", e.optimizer_state),
                     ("activations", e.activations), ("inputs", e.inputs), ("buffers", e.buffers),
                     ("gathered parameters", e.unsharded_parameters), ("communication", e.communication)]
            made = ", ".join(f"{name} {format_bytes(v)}" for name, v in parts if v)
            lines.append(f"  at {e.batch_size}: {format_bytes(e.required_bytes)} required; tensors at the peak: {made}")
        n = self.next_estimate
        if n is not None:
            lines.append(f"  at {n.batch_size}: {format_bytes(n.required_bytes)}, over the limit")
        if e is not None and n is not None and n.required_bytes > e.required_bytes:
            per = n.required_bytes - e.required_bytes
            lines.append(f"  model: {format_bytes(e.required_bytes - per * e.batch_size)} + {format_bytes(per)} "
                         "per sample (between the last two sizes)")
        lines.append(f"  search: {len(self.evaluations)} sizes evaluated, no OOM possible, {self.seconds:.2f}s")
        if self.stopped_by == "max_batch_size":
            lines.append(f"  to raise it: the search stopped at max_batch_size={self.batch_size}, under the limit; "
                         "pass a larger max_batch_size to search further")
        else:
            lines.append("  to raise it: a larger target or capacity; less memory per sample (mixed precision, "
                         "activation checkpointing)" + ("; more ranks to shard over" if self.sharding else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return (f"PlanResult(batch_size={self.batch_size}, limit={self.limit}, capacity={self.capacity}, "
                f"target={self.target}, device={self.device!r}, gpu={self.gpu!r}, evaluations={len(self.evaluations)})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stopped_by"] = self.stopped_by
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        d["next_estimate"] = self.next_estimate.to_dict() if self.next_estimate else None
        return d


@dataclass(frozen=True, kw_only=True)
class RankPlan(RankShare):
    """One rank of a mixed cluster: its share (the fields of :class:`~batchpilot.policy.shares.RankShare`),
    its GPU, and the plan that gave its largest micro-batch (``max_micro_batch == plan.batch_size``)."""

    gpu: str | None
    capacity: int
    plan: PlanResult

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "gpu": self.gpu, "capacity_bytes": self.capacity, "limit_bytes": self.plan.limit,
                "share": self.share, "micro_batch_size": self.micro_batch, "accumulation": self.accumulation,
                "max_micro_batch_size": self.max_micro_batch, "stopped_by": self.plan.stopped_by,
                "speed": self.speed, "time": self.time,
                "required_bytes": self.plan.estimate.required_bytes if self.plan.estimate else None}


@dataclass(frozen=True, kw_only=True, repr=False)
class ClusterPlanResult:
    """The plan of a data-parallel job over GPUs that differ: each rank's share of one global batch.

    Shares are proportional to ``speeds`` (the GPU table's TFLOPS, or the user's figures), so
    ranks finish their share at about the same time; each rank's micro-batch is the largest its
    own memory allows, and a share larger than that runs as several micro-batches. Every rank
    runs one optimizer step per global batch. ``global_batch_size`` is the one asked for, or
    (none asked for) the largest that every rank takes in one micro-batch.
    """

    global_batch_size: int
    ranks: tuple[RankPlan, ...]
    speeds_from: str
    target: float
    device: str
    seconds: float = 0.0
    evaluations: int = 0

    @property
    def shares(self) -> list[int]:
        """Samples per rank per optimizer step, in rank order."""
        return [r.share for r in self.ranks]

    @property
    def equal_share_micro_batch(self) -> int:
        """The per-rank batch data parallelism gives every rank today: the smallest rank's largest one."""
        return min(r.max_micro_batch for r in self.ranks)

    @property
    def speedup(self) -> float:
        """Predicted step-time ratio: equal shares of the same global batch over these shares.

        Equal shares run the global batch split evenly (each rank's part in as many micro-batches
        as its memory needs); the time is the slowest rank's, in the speeds' unit. Only as good as
        the speeds: a peak figure from a data sheet is not a measured samples/s.
        """
        speeds = [r.speed for r in self.ranks]
        n = len(self.ranks)
        equal = [self.global_batch_size // n + (1 if i < self.global_batch_size % n else 0) for i in range(n)]
        return step_seconds(equal, speeds) / step_seconds(self.shares, speeds)

    def describe(self) -> str:
        """A few lines: the global batch, one row per rank, why these shares, what would change them (``str()``)."""
        names = Counter(r.gpu or format_bytes(r.capacity) for r in self.ranks)
        mix = ", ".join(f"{k} x {v}" if v > 1 else k for k, v in names.items())
        lines = [f"global batch {self.global_batch_size} over {len(self.ranks)} ranks ({mix}): planned on fake "
                 "tensors, nothing ran"]
        head = ("rank", "gpu", "max micro", "speed", "share", "micro x accum", "time")
        rows = [(str(r.rank), r.gpu or format_bytes(r.capacity),
                 f"{r.max_micro_batch}{'*' if r.plan.stopped_by == 'max_batch_size' else ''}", f"{r.speed:.4g}",
                 str(r.share), f"{r.micro_batch} x {r.accumulation}", f"{r.time:.2f}") for r in self.ranks]
        # widths from the values, two spaces between columns: a long number never runs into its neighbour
        widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head))]
        for row in (head, *rows):
            cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  " + "  ".join(cells).rstrip())
        source = {"table": "the GPU table's peak dense FP16 tensor TFLOPS (vendor data sheets)",
                  "given": "the speeds given"}.get(self.speeds_from, self.speeds_from)
        capped = [r for r in self.ranks if r.plan.stopped_by == "max_batch_size"]
        micro = f"max micro: the largest batch under {self.target:.0%} of each GPU's memory"
        if capped:
            micro = (f"{micro}, or * the planner's search cap max_batch_size={capped[0].max_micro_batch}, not "
                     "memory (pass a larger max_batch_size to search further)")
        lines.append(f"  shares proportional to {source}; {micro}; one optimizer step per global batch on every rank")
        at_cap = any(r.max_micro_batch == self.equal_share_micro_batch for r in capped)
        fits = "takes (the search cap)" if at_cap else "fits"
        lines.append(f"  equal shares would give every rank {self.global_batch_size / len(self.ranks):g} samples "
                     f"(the smallest GPU {fits} {self.equal_share_micro_batch} per micro-batch): these shares "
                     f"are {self.speedup:.2f}x faster by the same speeds")
        lines.append(f"  search: {self.evaluations} fake steps for {len(names)} kinds of GPU, {self.seconds:.2f}s")
        lines.append("  to change it: speeds= (measured samples/s per rank) for a split closer to the real one; "
                     "global_batch_size= for another global batch")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return (f"ClusterPlanResult(global_batch_size={self.global_batch_size}, shares={self.shares}, "
                f"micro_batches={[r.micro_batch for r in self.ranks]}, "
                f"accumulation={[r.accumulation for r in self.ranks]})")

    def to_dict(self) -> dict[str, Any]:
        return {"global_batch_size": self.global_batch_size, "speeds_from": self.speeds_from, "target": self.target,
                "device": self.device, "speedup": self.speedup, "evaluations": self.evaluations,
                "seconds": self.seconds, "ranks": [r.to_dict() for r in self.ranks]}
