"""The engine composes its parts through what they declare: no module of ``train/`` touches another object's privates.

Every module of ``batchpilot/train/`` is read with ``ast``. Refused: ``x._name`` where ``x`` is
not ``self`` or ``cls`` (another object's attribute; ``self.engine._search`` and
``engine._params`` included), ``getattr`` / ``hasattr`` / ``setattr`` with a private name, and
``from .m import _name`` of another batchpilot module's private. A name bound to a module
(``torch._foreach_mul_``) is a library's function, not an object's state, and is left to the
layering test. What a part needs of torch's own objects and has no public spelling for is listed
in :data:`ALLOWED` with the reason; an entry that no longer occurs fails too, so the list stays
true. Across the whole package, nothing reaches into an engine's privates (``<...>engine._x``).
"""

from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import batchpilot

PACKAGE_DIR = Path(batchpilot.__file__).resolve().parent
TRAIN = sorted((PACKAGE_DIR / "train").glob("*.py"))

#: ``(module, what)``: why it is allowed. ``what`` is the expression, or ``getattr:_name`` for a probe.
ALLOWED: dict[tuple[str, str], str] = {
    ("batching.py", "scheduler._last_lr"): "torch's LR schedulers cache get_last_lr() there; no public setter",
    ("batching.py", "hasattr:_last_lr"): "the same cache, on the schedulers that have one",
    ("batching.py", "getattr:_schedulers"): "SequentialLR / ChainedScheduler hold their children there, unexposed",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def reach_ins(source: str, modules: set[str] = frozenset()) -> list[tuple[int, str]]:
    """``(line, what)`` for each private of another object that ``source`` touches; ``modules``: names bound to modules."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            root = _root(node.value)
            if isinstance(root, ast.Name) and root.id in modules:
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            found.append((node.lineno, f"{node.func.id}:{node.args[1].value}"))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found += [(node.lineno, f"import {'.' * node.level}{node.module or ''}:{a.name}")
                      for a in node.names if _private(a.name)]
    return sorted(found)


def _module_names(path: Path) -> set[str]:
    """The module-level names of ``train/<path>`` that are bound to modules (``torch``, ``nn``, ``dist``)."""
    module = importlib.import_module(f"batchpilot.train.{path.stem}" if path.stem != "__init__" else "batchpilot.train")
    return {name for name, value in vars(module).items() if isinstance(value, types.ModuleType)}


def test_the_scan_sees_every_kind_of_reach_in():
    code = ("import torch\nfrom ..dist.distributed import _all_reduce_ints\n"
            "def f(self, engine):\n"
            "    self._mine = engine._params\n"         # 4: another object's
            "    self.engine._search(1)\n"              # 5: through an attribute
            "    e = self.engine\n    e.policy._x = 1\n"  # 7: written
            "    getattr(engine, '_start', None)\n"     # 8: probed
            "    torch._foreach_mul_([], 2)\n"          # a module's function: not an object's
            "    return self._ok, engine.__class__\n")
    assert reach_ins(code, {"torch"}) == [
        (2, "import ..dist.distributed:_all_reduce_ints"), (4, "engine._params"), (5, "self.engine._search"),
        (7, "e.policy._x"), (8, "getattr:_start"),
    ]


def test_no_part_of_the_engine_reaches_into_another_objects_privates():
    wrong, seen = [], set()
    for path in TRAIN:
        for line, what in reach_ins(path.read_text(), _module_names(path)):
            if (path.name, what) in ALLOWED:
                seen.add((path.name, what))
            else:
                wrong.append(f"train/{path.name}:{line}: {what}")
    assert not wrong, ("private attributes of another object, read or written across a part's boundary; "
                       "give the owner a public method or attribute and call that:\n" + "\n".join(wrong))
    assert seen == set(ALLOWED), f"allowed but no longer there (remove them): {sorted(set(ALLOWED) - seen)}"


def test_nothing_in_the_package_reaches_into_an_engine():
    wrong = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and ast.unparse(node.value).lower().endswith("engine")):
                wrong.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}: {ast.unparse(node)}")
    assert wrong == [], "an engine's privates used outside it:\n" + "\n".join(wrong)
