"""The one positive-int (and bounded-int) validator, and the note on a user's error; torch-free, so the
pure policies use them too."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["add_note", "check_int", "positive_int"]


def check_int(name: str, value: Any, *, minimum: int, hint: str = "", error: type[Exception] = ValueError) -> int:
    """``value`` as an int ``>= minimum``; ``True`` / ``2.5`` / ``"3"`` are refused.

    Raises:
        ValueError (or ``error``): not an int, or below ``minimum``; ``hint`` ends the message.
    """
    # bool is an Integral, but True as a size, count or rank is always a bug
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{name} must be an int, got {value!r} ({type(value).__name__}){hint}")
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}{hint}")
    return int(value)


def positive_int(name: str, value: Any, extra: str = "", *, error: type[Exception] = ValueError) -> int:
    """``value`` as an int >= 1; ``extra`` names other accepted values (the engine's ``"auto"``).

    Raises:
        ValueError (or ``error``): not a positive int.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{name} must be a positive int{extra}, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise error(f"{name} must be a positive int{extra}, got {value}")
    return int(value)


def add_note(exc: BaseException, note: str) -> None:
    """Tell where ``exc`` was raised without changing its type: ``exc.add_note(note)``.

    A user's error from inside a search keeps its type (their ``except`` still catches it) and
    gains the batch size or length it ran at. Python 3.10 has no ``add_note``: the note goes to
    ``__notes__``, as 3.11 would keep it, and is not printed.
    """
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]
