"""The planner's answers (:class:`MemoryEstimate`, :class:`PlanResult`) and its one error."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..memory.units import format_bytes

__all__ = ["PlanningError", "MemoryEstimate", "PlanResult"]


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
    maps every batch size tried to its ``required_bytes``.
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

    def describe(self) -> str:
        """A few lines: the answer, the limit, the make-up of its peak, the next size, what would raise it (``str()``)."""
        where = self.device + (f" ({self.gpu})" if self.gpu else "")
        ranks = "" if self.world_size == 1 else f", {self.world_size} ranks ({self.sharding or 'replicated'})"
        lines = [f"batch size {self.batch_size} on {where}{ranks}: planned on fake tensors, nothing ran",
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
        if n is None and self.batch_size > 0:
            lines.append("  to raise it: max_batch_size stopped it")
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
        d["estimate"] = self.estimate.to_dict() if self.estimate else None
        d["next_estimate"] = self.next_estimate.to_dict() if self.next_estimate else None
        return d
