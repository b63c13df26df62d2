"""Memory over (batch, sequence length), and length-aware micro-batches: pure, torch-free.

A padded batch of ``b`` samples of length ``L`` peaks at ``F(L) + b × P(L)``: ``P`` is what a
sample costs (``a·L`` for the activations of every token, ``c·L²`` for attention scores that no
fused kernel avoids), ``F`` what the step costs whatever the batch (weights, optimizer state,
and a few ``L``-sized buffers such as a causal mask). :func:`fit_lengths` fits both from the
finder's memory lines at two or three lengths; :class:`LengthBudget` answers the largest
micro-batch per length and refuses lengths beyond the longest one a real trial verified;
:func:`plan_length_split` cuts a batch, longest samples first, into micro-batches that fit.
Why and how: ``docs/internals.md#sequence-length``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Iterable, Mapping, Sequence

from .._checks import positive_int

__all__ = [
    "CORRECTION_BAND",
    "LengthFit",
    "LengthBudget",
    "UnverifiedLengthError",
    "check_lengths",
    "choose_fit_lengths",
    "fit_lengths",
    "fit_lengths_for",
    "plan_length_split",
    "split_into",
]


#: a correction at length L holds for lengths in [L / band, L × band]
CORRECTION_BAND = 1.25


class UnverifiedLengthError(ValueError):
    """A length beyond the longest one a real trial verified: the model is an extrapolation there."""

    def __init__(self, length: int, verified: int) -> None:
        self.length, self.verified = length, verified
        # the longest length that ran first: a model may not take longer sequences at all (a
        # position table), and a search at a length it cannot take fails
        super().__init__(
            f"sequence length {length} is beyond the longest verified length {verified}: the memory model "
            f"is not trusted there until a real trial at {length} has run. Cut batches to at most {verified} "
            f"tokens (the longest length that ran; e.g. the tokenizer's max_length={verified}); or, if the model "
            f"takes {length} tokens, find with lengths up to {length} (find_batch_size_for(..., lengths=(..., "
            f"{length}))) or let the engine verify it (LengthConfig(beyond='verify'))"
        )


def check_lengths(lengths: Iterable[Any], *, name: str = "lengths") -> tuple[int, ...]:
    """``lengths`` as sorted distinct positive ints.

    >>> check_lengths([512, 128, 128])
    (128, 512)

    Raises:
        ValueError: empty, or an entry that is not a positive int (``0``, ``-3``, ``2.5``, ``True``).
    """
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise ValueError(f"{name} must be a sequence of positive ints such as (128, 512), got {lengths!r}")
    out = sorted({positive_int(f"each of {name}", v) for v in lengths})
    if not out:
        raise ValueError(f"{name} is empty; give the sequence lengths to answer for, such as (128, 512)")
    return tuple(out)


def _poly(coeffs: Sequence[float], x: float) -> float:
    return sum(c * x ** i for i, c in enumerate(coeffs))


def _least_squares(xs: Sequence[int], ys: Sequence[float], powers: Sequence[int]) -> tuple[float, ...]:
    """Coefficients of ``sum(k_i x^powers[i])`` by least squares, solved in exact rationals.

    Exact when the points lie on such a polynomial (the CPU tracker's integer peaks do), so a
    prediction at a length not fitted on is the measured peak to the byte.
    """
    rows = [[Fraction(x) ** p for p in powers] for x in xs]
    vals = [Fraction(y) for y in ys]
    n = len(powers)
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * v for r, v in zip(rows, vals))]
         for i in range(n)]
    for col in range(n):  # Gauss-Jordan on the normal equations; exact, so no pivoting for size
        pivot = next(r for r in range(col, n) if a[r][col] != 0)
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col and a[r][col] != 0:
                k = a[r][col] / a[col][col]
                a[r] = [x - k * y for x, y in zip(a[r], a[col])]
    return tuple(float(a[i][n] / a[i][i]) for i in range(n))


@dataclass(kw_only=True)
class LengthFit:
    """``peak(b, L) ≈ F(L) + b × P(L)``, both quadratics in ``L`` (coefficients low power first).

    Attributes:
        fixed: ``(f0, f1, f2)``: ``F(L) = f0 + f1·L + f2·L²``, bytes whatever the batch.
        per_sample: ``(p0, p1, p2)``: ``P(L) = p0 + p1·L + p2·L²``, bytes per sample; ``p1`` is
            the issue's ``a`` (bytes per token), ``p2`` its ``c`` (bytes per ``b·L²``: unfused
            attention; near 0 with a fused kernel).
        lengths: the lengths it was fitted on.
    """

    fixed: tuple[float, float, float]
    per_sample: tuple[float, float, float]
    lengths: tuple[int, ...] = ()

    @property
    def bytes_per_token(self) -> float:
        return self.per_sample[1]

    @property
    def bytes_per_token_squared(self) -> float:
        return self.per_sample[2]

    def fixed_bytes(self, length: int) -> float:
        return _poly(self.fixed, length)

    def bytes_per_sample(self, length: int) -> float:
        return _poly(self.per_sample, length)

    def peak(self, batch_size: int, length: int) -> float:
        """Predicted peak bytes of a micro-batch of ``batch_size`` samples padded to ``length``."""
        return self.fixed_bytes(length) + batch_size * self.bytes_per_sample(length)

    def max_batch(self, length: int, limit_bytes: float) -> int:
        """Largest ``b`` with ``peak(b, length) <= limit_bytes`` (0 if none; a huge int if samples cost nothing).

        A prediction that lands within a part in a billion of a whole sample counts as that
        sample: the exact rational fit comes back through floats.
        """
        per = self.bytes_per_sample(length)
        room = limit_bytes - self.fixed_bytes(length)
        if per <= 0:
            return 1 << 40 if room >= 0 else 0
        return max(0, math.floor(room / per + 1e-9))

    def to_dict(self) -> dict[str, Any]:
        return {"fixed": list(self.fixed), "per_sample": list(self.per_sample), "lengths": list(self.lengths),
                "bytes_per_token": self.bytes_per_token, "bytes_per_token_squared": self.bytes_per_token_squared}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LengthFit:
        """The fit :meth:`to_dict` wrote (its derived keys are ignored).

        Raises:
            ValueError: ``fixed`` or ``per_sample`` missing or not three finite numbers.
        """
        def coeffs(key: str) -> tuple[float, float, float]:
            values = state.get(key) if isinstance(state, Mapping) else None
            if (not isinstance(values, (list, tuple)) or len(values) != 3
                    or not all(_finite(v) for v in values)):
                raise ValueError(f"a saved LengthFit needs {key!r}: three finite numbers, got {values!r}")
            return tuple(float(v) for v in values)  # type: ignore[return-value]

        return cls(fixed=coeffs("fixed"), per_sample=coeffs("per_sample"),
                   lengths=tuple(positive_int("each fitted length", L) for L in state.get("lengths", ())))


def fit_lengths(lines: Mapping[int, tuple[float, float]]) -> LengthFit:
    """Fit ``F`` and ``P`` to the memory lines ``{length: (fixed_bytes, bytes_per_sample)}``.

    Three lengths or more: full quadratics (least squares; exact through three). Two lengths
    cannot tell every term apart, so they fit the issue's form ``P(L) = a·L + c·L²`` (nothing
    per sample without tokens) and ``F(L) = f0 + f1·L``. With the lines of a step that costs
    ``F(L) = 1000 + 2L`` and ``P(L) = 10L + L²``:

    >>> fit = fit_lengths({16: (1032, 416), 32: (1064, 1344), 64: (1128, 4736)})
    >>> fit.max_batch(128, 1_000_000), fit.max_batch(48, 1_000_000)
    (56, 358)

    Raises:
        ValueError: fewer than two distinct lengths, or a length that is not a positive int.
    """
    lengths = check_lengths(lines, name="the fitted lengths")
    if len(lengths) < 2:
        raise ValueError(
            f"one length ({lengths[0]}) cannot tell the per-token cost from the attention's L² cost; "
            "measure at two or three lengths, e.g. the longest, half and a quarter of it"
        )
    fixed_y = [float(lines[L][0]) for L in lengths]
    per_y = [float(lines[L][1]) for L in lengths]
    if len(lengths) == 2:
        f = _least_squares(lengths, fixed_y, (0, 1)) + (0.0,)
        p = (0.0,) + _least_squares(lengths, per_y, (1, 2))
    else:
        f = _least_squares(lengths, fixed_y, (0, 1, 2))
        p = _least_squares(lengths, per_y, (0, 1, 2))
    return LengthFit(fixed=tuple(f), per_sample=tuple(p), lengths=lengths)  # type: ignore[arg-type]


def fit_lengths_for(points: Iterable[tuple[int, int, float]]) -> LengthFit:
    """:func:`fit_lengths` from raw trials ``(batch_size, length, peak)``: a line per length first.

    Each length needs trials at two batch sizes or more (the line is least squares over them).

    Raises:
        ValueError: a length measured at one batch size only, or fewer than two lengths.
    """
    by_length: dict[int, dict[int, float]] = {}
    for b, L, peak in points:
        by_length.setdefault(positive_int("length", L), {})[positive_int("batch_size", b)] = float(peak)
    lines = {}
    for L, pts in by_length.items():
        if len(pts) < 2:
            raise ValueError(f"length {L} was measured at one batch size only; a line needs two")
        fixed, per = _least_squares(sorted(pts), [pts[b] for b in sorted(pts)], (0, 1))
        lines[L] = (fixed, per)
    return fit_lengths(lines)


@dataclass(kw_only=True)
class LengthBudget:
    """The largest micro-batch per padded length, within what real trials verified.

    Attributes:
        fit: the memory model.
        limit_bytes: the peak a micro-batch may reach (``target × capacity``).
        verified: ``{length: batch size}`` a real trial (or search) showed to fit at that length.
        max_batch_size: a cap on every answer (the per-rank batch, a user's bound), or ``None``.
        corrections: ``{length: factor}``: a step at ``length`` peaked ``factor`` (> 1) times
            over the model's prediction; lengths within :data:`CORRECTION_BAND` of it are sized
            for a peak that many times the model's (see :meth:`correct`).
        capped: verified lengths whose search stopped at a batch-size cap, not at memory: their
            answer is a floor under the model's, not the boundary (see :meth:`raise_cap`).
    """

    fit: LengthFit
    limit_bytes: float
    verified: dict[int, int] = field(default_factory=dict)
    max_batch_size: int | None = None
    corrections: dict[int, float] = field(default_factory=dict)
    capped: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.verified:
            raise ValueError("a LengthBudget needs at least one verified (length, batch size)")

    @property
    def verified_max(self) -> int:
        """The longest verified length; the model is not trusted beyond it."""
        return max(self.verified)

    def micro_batch(self, length: int) -> int:
        """The largest micro-batch for samples padded to ``length`` (0: not even one sample fits).

        At a verified length, the verified batch; elsewhere (and where the verification only
        reached a cap) the model's answer, never below what a trial verified at a length at least
        as long (a shorter sequence needs no more memory); capped at ``max_batch_size``. With
        ``F(L) = 1000 + 2L``, ``P(L) = 10L + L²`` and a verified 56 at length 128:

        >>> fit = fit_lengths({16: (1032, 416), 32: (1064, 1344), 64: (1128, 4736)})
        >>> budget = LengthBudget(fit=fit, limit_bytes=1_000_000, verified={128: 56})
        >>> [budget.micro_batch(L) for L in (16, 64, 100, 128)]
        [2401, 210, 90, 56]
        >>> budget.micro_batch(129)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        batchpilot.policy.lengths.UnverifiedLengthError: sequence length 129 is beyond the longest verified length 128: ...

        Raises:
            ValueError: ``length`` not a positive int.
            UnverifiedLengthError: ``length`` beyond :attr:`verified_max`.
        """
        length = positive_int("length", length)
        if length > self.verified_max:
            raise UnverifiedLengthError(length, self.verified_max)
        if length in self.verified and length not in self.capped:  # a real search found the boundary here
            answer = self.verified[length]
        else:
            floor = max(b for L, b in self.verified.items() if L >= length)
            model = self.fit.max_batch(length, self._limit_at(length))
            answer = max(model, floor)
        return answer if self.max_batch_size is None else min(answer, self.max_batch_size)

    def raise_cap(self, max_batch_size: int) -> None:
        """Answer up to a larger ``max_batch_size`` (a schedule grew the per-rank batch).

        A verified answer that had reached the old cap says where the search stopped, not where
        memory ran out: from now on it is a floor under the model's answer.

        >>> fit = LengthFit(fixed=(0.0, 0.0, 0.0), per_sample=(0.0, 100.0, 0.0))
        >>> budget = LengthBudget(fit=fit, limit_bytes=100_000, verified={100: 8, 1000: 1}, max_batch_size=8)
        >>> budget.micro_batch(100), budget.micro_batch(50)
        (8, 8)
        >>> budget.raise_cap(32)
        >>> budget.micro_batch(100), budget.micro_batch(50), budget.micro_batch(1000)
        (10, 20, 1)
        """
        old = self.max_batch_size
        if old is None or max_batch_size <= old:
            return
        self.capped |= {L for L, b in self.verified.items() if b >= old}
        self.max_batch_size = positive_int("max_batch_size", max_batch_size)

    def _limit_at(self, length: int) -> float:
        """The limit the model is held to at ``length``: lowered by the corrections near it."""
        near = [f for L, f in self.corrections.items() if L / CORRECTION_BAND <= length <= L * CORRECTION_BAND]
        return self.limit_bytes / max(near, default=1.0)

    def correct(self, length: int, factor: float) -> None:
        """A step at ``length`` peaked ``factor`` times over the model: size lengths near it for that.

        The model is a quadratic through two or three lengths; where the step's peak moves from
        one part of the step to another between them (logits at short lengths, attention scores
        at long ones), it under-predicts there. The correction holds within a factor of
        :data:`CORRECTION_BAND` of ``length``, except at verified lengths.

        >>> fit = LengthFit(fixed=(0.0, 0.0, 0.0), per_sample=(0.0, 100.0, 0.0))
        >>> budget = LengthBudget(fit=fit, limit_bytes=100_000, verified={1000: 1})
        >>> budget.correct(100, 1.25)
        >>> [budget.micro_batch(L) for L in (50, 100, 120, 140, 200)]
        [20, 8, 6, 7, 5]
        """
        positive_int("length", length)
        if factor > 1:
            self.corrections[length] = max(factor, self.corrections.get(length, 1.0))

    def table(self, lengths: Iterable[int]) -> dict[int, int]:
        """``{length: micro_batch(length)}`` for the lengths up to :attr:`verified_max`."""
        return {L: self.micro_batch(L) for L in check_lengths(lengths) if L <= self.verified_max}

    def verify(self, length: int, batch_size: int, *, capped: bool = False) -> None:
        """Record that ``batch_size`` fits at ``length`` (a real trial ran); ``capped``: the search
        stopped at a batch-size cap, so more may fit (the answer is a floor, see :attr:`capped`)."""
        self.verified[positive_int("length", length)] = max(positive_int("batch_size", batch_size),
                                                            self.verified.get(length, 0))
        if capped:
            self.capped.add(length)
        else:
            self.capped.discard(length)

    def to_dict(self) -> dict[str, Any]:
        return {"fit": self.fit.to_dict(), "limit_bytes": self.limit_bytes,
                "verified": {str(k): v for k, v in sorted(self.verified.items())},
                "max_batch_size": self.max_batch_size,
                "corrections": {str(k): v for k, v in sorted(self.corrections.items())}}

    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`micro_batch` answers from, as lists, numbers and strings.

        ``torch.load(..., weights_only=True)`` and JSON both read it back; :meth:`from_state`
        rebuilds a budget that answers every length alike (floats kept to the bit):

        >>> fit = LengthFit(fixed=(0.0, 0.0, 0.0), per_sample=(0.0, 100.0, 0.0))
        >>> budget = LengthBudget(fit=fit, limit_bytes=100_000, verified={1000: 1}, max_batch_size=16)
        >>> budget.correct(100, 1.25)
        >>> budget.state_dict()["verified"], budget.state_dict()["corrections"]
        ([[1000, 1]], [[100, 1.25]])
        >>> LengthBudget.from_state(budget.state_dict()) == budget
        True
        """
        return {"fit": {"fixed": list(self.fit.fixed), "per_sample": list(self.fit.per_sample),
                        "lengths": list(self.fit.lengths)},
                "limit_bytes": float(self.limit_bytes),
                "verified": [[L, b] for L, b in sorted(self.verified.items())],
                "max_batch_size": self.max_batch_size,
                "corrections": [[L, float(f)] for L, f in sorted(self.corrections.items())],
                "capped": sorted(self.capped)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LengthBudget:
        """The budget :meth:`state_dict` saved.

        Raises:
            ValueError: not such a state: a key missing, a length or batch that is not a
                positive int, a limit or correction factor that is not a finite positive number,
                no verified length.
        """
        if not isinstance(state, Mapping) or not {"fit", "limit_bytes", "verified"} <= set(state):
            raise ValueError("a saved LengthBudget needs 'fit', 'limit_bytes' and 'verified' (from "
                             f"LengthBudget.state_dict()), got {state!r}")
        limit = state["limit_bytes"]
        if not (_finite(limit) and limit > 0):
            raise ValueError(f"a saved LengthBudget's limit_bytes must be a positive number, got {limit!r}")
        cap = state.get("max_batch_size")
        corrections = {}
        for L, f in _pairs(state.get("corrections", ()), "corrections"):
            if not (_finite(f) and f > 0):
                raise ValueError(f"a saved correction factor must be a positive number, got {f!r} at length {L}")
            corrections[positive_int("each corrected length", L)] = float(f)
        return cls(
            fit=LengthFit.from_state(state["fit"]),
            limit_bytes=float(limit),
            verified={positive_int("each verified length", L): positive_int("each verified batch size", b)
                      for L, b in _pairs(state["verified"], "verified")},
            max_batch_size=None if cap is None else positive_int("max_batch_size", cap),
            corrections=corrections,
            capped={positive_int("each capped length", L) for L in state.get("capped", ())},
        )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pairs(items: Any, name: str) -> list[tuple[Any, Any]]:
    """``[[length, value], ...]`` (a state's form) as pairs; a ``{length: value}`` mapping is accepted too."""
    if isinstance(items, Mapping):
        items = list(items.items())
    if not isinstance(items, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in items):
        raise ValueError(f"a saved LengthBudget's {name} must be [[length, value], ...], got {items!r}")
    return [(p[0], p[1]) for p in items]


def split_into(groups: Sequence[tuple[list[int], int]], lengths: Sequence[int],
               count: int) -> list[tuple[list[int], int]]:
    """``groups`` of :func:`plan_length_split` cut further, the largest first, until there are ``count``.

    Under ``torchrun`` every rank runs the same number of micro-batches (DDP's forward broadcasts
    buffers, SyncBatchNorm gathers), while each rank's samples call for their own number; a rank with
    fewer halves its largest micro-batches, each half trimmed to its own longest sample. A half
    holds no more than the whole did, so it fits where the whole did:

    >>> split_into([([1, 3], 40), ([2, 4, 0, 5], 12)], [5, 40, 12, 40, 7, 3], 4)
    [([1], 40), ([3], 40), ([2, 4], 12), ([0, 5], 5)]

    Raises:
        ValueError: ``count`` above the number of samples.
    """
    out = list(groups)
    samples = sum(len(idx) for idx, _ in out)
    if count > samples:
        raise ValueError(f"cannot cut {samples} samples into {count} micro-batches")
    while len(out) < count:
        i = max(range(len(out)), key=lambda j: (len(out[j][0]), -j))  # the largest, the first among equals
        idx = out[i][0]
        half = (len(idx) + 1) // 2
        out[i:i + 1] = [(part, max(lengths[k] for k in part)) for part in (idx[:half], idx[half:])]
    return out


def plan_length_split(lengths: Sequence[int], budget: Callable[[int], int]) -> list[tuple[list[int], int]]:
    """Cut samples into micro-batches, longest first, each trimmed to its own longest sample.

    ``lengths[i]`` is sample ``i``'s real length and ``budget(L)`` the largest micro-batch
    padded to ``L``. Samples are sorted by length, longest first (ties keep their order);
    each micro-batch starts at the longest sample left and takes as many as ``budget`` allows
    at that length. Returns ``[(sample indices, padded length), ...]``:

    >>> plan_length_split([5, 40, 12, 40, 7, 3], lambda L: 100 // L)
    [([1, 3], 40), ([2, 4, 0, 5], 12)]

    Raises:
        ValueError: a length that is not a positive int, or a sample that does not fit even alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -positive_int("each sample length", lengths[i]))
    out: list[tuple[list[int], int]] = []
    i = 0
    while i < len(order):
        longest = lengths[order[i]]
        room = budget(longest)
        if room < 1:
            raise ValueError(
                f"a sample of length {longest} does not fit even alone under the memory budget; truncate "
                "long samples, use a smaller model or mixed precision (amp='bf16'), or a larger device"
            )
        take = order[i:i + room]
        out.append((take, longest))
        i += len(take)
    return out


def choose_fit_lengths(lengths: tuple[int, ...], *, down_to: int | None = None) -> tuple[int, ...]:
    """The lengths to search at: up to three, from those within 8× of the longest.

    Much shorter sequences are left to the model: there the fixed memory (weights, optimizer
    state) hides the per-sample cost, and their lines say little about the long lengths that
    run out of memory. All of them up to three, else the shortest, the longest and the one
    nearest their geometric mean, the longer on a tie (all of ``lengths`` when fewer than two
    are within 8×):

    >>> choose_fit_lengths((128, 256, 512, 1024, 2048))
    (256, 1024, 2048)
    >>> choose_fit_lengths((16, 512))
    (16, 512)

    ``down_to`` replaces the 8× rule: the pool reaches down to the longest length at most
    ``down_to`` (the shortest if none is). Forward-only scoring, whose batches are largest where
    most of its requests are, measures there instead of extrapolating a quadratic down to it:

    >>> choose_fit_lengths((16, 43, 131, 388, 1020), down_to=45)
    (43, 131, 1020)
    """
    if down_to is None:
        near = tuple(L for L in lengths if 8 * L >= lengths[-1])
    else:
        floor = max((L for L in lengths if L <= down_to), default=lengths[0])
        near = tuple(L for L in lengths if L >= floor)
    pool = near if len(near) >= 2 else lengths
    if len(pool) <= 3:
        return pool
    middle = math.sqrt(pool[0] * pool[-1])
    # ties go to the longer length: memory runs out at the long end
    mid = min(pool[1:-1], key=lambda L: (round(abs(math.log(L / middle)), 9), -L))
    return (pool[0], mid, pool[-1])
