"""The host's memory figures (batchpilot.memory.host): cgroup paths, the resident peak, glibc's threshold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchpilot.memory.host import ResidentPeak, cgroup_dirs, trim_host_memory

GiB = 2**30

V1 = "9:name=systemd:/\n4:memory:/kubepods/pod1/c1\n1:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n"
V1_MOUNTS = (
    "30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
    "31 25 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
)
V2 = "0::/user.slice/job.scope\n"
V2_MOUNTS = "27 22 0:24 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def test_cgroup_v1_path_and_ancestors_innermost_first():
    dirs = cgroup_dirs(V1, V1_MOUNTS)
    assert dirs == [(1, Path(p)) for p in (
        "/sys/fs/cgroup/memory/kubepods/pod1/c1", "/sys/fs/cgroup/memory/kubepods/pod1",
        "/sys/fs/cgroup/memory/kubepods", "/sys/fs/cgroup/memory")]


def test_cgroup_v2_path_and_a_namespaced_mount():
    assert cgroup_dirs(V2, V2_MOUNTS)[0] == (2, Path("/sys/fs/cgroup/user.slice/job.scope"))
    # inside a container the mount's root is the container's own cgroup
    mounts = "27 22 0:24 /user.slice/job.scope /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert cgroup_dirs(V2, mounts) == [(2, Path("/sys/fs/cgroup"))]
    assert cgroup_dirs("", V2_MOUNTS) == []


PEAK_CHILD = """
import json, resource, torch
from batchpilot.memory import host
from batchpilot.memory.host import ResidentPeak, trim_host_memory, _status_kib
def marks():
    return _status_kib("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch.ones(300 * 2**20 // 4).fill_(1)  # the process's peak, from before any window
trim_host_memory()
before = marks()
host._SAMPLER_IDLE = 0.2
peak = ResidentPeak()
seen = []
for pause in (0, 0.5):  # the second window after the sampler ended idle: a new one starts
    __import__("time").sleep(pause)
    peak.reset()
    start = peak.peak()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, written: resident, then freed
    del x
    trim_host_memory()
    seen.append(peak.peak() - start)
    peak.close()
print(json.dumps({"seen": seen, "before": before, "after": marks(), "sampled": not peak._failed}))
"""


def test_the_resident_peak_sees_a_spike_below_the_high_water_mark_and_leaves_the_mark_alone():
    # a fresh process: the kernel's mark and ru_maxrss are its own, from a 300 MiB spike before the windows
    proc = subprocess.run([sys.executable, "-c", PEAK_CHILD], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sampled"], out
    assert all(s >= 60 * 2**20 for s in out["seen"]), out  # each window saw the 64 MiB it held a moment
    assert out["after"] == out["before"], out  # VmHWM and ru_maxrss as the process left them


PIN_CHILD = """
import json, sys, torch
from batchpilot.memory.host import address_space_bytes, malloc_threshold_pinned, pin_malloc_threshold
pinned = pin_malloc_threshold() if sys.argv[1] == "pin" else False
torch.empty(8 * 2**20 // 4).fill_(1)  # freed: the dynamic threshold now sends blocks up to 8 MiB to the heap
before = address_space_bytes()
x = torch.empty(6 * 2**20 // 4).fill_(1)
del x
print(json.dumps({"pinned": pinned, "reported": malloc_threshold_pinned(), "kept": address_space_bytes() - before}))
"""


@pytest.mark.parametrize("mode", ["pin", "dynamic"])
def test_a_pinned_malloc_threshold_gives_freed_blocks_back_to_the_address_space(mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", PIN_CHILD, mode], capture_output=True, text=True, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if mode == "pin":
        assert out["pinned"] and out["reported"]
        assert out["kept"] < 2**20, out  # the 6 MiB block was a mapping of its own, unmapped when freed
    else:
        assert not out["reported"]
        assert out["kept"] >= 4 * 2**20, out  # glibc's default: it stayed in the heap, mapped


@pytest.mark.parametrize("setting, pinned", [
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, True),  # the modern spelling: no dynamic rule either
    ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, False),  # fixed, but blocks under 1 MiB stay in the heap
])
def test_pinning_is_left_to_an_environment_that_already_fixes_the_threshold(setting, pinned):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(setting)
    code = ("from batchpilot.memory.host import pin_malloc_threshold, malloc_threshold_pinned\n"
            "print(pin_malloc_threshold(), malloc_threshold_pinned())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", str(pinned)]


@pytest.mark.parametrize("environ, value", [
    ({"MALLOC_MMAP_THRESHOLD_": "1048576"}, 1048576),
    ({"MALLOC_MMAP_THRESHOLD_": "0x100000"}, 1048576),
    ({"MALLOC_MMAP_THRESHOLD_": "1048576", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, 65536),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, None),
    ({"MALLOC_MMAP_THRESHOLD_": "lots"}, None),
    ({}, None),
])
def test_the_threshold_the_environment_fixes_is_read_in_bytes(environ, value):
    from batchpilot.memory.host import env_malloc_threshold

    assert env_malloc_threshold(environ) == value


@pytest.mark.parametrize("environ, fixed", [
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold=65536"}, True),
    ({}, False),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, False),
])
def test_the_environment_fixes_the_threshold_by_either_of_glibcs_spellings(environ, fixed):
    from batchpilot.memory.host import _env_fixes_threshold

    assert _env_fixes_threshold(environ) is fixed
