"""ResilientGRPOTrainer under torchrun (2 gloo ranks, DDP): lockstep, and an OOM on one rank in each phase.

One launch (tests/helpers/trl_dist_worker.py) runs every scenario in turn: the clean run, plain
``GRPOTrainer`` (the reference), and one real ``torch.OutOfMemoryError`` on one rank in generation,
scoring, a training forward and a training backward. A rank waiting on a peer that never comes
fails the launch (the workers' process-group timeout, then the launcher's), so a hang is a failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="needs trl: pip install -e '.[integrations]'")

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
sys.path.insert(0, str(HELPERS))
from dist_launch import torchrun  # noqa: E402

from test_trl import EXACT, _relative_error  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

FAULTS = ("scoring-1", "forward-1", "backward-0", "generation-0")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trl_dist")
    torchrun(HELPERS / "trl_dist_worker.py", str(out), "clean", "trl", *FAULTS, timeout=360,
             finished=lambda stdout: '"scenario": "generation-0"' in stdout)
    return out


def _ranks(out: Path, name: str) -> list[dict]:
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_clean_run_is_trls_update_on_both_ranks(launched):
    clean, trl = _ranks(launched, "clean"), _ranks(launched, "trl")
    assert clean[0]["micro"] == clean[1]["micro"] == [3, 3, 2] and clean[0]["train_ooms"] == [0]
    assert _relative_error(clean[0]["grads"], clean[1]["grads"]) == 0.0
    assert _relative_error(clean[0]["grads"], trl[0]["grads"]) < EXACT


@pytest.mark.parametrize("name", [f for f in FAULTS if not f.startswith("generation")])
def test_oom_on_one_rank_keeps_ranks_in_step_and_the_update(launched, name):
    """The OOM fires on its rank only; both ranks finish the step with the same micro-batches and TRL's update."""
    phase, fault_rank = name.split("-")
    ranks, clean = _ranks(launched, name), _ranks(launched, "clean")
    assert [r["fired"] for r in ranks] == [[phase] if r == int(fault_rank) else [] for r in (0, 1)]
    assert all(r["steps"] == 1 for r in ranks)
    assert ranks[0]["micro"] == ranks[1]["micro"] and sum(ranks[0]["micro"]) == 8
    if phase == "scoring":
        assert ranks[int(fault_rank)]["scoring_ooms"] == 1 and ranks[0]["train_ooms"] == [0]
    else:  # every rank reruns the step smaller: the engine agrees the OOM
        assert ranks[0]["train_ooms"] == ranks[1]["train_ooms"] == [1]
    assert _relative_error(ranks[0]["grads"], ranks[1]["grads"]) == 0.0
    assert _relative_error(ranks[0]["grads"], clean[0]["grads"]) < EXACT


def test_generation_oom_on_one_rank_switches_every_rank_to_whole_groups(launched):
    """TRL's one generate call fails on rank 0: both ranks generate in sized batches of whole groups, none lost."""
    ranks = _ranks(launched, "generation-0")
    assert ranks[0]["fired"] == ["generation"] and ranks[1]["fired"] == []
    for r in ranks:
        (completions, calls, batches, ooms), = r["generation"]
        assert completions == 8 and sum(b for b, _, _ in batches) == 8 and all(b % 4 == 0 for b, _, _ in batches)
        assert ooms == 1 and calls > len(batches)  # the failed call (here or on the peer), trials, the batches
    assert _relative_error(ranks[0]["grads"], ranks[1]["grads"]) == 0.0
