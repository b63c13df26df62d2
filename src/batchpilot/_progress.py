"""What a long search says while it runs, where the user is, without owning their logging.

A library cannot configure logging (that is the application's), and a search that runs for
minutes should not be silent. :class:`Progress` writes a few lines to ``sys.stderr`` itself,
beside the log records at INFO that a configured logger shows anyway:

* ``enabled=None`` (auto): on an interactive terminal or in a notebook, a line per trial, the
  running trial shown as it starts, unless the search's own logger already shows its INFO
  records (a configured handler says the same); elsewhere (a CI log, ``nohup``, a file)
  nothing: the log records are there for whoever configured a handler;
* ``True``: the same on a terminal or notebook, plain lines elsewhere;
* ``False``: nothing.

``BATCHPILOT_PROGRESS=0`` (or ``1``) in the environment decides for every ``None``. No escape
code is ever written: a running trial's line is drawn after a carriage return and followed by
another, so anything else printed meanwhile (a warning) starts at the beginning of the line and
the trial's result follows on a line of its own. Plain lines are written whole, each with its
newline.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from typing import Any, Iterator, TextIO

__all__ = ["Progress", "interactive", "stage", "PROGRESS_ENV"]

#: the environment variable that decides ``enabled=None``: ``0`` off, ``1`` on
PROGRESS_ENV = "BATCHPILOT_PROGRESS"
_PREFIX = "batchpilot: "
#: what the searches started inside :func:`stage` are part of ("length 512"), for their titles
_STAGE: contextvars.ContextVar[str] = contextvars.ContextVar("batchpilot_progress_stage", default="")


@contextlib.contextmanager
def stage(label: str) -> Iterator[None]:
    """Searches run inside say ``label`` before their title (``"length 512: finding the batch size..."``)."""
    token = _STAGE.set(label)
    try:
        yield
    finally:
        _STAGE.reset(token)


def interactive(stream: Any) -> bool:
    """True when ``stream`` is a terminal, or the output of a notebook cell (IPython's kernel)."""
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    kernel = get() if callable(get) else None
    return type(kernel).__name__ == "ZMQInteractiveShell"


def _decide(enabled: bool | None) -> bool | None:
    """``enabled`` with ``None`` read from :data:`PROGRESS_ENV` (still ``None`` when it is unset)."""
    if enabled is not None:
        return enabled
    value = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return None


class Progress:
    """The lines one search writes: a title, a line per trial, an end; see the module docstring.

    Args:
        title: what runs, e.g. ``"finding the batch size on cpu"``; written first.
        enabled: ``None`` auto, ``True`` always (plain lines off a terminal), ``False`` never.
        stream: where to write; default ``sys.stderr`` when the search starts.
        logger: the search's logger; with ``enabled=None``, nothing is written when it shows INFO
            records through a handler (they say each trial already).
    """

    def __init__(self, title: str, *, enabled: bool | None = None, stream: TextIO | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        decided = _decide(enabled)
        if decided is None and logger is not None and logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
            decided = False
        live = interactive(self.stream)
        self.live = live and decided is not False
        self.on = self.live or decided is True
        within = _STAGE.get()
        self.title = title = f"{within}: {title}" if within else title
        self.began = time.perf_counter()
        self._count = 0
        self._running = False  # a trial started and not yet done
        self._pending = ""  # the running trial's line, drawn and not yet ended (live only)
        if self.on:
            self._line(title)

    def start(self, label: str) -> None:
        """A trial begins (``label`` says what it runs, e.g. ``"batch 83"``): shown as it runs on a terminal."""
        self._count += 1
        self._running = True
        if not self.live:
            return
        text = f"{_PREFIX}  trial {self._count}: {label} ... ({self.elapsed():.0f}s so far)"
        self._write("\r" + text + "\r")
        self._pending = text

    def done(self, text: str) -> None:
        """A trial's result, one line (``text`` without the trial's number); also one that never started (refused)."""
        if not self._running:
            self._count += 1
        self._running = False
        self._line(f"  trial {self._count}: {text}")

    def note(self, text: str) -> None:
        """A line of its own (a header, the answer)."""
        self._line(text)

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def _line(self, text: str) -> None:
        if not self.on:
            return
        text = _PREFIX + text
        if self.live:
            # over the running trial's line: padded to its length, since no escape code clears it
            width = len(self._pending)
            self._write("\r" + text.ljust(width) + "\n")
        else:
            self._write(text + "\n")
        self._pending = ""

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the search goes on without it
            self.on = self.live = False
