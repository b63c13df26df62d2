"""The engine under a real allocator OOM (RLIMIT_AS in a subprocess)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import run_helper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps need Linux")


@pytest.mark.slow
def test_fifty_steps_under_an_address_space_cap():
    out = json.loads(run_helper("engine_rlimit.py").stdout.strip().splitlines()[-1])
    results = out["results"]
    assert out["optimizer_steps"] == 50 and len(results) == 50
    assert all(r["samples"] == 1024 for r in results)  # 50 x 1024 samples seen
    assert all(out["exact_once"])  # each update used every sample of its batch exactly once
    assert results[0]["ooms"] >= 1  # the global batch did not fit: real DefaultCPUAllocator errors
    assert all(r["micro"] < 1024 for r in results)
    assert all(r["loss"] == r["loss"] for r in results)  # no NaN
    assert out["rss_last"] - out["rss_first"] < 64 * 2**20  # nothing of the failed attempts leaked
