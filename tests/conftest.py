"""Shared fixtures and markers: CPU by default, GPU tests skipped without CUDA."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HELPERS = Path(__file__).resolve().parent / "helpers"
# tests import the helper modules (dist_common, pure, ...) by name
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))


def xdist_thread_share() -> int | None:
    """torch's CPU threads for this pytest-xdist worker (its share of the cores), or None outside xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2:
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


def pytest_configure(config):
    # make test runs a worker per core: a worker's OpenMP threads beyond its share would spin against
    # the other workers' on each tiny kernel (the reason run_cli and the cli fixture use one thread)
    share = xdist_thread_share()
    if share is not None:
        torch.set_num_threads(share)


def pytest_collection_finish(session):
    # Lightning and transformers (tests/integrations) import about 450,000 Python objects, which every
    # later gc.collect() walks: 0.7 s each on the 2-core CI machine, and batchpilot's free_memory runs
    # one at each search's start and end and after each OOM, in every test collected after them.
    # Imports never become garbage: freeze what collection created out of the collector's way.
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # Tests import more (torch.compile loads inductor and sympy: 300,000 objects more, 0.3 s on
    # every later full collection), and torch keeps caches. What is still alive once a test and
    # its fixtures are done is such state: collect the test's garbage, then freeze what is left,
    # so that each later search's collection walks only its own test's objects.
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_helper(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``tests/helpers/<script>`` in a fresh interpreter (for RLIMIT_AS caps)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(HELPERS / script), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield


@pytest.fixture
def cli(capsys):
    """Run ``batchpilot.app.cli.main(argv)`` in this process; returns ``(status, stdout, stderr)``.

    ``main`` puts logging back itself (tests/app/test_cli.py checks); the thread count the train
    command sets is put back here.
    """
    from batchpilot.app.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_cli.run_cli: busy shared cores, tiny models

    def call(*argv: str) -> tuple[int, str, str]:
        try:
            status = main(list(argv))
        except SystemExit as exc:  # argparse's own errors
            status = exc.code
        out, err = capsys.readouterr()
        return status, out, err

    yield call
    torch.set_num_threads(threads)
