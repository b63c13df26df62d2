"""The engine's sizing by sequence length: each step's micro-batch from its padded length, before it runs.

The engine calls a :class:`LengthSizer` at three points: :meth:`LengthSizer.size_step` before a
step (read the length, verify it by a real search when it is beyond the longest verified one,
set the micro-batch), :meth:`LengthSizer.cut` inside it (length-aware splitting, opt-in), and
:meth:`LengthSizer.observe` / :meth:`LengthSizer.on_oom` after an attempt (a model that
under-predicted is derated). The model itself is :mod:`batchpilot.lengths`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._checks import check_int
from .batch import BatchSplitter, to_device
from .find_lengths import LengthPlan
from .lengths import LengthBudget, UnverifiedLengthError, fit_lengths
from .memory import format_bytes
from .seqbatch import LengthFn, gather_rows, padded_length, sample_lengths, trim_batch

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["LengthConfig", "LengthSizer", "make_sizer"]

logger = logging.getLogger(__name__)

#: lines refitted after a verification: the longest lengths, where memory runs out first
_REFIT_LENGTHS = 3


@dataclass(kw_only=True)
class LengthConfig:
    """How the engine reads and uses each batch's sequence length.

    Attributes:
        seq_dim: the dimension of the batch's tensors that holds the tokens; ``None``: the width
            of a dict batch's ``attention_mask`` (trimming then uses dim 1).
        length_fn: ``length_fn(batch) -> padded length``, instead of reading a dimension.
        split: length-aware splitting (Hugging Face dict batches, right-padded): sort the
            samples by real length, cut micro-batches that each fit at their own longest sample,
            trim each to it. With a ``(sum, count)`` loss the update is the full batch's.
        beyond: a batch longer than the longest verified length: ``"verify"`` runs a real search
            at its length on its samples first (state put back), ``"error"`` raises
            :class:`~batchpilot.lengths.UnverifiedLengthError`.

    Raises:
        ValueError: ``seq_dim`` below 1, a ``length_fn`` that is not callable, an unknown ``beyond``.
    """

    seq_dim: int | None = None
    length_fn: LengthFn | None = None
    split: bool = False
    beyond: Literal["verify", "error"] = "verify"

    def __post_init__(self) -> None:
        if self.seq_dim is not None:
            check_int("seq_dim", self.seq_dim, minimum=1, hint=" (dim 0 is the batch)")
        if self.length_fn is not None and not callable(self.length_fn):
            raise ValueError(f"length_fn must be a function batch -> padded length, got {self.length_fn!r}")
        if not isinstance(self.split, bool):
            raise ValueError(f"split must be True or False, got {self.split!r}")
        if self.beyond not in ("verify", "error"):
            raise ValueError(f"beyond must be 'verify' or 'error', got {self.beyond!r}")

    @property
    def trim_dim(self) -> int:
        return 1 if self.seq_dim is None else self.seq_dim

    @property
    def token_dim(self) -> int | None:
        """The dim whose size is the padded length; ``None`` when only ``length_fn`` knows it."""
        if self.seq_dim is not None:
            return self.seq_dim
        return None if self.length_fn is not None else 1


def make_sizer(engine: Engine, lengths: LengthConfig | bool | None, plan: Any) -> LengthSizer | None:
    """The engine's sizer, or ``None`` (no ``lengths`` and no :class:`LengthPlan` start).

    Raises:
        ValueError: ``lengths`` with a fixed micro-batch, a ``start`` that is an int, several
            ranks or FSDP, or of the wrong type.
    """
    if lengths is None or lengths is False:
        if not isinstance(plan, LengthPlan):
            return None
        lengths = LengthConfig(seq_dim=plan.seq_dim if plan.seq_dim != 1 else None)
    elif lengths is True:
        lengths = LengthConfig()
    elif not isinstance(lengths, LengthConfig):
        raise ValueError(f"lengths must be a LengthConfig, True or None, got {type(lengths).__name__}")
    if engine.fixed:
        raise ValueError('lengths= sizes the micro-batch by the length: it needs micro_batch_size="auto"')
    if engine._start is not None and engine.plan is None:
        raise ValueError(
            "start= with lengths= must be the LengthPlan of find_batch_size_for(..., lengths=...) (or None: the "
            "engine searches on the first batch); an int holds for one length only"
        )
    if engine.plan is not None and not isinstance(engine.plan, LengthPlan):
        raise ValueError("start= with lengths= must be a LengthPlan: find_batch_size_for(..., lengths=(...))")
    if engine.world_size > 1 or engine._fsdp:
        raise ValueError(
            "lengths= sizes micro-batches on one rank for now: ranks with different lengths would need to agree "
            "on every verification; leave lengths out under torchrun"
        )
    return LengthSizer(engine, lengths, engine.plan)


class LengthSizer:
    """Picks each step's micro-batch from its length; see the module docstring for the call order."""

    def __init__(self, engine: Engine, config: LengthConfig, plan: LengthPlan | None) -> None:
        self.engine = engine
        self.config = config
        self.budget: LengthBudget | None = None
        self.lines: dict[int, tuple[float, float]] = {}
        self.length: int | None = None  # this step's padded length
        self.sizes: list[int] = []  # each micro-batch's samples in the last attempt
        self.widths: list[int] = []  # and its padded length
        self.groups: list[list[int]] = []  # with split: each micro-batch's sample indices
        self.verifications = 0
        self._step_micro = 0
        if plan is not None:
            self.budget = plan.budget(engine.per_rank_batch_size)
            # the finder's trials ran one micro-batch each; a step that accumulates runs its later
            # micro-batches beside the gradients of the earlier ones
            self.budget.limit_bytes -= sum(p.numel() * p.element_size() for p in engine._params)
            self.lines = {L: (p.fit.fixed_bytes, p.fit.bytes_per_sample)
                          for L, p in plan.length_plans.items() if p.fit is not None}

    @property
    def splits(self) -> bool:
        return self.config.split

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What the sizer learnt, as lists, numbers and strings (``torch.load(weights_only=True)`` reads it).

        The budget (the fit, its limit and cap, the verified lengths and answers, the
        corrections) and the memory lines a later verification refits on; ``budget`` is
        ``None`` before the first step of an engine given no plan.
        """
        return {
            "budget": None if self.budget is None else self.budget.state_dict(),
            "lines": [[L, float(f), float(p)] for L, (f, p) in sorted(self.lines.items())],
            "verifications": self.verifications,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: no search again at a length it verified.

        The saved budget replaces one built from a ``start`` plan (it holds what the run
        learnt since). A state saved before the first step changes nothing.

        Raises:
            ValueError: not such a state (see :meth:`LengthBudget.from_state`).
        """
        if not isinstance(state, dict):
            raise ValueError(f"the engine state's 'lengths' must be LengthSizer.state_dict()'s dict, got {state!r}")
        if state.get("budget") is None:
            return
        budget = LengthBudget.from_state(state["budget"])
        lines = {}
        for line in state.get("lines", ()):
            if not (isinstance(line, (list, tuple)) and len(line) == 3):
                raise ValueError(f"each saved memory line must be [length, fixed_bytes, bytes_per_sample], "
                                 f"got {line!r}")
            lines[check_int("each line's length", line[0], minimum=1)] = (float(line[1]), float(line[2]))
        if self.budget is not None:
            logger.info("the checkpoint's length budget (verified up to %d) replaces the start plan's",
                        budget.verified_max)
        self.budget, self.lines = budget, lines
        self.verifications = int(state.get("verifications", 0))

    # ------------------------------------------------------------------ before the step
    def size_step(self, split: BatchSplitter) -> None:
        """Read the length, verify it if needed, and set the engine's micro-batch for this step.

        Raises:
            ValueError: the length cannot be read (see :func:`batchpilot.seqbatch.padded_length`).
            UnverifiedLengthError: beyond the verified maximum with ``beyond="error"``.
            batchpilot.find.NothingFitsError: a verification finds that not one sample fits.
        """
        e = self.engine
        cfg = self.config
        L = padded_length(split, seq_dim=cfg.seq_dim, length_fn=cfg.length_fn, layout=e.layout)
        self.length = L
        if self.budget is None:
            if cfg.split:
                sample_lengths(split.batch)  # a batch the split cannot read fails before any search
            self._first_fit(split, L)
        elif L > self.budget.verified_max:
            if cfg.beyond == "error":
                raise UnverifiedLengthError(L, self.budget.verified_max)
            self._verify(split, L)
        allowed = self.budget.micro_batch(L)
        micro = max(1, min(allowed, e.per_rank_batch_size))
        if e.policy is None:
            e._make_policy(micro)
        else:
            e.policy.adopt(micro)
        e.micro_batch_size = self._step_micro = e.policy.micro
        e.micro_batch_reason = f"sized for length {L}: the memory model allows {allowed} samples"

    def _search_lines(self, split: BatchSplitter, L: int) -> int:
        """A real search on ``split`` (padded to ``L``); its line joins the model's. Returns the fitting batch."""
        plan = self.engine._search(split, accumulating=True, timed_steps=0)
        if plan.fit is not None and plan.fit.bytes_per_sample > 0:
            self.lines[L] = (plan.fit.fixed_bytes, plan.fit.bytes_per_sample)
        if self.engine.plan is None:
            self.engine.plan = plan
        self.limit = plan.limit_bytes
        return int(plan.largest_fitting or plan.batch_size)

    def _refit(self) -> Any:
        longest = sorted(self.lines)[-_REFIT_LENGTHS:]
        return fit_lengths({L: self.lines[L] for L in longest})

    def _first_fit(self, split: BatchSplitter, L: int) -> None:
        """No plan given: searches at this batch's length and its half and quarter (trimmed)."""
        e = self.engine
        if self.config.length_fn is not None and self.config.seq_dim is None:
            raise ValueError(
                "length_fn alone cannot build the shorter batches the first fit needs; declare seq_dim= too, or "
                "pass start=find_batch_size_for(..., lengths=(...))"
            )
        fit_at = sorted({L, max(1, L // 2), max(1, L // 4)}, reverse=True)
        if len(fit_at) < 2:
            raise ValueError(f"the first batch is {L} token long: too short to fit a memory model over lengths; "
                             "pass start=find_batch_size_for(..., lengths=(...))")
        verified = {}
        for length in fit_at:
            sub = split if length == L else BatchSplitter(
                trim_batch(split, length, seq_dim=self.config.trim_dim, width=L, copy=True), e.layout)
            verified[length] = self._search_lines(sub, length)
        if len(self.lines) < 2:
            raise ValueError(
                f"the searches at lengths {fit_at} measured fewer than two memory lines (a batch of {split.size} "
                "samples is too small to measure); pass start=find_batch_size_for(..., lengths=(...))"
            )
        self.budget = LengthBudget(fit=self._refit(), limit_bytes=self.limit, verified=verified,
                                   max_batch_size=e.per_rank_batch_size)
        logger.info("memory over lengths fitted at %s: %s", fit_at, self.budget.fit)

    def _verify(self, split: BatchSplitter, L: int) -> None:
        assert self.budget is not None
        logger.info("length %d is beyond the verified %d: verifying it by a real search on this batch",
                    L, self.budget.verified_max)
        fits = self._search_lines(split, L)
        self.verifications += 1
        limit = self.budget.limit_bytes
        self.budget.fit = self._refit()
        self.budget.limit_bytes = limit  # a derating learnt so far stays
        self.budget.verify(L, fits)

    # ------------------------------------------------------------------ inside the step
    def cut(self, split: BatchSplitter, micro: int, sizes: list[int]) -> tuple[list[int], list[int] | None]:
        """The attempt's micro-batches: ``(sizes, padded lengths)``; lengths ``None`` without ``split``.

        Without ``split`` every micro-batch is a slice at the batch's length. With it, the
        samples are sorted by real length and cut by :func:`~batchpilot.lengths.plan_length_split`
        (:meth:`take` builds each), each micro-batch's budget scaled by how far an OOM retry
        has shrunk ``micro``.
        """
        if not self.config.split:
            self.sizes, self.widths = list(sizes), [self.length] * len(sizes)
            return sizes, None
        from .lengths import plan_length_split

        assert self.budget is not None and self.length is not None
        real = sample_lengths(split.batch)
        per_rank = self.engine.per_rank_batch_size
        shrink = min(1.0, micro / self._step_micro) if self._step_micro else 1.0

        def budget(L: int) -> int:
            return max(1, math.floor(min(self.budget.micro_batch(L), per_rank) * shrink))

        groups = plan_length_split(real, budget)
        self.groups = [idx for idx, _ in groups]
        self.sizes, self.widths = [len(idx) for idx, _ in groups], [w for _, w in groups]
        return self.sizes, self.widths

    def take(self, split: BatchSplitter, i: int, device: Any) -> Any:
        """Micro-batch ``i`` of the split: its samples gathered, trimmed to its width, on ``device``.

        Trimmed before gathering, so the only copy is the micro-batch itself (``b × width``).
        """
        narrow = BatchSplitter(self.trim(split.batch, self.widths[i]), self.engine.layout)
        return to_device(gather_rows(narrow, self.groups[i]), device)

    def trim(self, micro_batch: Any, width: int) -> Any:
        """A micro-batch narrowed to ``width`` tokens (a no-op at the batch's own length)."""
        if width == self.length:
            return micro_batch
        return trim_batch(micro_batch, width, seq_dim=self.config.trim_dim, width=self.length,
                          layout=self.engine.layout)

    # ------------------------------------------------------------------ after an attempt
    def _predicted(self) -> tuple[float, int]:
        """The model's largest micro-batch peak in the last attempt, and that micro-batch's length."""
        assert self.budget is not None
        fit = self.budget.fit
        return max(((fit.peak(b, w), w) for b, w in zip(self.sizes, self.widths)), default=(0.0, 0))

    def observe(self, peak: int, capacity: int) -> bool:
        """A clean attempt peaked at ``peak``: correct the model near its length if it went over the target.

        Returns True on memory pressure (over ``high_water``).
        """
        e = self.engine
        pressure = peak > e.config.high_water * capacity
        if self.budget is not None and self.sizes and peak > e.target * capacity:
            predicted, width = self._predicted()
            if peak > predicted > 0:
                budget = self.budget
                factor = peak / predicted
                # which micro-batch peaked is not measured: every length the model sized takes the
                # correction; only when a verified length was all there was does its answer shrink
                modelled = {w for w in self.widths if w not in budget.verified}
                for w in modelled:
                    budget.correct(w, factor)
                if not modelled:
                    budget.verified[width] = max(1, math.floor(budget.verified[width] / factor))
                logger.warning("lengths %s: the step peaked at %s, over the target %.0f%% of %s, %.2fx the model's "
                               "%s; %s", sorted(set(self.widths)), format_bytes(peak), 100 * e.target,
                               format_bytes(capacity), factor, format_bytes(predicted),
                               f"lengths near {sorted(modelled)} are sized for that from now on" if modelled
                               else f"the verified answer at {width} is now {budget.verified[width]}")
        return pressure

    def on_oom(self, capacity: int) -> None:
        """An attempt ran out of memory: the model over-promised at this length; derate it."""
        if self.budget is None or not self.sizes:
            return
        predicted, _ = self._predicted()
        if 0 < predicted < capacity:
            self._derate(predicted / capacity, f"out of memory although the model predicted {format_bytes(predicted)} "
                                               f"of {format_bytes(capacity)}")

    def _derate(self, factor: float, why: str) -> None:
        """Scale the budget's limit by ``factor`` (< 1); verified answers above the new model's are cut to it."""
        budget = self.budget
        assert budget is not None
        budget.limit_bytes *= factor
        for L, b in budget.verified.items():
            budget.verified[L] = max(1, min(b, budget.fit.max_batch(L, budget.limit_bytes)))
        logger.warning("length %s: %s; derating the model's limit to %s", self.length, why,
                       format_bytes(budget.limit_bytes))
