"""The pure 2-D memory model, the per-length budget and the longest-first split (batchpilot.policy.lengths)."""

from __future__ import annotations

import doctest
import io
import json

import pytest
import torch

from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch
from batchpilot.memory.probes import track_peak
from batchpilot.policy import lengths as lengths_mod
from batchpilot.policy.lengths import (
    LengthBudget, LengthFit, UnverifiedLengthError, check_lengths, fit_lengths, fit_lengths_for, plan_length_split,
)


def test_docstring_sequences() -> None:
    result = doctest.testmod(lengths_mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0


def _synthetic(b: int, L: int) -> int:
    # F(L) = 5000 + 3L + L², P(L) = 7 + 11L + 2L²: every term of the general form
    return 5000 + 3 * L + L * L + b * (7 + 11 * L + 2 * L * L)


def test_three_lengths_fit_is_exact_at_lengths_not_fitted() -> None:
    fit = fit_lengths_for((b, L, _synthetic(b, L)) for L in (16, 64, 256) for b in (2, 5))
    assert fit.fixed == pytest.approx((5000, 3, 1), abs=1e-9)
    assert fit.per_sample == pytest.approx((7, 11, 2), abs=1e-9)
    for L in (8, 40, 100, 300):
        for b in (1, 3, 17):
            assert fit.peak(b, L) == _synthetic(b, L)
    # max_batch is the exact boundary: b fits, b + 1 does not
    limit = 3_000_000
    for L in (20, 128, 200):
        b = fit.max_batch(L, limit)
        assert _synthetic(b, L) <= limit < _synthetic(b + 1, L)


def test_two_lengths_fit_the_issue_form() -> None:
    # peak = f + a·b·L + c·b·L² is recovered exactly from two lengths
    fit = fit_lengths({64: (1000.0, 64 * 10 + 64 * 64 * 0.5), 256: (1000.0, 256 * 10 + 256 * 256 * 0.5)})
    assert fit.bytes_per_token == pytest.approx(10)
    assert fit.bytes_per_token_squared == pytest.approx(0.5)
    assert fit.per_sample[0] == 0 and fit.fixed[2] == 0
    assert fit.peak(3, 128) == pytest.approx(1000 + 3 * (1280 + 0.5 * 128 * 128))


def test_fused_attention_has_no_square_term() -> None:
    fit = fit_lengths({L: (2000.0, 40.0 * L) for L in (32, 128, 512)})
    assert fit.bytes_per_token_squared == pytest.approx(0, abs=1e-9)
    assert fit.max_batch(1024, 2000 + 40 * 1024 * 9) == 9


@pytest.mark.parametrize("bad", [[], [0, 16], [-3, 16], [2.5, 16], [True, 16], "128", 128])
def test_bad_lengths_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="lengths|int"):
        check_lengths(bad)


def test_one_length_cannot_fit() -> None:
    with pytest.raises(ValueError, match="two or three lengths"):
        fit_lengths({128: (1.0, 2.0)})
    with pytest.raises(ValueError, match="one batch size"):
        fit_lengths_for([(2, 16, 100.0), (4, 16, 200.0), (2, 32, 300.0)])


def test_budget_refuses_unverified_lengths_and_never_goes_below_a_verified_answer() -> None:
    fit = LengthFit(fixed=(1000.0, 0.0, 0.0), per_sample=(0.0, 10.0, 0.0))
    budget = LengthBudget(fit=fit, limit_bytes=11_000, verified={100: 10, 50: 25})
    assert budget.verified_max == 100
    assert budget.micro_batch(100) == 10
    assert budget.micro_batch(50) == 25  # the verified search found more than the model: trust the trial
    assert budget.micro_batch(20) == 50
    with pytest.raises(UnverifiedLengthError, match="beyond the longest verified length 100") as err:
        budget.micro_batch(101)
    assert err.value.length == 101 and err.value.verified == 100
    with pytest.raises(ValueError, match="positive int"):
        budget.micro_batch(0)
    budget.verify(200, 4)
    assert budget.micro_batch(150) == 6 and budget.micro_batch(200) == 4
    capped = LengthBudget(fit=fit, limit_bytes=11_000, verified={100: 10}, max_batch_size=8)
    assert capped.micro_batch(20) == 8
    assert capped.table([20, 100, 400]) == {20: 8, 100: 8}
    with pytest.raises(ValueError, match="verified"):
        LengthBudget(fit=fit, limit_bytes=1.0, verified={})


def _learnt_budget() -> LengthBudget:
    """A budget as the engine leaves it: refitted, derated to a float limit, verified and corrected."""
    fit = fit_lengths_for((b, L, _synthetic(b, L)) for L in (16, 64, 256) for b in (2, 5))
    budget = LengthBudget(fit=fit, limit_bytes=3_000_000 * 0.8123456789, verified={256: 9, 64: 40},
                          max_batch_size=64)
    budget.correct(100, 1.1234567891)
    budget.correct(30, 1.05)
    budget.verify(16, 64, capped=True)  # the search stopped at the cap, not at memory
    return budget


def test_budget_state_round_trips_through_torch_load_weights_only_and_json() -> None:
    budget = _learnt_budget()
    buffer = io.BytesIO()
    torch.save(budget.state_dict(), buffer)
    buffer.seek(0)
    via_torch = LengthBudget.from_state(torch.load(buffer, weights_only=True))  # plain containers only
    via_json = LengthBudget.from_state(json.loads(json.dumps(budget.state_dict())))
    for restored in (via_torch, via_json):
        assert restored == budget  # every float to the bit: the fit, the limit, the corrections
        assert [restored.micro_batch(L) for L in range(1, 257)] == [budget.micro_batch(L) for L in range(1, 257)]
        with pytest.raises(UnverifiedLengthError):
            restored.micro_batch(257)
    # the restored budget learns on as the original does
    for b in (budget, via_torch):
        b.correct(200, 1.3)
        b.verify(300, 5)
        b.raise_cap(128)
    assert via_torch == budget and budget.capped == {16}  # 64 stopped at memory (40 of 64): a boundary
    # an older state, saved before capped lengths were kept, loads with none
    old = budget.state_dict()
    del old["capped"]
    assert LengthBudget.from_state(old).capped == set()


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("verified"), "needs 'fit', 'limit_bytes' and 'verified'"),
    (lambda s: s.update(verified=[]), "at least one verified"),
    (lambda s: s.update(verified=[[0, 4]]), "each verified length must be a positive int"),
    (lambda s: s.update(verified=[[64]]), r"verified must be \[\[length, value\]"),
    (lambda s: s.update(limit_bytes=float("nan")), "limit_bytes must be a positive number"),
    (lambda s: s.update(corrections=[[100, -1.0]]), "correction factor must be a positive number"),
    (lambda s: s["fit"].update(fixed=[1.0, 2.0]), "'fixed': three finite numbers"),
    (lambda s: s.update(max_batch_size=0), "max_batch_size must be a positive int"),
    (lambda s: s.update(capped=[-16]), "each capped length must be a positive int"),
])
def test_a_bad_budget_state_is_refused(edit, match) -> None:
    state = _learnt_budget().state_dict()
    edit(state)
    with pytest.raises(ValueError, match=match):
        LengthBudget.from_state(state)


def test_split_longest_first_within_budget() -> None:
    lengths = [5, 40, 12, 40, 7, 3, 33, 20]

    def budget(L: int) -> int:
        return 100 // L

    groups = plan_length_split(lengths, budget)
    assert groups == [([1, 3], 40), ([6, 7, 2], 33), ([4, 0, 5], 7)]
    assert sorted(i for g, _ in groups for i in g) == list(range(len(lengths)))
    for idx, width in groups:
        assert width == max(lengths[i] for i in idx) and len(idx) <= budget(width)
    with pytest.raises(ValueError, match="does not fit even alone"):
        plan_length_split([5, 200], budget)
    with pytest.raises(ValueError, match="positive int"):
        plan_length_split([5, 0], budget)


def _tiny_gpt() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=16, heads=2, layers=1, max_len=64)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _measured_peak(model, opt, b: int, L: int) -> int:
    batch = padded_lm_batch([L] * b, vocab=64)
    with track_peak("cpu", track=[model, opt]) as m:
        opt.zero_grad(set_to_none=True)
        total, count = lm_loss(model, batch)
        (total / count).backward()
        opt.step()
    return m.peak_bytes


def test_fit_on_the_tracker_predicts_lengths_it_was_not_fitted_on() -> None:
    model, opt = _tiny_gpt()
    _measured_peak(model, opt, 1, 4)  # Adam's state exists from here on
    points = [(b, L, _measured_peak(model, opt, b, L)) for L in (16, 32, 64) for b in (4, 6)]
    exact = fit_lengths_for(points)
    two = fit_lengths_for([p for p in points if p[1] != 32])
    for L in (24, 48):
        for b in (5, 8):
            measured = _measured_peak(model, opt, b, L)
            assert exact.peak(b, L) == measured  # the tracker's peaks are exactly quadratic in L
            # the issue's two-length form drops P's constant and F's L²: within 1% here
            assert two.peak(b, L) == pytest.approx(measured, rel=0.01)
