"""The figure each device is judged on (batchpilot.memory.gauge); CUDA's with its driver calls stubbed."""

from __future__ import annotations

import types

import pytest
import torch

from batchpilot.memory import gauge as gauge_mod
from batchpilot.memory.gauge import AllocatorGauge, DeviceGauge, Gauge, HostGauge, TensorGauge, gauge_for
import batchpilot.memory.limits as limits_mod
from batchpilot.memory.limits import HostLimits
from batchpilot.memory.probes import emulate_capacity, emulated_capacity, get_probe, track_peak
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

    def install_allocated(self, monkeypatch) -> None:
        """The allocated-bytes figures too (here equal to reserved: no cached blocks) and the memory fraction."""
        self.fractions: list[float] = []
        # torch.accelerator's memory functions serve a real GPU's gauge, the backend module's the rest
        for owner in (torch.cuda, getattr(torch, "accelerator", None)):
            if owner is not None:
                monkeypatch.setattr(owner, "memory_allocated", lambda d=None: self.reserved, raising=False)
                monkeypatch.setattr(owner, "max_memory_allocated", lambda d=None: self.max_reserved, raising=False)
                monkeypatch.setattr(owner, "reset_peak_memory_stats",
                                    lambda d=None: setattr(self, "max_reserved", self.reserved), raising=False)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: self.fractions.append(f))


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


def test_cpu_gauges_tensors_under_emulation_and_host_memory_otherwise():
    cpu = torch.device("cpu")
    host = gauge_for(cpu)
    assert isinstance(host, HostGauge) and host.kind == host.limits.limit.name
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


def test_the_host_gauge_follows_the_host():
    gauge = HostGauge(torch.device("cpu"))
    gauge.reset()
    start = gauge.current()
    x = torch.ones(32 * MiB // 4)
    assert gauge.peak() >= start + 30 * MiB
    del x
    assert gauge.capacity() > gauge.current() and gauge.kills == (gauge.limits.binding != "rlimit_as")


class FakeHost:
    """The /proc figures a host gauge reads, set by the test (bytes)."""

    def __init__(self, monkeypatch, **limits) -> None:
        self.rss, self.hwm, self.vm, self.vm_peak = 300 * MiB, 300 * MiB, 900 * MiB, 950 * MiB
        self.limits = limits
        for mod in (gauge_mod, limits_mod):  # the gauge keeps the window, the limit reads its figure
            monkeypatch.setattr(mod, "host_limits", self.host_limits)
            monkeypatch.setattr(mod, "resident_bytes", lambda: self.rss)
            monkeypatch.setattr(mod, "address_space_peak", lambda: self.vm_peak)
        monkeypatch.setattr(limits_mod, "address_space_bytes", lambda: self.vm)
        monkeypatch.setattr(gauge_mod.ResidentPeak, "reset", lambda peak: setattr(self, "hwm", self.rss))
        monkeypatch.setattr(gauge_mod.ResidentPeak, "peak", lambda peak: self.hwm)

    def host_limits(self) -> HostLimits:
        return HostLimits(resident_bytes=self.rss, address_space_bytes=self.vm, **self.limits)

    def grow(self, mapped: int, resident: int) -> None:
        """A step maps ``mapped`` and writes ``resident`` more, then frees both."""
        self.hwm = max(self.hwm, self.rss + resident)
        self.vm_peak = max(self.vm_peak, self.vm + mapped)


def test_under_rlimit_as_the_figure_is_the_address_space(monkeypatch):
    fake = FakeHost(monkeypatch, rlimit_as_bytes=2 * GiB, available_bytes=20 * GiB)
    gauge = gauge_for(torch.device("cpu"))
    assert gauge.kind == "address_space" and gauge.capacity() == 2 * GiB and not gauge.kills
    assert gauge.current() == 900 * MiB  # mapped, not resident: what the limit counts
    gauge.reset()
    fake.grow(mapped=20 * MiB, resident=20 * MiB)
    # below the process's earlier peak (950 MiB): the kernel's VmPeak says nothing, the resident
    # growth from the window's start gives the peak
    assert gauge.peak() == 920 * MiB
    fake.grow(mapped=300 * MiB, resident=250 * MiB)
    # above every earlier peak: VmPeak is exact, whatever the resident set did
    assert gauge.peak() == 1200 * MiB


def test_an_estimated_address_space_peak_never_exceeds_the_kernels(monkeypatch):
    fake = FakeHost(monkeypatch, rlimit_as_bytes=2 * GiB, available_bytes=20 * GiB)
    gauge = gauge_for(torch.device("cpu"))
    gauge.reset()
    fake.hwm += 80 * MiB  # pages of files read (libraries, data) are resident, not mapped anew
    assert gauge.peak() == 950 * MiB


def test_in_a_container_the_figure_is_the_working_set(monkeypatch):
    fake = FakeHost(monkeypatch, cgroup_limit_bytes=GiB, cgroup_used_bytes=600 * MiB, available_bytes=20 * GiB)
    gauge = gauge_for(torch.device("cpu"))
    assert gauge.kind == "cgroup" and gauge.capacity() == GiB and gauge.kills
    assert gauge.current() == 600 * MiB  # the whole container, other processes included
    gauge.reset()
    fake.grow(mapped=0, resident=100 * MiB)
    assert gauge.peak() == 700 * MiB


def test_without_a_limit_the_figure_is_the_resident_set(monkeypatch):
    fake = FakeHost(monkeypatch, available_bytes=GiB)
    gauge = gauge_for(torch.device("cpu"))
    assert gauge.kind == "resident" and gauge.capacity() == 300 * MiB + GiB and gauge.kills
    gauge.reset()
    fake.grow(mapped=500 * MiB, resident=100 * MiB)
    assert gauge.current() == 300 * MiB and gauge.peak() == 400 * MiB


def test_each_devices_probe_is_its_allocated_bytes_gauge():
    cpu = get_probe("cpu")
    assert isinstance(cpu, AllocatorGauge) and isinstance(cpu, Gauge) and get_probe("cpu") is cpu
    with StorageTracker():
        cpu.reset()
        x = torch.empty(MiB // 4)
        assert cpu.current() == cpu.peak() == MiB
        del x
        assert cpu.current() == 0 and cpu.peak() == MiB


def test_the_emulated_cpu_capacity_is_the_running_trackers():
    assert emulated_capacity("cpu") is None
    with track_peak("cpu"):
        assert emulated_capacity("cpu") is None  # a tracker that only counts emulates nothing
        with emulate_capacity(4 * MiB) as probe:
            assert emulated_capacity("cpu") == probe.capacity() == 4 * MiB
        assert emulated_capacity("cpu") is None
    with emulate_capacity("2MiB"):
        assert emulated_capacity(torch.device("cpu")) == 2 * MiB
    assert emulated_capacity("cpu") is None


def test_an_emulated_cuda_capacity_is_recorded_while_it_runs(monkeypatch):
    fake = FakeCuda(total=80 * GiB, other=3 * GiB)
    fake.install(monkeypatch)
    fake.install_allocated(monkeypatch)
    dev = torch.device("cuda", 0)
    assert emulated_capacity(dev) is None
    with emulate_capacity(24 * GiB, "cuda:0") as probe:
        assert probe is get_probe(dev) and probe.capacity() == 24 * GiB
        assert emulated_capacity(dev) == 24 * GiB and fake.fractions == [0.3]
        with emulate_capacity(8 * GiB, dev):  # nested: the inner one wins, then the outer is back
            assert emulated_capacity(dev) == probe.capacity() == 8 * GiB
        assert emulated_capacity(dev) == 24 * GiB and fake.fractions == [0.3, 0.1, 0.3]
        with track_peak(dev) as m:
            fake.allocate(GiB)
        assert (m.start_bytes, m.peak_bytes, m.end_bytes, m.capacity) == (0, GiB, GiB, 24 * GiB)
    assert emulated_capacity(dev) is None and probe.capacity() == 80 * GiB and fake.fractions[-1] == 1.0
    with pytest.raises(ValueError, match="exceeds the device"):
        with emulate_capacity(81 * GiB, dev):
            pass
    assert emulated_capacity(dev) is None
