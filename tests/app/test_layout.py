"""The two layers: the library never imports the app, and the app's old import paths still work."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

ALIASES = {
    "batchpilot.trainjob": "batchpilot.app.trainjob",
    "batchpilot.report": "batchpilot.app.report",
    "batchpilot.datasets": "batchpilot.app.datasets",
    "batchpilot.cli": "batchpilot.app.cli",
}
# console scripts of earlier installs import it from __main__ on every run: no warning there
SILENT = {"batchpilot.cli"}


def _import_afresh(name: str):
    sys.modules.pop(name, None)  # the warning fires when the module body runs
    return importlib.import_module(name)


@pytest.mark.parametrize("old, new", sorted(ALIASES.items()))
def test_old_path_imports_the_same_names(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = _import_afresh(old)
    target = importlib.import_module(new)
    assert list(alias.__all__) == list(target.__all__) and target.__all__
    for name in target.__all__:
        assert getattr(alias, name) is getattr(target, name), name
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    if old in SILENT:
        assert deprecations == []
    else:
        assert deprecations == [f"{old} is deprecated; import {new}"]


def test_the_library_never_imports_the_app():
    skip = sorted({old.rpartition(".")[2] for old in ALIASES} | {"app", "__main__"})
    code = (
        "import importlib, pkgutil, sys, batchpilot\n"
        f"skip = {skip!r}\n"
        "for m in pkgutil.iter_modules(batchpilot.__path__, 'batchpilot.'):\n"
        "    if m.name.split('.')[1] not in skip:\n"
        "        importlib.import_module(m.name)\n"
        "print(sorted(n for n in sys.modules if n.startswith('batchpilot.app')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
