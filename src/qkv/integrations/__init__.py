"""qkv inside other libraries' models: ``qkv.integrations.transformers`` (Hugging Face).

Each integration imports its library lazily, so ``import qkv`` never needs it.
"""

import importlib as _importlib


def __getattr__(name: str):
    """``qkv.integrations.transformers`` after ``import qkv`` alone (loaded on first use)."""
    if name == "transformers":
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'qkv.integrations' has no attribute {name!r}")
