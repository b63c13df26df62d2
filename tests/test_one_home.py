"""One home per concept: "is this FSDP2?" is answered by :mod:`batchpilot.core.sharding` only,
"how many ranks?" by :mod:`batchpilot.core.ranks` only.

Every module of the package is read with ``ast`` (as :mod:`test_layering` does); a check written
a second time elsewhere fails here with the line to replace and the helper to call instead.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import batchpilot

PACKAGE_DIR = Path(batchpilot.__file__).resolve().parent
SOURCES = {path.relative_to(PACKAGE_DIR).as_posix(): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _name(node: ast.AST) -> str | None:
    """``x`` for ``x`` and ``a.b.x``; else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _fsdp_checks(tree: ast.AST) -> list[int]:
    """Lines of ``isinstance(..., FSDPModule)`` (a tuple of classes included) and of imports of ``FSDPModule``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(_name(k) == "FSDPModule" for k in kinds):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name == "FSDPModule" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_the_scan_sees_an_fsdp_check():
    # the scan itself must find what it forbids, or the tests below could not fail
    code = ("from torch.distributed.fsdp import FSDPModule\n"
            "def f(m):\n    return isinstance(m, (nn.Linear, fsdp.FSDPModule))\n")
    assert _fsdp_checks(ast.parse(code)) == [1, 3]


def test_is_fsdp_has_one_home():
    wrong = [f"{rel}:{line}" for rel, path in SOURCES.items() if rel != "core/sharding.py"
             for line in _fsdp_checks(ast.parse(path.read_text(), str(path)))]
    assert not wrong, ("FSDPModule checked outside batchpilot/core/sharding.py; call "
                       "batchpilot.core.sharding.is_fsdp (or fsdp_modules) instead:\n" + "\n".join(wrong))


def test_asking_is_fsdp_does_not_load_fsdp_at_import():
    # torch.distributed.fsdp takes seconds to import: the engine, the finder and the coordinators
    # import core.sharding at module level, so it must not load FSDP until asked
    modules = ["batchpilot.core.sharding", "batchpilot.train.engine", "batchpilot.find.front",
               "batchpilot.dist.distributed"]
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print('torch.distributed.fsdp' in sys.modules)\n"
            "from torch import nn\nfrom batchpilot.core.sharding import is_fsdp\n"
            "print(is_fsdp(nn.Sequential(nn.Linear(2, 2))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def _world_size_calls(tree: ast.AST) -> list[int]:
    """Lines of ``get_world_size(...)`` calls (``dist.``, ``torch.distributed.`` or imported bare)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _name(node.func) == "get_world_size"]


def test_the_scan_sees_a_world_size_call():
    code = "import torch.distributed as dist\nn = dist.get_world_size(g)\nm = torch.distributed.get_world_size()\n"
    assert _world_size_calls(ast.parse(code)) == [2, 3]


def test_world_size_has_one_home():
    wrong = [f"{rel}:{line}" for rel, path in SOURCES.items() if rel != "core/ranks.py"
             for line in _world_size_calls(ast.parse(path.read_text(), str(path)))]
    assert not wrong, ("torch.distributed.get_world_size called outside batchpilot/core/ranks.py; call "
                       "batchpilot.core.ranks.group_size (the process group's) or world_size "
                       "(the launcher's too) instead:\n" + "\n".join(wrong))


def _weakref_calls(tree: ast.AST) -> list[tuple[str, int]]:
    """``(enclosing class, line)`` of every ``weakref.ref`` / ``weakref.finalize`` call."""
    found = []
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [tree]:
        for node in ast.walk(cls):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("ref", "finalize") and _name(node.func.value) == "weakref"):
                found.append((getattr(cls, "name", "<module>"), node.lineno))
    # a call inside a class is also seen from the module: keep the innermost owner
    lines = {line for owner, line in found if owner != "<module>"}
    return [(owner, line) for owner, line in found if owner != "<module>" or line not in lines]


def test_one_storage_ledger():
    # a storage's death is heard in one place: the ledger the tracker and the planner share
    found = [(rel, owner, line) for rel, path in SOURCES.items()
             for owner, line in _weakref_calls(ast.parse(path.read_text(), str(path)))]
    assert found and all((rel, owner) == ("memory/tracker.py", "StorageLedger") for rel, owner, _ in found), (
        "storages counted outside batchpilot.memory.tracker.StorageLedger; charge them there: " + repr(found))
