"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words"), seed 000.

An image is cut into patches, each projected to a token; a learned CLS token goes first;
learned position embeddings (one per patch and one for CLS) are added; an encoder runs over
the P + 1 tokens; the CLS output, normalised, goes to a linear classifier.

Shape alphabet: B batch, P patches, C model dim, K classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .embeddings import PatchEmbedding
from .layers import AttentionMaps, Encoder
from .transformer import _refuse_pooled_context

__all__ = ["ViT"]


class ViT(nn.Module):
    """Vision Transformer classifier.

    Args:
        image_size: Height and width of the images (an int for a square image).
        patch_size: Side of a patch; must divide both image sides.
        num_classes: K.
        embed_dim, num_heads, num_layers: C, H, layers.
        in_channels: Channels of the images.
        ffn_dim: MLP width (default ``4 * C``).
        dropout: On the embeddings and the residual branches.
        norm_first: Pre-norm (True, as ViT) or post-norm.
        attention: Attention kind (``qkv.models.attention_kinds()``); ``attention_options``
            its keyword arguments. The patches are a sequence in raster order, so ``"local"``
            windows run along rows.
        context_group: Must be None: ViT classifies from the CLS token, which one rank
            holds, after attention over every patch; refused with a ValueError (run a
            :class:`qkv.models.Encoder` with the context_group for a sharded sequence).

    Shape:
        images ``(B, in_channels, height, width)`` -> logits ``(B, K)``; the encoder sees
        ``P + 1`` tokens, ``P = (height / patch_size) * (width / patch_size)``.
    """

    def __init__(
        self,
        image_size: int | tuple[int, int],
        patch_size: int,
        num_classes: int,
        embed_dim: int,
        num_heads: int,
        num_layers: int,
        *,
        in_channels: int = 3,
        ffn_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        attention: str = "exact",
        attention_options: Mapping[str, Any] | None = None,
        context_group=None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _refuse_pooled_context("ViT", context_group)
        kw = dict(device=device, dtype=dtype)
        self.patches = PatchEmbedding(image_size, patch_size, in_channels, embed_dim, **kw)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim, **kw))
        self.positions = nn.Parameter(torch.zeros(1, self.patches.num_patches + 1, embed_dim, **kw))
        for p in (self.cls_token, self.positions):
            nn.init.normal_(p, std=0.02)
        self.dropout = nn.Dropout(dropout)
        self.encoder = Encoder(
            num_layers,
            embed_dim,
            num_heads,
            ffn_dim=ffn_dim,
            dropout=dropout,
            norm_first=norm_first,
            attention=attention,
            attention_options=attention_options,
            **kw,
        )
        self.head = nn.Linear(embed_dim, num_classes, **kw)

    @property
    def num_patches(self) -> int:
        return self.patches.num_patches

    def forward(self, images: Tensor, *, return_attention: bool = False):
        """Class logits; or ``(logits, AttentionMaps)`` with ``encoder`` filled (CLS is query
        and key 0 of every trace, patch p is position p + 1)."""
        x = self.patches(images)  # (B, P, C)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, C)
        x = self.dropout(torch.cat([cls, x], 1) + self.positions)  # (B, P + 1, C)
        x = self.encoder(x, return_attention=return_attention)  # (B, P + 1, C)
        if not return_attention:
            return self.head(x[:, 0])  # (B, K)
        x, traces = x
        return self.head(x[:, 0]), AttentionMaps(encoder=traces)
