"""Scoring by length: forward-only requests of varying length, longest first, each batch sized for its own length.

Log-likelihoods, perplexity, embeddings: every request is one row of a padded forward with no
gradient, and what a batch of ``b`` requests padded to ``L`` needs is the (batch, length) model of
:mod:`batchpilot.policy.lengths`. :class:`LengthScorer` fits it by real searches
(:func:`batchpilot.find.finder.find_batch_size`) at two or three of the requests' own lengths, each
trial a window of real requests whose results are kept, then runs the rest longest first in batches
that each fit at their own padded length, and returns the results in input order. A batch that runs
out of memory anyway is split and retried (its requests produced nothing, so none is lost or run
twice), and the model is derated for the batches after it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Sequence, TypeVar

import torch

from .._checks import check_int, positive_int
from .._progress import stage
from ..find import timing
from ..find.finder import find_batch_size
from ..find.options import FindOptions
from ..find.lengths import LengthPlan
from ..find.notes import note_length_search
from ..find.result import BatchPlan
from ..memory.gauge import Gauge, gauge_for
from ..memory.host import malloc_threshold_held
from ..memory.oom import attempt, free_memory
from ..memory.probes import emulate_capacity
from ..memory.tracker import active_tracker
from ..memory.units import format_bytes, resolve_device
from ..policy.evidence import BatchingCheck, OverheadFit, fit_overhead
from ..policy.lengths import LengthBudget, LengthFit, choose_fit_lengths, fit_lengths
from ..policy.search import BatchSizeError, NothingFitsError
from ..policy.speed import SPEED_TOLERANCE
from .ranks import exchange

__all__ = ["ScoreBatch", "LengthScorer", "batch_end", "score_by_length"]

logger = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")

#: a request window smaller than this at a length is no place to fit a memory line
_MIN_WINDOW = 2
#: a search stops within this share of the boundary: the model sizes every other length anyway
_SEARCH_TOLERANCE = 0.05
#: the least an OOM corrects the model by near its length
_OOM_CORRECTION = 1.25
#: a call's fixed cost near a length is measured on the batches within this factor of it
_TIME_BAND = 2.0
#: how batches are cut without a time line that holds
_UNTIMED = "batched by length alone (requests at least half as long as the first)"
#: the model's limit is lowered by this many times the searches' largest distance of a peak from its line
_SCATTER_MARGIN = 2.0


@dataclass
class ScoreBatch:
    """One call of ``run_batch`` while scoring.

    Attributes:
        size: requests in the batch.
        length: its padded length (its longest request's).
        trial: run by a sizing search.
        kept: a trial whose results were kept (the largest window that completed at its length;
            with ``pads``, every completed trial with a request no earlier one ran).
        oom: it ran out of memory (its requests were run again in smaller batches).
        peak_bytes: the peak of the memory figure that fails on the device, when measured.
        seconds: wall time of the call, when measured (not for trials).
        predicted: the seconds the measured call overhead predicted for it, when it was batched
            by that (``None``: batched by length alone).
    """

    size: int
    length: int
    trial: bool = False
    kept: bool = False
    oom: bool = False
    peak_bytes: int | None = None
    seconds: float | None = None
    predicted: float | None = None


class LengthScorer(Generic[R, T]):
    """Runs requests longest first, each batch sized for its padded length; keeps its memory model between calls.

    A later :meth:`score` whose longest request is no longer than the longest length verified so far
    reuses the model and runs no search; a longer one fits it again on its own requests.

    Args:
        run_batch: ``run_batch(requests) -> results``: the requests as one padded forward with no
            gradient, one result per request, in order (``run_batch(requests, length)`` with ``pads``).
        length: ``length(request) -> int``: the padded length the request needs.
        target: fraction of the device memory a batch's peak may use, in (0, 1] (default: ``FindOptions.target``).
        capacity: device memory to emulate (bytes or ``"24GiB"``; CPU and CUDA); ``None``: the
            device's real memory (or the capacity of an ``emulate_capacity`` the caller runs).
        device: the device ``run_batch`` computes on; default the current accelerator, else CPU.
        max_length: the longest request the model takes (its context); a longer one is refused
            before anything runs.
        max_batch_size: the most requests in one batch; ``None``: as many as fit.
        track: modules or tensors that exist before the first batch and count as memory in use
            under an emulated capacity (the model).
        agree: ``agree(obj) -> [obj of every rank]``: an all-gather over the ranks that score
            together (``torch.distributed.all_gather_object``); every rank calls it exactly once
            per :meth:`score`, however many requests it holds, and every rank then sizes each
            length by the most cautious rank's model. ``None``: one process.
        pads: ``run_batch(requests, length)`` pads every row to ``length`` (at least its longest
            request's): the sizing trials then run requests no trial ran before, none wasted.

    Attributes:
        budget: the per-length budget (``None`` before the first search).
        plan: the last sizing's searches (a :class:`~batchpilot.find.lengths.LengthPlan`).
        batches: every ``run_batch`` call of the last :meth:`score`, trials included.
        batching_reason: how the batches are cut by length, and why, in one line: by length
            alone (requests at least half as long as the first) until the calls' times fit a
            line ``fixed + per_token × tokens`` to within the speed tolerance, then by that line
            (a call's fixed cost against its padding), kept only if the next real calls take the
            time it predicts (:class:`~batchpilot.policy.evidence.BatchingCheck`), else by length
            alone for good.
        check: that check of the real calls (``None`` before the line is first used).

    Raises:
        ValueError: a ``run_batch`` or ``length`` that is not callable, a bad ``max_length`` or
            ``max_batch_size``.
        BatchSizeError: ``target`` outside (0, 1] or an unreadable ``capacity``.
    """

    def __init__(
        self,
        run_batch: Callable[[list[R]], Sequence[T]],
        *,
        length: Callable[[R], int],
        target: float | None = None,
        capacity: int | str | None = None,
        device: torch.device | str | int | None = None,
        max_length: int | None = None,
        max_batch_size: int | None = None,
        track: Iterable[Any] = (),
        agree: Callable[[Any], list[Any]] | None = None,
        pads: bool = False,
    ) -> None:
        if not callable(run_batch):
            raise ValueError(f"run_batch must be a function list of requests -> list of results, got {run_batch!r}")
        if not callable(length):
            raise ValueError(f"length must be a function request -> padded length, got {length!r}")
        options = FindOptions(**({} if target is None else {"target": target}), capacity=capacity)  # the finder's checks, before anything runs
        self.capacity: int | None = options.capacity  # type: ignore[assignment]
        self.run_batch, self.length, self.target = run_batch, length, float(options.target)
        self.device = resolve_device(device)
        if self.capacity is not None and self.device.type not in ("cpu", "cuda"):
            raise BatchSizeError(f"capacity= is emulated on cpu and cuda, not {self.device.type}; leave it out "
                                 "to size for the device's real memory")
        self.max_length = None if max_length is None else positive_int("max_length", max_length)
        self.max_batch_size = None if max_batch_size is None else positive_int("max_batch_size", max_batch_size)
        self.track = list(track)
        if agree is not None and not callable(agree):
            raise ValueError(f"agree must be a function obj -> [obj of every rank] (an all-gather), got {agree!r}")
        self.agree = agree
        if not isinstance(pads, bool):
            raise ValueError(f"pads must be True or False, got {pads!r}")
        self.pads = pads
        self.budget: LengthBudget | None = None
        self.plan: LengthPlan | None = None
        self.batches: list[ScoreBatch] = []
        self._calls: dict[tuple[int, int], list[float]] = {}  # {(padded length, tokens): seconds of each call}
        self.check: BatchingCheck | None = None
        self._checked: OverheadFit | None = None  # the line under check, held as it was nominated
        self.batching_reason = (f"{_UNTIMED}: no line through the calls' times predicts them within "
                                f"{SPEED_TOLERANCE:.0%}")
        self._others: list[LengthBudget] = []  # the other ranks' budgets, from the last agreement

    # ------------------------------------------------------------------ the public call
    def score(self, requests: Sequence[R]) -> list[T]:
        """The result of every request, in input order.

        An empty list returns ``[]`` and runs nothing (with ``agree``, this rank still takes part
        in the agreement).

        Raises:
            ValueError: a request whose length is not a positive int, or longer than ``max_length``;
                ``run_batch`` returning a number of results other than its requests'.
            NothingFitsError: a request does not fit even alone.
            Exception: an error of ``run_batch`` that is not an OOM, with its type and a note
                naming the batch.
        """
        requests = list(requests)
        self.batches = []
        results: dict[int, T] = {}
        lengths: list[int] = []
        order: list[int] = []
        error: BaseException | None = None
        with self._emulation(), self._host_malloc():
            try:
                lengths = [self._length_of(r, i) for i, r in enumerate(requests)]
                order = sorted(range(len(requests)), key=lambda i: -lengths[i])
                if requests and (self.budget is None or lengths[order[0]] > self.budget.verified_max):
                    self._fit(requests, lengths, order, results)
            except Exception as exc:  # every rank must reach the agreement, failed or not
                if self.agree is None:
                    raise
                error = exc
            self._agree(error)
            if requests:
                self._run(requests, lengths, order, results)
        return [results[i] for i in range(len(requests))]

    # ------------------------------------------------------------------ input
    def _length_of(self, request: R, index: int) -> int:
        value = self.length(request)
        L = check_int(f"length(requests[{index}])", value, minimum=1)
        if self.max_length is not None and L > self.max_length:
            raise ValueError(
                f"requests[{index}] needs {L} tokens, more than the model's context of {self.max_length}; "
                f"truncate it (keep its last {self.max_length} tokens) or split it into windows of at most "
                f"{self.max_length}"
            )
        return L

    @contextlib.contextmanager
    def _emulation(self) -> Any:
        if self.capacity is None:
            yield
            return
        with emulate_capacity(self.capacity, self.device, track=self.track):
            yield

    def _host_malloc(self) -> Any:
        """On a real host, glibc's mmap threshold held for the searches and the batches that follow them
        (:func:`~batchpilot.memory.host.malloc_threshold_held`): they are sized on one figure, and run on it."""
        if self.device.type == "cpu" and active_tracker(self.device) is None:
            return malloc_threshold_held()
        return contextlib.nullcontext()

    def _gauge(self) -> Gauge:
        """The figure that fails on the device: the running emulation's, or the real memory's."""
        if self.device.type == "cpu":
            tr = active_tracker(self.device)
            return gauge_for(self.device, emulated_capacity=None if tr is None else tr.capacity)
        return gauge_for(self.device, emulated_capacity=self.capacity)

    # ------------------------------------------------------------------ sizing
    def _fit(self, requests: list[R], lengths: list[int], order: list[int], results: dict[int, T]) -> None:
        """Real searches at two or three of the requests' lengths; the model through their memory lines.

        A search at length ``L`` runs windows of real requests that start at the longest request of
        that length (so every window is padded to ``L``), and the largest window that completed
        keeps its results.
        """
        n = len(requests)
        first: dict[int, int] = {}
        for pos, i in enumerate(order):
            first.setdefault(lengths[i], pos)
        ordered = [lengths[i] for i in order]
        # a search at L runs windows no wider than a batch at L would be: requests at least half as long
        room = {L: batch_end(ordered, pos, n, None) - pos for L, pos in first.items()}
        if self.max_batch_size is not None:
            room = {L: min(r, self.max_batch_size) for L, r in room.items()}
        longest = ordered[0]
        if self.plan is None:
            # lengths whose window holds two requests or more (the longest always: its search verifies it)
            usable = tuple(sorted(L for L, r in room.items() if r >= _MIN_WINDOW or L == longest))
            # down to the median request: most requests, and the largest batches, are there, and a
            # quadratic through longer lengths alone, extrapolated down to it, can miss it by far
            # (docs/internals.md)
            fitted = choose_fit_lengths(usable, down_to=ordered[n // 2])
        else:  # longer than an earlier call verified: a search there, the earlier lines kept
            fitted = (longest,)
        plans: dict[int, BatchPlan] = {}
        started = time.perf_counter()
        with _collected_once(self.device):
            self._search(requests, order, first, room, fitted, plans, results)
        earlier = self.budget
        self.plan = _length_plan({**(self.plan.length_plans if self.plan else {}), **plans},
                                 time.perf_counter() - started)
        self.budget = self.plan.budget(self.max_batch_size)
        self.budget.limit_bytes -= _margin(self.plan.length_plans, self.budget.limit_bytes)
        if earlier is not None:  # what the earlier batches taught stays
            self.budget.corrections.update(earlier.corrections)
        self.plan.per_length = {L: self.budget.micro_batch(L) for L in sorted(self.plan.length_plans)}
        logger.info("scoring sized at lengths %s in %.2fs: %s", sorted(plans), self.plan.seconds, self.plan.per_length)

    def _search(self, requests: list[R], order: list[int], first: dict[int, int], room: dict[int, int],
                fitted: tuple[int, ...], plans: dict[int, BatchPlan], results: dict[int, T]) -> None:
        """A search per fitted length, each trial a window of real requests from the longest of that length.

        With ``pads`` every trial takes the next requests not yet run (padded to ``L``), sliding back
        within the room when the next would not fit in it, and every trial that completed keeps its
        results; without, each trial is the first ``b`` of the room (its own longest request pads
        it to ``L``) and the largest that completed keeps them.
        """
        for i, L in enumerate(sorted(fitted, reverse=True)):  # the longest first: a nothing-fits fails fastest there
            start, width = first[L], room[L]
            # without pads each trial reruns a prefix; with pads, trials of half the room each leave
            # the next one room to run new requests (its answer is a floor the model rises above)
            cap = width if not self.pads else max(_MIN_WINDOW, width // 2)
            state: dict[str, Any] = {"next": 0, "record": None, "out": ()}

            def step(b: int, start: int = start, L: int = L, width: int = width,
                     state: dict[str, Any] = state) -> None:
                offset = 0 if not self.pads else state["next"] if state["next"] + b <= width else max(0, width - b)
                idx = order[start + offset:start + offset + b]
                record = ScoreBatch(size=b, length=L, trial=True, oom=True)
                self.batches.append(record)
                out = self._call([requests[i] for i in idx], L)  # an OOM is the trial's answer, caught by the finder
                record.oom = False
                if self.pads:
                    state["next"] = max(state["next"], offset + b)
                    fresh = [(i, v) for i, v in zip(idx, out) if i not in results]
                    results.update(fresh)
                    record.kept = bool(fresh)
                elif state["record"] is None or b > state["record"].size:
                    state["record"], state["out"] = record, out

            try:
                with stage(f"scoring, length {L} ({i + 1} of {len(fitted)})"):
                    plans[L] = find_batch_size(step, device=self.device, target=self.target, max_batch_size=cap,
                                               steps_per_trial=1, timed_steps=0, objective="memory",
                                               tolerance=_SEARCH_TOLERANCE)
            except Exception as exc:
                note_length_search(exc, L, sorted(plans))
                raise
            if state["record"] is not None:
                state["record"].kept = True
                for i, value in zip(order[start:start + state["record"].size], state["out"]):
                    results.setdefault(i, value)
            logger.info("length %d: batch %d in %d trials", L, plans[L].batch_size, plans[L].num_trials)

    def _agree(self, error: BaseException | None) -> None:
        """Every rank's budget (or failure), once per call; without ``agree``, nothing to agree."""
        self._others = []
        if self.agree is None:
            return
        budget = None if self.budget is None else self.budget.state_dict()
        self._others = [LengthBudget.from_state(b) for b in exchange(self.agree, budget, error, what="sizing")]

    def _size_at(self, length: int) -> int:
        """The largest batch at ``length``: this rank's budget, lowered to any other rank's that answers there."""
        assert self.budget is not None
        others = [b.micro_batch(length) for b in self._others if length <= b.verified_max]
        return min([self.budget.micro_batch(length), *others])

    # ------------------------------------------------------------------ running
    def _call(self, batch: list[R], length: int) -> list[T]:
        out = list(self.run_batch(batch, length) if self.pads else self.run_batch(batch))
        if len(out) != len(batch):
            raise ValueError(f"run_batch returned {len(out)} results for {len(batch)} requests (padded to "
                             f"{length}); it must return one result per request, in order")
        return out

    def _run(self, requests: list[R], lengths: list[int], order: list[int], results: dict[int, T]) -> None:
        """The requests without a result yet, longest first, in batches sized for their own length."""
        gauge = self._gauge()
        budget = self.budget
        assert budget is not None
        ordered = [lengths[i] for i in order]
        pos, n = 0, len(order)
        shrink: dict[int, int] = {}  # after an OOM at a position: the most its next batch may take
        while pos < n:
            if order[pos] in results:
                pos += 1
                continue
            L = ordered[pos]
            size = min(self._size_at(L), shrink.pop(pos, n))
            if size < 1:
                raise self._nothing_fits(L, None, "does not fit even alone under the memory limit")
            stop = next((k for k in range(pos + 1, min(n, pos + size)) if order[k] in results), min(n, pos + size))
            # within the speed tolerance the time model cannot tell the two apart: fewer calls win
            line = self._line(L)
            end = batch_end(ordered, pos, stop, None if line is None else line.overhead_tokens, SPEED_TOLERANCE)
            idx = order[pos:end]
            batch = [requests[i] for i in idx]
            gauge.synchronize()
            gauge.reset()
            began = timing.clock()
            outcome = attempt(self._call, batch, L, device=self.device)
            gauge.synchronize()
            seconds = timing.clock() - began
            peak = int(gauge.peak())
            gauge.close()
            tokens = len(idx) * L
            self.batches.append(ScoreBatch(size=len(idx), length=L, oom=outcome.oom, peak_bytes=peak,
                                           seconds=seconds, predicted=None if line is None else line.predict(tokens)))
            if outcome.oom:
                if len(idx) == 1:
                    raise self._nothing_fits(L, peak, f"ran out of memory alone ({outcome.message})")
                half = (len(idx) + 1) // 2
                logger.warning("a batch of %d at length %d ran out of memory (%s): running it as %d and %d",
                               len(idx), L, outcome.message, half, len(idx) - half)
                self._on_oom(L, len(idx), gauge.capacity())
                shrink[pos] = half
                continue
            for i, value in zip(idx, outcome.result):
                results[i] = value
            self._check_line(line, tokens, seconds)
            self._calls.setdefault((L, tokens), []).append(seconds)
            self._observe(L, len(idx), peak)
            pos = end

    def _line(self, length: int) -> OverheadFit | None:
        """The time line of the calls near ``length`` if it predicts them within the speed tolerance; else ``None``.

        Only calls within :data:`_TIME_BAND` of ``length``: a token costs more in long rows
        (attention grows with the square of the length), so a line through long and short calls
        alike leans on the long ones and puts the fixed cost at zero. ``None`` (batching by length
        alone) too once the check of the real calls went against the line; while the check runs,
        the line as it was nominated (a line fitted again on each call would follow the calls it
        is checked on, and agree with them whatever they took).
        """
        if self.check is not None and self.check.verdict == "simple":
            return None
        if self.check is not None and self.check.verdict is None:
            return self._checked  # the line under check cuts, and predicts, the calls it is checked on
        near: dict[int, list[float]] = {}
        for (L, tokens), seconds in self._calls.items():
            if length <= L * _TIME_BAND and L <= length * _TIME_BAND:
                near.setdefault(tokens, []).extend(seconds)
        return fit_overhead(near, SPEED_TOLERANCE)

    def _check_line(self, line: OverheadFit | None, tokens: int, seconds: float) -> None:
        """A call batched by ``line`` took ``seconds``: the check of the line against the real calls."""
        if line is None or seconds <= 0:
            return
        if self.check is None:
            self.check, self._checked = BatchingCheck(noise=line.noise, tolerance=SPEED_TOLERANCE), line
            self.batching_reason = (f"batched by the measured call overhead ({line.overhead_tokens:,.0f} tokens' "
                                    f"worth per call, noise ±{line.noise:.1%} over {line.calls} calls); "
                                    f"checking it on the next {self.check.calls} real calls")
        if self.check.verdict is not None:
            return
        if self.check.observe(line.predict(tokens), seconds) is not None:
            self.batching_reason = self.check.reason
            (logger.info if self.check.verdict == "timed" else logger.warning)("scoring: %s", self.batching_reason)

    def _nothing_fits(self, length: int, peak: int | None, what: str) -> NothingFitsError:
        budget = self.budget
        assert budget is not None
        return NothingFitsError(
            f"a request of {length} tokens {what}: the limit is {format_bytes(budget.limit_bytes)} "
            f"({self.target:.0%} of the device's memory); truncate long requests (a smaller max_length), use mixed "
            "precision, a larger target or a larger device", batch_size=1, peak_bytes=peak,
            limit_bytes=int(budget.limit_bytes), capacity_bytes=int(budget.limit_bytes / self.target))

    def _observe(self, length: int, size: int, peak: int) -> None:
        """A batch peaked over the limit: size the lengths near it for what it really took."""
        budget = self.budget
        assert budget is not None
        if peak <= budget.limit_bytes:
            return
        predicted = budget.fit.peak(size, length)
        if predicted > 0 and peak > predicted:
            factor = peak / predicted
            logger.warning("a batch of %d at length %d peaked at %s, over the limit %s and %.2fx the model's %s; "
                           "lengths near %d are sized for that from now on", size, length, format_bytes(peak),
                           format_bytes(budget.limit_bytes), factor, format_bytes(predicted), length)
            budget.correct(length, factor)

    def _on_oom(self, length: int, size: int, capacity: int) -> None:
        """An OOM at ``length``: the model over-promised there; lengths near it are sized for more."""
        budget = self.budget
        assert budget is not None
        predicted = budget.fit.peak(size, length)
        if predicted > 0:
            # the batch needed more than the capacity: at least capacity / predicted times the model's
            budget.correct(length, max(_OOM_CORRECTION, capacity / predicted))
        if length in budget.verified:
            budget.verified[length] = max(1, min(budget.verified[length], size - 1))


def _margin(plans: dict[int, BatchPlan], limit: float) -> float:
    """Bytes to keep under the limit for the noise of the figure the batches are sized by.

    :data:`_SCATTER_MARGIN` times the largest distance of a measured trial's peak from its
    length's memory line (at most half the room above the lowest start). On exact tensor bytes that
    is about nothing; on a host's address space, where what each trial leaves or frees moves the
    figure by a few MiB, it is what a batch sized right at the limit by a line through such points
    can exceed it by (the OOMs it prevents, measured: docs/internals.md).
    """
    worst, starts = 0.0, []
    for p in plans.values():
        if p.fit is None:
            continue
        for t in p.trials:
            if t.measured and t.peak_bytes is not None:
                worst = max(worst, abs(t.peak_bytes - p.fit.fixed_bytes - t.batch_size * p.fit.bytes_per_sample))
            if t.start_bytes is not None:
                starts.append(t.start_bytes)
    margin = _SCATTER_MARGIN * worst
    return min(margin, 0.5 * max(0.0, limit - min(starts))) if starts else margin


@contextlib.contextmanager
def _collected_once(device: torch.device) -> Any:
    """The young garbage collected before the searches, and none of what existed then collected during them.

    Each search collects garbage when it starts and ends, and a full collection walks every object
    of the process: 0.2-0.7 s with transformers and lm-eval loaded, twice per length. What exists
    before is frozen (``gc.freeze``) while the searches run, unless the caller froze objects
    already, after one collection of the young generations (the caller's last step's garbage);
    older garbage stays frozen, as constant a part of the memory the searches start from as the
    model, and goes at the next full collection after them. The searches' own garbage is
    collected as before.
    """
    free_memory(device, generation=1)
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def batch_end(lengths: Sequence[int], start: int, stop: int, overhead_tokens: float | None,
              tolerance: float = 0.0) -> int:
    """Where a batch that starts at ``start`` of the longest-first ``lengths`` ends (``stop`` at most).

    Padding to the first (longest) request costs compute, and a call costs its fixed overhead:
    the batch grows while its padding, in tokens, is at most ``overhead_tokens`` per request
    beyond the first -- the calls it saves -- plus ``tolerance`` times its requests' own tokens,
    so that under ``seconds = fixed + per_token × tokens`` it never takes more than ``1 +
    tolerance`` times as long as its requests one at a time. Without a measured overhead
    (``None``) a batch takes the requests at least half as long as its first:

    >>> batch_end([40, 39, 30, 12, 11], 0, 5, 8)  # 1 + 10 tokens of padding: 28 more would exceed 3 × 8
    3
    >>> batch_end([40, 39, 30, 12, 11], 0, 5, 0), batch_end([40, 39, 30, 12, 11], 0, 5, 0, 0.05)
    (1, 2)
    >>> batch_end([40, 39, 30, 12, 11], 0, 5, None), batch_end([40, 39, 30, 12, 11], 3, 5, None)
    (3, 5)
    """
    first = lengths[start]
    end, padding, tokens = start + 1, 0, first
    while end < stop:
        pad = padding + first - lengths[end]
        allowed = (end - start) * (overhead_tokens or 0.0) + tolerance * (tokens + lengths[end])
        if (2 * lengths[end] < first) if overhead_tokens is None else pad > allowed:
            break
        padding, tokens, end = pad, tokens + lengths[end], end + 1
    return end


def _length_plan(plans: dict[int, BatchPlan], seconds: float) -> LengthPlan:
    """The searches as a :class:`LengthPlan`: the 2-D model through their lines (one line: that line at every length)."""
    lines = {L: (p.fit.fixed_bytes, p.fit.bytes_per_sample) for L, p in plans.items()
             if p.fit is not None and p.fit.bytes_per_sample > 0}
    if len(lines) < 2:
        for L, p in plans.items():
            if L not in lines:  # one size measured (a window of one request): its whole peak taken as per-request
                top = max((t for t in p.trials if t.measured and t.outcome == "fit"), key=lambda t: t.batch_size)
                lines[L] = (0.0, top.peak_bytes / top.batch_size)
    if len(lines) >= 2:
        fit = fit_lengths(lines)
    else:
        (L, (fixed, per)), = lines.items()
        fit = LengthFit(fixed=(fixed, 0.0, 0.0), per_sample=(per, 0.0, 0.0), lengths=(L,))
    top = plans[max(plans)]
    base = {f: getattr(top, f) for f in BatchPlan.__dataclass_fields__}
    base["seconds"] = seconds
    base["compilations"] = sum(p.compilations for p in plans.values())
    return LengthPlan(**base, length_fit=fit, length_plans=plans, seq_dim=None)


def score_by_length(
    run_batch: Callable[[list[R]], Sequence[T]],
    requests: Sequence[R],
    *,
    length: Callable[[R], int],
    target: float | None = None,
    capacity: int | str | None = None,
    device: torch.device | str | int | None = None,
    max_length: int | None = None,
    max_batch_size: int | None = None,
    track: Iterable[Any] = (),
    agree: Callable[[Any], list[Any]] | None = None,
    pads: bool = False,
) -> list[T]:
    """Score ``requests`` longest first in batches each sized for its own padded length; results in input order.

    ``run_batch(requests)`` runs a list of requests as one padded forward (no gradient) and returns
    one result per request. Real searches at two or three of the requests' lengths (a few trials
    each, on windows of real requests whose results are kept) fit ``peak ≈ F(L) + b·P(L)``; every
    other batch is sized by it, runs once, and an OOM splits the failing batch and retries it. See
    :class:`LengthScorer` (which keeps the model for later calls) for the arguments.

    Raises:
        ValueError: a request's length not a positive int or over ``max_length``.
        NothingFitsError: a request does not fit even alone.
    """
    scorer = LengthScorer(run_batch, length=length, target=target, capacity=capacity, device=device,
                          max_length=max_length, max_batch_size=max_batch_size, track=track, agree=agree, pads=pads)
    return scorer.score(requests)
