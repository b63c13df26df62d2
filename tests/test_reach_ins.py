"""No reach-ins: no module reads another object's private attributes, nor imports another module's private names.

The rule, read from the source with ``ast`` (as :mod:`test_layering` does):

* ``<expr>._name`` is a reach-in when ``_name`` is private (one leading underscore; dunders are
  Python's protocol, not privacy), ``<expr>`` is not ``self``, ``cls`` or ``super()`` (an object's
  own state, inherited state included), and ``_name`` is a private name that batchpilot itself
  defines somewhere: an attribute set on ``self``/``cls``, a method or class attribute, or a
  module-level name. An object of another part is then used through what it declares public,
  and a module's private function is not called from outside it as ``module._f``. The scan does
  not know types, so it keys on the name; a private name of batchpilot's own never has a home
  the reader could not find.
* ``from <a batchpilot module> import _name`` is a reach-in: the name is that module's own.
* Out of scope: the private API of third-party packages (``torch._foreach_mul_``, FSDP2's
  param groups, Lightning's loops), reached from an expression rooted in a name the module
  imported from outside batchpilot, or by a name batchpilot does not define. That is a
  compatibility question, answered where each is used (a comment naming the torch versions);
  this test holds batchpilot's parts to their declared interfaces.

An object of the same class reading ``other._x`` counts too: a part's state has one owner.
"""

from __future__ import annotations

import ast
from pathlib import Path

import batchpilot

PACKAGE_DIR = Path(batchpilot.__file__).resolve().parent
SOURCES = {path.relative_to(PACKAGE_DIR).as_posix(): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}
OWN = ("self", "cls")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(trees: list[ast.AST]) -> set[str]:
    """The private names batchpilot's source defines: ``self._x = ...``, ``def _f``, ``class _C``, ``_X = ...``."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _root(node) in OWN:
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if _private(name):
                names.add(name)
    return names


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain starts from (``torch`` for ``torch._C._x``), or ``None`` (a call, a subscript)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _third_party_names(tree: ast.AST) -> set[str]:
    """Names a module binds by importing from outside batchpilot (``torch``, ``nn``, ``dist``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.partition(".")[0] for a in node.names if not a.name.startswith("batchpilot")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("batchpilot"):
            names |= {a.asname or a.name for a in node.names}
    return names


def reach_ins(tree: ast.AST, own_names: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` of every reach-in of ``tree`` by the module docstring's rule."""
    outside = _third_party_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in own_names:
            value = node.value
            if isinstance(value, ast.Name) and value.id in OWN:
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if _root(value) in outside:
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("batchpilot")):
            found += [(node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}")
                      for a in node.names if _private(a.name)]
    return sorted(found)


def test_the_scan_sees_a_reach_in():
    # it must find what it forbids, and leave alone what it allows, or the test below could not fail
    code = (
        "import torch\n"
        "from .finder import _EMULATED, find_batch_size\n"
        "class A:\n"
        "    def __init__(self, other):\n"
        "        self._ledger = 1\n"
        "        self.coord = other\n"
        "    def f(self):\n"
        "        torch._foreach_mul_([], 2)\n"      # third party: out of scope
        "        super()._ledger\n"                 # inherited: its own
        "        x = self.coord._ledger\n"          # another object's
        "        return other._give_up, self.__dict__, scheduler._last_lr\n"  # another's; a dunder; not ours
        "def _give_up():\n"
        "    pass\n"
    )
    tree = ast.parse(code)
    assert reach_ins(tree, _defined_private_names([tree])) == [
        (2, "from .finder import _EMULATED"), (10, "self.coord._ledger"), (11, "other._give_up")]


def test_no_module_reaches_into_another_objects_private_state():
    trees = {rel: ast.parse(path.read_text(), str(path)) for rel, path in SOURCES.items()}
    own = _defined_private_names(list(trees.values()))
    wrong = [f"{rel}:{line}: {text}" for rel, tree in trees.items() for line, text in reach_ins(tree, own)]
    assert not wrong, ("private state read from outside its owner; give the owner a public method or "
                       "property (or move the fact to where both can import it):\n" + "\n".join(wrong))
