"""The figure each device is judged on (batchpilot.memory.gauge); CUDA's with its driver calls stubbed."""

from __future__ import annotations

import types

import pytest
import torch

from batchpilot.memory.gauge import DeviceGauge, ResidentGauge, TensorGauge, gauge_for
from batchpilot.memory.probes import emulate_capacity
from batchpilot.memory.tracker import StorageTracker

GiB, MiB = 2**30, 2**20


class FakeCuda:
    """The allocator and driver figures a CUDA gauge reads, set by the test."""

    def __init__(self, total: int, other: int) -> None:
        self.total, self.other = total, other  # other: context + other processes, outside PyTorch
        self.reserved = self.max_reserved = 0
        self.synced = 0

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (self.total - self.other - self.reserved, self.total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda d=None: self.max_reserved)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: setattr(self, "max_reserved", self.reserved))
        monkeypatch.setattr(cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(total_memory=self.total))
        monkeypatch.setattr(cuda, "synchronize", lambda d=None: setattr(self, "synced", self.synced + 1))

    def allocate(self, n: int) -> None:
        self.reserved += n
        self.max_reserved = max(self.max_reserved, self.reserved)


def test_cuda_is_judged_on_reserved_plus_everything_outside_pytorch(monkeypatch):
    fake = FakeCuda(total=80 * GiB, other=3 * GiB)  # a context and another process
    fake.install(monkeypatch)
    fake.allocate(10 * GiB)
    gauge = DeviceGauge(torch.device("cuda", 0))
    gauge.reset()
    assert fake.synced == 1  # figures are read after the queued kernels
    assert gauge.outside == 3 * GiB and gauge.current() == 13 * GiB
    fake.allocate(50 * GiB)  # the step's peak, cached blocks included
    fake.reserved -= 20 * GiB
    assert gauge.peak() == 63 * GiB and gauge.capacity() == 80 * GiB and not gauge.kills


def test_an_emulated_cuda_capacity_counts_reserved_only(monkeypatch):
    fake = FakeCuda(total=80 * GiB, other=3 * GiB)
    fake.install(monkeypatch)
    gauge = gauge_for(torch.device("cuda", 0), emulated_capacity=24 * GiB)
    gauge.reset()
    fake.allocate(5 * GiB)
    # the memory fraction caps what the allocator reserves: what others hold is not the emulated card's
    assert gauge.peak() == 5 * GiB and gauge.capacity() == 24 * GiB


def test_cpu_gauges_tensors_under_emulation_and_resident_memory_otherwise():
    cpu = torch.device("cpu")
    assert isinstance(gauge_for(cpu), ResidentGauge) and gauge_for(cpu).kind == "resident"
    tensors = gauge_for(cpu, emulated_capacity=4 * MiB)
    assert isinstance(tensors, TensorGauge)
    with emulate_capacity(4 * MiB):
        tensors.reset()
        x = torch.empty(MiB // 4)
        assert tensors.current() == MiB and tensors.peak() == MiB and tensors.capacity() == 4 * MiB
        del x
    with pytest.raises(RuntimeError, match="StorageTracker"):
        tensors.current()
    with StorageTracker():
        assert tensors.capacity() > 4 * MiB  # a tracker without a capacity: the host's


def test_the_resident_gauge_follows_the_host():
    gauge = ResidentGauge(torch.device("cpu"))
    gauge.reset()
    start = gauge.current()
    x = torch.ones(32 * MiB // 4)
    assert gauge.peak() >= start + 30 * MiB
    del x
    assert gauge.capacity() > gauge.current() and gauge.kills == (gauge.limits.binding != "rlimit_as")
