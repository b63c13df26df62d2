"""FSDP2 sized by length: ``Engine(lengths=...)`` on a ``fully_shard`` model over 2 gloo ranks.

One launch (tests/helpers/fsdp_lengths_worker.py) runs a held-out causal LM (dict batches, labels
-100 at the pads, no mask, float64) whose ranks bring different long-tailed lengths: clean with
``split=True``, with rank 1's device shrunk to 30% from step 2, one OOM on one rank in a forward,
a backward, an all-gather, a reduce-scatter and a verification search (one run each), and the
finder by length on the sharded model with tracked peaks at lengths it did not fit. Every run must
equal one process taking a plain step on both ranks' samples at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HELPERS))
import fsdp_lengths_common as flc  # noqa: E402
import heldout_lm as hl  # noqa: E402
from dist_launch import read_result, torchrun  # noqa: E402

from batchpilot.plan.lengths import plan_per_length  # noqa: E402
from batchpilot.policy.lengths import LengthFit  # noqa: E402

WORKER = HELPERS / "fsdp_lengths_worker.py"

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_lengths")
    torchrun(WORKER, str(out), "split", "shrink-split", "faults", "find", timeout=400)
    return out


def _assert_exact(out: Path, name: str, steps: int) -> None:
    got = torch.load(out / f"{name}_params.pt")
    for a, b in zip(got, flc.reference(steps)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def _same_cuts(out: Path, name: str) -> list[dict]:
    """Each rank's steps; every rank ran as many micro-batches at every step, and the same OOMs."""
    ranks = [read_result(out, f"{name}_rank{r}.json")["steps"] for r in range(flc.WORLD)]
    for steps in zip(*ranks):
        assert len({len(s["sizes"]) for s in steps}) == 1, steps
        assert len({s["ooms"] for s in steps}) == 1, steps
        assert all(sum(s["sizes"]) == flc.PER_RANK for s in steps), steps
    return ranks[0]


def test_split_on_two_sharded_ranks_trains_exactly_with_as_many_micro_batches_each(launched):
    steps = _same_cuts(launched, "split")
    _assert_exact(launched, "split", flc.STEPS)
    assert all(s["ooms"] == 0 for s in steps)
    ranks = [read_result(launched, f"split_rank{r}.json") for r in range(flc.WORLD)]
    # each rank trims its own micro-batches: the widths differ between the ranks, the counts do not
    assert any(a["lengths"] != b["lengths"] for a, b in zip(ranks[0]["steps"], ranks[1]["steps"]))
    assert ranks[0]["verifications"] == ranks[1]["verifications"] == 1  # the long batch at VERIFY_STEP


def test_a_rank_whose_device_shrinks_makes_every_rank_retry_the_same_cut(launched):
    steps = _same_cuts(launched, "shrink-split")
    _assert_exact(launched, "shrink-split", flc.STEPS)
    assert sum(s["ooms"] for s in steps) >= 1  # rank 1 ran out, both retried
    limits = [[s["limit"] for s in read_result(launched, f"shrink-split_rank{r}.json")["steps"]]
              for r in range(flc.WORLD)]
    assert limits[0] == limits[1]  # one budget: rank 1's derating applied on rank 0 too
    assert limits[0] == sorted(limits[0], reverse=True) and limits[0][-1] < limits[0][0]


@pytest.mark.parametrize("index", range(len(flc.SUITE_FAULTS)))
def test_one_oom_on_one_rank_anywhere_in_a_step_ends_in_the_same_retry_and_exact_training(launched, index):
    rank_at, kind, step, _, split = flc.SUITE_FAULTS[index]
    name = f"fault{index}"
    _same_cuts(launched, name)
    _assert_exact(launched, name, flc.FAULT_STEPS)
    fired = read_result(launched, f"{name}_rank{rank_at}.json")["fired"]
    assert fired is not None and fired["kind"] == kind, fired  # the OOM was injected where asked
    other = read_result(launched, f"{name}_rank{1 - rank_at}.json")
    assert other["fired"] is None and other["error"] is None


def test_finder_by_length_on_a_sharded_model_runs_in_lockstep_and_restores(launched):
    ranks = [read_result(launched, f"find_rank{r}.json") for r in range(flc.WORLD)]
    assert ranks[0]["per_length"] == ranks[1]["per_length"]  # the same answer on both ranks
    assert ranks[0]["trials"] == ranks[1]["trials"]  # the same trials, agreed after each
    assert all(r["restored"] for r in ranks)
    per_length = {int(k): v for k, v in ranks[0]["per_length"].items()}
    assert list(per_length) == list(flc.TABLE)
    assert all(a > b for a, b in zip(list(per_length.values()), list(per_length.values())[1:]))


def test_world_2_length_models_match_the_real_two_rank_peak_at_lengths_they_did_not_fit(launched):
    found = read_result(launched, "find_rank0.json")
    planned = plan_per_length(flc.build(), flc.example(), lengths=flc.TABLE, capacity="3MiB", world_size=2,
                              sharding="fsdp2", optimizer=lambda ps: torch.optim.SGD(ps, lr=flc.LR),
                              loss_fn=hl.loss, max_batch_size=64)
    fits = {"finder": LengthFit.from_state(found["fit"]), "planner": planned.fit}
    for r in range(flc.WORLD):
        peaks = read_result(launched, f"find_rank{r}.json")["peaks"]
        assert [L for _, L, _, _ in peaks] == list(flc.PEAK_LENGTHS)
        for b, L, peak, race in peaks:
            assert L not in found["fitted"] and L not in planned.plans
            assert b >= 1 and peak <= found["capacity"], (b, L, peak)  # the budget's answer runs
            # no counted storage is freed on gloo's worker thread (the tracker runs collectives on
            # copies), so the real peak is one figure, the same in every run
            assert race == 0, (b, L, peak, race)
            for name, fit in fits.items():
                assert abs(fit.peak(b, L) / peak - 1) <= 0.02, (name, b, L, fit.peak(b, L), peak)
    # the sharded plan's fixed term holds the all-gathered (unsharded) parameters at every length
    for L, p in planned.plans.items():
        est = p.estimate
        assert est.unsharded_parameters > 0, L
        assert planned.fit.fixed_bytes(L) >= est.parameters + est.unsharded_parameters, L


def test_a_rank_too_small_for_one_sample_ends_every_rank_naming_it(tmp_path):
    # rank 1's device shrinks to a tenth from step 2 (under one sample's step): both ranks stop
    # with the same error naming rank 1 and the micro-batch, before the process group's timeout
    # (a rank left waiting in a collective would end there, with the backend's error instead)
    import time

    pg_timeout = 300  # far above a launch on a loaded machine, so only a hang reaches it
    began = time.perf_counter()
    with pytest.raises(AssertionError) as failed:
        torchrun(WORKER, str(tmp_path), "hopeless", timeout=pg_timeout + 120, env={"PG_TIMEOUT_S": str(pg_timeout)})
    assert time.perf_counter() - began < pg_timeout
    for rank in range(flc.WORLD):
        r = read_result(tmp_path, f"hopeless_rank{rank}.json")
        assert r["error"] == "BatchDoesNotFitError", (rank, r, str(failed.value)[-3000:])
        assert r["message"].startswith("out of memory at a micro-batch of 1 sample on cpu"), r
        named = "rank 1: batchpilot emulated capacity exceeded" if rank == 1 else "rank 1 ran out of memory"
        assert named in r["message"], r
