"""core.ranks: the process group's size (group_size) beside the launcher's world (world_size)."""

from __future__ import annotations

import torch.distributed as dist

from batchpilot.core.ranks import group_size, world_size


def test_group_size_is_the_process_groups_not_the_launchers(monkeypatch):
    # torchrun's environment without init_process_group: world_size reads it, group_size does not
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not dist.is_initialized()
    assert (world_size(), group_size(), group_size(None)) == (4, 1, 1)

