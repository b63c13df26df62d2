"""TRL's ``GRPOTrainer`` sized by batchpilot: whole prompt groups, the user's optimisation, no OOM crash.

:class:`ResilientGRPOTrainer` takes ``GRPOTrainer``'s arguments and keeps what they ask of the
optimisation -- the prompt groups, the completions per optimizer step
(``per_device_train_batch_size × gradient_accumulation_steps`` per rank), the normalisation of the
configured ``loss_type`` -- while it chooses the sizes that depend on memory:

- generation: a step's prompts go through ``generate`` in batches of whole prompt groups, each
  sized for its padded prompt length from the generation memory model
  (:func:`batchpilot.infer.generate.generate_by_length`); an OOM splits the batch and runs it again,
  no completion lost or generated twice;
- scoring (reference and old log-probabilities): chunks that halve on OOM;
- training: one optimizer step's completions run through :class:`batchpilot.Engine`, sorted by
  length so that each micro-batch is padded to its own longest row only; each micro-batch's loss
  is TRL's own ``compute_loss`` scaled to its share of the step's loss, so the accumulated
  gradients are those of TRL's whole step; an OOM drops the partial gradients and runs the same
  step again in smaller micro-batches.

Why the shares are exact for each ``loss_type``, and what is refused: ``docs/rl.md``.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._checks import positive_int
from ..core.ranks import group_size
from ..dist.distributed import all_reduce_int
from ..infer.generate import Generations, generate_by_length
from ..infer.genmemory import GenerationMemory, UnverifiedShapeError
from ..memory.oom import attempt
from ..train.engine import Engine, EngineConfig, StepResult
from ..train.lengths import LengthConfig
from ._common import DeferredOptimizer, require

require("trl", "batchpilot.integrations.trl")

from transformers import Trainer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.models import unwrap_model_for_generation  # noqa: E402

__all__ = ["ResilientGRPOTrainer", "GenerationStats", "LOSS_SHARES", "to_rows", "from_rows", "main"]

logger = logging.getLogger(__name__)

#: how each ``loss_type`` normalises a micro-batch's token losses, which decides its share of the step:
#: ``"rows"``: a mean over the micro-batch's rows (of each row's token mean, sum, or sum over the longest
#: completion), so ``|rows| / rows per step``; ``"tokens"``: over the tokens of TRL's own micro-batch of
#: ``per_device_train_batch_size`` rows (bnpo), so ``tokens here / (accumulation × tokens of that micro-batch)``;
#: ``"batch"``: over the tokens of the whole generation batch, the same for every micro-batch.
LOSS_SHARES = {
    "grpo": "rows", "sapo": "rows", "dr_grpo": "rows", "luspo": "rows",
    "bnpo": "tokens",
    "dapo": "batch", "cispo": "batch", "vespo": "batch",
}

#: the keys of TRL's prepared batch the trainer knows how to cut; any other (images, tool masks, vLLM
#: importance ratios) is refused at the first step
_KNOWN_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch",
               "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"}
#: per-completion-token tensors carried through the engine, aligned with each row's completion
_PER_TOKEN = ("old_per_token_logps", "ref_per_token_logps")


@dataclass(frozen=True)
class GenerationStats:
    """One generation batch of a training step: how ``generate`` was called.

    Attributes:
        completions: rows generated (prompts × ``num_generations`` on this rank).
        calls: ``generate`` calls in all: the sizing trials, the batches, the batches that ran out of memory.
        batches: the batches that completed, ``(rows, padded prompt length, max_new_tokens)`` each.
        trials: sizing trials run for this batch (0 when the memory model of an earlier step covered it).
        ooms: batches that ran out of memory and were split.
        sizing_seconds, seconds: the trials' wall time, and the whole generation's.
    """

    completions: int
    calls: int
    batches: tuple[tuple[int, int, int], ...]
    trials: int
    ooms: int
    sizing_seconds: float
    seconds: float


class _EngineTrainingStep(Trainer):
    """``Trainer.training_step`` replaced by one engine step; it sits under ``GRPOTrainer`` in the MRO.

    ``GRPOTrainer.training_step`` (its step timing and counter) calls ``super().training_step``,
    which lands here instead of in ``Trainer``'s forward and backward.
    """

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        return self._batchpilot_training_step(model, inputs)  # type: ignore[attr-defined]


class ResilientGRPOTrainer(GRPOTrainer, _EngineTrainingStep):
    """``trl.GRPOTrainer`` whose generation, scoring and training are sized by batchpilot and survive OOMs.

    Build it as ``GRPOTrainer`` (the same arguments); ``per_device_train_batch_size``,
    ``gradient_accumulation_steps``, ``generation_batch_size`` and ``num_generations`` keep their
    meaning: each optimizer step trains on ``per_device_train_batch_size × gradient_accumulation_steps``
    completions per rank (whole prompt groups, as TRL draws them) with the update TRL computes for
    them. Only the memory-bound sizes are batchpilot's: how many rows one ``generate`` call, one
    scoring forward and one training micro-batch take. ``per_device_train_batch_size`` is where the
    training micro-batch starts (or ``micro_batch_size``); an OOM shrinks it, clean steps grow it back
    (:class:`batchpilot.EngineConfig`).

    The trainer takes each optimizer step's batch in one piece (``gradient_accumulation_steps=1``,
    ``steps_per_generation=1`` and ``per_device_train_batch_size`` times the accumulation, on a copy
    of ``args``; the caller's ``args`` are unchanged), so the Trainer's loop steps the optimizer, the
    LR scheduler and ``global_step`` once per step exactly as TRL does.

    Args (keyword, besides ``GRPOTrainer``'s):
        engine_config: :class:`batchpilot.EngineConfig` (growth, memory pressure, ``capacity``).
        micro_batch_size: the first training micro-batch; default ``per_device_train_batch_size``.
        lengths: size each step's micro-batches by its length with the engine's memory model over
            (batch, length) (:class:`batchpilot.LengthConfig`, ``True`` for length-aware splitting);
            its first step runs real searches. Default ``False``: rows sorted by length, micro-batches
            from the OOM-adapted size.
        size_generation: ``True`` (default): TRL's one ``generate`` call for the whole generation batch
            while it fits; after it runs out of memory once, batches of whole prompt groups sized by
            prompt length from the generation memory model, for the rest of the run. ``"always"``:
            sized batches from the first step (the model's sizing trials cost a few small
            ``generate`` calls per new prompt length). ``False``: TRL's own generation, unguarded.

    Attributes:
        batchpilot_engine: the :class:`batchpilot.Engine` of the training steps (after the first).
        batchpilot_last_step: the engine's :class:`batchpilot.StepResult` of the last step.
        batchpilot_step_ooms: the training OOMs survived in each step, in order.
        batchpilot_generation: one :class:`GenerationStats` per generation batch.
        batchpilot_generation_memory: the generation memory model in use, or ``None``.
        batchpilot_scoring_ooms: OOMs survived while scoring.

    Raises:
        ValueError: a configuration whose loss or batching the trainer cannot reproduce exactly, each
            named with how to fix it: ``num_iterations`` other than 1, ``steps_per_generation`` other than
            ``gradient_accumulation_steps``, ``top_entropy_quantile`` below 1, an entropy bonus, a
            MoE router loss, tools or environments, vLLM, fp16, DeepSpeed or FSDP, an unknown
            ``loss_type``.
    """

    def __init__(self, *args: Any, engine_config: EngineConfig | None = None, micro_batch_size: int | None = None,
                 lengths: bool | LengthConfig = False, size_generation: bool | str = True, **kwargs: Any) -> None:
        if micro_batch_size is not None:
            positive_int("micro_batch_size", micro_batch_size)
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config must be a batchpilot.EngineConfig, got {type(engine_config).__name__}")
        if size_generation not in (True, False, "always"):
            raise ValueError(f"size_generation must be True, False or 'always', got {size_generation!r}")
        if not isinstance(lengths, (bool, LengthConfig)):
            raise TypeError(f"lengths must be True, False or a batchpilot.LengthConfig, got {lengths!r}")
        super().__init__(*args, **kwargs)
        targs = self.args
        self._check_supported(targs)
        per_device, accum = targs.per_device_train_batch_size, targs.gradient_accumulation_steps
        #: TRL's own micro-batch and accumulation, which the loss normalisations refer to
        self._trl_micro, self._trl_accum = per_device, accum
        self._rows_per_step = per_device * accum
        self._first_micro = min(micro_batch_size or per_device, self._rows_per_step)
        # one optimizer step's batch in one piece, on a copy (the caller's args are untouched)
        merged = copy.copy(targs)
        merged.per_device_train_batch_size = self._rows_per_step
        merged.gradient_accumulation_steps = 1
        merged.steps_per_generation = 1
        self.args = merged
        self._train_batch_size = merged.train_batch_size
        self.accelerator.gradient_accumulation_steps = 1
        self._bp_config = engine_config
        self._bp_lengths = lengths
        self._bp_size_generation = bool(size_generation)
        self._bp_sized_generation = size_generation == "always"
        self._bp_generation_ooms = 0
        self.batchpilot_engine: Engine | None = None
        self.batchpilot_last_step: StepResult | None = None
        self.batchpilot_step_ooms: list[int] = []
        self.batchpilot_generation: list[GenerationStats] = []
        self.batchpilot_generation_memory: GenerationMemory | None = None
        self.batchpilot_scoring_ooms = 0
        self._bp_score_rows: int | None = None
        self._bp_tokens: int | None = None  # rows × width of the widest training micro-batch known to run
        self._bp_share = LOSS_SHARES[targs.loss_type]
        self._bp_prompt_width = 0  # TRL's padded prompt width in this step's batch
        self._bp_position_shift = 0  # how far left of TRL's columns the micro-batch in the forward sits

    # ------------------------------------------------------------------ checks
    def _check_supported(self, targs: GRPOConfig) -> None:
        who = type(self).__name__
        refusals = [
            (targs.loss_type not in LOSS_SHARES,
             f"loss_type={targs.loss_type!r} is not one whose normalisation {who} knows ({sorted(LOSS_SHARES)})"),
            (targs.num_iterations != 1, f"num_iterations={targs.num_iterations}: each generation batch is trained on "
             "once per optimizer step; set num_iterations=1"),
            (targs.steps_per_generation != targs.gradient_accumulation_steps,
             f"steps_per_generation={targs.steps_per_generation} differs from gradient_accumulation_steps="
             f"{targs.gradient_accumulation_steps}: one generation batch per optimizer step is what {who} sizes; "
             "set generation_batch_size = per_device_train_batch_size × processes × gradient_accumulation_steps"),
            (targs.top_entropy_quantile < 1.0, "top_entropy_quantile < 1 masks by a quantile over each micro-batch, "
             "which changes with the micro-batch; set top_entropy_quantile=1.0"),
            (targs.entropy_coef != 0 or targs.use_adaptive_entropy, "the entropy bonus is a mean over each "
             "micro-batch, which changes with the micro-batch; set entropy_coef=0 and use_adaptive_entropy=False"),
            (bool(getattr(self, "aux_loss_enabled", False)), "the MoE router loss is a mean over each micro-batch; "
             "set model.config.output_router_logits=False"),
            (bool(self.tools) or self.environment_factories is not None, "tools and environments give tool masks "
             f"that {who} does not cut; use GRPOTrainer"),
            (bool(targs.use_vllm), f"{who} sizes transformers' generate; with vLLM use GRPOTrainer"),
            (bool(targs.fp16), "fp16's GradScaler belongs to Accelerate's backward, which the engine's micro-batches "
             "do not go through; use bf16=True (or fp32)"),
            (bool(getattr(targs, "deepspeed", None) or getattr(targs, "fsdp", None)), "DeepSpeed and FSDP shard "
             "what the engine accumulates; run DDP (torchrun) or one process"),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"{who} cannot run this configuration: {why}")

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids: list, images: Any, multimodal_fields: Any, num_generations: int,
                              has_tool_images: bool = False) -> tuple[list, Any]:
        trl_own = super()._generate_single_turn
        if (not self._bp_size_generation or images is not None or multimodal_fields
                or self.use_transformers_continuous_batching):
            return trl_own(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if not self._bp_sized_generation:
            # TRL's one call for the whole batch while it fits: sizing trials would cost more than they save
            began = time.perf_counter()
            done = attempt(trl_own, prompt_ids, images, multimodal_fields, num_generations, has_tool_images,
                           device=self.accelerator.device)
            if self.accelerator.num_processes > 1:
                oom = bool(all_reduce_int(int(done.oom), "max"))  # every rank switches, or none
            else:
                oom = done.oom
            if not oom:
                self.batchpilot_generation.append(GenerationStats(
                    completions=len(prompt_ids), calls=1, batches=((len(prompt_ids), max(map(len, prompt_ids)),
                                                                   self.max_completion_length),),
                    trials=0, ooms=0, sizing_seconds=0.0, seconds=time.perf_counter() - began))
                return done.result
            self._bp_sized_generation = True
            self._bp_generation_ooms += 1
            logger.warning("generating %d completions in one call ran out of memory (%s): generating in batches of "
                           "whole prompt groups sized from the memory model from now on", len(prompt_ids),
                           done.message or "on another rank")
            del done
        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            torch.no_grad(),
        ):
            gens = self._batchpilot_generate(unwrapped, [list(p) for p in prompt_ids], num_generations)
        return [list(row) for row in gens], None

    def _batchpilot_generate(self, model: nn.Module, prompts: list[list[int]], num_generations: int) -> Generations:
        """Every row's completion, generated in whole groups by length from the memory model (fitted when needed)."""
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        new = self.max_completion_length
        memory = self.batchpilot_generation_memory
        refit = memory is None
        if not refit:
            try:
                memory.max_batch(max(len(p) for p in prompts), new)
            except UnverifiedShapeError:
                refit = True  # prompts longer than any the model was fitted at
        world = self.accelerator.num_processes
        agree = None
        if world > 1:
            refit = bool(all_reduce_int(int(refit), "max"))  # every rank fits, or none (the fit is collective)
            agree = _all_gather
        find = (self._bp_config or EngineConfig()).find
        groups = num_generations if _whole_groups(prompts, num_generations) else 1
        began = time.perf_counter()
        gens = generate_by_length(
            model, prompts, max_new_tokens=new, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=list(self.eos_token_ids), memory=None if refit else memory, target=find.target,
            capacity=None if self._bp_config is None else self._bp_config.capacity, agree=agree,
            group_size=groups, generation_config=self.generation_config,
            do_sample=bool(self.generation_config.do_sample),
        )
        self.batchpilot_generation_memory = gens.memory
        # the one-call attempt that ran out of memory counts with the batch it was for
        failed, self._bp_generation_ooms = self._bp_generation_ooms, 0
        stats = GenerationStats(completions=len(prompts), calls=gens.generate_calls + failed,
                                batches=tuple(gens.batches), trials=len(gens.trials), ooms=gens.ooms + failed,
                                sizing_seconds=gens.sizing_seconds, seconds=time.perf_counter() - began)
        self.batchpilot_generation.append(stats)
        logger.info("batchpilot: %d completions in %d generate calls (%d sizing trials, %d OOM)", stats.completions,
                    stats.calls, stats.trials, stats.ooms)
        return gens

    # ------------------------------------------------------------------ scoring
    def _get_per_token_logps_and_entropies(self, model: nn.Module, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           batch_size: int | None = None, compute_entropy: bool = False,
                                           compute_aux_loss: bool = False, **kwargs: Any) -> Any:
        parent = super()._get_per_token_logps_and_entropies
        if torch.is_grad_enabled() or any(v is not None for v in kwargs.values()):
            # the training forward of one engine micro-batch (already sized), or multimodal inputs
            shift = self._bp_position_shift
            handle = None if not shift else model.register_forward_pre_hook(_shift_positions(shift), with_kwargs=True)
            try:
                return parent(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                              compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kwargs)
            finally:
                if handle is not None:
                    handle.remove()
        n = input_ids.size(0)
        size = min(n, self._bp_score_rows or self._first_micro)
        logps, entropies, aux = [], [], []
        start = 0
        while start < n:
            stop = min(n, start + size)
            done = attempt(parent, model, input_ids[start:stop], attention_mask[start:stop], logits_to_keep,
                           batch_size=stop - start, compute_entropy=compute_entropy,
                           compute_aux_loss=compute_aux_loss, device=input_ids.device)
            if done.oom:
                if size == 1:
                    raise torch.OutOfMemoryError(
                        f"scoring one completion ran out of memory ({done.message}); shorten max_completion_length "
                        "or the prompts, or use more memory")
                self.batchpilot_scoring_ooms += 1
                size = self._bp_score_rows = max(1, size // 2)
                logger.warning("scoring ran out of memory at %d rows (%s): scoring again at %d", stop - start,
                               done.message, size)
                continue
            lp, ent, ax = done.result
            logps.append(lp)
            entropies.append(ent)
            aux.append(ax)
            start = stop
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux).mean() if compute_aux_loss else None)

    # ------------------------------------------------------------------ training
    def _batchpilot_training_step(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        prepared = self._prepare_inputs(inputs)  # TRL's generation, rewards and advantages
        rows = self._batchpilot_rows(prepared)
        del prepared
        engine = self._batchpilot_engine(model)
        width = int(rows["attention_mask"].sum(1).max())  # the longest row: the first micro-batch's width
        if not self._bp_lengths:
            self._batchpilot_presize(engine, width)
        result = engine.step(rows)
        # the tokens of the widest micro-batch that ran: raised by a clean step, set by one that ran out of memory
        ran = max(result.micro_batch_sizes) * width
        self._bp_tokens = ran if result.ooms or self._bp_tokens is None else max(self._bp_tokens, ran)
        self.batchpilot_last_step = result
        self.batchpilot_step_ooms.append(result.ooms)
        return result.loss_tensor

    def _batchpilot_presize(self, engine: Engine, width: int) -> None:
        """The micro-batch for a step whose longest row is ``width`` tokens: as many rows as the token budget allows.

        A GRPO step's length is known only after generation, and one long prompt makes it several
        times wider than the step before: the micro-batch that ran then would run out of memory now.
        Rows are sorted longest first, so the first micro-batch is the widest; its rows × width
        scales with memory (linearly in tokens; attention's quadratic part makes a longer step
        cost a little more, which an OOM then corrects).
        """
        if self._bp_tokens is None or engine.micro_batch_size is None:
            return  # the first step starts at the configured micro-batch
        want = max(1, min(self._rows_per_step, self._bp_tokens // width))
        if want != engine.micro_batch_size:
            engine.batcher.size_for(want, f"{want} rows of up to {width} tokens: the {self._bp_tokens}-token "
                                    "budget of the widest micro-batch that ran", self._rows_per_step)

    def _batchpilot_engine(self, model: nn.Module) -> Engine:
        engine = self.batchpilot_engine
        if engine is not None and engine.model is model:
            return engine
        state = None if engine is None else engine.state_dict()
        lengths = self._bp_lengths
        if lengths is True:
            lengths = LengthConfig(split=True)
        engine = Engine(model, DeferredOptimizer(self), self._batchpilot_loss,
                        global_batch_size=self._rows_per_step * self.accelerator.num_processes,
                        start=None if lengths else self._first_micro, config=self._bp_config,
                        shared="num_items_in_batch", lengths=lengths or None)
        if state is not None:  # the model was re-wrapped (a resumed run): keep what the engine learnt
            engine.load_state_dict(state)
        self.batchpilot_engine = engine
        return engine

    def _batchpilot_rows(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """TRL's step batch as right-padded rows (prompt then completion), longest first, with their loss weights."""
        unknown = sorted(k for k, v in inputs.items() if k not in _KNOWN_KEYS and v is not None)
        if unknown:
            raise ValueError(f"{type(self).__name__} cannot cut a batch with {unknown} (multimodal inputs, tool "
                             "masks or importance ratios); use GRPOTrainer")
        adv = inputs["advantages"]
        if adv.dim() != 1:
            raise ValueError(f"advantages of shape {tuple(adv.shape)}: {type(self).__name__} cuts one advantage "
                             "per completion")
        n = adv.size(0)
        if n != self._rows_per_step:
            raise ValueError(f"a step of {n} completions, not per_device_train_batch_size × "
                             f"gradient_accumulation_steps = {self._rows_per_step}")
        rows = to_rows(inputs, pad_token_id=_pad_id(self.processing_class))
        self._bp_prompt_width = inputs["prompt_ids"].size(1)
        # TRL's micro-batches: consecutive slices of per_device_train_batch_size rows (after its shuffle)
        part = torch.arange(n, device=adv.device) // self._trl_micro
        rows["trl_micro_batch"] = part
        tokens = inputs["completion_mask"].sum(1)
        rows["trl_micro_batch_tokens"] = torch.zeros_like(tokens).index_add_(0, part, tokens)[part]
        if not self._bp_lengths:
            order = torch.argsort(rows["attention_mask"].sum(1), descending=True, stable=True)
            rows = {k: v if k == "num_items_in_batch" else v[order] for k, v in rows.items()}
        return rows

    def _batchpilot_loss(self, model: nn.Module, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """TRL's loss for these rows as their share of the step's loss, weighted back by the engine's ``size / n``."""
        size = micro_batch["advantages"].size(0)
        share = self._bp_share
        if share == "tokens":  # bnpo: TRL divides by the tokens of its own micro-batch; one call per such part
            parts = [micro_batch["trl_micro_batch"] == p for p in torch.unique(micro_batch["trl_micro_batch"])]
        else:
            parts = [None]
        total = None
        for keep in parts:
            mb = micro_batch if keep is None else {
                k: v if k == "num_items_in_batch" else v[keep] for k, v in micro_batch.items()}
            trl_inputs = from_rows(mb, pad_token_id=_pad_id(self.processing_class))
            # TRL runs every row at the columns of the whole batch, its prompt left-padded to the step's longest;
            # these rows are padded to their own longest prompt, so their tokens sit this many columns to the left
            self._bp_position_shift = self._bp_prompt_width - trl_inputs["prompt_ids"].size(1)
            accelerator = self.accelerator
            if accelerator.num_processes > 1:
                self.accelerator = _RankLocalMetrics(accelerator)
            try:
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, trl_inputs)
            finally:
                self._bp_position_shift = 0
                self.accelerator = accelerator
            loss = loss * self._share(mb, trl_inputs)
            total = loss if total is None else total + loss
        assert total is not None
        # the engine sums loss × size / n over the micro-batches
        return total * (self._rows_per_step / size)

    def _share(self, mb: dict[str, torch.Tensor], trl_inputs: dict[str, torch.Tensor]) -> Any:
        """The factor from TRL's loss over ``mb`` alone (accumulation 1) to ``mb``'s part of the step's loss."""
        share, accum = self._bp_share, self._trl_accum
        # TRL divided by the accumulation of the merged args (1) and, for "batch", by steps_per_generation (1)
        if share == "rows":
            return mb["advantages"].size(0) / self._rows_per_step
        if share == "tokens":
            # a Python float (double): counts divided as tensors give float32, whose rounding a float64 loss would keep
            tokens = max(1, int(trl_inputs["completion_mask"].sum()))
            return tokens / (accum * max(1, int(mb["trl_micro_batch_tokens"][0])))
        return 1.0


# ---------------------------------------------------------------------------


def to_rows(inputs: dict[str, Any], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """TRL's batch (left-padded prompts, right-padded completions) as right-padded rows.

    Row ``r`` holds its prompt's tokens then its completion's, then padding; ``attention_mask`` is
    its ones; ``prompt_lengths`` says where the completion starts; the per-token log-probabilities
    (old, reference) sit at their completion tokens' positions. A completion whose mask TRL zeroed
    (``mask_truncated_completions``) keeps only its prompt: its tokens neither attend nor count.
    """
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    P, C = prompt_ids.size(1), completion_ids.size(1)
    plen, clen = prompt_mask.sum(1), completion_mask.sum(1)
    total = plen + clen
    width = int(total.max())
    cols = torch.arange(width, device=prompt_ids.device)[None, :]
    valid = cols < total[:, None]
    # a row's real tokens are contiguous in [prompt | completion], starting at P - plen
    src = (cols + (P - plen)[:, None]).clamp(max=P + C - 1)
    ids = torch.cat([prompt_ids, completion_ids], 1).gather(1, src)
    rows = {
        "input_ids": torch.where(valid, ids, pad_token_id),
        "attention_mask": valid.long(),
        "prompt_lengths": plen,
        "advantages": inputs["advantages"],
        "num_items_in_batch": inputs["num_items_in_batch"],
    }
    in_completion = valid & (cols >= plen[:, None])
    at = (cols - plen[:, None]).clamp(0, C - 1)
    for key in _PER_TOKEN:
        t = inputs.get(key)
        if t is not None:
            rows[key] = torch.where(in_completion, t.gather(1, at), torch.zeros((), dtype=t.dtype, device=t.device))
    return rows


def from_rows(rows: dict[str, torch.Tensor], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Rows back in TRL's layout, padded to these rows' own longest prompt and completion."""
    ids, mask = rows["input_ids"], rows["attention_mask"]
    # the engine's length searches cut rows shorter (to half, a quarter of the step's length): a prompt is
    # then cut too, and its completion empty
    total = mask.sum(1)
    plen = torch.minimum(rows["prompt_lengths"], total)
    width = ids.size(1)
    clen = total - plen
    P, C = int(plen.max()), max(1, int(clen.max()))
    pc = torch.arange(P, device=ids.device)[None, :]
    psrc = pc - (P - plen)[:, None]
    pvalid = psrc >= 0
    cc = torch.arange(C, device=ids.device)[None, :]
    csrc = (plen[:, None] + cc).clamp(max=width - 1)
    cvalid = cc < clen[:, None]
    out = {
        "prompt_ids": torch.where(pvalid, ids.gather(1, psrc.clamp(min=0)), pad_token_id),
        "prompt_mask": pvalid.long(),
        "completion_ids": torch.where(cvalid, ids.gather(1, csrc), pad_token_id),
        "completion_mask": cvalid.long(),
        "advantages": rows["advantages"],
        "num_items_in_batch": rows["num_items_in_batch"],
    }
    for key in _PER_TOKEN:
        t = rows.get(key)
        if t is not None:
            out[key] = torch.where(cvalid, t.gather(1, csrc), torch.zeros((), dtype=t.dtype, device=t.device))
    return out


class _RankLocalMetrics:
    """The trainer's ``Accelerator`` with the collectives of TRL's loss metrics kept on this rank.

    TRL's ``compute_loss`` gathers and reduces its metrics (KL, entropy, clip ratios, the policy
    loss) over the ranks in every call, which pairs the calls of all ranks. The engine calls it once
    per micro-batch, and ranks run different micro-batches: an OOM on one rank reruns its step while
    the others wait in the engine's agreement, and bnpo's micro-batch is one call per TRL
    micro-batch it spans. Paired calls would then wait for each other forever or mix up. Here each
    rank's metrics are its own means; the loss and its gradients never read them. Everything else
    (``num_processes``, ``autocast``, ...) is the ``Accelerator``'s.
    """

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def gather(self, tensor: Any) -> Any:
        return tensor

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return input_data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return tensor * scale if scale != 1.0 else tensor


def _shift_positions(shift: int) -> Any:
    """A forward pre-hook giving the model the positions its tokens have in TRL's batch: ``shift`` columns on.

    A row's token at column ``c`` of a micro-batch padded to its own longest prompt sits at column
    ``c + shift`` of TRL's batch, whose prompts are left-padded to the step's longest. The model
    derives positions from columns: absolute position embeddings see the padding, and rotary ones,
    relative in exact arithmetic, compute their angles in float32 from the absolute position. With
    TRL's positions each token's forward is TRL's own.
    """

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and kwargs.get("position_ids") is None:
            cols = torch.arange(shift, shift + ids.size(1), device=ids.device)
            kwargs["position_ids"] = cols.unsqueeze(0).expand(ids.size(0), -1)
        return args, kwargs

    return hook


def _pad_id(processing_class: Any) -> int:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    return int(tokenizer.pad_token_id)


def _whole_groups(prompts: list[list[int]], size: int) -> bool:
    """The rows come as runs of ``size`` identical prompts (TRL's sampler repeats each prompt so)."""
    if size <= 1 or len(prompts) % size:
        return False
    return all(prompts[i] == prompts[i - i % size] for i in range(len(prompts)))


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * group_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m batchpilot.integrations.trl --config grpo.yaml``: TRL's ``trl grpo`` with :class:`ResilientGRPOTrainer`.

    TRL's own GRPO script (``trl.scripts.grpo``: its YAML config, datasets, reward functions, PEFT)
    runs unchanged, with ``trl.GRPOTrainer`` standing for :class:`ResilientGRPOTrainer` while it
    runs: ``trl grpo`` builds its trainer from that name and takes no trainer class.
    """
    import sys

    import trl
    from trl.scripts import grpo

    parser = grpo.make_parser(prog="python -m batchpilot.integrations.trl")
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    # an entry point: batchpilot says what it sized (the engine's split, generation fallbacks) on stderr
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger("batchpilot").addHandler(handler)
    logging.getLogger("batchpilot").setLevel(logging.INFO)
    original = trl.GRPOTrainer
    trl.GRPOTrainer = ResilientGRPOTrainer
    try:
        grpo.main(script_args, training_args, model_args, dataset_args)
    finally:
        trl.GRPOTrainer = original


if __name__ == "__main__":
    main()
