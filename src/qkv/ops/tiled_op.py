"""The tiled backend's custom ops moved to ``qkv.ops.tiled.op`` (the tiled package); this
name still resolves for code that imported it from here."""

from .tiled.op import tiled_attention_op, usable

__all__ = ["tiled_attention_op", "usable"]
