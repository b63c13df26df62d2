"""The engine's shrink after an OOM is the same from run to run."""

from __future__ import annotations

import torch

from batchpilot.memory.probes import emulate_capacity
from batchpilot.train.engine import Engine

from engine_utils import CE, InjectOOM, batches, make, one_thread, peak_at  # noqa: F401


def _sizes(capacity: int, other_bytes: int) -> list[tuple[int, int]]:
    """``(micro-batch, OOMs)`` of 4 steps of a fresh engine: 256 samples in micro-batches of 32, an OOM in step 2.

    ``other_bytes``: memory in use besides the job (another process's on a host, a CUDA
    context, allocator caches): what differs between two runs of the same job.
    """
    model, opt = make("mlp")
    loss = InjectOOM(CE, in_step={(2, 0)})
    other = torch.zeros(other_bytes // 4)
    engine = Engine(model, opt, loss, global_batch_size=256, start=32)
    out = []
    with emulate_capacity(capacity, track=(model, opt, other)):
        for batch in batches(model, 256, 4):
            loss.begin_step()
            r = engine.step(batch)
            assert not r.pressure
            out.append((r.micro_batch_size, r.ooms))
    return out


def test_the_same_oom_shrinks_to_the_same_micro_batch_in_every_run():
    # a step at 32 peaks at 85% of the capacity: above the 0.8 target, below the 0.95 high-water
    # mark, so the memory model would say "31 fits" (and, from one run to the next, 26, 24, 22 or
    # 20, as the other memory in use moved by 1-4 KiB); the shrink is a halving whatever it reads
    capacity = int(peak_at("mlp", 256, 32) / 0.85)
    runs = [_sizes(capacity, other) for other in (0, 1024, 2048, 4096) for _ in range(2)]
    assert runs == [[(32, 0), (32, 0), (16, 1), (16, 0)]] * len(runs)
