"""Sharded data-parallel training (FSDP2, ``fully_shard``) with batchpilot under torchrun.

    torchrun --standalone --nproc-per-node=2 examples/fsdp_train.py
    torchrun --standalone --nproc-per-node=2 examples/fsdp_train.py --capacity 6MiB,3MiB  # rank 1 smaller
    # two machines (or two agents on one): the same command on each, pointing at one of them
    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=job1 \\
        examples/fsdp_train.py

gloo on CPU, NCCL on GPU; without torchrun it runs as one rank. Each Linear layer is sharded with
``fully_shard``, then the whole model, the usual FSDP2 recipe. The engine sees the sharded model
and keeps the ranks in lockstep (batchpilot.dist.fsdp.FSDPCoordinator): the finder runs the same trials
on every rank and agrees after each, every micro-batch but the last skips the gradient
reduce-scatter, and a rank that runs out of memory replays its collectives so that all ranks
shrink together and retry the same batch. ``--global-batch`` is the batch over all ranks.
Checkpoint a sharded model with torch.distributed.checkpoint (not shown here).
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
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
                        help="emulate devices of these sizes, one per rank (cycled), e.g. 6MiB,3MiB")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {bd.rank()}] %(levelname)s %(name)s: %(message)s")

    device = bd.init_distributed()  # gloo on CPU, NCCL (pinned to LOCAL_RANK) on GPU
    if not bd.is_distributed():
        # fully_shard needs a process group: one rank of its own when run without torchrun
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = bd.rank(), bd.world_size()

    data = load_data()
    torch.manual_seed(0)
    model = MLP(in_features=64, width=256, depth=3).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: parameters left outside the layers, and the per-step bookkeeping
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # over the shards

    # the engine sees fully_shard and uses batchpilot.dist.fsdp.FSDPCoordinator by itself
    engine = Engine(model, optimizer, nn.CrossEntropyLoss(), global_batch_size=args.global_batch, device=device)
    coordinator = engine.coordinator
    sampler = ElasticBatchSampler(len(data), engine.per_rank_batch_size, shuffle=True, seed=0)
    loader = ElasticLoader(data, sampler)
    if rank == 0:
        print(f"{world} rank(s) on {device}, FSDP2: {engine.global_batch_size} samples per step, "
              f"{engine.per_rank_batch_size} per rank", flush=True)

    def device_memory() -> contextlib.AbstractContextManager:
        if args.capacity is None:
            return contextlib.nullcontext()
        sizes = args.capacity.split(",")
        return emulate_capacity(sizes[rank % len(sizes)], device, track=(model, optimizer))

    step = 0
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            with device_memory():
                result = engine.step((x, y))
            step += 1
            if rank == 0:
                print(f"epoch {epoch} step {step}: loss {result.loss:.4f}, micro-batch {result.micro_batch_size} "
                      f"x {result.accum_steps} accumulation x {world} rank(s), OOM retries {result.ooms}, "
                      f"limited by rank {coordinator.limited_by_rank}", flush=True)
            if args.steps is not None and step >= args.steps:
                break
        if args.steps is not None and step >= args.steps:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
