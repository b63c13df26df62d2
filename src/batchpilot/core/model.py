"""Facts about a user's model that every layer asks: the device it is on, the context it states.

One home for each, so that the engine, the finder's front, inference and the integrations agree
(a model without parameters, a multimodal config) instead of each working it out its own way.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CONTEXT_FIELDS", "context_length", "model_device"]

#: the config fields that give a causal LM's context, most specific first
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_device(model: Any, default: torch.device | str | None = "cpu") -> torch.device | None:
    """The device of the model's first parameter; ``default`` for a model without any (or no ``parameters()``).

    ``default=None`` returns ``None`` there, for a caller that picks the device its own way.
    """
    params = getattr(model, "parameters", None)
    first = next(iter(params()), None) if callable(params) else None
    if first is not None:
        return first.device
    return None if default is None else torch.device(default)


def context_length(model: Any) -> int | None:
    """The model's context (``config.max_position_embeddings`` or its like); ``None`` if it states none.

    A multimodal or encoder-decoder config's text decoder is read (``config.get_text_config(decoder=True)``):
    its positions are those a generation runs over.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = getattr(config, "get_text_config", None)
    if callable(text):
        try:
            config = text(decoder=True)
        except TypeError:  # a config of its own whose get_text_config takes no argument
            config = text()
    for name in CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
