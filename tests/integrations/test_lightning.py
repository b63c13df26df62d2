"""batchpilot.integrations.lightning with a real ``lightning.Trainer`` on CPU, one process and 2-rank DDP (gloo)."""

from __future__ import annotations

import json
import logging
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning", reason="needs Lightning: pip install -e '.[integrations]'")

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_job as job  # noqa: E402  (tests/helpers)
from dist_launch import torchrun  # noqa: E402

from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

from batchpilot.integrations.lightning import BatchSizeCallback, NothingFitsException, ResilientModule  # noqa: E402
from batchpilot.memory.probes import emulate_capacity  # noqa: E402
from batchpilot.policy.search import NothingFitsError  # noqa: E402
from batchpilot.train.engine import EngineConfig  # noqa: E402
from batchpilot.train.batching import scale_lr  # noqa: E402

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


@pytest.fixture(autouse=True)
def _quiet():
    warnings.filterwarnings("ignore", module="lightning")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def trainer(**kw) -> L.Trainer:
    kw.setdefault("max_steps", 3)
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **kw)


def reference(steps: int, per_step: int, lr: float, world: int) -> list[torch.Tensor]:
    """Plain PyTorch: AdamW on consecutive global batches of the job's data (what DDP + accumulation must equal).

    Under DDP Lightning always shuffles the training data (a ``DistributedSampler`` seeded with 0 for
    epoch 0, rank r taking positions r, r + world, ...), so a global batch is a slice of that
    permutation; in one process the order is the dataloader's own.
    """
    X, Y = job.data()
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(0)) if world > 1 else torch.arange(len(X))
    net = job.network()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    for s in range(steps):
        rows = order[s * per_step:(s + 1) * per_step]
        opt.zero_grad()
        F.cross_entropy(net(X[rows]), Y[rows]).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def check_job(out: Path, world: int) -> None:
    """What the callback reported is what ran, on every rank, and both fits train like plain PyTorch."""
    docs = {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(world)]
            for name in ("auto", "resilient")}
    for name, per_rank in docs.items():
        setups = [d["setup"] for d in per_rank]
        for s in setups:  # every rank reports the same choice
            for key in ("micro_batch_size", "accum_steps", "global_batch_size", "found_batch_size", "limited_by_rank",
                        "lr_factor", "learning_rates"):
                assert s[key] == setups[0][key], (name, key, setups)
        s = setups[0]
        assert s["global_batch_size"] == job.GLOBAL == sum(s["micro_batch_sizes"]) * world
        assert len(s["micro_batch_sizes"]) == s["accum_steps"] and s["micro_batch_sizes"][0] == s["micro_batch_size"]
        assert s["world_size"] == world
        # the answer is the smallest rank's: rank world-1 has the smallest emulated device
        assert s["limited_by_rank"] == world - 1
        assert s["micro_batch_size"] <= s["found_batch_size"] < job.GLOBAL // world
        # the LR was tuned for the configured batch (8 per device, no accumulation): sqrt rule for AdamW
        base = 8 * world
        assert s["lr_base_size"] == base and s["lr_rule"] == "sqrt"
        expected_lr = scale_lr(job.LR, job.GLOBAL, lr_base_size=base, optimizer=torch.optim.AdamW)
        for d in per_rank:
            assert d["lr"] == pytest.approx([expected_lr]) and d["global_step"] == job.MAX_STEPS
    for d in docs["auto"]:  # Lightning accumulates equal micro-batches of the reported size
        s = d["setup"]
        assert d["accumulate_grad_batches"] == s["accum_steps"] and d["batch_size_attr"] == s["micro_batch_size"]
        assert d["batches"] == [s["micro_batch_size"]] * (job.MAX_STEPS * s["accum_steps"])
        # global_step advances once per accum_steps batches
        assert d["steps_at_batch"] == [i // s["accum_steps"] for i in range(job.MAX_STEPS * s["accum_steps"])]
    for d in docs["resilient"]:  # the dataloader gives the whole share; the engine accumulates
        s = d["setup"]
        assert d["accumulate_grad_batches"] == 1 and d["batch_size_attr"] == job.GLOBAL // world
        # what the callback reports is what the engine ran in its first step
        assert s["micro_batch_sizes"] == d["step_sizes"][0]
        assert d["engine"]["global_batch_size"] == job.GLOBAL and d["engine"]["steps"] == job.MAX_STEPS
        # the injected OOM in step OOM_STEP was retried at a smaller micro-batch; no step lost
        ooms = d["step_ooms"]
        assert ooms[job.OOM_STEP] >= 1 and ooms[:job.OOM_STEP] + ooms[job.OOM_STEP + 1:] == [0] * (job.MAX_STEPS - 1)
        assert d["step_micro"][:job.OOM_STEP] == [s["micro_batch_size"]] * job.OOM_STEP
        assert d["step_micro"][job.OOM_STEP] <= 16
    expected = reference(job.MAX_STEPS, job.GLOBAL, docs["auto"][0]["lr"][0], world)
    for name in ("auto", "resilient"):
        for r in range(world):
            got = torch.load(out / f"{name}_rank{r}.pt")
            for a, b in zip(got, expected):
                # float rounding: sums in another order, amplified by Adam where a gradient is near 0
                # (the updates themselves are of order lr × steps = 1e-2)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_callback_and_resilient_module_one_process(tmp_path):
    job.main(tmp_path)
    check_job(tmp_path, 1)


@pytest.mark.timeout(300)
def test_callback_and_resilient_module_under_ddp_with_two_ranks(tmp_path):
    # judged by what both ranks wrote (check_job), not by an exit code gloo's teardown may spoil
    proc = torchrun(HELPERS / "lightning_job.py", str(tmp_path), nproc=2, timeout=240,
                    finished=lambda _: all(any(tmp_path.glob(f"*_rank{r}.pt")) for r in (0, 1)))
    check_job(tmp_path, 2)
    # rank 0 fits more than rank 1 but Lightning's sampler gives both the same batch: said in one line
    said = [ln for ln in proc.stderr.splitlines() if "uneven shares cannot be handed out" in ln]
    assert said and all("Lightning gives every rank the same per-device batch" in ln for ln in said), proc.stderr[-3000:]


# ---------------------------------------------------------------------------
# a new user's module: dict batches with padding, the batch size on a datamodule, no global batch


class PaddedData(L.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(3, 12, (256,), generator=g)
        self.x = torch.randn(256, 12, 8, generator=g)
        self.mask = torch.arange(12)[None, :] < lengths[:, None]
        self.y = torch.randint(0, 3, (256,), generator=g)

    def train_dataloader(self) -> DataLoader:
        rows = [{"x": self.x[i], "mask": self.mask[i], "y": self.y[i]} for i in range(len(self.y))]
        return DataLoader(rows, batch_size=self.batch_size)


class Pooled(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3))
        self.lr = lr
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        h = self.net(batch["x"]) * batch["mask"][..., None]
        logits = h.sum(1) / batch["mask"].sum(1, keepdim=True)
        self.sizes.append(len(batch["y"]))
        return F.cross_entropy(logits, batch["y"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


def test_a_datamodule_batch_size_and_dict_batches_without_a_global_batch():
    data, module = PaddedData(), Pooled()
    cb = BatchSizeCallback(capacity="96KiB", max_batch_size=64, lr_rule="auto")
    t = trainer(callbacks=[cb], accumulate_grad_batches=2, max_steps=2)
    t.fit(module, datamodule=data)
    s = cb.setup
    # the largest micro-batch that fits; the configured accumulation is kept
    assert s.found_batch_size == s.micro_batch_size and 4 < s.micro_batch_size <= 64
    assert s.plan.stop_reason in ("boundary", "max_batch_size")
    assert data.batch_size == s.micro_batch_size and t.accumulate_grad_batches == 2 == s.accum_steps
    assert module.sizes[-4:] == [s.micro_batch_size] * 4  # the reloaded dataloader
    # SGD: linear rule from the configured 4 × 2, scheduler's base moved with it
    assert s.lr_base_size == 8 and s.lr_rule == "linear"
    assert s.lr_factor == pytest.approx(s.global_batch_size / 8)
    assert t.lr_scheduler_configs[0].scheduler.base_lrs == pytest.approx([0.1 * s.lr_factor])


class AdamPooled(Pooled):
    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


def test_the_callback_with_its_defaults_changes_only_the_batch_size_like_lightnings_finder():
    # in place of Lightning's BatchSizeFinder, which leaves the optimizer alone: Adam keeps its lr
    data, module = PaddedData(), AdamPooled()
    cb = BatchSizeCallback()
    with emulate_capacity("96KiB", track=(module,)):
        t = trainer(callbacks=[cb], max_steps=1)
        t.fit(module, datamodule=data)
    s = cb.setup
    assert s.micro_batch_size == s.found_batch_size > 4 == s.lr_base_size  # the batch size did change
    assert data.batch_size == s.micro_batch_size and t.accumulate_grad_batches == 1
    assert s.lr_rule == "none" and s.lr_factor == 1.0 and s.learning_rates == (1e-3,)
    assert t.optimizers[0].param_groups[0]["lr"] == 1e-3
    assert t.lr_scheduler_configs[0].scheduler.base_lrs == [1e-3]
    assert "lr" not in s.describe()
    # LR scaling is one argument away: sqrt for Adam from the configured 4
    data, module = PaddedData(), AdamPooled()
    cb = BatchSizeCallback(lr_rule="auto")
    with emulate_capacity("96KiB", track=(module,)):
        t = trainer(callbacks=[cb], max_steps=1)
        t.fit(module, datamodule=data)
    s = cb.setup
    assert s.lr_rule == "sqrt" and s.lr_factor == pytest.approx((s.global_batch_size / 4) ** 0.5) != 1.0
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * s.lr_factor)
    assert t.lr_scheduler_configs[0].scheduler.base_lrs == pytest.approx([1e-3 * s.lr_factor])


def test_lr_rule_none_and_a_fixed_micro_batch_leave_the_learning_rate_alone():
    data, module = PaddedData(), Pooled()
    cb = BatchSizeCallback(micro_batch_size=16, global_batch_size=64, lr_rule="none")
    t = trainer(callbacks=[cb], max_steps=1)
    t.fit(module, datamodule=data)
    assert cb.setup.plan is None and cb.setup.micro_batch_size == 16 and t.accumulate_grad_batches == 4
    assert t.optimizers[0].param_groups[0]["lr"] == 0.1  # not rescaled (StepLR steps per epoch)
    assert cb.setup.describe() == "global 64 = micro 16 × world 1 × accum 4"


def test_a_module_without_the_batch_size_attribute_is_told_how_to_fix_it():
    class NoAttr(Pooled):
        def train_dataloader(self):
            return PaddedData().train_dataloader()

    with pytest.raises(ValueError, match=r"attribute 'batch_size'.*add self.batch_size"):
        trainer(callbacks=[BatchSizeCallback(capacity="1MiB")]).fit(NoAttr())
    with pytest.raises(ValueError, match=r"passed to fit\(\) directly"):
        trainer(callbacks=[BatchSizeCallback(capacity="1MiB")]).fit(Pooled(), train_dataloaders=PaddedData().train_dataloader())


@pytest.mark.parametrize("kwargs, match", [
    ({"lr_rule": "cubic"}, "unknown lr_rule 'cubic'"),
    ({"global_batch_size": 0}, "global_batch_size must be a positive int"),
    ({"target": 1.5}, "target must be a fraction"),
    ({"device": "cpu"}, "unknown finder option 'device'"),
    ({"max_trails": 3}, "unknown finder option 'max_trails'; did you mean 'max_trials'"),
    ({"find_options": {"max_trials": 3}}, "find_options= is not a finder option any more"),
    ({"micro_batch_size": 2.5}, "micro_batch_size must be a positive int"),
])
def test_bad_options_fail_when_the_callback_is_built(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchSizeCallback(**kwargs)


def test_resilient_module_alone_searches_on_its_first_batch_and_resumes_from_a_checkpoint(tmp_path):
    X, Y = job.data()

    class Net(ResilientModule, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = job.network()

        def train_dataloader(self):
            return DataLoader(TensorDataset(X, Y), batch_size=64)

        def compute_loss(self, batch):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    from batchpilot.memory.probes import emulate_capacity

    module = Net()
    t = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=tmp_path)
    with emulate_capacity("300KiB", track=(module,)):
        t.fit(module)
    engine = module.batchpilot_engine
    assert engine.plan is not None and engine.global_batch_size == 64 and t.global_step == 2
    micro = engine.micro_batch_size
    assert micro < 64  # 300 KiB does not hold a step at 64: the engine accumulates
    ckpt = tmp_path / "last.ckpt"
    t.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["batchpilot_engine"]["micro_batch"]["policy"]["micro"] == micro
    resumed = Net()
    t2 = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=tmp_path)
    t2.fit(resumed, ckpt_path=ckpt)
    # no second search: the engine resumed at the saved micro-batch
    assert resumed.batchpilot_engine.plan is None and resumed.batchpilot_last_step.micro_batch_size == micro
    assert t2.global_step == 3


class LoggingPooled(ResilientModule, Pooled):
    """A user's habit carried over from training_step: ``self.log("train_loss", ...)`` in compute_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.ran: list[tuple[int, ...]] = []  # the micro-batches compute_loss saw in each training step

    def compute_loss(self, batch):
        h = self.net(batch["x"]) * batch["mask"][..., None]
        loss = F.cross_entropy(h.sum(1) / batch["mask"].sum(1, keepdim=True), batch["y"])
        self.log("train_loss", loss, prog_bar=True)
        self.seen.append(len(batch["y"]))
        return loss

    def training_step(self, batch, batch_idx):
        self.seen = []
        out = super().training_step(batch, batch_idx)
        self.ran.append(tuple(self.seen))
        return out


def test_the_module_logs_its_own_train_loss_and_the_callback_reports_the_engines_unequal_micro_batches():
    data, module = PaddedData(), LoggingPooled()
    cb = BatchSizeCallback(capacity="64KiB", global_batch_size=61)  # 61 is prime: the micro-batches are unequal
    t = trainer(callbacks=[cb], max_steps=2)
    t.fit(module, datamodule=data)
    assert t.global_step == 2 and data.batch_size == 61
    s = cb.setup
    assert 1 < s.found_batch_size < 61 and len(set(module.ran[0])) == 2  # e.g. 13 + 12 × 4
    # what the callback returns and logs is what compute_loss really ran, not 15 × 4 plus a last of 1
    assert s.micro_batch_sizes == module.ran[0] == module.batchpilot_last_step.micro_batch_sizes
    assert (s.micro_batch_size, s.accum_steps, sum(s.micro_batch_sizes)) == (max(module.ran[0]), len(module.ran[0]), 61)
    assert s.describe().startswith(f"global 61 = micro {s.micro_batch_size} × world 1 × accum {s.accum_steps} (")
    # the user's metric and the mixin's, side by side
    metrics = t.callback_metrics
    assert "train_loss" in metrics and "batchpilot/loss" in metrics
    assert metrics["batchpilot/micro_batch_size"] == module.ran[-1][0]
    assert metrics["batchpilot/accum_steps"] == len(module.ran[-1])


class Tiny(ResilientModule, Pooled):
    engine_options = {"config": EngineConfig(capacity="2KiB")}

    def compute_loss(self, batch):
        h = self.net(batch["x"]) * batch["mask"][..., None]
        return F.cross_entropy(h.sum(1) / batch["mask"].sum(1, keepdim=True), batch["y"])


@pytest.mark.parametrize("who", ["BatchSizeCallback", "ResilientModule"])
def test_nothing_fits_reaches_the_user_as_one_message_in_lightnings_style(who):
    if who == "BatchSizeCallback":
        t, module, hook = trainer(callbacks=[BatchSizeCallback(capacity="2KiB")]), Pooled(), "on_fit_start"
    else:
        t, module, hook = trainer(), Tiny(), "_batchpilot_build"
    with pytest.raises(NothingFitsException) as info:
        t.fit(module, datamodule=PaddedData())
    exc = info.value
    # the finder's type and figures are kept, as Lightning's MisconfigurationException
    assert isinstance(exc, NothingFitsError) and isinstance(exc, MisconfigurationException)
    assert exc.batch_size == 1 and exc.capacity_bytes == 2048 and exc.limit_bytes < 2048
    assert str(exc).startswith(f"{who}: nothing fits on cpu: batch size 1") and "use a smaller model" in str(exc)
    # one traceback, ending in the integration's hook: no chained OOMs, no frames of the finder
    text = "".join(traceback.format_exception(exc))
    assert text.count("Traceback (most recent call last)") == 1 and "During handling" not in text
    frames = traceback.extract_tb(exc.__traceback__)
    assert frames[-1].name == hook and not any("batchpilot/find" in f.filename for f in frames)
    assert text.rstrip().endswith(f"NothingFitsException: {exc}")


def test_resilient_module_refuses_automatic_optimization_and_explains_compute_loss():
    class Bare(ResilientModule, L.LightningModule):
        pass

    m = Bare()
    assert m.automatic_optimization is False
    with pytest.raises(ValueError, match="manual optimization"):
        m.automatic_optimization = True
    with pytest.raises(NotImplementedError, match=r"define compute_loss\(self, batch\)"):
        m.compute_loss(None)


@pytest.mark.gpu
def test_on_cuda_the_callback_sizes_for_an_emulated_card_and_the_module_trains_within_it():
    from batchpilot.memory.probes import emulate_capacity

    X, Y = job.data()

    class Net(ResilientModule, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 4096), nn.ReLU(), nn.Linear(4096, 4))
            self.batch_size = 8

        def train_dataloader(self):
            return DataLoader(TensorDataset(X.repeat(64, 1), Y.repeat(64)), batch_size=self.batch_size)

        def compute_loss(self, batch):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    cb = BatchSizeCallback(global_batch_size=65536, capacity="1GiB")
    t = L.Trainer(accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    module = Net()
    with emulate_capacity("1GiB", "cuda"):
        t.fit(module)
    s = cb.setup
    assert s.plan.device.startswith("cuda") and s.plan.memory != "tensors"
    assert 1 < s.micro_batch_size < 65536 and t.global_step == 2
    assert module.batchpilot_engine.global_batch_size == 65536
