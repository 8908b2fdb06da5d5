"""``qkv.capture``: the attention weights of a whole model's forward, by module, layer and head.

::

    with qkv.capture(model, layers=[0, 5], heads=[0, 3], rows=range(8000, 8016)) as cap:
        model(x)
    cap.layer(5)[0].probs               # (B, 2, 16, S): heads 0 and 3, query rows 8000..8015
    cap.save("attn.pt"); cap2 = qkv.load_capture("attn.pt")

Every call of ``qkv.scaled_dot_product_attention`` (and ``qkv.linear_attention``; and
deformable attention, ``qkv.nn.MultiScaleDeformableAttention``, whose sampling points go to
``cap.deformable``) made while a submodule of ``model`` runs is seen, whatever called it:
qkv's own modules and models, torch modules patched by ``qkv.torch_compat``, Hugging Face
models with ``attn_implementation="qkv"``; on every backend.

* **Site**: the innermost submodule of ``model`` whose forward is running when attention is
  called (forward hooks on every submodule keep the stack of names; they are removed on exit,
  error or not). **Layer**: the order in which distinct sites first call attention during the
  capture, so in a stack of blocks layer ``i`` is block ``i``. **Call**: the n-th call of a
  site (``generate`` calls every layer once per step).
* **Cost**: a call nobody asked for (its layer is not in ``layers``) runs exactly as without
  capture, with no trace formed. A wanted call runs with ``return_trace=True``; with
  ``heads``/``rows``/``batch`` given, only those weights are computed (a fast backend's
  trace recomputes just those rows from its log-sum-exp) and kept, so the call's inputs
  are freed as usual. With none of them given, each wanted call's full ``(B, H, T, S)``
  weights are materialised and kept: bound a long sequence's capture.
* Everything kept is detached (no gradient, no autograd graph held) and the forward's
  outputs and gradients are those of an uncaptured run.

Shape alphabet: B batch, H query heads, T query length, S key length; nb, nh, nr the batch
elements, heads and query rows kept.

The package, by job: :mod:`qkv.capture.session` (:func:`capture`: the hooks that keep the
stack of sites, the recorder, the checks on exit), :mod:`qkv.capture.selection` (which
layers, batch elements, heads and rows a capture keeps, and picking them from a trace) and
:mod:`qkv.capture.captured` (:class:`Captured`, :class:`CapturedAttention`, saving and
:func:`load_capture`). Imports run session -> selection, captured.
"""

from __future__ import annotations

from .captured import Captured, CapturedAttention, CapturedDeformable, load_capture
from .session import capture

__all__ = ["Captured", "CapturedAttention", "CapturedDeformable", "capture", "load_capture"]

# Pickles (``torch.save(cap)`` of a Captured or its records, rather than ``cap.save``) name
# the classes by where they lived before this module became a package: keep those names.
for _obj in (Captured, CapturedAttention, CapturedDeformable, capture, load_capture):
    _obj.__module__ = __name__
del _obj
