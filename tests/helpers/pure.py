"""Import batchpilot modules in a fresh interpreter *without* the package ``__init__`` (which imports torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import batchpilot

PACKAGE_DIR = str(Path(batchpilot.__file__).parent)


def modules_loaded_alone(module: str, then: str = "") -> subprocess.CompletedProcess:
    """Run ``import <pkg>.<module>`` under a stand-in parent package; print the heavy modules it loaded.

    The stand-in has the package's ``__path__`` but runs no ``__init__``, so relative imports
    resolve and only what ``module`` itself needs is loaded. ``then`` runs afterwards with the
    module bound to ``mod``.
    """
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('bp_alone'); pkg.__path__ = [{PACKAGE_DIR!r}]; sys.modules['bp_alone'] = pkg\n"
        f"mod = importlib.import_module('bp_alone.{module}')\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
        f"{then}\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
