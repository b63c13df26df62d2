"""The noise scale and batch schedules under torchrun (2 gloo ranks) against the 1-rank path.

One launch runs every 2-rank scenario (tests/helpers/noise_worker.py); the references run the
same functions in this process. On the same global batches the 2-rank measurement equals the
1-rank accumulation path's: each rank's share (or micro-batch) is one of the 1-rank run's small
batches, and the averaged gradient is its accumulated one. Both ranks decide the same schedule.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HELPERS))
import noise_worker as nw  # noqa: E402
from dist_launch import read_result, torchrun  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("noise_dist")
    torchrun(HELPERS / "noise_worker.py", str(out), "equal", "ramp-save", env={"RAMP_SAVE": str(out / "ramp.pt")},
             timeout=180)
    return out


def _close(a, b, rel=1e-5, abs_=1e-7):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k], rel, abs_)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y, rel, abs_)
    elif isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=rel, abs=abs_)
    else:
        assert a == b


def test_both_ranks_measure_and_decide_the_same(launched):
    r0, r1 = read_result(launched, "equal_rank0.json"), read_result(launched, "equal_rank1.json")
    assert r0 == r1  # bit for bit: the local norms were summed over ranks before anyone divided


@pytest.mark.parametrize("name,two,one", nw.EQUAL_CASES, ids=[c[0] for c in nw.EQUAL_CASES])
def test_two_ranks_equal_the_one_rank_accumulation_path(launched, name, two, one):
    got = read_result(launched, "equal_rank0.json")[name]
    want = nw.run_case(one)
    assert all(s["noise"] is not None for s in got["steps"])
    small = got["steps"][0]["noise"]["small_count"]
    assert small == want["steps"][0]["noise"]["small_count"] == {"every": 4, "tokens": 8}.get(name, small)
    _close(want["steps"], got["steps"])
    _close(want["params"], got["params"])
    if name == "adaptive":
        assert len({s["global"] for s in got["steps"]}) > 1  # the schedule did move


def test_bf16_buckets_sum_the_norms_apart(launched):
    got = read_result(launched, "equal_rank0.json")["bf16"]
    want = nw.measure(mode="every", micro=16, dtype=nw.torch.bfloat16)
    for g, w in zip(got["steps"], want["steps"]):
        assert g["noise"]["small_count"] == 2
        # bf16 gradients summed over ranks round differently from one rank's accumulation
        assert g["noise"]["grad_sq"] == pytest.approx(w["noise"]["grad_sq"], rel=0.05)


def test_a_ramp_saved_on_two_ranks_resumes_on_one_exactly_once(launched):
    full = nw.run_ramp()  # one rank, uninterrupted
    two = [read_result(launched, f"ramp_rank{r}.json") for r in (0, 1)]
    rest = nw.run_ramp(resume=launched / "ramp.pt")
    assert two[0]["globals"] == two[1]["globals"]
    assert two[0]["globals"] + rest["globals"] == full["globals"]  # the same ramp, on another world size
    # every sample of each epoch once: the two ranks' shares before the save, one rank's after
    for epoch in (0, 1):
        seen = [i for rec in (*two, rest) for e, idx in rec["indices"] if e == epoch for i in idx]
        want = [i for e, idx in full["indices"] if e == epoch for i in idx]
        assert sorted(seen) == sorted(want) and len(seen) == len(set(seen))
    _close(full["params"], rest["params"])  # the same global batches: the same training
