"""Fixtures of the app tests."""

from __future__ import annotations

import pytest
import torch

from batchpilot.app.cli import main


@pytest.fixture
def cli(capsys):
    """Run ``main(argv)`` in this process; returns ``(status, stdout, stderr)``.

    ``main`` puts logging back itself (tests/app/test_cli.py checks); the thread count the train
    command sets is put back here.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_cli: busy shared cores, tiny models

    def call(*argv: str) -> tuple[int, str, str]:
        try:
            status = main(list(argv))
        except SystemExit as exc:  # argparse's own errors
            status = exc.code
        out, err = capsys.readouterr()
        return status, out, err

    yield call
    torch.set_num_threads(threads)
