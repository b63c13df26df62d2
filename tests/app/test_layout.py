"""The two layers: the library never imports the app."""

from __future__ import annotations

import subprocess
import sys


def test_the_library_never_imports_the_app():
    skip = ["__main__", "app"]
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
