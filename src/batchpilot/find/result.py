"""The finder's answer: :class:`BatchPlan` (every trial, the memory line, the speed line, why)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..policy.search import OOM, Trial
from ..policy.speed import SPEED_TOLERANCE, TimeFit, timed_fits
from .options import option_default

__all__ = ["MemoryFit", "BatchPlan"]


@dataclass(kw_only=True)
class MemoryFit:
    """``peak ≈ fixed_bytes + bytes_per_sample × batch_size`` near the boundary."""

    fixed_bytes: float
    bytes_per_sample: float

    def predict(self, batch_size: int) -> float:
        return self.fixed_bytes + self.bytes_per_sample * batch_size


@dataclass(kw_only=True)
class BatchPlan:
    """The result of a batch-size search.

    Attributes:
        batch_size: the answer: with ``objective="memory"`` the largest batch size found to fit,
            with ``"throughput"`` the smallest fitting one within ``speed_tolerance`` of the
            fastest measured samples/s (``reason`` says which and why).
        target: the fraction of ``capacity`` the peak may use.
        capacity: device capacity in bytes (emulated or real).
        limit_bytes: ``int(target × capacity)`` (on a host, ``base_bytes + target × (capacity -
            base_bytes)``); a fitting peak is at most this.
        strategy: the search policy's name.
        device: the device measured, e.g. ``"cuda:0"``.
        trials: every trial in order.
        fit: the line through the two measured trials nearest the boundary,
            or ``None`` with fewer than two measured trials.
        seconds: wall time of the whole search.
        stop_reason: ``"boundary"`` (b fits, b + 1 does not), ``"tolerance"`` (within the
            tolerance of it), ``"max_batch_size"``, ``"strategy"`` (power / decay stop before the
            boundary), ``"max_trials"``, or ``"verification"`` (the answer did not run again
            after the search, and the finder stepped down to one that did).
        steps_per_trial: training steps run per trial.
        limited_by_rank: in a distributed search, the rank whose memory set the
            answer (filled in by the distributed layer).
        first_guess: the size tried first when one was given (by the caller
            or the planner), else ``None``.
        seeded_by: ``"plan"`` when ``first_guess`` came from the planner
            (``find_batch_size_for(..., plan_first=True)``), else ``None``.
        plan_seconds: wall time of that planning pass (also when it failed
            and the search ran unseeded); included in ``seconds``.
        memory: the figure the trials were judged on: ``"tensors"`` (an emulated
            capacity on CPU), ``"resident"`` (the process's real memory on CPU),
            ``"device"`` (reserved plus outside PyTorch on CUDA) or ``"allocated"``.
        tensor_fit: on a real CPU, the line of the tensor bytes alone at the answer (from the
            exact tensor model of the two tiny trials); ``fit`` minus it is the rest (allocator,
            kernel scratch, the runtime).
        binding_limit: on a real CPU, the limit that set the capacity: ``"cgroup"``,
            ``"rlimit_as"`` or ``"physical"``; else ``None``.
        refused: trials not run because their predicted peak was over a limit past which
            the process is killed (counted in ``trials``, outcome ``"refused"``).
        snapshot_bytes, snapshot_seconds, snapshot_on_disk: what the ``restore=`` snapshot
            held, the time it took to take and restore, and whether it was spilled to a file.
        compiled: a ``restore=`` module is, or holds, a ``torch.compile``'d module.
        compiled_trials: the trials ran the compiled program (real memory: a CPU's resident
            set, a GPU's); ``False`` for a compiled model under an emulated CPU capacity, whose
            tracker sees the eager program (:mod:`batchpilot.core.compiled`).
        compilations: graphs dynamo compiled during the search, warm-up included (any model).
        objective: ``"memory"`` or ``"throughput"``.
        speed_tolerance: the share of the best samples/s the throughput objective may give up.
        largest_fitting: the largest batch size found to fit (``batch_size`` for ``"memory"``).
        time_fit: ``seconds per step ≈ fixed + per_sample × b`` through the timed trials that
            fitted, or ``None`` with fewer than two.
        reason: one line on why ``batch_size`` was chosen.
        verified: the answer ran again after the search, in the state the search left (after its
            last OOM, or with a peak near the capacity); the trials it took are the last ones.
        base_bytes: on a host, the memory in use when the search began; the limit is
            ``base_bytes + target × (capacity - base_bytes)``. ``None`` elsewhere.
    """

    batch_size: int
    target: float
    capacity: int
    limit_bytes: int
    strategy: str
    device: str
    trials: list[Trial] = field(default_factory=list)
    fit: MemoryFit | None = None
    seconds: float = 0.0
    stop_reason: str = "boundary"
    steps_per_trial: int = option_default("steps_per_trial")
    limited_by_rank: int | None = None
    first_guess: int | None = None
    seeded_by: Literal["plan"] | None = None
    plan_seconds: float = 0.0
    memory: str = "tensors"
    tensor_fit: MemoryFit | None = None
    binding_limit: str | None = None
    snapshot_bytes: int = 0
    snapshot_seconds: float = 0.0
    snapshot_on_disk: bool = False
    compiled: bool = False
    compiled_trials: bool = False
    compilations: int = 0
    objective: str = "memory"
    speed_tolerance: float = SPEED_TOLERANCE
    largest_fitting: int | None = None
    time_fit: TimeFit | None = None
    reason: str = ""
    verified: bool = False
    base_bytes: int | None = None

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    @property
    def samples_per_second(self) -> float | None:
        """Measured samples/s at ``batch_size`` (its fastest timed step), or ``None`` if not timed."""
        timed_fits = [t for t in self.trials if t.batch_size == self.batch_size and t.fits and t.step_seconds]
        return timed_fits[-1].samples_per_second if timed_fits else None

    def timed_points(self) -> dict[int, float]:
        """``{batch size: seconds per step}`` of the timed trials that fitted."""
        return timed_fits(self.trials)

    @property
    def num_ooms(self) -> int:
        return sum(t.outcome == OOM for t in self.trials)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (ints, floats, strings, lists, dicts, None)."""
        out = asdict(self)
        out["trials"] = [t.to_dict() for t in self.trials]
        out["num_trials"] = self.num_trials
        out["num_ooms"] = self.num_ooms
        return out
