"""Kinds of memory limit (batchpilot.memory.limits): which one binds, what each answers, and a new kind.

The last test defines a kind of host limit of its own, here in the tests, and adds it through the
public ``register``: the gauge, the finder, the plan and the CLI's JSON record follow it with no
change anywhere but here.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from batchpilot import find_batch_size
from batchpilot.app.report import plan_record
from batchpilot.memory.gauge import HostGauge, gauge_for
from batchpilot.memory.host import resident_bytes
from batchpilot.memory.limits import (
    ADDRESS_SPACE, ALLOCATED, CGROUP, DEVICE, RESIDENT, TENSORS, HostLimit, HostLimits, host_kinds, host_limits,
    register, unregister,
)
from batchpilot.memory.oom import parse_oom_message

GiB, MiB = 2**30, 2**20


def test_the_tightest_limit_binds_and_only_rlimit_as_raises():
    limits = HostLimits(resident_bytes=1 * GiB, cgroup_limit_bytes=4 * GiB, cgroup_used_bytes=3 * GiB,
                        rlimit_as_bytes=10 * GiB, address_space_bytes=8 * GiB, available_bytes=20 * GiB)
    assert limits.headrooms() == {"physical": 20 * GiB, "cgroup": 1 * GiB, "rlimit_as": 2 * GiB}
    assert limits.binding == "cgroup" and limits.kills and limits.limit is CGROUP
    assert limits.capacity_bytes == 2 * GiB  # what it holds now plus the cgroup's headroom
    capped = HostLimits(resident_bytes=1 * GiB, rlimit_as_bytes=3 * GiB, address_space_bytes=2 * GiB,
                        available_bytes=20 * GiB)
    assert capped.binding == "rlimit_as" and not capped.kills and capped.capacity_bytes == 2 * GiB
    assert HostLimits(resident_bytes=GiB, available_bytes=5 * GiB).binding == "physical"


def test_this_process_reads_as_a_real_host():
    limits = host_limits()
    assert limits.resident_bytes == pytest.approx(resident_bytes(), rel=0.1)
    assert limits.available_bytes > 0 and limits.capacity_bytes > limits.resident_bytes


def test_rlimit_as_is_read_in_a_child():
    code = (
        "import resource; from batchpilot.memory.limits import host_limits\n"
        "resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.RLIM_INFINITY))\n"
        "l = host_limits(); print(l.rlimit_as_bytes, l.headrooms()['rlimit_as'], l.limit.name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(8 * 2**30) and int(out[1]) > 0 and out[2] == "address_space"


def test_each_kind_answers_what_follows_from_it():
    # the names reports carry: a contract (docs/cli.md)
    assert [k.name for k in (TENSORS, DEVICE, ALLOCATED, ADDRESS_SPACE, CGROUP, RESIDENT)] == [
        "tensors", "device", "allocated", "address_space", "cgroup", "resident"]
    assert [k.binding for k in (ADDRESS_SPACE, CGROUP, RESIDENT)] == ["rlimit_as", "cgroup", "physical"]
    assert TENSORS.binding is DEVICE.binding is ALLOCATED.binding is None
    assert [k for k in (TENSORS, DEVICE, ALLOCATED, ADDRESS_SPACE, CGROUP, RESIDENT) if k.tracked] == [TENSORS]
    # past a container's limit or the RAM the kernel kills; RLIMIT_AS and the devices raise
    assert [k.kills for k in (ADDRESS_SPACE, CGROUP, RESIDENT, DEVICE)] == [False, True, True, False]
    # a figure that only estimates what the kernel counts is raised by a trial that ran above it
    assert [k.estimated for k in (ADDRESS_SPACE, CGROUP, RESIDENT, TENSORS)] == [False, True, True, False]
    # a file mapped back in costs address space; a device's snapshot is host memory its figure does not see
    assert [k.spills for k in (ADDRESS_SPACE, CGROUP, RESIDENT, DEVICE, TENSORS)] == [False, True, True, False, False]
    assert host_kinds() == (RESIDENT, CGROUP, ADDRESS_SPACE)


def test_what_an_oom_bounds_depends_on_the_limit():
    cpu = parse_oom_message("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                            "memory: you tried to allocate 1048576 bytes. Error code 12 (Cannot allocate memory)")
    failed = SimpleNamespace(report=cpu, mapped_bytes=500 * MiB)
    # under RLIMIT_AS the allocation failed on what was mapped plus the request
    assert ADDRESS_SPACE.oom_bound(failed) == 500 * MiB + MiB
    # elsewhere a CPU allocator's request alone says nothing about what the process held
    assert RESIDENT.oom_bound(failed) is None and CGROUP.oom_bound(failed) is None
    assert ADDRESS_SPACE.oom_bound(SimpleNamespace(report=cpu, mapped_bytes=None)) is None
    emulated = parse_oom_message("batchpilot emulated capacity exceeded on cpu: tried to allocate 4.00 MiB "
                                 "(4194304 bytes) in aten.mm.default with 1048577 bytes live; capacity 4.50 MiB "
                                 "(4718592 bytes)")
    assert TENSORS.oom_bound(SimpleNamespace(report=emulated)) == 5 * MiB + 1  # live plus the request, exact
    assert TENSORS.oom_bound(SimpleNamespace(report=None)) is None


def test_register_refuses_what_is_not_a_new_host_kind():
    with pytest.raises(TypeError, match="HostLimit"):
        register(DEVICE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        register(HostLimit(name="resident", binding="mine", label="x"))
    with pytest.raises(ValueError, match="not a registered"):
        unregister(RESIDENT)


@dataclass(frozen=True, kw_only=True)
class Budget(HostLimit):
    """A kind of host limit the library does not have: a budget on the resident set, ``size`` bytes."""

    size: int

    def read(self) -> tuple[int, int]:
        return self.size, resident_bytes()


@pytest.fixture
def add_budget():
    """Register a :class:`Budget` ``room`` bytes above the resident set now; unregistered after the test."""
    added: list[Budget] = []

    def add(room: int) -> Budget:
        # well under any real headroom here, so that it binds; it raises nothing past it, it only counts
        kind = register(Budget(name="budget", binding="test_budget", label="a test's budget on the resident set",
                               size=resident_bytes() + room, spills=True))
        added.append(kind)
        return kind

    yield add
    for kind in added:
        unregister(kind)
    assert host_kinds() == (RESIDENT, CGROUP, ADDRESS_SPACE)


def test_a_kind_defined_here_binds_and_the_finder_and_reports_follow_it(add_budget):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(4096, 256)

    def step(b: int) -> None:
        opt.zero_grad(set_to_none=True)
        model(data[:b]).square().mean().backward()
        opt.step()

    step(2)
    budget = add_budget(24 * MiB)
    limits = host_limits()
    assert limits.binding == "test_budget" and limits.limit is budget and not limits.kills
    assert limits.headrooms()["test_budget"] <= 24 * MiB
    gauge = gauge_for(torch.device("cpu"))
    assert isinstance(gauge, HostGauge) and gauge.limit is budget and gauge.kind == "budget"
    assert gauge.capacity() == budget.size

    plan = find_batch_size(step, device="cpu", restore=(model, opt), max_batch_size=4096)
    assert plan.memory == "budget" and plan.binding_limit == "test_budget"
    assert plan.capacity == budget.size  # the budget's size, not the RAM's
    # the budget, not max_batch_size, bounds the answer
    assert plan.batch_size < 4096 and plan.stop_reason != "max_batch_size"
    at_answer = [t for t in plan.trials if t.batch_size == plan.batch_size]
    assert at_answer and at_answer[-1].peak_bytes <= plan.limit_bytes < budget.size
    record = plan_record(plan)  # what `batchpilot find --json` writes
    assert record["memory"] == "budget" and record["binding_limit"] == "test_budget"
    assert plan.to_dict()["memory"] == "budget"
    # the summary says the limit in the kind's own words, and what would raise it on a host
    assert "of a test's budget on the resident set: " in plan.limit_text() and "the test_budget limit leaves" in str(plan)
    assert "more memory for the process" in plan.to_raise()
