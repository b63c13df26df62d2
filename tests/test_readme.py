"""The README's Python blocks run as written, in order, in one namespace (like a notebook).

A block preceded by an HTML comment starting ``<!-- not run`` is skipped; the comment says why
and where it is tested instead.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.DOTALL)


def readme_blocks() -> list[tuple[int, str, bool]]:
    """``(line number, code, run?)`` of every Python block of README.md."""
    text = (ROOT / "README.md").read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        skipped = m.group("before").strip().startswith("<!-- not run")
        out.append((line, m.group("code"), not skipped))
    return out


def test_the_readme_has_python_blocks_and_says_why_it_skips_any():
    blocks = readme_blocks()
    assert len(blocks) >= 6
    assert sum(run for _, _, run in blocks) >= len(blocks) - 2


def test_every_readme_python_block_runs_as_written(tmp_path):
    parts = []
    for line, code, run in readme_blocks():
        if run:
            parts.append(f"# --- README.md line {line}\n__readme_line__ = {line}\n{code}\n")
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(parts))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
                               **({"PYTHONPATH": str(ROOT / "src")} if (ROOT / "src").exists() else {})})
    assert proc.returncode == 0, f"a README block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
