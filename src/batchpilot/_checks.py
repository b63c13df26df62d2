"""The one positive-int (and bounded-int) validator; torch-free, so the pure policies use it too."""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["check_int", "positive_int"]


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
