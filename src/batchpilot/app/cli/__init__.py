"""The ``batchpilot`` command: ``find``, ``plan`` and ``train``.

Exit status: 0 on success, 2 for a bad argument (argparse's own status, and
ours for values argparse cannot check), 3 when nothing fits even at batch 1.
User errors print one line on stderr and no traceback. Logs go to stderr
(``-v`` for info, ``-vv`` for debug); stdout carries the result, which with
``--json`` is a single JSON document (schemas: :mod:`batchpilot.report`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from ...engine import BatchDoesNotFitError
from ...search import BatchSizeError, NothingFitsError
from ..trainjob import JobError
from . import cmd_find, cmd_plan, cmd_train
from .common import UsageError

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_USAGE", "EXIT_NOTHING_FITS"]

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NOTHING_FITS = 3


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per command."""
    parser = argparse.ArgumentParser(
        prog="batchpilot",
        description="Pick and keep the best batch size for a PyTorch job.",
        epilog="Exit status: 0 success, 2 bad arguments, 3 nothing fits even at batch size 1. "
               "Run 'batchpilot COMMAND --help' for the options of a command.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log to stderr: -v progress notes, -vv debugging detail")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (cmd_find, cmd_plan, cmd_train):
        module.add_parser(sub)
    return parser


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s", force=True)


def _fail(command: str, message: str) -> None:
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    print(f"batchpilot {command}: error: {first}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse exits 2 by itself on bad syntax)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # subcommands may add verbosity after the command name too
    _configure_logging(args.verbose + getattr(args, "sub_verbose", 0))
    try:
        return int(args.handler(args) or EXIT_OK)
    except (UsageError, JobError) as exc:
        _fail(args.command, str(exc))
        return EXIT_USAGE
    except NothingFitsError as exc:
        _fail(args.command, str(exc))
        return EXIT_NOTHING_FITS
    except BatchDoesNotFitError as exc:
        _fail(args.command, str(exc))
        return EXIT_NOTHING_FITS
    except BatchSizeError as exc:  # the search was asked for something impossible (bounds, strategy)
        _fail(args.command, str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"batchpilot {args.command}: interrupted", file=sys.stderr)
        return 130
