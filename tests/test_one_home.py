"""One home per concept: "is this FSDP2?" is answered by :mod:`batchpilot.core.sharding` only,
"how many ranks?" by :mod:`batchpilot.core.ranks` only; a memory figure is a
:class:`batchpilot.memory.gauge.Gauge`, and an emulated capacity is read from
:func:`batchpilot.memory.probes.emulated_capacity`.

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


def _figure_classes(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """``(name, base names, line)`` of every class named ``*Probe`` / ``*Gauge`` or defining ``capacity()``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            if node.name.endswith(("Probe", "Gauge")) or "capacity" in methods:
                found.append((node.name, [_name(b) for b in node.bases], node.lineno))
    return found


def test_the_scan_sees_a_memory_figure_class():
    code = ("class CpuProbe:\n    pass\n"
            "class Meter:\n    def capacity(self):\n        return 1\n"
            "class Limits:\n    capacity_bytes = 0\n")
    assert _figure_classes(ast.parse(code)) == [("CpuProbe", [], 1), ("Meter", [], 3)]


def test_one_memory_figure_abstraction():
    # a figure of a device's memory (current, peak since reset, capacity) is a Gauge, declared in
    # batchpilot/memory/gauge.py, all of them under the one base
    found = {rel: _figure_classes(ast.parse(path.read_text(), str(path))) for rel, path in SOURCES.items()}
    elsewhere = [f"{rel}:{line} {name}" for rel, classes in found.items() if rel != "memory/gauge.py"
                 for name, _, line in classes]
    assert not elsewhere, ("memory figures declared outside batchpilot/memory/gauge.py; make them a "
                           "batchpilot.memory.gauge.Gauge there:\n" + "\n".join(elsewhere))
    gauges = {name: bases for name, bases, _ in found["memory/gauge.py"]}
    assert gauges.pop("Gauge") == [] and gauges, "batchpilot.memory.gauge.Gauge is the one root"
    assert all(bases == ["Gauge"] for bases in gauges.values()), gauges
    assert not any(name.endswith("Probe") for name in gauges)


def _emulation_reads(tree: ast.AST) -> list[tuple[str, int]]:
    """``(how, line)`` of ``_capacity_override`` anywhere and of assignments to a gauge's ``emulated``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "_capacity_override":
            found.append(("_capacity_override", node.lineno))
        elif isinstance(node, ast.Constant) and node.value == "_capacity_override":
            found.append(("_capacity_override", node.lineno))
        elif isinstance(node, ast.Attribute) and node.attr == "emulated" and isinstance(node.ctx, ast.Store):
            found.append(("emulated =", node.lineno))
    return sorted(found, key=lambda f: f[1])


def test_the_scan_sees_an_emulation_read():
    code = "a = getattr(p, '_capacity_override', None)\nb = p._capacity_override\np.emulated = 3\nc = p.emulated\n"
    assert _emulation_reads(ast.parse(code)) == [("_capacity_override", 1), ("_capacity_override", 2), ("emulated =", 3)]


def test_the_emulated_capacity_has_one_home():
    # emulate_capacity records it, memory.probes.emulated_capacity is where everything else reads it
    wrong = [f"{rel}:{line} {how}" for rel, path in SOURCES.items()
             for how, line in _emulation_reads(ast.parse(path.read_text(), str(path)))
             if not (rel in ("memory/probes.py", "memory/gauge.py") and how == "emulated =")]
    assert not wrong, ("an emulated capacity read or recorded outside batchpilot.memory.probes; call "
                       "batchpilot.memory.probes.emulated_capacity(device) instead:\n" + "\n".join(wrong))


def _target_checks(tree: ast.AST) -> list[int]:
    """Lines of comparisons of a ``target`` (a name or an attribute) with a number: a range check written again."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_name(o) == "target" for o in operands) and any(
                    isinstance(o, ast.Constant) and type(o.value) in (int, float) for o in operands):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_sees_a_target_check():
    code = "if not 0 < target <= 1:\n    pass\nok = self.target < 0.95\nfine = target < high_water\n"
    assert _target_checks(ast.parse(code)) == [1, 3]


def test_the_target_has_one_check_and_one_default():
    # every door (FindOptions, the engine, the planner, the train job, the integrations, the command
    # line) checks a target with batchpilot.policy.search.check_target; a tighter bound is its `below=`
    wrong = [f"{rel}:{line}" for rel, path in SOURCES.items()
             for line in _target_checks(ast.parse(path.read_text(), str(path)))]
    assert not wrong, ("a target's range checked outside batchpilot.policy.search.check_target; call it "
                       "(with below= for a bound of the entry point's own):\n" + "\n".join(wrong))
    import inspect

    from batchpilot.find.options import option_default
    from batchpilot.plan.generation import plan_generation
    from batchpilot.plan.planner import plan_batch_size
    from batchpilot.policy.search import DEFAULT_TARGET

    defaults = {option_default("target")} | {inspect.signature(f).parameters["target"].default
                                              for f in (plan_batch_size, plan_generation)}
    assert defaults == {DEFAULT_TARGET}


def _model_facts(tree: ast.AST) -> list[tuple[str, int]]:
    """``(what, line)`` of a model's device or context worked out again: a function named for it,
    ``next(...parameters()).device``, or a config's context field read by name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                "model_device" in node.name or "context_length" in node.name):
            found.append((f"def {node.name}", node.lineno))
        elif (isinstance(node, ast.Attribute) and node.attr == "device" and isinstance(node.value, ast.Call)
              and _name(node.value.func) == "next" and "parameters" in ast.unparse(node.value)):
            found.append(("next(parameters()).device", node.lineno))
        elif isinstance(node, ast.Constant) and node.value in ("max_position_embeddings", "n_positions"):
            found.append((repr(node.value), node.lineno))
    return sorted(found, key=lambda f: f[1])


def test_the_scan_sees_a_model_fact():
    code = ("def _model_device(m):\n    return next(m.parameters()).device\n"
            "n = getattr(cfg, 'max_position_embeddings', None)\n")
    assert _model_facts(ast.parse(code)) == [("def _model_device", 1), ("next(parameters()).device", 2),
                                             ("'max_position_embeddings'", 3)]


def test_a_models_device_and_context_have_one_home():
    wrong = [f"{rel}:{line} {what}" for rel, path in SOURCES.items() if rel != "core/model.py"
             for what, line in _model_facts(ast.parse(path.read_text(), str(path)))]
    assert not wrong, ("a model's device or context length worked out outside batchpilot/core/model.py; call "
                       "batchpilot.core.model.model_device / context_length instead:\n" + "\n".join(wrong))
