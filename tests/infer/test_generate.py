"""generate_by_length: greedy outputs identical to one prompt at a time, in input order, under a memory limit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from batchpilot.infer.generate import Generations, _plan, _TrialSizer, generate_by_length  # noqa: E402
from batchpilot.infer.genmemory import GenerationTrial, UnverifiedShapeError, band_low  # noqa: E402
from batchpilot.memory.probes import emulate_capacity  # noqa: E402
from batchpilot.policy.lengths import LengthFit  # noqa: E402
from batchpilot.policy.search import BatchSizeError, NothingFitsError  # noqa: E402
from tiny_llama_gen import PAD, alone, frequent_token, random_prompts, tiny_llama  # noqa: E402

NEW = 8
CAPACITY = "1MiB"


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(20, (3, 40), seed=1)


@pytest.fixture(scope="module")
def eos(model, prompts):
    # a token the model emits early for some prompts: their rows end before the others'
    return frequent_token([alone(model, p, NEW) for p in prompts], before=NEW - 2)


@pytest.fixture(scope="module")
def reference(model, prompts, eos):
    return [alone(model, p, NEW, eos=eos) for p in prompts]


@pytest.fixture(scope="module")
def run(model, prompts, eos):
    return generate_by_length(model, prompts, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos,
                              capacity=CAPACITY)


def test_outputs_are_those_of_each_prompt_alone_in_input_order(run, reference, eos):
    assert isinstance(run, Generations) and isinstance(run, list)
    assert list(run) == reference
    ended_early = [r for r in reference if len(r) < NEW]
    assert ended_early and all(r[-1] == eos for r in ended_early)  # some rows stopped on EOS, others did not
    assert any(len(r) == NEW and eos not in r for r in reference)
    assert all(PAD not in r or PAD == eos for r in run)


def test_batches_are_sized_per_length_longest_first_within_the_limit(run, prompts):
    assert run.sized_by == "model" and run.ooms == 0
    sizes = [b for b, _, _ in run.batches]
    padded = [L for _, L, _ in run.batches]
    # every prompt once: in a sizing trial that ran it (greedy: its output kept) or in a batch
    in_trials = [i for t in run.trials if t.outcome != "oom" for i in t.prompts]
    assert len(set(in_trials)) == len(in_trials) and sum(sizes) + len(in_trials) == len(prompts)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert run.trials[0].prompts == (longest,) and run.trials[0].batch_size == 1
    assert run.trials[0].prompt_length == len(prompts[longest]) + 1  # padded, as the batches' rows are
    assert padded == sorted(padded, reverse=True) and padded[0] < len(prompts[longest])
    for b, L, n in run.batches:
        assert run.memory.peak(b, L, n) <= run.memory.limit_bytes
    # shorter prompts, larger batches: in the model and in the trials that ran
    short, long = min(t.prompt_length for t in run.trials), run.trials[0].prompt_length
    assert run.memory.max_batch(short, NEW) > run.memory.max_batch(long, NEW) >= 2
    assert max(t.batch_size for t in run.trials if t.prompt_length == short) > 2
    # a trial pads no prompt past twice its length, unless by no more than the new tokens
    assert all(len(prompts[i]) >= band_low(t.prompt_length, NEW) for t in run.trials for i in t.prompts)
    # at most three real trials per fitted prompt length
    fitted = {t.prompt_length for t in run.trials}
    assert len(fitted) <= 3
    assert all(sum(t.prompt_length == P for t in run.trials) <= 3 for P in fitted)
    assert run.generate_calls == len(run.trials) + len(run.batches)


def test_a_trial_that_holds_back_an_eos_gives_the_row_generate_ends_there(run, reference):
    in_trials = [i for t in run.trials for i in t.prompts]
    assert any(len(reference[i]) < NEW for i in in_trials)  # rows that ended on EOS inside a trial
    assert [run[i] for i in in_trials] == [reference[i] for i in in_trials]


def test_other_stops_size_by_made_up_prompts(model, prompts, reference, eos):
    # max_time may end rows early: the trials cannot hold back an EOS there, so they run made-up prompts
    out = generate_by_length(model, prompts, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos,
                             capacity=CAPACITY, max_time=1e6)
    assert list(out) == reference
    assert out.trials and all(t.prompts == () for t in out.trials)
    assert sum(b for b, _, _ in out.batches) == len(prompts)


def test_batches_cut_where_a_prompt_would_be_padded_past_twice_its_length():
    lengths = [100, 60, 51, 49, 30, 12, 5, 1]
    # 5 joins 12 (padded by no more than the 8 new tokens), 1 does not (by 11)
    assert _plan(lengths, lambda L: 8, 8) == [([0, 1, 2], 100), ([3, 4], 49), ([5, 6], 12), ([7], 1)]
    assert _plan(lengths, lambda L: 2, 8) == [([0, 1], 100), ([2], 51), ([3, 4], 49), ([5, 6], 12), ([7], 1)]


def test_a_fitted_memory_is_reused_and_each_prompt_keeps_its_own_max_new_tokens(model, prompts, run, reference, eos):
    news = [NEW - i % 4 for i in range(len(prompts))]
    out = generate_by_length(model, prompts, max_new_tokens=news, pad_token_id=PAD, eos_token_id=eos,
                             capacity=CAPACITY, memory=run.memory)
    assert out.trials == [] and out.ooms == 0
    # greedy: a prompt's first n tokens do not depend on how many come after them
    assert list(out) == [ref[:n] for ref, n in zip(reference, news)]
    assert out.memory is not run.memory  # the caller's model is left as it was


def test_an_oom_mid_run_splits_the_batch_and_no_prompt_is_lost_or_run_twice(model, prompts, run, reference, eos):
    # a model that promises twice the room it has: the first batch runs out of the emulated capacity
    m = run.memory
    wrong = dataclasses.replace(
        m, prefill=LengthFit(fixed=m.prefill.fixed, per_sample=tuple(x / 2 for x in m.prefill.per_sample),
                             lengths=m.prefill.lengths),
        decode=tuple((T, e, d / 2) for T, e, d in m.decode))
    calls = []
    real = model.generate

    def counted(*args, **kwargs):
        calls.append(kwargs["attention_mask"].shape[0])
        return real(*args, **kwargs)

    model.generate = counted
    try:
        with emulate_capacity(CAPACITY, track=[model]):  # the caller's own emulation counts
            out = generate_by_length(model, prompts, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos,
                                     memory=wrong)
    finally:
        del model.generate
    assert list(out) == reference
    assert 1 <= out.ooms <= 2
    assert sum(b for b, _, _ in out.batches) == len(prompts)  # completed batches hold each prompt once
    assert len(calls) == len(out.batches) + out.ooms
    # the batches after the OOM were sized by the corrected model: none ran out again
    assert out.memory.scale > 1.5


def test_the_fallback_of_a_refused_fit_sizes_by_what_ran():
    trials = [GenerationTrial(batch_size=b, prompt_length=P, max_new_tokens=8, outcome=o)
              for b, P, o in [(1, 40, "fit"), (3, 40, "fit"), (6, 40, "over_target"), (9, 10, "fit")]]
    sizer = _TrialSizer(trials, 8, 100)
    assert [sizer(L) for L in (40, 20, 10, 5, 41)] == [3, 3, 9, 9, 1]
    sizer.note_oom(9, 10, 8)
    assert sizer(5) == 4


def test_an_empty_list_gives_an_empty_result_without_running(model):
    out = generate_by_length(model, [], max_new_tokens=NEW, pad_token_id=PAD)
    assert out == [] and out.trials == [] and out.batches == []


@pytest.mark.parametrize("prompts, kwargs, error, match", [
    ([[5] * 250], {"max_new_tokens": 8}, ValueError, r"prompt 0 has 250 tokens and max_new_tokens=8: 258 positions"),
    ([[5] * 300], {"max_new_tokens": 8}, ValueError, r"more than the model's context of 256: truncate"),
    ([[5] * 4], {"max_new_tokens": 256}, ValueError, "leaves no room for a prompt"),
    ([[5, 6], []], {"max_new_tokens": 8}, ValueError, "prompt 1 is empty"),
    ([[5, 999]], {"max_new_tokens": 8}, ValueError, "outside the model's vocabulary of 384"),
    ([[5, -1]], {"max_new_tokens": 8}, ValueError, "no token id"),
    ("hello", {"max_new_tokens": 8}, TypeError, "tokenize first"),
    (torch.ones(2, 5, dtype=torch.long), {"max_new_tokens": 8}, TypeError, "without padding"),
    ([[5, 6]], {"max_new_tokens": 0}, ValueError, "positive int"),
    ([[5, 6], [7]], {"max_new_tokens": [8]}, ValueError, "one per prompt"),
    ([[5, 6]], {"max_new_tokens": 8, "max_length": 20}, ValueError, "use max_new_tokens"),
    ([[5, 6]], {"max_new_tokens": 8, "num_return_sequences": 2}, ValueError, "one sequence per prompt"),
    ([[5, 6]], {"max_new_tokens": 8, "target": 0}, BatchSizeError, "target"),
    ([[5, 6]], {"max_new_tokens": 8, "capacity": "a lot"}, BatchSizeError, "memory size"),
    ([[5, 6]], {"max_new_tokens": 8, "pad_token_id": 384}, ValueError, "pad_token_id=384"),
])
def test_bad_input_is_refused_before_any_generate(model, prompts, kwargs, error, match):
    kwargs = {"pad_token_id": PAD, **kwargs}
    calls = []
    model.generate = lambda *a, **k: calls.append(1)
    try:
        with pytest.raises(error, match=match):
            generate_by_length(model, prompts, **kwargs)
    finally:
        del model.generate
    assert calls == []


def test_a_prompt_that_fits_no_batch_and_a_memory_fitted_on_shorter_prompts(model, run):
    with pytest.raises(NothingFitsError, match="one prompt of 200 tokens"):
        generate_by_length(model, [[5] * 200], max_new_tokens=NEW, pad_token_id=PAD, capacity="700KiB")
    with pytest.raises(UnverifiedShapeError, match="beyond what the trials measured"):
        generate_by_length(model, [[5] * 60], max_new_tokens=NEW, pad_token_id=PAD, capacity=CAPACITY,
                           memory=run.memory)


def test_a_model_error_keeps_its_type_and_says_where(model, run):
    # generate's own error for an argument it does not know: in a sizing trial, then in a batch
    with pytest.raises(ValueError, match="not used by the model") as info:
        generate_by_length(model, [[5, 6, 7]], max_new_tokens=2, pad_token_id=PAD, capacity=CAPACITY, not_an_option=1)
    assert any("in a sizing trial" in note for note in info.value.__notes__)
    with pytest.raises(ValueError, match="not used by the model") as info:
        generate_by_length(model, [[5, 6, 7]], max_new_tokens=2, pad_token_id=PAD, capacity=CAPACITY,
                           memory=run.memory, not_an_option=1)
    assert any("in a generate batch of 1 prompts padded to 3 tokens" in note for note in info.value.__notes__)


def test_ranks_agree_on_the_most_cautious_size_and_every_rank_takes_part_once(model, prompts, run, reference, eos):
    # a stand-in for torch.distributed.all_gather_object: this rank, then a "rank 1" whose device holds
    # a third of this one's room, answering from this run's own model in that smaller room
    small = dataclasses.replace(run.memory, trials=[], limit_bytes=run.memory.start_bytes
                                + (run.memory.limit_bytes - run.memory.start_bytes) // 3)
    calls = []

    def agree(obj):
        calls.append(obj)
        from batchpilot.infer.generate import _Peer

        return [obj, {"id": "rank1", "payload": _Peer(small, []), "failed": None}]

    agreed = generate_by_length(model, prompts, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos,
                                capacity=CAPACITY, memory=run.memory, agree=agree)
    assert list(agreed) == reference and len(calls) == 1
    assert agreed.batches and all(b <= max(1, small.max_batch(L, N)) for b, L, N in agreed.batches)
    plain = generate_by_length(model, prompts, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos,
                               capacity=CAPACITY, memory=run.memory)
    assert max(b for b, _, _ in agreed.batches) < max(b for b, _, _ in plain.batches)  # lowered by the peer
    # no prompts: the rank still takes part, once; a peer's failure stops this rank too
    calls.clear()
    assert generate_by_length(model, [], max_new_tokens=NEW, pad_token_id=PAD, agree=agree) == [] and len(calls) == 1
    with pytest.raises(RuntimeError, match="generation sizing failed on rank 1"):
        generate_by_length(model, prompts, max_new_tokens=NEW, pad_token_id=PAD, capacity=CAPACITY, memory=run.memory,
                           agree=lambda obj: [obj, {"id": "x", "payload": None, "failed": "NothingFitsError: no"}])
    # this rank's own bad input reaches the agreement before it is raised
    calls.clear()
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate_by_length(model, [[]], max_new_tokens=NEW, pad_token_id=PAD, agree=agree)
    assert len(calls) == 1 and calls[0]["failed"].startswith("ValueError")
