"""Hugging Face transformers on qkv: ``attn_implementation="qkv"``.

::

    import qkv.integrations.transformers as qkv_hf
    qkv_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_config(config, attn_implementation="qkv")
    model.set_attn_implementation("qkv")                # or switch a loaded model
    out = model(ids, attention_mask=pad, output_attentions=True)   # weights, from the lse

Every transformers model that dispatches through ``AttentionInterface`` (transformers 5.x:
Llama, Mistral, Qwen2, GPT-2, BERT, BART, T5, ViT and most others) then runs its attention on
qkv. :func:`register` registers both halves transformers needs: the attention function and
the mask builder (``AttentionMaskInterface``; a name registered only as an attention function
gets ``attention_mask=None`` and silently ignores padding).

What the models pass is mapped onto qkv's vocabulary, so nothing ``(T, S)``-sized is built:

* causal masks (``module.is_causal``, transformers' causal mask with its KV-cache offsets) and
  the sliding windows of Mistral/Qwen2-style models become ``qkv.masks`` windows, which the
  tiled backend skips block by block; plain top-left causal stays ``is_causal=True`` for
  torch's kernels;
* padding becomes a ``(B, 1, 1, S)`` bool mask; a query row with no real key (left padding
  under a causal mask) outputs 0, never NaN;
* GQA (``enable_gqa``), ``scaling``, ``dropout`` in training, T5's ``position_bias`` (an
  added float mask) and Gemma-style ``softcap`` (``qkv.masks.softcap``);
* any other mask transformers builds (chunked, packed sequences, image-token blocks) runs as
  a structured mask evaluated per block, exactly.

The mask the models receive is an :class:`HFMaskTensor`: to model code that reads it (slices
it, adds it to scores, asks its dtype) it is the 4-D float mask of transformers' eager path,
formed on that first read; qkv's attention function reads its description and forms nothing.
Model code that writes into it (``mask[..., 0] = min``, ``masked_fill_``) changes what qkv's
attention reads, in that layer and the next, as in eager.

``output_attentions=True`` returns the weights ``exp(scores - lse)`` recomputed from the fast
kernel's log-sum-exp, only when asked (transformers' own ``sdpa`` returns none).

Deformable attention does not go through the ``AttentionInterface``: Deformable DETR, Grounding
DINO and every model with transformers' ``MultiScaleDeformableAttention`` class sample with
``grid_sample`` whatever ``attn_implementation`` says. :func:`register` routes that class to
:func:`qkv.deformable_attention` too (for every model, whatever its ``attn_implementation``),
and :func:`unregister` of the last name gives it its own forward back.

Laid out by job: :mod:`.attention` (the attention function and every keyword's decision),
:mod:`.masks` (the mask models receive and its mapping onto qkv masks), :mod:`.tables`
(models with their own tables of attention classes), :mod:`.deformable`
(``MultiScaleDeformableAttention`` on qkv's kernel).

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim.
"""

from __future__ import annotations

import functools

from . import deformable
from .attention import KEYWORDS_IGNORED_AS_EAGER, KEYWORDS_IMPLEMENTED, attention_forward
from .masks import HFMask, HFMaskTensor, build_mask
from .tables import refuse_in_own_tables, withdraw_from_own_tables

__all__ = [
    "KEYWORDS_IGNORED_AS_EAGER",
    "KEYWORDS_IMPLEMENTED",
    "SUPPORTED_VERSIONS",
    "HFMask",
    "HFMaskTensor",
    "attention_forward",
    "build_mask",
    "register",
    "registered",
    "unregister",
]

# transformers >= 5.3, < 6 (tested: 5.3.0 and 5.23.0). 5.3 is the first whose models report
# output_attentions to the attention function (through its output recorder).
SUPPORTED_VERSIONS = ((5, 3), (6, 0))

_MISSING = object()
# name -> what transformers' two interfaces held under it before the first register(name)
_BEFORE: dict[str, tuple[object, object]] = {}


def register(name: str = "qkv", *, backend: str = "auto") -> str:
    """Make ``attn_implementation=name`` run transformers models on qkv.

    Registers :func:`attention_forward` in transformers' ``AttentionInterface`` and
    :func:`build_mask` in its ``AttentionMaskInterface`` under ``name``, and routes
    transformers' ``MultiScaleDeformableAttention`` (Deformable DETR, Grounding DINO, ...) to
    :func:`qkv.deformable_attention` (see :mod:`.deformable`). Calling it again re-registers
    (e.g. with another ``backend``); :func:`unregister` undoes it.

    Args:
        name: The attention implementation's name.
        backend: The qkv backend the calls use (``"auto"``, ``"tiled"``, ``"torch"``,
            ``"reference"``).

    Returns:
        ``name``, to pass as ``attn_implementation``.
    """
    tf = _import_transformers()
    from transformers.masking_utils import AttentionMaskInterface

    if name not in _BEFORE:
        _BEFORE[name] = (
            tf.AttentionInterface._global_mapping.get(name, _MISSING),
            AttentionMaskInterface._global_mapping.get(name, _MISSING),
        )
    tf.AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, build_mask)
    refuse_in_own_tables(name)
    deformable.route()
    return name


def unregister(name: str = "qkv") -> None:
    """Undo :func:`register` of ``name``: transformers' two interfaces hold under ``name`` what
    they held before (nothing, usually), the models with their own attention tables lose the
    entry, and with the last name unregistered ``MultiScaleDeformableAttention`` gets its own
    forward back and the import finder leaves ``sys.meta_path``.

    Raises:
        ValueError: ``name`` is not registered by :func:`register`.
    """
    if name not in _BEFORE:
        raise ValueError(
            f"unregister({name!r}): {name!r} was not registered by "
            f"qkv.integrations.transformers.register (registered: {sorted(_BEFORE)})"
        )
    tf = _import_transformers()
    from transformers.masking_utils import AttentionMaskInterface

    for interface, before in zip(
        (tf.AttentionInterface, AttentionMaskInterface), _BEFORE.pop(name)
    ):
        if before is _MISSING:
            interface._global_mapping.pop(name, None)
        else:
            interface._global_mapping[name] = before
    withdraw_from_own_tables(name)
    if not _BEFORE:
        deformable.unroute()


def registered() -> list[str]:
    """The names :func:`register` has registered and :func:`unregister` has not undone."""
    return sorted(_BEFORE)


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "qkv.integrations.transformers needs transformers 5.x: pip install 'qkv[hf]'"
        ) from e
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    low, high = SUPPORTED_VERSIONS
    if not low <= version < high:
        raise ImportError(
            f"qkv.integrations.transformers supports transformers "
            f">={'.'.join(map(str, low))},<{high[0]}, found "
            f"{transformers.__version__}: pip install 'qkv[hf]'"
        )
    return transformers
