"""A causal LM batchpilot never ships, and the batches a user brings it: labels -100 at the pads, no mask.

Token embedding + a learned position table (``max_positions`` long: a longer batch is an
``IndexError``) + causal self-attention layers. The loss is ``(sum, count)`` over the labels
that are not -100, the convention of Hugging Face collators.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

VOCAB = 50


class HeldOutLM(nn.Module):
    def __init__(self, *, dim: int = 16, layers: int = 2, max_positions: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(max_positions, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        width = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(width, device=input_ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(width, device=input_ids.device)
        for layer in self.layers:
            x = layer(x, src_mask=causal, is_causal=True)
        return self.head(x)


def model(**kwargs: Any) -> HeldOutLM:
    torch.manual_seed(0)
    return HeldOutLM(**kwargs)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross entropy, ``(sum, count)`` over the labels that are not -100."""
    logits = model(batch["input_ids"])[:, :-1]
    labels = batch["labels"][:, 1:]
    total = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    return total, (labels != -100).sum()


def batch(lengths: list[int], *, width: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ``{"input_ids", "labels"}``: labels -100 at the pads, and no ``attention_mask``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) if width is None else width
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g)
    real = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids.masked_fill(~real, 0)
    return {"input_ids": ids, "labels": ids.masked_fill(~real, -100)}


def batches(widths: list[int], n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """One batch per width, each padded to its longest sample as a collate function pads it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, w in enumerate(widths):
        lens = torch.randint(1, w + 1, (n,), generator=g).tolist()
        lens[i % n] = w
        out.append(batch(lens, seed=seed + i))
    return out


def plain_steps(net: nn.Module, data: list[dict[str, torch.Tensor]], lr: float = 0.1) -> nn.Module:
    """A copy of ``net`` after one plain SGD step on each whole batch: what the engine must equal."""
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for b in data:
        opt.zero_grad(set_to_none=True)
        total, count = loss(net, b)
        (total / count).backward()
        opt.step()
    return net
