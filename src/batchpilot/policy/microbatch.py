"""When to shrink and when to grow the micro-batch: a pure policy and a linear memory model.

Nothing here imports torch. :class:`MicroBatchPolicy` is told what happened at the end of
each step (clean, OOM, memory pressure) and answers with the micro-batch for the next one;
:class:`PeakFit` turns observed ``(micro-batch, peak bytes)`` pairs into the largest
micro-batch predicted to stay under a byte budget. The engine (``batchpilot.train.engine``) feeds
one into the other; both are plain state machines, so their sequences can be asserted.
"""

from __future__ import annotations

import math
from typing import Any

from .._checks import positive_int
from .search import least_squares_line

__all__ = ["accum_steps", "balanced_sizes", "efficient_size", "MicroBatchPolicy", "PeakFit"]

# "any size": the policy caps it at the global batch
_UNBOUNDED = 2**62


def accum_steps(total: int, micro: int) -> int:
    """Micro-batches needed for ``total`` samples at ``micro`` per micro-batch: ``ceil(total / micro)``."""
    return -(-total // micro)


def efficient_size(total: int, micro: int) -> int:
    """The smallest micro-batch that needs as few micro-batches as ``micro`` does.

    Never larger than ``micro``: ``efficient_size(24, 10) == 8`` (3 micro-batches either way,
    but 8, 8, 8 is balanced and needs less memory than 10, 10, 4).
    """
    micro = max(1, min(micro, total))
    return -(-total // accum_steps(total, micro))


def balanced_sizes(total: int, parts: int) -> list[int]:
    """``total`` samples in ``parts`` micro-batches whose sizes differ by at most one, larger first.

    ``balanced_sizes(10, 3) == [4, 3, 3]`` (not 4, 4, 2: the same peak and passes, no ragged
    tail); ``balanced_sizes(256, 2) == [128, 128]``.

    Raises:
        ValueError: ``parts`` is not in ``[1, total]``.
    """
    if not 1 <= parts <= total:
        raise ValueError(f"{total} samples cannot be split into {parts} micro-batches")
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


class MicroBatchPolicy:
    """Shrink on OOM, grow back after a run of clean steps: ``GradScaler``'s rule for the micro-batch.

    ``limit`` is the per-rank global batch, the largest useful micro-batch. Every size the
    policy picks is "efficient" (see :func:`efficient_size`), so growth always saves at least
    one micro-batch per step.

    * :meth:`on_clean`: one more clean step. After ``wait`` of them at the current size
      (``wait`` starts at ``grow_after``), and if the memory model says a size that needs fewer
      micro-batches fits (``max_fitting``), grow to the largest such size. The grown size is on
      *probation* until it completes a clean step; that step confirms it and resets ``wait``
      to ``grow_after``.
    * :meth:`on_oom`: an OOM at a size on probation goes back to the size before the growth and
      multiplies ``wait`` by ``backoff`` (capped at ``max_wait``). Any other OOM halves the
      size, or shrinks it less when the memory model says a size between half and the current
      one fits (the model can spare micro-batches, never cause more OOMs than halving); rounded
      to an efficient size. At size 1 there is nothing left to shrink: it returns ``None``.
    * :meth:`on_pressure`: the same as an OOM, without failing at size 1.
    * ``ceiling``: growth never goes past it (the engine sets it when measured step times say
      smaller micro-batches are faster, :func:`batchpilot.policy.speed.choose_split`).

    Example, ``limit=64, micro=64, grow_after=2, backoff=2``, memory model unknown after an OOM
    at 64, then reporting that 64 fits::

        on_oom()            -> 32      wait 2
        on_clean(None)      -> 32      (no model: never grow)
        on_clean(64)        -> 64      probation (2 clean steps at 32)
        on_oom()            -> 32      wait 4 (the growth failed)
        on_clean(64) x 3    -> 32
        on_clean(64)        -> 64      probation again, after 4 clean steps
        on_clean(64)        -> 64      confirmed; wait back to 2

    Raises:
        ValueError: a size or count is not a positive int, ``micro > limit``, ``backoff < 1``.
    """

    def __init__(
        self, *, limit: int, micro: int, grow_after: int = 50, backoff: float = 2.0, max_wait: int | None = None,
        ceiling: int | None = None,
    ) -> None:
        for name, value in (("limit", limit), ("micro", micro), ("grow_after", grow_after)):
            positive_int(name, value)
        if micro > limit:
            raise ValueError(f"micro-batch {micro} is larger than the per-rank global batch {limit}")
        if not backoff >= 1:
            raise ValueError(f"backoff must be >= 1 (the factor the growth wait grows by), got {backoff}")
        if max_wait is not None:
            positive_int("max_wait", max_wait)
        if ceiling is not None:
            positive_int("ceiling", ceiling)
        self.limit = limit
        self.ceiling = ceiling
        self.micro = efficient_size(limit, micro)
        self.grow_after = grow_after
        self.backoff = backoff
        self.max_wait = max_wait
        self.wait = grow_after
        self.clean = 0
        self.previous: int | None = None

    @property
    def on_probation(self) -> bool:
        """True between a growth and its first clean step."""
        return self.previous is not None

    @property
    def accum_steps(self) -> int:
        return accum_steps(self.limit, self.micro)

    def growth_candidate(self, max_fitting: int | None) -> int | None:
        """The size growth would pick now, or ``None`` if it would not save a micro-batch."""
        if max_fitting is None or self.micro >= self.limit:
            return None
        size = efficient_size(self.limit, min(max_fitting, self.limit, self.ceiling or self.limit))
        return size if accum_steps(self.limit, size) < self.accum_steps else None

    def on_clean(self, max_fitting: int | None = None) -> int:
        """Record a clean step; return the micro-batch for the next one.

        Args:
            max_fitting: largest micro-batch the memory model predicts under the target, or
                ``None`` when the peak cannot be measured (then the policy never grows).
        """
        if self.previous is not None:
            self.previous = None
            self.wait = self.grow_after
        self.clean += 1
        if self.clean >= self.wait:
            size = self.growth_candidate(max_fitting)
            if size is not None:
                self.previous, self.micro, self.clean = self.micro, size, 0
        return self.micro

    def on_oom(self, max_fitting: int | None = None) -> int | None:
        """Record an OOM at the current size; return the size to retry with, ``None`` at size 1."""
        if self.previous is not None:
            self.micro, self.previous, self.clean = self.previous, None, 0
            wait = math.ceil(self.wait * self.backoff)
            self.wait = min(wait, self.max_wait) if self.max_wait is not None else wait
            return self.micro
        if self.micro == 1:
            return None
        size = self.micro // 2
        if max_fitting is not None and size <= max_fitting < self.micro:
            size = max_fitting
        self.micro = efficient_size(self.limit, max(1, min(size, self.micro - 1)))
        self.clean = 0
        return self.micro

    def on_pressure(self, max_fitting: int | None = None) -> int:
        """Memory is close to full (no OOM yet): shrink as for an OOM; at size 1 stay."""
        if self.micro == 1 and self.previous is None:
            self.clean = 0
            return 1
        size = self.on_oom(max_fitting)
        assert size is not None
        return size

    def rebase(self, limit: int, cap: int) -> None:
        """A new ``limit`` (the global batch changed): the micro-batch becomes the efficient size at most ``cap``.

        ``cap`` is the micro-batch memory allowed before the change, so a ramp 96 → 128 over a
        cap of 64 goes 48 → 64, not 48 → 43. A growth on probation is confirmed; the clean count
        goes on.

        Example: ``limit=64, micro=64``; ``rebase(96, 64)`` → micro 48; ``rebase(128, 64)`` → 64.

        Raises:
            ValueError: ``limit`` or ``cap`` is not a positive int.
        """
        self.limit = positive_int("limit", limit)
        self.micro = efficient_size(limit, min(positive_int("cap", cap), limit))
        self.previous = None

    def adopt(self, micro: int) -> None:
        """Take a size decided elsewhere (e.g. the minimum over ranks); a smaller one ends probation."""
        positive_int("micro", micro)
        micro = efficient_size(self.limit, micro)
        if micro == self.micro:
            return
        if self.previous is not None and micro <= self.previous:
            self.previous = None
        self.micro, self.clean = micro, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "limit": self.limit, "micro": self.micro, "grow_after": self.grow_after, "backoff": self.backoff,
            "max_wait": self.max_wait, "wait": self.wait, "clean": self.clean, "previous": self.previous,
            "ceiling": self.ceiling,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters (and a speed ``ceiling``); the configuration (``grow_after``...) stays as built.

        A state saved with a different ``limit`` (another global batch or world size) keeps its
        micro-batch, clamped to the new limit, and starts the growth counters afresh.
        """
        micro = int(state["micro"])
        if state.get("ceiling") is not None and int(state["limit"]) == self.limit:
            self.ceiling = int(state["ceiling"])  # measured on this batch: keep it
        if int(state["limit"]) != self.limit:
            self.micro = efficient_size(self.limit, micro)
            self.wait, self.clean, self.previous = self.grow_after, 0, None
            return
        self.micro = micro
        self.wait = int(state["wait"])
        self.clean = int(state["clean"])
        self.previous = None if state["previous"] is None else int(state["previous"])

    def __repr__(self) -> str:
        return (
            f"MicroBatchPolicy(micro={self.micro}, limit={self.limit}, clean={self.clean}, "
            f"wait={self.wait}, probation={self.on_probation}, ceiling={self.ceiling})"
        )


class PeakFit:
    """A running linear model of a training step's memory: ``peak - start = fixed + per_sample × micro``.

    ``start`` is the memory in use when the step begins (parameters, optimizer state, whatever
    the caller keeps), so the model describes what the step itself adds and stays right when
    the optimizer state appears after the first step. Each micro-batch size keeps the largest
    increase seen at it (the data can change a step's peak, e.g. the sequence length; the
    largest is the safe one), and at most ``max_sizes`` sizes are kept, the most recently seen.
    With two sizes or more the line is the least-squares fit; with one, the whole increase is
    charged to the samples (``fixed = 0``), which over-estimates ``per_sample`` and so
    under-estimates what fits at a larger size. When the sizes seen show no growth with the
    micro-batch (weights and optimizer state dominate), ``per_sample`` is 0 and every size fits
    or none does. A ``prior`` line (e.g. the finder's fit) is used until two sizes have been seen.
    """

    def __init__(self, *, max_sizes: int = 8, prior: tuple[float, float] | None = None) -> None:
        if max_sizes < 2:
            raise ValueError(f"max_sizes must be at least 2 to fit a line, got {max_sizes}")
        self.max_sizes = max_sizes
        self.prior = prior
        self._increase: dict[int, int] = {}

    def observe(self, micro: int, peak: int, start: int = 0) -> None:
        """Record a clean step at ``micro``: its peak and the bytes in use when it began."""
        increase = max(int(peak) - int(start), self._increase.pop(micro, 0))
        self._increase[micro] = increase  # re-inserted: most recent last
        while len(self._increase) > self.max_sizes:
            del self._increase[next(iter(self._increase))]

    @property
    def sizes(self) -> list[int]:
        return sorted(self._increase)

    def line(self) -> tuple[float, float] | None:
        """``(fixed_bytes, bytes_per_sample)`` of the increase, or ``None`` while unknown."""
        pts = self._increase
        if len(pts) >= 2:
            fixed, slope = least_squares_line(pts)
            if slope > 0:
                return max(0.0, fixed), slope
            # no growth with the micro-batch: the peak is fixed memory (weights, optimizer state)
            return float(max(pts.values())), 0.0
        if self.prior is not None:
            return self.prior
        if pts:
            micro, inc = max(pts.items(), key=lambda kv: kv[1] / kv[0])
            if inc > 0:
                return 0.0, inc / micro
        return None

    def predict(self, micro: int, start: int = 0) -> float | None:
        """Predicted peak of a step at ``micro`` that begins with ``start`` bytes in use."""
        line = self.line()
        return None if line is None else start + line[0] + line[1] * micro

    def max_fitting(self, budget: float, start: int = 0) -> int | None:
        """Largest micro-batch whose predicted peak is at most ``budget`` bytes (0 if none)."""
        line = self.line()
        if line is None:
            return None
        fixed, per_sample = line
        room = budget - start - fixed
        if per_sample <= 0:
            return _UNBOUNDED if room >= 0 else 0
        return max(0, math.floor(room / per_sample))

    def state_dict(self) -> dict[str, Any]:
        return {
            "increase": [[m, inc] for m, inc in self._increase.items()],
            "prior": None if self.prior is None else list(self.prior),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._increase = {int(m): int(inc) for m, inc in state["increase"]}
        prior = state.get("prior")
        self.prior = None if prior is None else (float(prior[0]), float(prior[1]))

    def __repr__(self) -> str:
        return f"PeakFit(line={self.line()}, sizes={self.sizes})"
