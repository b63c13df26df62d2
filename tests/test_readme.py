"""The README's Python blocks run as written, in order, in one namespace (like a notebook).

A block preceded by an HTML comment starting ``<!-- not run`` is skipped; the comment says why
and where it is tested instead. A block preceded by ``<!-- requires: PKG[, PKG] -->`` needs an
optional package (the integrations extra): it runs on its own, in a fresh process, and is
skipped with the reason when a package is missing.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.DOTALL)
_REQUIRES = re.compile(r"<!-- requires: (?P<packages>[\w, .-]+?) -->")


def readme_blocks() -> list[tuple[int, str, bool, tuple[str, ...]]]:
    """``(line number, code, run?, packages it requires)`` of every Python block of README.md."""
    text = (ROOT / "README.md").read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        before = m.group("before").strip()
        skipped = before.startswith("<!-- not run")
        needs = _REQUIRES.fullmatch(before)
        packages = tuple(p.strip() for p in needs.group("packages").split(",")) if needs else ()
        out.append((line, m.group("code"), not skipped, packages))
    return out


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_blocks.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
                               **({"PYTHONPATH": str(ROOT / "src")} if (ROOT / "src").exists() else {})})


def test_the_readme_has_python_blocks_and_says_why_it_skips_any():
    blocks = readme_blocks()
    assert len(blocks) >= 6
    assert sum(run for _, _, run, _ in blocks) >= len(blocks) - 2


def test_every_readme_python_block_runs_as_written(tmp_path):
    parts = []
    for line, code, run, packages in readme_blocks():
        if run and not packages:
            parts.append(f"# --- README.md line {line}\n__readme_line__ = {line}\n{code}\n")
    proc = _run("\n".join(parts), tmp_path)
    assert proc.returncode == 0, f"a README block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.mark.parametrize("line, code, packages",
                         [(line, code, packages) for line, code, run, packages in readme_blocks() if run and packages],
                         ids=lambda v: f"line{v}" if isinstance(v, int) else None)
def test_readme_blocks_that_need_an_extra_run_on_their_own(line, code, packages, tmp_path):
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"README.md line {line} needs {', '.join(missing)}: pip install -e '.[integrations]'")
    proc = _run(f"# --- README.md line {line}\n{code}\n", tmp_path)
    assert proc.returncode == 0, f"README.md line {line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
