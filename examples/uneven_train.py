"""Uneven ranks under torchrun: each rank takes the share of the global batch its memory and speed allow.

    torchrun --standalone --nproc-per-node=2 examples/uneven_train.py --shares auto
    torchrun --standalone --nproc-per-node=2 examples/uneven_train.py --shares auto --capacity 18MiB,6MiB --pin 0,1
    torchrun --standalone --nproc-per-node=2 examples/uneven_train.py --shares 3,1
    torchrun --standalone --nproc-per-node=2 examples/uneven_train.py --shares equal   # every rank G // world

``--shares auto`` starts equal, measures each rank's samples/s at its own micro-batch and moves
the split so that the ranks finish together (every rank adopts the same shares at the same step);
``--capacity`` emulates a device of that size per rank, so a smaller rank runs a smaller
micro-batch of its own instead of holding every rank to it; ``--pin`` pins rank r to a core, so
that a co-tenant on one core (``taskset -c 1 python /work/shared/tools/cotenant.py --procs 1
--threads 1 --off 0,0``) slows that rank alone. ``--shrink-at RANK:STEP:FRACTION`` lowers that rank's
emulated capacity before STEP to what is in use plus FRACTION of what the last step's activations
took: its next micro-batch runs out of memory (the emulated allocator refuses it), every rank
retries the step, that rank alone shrinks.
The data follow the engine (``loader.set_shares(engine.shares)``): every sample once per epoch.
Rank 0 prints one JSON line at the end (samples/s over the timed steps, the shares, the OOMs);
``--record DIR`` writes each rank's samples per epoch there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from batchpilot.app.models import SmallCNN
from batchpilot.dist import distributed as bd
from batchpilot.memory.probes import emulate_capacity
from batchpilot.memory.tracker import active_tracker
from batchpilot.train.data import ElasticBatchSampler, ElasticLoader
from batchpilot.train.engine import Engine, EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=128, help="samples per optimizer step, all ranks")
    parser.add_argument("--shares", default="auto", help='"auto", "equal", or one int per rank: 3,1')
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--timed-from", type=int, default=20, help="time the steps from this one on")
    parser.add_argument("--dataset", type=int, default=2048)
    parser.add_argument("--capacity", default=None, help="emulated device size per rank, e.g. 18MiB,6MiB")
    parser.add_argument("--pin", default=None, help="pin rank r to core r of this list, e.g. 0,1")
    parser.add_argument("--shrink-at", default=None, help="RANK:STEP:FRACTION: lower that rank's capacity there")
    parser.add_argument("--record", default=None, help="write each rank's samples per epoch in this directory")
    parser.add_argument("--json", default=None, help="rank 0 also writes its result line here")
    parser.add_argument("--trace", action="store_true", help="print each step: rank, step, seconds, micro-batches")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {bd.rank()}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    device = bd.init_distributed()
    rank, world = bd.rank(), bd.world_size()
    if args.pin:
        os.sched_setaffinity(0, {int(args.pin.split(",")[rank % len(args.pin.split(","))])})

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.dataset, 3, 32, 32, generator=g)
    data = TensorDataset(x, x[:, :10, 0, 0].argmax(dim=1), torch.arange(args.dataset))
    torch.manual_seed(0)
    # a small CNN on 32 x 32 images: its activations, which grow with the micro-batch, fill the memory
    model = SmallCNN(batch_norm=False).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ddp = DDP(model) if bd.is_distributed() else model
    shares = {"auto": "auto", "equal": None}.get(args.shares)
    if args.shares not in ("auto", "equal"):
        shares = [int(s) for s in args.shares.split(",")]
    criterion = nn.CrossEntropyLoss()
    engine = Engine(ddp, optimizer, lambda m, b: criterion(m(b[0]), b[1]), global_batch_size=args.global_batch,
                    shares=shares, config=EngineConfig(grow_after=10))
    sampler = ElasticBatchSampler(len(data), engine.per_rank_batch_size, seed=0, shares=list(engine.shares)
                                  if shares is not None else None)
    loader = ElasticLoader(data, sampler)
    capacities = args.capacity.split(",") if args.capacity else None
    shrink = None
    if args.shrink_at:
        who, at, fraction = args.shrink_at.split(":")
        shrink = (int(who), int(at), float(fraction))

    seen: dict[int, list[int]] = {}
    last_peak = 0
    steps = ooms = timed_samples = 0
    timed_began = None
    history = []
    with emulate_capacity(capacities[rank % len(capacities)], track=(ddp, optimizer)) if capacities else contextlib.nullcontext():
        epoch = 0
        while steps < args.steps:
            loader.set_epoch(epoch)
            for batch in loader:
                if shrink is not None and shrink[0] == rank and shrink[1] == steps and last_peak:
                    # the memory the last step's activations took, cut to FRACTION: the same
                    # micro-batch cannot fit any more, one of half its size can
                    tracker = active_tracker(torch.device("cpu"))
                    tracker.capacity = int(tracker.live + (last_peak - tracker.live) * shrink[2])
                if steps == args.timed_from:
                    if bd.is_distributed():
                        torch.distributed.barrier()
                    timed_began = time.perf_counter()
                result = engine.step(batch)
                last_peak = result.peak_bytes
                if args.trace:
                    print(rank, steps, round(result.seconds, 3), result.samples, result.micro_batch_sizes, flush=True)
                ooms += result.ooms
                seen.setdefault(epoch, []).extend(batch[2].tolist())
                if timed_began is not None:
                    timed_samples += engine.global_batch_size
                steps += 1
                history.append(list(engine.shares))
                if shares is not None:
                    loader.set_shares(engine.shares)  # the next batch at the shares the ranks agreed on
                if steps >= args.steps:
                    break
            epoch += 1
    if bd.is_distributed():
        torch.distributed.barrier()
    elapsed = time.perf_counter() - timed_began if timed_began is not None else float("nan")
    micro = torch.zeros(world, dtype=torch.int64)
    micro[rank] = engine.micro_batch_size or 0
    if bd.is_distributed():
        torch.distributed.all_reduce(micro)  # every rank's micro-batch, for the result line
    if args.record:
        Path(args.record, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "epochs_done": epoch}))
    line = {"shares": args.shares, "final_shares": list(engine.shares), "samples_per_s": timed_samples / elapsed,
            "micro_batches": micro.tolist(), "ooms": ooms, "steps": steps, "describe": engine.describe(),
            "changes": sum(1 for a, b in zip(history, history[1:]) if a != b)}
    if rank == 0:
        print(json.dumps(line), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(line))
    if bd.is_distributed():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
