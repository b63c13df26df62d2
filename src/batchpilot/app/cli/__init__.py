"""The ``batchpilot`` command: ``find``, ``plan`` and ``train``.

Exit status: 0 on success, 2 for a user's mistake (argparse's own status for bad syntax,
ours for values argparse cannot check and for a model that fails on the inputs it is
given), 3 when nothing fits even at batch 1. A user's mistake prints one line on stderr
and no traceback (``-vv`` adds it). Logs go to stderr (``-v`` info, ``-vv`` debug) through
the ``batchpilot`` logger only; stdout carries the result, which with ``--json`` is a
single JSON document (schemas: :mod:`batchpilot.app.report`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import re
import sys
from typing import Iterator, Sequence

from ... import __version__
from ...plan.result import PlanningError
from ...policy.search import BatchSizeError, NothingFitsError
from ...train.engine import BatchDoesNotFitError
from ..trainjob import JobError
from . import cmd_find, cmd_plan, cmd_train
from .common import UsageError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_USAGE", "EXIT_NOTHING_FITS"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NOTHING_FITS = 3

# A user's mistake, or something the user can change: one line and exit 2.
_USER_ERRORS = (UsageError, JobError, PlanningError, BatchSizeError)
_NOTHING_FITS = (NothingFitsError, BatchDoesNotFitError)

#: torch's loggers that print internals while the planner probes a model on fake tensors
#: (a failing meta kernel logs its whole traceback); the planner turns those failures into
#: a PlanningError, so below -vv they only bury its advice.
TORCH_INTERNAL_LOGGERS = (
    "torch._subclasses.fake_tensor",
    "torch.fx.experimental.symbolic_shapes",
    "torch.fx.experimental.proxy_tensor",
    "torch._dynamo",
    "torch._functorch",
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors for a mistyped command, option or choice name the near miss."""

    _argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]  # noqa: ANN001,ANN201
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]  # noqa: ANN201
        super().error(message + self._did_you_mean(message))

    def _did_you_mean(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice.group(2))
            near = difflib.get_close_matches(choice.group(1), options, n=1)
            return f"; did you mean '{near[0]}'?" if near else ""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = set(self._option_string_actions)
        commands = self._subparsers._group_actions[0].choices if self._subparsers is not None else {}
        command = next((a for a in self._argv if a in commands), None)
        if command is not None:
            known |= set(commands[command]._option_string_actions)
        hints = []
        for word in message.split(":", 1)[1].split():
            name = word.split("=", 1)[0]
            if name.startswith("--") and name not in known:
                near = difflib.get_close_matches(name, sorted(o for o in known if o.startswith("--")), n=1)
                if near:
                    hints.append(near[0])
        return f"; did you mean {', '.join(hints)}?" if hints else ""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per command."""
    parser = _Parser(
        prog="batchpilot",
        description="Pick and keep the best batch size for a PyTorch job.",
        epilog="Exit status: 0 success, 2 bad arguments or a model that fails on its inputs, 3 nothing fits "
               "even at batch size 1. Run 'batchpilot COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log to stderr: -v progress notes, -vv debugging detail")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (cmd_find, cmd_plan, cmd_train):
        module.add_parser(sub)
    return parser


@contextlib.contextmanager
def _logging(verbosity: int) -> Iterator[None]:
    """Show the ``batchpilot`` logger on stderr (not the root logger's), quieten torch's internals.

    Everything is put back on exit, so ``main`` can be called more than once in a process.
    """
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    ours = logging.getLogger("batchpilot")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    quiet = [] if verbosity >= 2 else [logging.getLogger(name) for name in TORCH_INTERNAL_LOGGERS]
    saved = ours.level, ours.propagate, [(lg, lg.level) for lg in quiet]
    ours.addHandler(handler)
    ours.setLevel(level)
    ours.propagate = False  # a root handler set up by someone else would print every line twice
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        ours.removeHandler(handler)
        ours.setLevel(saved[0])
        ours.propagate = saved[1]
        for lg, lg_level in saved[2]:
            lg.setLevel(lg_level)


def _fail(command: str, exc: BaseException, status: int) -> int:
    message = str(exc).strip()
    first = message.splitlines()[0] if message else type(exc).__name__
    print(f"batchpilot {command}: error: {first}", file=sys.stderr)
    logger.debug("the error in full (with its cause in the user's code, if any):", exc_info=exc)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 by itself on bad syntax)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # subcommands may add verbosity after the command name too
    with _logging(args.verbose + getattr(args, "sub_verbose", 0)):
        try:
            return int(args.handler(args) or EXIT_OK)
        except _NOTHING_FITS as exc:  # first: NothingFitsError is also a BatchSizeError
            return _fail(args.command, exc, EXIT_NOTHING_FITS)
        except _USER_ERRORS as exc:
            return _fail(args.command, exc, EXIT_USAGE)
        except KeyboardInterrupt:
            print(f"batchpilot {args.command}: interrupted", file=sys.stderr)
            return 130
