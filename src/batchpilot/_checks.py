"""The one positive-int (and bounded-int) validator, and the lazy exports of the subpackages; torch-free,
so the pure policies use it too."""

from __future__ import annotations

import importlib
import numbers
import sys
from typing import Any, Callable

__all__ = ["check_int", "lazy_exports", "positive_int"]


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


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``names`` (name -> submodule) load on first use.

    Used by the subpackages that must not pull their heavy modules (fake tensors, torch.distributed,
    transformers) into ``import batchpilot``; a loaded name is kept in the package's namespace.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
