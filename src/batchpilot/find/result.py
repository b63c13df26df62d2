"""The finder's answer: :class:`BatchPlan` (every trial, the memory line, the speed line, why)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..memory.limits import limit_named
from ..memory.units import format_bytes
from ..policy.search import FIT, OOM, OVER_TARGET, REFUSED, Trial
from ..policy.speed import SPEED_TOLERANCE, TimeFit, timed_fits
from .options import option_default

__all__ = ["MemoryFit", "BatchPlan", "trial_line", "figure_name"]

def figure_name(memory: str) -> str:
    """The figure a ``memory`` kind (``"tensors"``, ``"resident"``, ``"device"``...) measures, in words."""
    kind = limit_named(memory)
    return kind.label if kind is not None else f"{memory} memory"


def trial_line(t: Trial, limit_bytes: int) -> str:
    """One trial in a few words: ``"batch 83: fits, peak 14.2 GiB of 17.9 GiB, 130.2s"``."""
    peak = "?" if t.peak_bytes is None else format_bytes(t.peak_bytes)
    if t.outcome == OOM:
        what = "out of memory" + ("" if t.peak_bytes is None else f" (needs at least {peak})")
    elif t.outcome == REFUSED:
        what = f"not run: its predicted peak {peak} is past a limit that kills"
    else:
        what = f"{'fits' if t.outcome == FIT else 'over the limit'}, peak {peak} of {format_bytes(limit_bytes)}"
    return f"batch {t.batch_size}: {what}, {t.seconds:.1f}s"


@dataclass(kw_only=True)
class MemoryFit:
    """``peak ≈ fixed_bytes + bytes_per_sample × batch_size`` near the boundary."""

    fixed_bytes: float
    bytes_per_sample: float

    def predict(self, batch_size: int) -> float:
        return self.fixed_bytes + self.bytes_per_sample * batch_size


@dataclass(kw_only=True, repr=False)
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
            boundary), ``"max_trials"``, ``"plateau"`` (no ``max_batch_size``, and the peak stopped
            growing with the batch: the answer is the smallest size measured at that peak), or
            ``"verification"`` (the answer did not run again after the search, and the finder
            stepped down to one that did).
        steps_per_trial: training steps run per trial.
        limited_by_rank: in a distributed search, the rank whose memory set the
            answer (filled in by the distributed layer).
        first_guess: the size tried first when one was given (by the caller
            or the planner), else ``None``.
        seeded_by: ``"plan"`` when ``first_guess`` came from the planner
            (``find_batch_size_for(..., plan_first=True)``), else ``None``.
        plan_seconds: wall time of that planning pass (also when it failed
            and the search ran unseeded); included in ``seconds``.
        memory: the figure the trials were judged on, the name of the kind of limit they ran
            under (:attr:`batchpilot.memory.limits.Limit.name`; ``"tensors"``: an emulated
            capacity, ``"device"``: CUDA, ``"address_space"``: a CPU under ``RLIMIT_AS`` ...).
        tensor_fit: on a real CPU, the line of the tensor bytes alone at the answer (from the
            exact tensor model of the two tiny trials); ``fit`` minus it is the rest (allocator,
            kernel scratch, the runtime).
        binding_limit: on a real CPU, the limit that set the capacity
            (:attr:`batchpilot.memory.limits.Limit.binding`: ``"cgroup"``, ``"rlimit_as"``,
            ``"physical"`` ...); else ``None``.
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

    def limit_text(self) -> str:
        """The limit in words: its figure, what it measures, and how it was set."""
        figure = figure_name(self.memory)
        if self.base_bytes is not None and self.base_bytes < self.capacity:
            how = (f"{format_bytes(self.base_bytes)} in use + {self.target:.0%} of the "
                   f"{format_bytes(self.capacity - self.base_bytes)} the {self.binding_limit or 'host'} limit leaves")
        else:
            how = f"{self.target:.0%} of {format_bytes(self.capacity)}"
        return f"limit {format_bytes(self.limit_bytes)} of {figure}: {how}"

    def describe(self) -> str:
        """A few lines on the answer: what it is and why, the limit it was measured against, the
        memory line, the search, and what would raise it (``str(plan)`` is the same)."""
        lines = [f"batch size {self.batch_size} on {self.device}: {self.reason or self.stop_reason}"]
        lines.append(f"  {self.limit_text()}")
        lines.extend(f"  {line}" for line in self._answer_lines())
        lines.append(f"  search: {self._search_text()}")
        raise_it = self.to_raise()
        if raise_it:
            lines.append(f"  to raise it: {raise_it}")
        return "\n".join(lines)

    def _answer_lines(self) -> list[str]:
        out = []
        at = [t for t in self.trials if t.batch_size == self.batch_size and t.fits and t.peak_bytes is not None]
        if at:
            peak = at[-1].peak_bytes
            above = [t for t in self.trials if t.batch_size > self.largest_or_answer and t.outcome in (OOM, OVER_TARGET)]
            nxt = min(above, key=lambda t: t.batch_size) if above else None
            out.append(f"peak {format_bytes(peak)} at {self.batch_size} ({peak / self.limit_bytes:.0%} of the limit)"
                       + ("" if nxt is None else f"; {nxt.batch_size} "
                          + ("ran out of memory" if nxt.outcome == OOM else "went over it")))
        if self.fit is not None:
            out.append(f"memory line: {format_bytes(self.fit.fixed_bytes)} + "
                       f"{format_bytes(self.fit.bytes_per_sample)} per sample")
        speed = self.samples_per_second
        if speed is not None:
            out.append(f"speed: {speed:.1f} samples/s at {self.batch_size}"
                       + ("" if self.objective == "memory" else
                          f" (within {self.speed_tolerance:.0%} of the fastest; {self.largest_fitting} fits)"))
        return out

    @property
    def largest_or_answer(self) -> int:
        return int(self.largest_fitting or self.batch_size)

    def _search_text(self) -> str:
        refused = sum(t.outcome == REFUSED for t in self.trials)
        parts = [f"{self.strategy}, {self.num_trials} trials, {self.num_ooms} OOM"]
        if refused:
            parts.append(f"{refused} refused")
        parts.append(f"{self.seconds:.1f}s")
        if self.seeded_by:
            parts.append(f"seeded by the {self.seeded_by} ({self.first_guess})")
        if self.verified:
            parts.append("the answer ran again after the search")
        if self.limited_by_rank is not None:
            parts.append(f"rank {self.limited_by_rank} set it")
        return ", ".join(parts)

    def to_raise(self) -> str:
        """What would give a larger answer, in words (empty when nothing obvious would)."""
        if self.objective == "throughput" and self.batch_size < self.largest_or_answer:
            return (f"{self.largest_or_answer} fits; it was not chosen because it is no faster "
                    "(objective='memory' answers the largest)")
        if self.stop_reason == "max_batch_size":
            room = self._line_answer(self.target)
            return "max_batch_size stopped it" + (f" (the memory line allows about {room})" if room else "")
        if self.stop_reason == "max_trials":
            return "max_trials stopped it before the boundary: raise max_trials"
        if self.stop_reason == "plateau":
            return ("nothing in memory: a larger batch peaked as high (does the step read fewer samples than "
                    "it is asked for?); max_batch_size sets the batch you want")
        if self.stop_reason == "strategy":
            return f"strategy {self.strategy!r} stops below the boundary: strategy='predict' reaches it"
        hints = []
        higher = round(min(0.95, self.target + 0.1), 2)
        room = self._line_answer(higher) if higher > self.target else None
        if room is not None and room > self.batch_size:
            hints.append(f"target={higher} (about {room} by the memory line)")
        hints.append("less memory per sample (mixed precision, activation checkpointing)")
        kind = limit_named(self.memory)
        hints.append("more memory for the process" if kind is None or kind.host else "a larger capacity")
        return "; ".join(hints)

    def _line_answer(self, target: float) -> int | None:
        """The batch the memory line puts at the limit a ``target`` would set, or ``None`` without a line."""
        if self.fit is None or self.fit.bytes_per_sample <= 0:
            return None
        base = self.base_bytes
        limit = target * self.capacity if base is None else base + target * (self.capacity - base)
        return max(0, int((limit - self.fit.fixed_bytes) // self.fit.bytes_per_sample))

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(batch_size={self.batch_size}, limit_bytes={self.limit_bytes}, "
                f"memory={self.memory!r}, target={self.target}, device={self.device!r}, strategy={self.strategy!r}, "
                f"trials={self.num_trials}, ooms={self.num_ooms}, stop_reason={self.stop_reason!r})")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (ints, floats, strings, lists, dicts, None)."""
        out = asdict(self)
        out["trials"] = [t.to_dict() for t in self.trials]
        out["num_trials"] = self.num_trials
        out["num_ooms"] = self.num_ooms
        return out
