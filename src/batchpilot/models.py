"""Small reference models used by the CLI's defaults, the benchmarks and the tests.

They cover the three memory shapes that matter for batch sizing: a plain MLP
(activations linear in the batch), a CNN with BatchNorm (buffers and large
per-sample activations) and a transformer block (attention, quadratic in the
sequence but linear in the batch). Sizes are parameters so that the GPU
validation script can build ResNet-50-sized and GPT-2-small-sized variants.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MLP", "SmallCNN", "TransformerBlockModel", "build_model", "example_batch", "MODEL_NAMES"]


class MLP(nn.Module):
    """Flatten, then ``depth`` hidden ReLU layers of ``width`` units."""

    def __init__(self, in_features: int = 64, width: int = 256, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        d = in_features
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stages with stride-2 downsampling, global pooling and a linear head."""

    def __init__(
        self, in_channels: int = 3, widths: tuple[int, ...] = (16, 32, 64), num_classes: int = 10, batch_norm: bool = True
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for i, w in enumerate(widths):
            layers.append(nn.Conv2d(c, w, 3, stride=1 if i == 0 else 2, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(w))
            layers.append(nn.ReLU())
            c = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class TransformerBlockModel(nn.Module):
    """Token embedding, ``layers`` pre-norm transformer blocks, and a classifier on the mean token."""

    def __init__(
        self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 1, seq_len: int = 32, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(h).mean(dim=1))


MODEL_NAMES = ("mlp", "cnn", "transformer")


def build_model(name: str, **kwargs) -> nn.Module:
    """Build a reference model by name (``mlp``, ``cnn``, ``transformer``).

    Raises:
        ValueError: unknown name.
    """
    table = {"mlp": MLP, "cnn": SmallCNN, "transformer": TransformerBlockModel}
    if name not in table:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return table[name](**kwargs)


def example_batch(model: nn.Module, batch_size: int, *, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(inputs, targets)`` batch of the right shape for a reference model."""
    if isinstance(model, MLP):
        x = torch.randn(batch_size, model.net[1].in_features, generator=generator)
        classes = model.net[-1].out_features
    elif isinstance(model, SmallCNN):
        x = torch.randn(batch_size, model.features[0].in_channels, 32, 32, generator=generator)
        classes = model.head.out_features
    elif isinstance(model, TransformerBlockModel):
        x = torch.randint(0, model.embed.num_embeddings, (batch_size, model.seq_len), generator=generator)
        classes = model.head.out_features
    else:
        raise TypeError(f"no example batch for {type(model).__name__}; pass your own batch")
    y = torch.randint(0, classes, (batch_size,), generator=generator)
    return x.to(device), y.to(device)
