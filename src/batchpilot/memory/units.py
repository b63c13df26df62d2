"""The units memory is spoken in: byte sizes (``"2GiB"`` and back) and device names."""

from __future__ import annotations

import re

import torch

__all__ = ["parse_bytes", "format_bytes", "resolve_device"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_KNOWN_DEVICES = ("cpu", "cuda", "xpu", "mps")


def parse_bytes(size: int | float | str) -> int:
    """Parse a byte count: ``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"2G"``, ``"1.5GB"``.

    Binary units (KiB, MiB, GiB, TiB and the bare K, M, G, T) are powers of 1024,
    decimal ones (KB, MB, GB, TB) powers of 1000.

    Raises:
        ValueError: the size is not positive or the unit is unknown.
    """
    if isinstance(size, bool):
        raise ValueError(f"a memory size must be a number of bytes or a string like '2GiB', got {size!r}")
    if isinstance(size, (int, float)):
        value = int(size)
    else:
        m = _SIZE_RE.match(str(size))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {size!r} as a memory size; use bytes or a number with a unit "
                "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '2GiB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"a memory size must be positive, got {size!r}")
    return value


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. ``'1.50 GiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def resolve_device(device: torch.device | str | int | None = None) -> torch.device:
    """Turn ``None`` / ``'cuda:1'`` / ``0`` into a ``torch.device``.

    ``None`` is the current accelerator if there is one, else the CPU.

    Raises:
        ValueError: the device type is not one of cpu, cuda, xpu, mps.
    """
    if device is None:
        acc = getattr(torch, "accelerator", None)
        cur = acc.current_accelerator() if acc is not None and acc.is_available() else None
        device = cur if cur is not None else "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"unknown device {device!r}; use one of {', '.join(_KNOWN_DEVICES)} "
            "optionally with an index, e.g. 'cuda:0'"
        ) from exc
    if dev.type not in _KNOWN_DEVICES:
        raise ValueError(f"unsupported device {device!r}; batchpilot measures {', '.join(_KNOWN_DEVICES)}")
    if dev.type != "cpu" and dev.index is None:
        backend = getattr(torch, dev.type)
        index = backend.current_device() if dev.type != "mps" and backend.is_available() else 0
        dev = torch.device(dev.type, index)
    return dev
