"""A drop-in for ``torch.nn.MultiheadAttention`` that runs qkv: weights with fast kernels, no NaN.

    import qkv.torch_compat
    qkv.torch_compat.patch(model)           # every nn.MultiheadAttention in model, in place
    mha = qkv.torch_compat.MultiheadAttention(512, 8, batch_first=True)   # or build one

**This package is the one place in qkv where torch's mask polarity applies**: a bool
``key_padding_mask`` or ``attn_mask`` marks with True what may NOT be attended, exactly as in
torch. Everywhere else in qkv a bool mask means True = may attend (see ``qkv.MultiHeadAttention``).

Shape alphabet: B batch, H heads, T query length, S key length, S' = S plus one key per
``add_bias_kv`` and ``add_zero_attn``, D head dim, C embed_dim, Ck/Cv key/value channels.

The package, by job: :mod:`qkv.torch_compat.module` (the module),
:mod:`qkv.torch_compat.patching` (:func:`patch`), :mod:`qkv.torch_compat.torch_masks` (torch's
masks as qkv's) and :mod:`qkv.torch_compat.checks` (torch's input checks, in its order, with
its exception types).
"""

from __future__ import annotations

from .module import MultiheadAttention, _forward_runs_here
from .patching import patch

__all__ = ["MultiheadAttention", "patch"]

# Pickles of a patched model (``torch.save(model)``) name the class and its no-op hook by
# where they lived before this module became a package: keep those names.
MultiheadAttention.__module__ = __name__
_forward_runs_here.__module__ = __name__
