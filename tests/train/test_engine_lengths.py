"""The engine sized by sequence length (batchpilot.train.lengths): no OOM on long batches, exact updates."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

from batchpilot import Engine, EngineConfig
from batchpilot.app.models import TinyGPT, lm_loss, padded_lm_batch
from batchpilot.memory.probes import emulate_capacity
from batchpilot.policy.lengths import UnverifiedLengthError
from batchpilot.train.lengths import LengthConfig

CAP = "1MiB"
N = 16


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, dim=16, heads=2, layers=1, max_len=64)


def _batches(widths: list[int], seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for w in widths:
        lens = torch.randint(1, w + 1, (N,), generator=g).tolist()
        lens[3] = w  # the batch is padded to its longest sample, as a collate function does
        out.append(padded_lm_batch(lens, vocab=64, generator=g))
    return out


def _reference(model: TinyGPT, batches: list) -> TinyGPT:
    """The full-batch computation: one forward over the whole padded batch per step."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        total, count = lm_loss(model, batch)
        (total / count).backward()
        opt.step()
    return model


def _train(model: TinyGPT, batches: list, lengths: LengthConfig, **kwargs) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, opt, lm_loss, global_batch_size=N, lengths=lengths,
                    config=EngineConfig(capacity=CAP), **kwargs)
    with emulate_capacity(CAP):
        results = [engine.step(b) for b in batches]
    return engine, results


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_alternating_short_and_long_batches_never_run_out_of_memory() -> None:
    model = _model()
    widths = [32, 8, 64, 8, 64, 16, 48]  # 64 is beyond the first fit (32, 16, 8): verified on step 3
    batches = _batches(widths)
    expected = _reference(model, batches)
    engine, results = _train(model, batches, LengthConfig())
    assert [r.length for r in results] == widths
    assert [r.ooms for r in results] == [0] * len(widths)
    assert engine.lengths.verifications == 1 and engine.lengths.budget.verified_max == 64
    micro = {r.length: r.micro_batch_size for r in results}
    assert micro[8] == N > micro[32] > micro[64] >= 1  # the short batch uses the memory the long one cannot
    budget = engine.lengths.budget
    for r in results:  # every micro-batch within the model's budget at its length, under the limit
        assert max(r.micro_batch_sizes) <= budget.micro_batch(r.length)
        assert r.peak_bytes <= budget.limit_bytes
    _assert_same_params(model, expected)


def test_a_length_beyond_the_verified_maximum_is_refused_with_beyond_error() -> None:
    model = _model()
    batches = _batches([32, 64])
    with pytest.raises(UnverifiedLengthError, match="beyond the longest verified length 32"):
        _train(model, batches, LengthConfig(beyond="error"))


def test_length_aware_split_trims_each_micro_batch_and_is_exact() -> None:
    model = _model()
    batches = _batches([64, 64, 40], seed=3)
    expected = _reference(model, batches)
    engine, results = _train(model, batches, LengthConfig(split=True))
    assert [r.ooms for r in results] == [0, 0, 0]
    first = results[1]
    assert sum(first.micro_batch_sizes) == N
    assert first.micro_batch_lengths[0] == 64 and min(first.micro_batch_lengths) < 64  # trimmed
    assert list(first.micro_batch_lengths) == sorted(first.micro_batch_lengths, reverse=True)
    budget = engine.lengths.budget
    assert all(r.peak_bytes <= budget.limit_bytes for r in results)
    assert all(b <= budget.micro_batch(w) for b, w in zip(first.micro_batch_sizes, first.micro_batch_lengths))
    # fewer passes than splitting the padded batch evenly at its own length
    assert len(first.micro_batch_sizes) < -(-N // budget.micro_batch(64))
    _assert_same_params(model, expected)


@pytest.mark.parametrize("config, match", [
    (dict(seq_dim=2), "seq_dim=2 is missing from the batch"),
    (dict(length_fn=lambda batch: 0), "positive int"),
])
def test_bad_lengths_at_step_time(config, match) -> None:
    with pytest.raises(ValueError, match=match):
        _train(_model(), _batches([16]), LengthConfig(**config))


def test_bad_configuration_fails_at_construction() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="seq_dim must be >= 1"):
        LengthConfig(seq_dim=0)
    with pytest.raises(ValueError, match="beyond must be"):
        LengthConfig(beyond="trust")
    with pytest.raises(ValueError, match='needs micro_batch_size="auto"'):
        Engine(model, opt, lm_loss, global_batch_size=N, micro_batch_size=4, lengths=True)
    with pytest.raises(ValueError, match="must be the LengthPlan"):
        Engine(model, opt, lm_loss, global_batch_size=N, start=4, lengths=True)
    with pytest.raises(ValueError, match="attention_mask"):
        _train(model, [(torch.zeros(N, 8, dtype=torch.long), torch.zeros(N, dtype=torch.long))],
               LengthConfig(), )


def test_a_model_that_under_predicts_is_derated_after_its_first_failure() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, opt, lm_loss, global_batch_size=N, lengths=LengthConfig(),
                    config=EngineConfig(capacity=CAP))
    with emulate_capacity(CAP):
        engine.step(_batches([64])[0])  # fits the model at 64, 32 and 16
        budget = engine.lengths.budget
        honest = budget.micro_batch(48)
        fit = budget.fit
        budget.fit = dataclasses.replace(fit, per_sample=tuple(p / 3 for p in fit.per_sample))  # a model 3x too small
        first = engine.step(_batches([48], seed=5)[0])
        assert first.micro_batch_size > honest and (first.ooms >= 1 or first.peak_bytes > 0.8 * (1 << 20))
        # an OOM derates the whole model; a peak over the target corrects it near that length
        assert budget.limit_bytes < 0.8 * (1 << 20) or 48 in budget.corrections
        later = [engine.step(b) for b in _batches([48, 48], seed=6)]
    assert [r.ooms for r in later] == [0, 0]
    assert all(r.peak_bytes <= 0.8 * (1 << 20) for r in later)


def test_a_ramped_global_batch_is_sized_by_memory_not_by_the_first_steps_batch() -> None:
    """The first fit could verify no more than the 8 samples it had; the ramp's later 16, 24, 32
    are sized by the model (at length 12 all fit in one micro-batch), not held at 8 (4 micro-batches)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, opt, lm_loss, global_batch_size=32, schedule="ramp:8,8,48", lengths=LengthConfig(),
                    config=EngineConfig(capacity=CAP))
    g = torch.Generator().manual_seed(3)
    seen = []
    with emulate_capacity(CAP):
        for _ in range(6):
            lens = torch.randint(1, 13, (engine.per_rank_batch_size,), generator=g).tolist()
            lens[0] = 12
            r = engine.step(padded_lm_batch(lens, vocab=64, generator=g))
            seen.append((len(lens), r.micro_batch_sizes))
            assert r.ooms == 0 and r.peak_bytes <= 0.8 * (1 << 20), r
    assert seen == [(8, (8,)), (8, (8,)), (16, (16,)), (24, (24,)), (32, (32,)), (32, (32,))]
    assert engine.lengths.budget.capped  # the first fit's answers reached the 8 it had: floors, not boundaries


def test_what_several_ranks_learnt_is_applied_once_the_most_cautious_of_each_kind() -> None:
    """The merge under torchrun (tests/train/test_engine_lengths_dist.py runs it for real): the events of
    two ranks that saw the same step derate once, by the stronger factor, and correct once per length."""
    engines = [_train(_model(), _batches([64]), LengthConfig())[0] for _ in range(2)]
    merged, one_by_one = (e.lengths for e in engines)
    assert merged.budget == one_by_one.budget
    before = merged.budget.limit_bytes
    merged._apply([("derate", 0.9), ("correct", 40, 1.1), ("derate", 0.8), ("correct", 40, 1.3),
                   ("cut_verified", 64, 1.2), ("cut_verified", 64, 1.5)])
    for event in (("derate", 0.8), ("correct", 40, 1.3), ("cut_verified", 64, 1.5)):
        one_by_one._apply([event])
    assert merged.budget == one_by_one.budget
    assert merged.budget.limit_bytes == pytest.approx(0.8 * before)  # not 0.9 x 0.8


# ---------------------------------------------------------------------- checkpoints
# fitted at 16, 8 and 4 on the first batch, 32 verified on the third; 64 is verified after the
# checkpoint (the refit then uses the saved memory lines); the 28 right after it is sized by the
# correction a step at 28 taught before it
RESUME_WIDTHS = [16, 8, 32, 24, 32, 12, 28, 28, 64, 48, 24, 64, 40]
RESUME_AT = 8


def _engine(model: TinyGPT) -> Engine:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # optimizer state to resume too
    return Engine(model, opt, lm_loss, global_batch_size=N, lengths=LengthConfig(split=True),
                  config=EngineConfig(capacity=CAP))


def _count_searches(engine: Engine) -> list[int]:
    """Counts the engine's finder searches (each is a run of real trials)."""
    calls: list[int] = []
    search = engine._search

    def counted(*args, **kwargs):
        calls.append(1)
        return search(*args, **kwargs)

    engine._search = counted
    return calls


def _resume(path, state_edit=None) -> tuple[Engine, list[int]]:
    ckpt = torch.load(path, weights_only=True)  # plain containers only: no pickled classes
    if state_edit is not None:
        state_edit(ckpt["engine"])
    model = _model()
    engine = _engine(model)
    model.load_state_dict(ckpt["model"])
    engine.optimizer.load_state_dict(ckpt["optimizer"])
    engine.load_state_dict(ckpt["engine"])
    return engine, _count_searches(engine)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Alternating lengths, checkpointed (by torch.save) after RESUME_AT steps and run on."""
    batches = _batches(RESUME_WIDTHS, seed=2)
    engine = _engine(_model())
    searches = _count_searches(engine)
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    with emulate_capacity(CAP):
        before = [engine.step(b) for b in batches[:RESUME_AT]]
        # a step over the target at 28 tokens, as the sizer applies one: with the global batch held
        # as host data this job's steps stay under their target, and the state must carry a correction
        engine.lengths.budget.correct(28, 1.25)
        torch.save({"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict(),
                    "engine": engine.state_dict()}, path)
    saved_budget = copy.deepcopy(engine.lengths.budget)
    searches_before = len(searches)
    # the rest on a new emulated device, as the resumed run gets: the CPU tracker counts tensors made
    # inside its block whole and older ones as they are read, which moves a later search's fixed bytes
    with emulate_capacity(CAP):
        after = [engine.step(b) for b in batches[RESUME_AT:]]
    assert searches_before == 4 and len(searches) == 5  # fit at 16, 8, 4; 32 verified; then 64
    assert [r.ooms for r in before + after] == [0] * len(batches)
    assert saved_budget.corrections == {28: 1.25}  # what the state must carry
    return dict(engine=engine, after=after, path=path, batches=batches, budget=saved_budget)


def test_a_resumed_engine_sizes_by_length_as_the_uninterrupted_one(uninterrupted) -> None:
    engine, searches = _resume(uninterrupted["path"])
    assert engine.lengths.budget == uninterrupted["budget"]  # fit, limit, verified answers, corrections
    with emulate_capacity(CAP):
        after = [engine.step(b) for b in uninterrupted["batches"][RESUME_AT:]]
    # 32 (and 24, 20, 16, ...) were verified before the checkpoint: the one search is 64's, as uninterrupted
    assert len(searches) == 1 and engine.lengths.verifications == 2
    assert [r.micro_batch_sizes for r in after] == [r.micro_batch_sizes for r in uninterrupted["after"]]
    assert [r.micro_batch_lengths for r in after] == [r.micro_batch_lengths for r in uninterrupted["after"]]
    assert [r.ooms for r in after] == [0] * len(after)
    assert engine.lengths.budget == uninterrupted["engine"].lengths.budget
    _assert_same_params(engine.model, uninterrupted["engine"].model)


def test_a_state_saved_without_the_sizer_still_loads_and_fits_again(uninterrupted) -> None:
    engine, searches = _resume(uninterrupted["path"], lambda state: state.pop("lengths"))
    assert engine.steps == RESUME_AT and engine.lengths.budget is None
    with emulate_capacity(CAP):
        result = engine.step(_batches([8], seed=4)[0])
    assert len(searches) == 3 and result.ooms == 0  # fitted again on its first batch (8, 4 and 2)


def test_a_corrupt_sizer_state_is_refused() -> None:
    engine = _engine(_model())
    with pytest.raises(ValueError, match="'fit', 'limit_bytes' and 'verified'"):
        engine.load_state_dict({**engine.state_dict(), "steps": 5, "lengths": {"budget": {"fit": {}}}})
    assert engine.steps == 0  # refused before any of the state was taken


def test_a_sizer_state_meets_an_engine_without_lengths_or_before_its_first_step(uninterrupted, caplog) -> None:
    ckpt = torch.load(uninterrupted["path"], weights_only=True)
    model = _model()
    plain = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss, global_batch_size=N)
    plain.load_state_dict(ckpt["engine"])
    assert "ignores it" in caplog.text and plain.steps == RESUME_AT
    fresh = _engine(_model())
    state = fresh.state_dict()
    assert state["lengths"]["budget"] is None
    _engine(_model()).load_state_dict(state)  # nothing learnt yet: nothing to restore, no error


# ---------------------------------------------------------------------- a user's own LM, padding marked by labels
# the held-out causal LM of tests/helpers/heldout_lm.py: {"input_ids", "labels"}, labels -100 at the pads,
# no attention_mask, a position table of 64


@pytest.fixture(scope="module")
def heldout_plan():
    """find_batch_size_for at three lengths on the user's batches, as the README's find -> train does."""
    import heldout_lm as lm

    from batchpilot import find_batch_size_for

    net = lm.model()
    example = lm.batch([64, 30, 10, 50], seed=2)
    plan = find_batch_size_for(net, example, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=lm.loss,
                               capacity=CAP, lengths=(16, 32, 64), seq_dim=1)
    assert plan.seq_dim == 1 and plan.per_length[16] > plan.per_length[64] >= 1
    return plan


@pytest.mark.parametrize("lengths", [None, True, LengthConfig(split=True)], ids=["none", "true", "split"])
def test_a_plan_found_on_batches_without_an_attention_mask_sizes_the_engine_on_its_seq_dim(heldout_plan,
                                                                                             lengths) -> None:
    import heldout_lm as lm

    net = lm.model()
    widths = [64, 24, 48]
    data = lm.batches(widths, N)
    expected = lm.plain_steps(net, data)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = Engine(net, opt, lm.loss, global_batch_size=N, start=heldout_plan, lengths=lengths,
                    config=EngineConfig(capacity=CAP))
    with emulate_capacity(CAP):
        results = [engine.step(b) for b in data]
    assert engine.lengths.config.seq_dim == 1  # the plan's dim, not "read the attention_mask"
    assert [r.length for r in results] == widths
    assert [r.ooms for r in results] == [0, 0, 0] and engine.lengths.verifications == 0
    micro = {r.length: r.micro_batch_size for r in results}
    assert micro[24] > micro[64] and micro[64] == min(heldout_plan.per_length[64], N)
    _assert_same_params(net, expected)


def test_split_reads_each_samples_length_from_labels_when_there_is_no_attention_mask() -> None:
    """Padding marked by labels -100 alone: trimmed as with the mask (equal cuts), and exact."""
    import heldout_lm as lm

    data = lm.batches([64, 64, 40], N, seed=3)
    runs = {}
    for marked in ("labels", "attention_mask"):
        net = lm.model()
        expected = lm.plain_steps(net, data)
        given = data if marked == "labels" else [dict(b, attention_mask=(b["labels"] != -100).long()) for b in data]
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        engine = Engine(net, opt, lambda m, b: lm.loss(m, b), global_batch_size=N,
                        lengths=LengthConfig(split=True, seq_dim=1), config=EngineConfig(capacity=CAP))
        with emulate_capacity(CAP):
            results = [engine.step(b) for b in given]
        assert [r.ooms for r in results] == [0, 0, 0]
        _assert_same_params(net, expected)
        runs[marked] = [(r.micro_batch_sizes, r.micro_batch_lengths) for r in results]
    sizes, widths = runs["labels"][1]
    assert sum(sizes) == N and widths[0] == 64 and min(widths) < 64  # trimmed to each group's longest label
    assert runs["labels"] == runs["attention_mask"]


def test_a_model_error_in_a_verification_keeps_its_type_and_names_the_length(heldout_plan) -> None:
    """A batch longer than the position table: the verification search's IndexError, told where it ran."""
    import heldout_lm as lm

    net = lm.model()
    engine = Engine(net, torch.optim.SGD(net.parameters(), lr=0.1), lm.loss, global_batch_size=N,
                    start=heldout_plan, config=EngineConfig(capacity=CAP))
    with emulate_capacity(CAP), pytest.raises(IndexError, match="index out of range") as info:
        engine.step(lm.batch([80] + [5] * (N - 1)))
    notes = "\n".join(info.value.__notes__)
    assert re.search(r"during a trial at batch size \d+", notes), notes
    assert "at sequence length 80 (the longest length that ran is 64)" in notes
    assert "cut batches to the longest it takes" in notes


def test_beyond_error_names_the_longest_length_that_ran_before_a_longer_one(heldout_plan) -> None:
    import heldout_lm as lm

    net = lm.model()
    engine = Engine(net, torch.optim.SGD(net.parameters(), lr=0.1), lm.loss, global_batch_size=N,
                    start=heldout_plan, lengths=LengthConfig(beyond="error"), config=EngineConfig(capacity=CAP))
    with pytest.raises(UnverifiedLengthError) as info:
        engine.step(lm.batch([80] + [5] * (N - 1)))
    message = str(info.value)
    # the safe fix first; a longer search only for a model that takes that length
    assert "Cut batches to at most 64 tokens (the longest length that ran" in message
    assert "if the model takes 80 tokens, find with lengths up to 80" in message
    assert message.index("Cut batches") < message.index("find with lengths")


def test_a_float64_batch_that_fits_whole_at_every_first_length_still_gets_a_model_and_trains_exactly() -> None:
    """8 samples of a float64 model fit whole at the first batch's length, its half and its quarter: each
    search stops at the per-rank batch, whose one micro-batch holds no gradients from an earlier one and
    peaked under the 7 + 1 below it. The lines come from the sizes that accumulate; longer batches are
    then sized by them (this raised 'measured fewer than two memory lines' on the first step)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=48, heads=2, layers=1, max_len=128).double()
    g = torch.Generator().manual_seed(3)
    batches = [padded_lm_batch([w] + torch.randint(1, w + 1, (7,), generator=g).tolist(), vocab=64, generator=g)
               for w in (24, 64, 120)]
    expected = _reference(model, batches)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), lm_loss, global_batch_size=8,
                    lengths=LengthConfig(), config=EngineConfig(capacity="4MiB"))
    with emulate_capacity("4MiB"):
        results = [engine.step(b) for b in batches]
    assert [r.ooms for r in results] == [0, 0, 0]
    assert results[0].micro_batch_size == 8 and results[-1].micro_batch_size < 8  # the longest is sized by the model
    assert all(r.peak_bytes <= engine.lengths.budget.limit_bytes for r in results)
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
