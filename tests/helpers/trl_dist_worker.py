"""torchrun worker: ``ResilientGRPOTrainer`` under DDP (gloo ranks), an OOM injected on one rank at one phase.

    python -m torch.distributed.run --standalone --nproc-per-node=2 trl_dist_worker.py OUT SCENARIO...

A scenario is ``clean`` (no OOM), ``trl`` (plain ``GRPOTrainer``, the reference), or
``PHASE-RANK``: one real ``torch.OutOfMemoryError`` raised once on rank ``RANK`` in ``PHASE``:

- ``generation``: TRL's ``generate`` call (real sampling from the model);
- ``scoring``: the reference model's forward (``beta > 0``: TRL scores reference log-probs);
- ``forward``: a training micro-batch's forward;
- ``backward``: a training micro-batch's backward (a gradient hook on the first layer's output).

Every scenario but ``generation`` trains on fixed rollouts (test_trl's ``rollout_func``: the same
completions and rewards for the same prompts) in float64 with TRL's LM head in float64
(trl_exact_head), so its update can be compared with the clean run's and TRL's to 1e-10. One
optimizer step of 8 completions per rank (per-device 4 × accumulation 2, micro-batches of 3).
Each rank writes ``OUT/SCENARIO_rank{R}.pt``: the gradients the optimizer applied, the engine's
micro-batches and OOMs, the generation batches, the scoring OOMs, the completions' token counts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))

import torch  # noqa: E402

from scenario_main import run_scenarios  # noqa: E402

from batchpilot.dist import distributed as bd  # noqa: E402

PHASES = ("generation", "scoring", "forward", "backward")


def _oom(where: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected in {where})")


def _inject(trainer, phase: str, rank: int) -> list[str]:
    """Arm one OOM on ``rank`` in ``phase``; returns the list the injection appends to when it fires."""
    fired: list[str] = []
    if bd.rank() != rank:
        return fired
    model = trainer.model
    if phase == "generation":
        original = model.generate

        def generate(*args, **kwargs):
            if not fired:
                fired.append(phase)
                raise _oom(phase)
            return original(*args, **kwargs)

        model.generate = generate
    elif phase == "scoring":
        def before_ref(module, args, kwargs):
            if not fired:
                fired.append(phase)
                raise _oom(phase)

        trainer.ref_model.register_forward_pre_hook(before_ref, with_kwargs=True)
    elif phase == "forward":
        def before(module, args, kwargs):
            if torch.is_grad_enabled() and not fired:
                fired.append(phase)
                raise _oom(phase)

        model.register_forward_pre_hook(before, with_kwargs=True)
    elif phase == "backward":
        def after_layer(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if torch.is_grad_enabled() and hidden.requires_grad and not fired:
                def raise_in_backward(grad):
                    if not fired:
                        fired.append(phase)
                        raise _oom(phase)

                hidden.register_hook(raise_in_backward)

        model.model.layers[0].register_forward_hook(after_layer)
    else:
        raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
    return fired


def run(out: Path, name: str) -> None:
    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    import test_trl as t
    import tiny_llama as tl
    from trl_exact_head import exact_head

    from batchpilot.integrations.trl import ResilientGRPOTrainer

    hf_logging.set_verbosity_error()
    rank = bd.rank()
    phase, _, fault_rank = name.partition("-")
    sampled = phase == "generation"
    dtype = torch.float32 if sampled else torch.float64
    tok = tl.tokenizer()
    policy = out / f"policy_{name}"  # TRL builds the reference model from the policy's path
    if rank == 0:  # transformers writes the weights from the main process only
        tl.model(context=128, layers=2, hidden=32, seed=1).to(dtype).save_pretrained(policy)
    torch.distributed.barrier()
    model = LlamaForCausalLM.from_pretrained(policy, dtype=dtype).train()
    args = GRPOConfig(
        output_dir=str(out / f"run_{name}"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=t.NEW, max_steps=1, report_to=[], use_cpu=True, logging_steps=1,
        save_strategy="no", learning_rate=1e-2, max_grad_norm=0.0, optim="sgd", beta=0.1, seed=7,
        gradient_checkpointing=False, disable_tqdm=True, ddp_timeout=60,
    )
    grads = t._Grads()
    cls = GRPOTrainer if name == "trl" else ResilientGRPOTrainer
    extra = {} if cls is GRPOTrainer else {"micro_batch_size": 3}
    if not sampled:
        extra["rollout_func"] = t._rollout(tok)
    with exact_head() if not sampled else contextlib.nullcontext():
        trainer = cls(model=model, reward_funcs=t._reward, args=args, processing_class=tok, callbacks=[grads],
                      train_dataset=Dataset.from_dict({"prompt": tl.texts([3, 17, 6, 30, 9, 4, 22, 12], seed=5)}),
                      **extra)
        fired = _inject(trainer, phase, int(fault_rank)) if fault_rank else []
        trainer.train()
    result = {"rank": rank, "fired": fired, "steps": trainer.state.global_step, "grads": grads.grads[0]}
    if cls is ResilientGRPOTrainer:
        step = trainer.batchpilot_last_step
        result.update(micro=list(step.micro_batch_sizes), train_ooms=list(trainer.batchpilot_step_ooms),
                      scoring_ooms=trainer.batchpilot_scoring_ooms,
                      generation=[(g.completions, g.calls, list(g.batches), g.ooms) for g in trainer.batchpilot_generation])
    torch.save(result, out / f"{name}_rank{rank}.pt")
    del trainer, model


def main() -> None:
    names = sys.argv[2:]
    for name in names:
        phase, _, fault = name.partition("-")
        if name not in ("clean", "trl") and (phase not in PHASES or not fault.isdigit()):
            raise SystemExit(f"unknown scenario {name!r}: clean, trl, or PHASE-RANK with PHASE in {PHASES}")
    run_scenarios({name: (lambda out, n=name: run(out, n)) for name in names})


if __name__ == "__main__":
    main()
