"""Data-parallel training with batchpilot under torchrun: a fixed global batch, any number of ranks.

    torchrun --standalone --nproc-per-node=2 examples/ddp_train.py
    torchrun --standalone --nproc-per-node=2 examples/ddp_train.py --capacity 1MiB,740KiB  # rank 1 smaller
    torchrun --standalone --nproc-per-node=1 examples/ddp_train.py --checkpoint ck.pt  # resume elastic

gloo on CPU, NCCL on GPU. ``--global-batch`` is the batch over all ranks, the engine's
``global_batch_size``; every rank trains on its share (``engine.per_rank_batch_size``). The
engine picks the micro-batch (the finder on every rank, then the minimum over ranks), and when
any rank runs out of memory all ranks drop the step's gradients, shrink together and retry the
same batch.
With ``--checkpoint`` the run resumes from the file if it exists (on any number of ranks: the
global batch stays, accumulation is recomputed, and the epoch continues with the unseen samples)
and writes it at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from batchpilot.app.models import MLP
from batchpilot.dist import distributed as bd
from batchpilot.memory.probes import emulate_capacity
from batchpilot.train.data import ElasticBatchSampler, ElasticLoader
from batchpilot.train.engine import Engine


def load_data() -> TensorDataset:
    """The bundled digits (scikit-learn) when installed, else a synthetic stand-in of the same shape."""
    try:
        from batchpilot.app.datasets import load_digits

        split = load_digits()
        return TensorDataset(torch.from_numpy(split.train_x), torch.from_numpy(split.train_y))
    except ImportError:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1437, 64, generator=g)
        return TensorDataset(x, (x[:, :10].argmax(dim=1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--global-batch", type=int, default=256, help="samples per optimizer step, all ranks")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps in total")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--capacity", default=None,
                        help="emulate devices of these sizes, one per rank (cycled), e.g. 1MiB,740KiB")
    parser.add_argument("--checkpoint", default=None, help="resume from this file if it exists; write it at the end")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {bd.rank()}] %(levelname)s %(name)s: %(message)s")

    device = bd.init_distributed()  # gloo on CPU, NCCL (pinned to LOCAL_RANK) on GPU
    rank, world = bd.rank(), bd.world_size()

    data = load_data()
    torch.manual_seed(0)
    model = MLP(in_features=64, width=128, depth=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = None
    if args.checkpoint and os.path.exists(args.checkpoint):
        # weights_only: the checkpoint holds tensors, numbers and strings only, nothing to unpickle
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if bd.is_distributed() else model
    # the global batch over all ranks; a value that does not divide by the world size is refused
    # with the nearest ones that do. Under torchrun the engine agrees with the other ranks by itself
    # (batchpilot.dist.distributed.DistributedCoordinator).
    engine = Engine(ddp, optimizer, nn.CrossEntropyLoss(), global_batch_size=args.global_batch, device=device)
    coordinator = engine.coordinator
    per_rank = engine.per_rank_batch_size
    sampler = ElasticBatchSampler(len(data), per_rank, shuffle=True, seed=0)
    loader = ElasticLoader(data, sampler)
    if state is not None:
        # on another world size the sampler keeps per_rank and the engine re-derives accumulation
        loader.load_state_dict(state["sampler"])
        engine.load_state_dict(state["engine"])
    start_epoch = state["epoch"] if state is not None else 0
    if rank == 0:
        print(f"{world} rank(s) on {device}: {engine.global_batch_size} samples per step, {per_rank} per rank"
              + (f", resumed at epoch {start_epoch}, sample {sampler.consumed_samples}" if state else ""), flush=True)

    def device_memory() -> contextlib.AbstractContextManager:
        if args.capacity is None:
            return contextlib.nullcontext()
        sizes = args.capacity.split(",")
        return emulate_capacity(sizes[rank % len(sizes)], device, track=(model, optimizer))

    step = 0
    epoch = start_epoch
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with device_memory():
                result = engine.step((x, y))
            step += 1
            if rank == 0:
                print(f"epoch {epoch} step {step}: loss {result.loss:.4f}, micro-batch {result.micro_batch_size} "
                      f"x {result.accum_steps} accumulation x {world} rank(s), OOM retries {result.ooms}, "
                      f"limited by rank {getattr(coordinator, 'limited_by_rank', None)}", flush=True)
            if args.steps is not None and step >= args.steps:
                break
        if args.steps is not None and step >= args.steps:
            break

    if args.checkpoint and rank == 0:
        next_epoch = epoch + 1 if sampler.exhausted else epoch  # a finished epoch is not redone
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": next_epoch,
                    "sampler": loader.state_dict(), "engine": engine.state_dict()}, args.checkpoint)
        print(f"checkpoint written to {args.checkpoint}", flush=True)
    if bd.is_distributed():
        torch.distributed.barrier()  # no rank exits while rank 0 is still writing
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
