"""score_by_length / LengthScorer: longest first, each batch sized for its own length, results in input order.

The model is a real ``transformers`` Llama built from a config (tests/helpers/tiny_llama.py) scoring
requests of long-tailed lengths; memory is the CPU's emulated capacity (a real
``torch.OutOfMemoryError`` past it), so the sizes and the OOMs are exact.
"""

from __future__ import annotations

import doctest
from collections import Counter

import pytest
import torch

import tiny_llama
from batchpilot.find import timing
from batchpilot.infer import score as score_mod
from batchpilot.infer.score import LengthScorer, batch_end, score_by_length
from batchpilot.policy.search import BatchSizeError, NothingFitsError

CONTEXT = 96
CAP = "600KiB"


@pytest.fixture(scope="module")
def model():
    return tiny_llama.model(context=CONTEXT, layers=2, hidden=32)


def _requests(n: int = 40, *, long: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 100, (L,), generator=g)
            for L in tiny_llama.lengths(n, context=CONTEXT, median=12, long=long, seed=seed)]


class Scorer:
    """The log-likelihood of each request's tokens, one right-padded forward per call; every call recorded."""

    def __init__(self, model, *, extra_per_request: int = 0) -> None:
        self.model, self.extra, self.calls, self.grow = model, extra_per_request, [], lambda: False

    @torch.no_grad()
    def __call__(self, batch: list[torch.Tensor], width: int | None = None) -> list[float]:
        self.calls.append([id(r) for r in batch])
        width = max(len(r) for r in batch) if width is None else width
        ids = torch.ones(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, :len(r)] = r
        if self.grow():  # memory the sizing never saw: a buffer per request, held through the forward
            held = torch.empty(len(batch) * self.extra, dtype=torch.uint8)  # noqa: F841
        logp = torch.log_softmax(self.model(ids).logits, -1)
        return [float(logp[i, :len(r) - 1].gather(-1, r[1:, None]).sum()) for i, r in enumerate(batch)]


def _alone(model, requests):
    run = Scorer(model)
    return [run([r])[0] for r in requests]


def _delivered(run: Scorer, scorer: LengthScorer) -> Counter:
    """How often each request's result came back: from a completed batch, or a trial window that was kept."""
    assert len(run.calls) == len(scorer.batches)
    return Counter(i for ids, b in zip(run.calls, scorer.batches)
                   if (b.kept or not b.trial) and not b.oom for i in ids)


def test_results_in_input_order_equal_scoring_each_request_alone(model) -> None:
    requests = _requests()
    run = Scorer(model)
    scorer = LengthScorer(run, length=len, capacity=CAP, track=[model])
    out = scorer.score(requests)
    assert out == pytest.approx(_alone(model, requests), rel=1e-5, abs=1e-4)
    assert _delivered(run, scorer) == Counter(id(r) for r in requests)  # every request once, none twice
    # batches ran longest first, each padded to its own first request's length
    real = [b for b in scorer.batches if not b.trial]
    assert [b.length for b in real] == sorted((b.length for b in real), reverse=True)
    assert not any(b.oom for b in scorer.batches)


def test_with_pads_every_sizing_trial_runs_requests_no_trial_ran_before(model) -> None:
    requests = _requests()
    run = Scorer(model)
    scorer = LengthScorer(run, length=len, capacity=CAP, track=[model], pads=True)
    out = scorer.score(requests)
    assert out == pytest.approx(_alone(model, requests), rel=1e-5, abs=1e-4)
    trials = [(ids, b) for ids, b in zip(run.calls, scorer.batches) if b.trial]
    assert trials and all(b.kept for _, b in trials)
    # the trials of a length are disjoint windows: no request ran in two trials
    for L in scorer.plan.length_plans:
        ran = [i for ids, b in trials if b.length == L for i in ids]
        assert len(ran) == len(set(ran))
    assert sum(Counter(i for ids, b in zip(run.calls, scorer.batches) if not b.trial for i in ids).values()) + \
        len({i for ids, _ in trials for i in ids}) == len(requests)


def test_each_batch_is_sized_for_its_length_from_a_few_trials_per_length(model) -> None:
    requests = _requests()
    scorer = LengthScorer(Scorer(model), length=len, capacity=CAP, track=[model])
    scorer.score(requests)
    plans = scorer.plan.length_plans
    assert 2 <= len(plans) <= 3 and max(plans) == max(map(len, requests))
    assert all(p.num_trials <= 3 for p in plans.values()), {L: p.num_trials for L, p in plans.items()}
    budget = scorer.budget
    assert budget.micro_batch(max(plans)) < budget.micro_batch(24) < budget.micro_batch(6)  # memory-bound
    cap = 600 * 1024
    for b in scorer.batches:
        if not b.trial:
            assert b.size <= scorer.plan.budget().micro_batch(b.length) and b.peak_bytes <= cap
    # the longest requests ran at the largest size that fits there, not one for every length
    assert {b.size for b in scorer.batches if not b.trial} != {1}


def test_the_model_is_measured_down_to_the_median_request_far_below_the_longest(model) -> None:
    g = torch.Generator().manual_seed(5)
    requests = [torch.randint(4, 100, (L,), generator=g)
                for L in tiny_llama.lengths(60, context=CONTEXT, median=6, long=3, seed=5)]
    median = sorted(map(len, requests))[len(requests) // 2]
    assert 8 * median < max(map(len, requests))  # a training search would leave it to the model
    run = Scorer(model)
    scorer = LengthScorer(run, length=len, capacity=CAP, track=[model])
    assert scorer.score(requests) == pytest.approx(_alone(model, requests), rel=1e-5, abs=1e-4)
    plans = scorer.plan.length_plans
    assert min(plans) <= median and max(plans) == max(map(len, requests)), sorted(plans)
    assert not any(b.oom for b in scorer.batches)


def test_the_limit_keeps_twice_the_trials_scatter_about_their_lines_in_reserve() -> None:
    from types import SimpleNamespace

    from batchpilot.policy.search import Trial

    MiB = 2**20

    def plan(fixed, per, *peaks):  # a length's search: its line, and its trials (size, peak)
        trials = [Trial(batch_size=b, outcome="fit", peak_bytes=int(peak * MiB), start_bytes=int(fixed * MiB))
                  for b, peak in peaks]
        return SimpleNamespace(fit=SimpleNamespace(fixed_bytes=fixed * MiB, bytes_per_sample=per * MiB), trials=trials)

    on_the_line = {47: plan(1000, 0.5, (2, 1001), (40, 1020)), 236: plan(1000, 2, (2, 1004), (9, 1018))}
    assert score_mod._margin(on_the_line, 1030 * MiB) == 0
    noisy = {47: plan(1000, 0.5, (2, 1002.5), (40, 1020)), 236: plan(1000, 2, (2, 1003), (9, 1018))}
    assert score_mod._margin(noisy, 1030 * MiB) == pytest.approx(2 * 1.5 * MiB)  # the farthest, 1.5 MiB, twice
    # never more than half the room above the lowest start
    assert score_mod._margin(noisy, 1004 * MiB) == pytest.approx(2 * MiB)


def test_an_oom_mid_run_splits_the_batch_and_retries_it_with_no_request_lost_or_run_twice(model) -> None:
    requests = _requests(seed=1)
    run = Scorer(model, extra_per_request=40_000)
    scorer = LengthScorer(run, length=len, capacity=CAP, track=[model])
    run.grow = lambda: scorer.plan is not None  # after the sizing: more memory than the model knows of
    out = scorer.score(requests)
    ooms = [b for b in scorer.batches if b.oom]
    assert ooms and not any(b.trial for b in ooms)
    assert out == pytest.approx(_alone(model, requests), rel=1e-5, abs=1e-4)
    assert _delivered(run, scorer) == Counter(id(r) for r in requests)
    # the batch that failed was run again as its halves (or smaller), starting with the same request
    first = scorer.batches.index(ooms[0])
    failed, retry = run.calls[first], run.calls[first + 1]
    assert retry[0] == failed[0] and len(retry) <= (len(failed) + 1) // 2
    # what the OOM taught sizes the rest: fewer OOMs than batches after it
    assert len(ooms) < len([b for b in scorer.batches if not b.trial]) / 2


def test_a_later_call_reuses_the_model_and_a_longer_one_verifies_only_its_length(model) -> None:
    requests = _requests()
    scorer = LengthScorer(Scorer(model), length=len, capacity=CAP, track=[model])
    scorer.score(requests)
    fitted = set(scorer.plan.length_plans)
    short = [r for r in requests if len(r) < 40]
    assert scorer.score(short) == pytest.approx(_alone(model, short), rel=1e-5, abs=1e-4)
    assert not any(b.trial for b in scorer.batches)
    longer = short + [torch.randint(4, 100, (CONTEXT,))]
    scorer.score(longer)
    assert {b.length for b in scorer.batches if b.trial} == {CONTEXT}
    assert set(scorer.plan.length_plans) == fitted | {CONTEXT} and scorer.budget.verified_max == CONTEXT


def test_real_memory_without_a_capacity(model) -> None:
    requests = _requests(n=30, long=3)
    run = Scorer(model)
    out = score_by_length(run, requests, length=len)
    assert out == pytest.approx(_alone(model, requests), rel=1e-5, abs=1e-4)
    assert len(run.calls) < len(requests)


def test_ranks_size_each_length_by_the_most_cautious_rank(model) -> None:
    requests = _requests()
    small = LengthScorer(Scorer(model), length=len, capacity="400KiB", track=[model])
    small.score(requests)
    states = []

    def agree(state):  # an all-gather over two ranks: this one and the one with less memory
        states.append(state)
        return [state, {"id": "other", "payload": small.budget.state_dict(), "failed": None}]

    run = Scorer(model)
    scorer = LengthScorer(run, length=len, capacity=CAP, track=[model], agree=agree)
    out = scorer.score(requests)
    assert len(states) == 1 and out == pytest.approx(_alone(model, requests), rel=1e-5, abs=1e-4)
    for b in scorer.batches:
        if not b.trial:
            assert b.size <= small.budget.micro_batch(b.length)
    assert scorer.score([]) == [] and len(states) == 2  # a rank with nothing to score still agrees

    def failed(state):
        return [state, {"id": "other", "payload": None, "failed": "NothingFitsError: ..."}]

    with pytest.raises(RuntimeError, match="sizing failed on rank 1"):
        LengthScorer(Scorer(model), length=len, capacity=CAP, agree=failed).score(requests)


def test_a_failure_on_this_rank_still_reaches_the_agreement(model) -> None:
    calls = []

    def agree(state):
        calls.append(state)
        return [state]

    scorer = LengthScorer(Scorer(model), length=len, capacity=CAP, max_length=CONTEXT, agree=agree)
    with pytest.raises(ValueError, match="more than the model's context"):
        scorer.score([torch.ones(CONTEXT + 1, dtype=torch.long)])
    assert len(calls) == 1 and "ValueError" in calls[0]["failed"]


def test_bad_input_fails_before_anything_runs(model) -> None:
    run = Scorer(model)
    with pytest.raises(ValueError, match="requests\\[1\\] needs 97 tokens, more than the model's context of 96"):
        score_by_length(run, [torch.ones(5, dtype=torch.long), torch.ones(97, dtype=torch.long)], length=len,
                        max_length=CONTEXT)
    with pytest.raises(ValueError, match="length\\(requests\\[0\\]\\)"):
        score_by_length(run, ["abc"], length=lambda r: 0)
    with pytest.raises(BatchSizeError, match="target must be"):
        score_by_length(run, [], length=len, target=1.5)
    with pytest.raises(ValueError, match="run_batch must be a function"):
        score_by_length(None, [], length=len)
    assert run.calls == []
    assert score_by_length(run, [], length=len, capacity=CAP) == [] and run.calls == []


def test_errors_of_run_batch_keep_their_type_and_a_wrong_count_is_named(model) -> None:
    def broken(batch):
        raise KeyError("no such token")

    with pytest.raises(KeyError, match="no such token") as info:
        score_by_length(broken, _requests(n=10, long=1), length=len, capacity=CAP)
    assert any("sequence length" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(ValueError, match="returned 1 results for 2 requests"):
        score_by_length(lambda batch: [0.0], [torch.ones(3), torch.ones(3)], length=len)


def test_a_request_that_does_not_fit_alone(model) -> None:
    with pytest.raises(NothingFitsError, match="nothing fits"):
        score_by_length(Scorer(model), _requests(n=10, long=2), length=len, capacity="64KiB", track=[model])


class Clock:
    """The finder's clock (:data:`batchpilot.find.timing.clock`), moved only by the scoring calls."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ClockedScorer(Scorer):
    """A real scoring call that also moves the clock by ``cost(padded tokens, call number)``."""

    def __init__(self, model, clock: Clock, cost) -> None:
        super().__init__(model)
        self.clock, self.cost = clock, cost

    def __call__(self, batch, width=None):
        out = super().__call__(batch, width)
        tokens = len(batch) * (max(len(r) for r in batch) if width is None else width)
        self.clock.now += self.cost(tokens, len(self.calls))
        return out


def _by_line(model, monkeypatch, cost):
    clock = Clock()
    monkeypatch.setattr(timing, "clock", clock)
    requests = _requests(60, long=6, seed=3)
    run = ClockedScorer(model, clock, cost)
    scorer = LengthScorer(run, length=len, capacity=CAP, track=[model], max_batch_size=4)
    out = scorer.score(requests)
    assert out == pytest.approx(_alone(model, requests), rel=1e-5, abs=1e-4)
    return scorer, [b for b in scorer.batches if not b.trial]


def test_the_timed_batching_is_kept_when_the_real_calls_take_what_its_line_predicts(model, monkeypatch) -> None:
    scorer, real = _by_line(model, monkeypatch, lambda tokens, n: 0.02 + 1e-5 * tokens)
    assert scorer.check is not None and scorer.check.verdict == "timed"
    assert scorer.batching_reason.startswith("batched by the measured call overhead: 4 real calls took 1.00x")
    predicted = [b for b in real if b.predicted is not None]
    assert len(predicted) >= 4 and all(b.predicted == pytest.approx(b.seconds) for b in predicted)


def test_a_line_the_real_calls_disagree_with_goes_back_to_batching_by_length(model, monkeypatch) -> None:
    # exact times at first (the line is nominated on them), then every call three times as long
    # as the line says: the check must see it and stop trusting the line, for the rest of the run
    box: dict[str, int] = {}

    def cost(tokens: int, n: int) -> float:
        base = 0.02 + 1e-5 * tokens
        return 3 * base if "from" in box and n >= box["from"] else base

    original = LengthScorer._check_line

    def nominated(self, line, tokens, seconds):
        original(self, line, tokens, seconds)
        if self.check is not None and "from" not in box:
            box["from"] = len(self.batches) + 1  # run_batch's next call number
    monkey = pytest.MonkeyPatch()
    monkey.setattr(LengthScorer, "_check_line", nominated)
    try:
        scorer, real = _by_line(model, monkeypatch, cost)
    finally:
        monkey.undo()
    assert scorer.check is not None and scorer.check.verdict == "simple"
    assert scorer.batching_reason.startswith("batched by length alone") and "3.00x" in scorer.batching_reason
    checked = [i for i, b in enumerate(real) if b.predicted is not None]
    after = real[checked[-1] + 1:]
    assert len(checked) == 4 and after  # the check's 4 calls (the nominating one first), then none
    assert all(b.predicted is None for b in after)


def test_calls_that_scatter_beyond_the_tolerance_never_batch_by_a_line(model, monkeypatch) -> None:
    rng = torch.Generator().manual_seed(0)

    def noisy(tokens: int, n: int) -> float:  # a co-tenant stretching each call by 1-2x
        return (0.02 + 1e-5 * tokens) * float(1 + torch.rand((), generator=rng))

    scorer, real = _by_line(model, monkeypatch, noisy)
    assert scorer.check is None and all(b.predicted is None for b in real)
    assert scorer.batching_reason.startswith("batched by length alone")


def test_batch_end_never_pads_more_than_the_calls_it_saves() -> None:
    lengths = [40, 39, 30, 12, 11, 11, 11]
    assert batch_end(lengths, 0, 7, 0) == 1  # no overhead: any padding is a loss
    assert batch_end(lengths, 4, 7, 0) == 7  # equal lengths cost nothing to batch
    assert batch_end(lengths, 0, 7, float("inf")) == 7
    assert batch_end(lengths, 0, 2, float("inf")) == 2  # never past stop
    for k in (1, 5, 20):
        end = batch_end(lengths, 0, 7, k)
        padding = sum(lengths[0] - L for L in lengths[:end])
        assert padding <= (end - 1) * k
    # a tolerance lets the padding exceed the calls saved by that share of the requests' own tokens
    assert batch_end(lengths, 0, 7, 0, 0.05) == 2 and batch_end(lengths, 0, 7, 0, 1.0) == 7
    for k, tol in ((0, 0.05), (1, 0.05), (5, 0.2)):
        end = batch_end(lengths, 0, 7, k, tol)
        padding = sum(lengths[0] - L for L in lengths[:end])
        assert padding <= (end - 1) * k + tol * sum(lengths[:end]) and (
            end == 7 or sum(lengths[0] - L for L in lengths[:end + 1]) > end * k + tol * sum(lengths[:end + 1]))


def test_docstring_examples() -> None:
    assert doctest.testmod(score_mod, optionflags=doctest.ELLIPSIS).failed == 0
