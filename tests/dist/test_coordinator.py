"""The Coordinator protocol declares every member the engine uses; LocalCoordinator holds the defaults.

Every module of ``train/`` (the engine and the parts it composes) is read with ``ast``: every
attribute it reads or calls on its coordinator (``self.coordinator.X``, or a local name bound to
it) must be a member of :class:`Coordinator`, and nothing probes the coordinator with
``getattr`` / ``hasattr``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

import batchpilot.train as train_package
from batchpilot.dist.coordinator import Coordinator, LocalCoordinator
from batchpilot.dist.distributed import DistributedCoordinator
from batchpilot.train.engine import Engine

#: the engine and the parts it composes
TRAIN = sorted(Path(train_package.__file__).parent.glob("*.py"))


def _protocol_members() -> set[str]:
    methods = {name for name, value in vars(Coordinator).items() if callable(value) and not name.startswith("_")}
    return methods | set(Coordinator.__annotations__)


def _is_coordinator(node: ast.AST, aliases: set[str]) -> bool:
    """``self.coordinator`` (also ``engine.coordinator``), a parameter named ``coordinator``, or a local name
    or an attribute bound to it."""
    if isinstance(node, ast.Attribute) and (node.attr == "coordinator" or f".{node.attr}" in aliases):
        return True
    return isinstance(node, ast.Name) and (node.id == "coordinator" or node.id in aliases)


def _binds_coordinator(value: ast.AST) -> bool:
    """The coordinator, or a choice one of whose branches is it (``c if even else OwnSizes(c)``: a view
    of the coordinator that the engine calls in its place)."""
    if isinstance(value, ast.IfExp):
        return _binds_coordinator(value.body) or _binds_coordinator(value.orelse)
    return _is_coordinator(value, set())


def _uses(source: str) -> tuple[dict[str, list[int]], list[int]]:
    """``{member: lines}`` the source uses on its coordinator, and the lines probing it with getattr/hasattr."""
    tree = ast.parse(source)
    aliases = {t.id if isinstance(t, ast.Name) else f".{t.attr}" for node in ast.walk(tree)
               if isinstance(node, ast.Assign) and _binds_coordinator(node.value)
               for t in node.targets if isinstance(t, (ast.Name, ast.Attribute))}
    used: dict[str, list[int]] = {}
    probes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_coordinator(node.value, aliases):
            used.setdefault(node.attr, []).append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and node.args and _is_coordinator(node.args[0], aliases)):
            probes.append(node.lineno)
    return used, probes


def test_the_scan_sees_uses_aliases_and_probes():
    code = ("def f(self):\n    self.coordinator.agree(1, 2)\n    coord = self.coordinator\n"
            "    coord.total_count(3)\n    getattr(self.coordinator, 'bind', None)\n    hasattr(coord, 'x')\n"
            "def g(coordinator):\n    return hasattr(coordinator, 'sum_over_ranks') and coordinator.group\n")
    used, probes = _uses(code)
    assert used == {"agree": [2], "total_count": [4], "group": [8]} and probes == [5, 6, 8]


def test_the_scan_sees_a_view_of_the_coordinator_the_engine_calls_in_its_place():
    code = ("def f(self):\n    view = self.by = self.coordinator if even else Own(self.coordinator)\n"
            "    self.by.find_batch_size(1)\n    view.agree(2)\n    self.other.x\n")
    used, _ = _uses(code)
    assert used["find_batch_size"] == [3] and used["agree"] == [4] and "x" not in used


def test_every_member_the_engine_uses_is_declared_by_the_protocol():
    assert {p.name for p in TRAIN} >= {"engine.py", "adapt.py", "lengths.py", "noise.py"}
    every: set[str] = set()
    for path in TRAIN:
        used, probes = _uses(path.read_text())
        assert probes == [], f"train/{path.name} probes its coordinator with getattr/hasattr at lines {probes}"
        undeclared = {name: lines for name, lines in used.items() if name not in _protocol_members()}
        assert not undeclared, (f"train/{path.name} uses {undeclared} on its coordinator (name: lines), which "
                                "batchpilot.dist.coordinator.Coordinator does not declare; declare them there, "
                                "with a default in LocalCoordinator")
        every |= set(used)
    # the calls the brief of the protocol names: the scan really sees the engine's calls
    assert {"agree", "agree_oom", "agree_micro_batch", "attempt", "bind", "find_batch_size"} <= every


def test_the_base_has_every_member_and_the_coordinators_derive_from_it():
    members = _protocol_members()
    assert {"agree_batch", "attempt", "bind", "explain", "find_batch_size", "group", "lockstep",
            "set_gradient_sync", "sum_over_ranks", "sync_gradients_and_sum"} <= members
    missing = [m for m in members if not hasattr(LocalCoordinator, m)]
    assert missing == []
    # one base: the others inherit its defaults instead of writing them again
    assert issubclass(DistributedCoordinator, LocalCoordinator)
    for name in ("bind", "agree_batch", "set_gradient_sync", "attempt", "explain"):
        assert getattr(DistributedCoordinator, name) is getattr(LocalCoordinator, name), name
    assert isinstance(LocalCoordinator(), Coordinator) and isinstance(DistributedCoordinator(), Coordinator)


def test_the_docstring_states_the_call_order_of_every_method():
    doc = inspect.getdoc(Coordinator)
    methods = [m for m in _protocol_members() if callable(getattr(Coordinator, m, None))]
    assert len(methods) == 13
    assert [m for m in methods if f"``{m}(" not in doc] == []


def test_a_coordinator_outside_the_base_is_refused_with_the_fix():
    class Partial:  # the five agreements only
        world_size, defer_grad_sync = 1, False

        def agree_oom(self, oom):
            return oom

        def agree_micro_batch(self, size):
            return size

        def agree(self, oom, size):
            return oom, size

        def total_count(self, count):
            return count

        def sync_gradients(self, model):
            return None

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"Partial lacks rank, group, lockstep, oom_rank, bind, find_batch_size, agree_batch, "
                                        r"set_gradient_sync, attempt, sync_gradients_and_sum, sum_over_ranks, explain"):
        Engine(model, opt, nn.functional.mse_loss, global_batch_size=8, coordinator=Partial())


def test_the_rank_that_ran_out_is_recorded_by_both_agreements():
    # outside a process group this process is rank 0 of 1; the 2-rank case is
    # tests/dist/test_fsdp_lengths.py's hopeless launch (each rank's error names rank 1)
    for agree in (lambda c, oom: c.agree_oom(oom), lambda c, oom: c.agree(oom, 4)[0]):
        c = DistributedCoordinator()
        assert c.oom_rank is None and not agree(c, False) and c.oom_rank is None
        assert agree(c, True) and c.oom_rank == 0
        assert not agree(c, False) and c.oom_rank == 0  # the last OOM's rank stays until another
    assert LocalCoordinator().oom_rank is None and LocalCoordinator().rank == 0
