"""Inputs of the models: token embeddings with positions, and ViT's patch embedding.

Positions index by absolute position, so a decoder fed one token at a time from a cache gets
the embedding of the position after the cached ones (``start=cache.position``), and a rank's
shard of a context-parallel sequence gets the positions it holds in the whole sequence
(``segments=``, one run or, for the balanced layout, two).

Shape alphabet: B batch, T tokens, P patches, C model dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "POSITIONS",
    "LearnedPositions",
    "PatchEmbedding",
    "SinusoidalPositions",
    "TokenEmbedding",
]


class LearnedPositions(nn.Module):
    """One learned vector per position ``0 .. max_len - 1`` (GPT, BERT, ViT).

    Shape:
        ``forward(start, length)`` -> ``(length, C)``.
    """

    def __init__(self, embed_dim: int, *, max_len: int, device=None, dtype=None) -> None:
        super().__init__()
        _check_positive("max_len", max_len)
        self.max_len = max_len
        self.weight = nn.Parameter(torch.empty(max_len, embed_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)  # GPT-2 and ViT use std 0.02

    def forward(self, start: int, length: int) -> Tensor:
        if start + length > self.max_len:
            raise ValueError(
                f"positions {start}..{start + length - 1} do not fit learned "
                f"position embeddings of max_len={self.max_len}; build the model "
                f"with max_len >= {start + length} (or positions='sinusoidal')"
            )
        return self.weight[start : start + length]  # (length, C)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids (Vaswani et al. 2017, sec. 3.5), for any position, no parameters:
    ``PE[p, 2i] = sin(p / 10000^(2i / C))``, ``PE[p, 2i + 1] = cos(p / 10000^(2i / C))``.

    Shape:
        ``forward(start, length)`` -> ``(length, C)``; C must be even.
    """

    max_len: int | None
    inv_freq: Tensor  # (C/2,) buffer

    def __init__(
        self, embed_dim: int, *, max_len: int | None = None, device=None, dtype=None
    ) -> None:
        super().__init__()
        if embed_dim % 2:
            raise ValueError(
                f"sinusoidal positions pair a sin and a cos per frequency: "
                f"embed_dim must be even, got {embed_dim}"
            )
        self.max_len = None  # any position; max_len is accepted for a common signature
        i = torch.arange(0, embed_dim, 2, dtype=torch.float64, device=device)  # (C/2,)
        inv_freq = torch.exp(-math.log(10000.0) * i / embed_dim)  # (C/2,)
        self.register_buffer(
            "inv_freq", inv_freq.to(dtype or torch.get_default_dtype()), persistent=False
        )

    def forward(self, start: int, length: int) -> Tensor:
        p = torch.arange(
            start, start + length, device=self.inv_freq.device, dtype=self.inv_freq.dtype
        )  # (length,)
        angles = p[:, None] * self.inv_freq  # (length, C/2)
        return torch.stack((angles.sin(), angles.cos()), -1).flatten(-2)  # (length, C)


POSITIONS: dict[str, type[LearnedPositions | SinusoidalPositions]] = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
}
"""The position embeddings a model's ``positions=`` names."""


class TokenEmbedding(nn.Module):
    """Token embedding plus position embedding, then dropout.

    Args:
        vocab_size: V.
        embed_dim: C.
        positions: ``"learned"`` (a table of ``max_len`` vectors) or ``"sinusoidal"``
            (Vaswani et al., any length).
        max_len: Positions of the learned table.
        dropout: On the sum.

    Shape:
        tokens ``(B, T)`` int -> ``(B, T, C)``; ``start`` is the position of the first token,
        or ``segments`` the runs ``[start, end)`` of positions the tokens hold, in order
        (their lengths sum to T).
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        *,
        positions: str = "learned",
        max_len: int = 512,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check_positive("vocab_size", vocab_size)
        _check_positive("embed_dim", embed_dim)
        if positions not in POSITIONS:
            raise ValueError(
                f"unknown positions {positions!r}; choose one of {', '.join(map(repr, POSITIONS))}"
            )
        self.tokens = nn.Embedding(vocab_size, embed_dim, device=device, dtype=dtype)
        nn.init.normal_(self.tokens.weight, std=0.02)
        self.positions = POSITIONS[positions](
            embed_dim, max_len=max_len, device=device, dtype=dtype
        )
        self.dropout = nn.Dropout(dropout)

    @property
    def max_len(self) -> int | None:
        """The most positions it embeds (None: any)."""
        return self.positions.max_len

    def forward(
        self, tokens: Tensor, *, start: int = 0, segments: list[tuple[int, int]] | None = None
    ) -> Tensor:
        x = self.tokens(tokens)  # (B, T, C)
        x = x + self.position_embeddings(tokens.shape[1], start=start, segments=segments).to(
            x.dtype
        )  # (B, T, C)
        return self.dropout(x)

    def position_embeddings(
        self, length: int, *, start: int = 0, segments: list[tuple[int, int]] | None = None
    ) -> Tensor:
        """The position embeddings of ``length`` tokens from ``start``, or of the runs
        ``segments`` (a context-parallel shard's whole-sequence positions).

        Shape:
            -> ``(length, C)``.
        """
        if segments is None:
            return self.positions(start, length)  # (length, C)
        if start or sum(b - a for a, b in segments) != length:
            raise ValueError(
                f"segments {segments} must cover the {length} tokens given, "
                f"with start=0 (got start={start})"
            )
        parts = [self.positions(a, b - a) for a, b in segments] or [self.positions(0, 0)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)  # (length, C)


class PatchEmbedding(nn.Module):
    """Split an image into non-overlapping ``patch_size`` squares and project each to C
    channels (ViT, Dosovitskiy et al. 2021): a convolution with kernel = stride = patch.

    Patches are ordered row by row (raster order).

    Args:
        image_size: Height and width (an int for a square image).
        patch_size: Side of a patch; must divide both image sides.
        in_channels: Channels of the image.
        embed_dim: C.

    Shape:
        images ``(B, in_channels, height, width)`` -> ``(B, P, C)`` with
        ``P = (height / patch_size) * (width / patch_size)``.
    """

    def __init__(
        self,
        image_size: int | tuple[int, int],
        patch_size: int,
        in_channels: int,
        embed_dim: int,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
        for name, n in (
            ("image height", height),
            ("image width", width),
            ("patch_size", patch_size),
            ("in_channels", in_channels),
        ):
            _check_positive(name, n)
        if height % patch_size or width % patch_size:
            fits = [p for p in range(1, min(height, width) + 1) if height % p == 0 == width % p]
            raise ValueError(
                f"image size {height}x{width} is not divisible by patch_size="
                f"{patch_size}; choose a patch size dividing both sides: {fits}"
            )
        self.image_size, self.patch_size = (height, width), patch_size
        self.in_channels = in_channels
        self.grid = (height // patch_size, width // patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.proj = nn.Conv2d(
            in_channels, embed_dim, patch_size, stride=patch_size, device=device, dtype=dtype
        )

    def forward(self, images: Tensor) -> Tensor:
        want = (self.in_channels, *self.image_size)
        if not isinstance(images, Tensor) or images.dim() != 4 or tuple(images.shape[1:]) != want:
            got = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
            raise ValueError(
                f"images must be (B, in_channels, height, width) = (B, {want[0]}, "
                f"{want[1]}, {want[2]}) as built, got {got}"
            )
        x = self.proj(images)  # (B, C, height / patch, width / patch)
        return x.flatten(2).transpose(1, 2)  # (B, P, C)


def _check_positive(name: str, n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
