"""``make test`` runs the suite under pytest-xdist: a module-scoped launch must still happen once.

Several test files share one torchrun launch between their tests through a module-scoped fixture;
the Makefile's ``--dist`` mode must keep a file's tests on one worker, or each worker repeats it.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import xdist_thread_share

ROOT = Path(__file__).resolve().parents[1]


def make_test_xdist_options(jobs: str = "2") -> list[str]:
    """The pytest-xdist options of ``make test`` (the Makefile's ``XDIST``), with ``JOBS=jobs``."""
    line = re.search(r"^XDIST\s*=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert line, "the Makefile defines XDIST, the xdist options of make test"
    return shlex.split(line.group(1).replace("$(JOBS)", jobs))


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="needs pytest-xdist (the dev extra)")
def test_make_tests_workers_set_a_module_scoped_fixture_up_once(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's options
    (tmp_path / "test_shared.py").write_text(textwrap.dedent("""
        import os
        import uuid
        from pathlib import Path

        import pytest

        @pytest.fixture(scope="module")
        def launched():
            Path(__file__).with_name(f"setup-{os.getpid()}-{uuid.uuid4().hex}").touch()
            return os.getpid()

        @pytest.mark.parametrize("i", range(6))
        def test_uses_the_launch(launched, i):
            assert launched == os.getpid()
    """))
    (tmp_path / "test_other.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("i", range(6))
        def test_alone(i):
            pass
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *make_test_xdist_options(), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" PASSED ") == 12, proc.stdout
    setups = list(tmp_path.glob("setup-*"))
    assert len(setups) == 1, (setups, proc.stdout)
    # and the run is parallel: both workers had tests
    assert "[gw0]" in proc.stdout and "[gw1]" in proc.stdout, proc.stdout


@pytest.mark.skipif(xdist_thread_share() is None, reason="only on a pytest-xdist worker (make test)")
def test_an_xdist_worker_runs_torch_on_its_share_of_the_cores():
    assert torch.get_num_threads() == xdist_thread_share()


def test_no_two_test_modules_share_a_name():
    # the test directories are not packages: pytest imports each module by its base name, and a
    # second module of the same name stops the collection of the whole suite ("import file mismatch")
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1 and name not in ("__init__.py", "conftest.py")}
    assert not shared, f"rename one of each: {shared}"
