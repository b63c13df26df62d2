"""BatchpilotLM: lm-eval's HFLM batched by length, with HFLM's own results at batch size 1.

A tiny Llama built from a config and a word-level tokenizer built locally (tests/helpers/tiny_llama.py):
no download. The reference is lm-eval's own ``HFLM(batch_size=1)`` on the same model object.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import score_rlimit  # noqa: E402
import tiny_llama  # noqa: E402
from dist_launch import torchrun  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from batchpilot.integrations.lm_eval import BatchpilotLM  # noqa: E402
from batchpilot.policy.lengths import LengthBudget  # noqa: E402

CONTEXT = 96
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
HAS_GENERATE = importlib.util.find_spec("batchpilot.infer.generate") is not None


@pytest.fixture(scope="module")
def model():
    return tiny_llama.model(context=CONTEXT)


@pytest.fixture(scope="module")
def tok():
    return tiny_llama.tokenizer()


@pytest.fixture(scope="module")
def ref(model, tok):
    return HFLM(pretrained=model, tokenizer=tok, batch_size=1)


class Calls:
    """Forward calls of a module (a hook: what lm-eval's model calls cost)."""

    def __init__(self, module) -> None:
        self.count = 0
        self.handle = module.register_forward_hook(self)

    def __call__(self, *args) -> None:
        self.count += 1


def _greedy_requests(model, tok, n: int = 3) -> list:
    """Requests whose continuation is the model's own greedy next word: ``is_greedy`` True."""
    from lm_eval.api.instance import Instance

    out = []
    for k, ctx in enumerate(tiny_llama.texts([5, 9, 14][:n], seed=11)):
        with torch.no_grad():
            nxt = int(model(torch.tensor([tok.encode(ctx)])).logits[0, -1].argmax())
        out.append(Instance("loglikelihood", {}, (ctx, " " + tok.decode([nxt])), 1000 + k))
    return out


def test_registered_as_batchpilot() -> None:
    assert get_model("batchpilot") is BatchpilotLM


def test_loglikelihood_equals_hflm_at_batch_size_1_in_fewer_calls(model, tok, ref) -> None:
    requests = tiny_llama.loglikelihood_requests(40, context=CONTEXT) + _greedy_requests(model, tok)
    counter = Calls(model)
    want = ref.loglikelihood(requests, disable_tqdm=True)
    hflm_calls, counter.count = counter.count, 0
    lm = BatchpilotLM(pretrained=model, tokenizer=tok, capacity="1MiB")
    got = lm.loglikelihood(requests, disable_tqdm=True)
    counter.handle.remove()
    assert [g for _, g in got] == [w for _, w in want] and sum(g for _, g in got) >= 3
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], rel=1e-5, abs=1e-4)
    assert counter.count < hflm_calls / 2, (counter.count, hflm_calls)
    assert not any(b.oom for b in lm.scorer.batches)
    assert lm.loglikelihood([], disable_tqdm=True) == []


def test_loglikelihood_asks_the_model_for_the_continuations_logits_only(model, tok, ref) -> None:
    requests = tiny_llama.loglikelihood_requests(30, context=CONTEXT, seed=4)
    widths: list[tuple[int, int | None]] = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: widths.append((args[0].shape[1], kwargs.get("logits_to_keep"))), with_kwargs=True)
    lm = BatchpilotLM(pretrained=model, tokenizer=tok, capacity="1MiB")
    try:
        got = lm.loglikelihood(requests, disable_tqdm=True)
    finally:
        handle.remove()
    want = ref.loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in got] == [w for _, w in want]
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], rel=1e-5, abs=1e-4)
    # every forward asked for some positions, never more than it had, and most for far fewer
    assert widths and all(keep is not None and 1 <= keep <= width for width, keep in widths), widths
    assert sum(keep for _, keep in widths) < sum(width for width, _ in widths) / 2, widths
    # a model whose forward takes no logits_to_keep gets HFLM's call, with the same results
    lm._keeps_logits = lambda: False
    full = lm.loglikelihood(requests, disable_tqdm=True)
    assert [g for _, g in full] == [g for _, g in got]
    assert [v for v, _ in full] == pytest.approx([v for v, _ in got], rel=1e-6, abs=1e-6)


def test_loglikelihood_under_a_real_rlimit_as_runs_out_of_memory_at_most_once_before_the_first_batch() -> None:
    """Issue #26's 360 requests in a plain fresh process under RLIMIT_AS = mapped + 176 MiB."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    # the tokenizer's threads off: their glibc arenas, made after the cap, would take 144 of the
    # 176 MiB (benchmarks/README.md reports that case)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(HELPERS / "score_rlimit.py"), "176"], env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    batches = out["batches"]
    first = next(k for k, (_, _, trial, _) in enumerate(batches) if not trial)
    assert not any(oom for *_, oom in batches[first + 1:]), batches
    assert sum(oom for *_, oom in batches) <= 1, batches
    # the model was measured down to the median request, where most of them ran
    lengths = out["lengths"]
    assert min(out["fitted"]) <= lengths[len(lengths) // 2] and max(out["fitted"]) == lengths[-1], out["fitted"]
    assert out["widest_kept"] < lengths[-1]
    ref = HFLM(pretrained=score_rlimit.model(), tokenizer=tiny_llama.tokenizer(words=score_rlimit.WORDS),
               batch_size=1)
    want = ref.loglikelihood(score_rlimit.requests(), disable_tqdm=True)
    assert [g for _, g in out["results"]] == [g for _, g in want]
    assert [v for v, _ in out["results"]] == pytest.approx([v for v, _ in want], rel=1e-4, abs=1e-3)
    assert out["forward_calls"] <= len(want) / 4


def test_loglikelihood_rolling_equals_hflm_including_documents_longer_than_the_context(model, tok, ref) -> None:
    docs = tiny_llama.rolling_requests([5, 40, 250, CONTEXT, CONTEXT + 1])
    lm = BatchpilotLM(pretrained=model, tokenizer=tok, capacity="1MiB")
    assert lm.loglikelihood_rolling(docs, disable_tqdm=True) == pytest.approx(
        ref.loglikelihood_rolling(docs, disable_tqdm=True), rel=1e-5, abs=1e-4)
    assert lm.loglikelihood_rolling([], disable_tqdm=True) == []


@pytest.mark.skipif(not HAS_GENERATE, reason="batchpilot.infer.generate (generate_by_length) is not in this tree yet")
def test_generate_until_equals_hflm_greedy_in_input_order(model, tok, ref) -> None:
    requests = tiny_llama.generate_requests(12, context=CONTEXT - 16,
                                            gen_kwargs={"until": ["w7"], "max_gen_toks": 12, "do_sample": False})
    lm = BatchpilotLM(pretrained=model, tokenizer=tok, capacity="2MiB")
    assert lm.generate_until(requests, disable_tqdm=True) == ref.generate_until(requests, disable_tqdm=True)
    # one group of gen_kwargs: one run, whose sizing trials ran real prompts (greedy) and kept them
    (run,) = lm.generations
    assert run.ooms == 0 and run.trials[0].prompts
    kept = sum(len(t.prompts) for t in run.trials if t.outputs)
    assert kept + sum(b for b, _, _ in run.batches) == len(requests)
    assert run.generate_calls < len(requests)


def test_bad_input_gets_a_clear_error(model, tok) -> None:
    from lm_eval.api.instance import Instance

    lm = BatchpilotLM(pretrained=model, tokenizer=tok, capacity="1MiB")
    ask = [Instance("generate_until", {}, ("w1 w2", {"until": ["w7"], "max_gen_toks": CONTEXT}), 0)]
    with pytest.raises(ValueError, match=f"max_gen_toks={CONTEXT} leaves no room for a prompt"):
        lm.generate_until(ask, disable_tqdm=True)
    assert lm.generate_until([], disable_tqdm=True) == []
    long = " " + " ".join(["w3"] * (CONTEXT + 1))
    with pytest.raises(ValueError, match="continuation of 97 tokens is longer than the model's context of 96"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("w1", long), 0)], disable_tqdm=True)
    with pytest.raises(ValueError, match="target must be"):
        BatchpilotLM(pretrained=model, tokenizer=tok, target=2)


def test_two_ranks_agree_and_a_rank_with_fewer_requests_never_waits(tmp_path) -> None:
    torchrun(HELPERS / "lm_eval_worker.py", str(tmp_path), timeout=240,
             finished=lambda out: "done 0" in out and "done 1" in out)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        (ll, rolling), (ll_want, rolling_want) = r["got"], r["want"]
        assert [g for _, g in ll] == [g for _, g in ll_want]
        assert [v for v, _ in ll] == pytest.approx([v for v, _ in ll_want], rel=1e-5, abs=1e-4)
        assert rolling == pytest.approx(rolling_want, rel=1e-5, abs=1e-4)
    # rank 0 (twice the memory) ran no batch larger than rank 1's model allows where rank 1 answers
    small = LengthBudget.from_state(ranks[1]["first_budget"])
    shared = [(size, L) for size, L, trial, _ in ranks[0]["batches"][0] if not trial and L <= small.verified_max]
    assert shared and all(size <= small.micro_batch(L) for size, L in shared)
    # generate_until: greedy outputs equal HFLM's at batch size 1 on both ranks, in input order;
    # rank 1 took part in the agreement of the group it has no prompts in, and rank 0 ran no batch
    # larger than rank 1's model allows at the same shape
    for r in ranks:
        assert r["generated"] == r["generated_want"]
    assert (ranks[0]["groups"], ranks[1]["groups"]) == (2, 1)
    mine, theirs = ranks[0]["answers_at_rank0_batches"], ranks[1]["answers_at_rank0_batches"]
    answered = [(b, own[3], a[3]) for own, a in zip(mine, theirs) if a[3] is not None for b in [own[0]]]
    assert answered and all(b <= max(1, a) for b, _, a in answered), (mine, theirs)
    assert any(own is not None and own > a for _, own, a in answered), (mine, theirs)  # the agreement lowered one
