"""The layout: subpackages by concern, each importing only the layers the table allows.

Every import of every module is read with ``ast`` (module-level and inside functions, relative
ones included), mapped to its subpackage and checked against :data:`ALLOWED`; the module graph
and the subpackage graph have no cycle; the library never imports the app nor the integrations;
the pure policies never import torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import batchpilot
from pure import modules_loaded_alone

PACKAGE_DIR = Path(batchpilot.__file__).resolve().parent

#: bottom to top; each layer may import only those listed for it (and itself)
ALLOWED: dict[str, set[str]] = {
    "_checks": set(),  # the argument checks every layer shares: imports nothing of batchpilot
    "_progress": set(),  # what a long search writes to stderr while it runs: imports nothing of batchpilot
    "policy": {"_checks"},  # pure, torch-free decisions
    "core": {"_checks"},  # the step vocabulary: batches, loss, amp, compiled and sharded models, ranks
    "memory": {"_checks", "core"},
    "plan": {"_checks", "policy", "core", "memory"},
    "find": {"_checks", "_progress", "policy", "core", "memory", "plan"},  # plan_first seeds the finder with the planner
    "infer": {"_checks", "_progress", "policy", "core", "memory", "plan", "find"},
    "dist": {"_checks", "policy", "core", "memory", "find"},
    "train": {"_checks", "policy", "core", "memory", "find", "dist"},
    "integrations": {"_checks", "policy", "core", "memory", "find", "dist", "train", "infer"},
    # batchpilot/__init__.py, the public API (it loads the planner, dist and app.trainjob lazily by name)
    "batchpilot": {"_checks", "policy", "core", "memory", "plan", "find", "dist", "train"},
    "app": {"_checks", "_progress", "policy", "core", "memory", "plan", "find", "dist", "train", "infer", "batchpilot"},
    "__main__": {"app"},  # python -m batchpilot
}
LIBRARY = {"_checks", "_progress", "policy", "core", "memory", "plan", "find", "dist", "train", "infer"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (path, is a package)}`` for every module of the package."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ["batchpilot", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, int]]:
    """The batchpilot modules ``name`` imports anywhere in its body, with the line of each import."""
    path, is_pkg = MODULES[name]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from . import x`` imports the submodule x; ``from .m import f`` the module m
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "batchpilot":
                continue
            while target not in MODULES:  # batchpilot.x.y.attr -> batchpilot.x.y
                target = target.rpartition(".")[0]
            if target != name:
                found.append((target, node.lineno))
    return found


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "batchpilot"


EDGES = {name: _imports(name) for name in MODULES}


def test_every_module_belongs_to_a_layer_of_the_table():
    unknown = sorted(name for name in MODULES if _layer(name) not in ALLOWED)
    assert not unknown, f"modules outside the layers of ALLOWED: {unknown}; add the subpackage to the table"


def test_the_table_is_a_strict_order():
    # a layer allowed to import another that may import it back would hide a cycle
    order = list(ALLOWED)
    for layer, allowed in ALLOWED.items():
        assert layer not in allowed
        below = [a for a in allowed if order.index(a) > order.index(layer)]
        assert not below, f"{layer} may import {below}, which come later in the table"


def test_each_import_is_allowed_by_the_table():
    wrong = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {_layer(name)} imports {target} ({_layer(target)})"
        for name, (path, _) in MODULES.items()
        for target, line in EDGES[name]
        if _layer(target) != _layer(name) and _layer(target) not in ALLOWED[_layer(name)]
    ]
    assert not wrong, "imports the layer table does not allow:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules_or_subpackages():
    modules = {name: {t for t, _ in EDGES[name]} for name in MODULES}
    assert _cycles(modules) == []
    layers: dict[str, set[str]] = defaultdict(set)
    for name, targets in modules.items():
        layers[_layer(name)] |= {_layer(t) for t in targets if _layer(t) != _layer(name)}
    assert _cycles(layers) == []


def test_the_library_never_imports_the_app_nor_the_integrations():
    # statically: no import of either anywhere in the library's modules
    wrong = [(name, t) for name in MODULES if _layer(name) in LIBRARY
             for t, _ in EDGES[name] if _layer(t) in ("app", "integrations")]
    assert wrong == []
    # and at run time: importing every library module (and the public API) loads neither
    library = sorted(name for name in MODULES if _layer(name) in LIBRARY | {"batchpilot"})
    code = (
        "import importlib, sys\n"
        f"for m in {library!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(n for n in sys.modules if n.startswith(('batchpilot.app', 'batchpilot.integrations'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module", ["_checks", "_progress", *sorted(n.partition(".")[2] for n in MODULES if _layer(n) == "policy")])
def test_the_pure_policies_never_import_torch(module):
    out = modules_loaded_alone(module)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "[]", f"{module} imported {out.stdout.split()[0]}"


# ---------------------------------------------------------------------------
# Function lengths: the finder, the engine and inference read one function at a time

#: the places held to :data:`MAX_LINES` (a subpackage, or one module), relative to the package
SHORT_FUNCTIONS = ("find", "infer", "train/engine.py")
#: lines of a function there, its docstring aside (comments and blank lines count)
MAX_LINES = 60
#: ``find_batch_size``: resolve the options, run a ``Search``, return its plan
MAX_FINDER_LINES = 40


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line (decorators aside), less its docstring's."""
    count = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        count -= first.end_lineno - first.lineno + 1
    return count


def _function_lengths(rel: str) -> dict[str, int]:
    """``{"path:line name": lines}`` for every function (methods and nested ones too) under ``rel``."""
    root = PACKAGE_DIR / rel
    paths = sorted(root.rglob("*.py")) if root.is_dir() else [root]
    out = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{path.relative_to(PACKAGE_DIR).as_posix()}:{node.lineno} {node.name}"] = code_lines(node)
    return out


def test_code_lines_leave_out_the_docstring_and_count_the_rest():
    tree = ast.parse('def f(x):\n    """One line.\n\n    More.\n    """\n    # why\n\n    return x\n')
    assert code_lines(tree.body[0]) == 4  # def, the comment, the blank line, return
    assert code_lines(ast.parse("def g():\n    return 1\n").body[0]) == 2


def test_find_batch_size_resolves_options_and_runs_a_search_in_a_screen():
    found = {k: n for k, n in _function_lengths("find/finder.py").items() if k.endswith(" find_batch_size")}
    assert len(found) == 1, found
    assert max(found.values()) <= MAX_FINDER_LINES, found


def test_no_function_of_the_finder_the_engine_or_inference_is_over_the_limit():
    long = {k: n for rel in SHORT_FUNCTIONS for k, n in _function_lengths(rel).items() if n > MAX_LINES}
    assert not long, (f"functions over {MAX_LINES} lines (docstring aside): split each into well-named parts\n"
                      + "\n".join(f"{k}: {n}" for k, n in sorted(long.items())))


def test_the_readme_layout_names_every_module_of_every_subpackage():
    # the README's layout table is where a newcomer finds a module: one that is missing there is
    # missing from the map (the table is one row per subpackage, its modules in backticks)
    readme = (PACKAGE_DIR.parents[1] / "README.md").read_text()
    missing = []
    for sub in sorted(p for p in PACKAGE_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        row = next((line for line in readme.splitlines() if line.startswith(f"| `batchpilot.{sub.name}` |")), None)
        if row is None:
            missing.append(f"batchpilot.{sub.name} (no row)")
            continue
        listed = row.split("|")[2]
        for mod in sorted(sub.iterdir()):
            name = mod.stem if mod.suffix == ".py" else mod.name
            if name.startswith("_") or not (mod.suffix == ".py" or (mod / "__init__.py").exists()):
                continue
            if f"`{name}`" not in listed:
                missing.append(f"batchpilot.{sub.name}.{name}")
    assert not missing, f"README.md's Layout table does not list: {missing}"
