"""Features compose: the engine's options × batch layouts × dtypes × launch, each cell one step.

Every cell (tests/helpers/composition.py) either trains exactly, its parameters those of one plain
PyTorch step on the whole global batch from the same weights, or refuses before any work (no forward
ran, the parameters untouched) with the error that says what to do. The 2-rank cells (DDP, FSDP2)
share one torchrun launch (tests/helpers/composition_worker.py) and are judged by what each rank
wrote, not by the launch's exit code (torch 2.13's gloo can abort a finished rank at exit).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import composition as cm
import composition_worker
from dist_launch import read_result, torchrun

pytestmark = pytest.mark.timeout(300)


def _params(cells: list[cm.Cell]) -> list:
    return [pytest.param(cell, id=cell.id) for cell in cells]


@pytest.mark.parametrize("cell", _params(cm.one_process_cells()))
def test_one_process(cell):
    cm.judge(cell, cm.run_cell(cell))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    out = tmp_path_factory.mktemp("composition")
    torchrun(composition_worker.__file__, str(out), "ddp", "fsdp", timeout=280,
             finished=lambda stdout: '"scenario": "fsdp"' in stdout)
    return out


@pytest.mark.parametrize("cell", _params(cm.ddp_cells() + cm.fsdp_cells()))
def test_two_ranks(launched, cell):
    outcomes = []
    for rank in range(2):
        written = read_result(launched, f"{cell.launch}_rank{rank}.json")
        assert cell.id in written, f"rank {rank} did not get to {cell.id}"
        outcomes.append(cm.Outcome.from_json(written[cell.id]))
    for out in outcomes:
        cm.judge(cell, out)
    if outcomes[0].trained:  # the ranks hold one model: bit for bit, not only near the reference
        for a, b in zip(outcomes[0].params, outcomes[1].params):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert outcomes[0].micro_batch_sizes and len(outcomes[0].micro_batch_sizes) == len(outcomes[1].micro_batch_sizes)
