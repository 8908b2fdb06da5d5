"""Attention backends. Each answers ``supports(call) -> None | reason`` and ``run(call)``."""

from .base import Backend, BackendResult, BackendUnsupportedError
from .call import AttentionCall
from .reference import ReferenceBackend
from .tiled import TiledBackend
from .torch_sdpa import TorchBackend

__all__ = [
    "AttentionCall",
    "Backend",
    "BackendResult",
    "BackendUnsupportedError",
    "ReferenceBackend",
    "TiledBackend",
    "TorchBackend",
]
