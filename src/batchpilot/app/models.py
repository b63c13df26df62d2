"""Reference models used by the CLI's defaults, the benchmarks and the tests.

They cover the three memory shapes that matter for batch sizing: a plain MLP
(activations linear in the batch), a CNN with BatchNorm (buffers and large
per-sample activations) and a transformer block (attention, quadratic in the
sequence but linear in the batch). Sizes are parameters so that the GPU
validation script can build ResNet-50-sized and GPT-2-small-sized variants. :class:`ResNet` is a
bottleneck ResNet written here (ResNet-50 by default: ``batchpilot plan --model resnet50`` plans it
without torchvision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP", "SmallCNN", "TransformerBlockModel", "ResNet", "TinyGPT", "lm_loss", "padded_lm_batch",
    "build_model", "example_batch", "MODEL_NAMES",
]


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


class _Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1 reduce, 3x3 (carries the stride), 1x1 expand x4, residual."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """Bottleneck ResNet; ``layers=(3, 4, 6, 3)``, ``widths=(64, 128, 256, 512)`` is ResNet-50 (25.6M params)."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), widths: tuple[int, ...] = (64, 128, 256, 512),
                 num_classes: int = 1000, imagenet_stem: bool = True, in_channels: int = 3) -> None:
        super().__init__()
        c = widths[0]
        if imagenet_stem:  # 7x7 stride 2 and a max-pool: 224 -> 56
            self.stem = nn.Sequential(nn.Conv2d(in_channels, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        else:  # small images keep their resolution
            self.stem = nn.Sequential(nn.Conv2d(in_channels, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c),
                                      nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        for i, (n, w) in enumerate(zip(layers, widths)):
            for j in range(n):
                blocks.append(_Bottleneck(c, w, 2 if j == 0 and i > 0 else 1))
                c = 4 * w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class _CausalBlock(nn.Module):
    """Pre-norm block with plain (unfused) causal self-attention: its scores are ``B × heads × L × L``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        att = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.norm2(h))


class TinyGPT(nn.Module):
    """A small causal language model taking Hugging Face style keyword inputs.

    ``model(input_ids=(B, L), attention_mask=(B, L) or None) -> logits (B, L, vocab)``; the
    attention is written out (not fused), so its memory has the ``B × L²`` term of a real LM
    without a fused kernel. The output head is tied to the token embedding.
    """

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 512) -> None:
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(_CausalBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        for emb in (self.embed, self.pos):  # GPT-2's scale; N(0, 1) makes the tied logits huge
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        h = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        mask = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        mask = mask.expand(b, 1, t, t)
        if attention_mask is not None:  # padded keys are never attended to
            mask = mask & attention_mask.bool()[:, None, None, :]
        mask = mask | torch.eye(t, dtype=torch.bool, device=input_ids.device)  # a pad row still attends to itself
        for block in self.blocks:
            h = block(h, mask)
        return self.norm(h) @ self.embed.weight.t()


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross entropy as ``(sum, count)`` over the labels that are not -100 (padding)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    labels = batch["labels"][:, 1:]
    total = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return total, (labels != -100).sum()


def padded_lm_batch(lengths: list[int], *, vocab: int = 256, generator: torch.Generator | None = None,
                    pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """A right-padded LM batch (``input_ids``, ``attention_mask``, ``labels`` with -100 at pads).

    Padded to the longest of ``lengths`` (or ``pad_to``), as a collate function pads each batch.
    """
    width = max(lengths) if pad_to is None else pad_to
    ids = torch.randint(1, vocab, (len(lengths), width), generator=generator)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids.masked_fill(~mask, 0)
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


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
