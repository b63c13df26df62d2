"""An lm-evaluation-harness model whose batches are sized by length: ``--model batchpilot``.

:class:`BatchpilotLM` is lm-eval's ``HFLM`` (same arguments, same tokenization, truncation and
scoring) with its batching replaced: ``loglikelihood`` and ``loglikelihood_rolling`` run through
:class:`batchpilot.infer.score.LengthScorer` (longest first, each batch sized for its own padded
length, an OOM split and retried) and ``generate_until`` through
:func:`batchpilot.infer.generate.generate_by_length` (batches grouped by prompt length and sized for
``generate``'s KV cache). Results are HFLM's at ``batch_size=1``, in the order lm-eval asked.

Importing this module registers the model as ``batchpilot``. lm-eval 0.4.13 finds models only in
its registry (no entry points), so the ``lm_eval`` command needs the import first: run
``python -m batchpilot.integrations.lm_eval`` with ``lm_eval``'s own arguments, which registers
the model and hands over to lm-eval's command line.

Under ``accelerate launch`` (several ranks) each rank sizes for its own device and requests, then
one all-gather per call (for ``generate_until``, one per ``gen_kwargs`` group any rank has, after
one for the groups) gives every rank the most cautious rank's size at every length; nothing else
is collective, so a rank with more requests never leaves another waiting.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .._checks import positive_int
from ..find.options import FindOptions
from ..infer.ranks import exchange
from ..infer.score import LengthScorer
from ._common import require

require("lm_eval", "batchpilot.integrations.lm_eval")

from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text  # noqa: E402
from lm_eval.models.utils_hf import pad_and_concat  # noqa: E402

__all__ = ["BatchpilotLM", "main"]

logger = logging.getLogger(__name__)

#: (cache key, context tokens, continuation tokens): a tokenized loglikelihood request, as HFLM holds it
TokenRequest = tuple[Any, list[int], list[int]]


class BatchpilotLM(HFLM):
    """lm-eval's ``HFLM``, batched by length: every argument of ``HFLM`` and three of batchpilot's.

    Args:
        pretrained: a model name or path, or a ``transformers`` model (as ``HFLM``).
        target: fraction of the device memory a batch may use, in (0, 1].
        capacity: device memory to size for (bytes or ``"24GiB"``, CPU and CUDA); default the
            device's real memory.
        max_batch_size: the most requests in one batch; ``None`` (unlike HFLM's 64): as many as fit.
        batch_size: accepted for compatibility with ``--batch_size``; batchpilot sizes every batch
            itself (an int other than 1 is logged and ignored).
        **kwargs: any other argument of ``HFLM`` (``tokenizer``, ``max_length``, ``dtype``, ...).

    Attributes:
        scorer: the :class:`~batchpilot.infer.score.LengthScorer` of ``loglikelihood`` and rolling windows.
        generations: the last ``generate_until``'s runs of
            :func:`~batchpilot.infer.generate.generate_by_length`, one per group of requests with the
            same ``gen_kwargs`` (each a :class:`~batchpilot.infer.generate.Generations`: trials, batches, OOMs).

    Raises:
        BatchSizeError: ``target`` outside (0, 1] or an unreadable ``capacity`` (before the model loads).
    """

    def __init__(self, pretrained: Any, *, target: float | str | None = None, capacity: int | str | None = None,
                 max_batch_size: int | None = None, batch_size: int | str | None = 1, **kwargs: Any) -> None:
        if batch_size not in (None, 1, "1") and not str(batch_size).startswith("auto"):
            logger.info("batch_size=%s ignored: batchpilot sizes each batch by its length (max_batch_size caps it)",
                        batch_size)
        if isinstance(target, str):  # from --model_args; what does not read as a number, FindOptions refuses
            with contextlib.suppress(ValueError):
                target = float(target)
        options = FindOptions(**({} if target is None else {"target": target}), capacity=capacity)  # bad options fail before the model loads
        max_batch_size = None if max_batch_size is None else positive_int("max_batch_size", int(max_batch_size))
        super().__init__(pretrained, batch_size=1, max_batch_size=max_batch_size or 64, **kwargs)
        self.max_batch_size = max_batch_size
        self.target, self.capacity = float(options.target), options.capacity
        # one scorer for loglikelihood and rolling windows: the same forward, the same memory per (batch, length)
        self.scorer = LengthScorer(self._score_batch, length=self._row_length, target=self.target,
                                   capacity=self.capacity, device=self.device, max_length=self.max_length,
                                   max_batch_size=self.max_batch_size, track=[self.model], agree=self._all_gather,
                                   pads=True)
        self.generations: list[Any] = []

    # ------------------------------------------------------------------ ranks
    def _all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``: the one collective of a scoring call, which every rank reaches once."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    # ------------------------------------------------------------------ loglikelihood
    def _row(self, context: list[int], continuation: list[int]) -> list[int]:
        """The input row HFLM builds: context + continuation, the last token dropped, left-truncated to the context."""
        return (context + continuation)[-(self.max_length + 1):][:-1]

    def _row_length(self, group: list[tuple[int, TokenRequest]]) -> int:
        _, (_, context, continuation) = group[0]
        return len(self._row(context, continuation))

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """``(log-likelihood, is greedy)`` of each continuation, in the order given.

        Requests whose context + continuation[:-1] agree share one row (HFLM's ``logits_cache``),
        scored from the one whose continuation is the longest, as HFLM does.
        """
        if self.backend != "causal":  # seq2seq pads encoder and decoder apart: HFLM's own loop
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation in tokens "
                                 f"(HFLM puts the prefix token before an empty context), got {context!r}, "
                                 f"{continuation!r}")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer than the model's context "
                                 f"of {self.max_length}; shorten it or raise max_length")
        groups: dict[Any, list[tuple[int, TokenRequest]]] = {}
        for i, req in enumerate(requests):
            key = tuple(req[1] + req[2][:-1]) if self.logits_cache else i
            groups.setdefault(key, []).append((i, req))
        rows = []
        for members in groups.values():
            # the row is scored from the member with the longest continuation (HFLM's Collator)
            rep = max(range(len(members)), key=lambda k: len(members[k][1][2]))
            rows.append([members[rep], *members[:rep], *members[rep + 1:]])
        answers = self.scorer.score(rows)
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for group, values in zip(rows, answers):
            for (i, (cache_key, _, _)), answer in zip(group, values):
                out[i] = answer
                if cache_key is not None:
                    self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return out  # type: ignore[return-value]

    def _score_batch(self, rows: list[list[tuple[int, TokenRequest]]], width: int) -> list[list[tuple[float, bool]]]:
        """One forward for ``rows`` right-padded to ``width``; each row's answers, its representative's first.

        A row's logits do not depend on the padding after it (causal attention), so a sizing trial
        padded wider than its rows gives them HFLM's results.
        """
        inps, inplens = [], []
        for group in rows:
            _, (_, context, continuation) = group[0]
            inp = torch.tensor(self._row(context, continuation), dtype=torch.long, device=self.device)
            inps.append(inp)
            inplens.append(inp.shape[0])
        padding_len_inp = max(width, *inplens)
        batched = pad_and_concat(padding_len_inp, inps, padding_side="right")
        # only the positions some row scores (its continuation's, the last of its row) need logits; right
        # padding puts the shortest row's furthest from the end
        keep = max(padding_len_inp - inplen + len(group[0][1][2]) for group, inplen in zip(rows, inplens))
        multi_logits = F.log_softmax(self._model_call(batched, logits_to_keep=keep), dim=-1,
                                     dtype=self.softmax_dtype)
        out = []
        for group, logits, inplen in zip(rows, multi_logits, inplens):
            _, (_, _, rep_cont) = group[0]
            ctx_len = inplen + (logits.shape[0] - padding_len_inp)
            logits = self._select_cont_toks(logits, contlen=len(rep_cont), inplen=ctx_len).unsqueeze(0)
            greedy_tokens = logits.argmax(dim=-1)
            answers = []
            for _, (_, _, cont) in group:  # as HFLM's Collator.get_cache: every member from the representative's logits
                cont_toks = torch.tensor(cont, dtype=torch.long, device=self.device).unsqueeze(0)
                max_equal = (greedy_tokens[:, -cont_toks.shape[1]:] == cont_toks).all()
                picked = torch.gather(logits, 2, cont_toks.unsqueeze(-1)).squeeze(-1)
                answers.append((float(picked.sum()), bool(max_equal)))
            out.append(answers)
        return out

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None, logits_to_keep: int | None = None) -> torch.Tensor:
        """HFLM's forward; with ``logits_to_keep``, the logits of the last that many positions only.

        Scoring needs the log-softmax of a row's continuation alone, but HFLM computes the model's
        head and a log-softmax over the vocabulary at every position: the largest tensors of a
        short request's forward (a 4-layer, 1000-word model at 43 tokens: 0.71 against 1.15 ms per
        request in batches of 8 on a 2-core CPU). Models whose ``forward`` takes
        ``logits_to_keep`` (transformers' causal LMs) skip the rest; the values are HFLM's.
        """
        if logits_to_keep is None or attn_mask is not None or labels is not None or not self._keeps_logits():
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        amp = getattr(self, "mixed_precision_dtype", None)  # HFLM's autocast dtype, where its version has one
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=amp, enabled=amp is not None):
            return self.model(inps, logits_to_keep=logits_to_keep).logits

    def _keeps_logits(self) -> bool:
        """Whether the model's ``forward`` takes ``logits_to_keep`` by name."""
        try:
            return "logits_to_keep" in inspect.signature(self.model.forward).parameters
        except (TypeError, ValueError):
            return False

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, over HFLM's disjoint windows of the model's context."""
        windows: list[TokenRequest] = []
        counts = []
        for (string,) in [req.args for req in requests]:
            rolling = list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)))
            windows.extend((None, context, continuation) for context, continuation in rolling)
            counts.append(len(rolling))
        nlls = self._loglikelihood_tokens(windows, disable_tqdm=True)
        out, at = [], 0
        for req, count in zip(requests, counts):
            total = sum(nll for nll, _ in nlls[at:at + count])
            at += count
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return out

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations until a stop sequence, batched by prompt length per ``gen_kwargs``.

        Raises:
            ValueError: ``max_gen_toks`` that leaves no room for a prompt in the model's context.
        """
        if self.backend != "causal":
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            if not isinstance(req.args[1], dict):
                raise ValueError(f"generate_until's gen_kwargs must be a dict, got {type(req.args[1]).__name__}")
            groups.setdefault(repr(sorted(req.args[1].items(), key=lambda kv: kv[0])), []).append(i)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        jobs = {}
        error: Exception | None = None
        try:
            for key, idx in groups.items():  # every group checked before any generates
                kwargs = normalize_gen_kwargs(copy.deepcopy(requests[idx[0]].args[1]), self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = kwargs.pop("max_gen_toks")
                room = self.max_length - max_gen_toks
                if room <= 0:
                    raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a prompt in the model's context "
                                     f"of {self.max_length} tokens; ask for fewer new tokens (below {self.max_length})")
                jobs[key] = (idx, kwargs, until, max_gen_toks, room)
        except Exception as exc:  # with several ranks, every rank must reach the agreement on the groups
            if self.world_size == 1:
                raise
            error = exc
        order = list(jobs)
        if self.world_size > 1:
            # the ranks' requests differ, and so may their gen_kwargs groups: every rank runs every group
            # any rank has, in one order (with no prompts where it has none), so that each group's one
            # agreement pairs up
            others = exchange(self._all_gather, sorted(jobs), error, what="generate_until")
            order = sorted(set(jobs).union(*others))
        out: list[str | None] = [None] * len(requests)
        self.generations = []
        if not order:
            return []
        from ..infer.generate import generate_by_length  # the generation half, imported when used

        agree = self._all_gather if self.world_size > 1 else None
        for key in order:
            if key not in jobs:  # another rank's group: take part in its agreement, generate nothing
                generate_by_length(self.model, [], max_new_tokens=1, pad_token_id=self.tokenizer.pad_token_id,
                                   agree=agree)
                continue
            idx, kwargs, until, max_gen_toks, room = jobs[key]
            # one prompt at a time, as HFLM at batch size 1: no padding, left-truncated to the room
            prompts = [self.tok_batch_encode([requests[i].args[0]], left_truncate_len=room,
                                             truncation=self.truncation)[0][0].tolist() for i in idx]
            max_length = kwargs.pop("max_length", None)
            new_tokens: int | list[int] = max_gen_toks if max_length is None else \
                [max(1, max_length - len(p)) for p in prompts]
            generated = generate_by_length(
                self.model, prompts, max_new_tokens=new_tokens, pad_token_id=self.tokenizer.pad_token_id,
                target=self.target, capacity=self.capacity, device=self.device, agree=agree,
                **_generate_kwargs(kwargs))
            self.generations.append(generated)
            for i, tokens in zip(idx, generated):
                out[i] = self._finish(list(tokens), until)
                self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out  # type: ignore[return-value]

    def _finish(self, tokens: list[int], until: list[str]) -> str:
        """HFLM's post-processing of one generation: the thinking part, the stop sequences."""
        if isinstance(self.think_end_token, int):
            ends = [k for k, tok in enumerate(tokens) if tok == self.think_end_token]
            if ends:
                tokens = tokens[ends[-1] + 1:]
        text = self.tok_decode(tokens)
        if isinstance(self.think_end_token, int):
            text = text.lstrip()
        return postprocess_generated_text(generation=text, stop=until, think_end_token=self.think_end_token
                                          if isinstance(self.think_end_token, str) else None)


if __name__ != "__main__":  # under python -m this file runs as __main__: main() imports and registers the real one
    register_model("batchpilot")(BatchpilotLM)


def _generate_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """HFLM's generation kwargs: temperature 0 means greedy (``do_sample=False``, no temperature)."""
    kwargs = dict(kwargs)
    kwargs["temperature"] = kwargs.get("temperature", 0.0)
    do_sample = kwargs.get("do_sample")
    if kwargs["temperature"] == 0.0 and do_sample is None:
        kwargs["do_sample"] = do_sample = False
    if do_sample is False and kwargs["temperature"] == 0.0:
        kwargs.pop("temperature")
    return kwargs


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line, with ``batchpilot`` registered: ``python -m batchpilot.integrations.lm_eval ...``."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    from batchpilot.integrations.lm_eval import main as _main

    _main()
