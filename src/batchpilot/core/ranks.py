"""Which rank am I, out of how many? The one place that answers, for every layer above it.

Sources, first match wins: an initialised process group, then torchrun's environment
(``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``), then SLURM's (``SLURM_PROCID`` / ``SLURM_NTASKS`` /
``SLURM_LOCALID``), else a single process (0 / 1 / 0). torchrun inside a SLURM allocation sets
its own variables, which therefore win over the allocation's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["is_distributed", "known_rank", "rank", "world_size", "group_size", "local_rank", "default_device"]

_RANK_VARS = ("RANK", "SLURM_PROCID")
_WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID")


def _launcher_int(names: tuple[str, ...], *, minimum: int) -> int | None:
    """The first of ``names`` set in the environment, as an int; ``None`` when none is set.

    Raises:
        ValueError: The variable is not an integer or is below ``minimum``.
    """
    for name in names:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={raw!r} is not an integer; fix or unset it, or pass "
                "the value explicitly"
            ) from None
        if value < minimum:
            raise ValueError(
                f"environment variable {name}={value} must be >= {minimum}; fix or unset it, or pass "
                "the value explicitly"
            )
        return value
    return None


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group is initialised (any world size)."""
    return dist.is_available() and dist.is_initialized()


def known_rank() -> int | None:
    """This process's global rank, or ``None`` when nothing reports one.

    The process group's rank, else ``$RANK`` (torchrun), else ``$SLURM_PROCID``. Use it where
    a silent 0 would be wrong (a sampler sharding over several ranks); :func:`rank` defaults to 0.

    Raises:
        ValueError: The environment variable is not an integer >= 0.
    """
    if is_distributed():
        return dist.get_rank()
    return _launcher_int(_RANK_VARS, minimum=0)


def rank() -> int:
    """This process's global rank: as :func:`known_rank`, else 0.

    Raises:
        ValueError: As :func:`known_rank`.
    """
    found = known_rank()
    return 0 if found is None else found


def world_size() -> int:
    """Number of ranks: the process group's, else ``$WORLD_SIZE``, else ``$SLURM_NTASKS``, else 1.

    Raises:
        ValueError: The environment variable is not an integer >= 1.
    """
    if is_distributed():
        return group_size()
    found = _launcher_int(_WORLD_VARS, minimum=1)
    return 1 if found is None else found


def group_size(group: Any = None) -> int:
    """Number of ranks in the process group ``group`` (``None``: the default group); 1 when none is initialised.

    Unlike :func:`world_size` it ignores the launcher's environment: the size of the group the
    collectives would run over, 1 before ``init_process_group``.
    """
    return dist.get_world_size(group) if is_distributed() else 1


def local_rank() -> int:
    """This process's rank on its node: ``$LOCAL_RANK`` (torchrun), else ``$SLURM_LOCALID``, else 0.

    torch.distributed keeps no local rank of its own, so the environment is the only source.

    Raises:
        ValueError: The environment variable is not an integer >= 0.
    """
    found = _launcher_int(_LOCAL_RANK_VARS, minimum=0)
    return 0 if found is None else found


def default_device() -> torch.device:
    """The device this rank should train on: ``cuda:<local_rank>`` when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")
