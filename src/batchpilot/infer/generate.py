"""``model.generate`` over many prompts, batched by prompt length and sized from the memory model.

:func:`generate_by_length` fits :class:`~batchpilot.infer.genmemory.GenerationMemory` on the prompts'
lengths (at most three real trials per fitted length; with greedy decoding the trials run the
real prompts and keep their outputs), cuts the rest longest first into batches each sized for its
own padded length (:func:`~batchpilot.policy.lengths.plan_length_split`) and padding no prompt past
twice its length by more than ``max_new_tokens``, left-pads each batch, and returns every prompt's new tokens in input order; an OOM mid-run splits
the failing batch and retries it, with the model corrected for the batches after it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .._checks import positive_int
from ..find.notes import add_note
from ..memory.oom import attempt, is_oom
from ..memory.units import resolve_device
from ..policy.lengths import plan_length_split
from ..policy.search import FIT, NothingFitsError
from .genmemory import (
    GenerationFitError,
    GenerationMemory,
    GenerationTrial,
    MemoryRoom,
    UnverifiedShapeError,
    band_low,
    check_token_id,
    context_length,
    eos_ids,
    fit_in,
    memory_room,
    model_device,
)
from .ranks import exchange

__all__ = ["Generations", "generate_by_length"]

logger = logging.getLogger(__name__)

#: generate's arguments that generate_by_length sets itself, with how to say them instead
_OWN_ARGUMENTS = {
    "input_ids": "pass the prompts as the second argument",
    "inputs": "pass the prompts as the second argument",
    "attention_mask": "generate_by_length pads the prompts and makes the mask itself",
    "max_length": "use max_new_tokens (the total varies with each prompt's length)",
}
#: arguments by which something other than EOS and max_new_tokens may end a row (then generate pads it)
_OTHER_STOPS = ("stopping_criteria", "stop_strings", "max_time")
#: arguments under which a row's tokens depend on more than its own greedy picks (the sizing trials
#: then run made-up prompts: theirs hold back an EOS, which only greedy decoding can put back)
_NOT_GREEDY = ("penalty_alpha", "assistant_model", "prompt_lookup_num_tokens", "streamer")


class Generations(list):
    """The new tokens of each prompt, in input order (a ``list`` of ``list[int]``), and how they were made.

    Attributes:
        memory: the memory model the batches were sized by (``None``: the fit was refused and
            the batches were sized by the trials that ran, see ``sized_by``).
        sized_by: ``"model"``, ``"trials"`` (a refused fit's fallback) or ``"none"`` (no prompt).
        trials: the sizing trials (real ``generate`` calls; under greedy decoding on the real prompts,
            whose outputs are kept).
        batches: ``(batch size, padded length, max_new_tokens)`` of every batch that completed, in order.
        ooms: batches that ran out of memory and were split (after sizing).
        sizing_seconds: the trials' wall time; ``seconds``: the whole call's.
    """

    memory: GenerationMemory | None = None
    sized_by: str = "none"
    trials: list[GenerationTrial]
    batches: list[tuple[int, int, int]]
    ooms: int = 0
    sizing_seconds: float = 0.0
    seconds: float = 0.0

    def __init__(self, rows: Sequence[list[int]] = ()) -> None:
        super().__init__(rows)
        self.trials, self.batches = [], []

    @property
    def generate_calls(self) -> int:
        """Calls of ``generate`` made: the trials, the batches and the ones that ran out of memory."""
        return len(self.trials) + len(self.batches) + self.ooms


@dataclass
class _ModelSizer:
    """Batch sizes from the memory model in this room; an OOM scales the model."""

    memory: GenerationMemory
    room: MemoryRoom
    max_new_tokens: int
    cap: int

    def __call__(self, length: int) -> int:
        return self.memory.max_batch(length, self.max_new_tokens, limit_bytes=self.room.limit_bytes,
                                     start_bytes=self.room.start_bytes, max_batch_size=self.cap)

    def note_oom(self, batch_size: int, length: int, max_new_tokens: int) -> None:
        self.memory.note_oom(batch_size, length, max_new_tokens, capacity_bytes=self.room.capacity_bytes,
                             start_bytes=self.room.start_bytes)

    def observe(self, batch_size: int, length: int, max_new_tokens: int, growth_bytes: int) -> bool:
        return self.memory.observe(batch_size, length, max_new_tokens, growth_bytes, room_bytes=self.room.room_bytes)


@dataclass
class _TrialSizer:
    """A refused fit's fallback: the largest batch a trial ran within the limit at a shape at least as long.

    A shorter prompt with as many new tokens needs no more memory, so what ran there fits; with
    no such trial, one prompt at a time. An OOM halves every answer from then on.
    """

    trials: list[GenerationTrial]
    max_new_tokens: int
    cap: int
    ceiling: int | None = None

    def __call__(self, length: int) -> int:
        ran = [t.batch_size for t in self.trials if t.outcome == FIT and t.prompt_length >= length
               and t.max_new_tokens >= self.max_new_tokens]
        answer = min(max(ran, default=1), self.cap)
        return answer if self.ceiling is None else min(answer, self.ceiling)

    def note_oom(self, batch_size: int, length: int, max_new_tokens: int) -> None:
        self.ceiling = max(1, batch_size // 2) if self.ceiling is None else max(1, min(self.ceiling, batch_size // 2))

    def observe(self, batch_size: int, length: int, max_new_tokens: int, growth_bytes: int) -> bool:
        return False  # no model to correct


@dataclass
class _Peer:
    """Another rank's sizing, asked at this rank's shapes: its model in its own room, or its fallback's trials."""

    memory: GenerationMemory | None
    ran: list[tuple[int, int, int]]  # (batch, padded prompt length, max_new_tokens) of its trials that fit

    @classmethod
    def of(cls, memory: GenerationMemory | None, trials: Sequence[GenerationTrial]) -> _Peer:
        slim = None if memory is None else dataclasses.replace(memory, trials=[], verified=dict(memory.verified))
        return cls(slim, [(t.batch_size, t.prompt_length, t.max_new_tokens) for t in trials if t.outcome == FIT])

    def at(self, length: int, max_new_tokens: int) -> int | None:
        """Its largest batch at this shape; ``None`` where it measured nothing as long (it does not answer)."""
        if self.memory is not None:
            try:
                return max(1, self.memory.max_batch(length, max_new_tokens))
            except UnverifiedShapeError:
                return None
        sizes = [b for b, P, N in self.ran if P >= length and N >= max_new_tokens]
        return max(sizes) if sizes else None


@dataclass
class _AgreedSizer:
    """This rank's sizer, lowered to any other rank's answer at the same shape: the most cautious rank's size."""

    own: Any
    peers: list[_Peer]
    max_new_tokens: int

    def __call__(self, length: int) -> int:
        theirs = [p.at(length, self.max_new_tokens) for p in self.peers]
        return min([self.own(length), *(b for b in theirs if b is not None)])

    def note_oom(self, batch_size: int, length: int, max_new_tokens: int) -> None:
        self.own.note_oom(batch_size, length, max_new_tokens)

    def observe(self, batch_size: int, length: int, max_new_tokens: int, growth_bytes: int) -> bool:
        return self.own.observe(batch_size, length, max_new_tokens, growth_bytes)


def _prompts(prompts: Any, vocab: int | None) -> list[list[int]]:
    """``prompts`` as lists of token ids, checked (before anything runs)."""
    if isinstance(prompts, torch.Tensor):
        raise TypeError(f"prompts is a tensor of shape {tuple(prompts.shape)}: give one sequence of token ids per "
                        "prompt, without padding (e.g. [row[mask].tolist() for row, mask in zip(ids, attention_mask.bool())])")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence of token-id sequences (one list of ints per prompt), got "
                        f"{type(prompts).__name__}; tokenize first, e.g. [tokenizer(t).input_ids for t in texts]")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.dim() != 1:
                raise ValueError(f"prompt {i} is a tensor of shape {tuple(p.shape)}: give each prompt as one "
                                 "sequence of token ids (a 1-D tensor or a list), without padding")
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TypeError(f"prompt {i} must be a sequence of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: generate needs at least one token to start from (a BOS token)")
        ids = []
        for tok in p:
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
                raise ValueError(f"prompt {i} holds {tok!r}, which is no token id (an int >= 0)")
            if vocab is not None and tok >= vocab:
                raise ValueError(f"prompt {i} holds token id {tok}, outside the model's vocabulary of {vocab} "
                                 "(a tokenizer of another model?)")
            ids.append(int(tok))
        out.append(ids)
    return out


def _new_tokens(max_new_tokens: Any, count: int) -> list[int]:
    if isinstance(max_new_tokens, numbers.Integral) and not isinstance(max_new_tokens, bool):
        return [positive_int("max_new_tokens", max_new_tokens)] * count
    if isinstance(max_new_tokens, (str, bytes)) or not isinstance(max_new_tokens, Sequence):
        raise TypeError(f"max_new_tokens must be a positive int or one per prompt, got {max_new_tokens!r}")
    if len(max_new_tokens) != count:
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {count} prompts: give one per prompt "
                         "or a single int")
    return [positive_int(f"max_new_tokens[{i}]", n) for i, n in enumerate(max_new_tokens)]


def _vocab_size(model: Any) -> int | None:
    embeddings = getattr(model, "get_input_embeddings", None)
    table = embeddings() if callable(embeddings) else None
    rows = getattr(table, "num_embeddings", None)
    if isinstance(rows, int):
        return rows
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def _check_groups(rows: list[list[int]], group_size: int) -> None:
    positive_int("group_size", group_size)
    if len(rows) % group_size or any(rows[i] != rows[i - i % group_size] for i in range(len(rows))):
        raise ValueError(f"group_size={group_size}: the {len(rows)} prompts are not runs of {group_size} identical "
                         "prompts; repeat each prompt group_size times in a row, or leave group_size out")


def _check_context(model: Any, prompts: list[list[int]], news: list[int]) -> None:
    context = context_length(model)
    if context is None:
        return
    for i, (p, n) in enumerate(zip(prompts, news)):
        if n >= context:
            raise ValueError(f"max_new_tokens={n} leaves no room for a prompt in the model's context of {context} "
                             f"positions: ask for at most {context - 1} new tokens")
        if len(p) > context:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than the model's context of {context}: truncate it "
                             f"(keep its last {context - n} tokens to leave room for {n} new ones)")
        if len(p) + n > context:
            raise ValueError(f"prompt {i} has {len(p)} tokens and max_new_tokens={n}: {len(p) + n} positions, more "
                             f"than the model's context of {context}; keep its last {context - n} tokens or ask for "
                             f"at most {context - len(p)} new ones")


def _check_generate_kwargs(model: Any, kwargs: Mapping[str, Any]) -> None:
    for name, how in _OWN_ARGUMENTS.items():
        if name in kwargs:
            raise ValueError(f"generate_by_length sets {name} itself: {how}")
    returns = kwargs.get("num_return_sequences", 1)
    if returns not in (None, 1):
        raise ValueError(f"num_return_sequences={returns!r}: generate_by_length returns one sequence per prompt; "
                         "repeat a prompt to get several")
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError("generate_by_length left-pads prompts for a decoder-only model; this model is an "
                         "encoder-decoder (its generate returns no prompt to cut off)")
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"{type(model).__name__} has no generate(); pass a causal LM with a Hugging Face-style "
                        "generate(input_ids, attention_mask=..., max_new_tokens=...)")


def _run_batch(model: Any, prompts: list[list[int]], length: int, max_new_tokens: int, pad_token_id: int,
               kwargs: dict[str, Any], device: torch.device) -> list[list[int]]:
    """One left-padded batch through ``generate``: each row's new tokens (as generate returns them)."""
    ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, length - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, length - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, **kwargs)
    except Exception as exc:
        if not is_oom(exc):  # an OOM is the batch's answer, caught by attempt()
            add_note(exc, f"batchpilot: in a generate batch of {len(prompts)} prompts padded to {length} tokens, "
                          f"max_new_tokens={max_new_tokens}")
        raise
    sequences = out if isinstance(out, torch.Tensor) else out.sequences  # return_dict_in_generate=True
    return sequences[:, length:].tolist()


def _finish(row: list[int], max_new_tokens: int, eos: tuple[int, ...], pad_token_id: int, other_stops: bool) -> list[int]:
    """A row as generating its prompt alone gives it: its own length, up to and with its first EOS."""
    row = row[:max_new_tokens]
    for k, tok in enumerate(row):
        if tok in eos:
            return row[:k + 1]
    if other_stops:  # another criterion ended the row; generate padded it to the batch's end
        while row and row[-1] == pad_token_id:
            row.pop()
    return row


def _plan(lengths: Sequence[int], budget: Any, new_tokens: int) -> list[tuple[list[int], int]]:
    """:func:`plan_length_split`, cut where a prompt would be padded past ``genmemory.MAX_PADDING`` times its length
    by more than ``new_tokens``.

    A long prompt's batch takes no short ones: their rows would carry the long one's padding
    through every step of the cache. ``[(positions in lengths, padded length), ...]``.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[tuple[list[int], int]] = []
    start = 0
    while start < len(order):
        low = band_low(lengths[order[start]], new_tokens)
        end = start
        while end < len(order) and lengths[order[end]] >= low:
            end += 1
        band = order[start:end]
        out += [([band[k] for k in part], L) for part, L in plan_length_split([lengths[i] for i in band], budget)]
        start = end
    return out


def _whole(batch: int, group: int) -> int:
    """``batch`` rounded down to whole groups of ``group`` rows; below one group, ``batch`` itself."""
    return batch if batch < group else batch // group * group


def _run(model: Any, rows: list[list[int]], news: list[int], sizer: Any, room: MemoryRoom, out: Generations, *,
         pad: int, eos: tuple[int, ...], other_stops: bool, kwargs: dict[str, Any],
         results: list[list[int] | None], group: int = 1) -> list[list[int]]:
    """Every prompt without a result through ``generate`` in batches, longest first; an OOM splits its batch.

    With ``group`` > 1 the rows come in runs of ``group`` identical prompts and every batch holds
    whole runs (sorted by length, a run stays together), unless one run alone does not fit.
    """
    lengths = [len(p) for p in rows]
    dev = room.device
    longest_new = max(news)

    def budget(length: int) -> int:
        return max(1, _whole(sizer(length), group))  # a model that fits none: one prompt, and the run decides

    def plan(idx: list[int], size: Any = budget) -> list[tuple[list[int], int]]:
        return [([idx[k] for k in p], L) for p, L in _plan([lengths[i] for i in idx], size, longest_new)]

    def replan(first: list[tuple[list[int], int]], rest: list[int]) -> collections.deque:
        return collections.deque(first + (plan(rest) if rest else []))

    queue = collections.deque(plan([i for i, r in enumerate(results) if r is None]))
    while queue:
        idx, length = queue.popleft()
        n = max(news[i] for i in idx)
        room.gauge.reset()
        before = int(room.gauge.current())
        done = attempt(_run_batch, model, [rows[i] for i in idx], length, n, pad, kwargs, dev, device=dev)
        rest = [i for ids, _ in queue for i in ids]
        if done.oom:
            out.ooms += 1
            if len(idx) == 1:
                raise NothingFitsError(
                    f"prompt {idx[0]} ({length} tokens, max_new_tokens={n}) ran out of memory alone on {dev} "
                    f"({done.message}); shorten it or max_new_tokens, or use more memory",
                    batch_size=1, peak_bytes=None, limit_bytes=room.limit_bytes, capacity_bytes=room.capacity_bytes)
            logger.info("a batch of %d prompts padded to %d ran out of memory: splitting it", len(idx), length)
            sizer.note_oom(len(idx), length, n)
            # halves of whole groups; a batch of one group (or less) is halved by rows
            half = (len(idx) // group + 1) // 2 * group if len(idx) > group else (len(idx) + 1) // 2
            queue = replan(plan(idx, lambda L: max(1, min(half, _whole(sizer(L), group)))), rest)
            continue
        for i, row in zip(idx, done.result or ()):
            results[i] = _finish(row, news[i], eos, pad, other_stops)
        out.batches.append((len(idx), length, n))
        # a batch that needed more than the model said corrects it before the next one runs
        if sizer.observe(len(idx), length, n, int(room.gauge.peak()) - before):
            queue = replan([], rest)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:  # every prompt is in exactly one batch that completed; anything else is a bug here
        raise RuntimeError(f"prompts {missing[:10]} got no output")
    return results  # type: ignore[return-value]


def generate_by_length(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                       pad_token_id: int, eos_token_id: int | Sequence[int] | None = None, target: float | None = None,
                       capacity: int | str | None = None, device: torch.device | str | int | None = None,
                       memory: GenerationMemory | None = None, agree: Callable[[Any], list[Any]] | None = None,
                       group_size: int = 1, **generate_kwargs: Any) -> Generations:
    """Generate for every prompt, in batches grouped by length and sized for the memory; outputs in input order.

    Prompts are token ids without padding. They run longest first, each batch left-padded to
    its longest prompt and as large as the memory model allows at that length (never more
    than ``target`` of the capacity); each row comes back as generating its prompt alone gives
    it (greedy, ``do_sample=False``, unless ``generate_kwargs`` say otherwise): its new tokens up
    to and including its first EOS, never a pad. When another criterion (``stop_strings``,
    ``stopping_criteria``, ``max_time``) ends rows, generate pads them to the batch's end and
    their trailing ``pad_token_id`` tokens are dropped.

    Sizing: the memory model is fitted by real trials at up to three prompt lengths, three at
    most each (:func:`~batchpilot.infer.genmemory.fit_in`; with greedy decoding they run the real
    prompts, longest first, and those prompts' outputs are kept), unless ``memory`` gives one (from
    :func:`~batchpilot.infer.genmemory.fit_generation_memory`, or an earlier call's
    ``.memory``). If the trials make no model, the batches are no larger than what a trial ran at
    a shape at least as long. An OOM mid-run splits the failing batch in halves and scales the
    model so that no later batch is that large; no prompt is lost or run twice.

    Args:
        model: a decoder-only causal LM with a Hugging Face-style ``generate``.
        prompts: one sequence of token ids per prompt (lists or 1-D tensors).
        max_new_tokens: new tokens per prompt, one int for all or one per prompt.
        pad_token_id: the id padding the prompts on the left (and finished rows).
        eos_token_id: the ids that end a row; ``None``: the model's generation config's.
        target: the share of the capacity a batch may peak at (default: the finder's, ``FindOptions.target``).
        capacity: a device size to emulate (``"4GiB"``) for the whole call; default the
            device's real memory, or the caller's own ``emulate_capacity``.
        device: the device the prompts go to; default the model's.
        memory: a memory model to size by instead of fitting one.
        agree: ``agree(obj) -> [obj of every rank]``, an all-gather over the ranks that generate
            (``torch.distributed.all_gather_object``): after sizing, every rank's batches are
            no larger than any other rank's model allows at the same shape. It is the call's one
            collective, which every rank reaches once, with no prompts or a failed sizing too
            (a failure is then raised on every rank).
        group_size: the prompts come in runs of ``group_size`` identical prompts (several completions
            of one prompt, as RL trainers draw them): every batch holds whole runs, unless one run
            alone does not fit, and the sizing trials run made-up prompts.
        **generate_kwargs: passed to every ``generate`` call, trials included.

    Returns:
        :class:`Generations`: a list with one ``list[int]`` per prompt, with the sizing and run figures.

    Raises:
        TypeError: prompts that are no sequences of token ids, a model without ``generate``.
        ValueError: an empty prompt, a token outside the vocabulary, a prompt with its new tokens
            longer than the model's context, ``max_new_tokens`` that leave no room for a prompt,
            arguments generate_by_length sets itself (``max_length``, ``attention_mask``), a
            ``group_size`` that does not divide the prompts into runs of identical ones.
        BatchSizeError: a bad ``target`` or ``capacity``.
        NothingFitsError: a single prompt does not fit.
        UnverifiedShapeError: a ``memory`` fitted on shorter prompts or fewer new tokens.
    """
    if agree is not None and not callable(agree):
        raise ValueError(f"agree must be a function obj -> [obj of every rank] (an all-gather), got {agree!r}")
    began = time.perf_counter()
    out = Generations()
    reached = [False]  # whether this rank took part in the agreement (it must, exactly once)
    try:
        return _generate(model, prompts, out, began, reached, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                         eos_token_id=eos_token_id, target=target, capacity=capacity, device=device, memory=memory,
                         agree=agree, group_size=group_size, generate_kwargs=generate_kwargs)
    except Exception as exc:  # every rank must reach the agreement, failed or not
        if agree is None or reached[0]:
            raise
        exchange(agree, None, exc, what="generation sizing")
        raise


def _generate(model: Any, prompts: Any, out: Generations, began: float, reached: list[bool], *, max_new_tokens: Any,
              pad_token_id: int, eos_token_id: Any, target: float | None, capacity: int | str | None, device: Any,
              memory: GenerationMemory | None, agree: Callable[[Any], list[Any]] | None, group_size: int,
              generate_kwargs: dict[str, Any]) -> Generations:
    """:func:`generate_by_length`'s work; ``reached[0]`` is set once this rank has taken part in ``agree``."""
    rows = _prompts(prompts, _vocab_size(model))
    if not rows:
        if agree is not None:
            reached[0] = True
            exchange(agree, None, what="generation sizing")  # takes part, bringing nothing to size by
        return out
    news = _new_tokens(max_new_tokens, len(rows))
    _check_groups(rows, group_size)
    _check_generate_kwargs(model, generate_kwargs)
    _check_context(model, rows, news)
    pad = check_token_id("pad_token_id", pad_token_id)
    vocab = _vocab_size(model)
    if vocab is not None and pad >= vocab:
        raise ValueError(f"pad_token_id={pad} is outside the model's vocabulary of {vocab}")
    eos = eos_ids(model, eos_token_id)
    dev = resolve_device(device) if device is not None else model_device(model)
    if dev != model_device(model):
        raise ValueError(f"the model is on {model_device(model)}, not {dev}: move it (model.to({str(dev)!r})) or "
                         "leave device= out")
    kwargs, other_stops, greedy = _decoding(model, generate_kwargs, pad=pad, eos=eos, eos_token_id=eos_token_id)
    longest_new = max(news)
    with memory_room(model, device=dev, capacity=capacity, target=target) as room:
        sizer = _sizer(model, rows, room, out, memory, longest_new=longest_new, pad=pad, eos=eos,
                       generate_kwargs=generate_kwargs, keep_outputs=greedy and group_size == 1)
        if agree is not None:
            reached[0] = True
            peers = exchange(agree, _Peer.of(memory, out.trials), what="generation sizing")
            if peers:
                sizer = _AgreedSizer(sizer, peers, longest_new)
        out.sizing_seconds = time.perf_counter() - began
        done: list[list[int] | None] = [None] * len(rows)
        for t in out.trials:  # the trials that ran real prompts to the end: those are done
            for i, row in zip(t.prompts, t.outputs):
                done[i] = _finish(row, news[i], eos, pad, other_stops)
        results = _run(model, rows, news, sizer, room, out, pad=pad, eos=eos, other_stops=other_stops, kwargs=kwargs,
                       results=done, group=group_size)
    out.extend(results)  # type: ignore[arg-type]
    out.seconds = time.perf_counter() - began
    logger.info("%d prompts in %d batches (%d OOM), sized in %.2fs by %s from %d trials; %.2fs in all",
                len(rows), len(out.batches), out.ooms, out.sizing_seconds, out.sized_by, len(out.trials), out.seconds)
    return out


def _decoding(model: Any, generate_kwargs: dict[str, Any], *, pad: int, eos: Any,
              eos_token_id: Any) -> tuple[dict[str, Any], bool, bool]:
    """``generate``'s keywords as every batch runs them; whether other stopping criteria apply; whether it is greedy."""
    kwargs = dict(generate_kwargs)
    kwargs.setdefault("do_sample", False)
    kwargs["pad_token_id"] = pad
    if eos_token_id is not None:
        kwargs["eos_token_id"] = list(eos)
    other_stops = any(kwargs.get(name) for name in _OTHER_STOPS)
    beams = kwargs.get("num_beams", getattr(getattr(model, "generation_config", None), "num_beams", 1))
    # greedy decoding: the sizing trials run the real prompts, longest first, and their outputs are kept
    greedy = (not kwargs["do_sample"] and beams in (None, 1) and not other_stops
              and not any(kwargs.get(name) is not None for name in _NOT_GREEDY))
    return kwargs, other_stops, greedy


def _sizer(model: Any, rows: list[list[int]], room: Any, out: Generations, memory: GenerationMemory | None, *,
           longest_new: int, pad: int, eos: Any, generate_kwargs: dict[str, Any],
           keep_outputs: bool) -> _ModelSizer | _TrialSizer:
    """What sizes each batch: the memory model (fitted now, or the caller's), else the trials; ``out`` records which."""
    lengths = [len(p) for p in rows]
    sizer: _ModelSizer | _TrialSizer
    if memory is None:
        try:
            memory = fit_in(model, room, prompt_lengths=lengths, max_new_tokens=longest_new, pad_token_id=pad,
                            eos=eos, max_batch_size=len(rows), generate_kwargs=generate_kwargs,
                            prompts=dict(enumerate(rows)) if keep_outputs else None)
            out.trials = list(memory.trials)
            sizer, out.sized_by = _ModelSizer(memory, room, longest_new, len(rows)), "model"
        except GenerationFitError as exc:
            logger.warning("%s; sizing each batch by the largest batch a trial ran at a shape at least as long", exc)
            out.trials = list(exc.trials)
            sizer, out.sized_by = _TrialSizer(out.trials, longest_new, len(rows)), "trials"
            memory = None
    else:
        memory.max_batch(max(lengths), longest_new)  # raises now if it was fitted on shorter shapes
        # corrected by this run's OOMs and peaks, not the caller's own: .memory holds the corrected one
        memory = dataclasses.replace(memory, verified=dict(memory.verified), trials=list(memory.trials))
        sizer, out.sized_by = _ModelSizer(memory, room, longest_new, len(rows)), "model"
    out.memory = memory
    return sizer
