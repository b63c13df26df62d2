"""batchpilot.core.model: a model's device and context length, the one answer every layer uses."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from batchpilot.core.model import context_length, model_device


def test_model_device_is_the_first_parameters_and_a_default_without_any():
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")
    # a model without parameters (a pure function module, or not a module at all) gets the default
    assert model_device(nn.ReLU()) == torch.device("cpu")
    assert model_device(object(), default="meta") == torch.device("meta")
    assert model_device(nn.ReLU(), default=None) is None
    assert model_device(nn.Linear(2, 2, device="meta"), default=None) == torch.device("meta")


class _Config(SimpleNamespace):
    def get_text_config(self, decoder=False):
        return self.text if decoder else self


def test_context_length_reads_the_fields_most_specific_first_and_the_text_decoder():
    assert context_length(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=96, n_ctx=32))) == 96
    assert context_length(SimpleNamespace(config=SimpleNamespace(n_positions=1024))) == 1024
    for config in (None, SimpleNamespace(), SimpleNamespace(max_position_embeddings=0),
                   SimpleNamespace(max_position_embeddings=True)):
        assert context_length(SimpleNamespace(config=config)) is None
    assert context_length(nn.Linear(2, 2)) is None
    # a multimodal config: the text decoder's positions
    multimodal = _Config(max_position_embeddings=4096, text=SimpleNamespace(max_position_embeddings=128))
    assert context_length(SimpleNamespace(config=multimodal)) == 128
