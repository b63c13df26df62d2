"""The one table of mixed-precision names and the autocast helper every module uses."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["AMP_DTYPES", "AMP_MODES", "amp_dtype", "autocast"]

#: Accepted spellings of ``amp=`` and the dtype each means.
AMP_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
}
#: The short names shown in help texts and JSON.
AMP_MODES: tuple[str, ...] = ("bf16", "fp16")


def amp_dtype(amp: str | torch.dtype | None) -> torch.dtype | None:
    """``None``, ``"bf16"`` / ``"fp16"`` (or their long names) or a dtype, as a dtype or ``None``.

    Raises:
        ValueError: anything else, naming the accepted values.
    """
    if amp is None:
        return None
    if isinstance(amp, torch.dtype) and amp in (torch.bfloat16, torch.float16):
        return amp
    if isinstance(amp, str) and amp.lower() in AMP_DTYPES:
        return AMP_DTYPES[amp.lower()]
    raise ValueError(f"amp must be None, 'bf16' or 'fp16' (or torch.bfloat16 / torch.float16), got {amp!r}")


def autocast(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast(device_type, dtype)``, or a no-op when ``dtype`` is ``None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
