"""What a search writes while it runs (batchpilot._progress): where, when, and never an escape code."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from batchpilot import find_batch_size
from batchpilot._progress import PROGRESS_ENV, Progress, stage


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _trials(p: Progress) -> None:
    p.start("batch 8")
    p.done("batch 8: fits, 0.1s")
    p.done("batch 99: not run")  # refused: never started, still numbered
    p.note("batch size 8")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)


def test_auto_is_live_on_a_terminal_and_silent_elsewhere():
    tty, log = Terminal(), io.StringIO()
    _trials(Progress("finding", stream=tty))
    _trials(Progress("finding", stream=log))
    assert log.getvalue() == ""
    out = tty.getvalue()
    assert "\x1b" not in out
    # the running trial is drawn between carriage returns, then its result replaces it on a line of its own
    assert "\rbatchpilot:   trial 1: batch 8 ... (0s so far)\r" in out
    lines = out.replace("\r", "\n").split("\n")
    assert "batchpilot:   trial 1: batch 8: fits, 0.1s".ljust(len("batchpilot:   trial 1: batch 8 ... (0s so far)")) in lines
    assert "batchpilot:   trial 2: batch 99: not run" in lines


def test_on_writes_whole_plain_lines_off_a_terminal_and_off_writes_nothing():
    log, off = io.StringIO(), Terminal()
    _trials(Progress("finding", enabled=True, stream=log))
    _trials(Progress("finding", enabled=False, stream=off))
    assert off.getvalue() == ""
    assert log.getvalue().splitlines() == [
        "batchpilot: finding", "batchpilot:   trial 1: batch 8: fits, 0.1s",
        "batchpilot:   trial 2: batch 99: not run", "batchpilot: batch size 8"]
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()


def test_the_environment_decides_auto_and_a_stage_names_the_search(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "1")
    log = io.StringIO()
    with stage("length 512 (1 of 2)"):
        Progress("finding", stream=log)
    assert log.getvalue() == "batchpilot: length 512 (1 of 2): finding\n"
    monkeypatch.setenv(PROGRESS_ENV, "0")
    tty = Terminal()
    Progress("finding", stream=tty).note("x")
    assert tty.getvalue() == ""


def test_auto_leaves_it_to_a_logger_that_shows_the_trials_already():
    shown = logging.getLogger("batchpilot.test_progress")
    handler = logging.StreamHandler(io.StringIO())
    shown.addHandler(handler)
    shown.setLevel(logging.WARNING)
    try:
        tty = Terminal()
        Progress("finding", stream=tty, logger=shown).note("x")  # WARNING level: its INFO records are not shown
        assert tty.getvalue() != ""
        shown.setLevel(logging.INFO)
        tty = Terminal()
        Progress("finding", stream=tty, logger=shown).note("x")
        assert tty.getvalue() == ""
        Progress("finding", enabled=True, stream=tty, logger=shown).note("x")  # asked for: written anyway
        assert tty.getvalue() != ""
    finally:
        shown.removeHandler(handler)
        shown.setLevel(logging.NOTSET)


def test_a_closed_stream_does_not_stop_the_search():
    log = io.StringIO()
    p = Progress("finding", enabled=True, stream=log)
    log.close()
    p.note("still running")  # no error
    assert not p.on


def test_the_finder_says_each_trial_off_a_terminal_only_when_asked(capsys):
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(b: int) -> None:
        model(torch.randn(b, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    plan = find_batch_size(step, device="cpu", capacity="64KiB", restore=[model, opt], timed_steps=0)
    assert capsys.readouterr().err == ""  # auto, and pytest's stderr is no terminal
    plan = find_batch_size(step, device="cpu", capacity="64KiB", restore=[model, opt], timed_steps=0, progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "batchpilot: finding the batch size on cpu"
    assert "limit 51.20 KiB (80% of 64.00 KiB)" in err[1]
    trials = [line for line in err if line.startswith("batchpilot:   trial ")]
    assert len(trials) == plan.num_trials and trials[0].startswith("batchpilot:   trial 1: batch ")
    assert err[-1].startswith(f"batchpilot:   batch size {plan.batch_size} after {plan.num_trials} trials")


LIVE = """
import torch
from torch import nn
from batchpilot import find_batch_size
model = nn.Linear(8, 4)
def step(b):
    model(torch.randn(b, 8)).sum().backward()
find_batch_size(step, device="cpu", capacity="64KiB", restore=[model], timed_steps=0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal")
def test_in_a_terminal_the_first_trial_shows_within_seconds_with_no_escape_code():
    import pty

    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != PROGRESS_ENV}
    proc = subprocess.Popen([sys.executable, "-c", LIVE], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(leader)
    out = b"".join(chunks).decode()
    assert "\x1b" not in out
    assert "finding the batch size on cpu" in out and "trial 1: batch 1 ... (" in out
    assert "batch size " in out.splitlines()[-1]
