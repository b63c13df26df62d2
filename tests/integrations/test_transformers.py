"""batchpilot.integrations.transformers with a real ``transformers.Trainer`` on CPU and tiny models built from configs."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[integrations]'")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from batchpilot.train.batching import scale_lr  # noqa: E402
from batchpilot.find.front import find_batch_size_for  # noqa: E402
from batchpilot.integrations.transformers import (  # noqa: E402
    ResilientTrainer,
    ResilientTrainerMixin,
    configure_batch_size,
    hf_loss,
)
from batchpilot.memory.probes import emulate_capacity  # noqa: E402

VOCAB, T = 64, 16


@pytest.fixture(autouse=True)
def _quiet():
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="accelerate")


class Tokens(torch.utils.data.Dataset):
    """Random token rows; ``lengths`` makes them ragged (padded with -100 labels by :func:`pad`)."""

    def __init__(self, n: int = 256, ragged: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, T), generator=g)
        self.lengths = torch.randint(4, T + 1, (n,), generator=g) if ragged else torch.full((n,), T)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.ids[i, : int(self.lengths[i])]
        return {"input_ids": row, "labels": row}


def pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collator for ragged rows: right padding, attention mask, labels -100 on the padding."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class MeanLoss(nn.Module):
    """A model whose forward takes no loss keywords: the Trainer averages its mean loss per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids, labels=None, attention_mask=None):
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=6,
                learning_rate=1e-3, report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, seed=0,
                dataloader_drop_last=True, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


class Steps(TrainerCallback):
    """Counts optimizer steps as the Trainer's loop reports them."""

    def __init__(self) -> None:
        self.optimizer_steps = 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer_steps += 1


def oom_in_step(trainer: Trainer, step: int, above: int):
    """A forward hook raising the OOM a device would, for micro-batches over ``above`` samples in ``step``."""

    def hook(module, a, kw):
        ids = kw.get("input_ids", a[0] if a else None)
        if module.training and trainer.state.global_step == step and ids.shape[0] > above:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    return hook


def train(cls, build, tmp_path, *, inject: int | None = None, ragged: bool = True, **kw):
    model = build()
    steps = Steps()
    t = cls(model=model, args=args(tmp_path, **kw), train_dataset=Tokens(ragged=ragged), data_collator=pad,
            callbacks=[steps])
    if inject is not None:
        model.register_forward_pre_hook(oom_in_step(t, inject, above=4), with_kwargs=True)
    t.train()
    return t, steps.optimizer_steps, [p.detach().clone() for p in model.parameters()]


# GPT-2 takes num_items_in_batch: exact on ragged rows. A model that averages over its own tokens
# gives a mean per micro-batch, which another split changes when rows are ragged (as the Trainer's
# own accumulation does): equal-length rows for it.
@pytest.mark.parametrize("build, ragged", [(gpt2, True), (MeanLoss, False)], ids=["num_items_in_batch", "mean_loss"])
def test_an_oom_in_step_k_changes_neither_the_steps_nor_the_parameters(build, ragged, tmp_path):
    plain, plain_steps, expected = train(Trainer, build, tmp_path / "plain", ragged=ragged)
    resilient, steps, got = train(ResilientTrainer, build, tmp_path / "oom", inject=3, ragged=ragged)
    assert resilient.state.global_step == plain.state.global_step == 6
    assert steps == plain_steps == 6
    engine = resilient.batchpilot_engine
    assert engine.steps == 6 and engine.global_batch_size == 16 and engine.micro_batch_size <= 4
    # each micro-batch's loss is the Trainer's compute_loss with num_items_in_batch over the whole
    # batch (GPT-2), or its mean weighted by its share of the samples (MeanLoss)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    logged = [h["loss"] for h in resilient.state.log_history if "loss" in h]
    assert logged == pytest.approx([h["loss"] for h in plain.state.log_history if "loss" in h], rel=1e-5)


class Subclassed(Trainer):
    """A Trainer subclass with arguments of its own, as SFTTrainer has."""

    def __init__(self, model, *rest, note: str = "", **kwargs):
        super().__init__(model, *rest, **kwargs)
        self.note = note


class ResilientSubclassed(ResilientTrainerMixin, Subclassed):
    pass


def test_the_callers_arguments_and_the_global_batch_are_kept_also_by_the_mixin_on_a_subclass(tmp_path):
    a = args(tmp_path)
    t = ResilientSubclassed(gpt2(), a, train_dataset=Tokens(), note="mine")
    assert t.note == "mine"
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps) == (8, 2)  # untouched
    # the Trainer's copy loads each optimizer step's batch whole; the engine starts at micro-batches of 8
    assert (t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps) == (16, 1)
    t.train()
    assert t.batchpilot_engine.describe().startswith("global 16 = micro 8 × world 1 × accum 2")


def test_an_eval_oom_shrinks_the_eval_batch_and_leaves_the_training_batch_alone(tmp_path):
    model = gpt2()
    a = args(tmp_path, per_device_eval_batch_size=32, eval_strategy="steps", eval_steps=2, max_steps=4)
    t = ResilientTrainer(model=model, args=a, train_dataset=Tokens(), eval_dataset=Tokens(64))
    seen: list[int] = []

    def hook(module, _, kw):  # a device that evaluates 16 samples at most
        if not module.training:
            seen.append(kw["input_ids"].shape[0])
            if seen[-1] > 16:
                raise torch.OutOfMemoryError("out of memory (injected by the test)")

    model.register_forward_pre_hook(hook, with_kwargs=True)
    t.train()
    metrics = t.evaluate()
    assert "eval_loss" in metrics and t.state.global_step == 4
    assert t.args.per_device_eval_batch_size == 16  # the finder's answer below the failing 32
    assert (t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps) == (16, 1)
    assert t.batchpilot_engine.micro_batch_size == 8 and t.batchpilot_engine.global_batch_size == 16
    assert seen[0] == 32 and seen[-4:] == [16] * 4  # the last evaluation ran at 16, 64 samples


def test_configure_batch_size_holds_a_global_batch_and_scales_the_learning_rate(tmp_path):
    a = args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=2)
    model = gpt2()
    setup = configure_batch_size(a, model, Tokens(ragged=True), data_collator=pad, global_batch_size=48,
                                 capacity="3MiB", lr_rule="auto")
    found = setup.found_batch_size
    # the largest divisor of 48 that fits, and the accumulation that makes up 48
    assert setup.micro_batch_size == max(d for d in range(1, found + 1) if 48 % d == 0)
    assert a.per_device_train_batch_size * a.gradient_accumulation_steps == 48 == setup.global_batch_size
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps) == (setup.micro_batch_size,
                                                                              setup.accum_steps)
    # AdamW: sqrt rule from the 4 the arguments described
    assert a.learning_rate == pytest.approx(scale_lr(1e-3, 48, lr_base_size=4, optimizer=torch.optim.AdamW))
    assert setup.lr_rule == "sqrt" and setup.plan.stop_reason == "boundary"
    # the same search by hand: the answer is the finder's, on the model and optimizer the Trainer builds
    fresh = gpt2()
    opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(a, fresh)
    again = find_batch_size_for(fresh, lambda b: pad([Tokens(ragged=True)[i] for i in range(b)]),
                                optimizer=opt_cls(fresh.parameters(), **opt_kwargs), loss_fn=hf_loss,
                                capacity="3MiB", max_batch_size=48)
    assert found == again.batch_size
    # and the Trainer then trains within the emulated memory, at the planned sizes
    with emulate_capacity("3MiB"):
        t = Trainer(model=model, args=a, train_dataset=Tokens(ragged=True), data_collator=pad)
        t.train()
    assert t.state.global_step == 2


def test_configure_batch_size_without_a_global_batch_keeps_the_accumulation(tmp_path):
    a = args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    batch = pad([Tokens()[i] for i in range(4)])  # an example batch: its rows are repeated to each size
    # the defaults change only the batch sizes (lr_rule="none"), as a peer's finder does, although
    # the global batch moved from 6 to 3 x the size found
    setup = configure_batch_size(a, gpt2(), batch, capacity="2MiB", max_batch_size=64)
    assert a.gradient_accumulation_steps == 3 and a.per_device_train_batch_size == setup.found_batch_size > 2
    assert setup.global_batch_size != 6
    assert a.learning_rate == 1e-3 and setup.lr_factor == 1.0 and setup.lr_rule == "none"


def _fits(b: int, capacity: int, a: TrainingArguments) -> bool:
    """Two real training steps at batch ``b`` of the Trainer's optimizer under an emulated ``capacity``."""
    model = gpt2()
    opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(a, model)
    opt = opt_cls(model.parameters(), **opt_kwargs)
    data = Tokens(ragged=True)
    batch = pad([data[i % len(data)] for i in range(b)])
    try:
        with emulate_capacity(capacity, track=(model,)):
            for _ in range(2):
                hf_loss(model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError:
        return False
    return True


class Recording(ResilientTrainer):
    """Records the micro-batch and the OOMs of every training step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.runs.append((self.batchpilot_last_step.micro_batch_size, self.batchpilot_last_step.ooms))
        return loss


def test_configure_batch_size_then_resilient_trainer_runs_the_micro_batch_the_finder_found(tmp_path, caplog):
    # the README's pairing. The plain Trainer needs a divisor of the per-rank batch (63 where 32 fit:
    # 21), but ResilientTrainer's engine cuts a smaller last micro-batch, so it starts at the answer
    capacity = 6 * 2**20
    a = args(tmp_path)
    # the largest micro-batch in the memory the finder may use (target 0.8), by direct bisection
    lo, hi = 1, 128
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(mid, int(0.8 * capacity), a) else (lo, mid - 1)
    largest = lo
    assert 16 < largest < 60  # the global batches below need more than one micro-batch
    ran = {}
    for global_ in (62, 63, 64, 65):  # 63 ± 1, and 65, where balanced micro-batches need 3
        a = args(tmp_path / str(global_), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                 max_steps=2)
        model = gpt2()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="batchpilot.integrations.transformers"):
            setup = configure_batch_size(a, model, Tokens(ragged=True), data_collator=pad,
                                         global_batch_size=global_, capacity=capacity)
        assert a.batchpilot_setup is setup and setup.found_batch_size <= largest
        # what was written into the arguments: a plain Trainer's equal micro-batches
        assert setup.micro_batch_sizes == (a.per_device_train_batch_size,) * a.gradient_accumulation_steps
        with emulate_capacity(capacity, track=(model,)):
            t = Recording(model=model, args=a, train_dataset=Tokens(ragged=True), data_collator=pad)
            t.runs = []
            t.train()
        assert t.state.global_step == 2 and t.batchpilot_engine.global_batch_size == global_
        assert [ooms for _, ooms in t.runs] == [0, 0]
        # configure_batch_size's log says what the ResilientTrainer then ran, unequal micro-batches included
        ran_sizes = t.batchpilot_last_step.micro_batch_sizes
        assert f"a ResilientTrainer on them runs {setup.with_micro_batches(ran_sizes).describe()}" in caplog.text
        micro = {m for m, _ in t.runs}
        assert len(micro) == 1
        ran[global_] = micro.pop()
        # the fewest micro-batches the memory allows
        assert t.batchpilot_last_step.accum_steps == -(-global_ // largest), (global_, ran, largest)
    for global_ in (62, 63, 64):
        assert ran[global_] >= 0.9 * largest, (ran, largest)
    assert max(ran[g] for g in (62, 63, 64)) - min(ran[g] for g in (62, 63, 64)) <= 1, ran


@pytest.mark.parametrize("kw, match", [
    ({"fp16": True}, "fp16=True"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size=True"),
])
def test_resilient_trainer_refuses_what_it_cannot_split(kw, match, tmp_path):
    a = args(tmp_path)
    for k, v in kw.items():
        object.__setattr__(a, k, v)
    with pytest.raises(ValueError, match=match):
        ResilientTrainer(model=gpt2(), args=a, train_dataset=Tokens())


def test_a_model_that_returns_no_loss_is_told_to_pass_labels(tmp_path):
    batch = {"input_ids": torch.randint(0, VOCAB, (2, T))}
    with pytest.raises(ValueError, match="give it labels"):
        configure_batch_size(args(tmp_path), gpt2(), batch, capacity="8MiB")


@pytest.mark.gpu
def test_on_cuda_configure_and_train_within_an_emulated_card(tmp_path):
    a = args(tmp_path, use_cpu=False, bf16=True, per_device_train_batch_size=4, gradient_accumulation_steps=1,
             max_steps=2)
    model = gpt2()
    setup = configure_batch_size(a, model, Tokens(n=4096), global_batch_size=4096, capacity="512MiB")
    assert setup.plan.device.startswith("cuda") and setup.global_batch_size == 4096
    with emulate_capacity("512MiB", "cuda"):
        t = ResilientTrainer(model=model, args=a, train_dataset=Tokens(n=4096))
        t.train()
    assert t.state.global_step == 2 and t.batchpilot_engine.global_batch_size == 4096
