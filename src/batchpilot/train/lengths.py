"""The engine's sizing by sequence length: each step's micro-batch from its padded length, before it runs.

The engine calls a :class:`LengthSizer` at three points: :meth:`LengthSizer.size_step` before a
step (read the length, verify it by a real search when it is beyond the longest verified one,
return the micro-batch the model allows, a :class:`LengthStep` the engine applies, then
:meth:`LengthSizer.start_step` with the micro-batch it adopted), :meth:`LengthSizer.cut` inside
it (length-aware splitting, opt-in), and :meth:`LengthSizer.observe` / :meth:`LengthSizer.on_oom`
after an attempt (a model that under-predicted is derated). The sizer knows the engine only by
what it is given: the searches run through the ``search`` function it is built with. The model
itself is :mod:`batchpilot.policy.lengths`.

Under ``torchrun`` (DDP) every rank must run as many micro-batches (DDP's forward broadcasts
buffers, SyncBatchNorm gathers statistics), so every rank holds the same budget: the step is
sized for the longest of the ranks' batches (one all-reduce), a verification searches on every
rank and keeps the line of the rank that holds that length, and what an attempt teaches
(corrections, derating) is exchanged as events that every rank applies alike, the most cautious
of each kind. With ``split=True`` each rank cuts its own samples, then the ranks with fewer
micro-batches halve their largest until all have as many.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch.distributed as dist

from .._checks import check_int
from ..core.batch import BatchLayout, BatchSplitter, to_device
from ..core.ranks import group_size
from ..core.seqbatch import LengthFn, gather_rows, padded_length, sample_lengths, trim_batch
from ..find.lengths import LengthPlan
from ..find.notes import note_length_search
from ..find.result import BatchPlan
from ..memory.units import format_bytes
from ..policy.lengths import LengthBudget, UnverifiedLengthError, fit_lengths, split_into

__all__ = ["LengthConfig", "LengthSizer", "LengthStep", "make_sizer"]

logger = logging.getLogger(__name__)

#: lines refitted after a verification: the longest lengths, where memory runs out first
_REFIT_LENGTHS = 3


@dataclass(kw_only=True)
class LengthConfig:
    """How the engine reads and uses each batch's sequence length.

    Attributes:
        seq_dim: the dimension of the batch's tensors that holds the tokens; ``None``: the
            ``start`` plan's (the dim its example was trimmed on), else the width of a dict
            batch's ``attention_mask`` (trimming then uses dim 1).
        length_fn: ``length_fn(batch) -> padded length``, instead of reading a dimension.
        split: length-aware splitting (Hugging Face dict batches, right-padded): sort the
            samples by real length, cut micro-batches that each fit at their own longest sample,
            trim each to it. A sample's real length comes from its ``attention_mask``, or without
            one from its ``labels`` (up to the last that is not -100: exact for a causal LM, see
            :func:`~batchpilot.core.seqbatch.sample_lengths`). With a ``(sum, count)`` loss the
            update is the full batch's.
        beyond: a batch longer than the longest verified length: ``"verify"`` runs a real search
            at its length on its samples first (state put back), ``"error"`` raises
            :class:`~batchpilot.policy.lengths.UnverifiedLengthError`.

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


def _accumulating_line(plan: BatchPlan) -> tuple[float, float] | None:
    """``(fixed, per_sample)`` of an engine search at one length, for micro-batches that accumulate.

    A trial at micro-batch ``b`` runs the whole per-rank batch in micro-batches of ``b``. At the
    per-rank batch itself it runs one, which holds no gradients from an earlier micro-batch, so it
    peaks lower than the line of the smaller sizes -- under the size below it, for a float64 model
    at 8 samples (its 7 + 1 held a copy of the gradients). When the search stopped there (the whole
    batch fits), the line is the one through the two largest measured sizes below it, the regime
    a model sizes micro-batches in; otherwise the search's own line. ``None`` when neither rises.
    """
    fit = plan.fit
    line = None if fit is None or fit.bytes_per_sample <= 0 else (float(fit.fixed_bytes), float(fit.bytes_per_sample))
    if plan.stop_reason != "max_batch_size":
        return line
    below = {t.batch_size: float(t.peak_bytes) for t in plan.trials if t.measured and t.batch_size < plan.batch_size}
    if len(below) < 2:
        return line
    x, y = sorted(below)[-2:]
    slope = (below[y] - below[x]) / (y - x)
    return line if slope <= 0 else (below[x] - slope * x, slope)


@dataclass(frozen=True)
class LengthStep:
    """What :meth:`LengthSizer.size_step` decided for a step; the engine applies it.

    Attributes:
        length: the padded length the step is sized for (the longest rank's).
        allowed: the micro-batch the memory model allows at that length.
        micro_batch_size: ``allowed`` within ``[1, per-rank batch]``: the step's micro-batch.
    """

    length: int
    allowed: int
    micro_batch_size: int

    @property
    def reason(self) -> str:
        return f"sized for length {self.length}: the memory model allows {self.allowed} samples"


def make_sizer(
    lengths: LengthConfig | bool | None, plan: BatchPlan | None, *, start: int | None, fixed: bool,
    search: Callable[[BatchSplitter], BatchPlan], layout: BatchLayout, per_rank: int, param_bytes: int,
    target: float, high_water: float, world: int, group: Any,
) -> LengthSizer | None:
    """The engine's sizer, or ``None`` (no ``lengths`` and no :class:`LengthPlan` start).

    ``plan`` and ``start`` are the engine's start (the plan it was given, and the first
    micro-batch as an int); ``fixed``: its micro-batch is fixed. The other arguments are
    :class:`LengthSizer`'s. A ``fully_shard`` model is sized as any other: the engine's searches
    run in lockstep through its FSDP coordinator.

    Raises:
        ValueError: ``lengths`` with a fixed micro-batch, a ``start`` that is an int, or of the
            wrong type.
    """
    if lengths is None or lengths is False:
        if not isinstance(plan, LengthPlan):
            return None
        lengths = LengthConfig()
    elif lengths is True:
        lengths = LengthConfig()
    elif not isinstance(lengths, LengthConfig):
        raise ValueError(f"lengths must be a LengthConfig, True or None, got {type(lengths).__name__}")
    if isinstance(plan, LengthPlan) and plan.seq_dim is not None and lengths.seq_dim is None \
            and lengths.length_fn is None:
        # the plan's batches were trimmed on this dim: the engine's are read on it too (a batch
        # without an attention_mask has no other length to read)
        lengths = dataclasses.replace(lengths, seq_dim=plan.seq_dim)
    if fixed:
        raise ValueError('lengths= sizes the micro-batch by the length: it needs micro_batch_size="auto"')
    if start is not None and plan is None:
        raise ValueError(
            "start= with lengths= must be the LengthPlan of find_batch_size_for(..., lengths=...) (or None: the "
            "engine searches on the first batch); an int holds for one length only"
        )
    if plan is not None and not isinstance(plan, LengthPlan):
        raise ValueError("start= with lengths= must be a LengthPlan: find_batch_size_for(..., lengths=(...))")
    return LengthSizer(lengths, plan, search=search, layout=layout, per_rank=per_rank, param_bytes=param_bytes,
                       target=target, high_water=high_water, world=world, group=group)


class LengthSizer:
    """Picks each step's micro-batch from its length; see the module docstring for the call order.

    Args:
        config: how lengths are read and used.
        plan: the finder's plan over lengths, or ``None`` (the first step fits one).
        search: a real search on a batch's samples, all state put back (the engine's finder,
            accumulating as a step does); its plan's fit and answer join the model.
        layout: how the engine cuts a batch into micro-batches.
        per_rank: the per-rank batch at construction (each :meth:`size_step` gives the current one).
        param_bytes: bytes of the trained parameters' gradients, held beside later micro-batches.
        target: the fraction of capacity a step may peak at before the model is corrected.
        high_water: a step above ``high_water × capacity`` is memory pressure.
        world: data-parallel ranks; ``group``: their process group (``None``: the default).
    """

    def __init__(self, config: LengthConfig, plan: LengthPlan | None, *,
                 search: Callable[[BatchSplitter], BatchPlan], layout: BatchLayout, per_rank: int,
                 param_bytes: int, target: float, high_water: float, world: int, group: Any) -> None:
        self.config = config
        self.layout = layout
        self.target = target
        self.high_water = high_water
        self.budget: LengthBudget | None = None
        self.lines: dict[int, tuple[float, float]] = {}
        self.length: int | None = None  # the padded length this step is sized for (the longest rank's)
        self.width: int | None = None  # this rank's batch's padded length
        self.sizes: list[int] = []  # each micro-batch's samples in the last attempt
        self.widths: list[int] = []  # and its padded length
        self.groups: list[list[int]] = []  # with split: each micro-batch's sample indices
        self.verifications = 0
        self._search = search
        self._per_rank = per_rank
        self._step_micro = 0
        # each search's largest fitting batch by length, and whether it stopped at the batch cap
        self._found: dict[int, tuple[int, bool]] = {}
        self._group = group
        self._world = world
        self._events: list[tuple] = []  # what this rank learnt since the last exchange (several ranks)
        self._owner = True  # this rank holds the step's length (its search lines are the ones kept)
        self._synced = self._world == 1
        self._retry = False  # the step's next cut follows an attempt (whose lessons are to exchange)
        if plan is not None:
            self.budget = plan.budget(per_rank)
            # the finder's trials ran one micro-batch each; a step that accumulates runs its later
            # micro-batches beside the gradients of the earlier ones
            self.budget.limit_bytes -= param_bytes
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
    def size_step(self, split: BatchSplitter, per_rank: int) -> LengthStep:
        """Read the length, verify it if needed: the micro-batch for this step, of at most ``per_rank``.

        The engine adopts it and calls :meth:`start_step` with what it adopted.

        Raises:
            ValueError: the length cannot be read (see :func:`batchpilot.core.seqbatch.padded_length`).
            UnverifiedLengthError: beyond the verified maximum with ``beyond="error"``.
            batchpilot.policy.search.NothingFitsError: a verification finds that not one sample fits.
        """
        cfg = self.config
        self._per_rank = per_rank
        L = self.width = padded_length(split, seq_dim=cfg.seq_dim, length_fn=cfg.length_fn, layout=self.layout)
        if self._world > 1:
            L = self._agree_length(L)
        self.length = L
        if self.budget is None:
            if cfg.split:
                sample_lengths(split.batch)  # a batch the split cannot read fails before any search
            self._first_fit(split, L)
        elif L > self.budget.verified_max:
            if cfg.beyond == "error":
                raise UnverifiedLengthError(L, self.budget.verified_max)
            self._verify(split, L)
        self.budget.raise_cap(per_rank)  # a schedule may have grown the per-rank batch
        allowed = self.budget.micro_batch(L)
        return LengthStep(length=L, allowed=allowed, micro_batch_size=max(1, min(allowed, per_rank)))

    def start_step(self, micro: int) -> None:
        """The step runs at ``micro`` (what the engine adopted from :meth:`size_step`); a retry's cut shrinks from it."""
        self._step_micro = micro
        self._retry = False

    def _search_lines(self, split: BatchSplitter, L: int, ran: list[int]) -> None:
        """A real search on ``split`` (padded to ``L``): its line joins the model's, its answer ``_found[L]``.

        With several ranks every rank searches (the answers are agreed), and the line and answer
        kept are those of the rank whose batch is ``L`` long; :meth:`_exchange` delivers them.
        An error keeps its type and gains a note naming ``L`` and the longest of ``ran``.
        """
        try:
            plan = self._search(split)
        except Exception as exc:
            note_length_search(exc, L, ran)
            raise
        if self._owner:
            line = _accumulating_line(plan)
            self._emit(("search", L, line, int(plan.largest_fitting or plan.batch_size), int(plan.limit_bytes),
                        plan.stop_reason == "max_batch_size"))

    def _refit(self) -> Any:
        longest = sorted(self.lines)[-_REFIT_LENGTHS:]
        return fit_lengths({L: self.lines[L] for L in longest})

    def _first_fit(self, split: BatchSplitter, L: int) -> None:
        """No plan given: searches at this batch's length and its half and quarter (trimmed)."""
        if self.config.length_fn is not None and self.config.seq_dim is None:
            raise ValueError(
                "length_fn alone cannot build the shorter batches the first fit needs; declare seq_dim= too, or "
                "pass start=find_batch_size_for(..., lengths=(...))"
            )
        fit_at = sorted({L, max(1, L // 2), max(1, L // 4)}, reverse=True)
        if len(fit_at) < 2:
            raise ValueError(f"the first batch is {L} token long: too short to fit a memory model over lengths; "
                             "pass start=find_batch_size_for(..., lengths=(...))")
        for i, length in enumerate(fit_at):
            # a rank whose batch is shorter than the length searches at its own (only the owner's line is kept)
            sub = split if length >= self.width else BatchSplitter(
                trim_batch(split, length, seq_dim=self.config.trim_dim, width=self.width, copy=True), self.layout)
            self._search_lines(sub, length, fit_at[:i])
        self._exchange()
        verified = {length: self._found[length][0] for length in fit_at}
        if len(self.lines) < 2:
            raise ValueError(
                f"the searches at lengths {fit_at} measured fewer than two memory lines (a batch of {split.size} "
                "samples is too small to measure); pass start=find_batch_size_for(..., lengths=(...))"
            )
        self.budget = LengthBudget(fit=self._refit(), limit_bytes=self.limit, verified=verified,
                                   max_batch_size=self._per_rank,
                                   capped={length for length in fit_at if self._found[length][1]})
        logger.info("memory over lengths fitted at %s: %s", fit_at, self.budget.fit)

    def _verify(self, split: BatchSplitter, L: int) -> None:
        assert self.budget is not None
        logger.info("length %d is beyond the verified %d: verifying it by a real search on this batch",
                    L, self.budget.verified_max)
        self._search_lines(split, L, sorted(self.budget.verified))
        self._exchange()
        self.verifications += 1
        limit = self.budget.limit_bytes
        self.budget.fit = self._refit()
        self.budget.limit_bytes = limit  # a derating learnt so far stays
        fits, capped = self._found[L]
        self.budget.verify(L, fits, capped=capped)

    # ------------------------------------------------------------------ inside the step
    def cut(self, split: BatchSplitter, micro: int, sizes: list[int]) -> tuple[list[int], list[int] | None]:
        """The attempt's micro-batches: ``(sizes, padded lengths)``; lengths ``None`` without ``split``.

        Without ``split`` every micro-batch is a slice at the batch's length. With it, the
        samples are sorted by real length and cut by :func:`~batchpilot.policy.lengths.plan_length_split`
        (:meth:`take` builds each), each micro-batch's budget scaled by how far an OOM retry
        has shrunk ``micro``.
        """
        if self._world > 1 and self._retry:
            self._exchange()  # a retry is cut by what every rank's attempt taught
        self._retry = True
        if not self.config.split:
            self.sizes, self.widths = list(sizes), [self.length] * len(sizes)
            return sizes, None
        from ..policy.lengths import plan_length_split

        assert self.budget is not None and self.length is not None
        real = sample_lengths(split.batch)
        per_rank = self._per_rank
        shrink = min(1.0, micro / self._step_micro) if self._step_micro else 1.0

        def budget(L: int) -> int:
            return max(1, math.floor(min(self.budget.micro_batch(L), per_rank) * shrink))

        groups = plan_length_split(real, budget)
        if self._world > 1:  # as many micro-batches on every rank
            from ..dist.distributed import all_reduce_int

            groups = split_into(groups, real, all_reduce_int(len(groups), "max", group=self._group))
        self.groups = [idx for idx, _ in groups]
        self.sizes, self.widths = [len(idx) for idx, _ in groups], [w for _, w in groups]
        return self.sizes, self.widths

    def take(self, split: BatchSplitter, i: int, device: Any) -> Any:
        """Micro-batch ``i`` of the split: its samples gathered, trimmed to its width, on ``device``.

        Trimmed before gathering, so the only copy is the micro-batch itself (``b × width``).
        """
        narrow = BatchSplitter(self.trim(split.batch, self.widths[i]), self.layout)
        return to_device(gather_rows(narrow, self.groups[i]), device)

    def trim(self, micro_batch: Any, width: int) -> Any:
        """A micro-batch narrowed to ``width`` tokens (a no-op at the batch's own length)."""
        if width == self.width:
            return micro_batch
        return trim_batch(micro_batch, width, seq_dim=self.config.trim_dim, width=self.width,
                          layout=self.layout)

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
        pressure = peak > self.high_water * capacity
        if self.budget is not None and self.sizes and peak > self.target * capacity:
            predicted, width = self._predicted()
            if peak > predicted > 0:
                budget = self.budget
                factor = peak / predicted
                # which micro-batch peaked is not measured: every length the model sized takes the
                # correction; only when a verified length was all there was does its answer shrink
                modelled = {w for w in self.widths if w not in budget.verified}
                for w in sorted(modelled):
                    self._emit(("correct", w, factor))
                if not modelled:
                    self._emit(("cut_verified", width, factor))
                logger.warning("lengths %s: the step peaked at %s, over the target %.0f%% of %s, %.2fx the model's "
                               "%s; %s", sorted(set(self.widths)), format_bytes(peak), 100 * self.target,
                               format_bytes(capacity), factor, format_bytes(predicted),
                               f"lengths near {sorted(modelled)} are sized for that from now on" if modelled
                               else f"the verified answer at {width} is cut by that")
        return pressure

    def on_oom(self, capacity: int) -> None:
        """An attempt ran out of memory: the model over-promised at this length; derate it."""
        if self.budget is None or not self.sizes:
            return
        predicted, _ = self._predicted()
        if 0 < predicted < capacity:
            logger.warning("length %s: out of memory although the model predicted %s of %s", self.length,
                           format_bytes(predicted), format_bytes(capacity))
            self._emit(("derate", predicted / capacity))

    def _derate(self, factor: float) -> None:
        """Scale the budget's limit by ``factor`` (< 1); verified answers above the new model's are cut to it."""
        budget = self.budget
        assert budget is not None
        budget.limit_bytes *= factor
        for L, b in budget.verified.items():
            budget.verified[L] = max(1, min(b, budget.fit.max_batch(L, budget.limit_bytes)))
        logger.warning("derating the length model's limit to %s", format_bytes(budget.limit_bytes))

    # ------------------------------------------------------------------ one budget on every rank
    def _emit(self, event: tuple) -> None:
        """Apply what was learnt now (one rank), or at the next exchange on every rank."""
        if self._world == 1:
            self._apply([event])
        else:
            self._events.append(event)

    def _apply(self, events: list[tuple]) -> None:
        """Apply events, merged: each search's line, the strongest derating, the largest correction per length."""
        derate: float | None = None
        corrections: dict[tuple[str, int], float] = {}
        for event in events:
            kind = event[0]
            if kind == "search":
                _, L, line, fits, limit, capped = event
                if line is not None:
                    self.lines[L] = tuple(line)
                self._found[L], self.limit = (fits, capped), limit
            elif kind == "derate":
                derate = event[1] if derate is None else min(derate, event[1])
            else:  # "correct" or "cut_verified", at a length
                key = (kind, event[1])
                corrections[key] = max(corrections.get(key, 0.0), event[2])
        if self.budget is None:
            return
        if derate is not None:
            self._derate(derate)
        for (kind, L), factor in sorted(corrections.items()):
            if kind == "correct":
                self.budget.correct(L, factor)
            elif L in self.budget.verified:
                self.budget.verified[L] = max(1, math.floor(self.budget.verified[L] / factor))

    def _exchange(self) -> None:
        """Every rank applies every rank's events (several ranks; every rank calls it at the same point)."""
        if self._world == 1:
            return
        from ..dist.distributed import all_reduce_int

        if not all_reduce_int(len(self._events), "max", group=self._group):
            return
        gathered: list[Any] = [None] * group_size(self._group)
        dist.all_gather_object(gathered, self._events, group=self._group)
        self._events = []
        self._apply([event for events in gathered for event in events])

    def _agree_length(self, width: int) -> int:
        """The longest of the ranks' padded lengths (after one state from rank 0 on the first step)."""
        from ..dist.distributed import all_reduce_ints

        if not self._synced:  # per-rank plans or checkpoints may differ: rank 0's holds for all
            state = [self.state_dict()]
            dist.broadcast_object_list(state, src=dist.get_global_rank(self._group, 0) if self._group else 0,
                                       group=self._group)
            if dist.get_rank(self._group) != 0:
                self.load_state_dict(state[0])
            self._synced = True
        rank, world = dist.get_rank(self._group), self._world
        # one all-reduce: the longest width and, among the ranks that hold it, the lowest rank
        key, pending = all_reduce_ints([width * world + (world - 1 - rank), len(self._events)], "max",
                                        group=self._group)
        longest, self._owner = key // world, world - 1 - key % world == rank
        if pending:
            self._exchange()
        return longest
