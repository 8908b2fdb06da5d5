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

``output_attentions=True`` returns the weights ``exp(scores - lse)`` recomputed from the fast
kernel's log-sum-exp, only when asked (transformers' own ``sdpa`` returns none).

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils import _pytree

from .. import masks
from ..functional import scaled_dot_product_attention
from ..masks import MaskMod
from ..ops.base import compiling_plainly, tracing

__all__ = ["register", "attention_forward", "build_mask", "HFMask", "HFMaskTensor",
           "SUPPORTED_VERSIONS"]

# transformers >= 5.3, < 6 (tested: 5.3.0 and 5.23.0). 5.3 is the first whose models report
# output_attentions to the attention function (through its output recorder).
SUPPORTED_VERSIONS = ((5, 3), (6, 0))
# Arguments some models pass that change the result and that qkv does not implement yet:
# refused with their names, never dropped (dropping block_indices once gave dense attention).
_REFUSED: dict[str, str] = {}
# Every keyword a modeling file of transformers passes to its attention function, by what qkv
# does with it (tests/test_hf_integration.py scans the installed transformers against this,
# so a new keyword fails there until it is classified).
KEYWORDS_IMPLEMENTED = frozenset({
    "attention_mask", "dropout", "scaling", "is_causal", "sliding_window", "softcap",
    "position_bias", "s_aux", "sinks", "output_attentions", "query", "key", "value",
    "indices", "block_indices"})
# Passed for FlashAttention's variable-length kernels or its options; transformers' eager
# attention ignores them too (the attention_mask carries the same segments).
KEYWORDS_IGNORED_AS_EAGER = frozenset({
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids",
    "deterministic"})


def register(name: str = "qkv", *, backend: str = "auto") -> str:
    """Make ``attn_implementation=name`` run transformers models on qkv.

    Registers :func:`attention_forward` in transformers' ``AttentionInterface`` and
    :func:`build_mask` in its ``AttentionMaskInterface`` under ``name``. Calling it again
    re-registers (e.g. with another ``backend``).

    Args:
        name: The attention implementation's name.
        backend: The qkv backend the calls use (``"auto"``, ``"tiled"``, ``"torch"``,
            ``"reference"``).

    Returns:
        ``name``, to pass as ``attn_implementation``.
    """
    tf = _import_transformers()
    from transformers.masking_utils import AttentionMaskInterface

    tf.AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, build_mask)
    _refuse_in_own_tables(name)
    return name


# --- models that keep their own tables of attention classes -------------------------------------
#
# A few models (git, sam, sam_hq, unlimited_ocr, data2vec_vision, ...) pick their attention
# class from a module-level dict such as GIT_SELF_ATTENTION_CLASSES by the config's
# attn_implementation, and never call the AttentionInterface: with "qkv" they raised
# KeyError: 'qkv'. register() puts an entry under its name in every such table, in the
# modules imported now and (through a finder on sys.meta_path) in those imported later, that
# raises one clear error naming the model and the way out.

_OWN_TABLE_NAMES: set[str] = set()
_TABLE_SUFFIX = "_ATTENTION_CLASSES"


def _refuse_in_own_tables(name: str) -> None:
    import sys
    _OWN_TABLE_NAMES.add(name)
    for module_name, module in list(sys.modules.items()):
        if _is_modeling_module(module_name) and module is not None:
            _patch_tables(module)
    if not any(isinstance(f, _TablePatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TablePatcher())


def _is_modeling_module(name: str) -> bool:
    parts = name.split(".")
    return (len(parts) == 4 and parts[:2] == ["transformers", "models"]
            and parts[3].startswith("modeling_"))


def _patch_tables(module) -> None:
    for attr, table in list(vars(module).items()):
        if attr.endswith(_TABLE_SUFFIX) and isinstance(table, dict):
            for name in _OWN_TABLE_NAMES:
                table.setdefault(name, _OwnTableRefusal(module.__name__, attr, name,
                                                        sorted(k for k in table if k not in _OWN_TABLE_NAMES)))


class _OwnTableRefusal:
    """What a model's own attention table holds under qkv's name: building it raises."""

    def __init__(self, module: str, table: str, name: str, choices: list) -> None:
        self.model = module.split(".")[2]
        self.table, self.name, self.choices = table, name, choices

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.model} picks its attention classes from its own table {self.table} "
            f"({', '.join(map(repr, self.choices))}) instead of transformers' AttentionInterface, "
            f"so attn_implementation={self.name!r} cannot run it. Build it with one of those; in "
            f"a composite model, give {self.name!r} only to the sub-configs whose attention goes "
            f"through the interface, e.g. attn_implementation={{'text_config': {self.name!r}, "
            f"'vision_config': 'eager'}}")


class _TablePatcher:
    """A finder that lets transformers' modeling modules load as usual, then patches their
    attention tables (see :func:`_refuse_in_own_tables`)."""

    def find_spec(self, fullname, path, target=None):
        import sys
        if not _is_modeling_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _patch_tables(module)

        loader.exec_module = exec_module
        return spec


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("qkv.integrations.transformers needs transformers 5.x: "
                          "pip install 'qkv[hf]'") from e
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    low, high = SUPPORTED_VERSIONS
    if not low <= version < high:
        raise ImportError(f"qkv.integrations.transformers supports transformers "
                          f">={'.'.join(map(str, low))},<{high[0]}, found "
                          f"{transformers.__version__}: pip install 'qkv[hf]'")
    return transformers


@dataclass(frozen=True)
class HFMask:
    """The mask transformers asked for, kept as a description rather than a tensor.

    Attributes:
        mask_function: transformers' ``mask_function(b, h, q_idx, kv_idx)`` in absolute
            positions (queries from ``q_offset``, keys from ``kv_offset``).
        q_length, kv_length: The sizes T and S of the attention call.
        q_offset, kv_offset: Absolute position of query row 0 and key column 0.
        padding: Bool ``(B, S)``, True = real key, or None when there is no padding.
        per_element: The function needs per-element (vmap) evaluation: transformers marks
            custom overlays so.
    """

    mask_function: Callable
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    padding: Tensor | None
    per_element: bool = False


def _dense_keep(mask: HFMask, B: int, device) -> Tensor:
    """The mask as a bool ``(B, 1, T, S)``, True where a query may attend."""
    T, S = mask.q_length, mask.kv_length
    keep, mask_mod, causal = _mask_args(None, mask, T, S, None, None)
    ok = torch.ones(B, 1, T, S, dtype=torch.bool, device=device)
    if keep is not None:
        ok = ok & keep.to(device)
    for mod in ((masks.causal() if causal else None), mask_mod):
        if mod is not None:
            ok = ok & masks.to_dense(mod, B, 1, T, S, device=device)
    return ok


class HFMaskTensor(Tensor):
    """An :class:`HFMask` that model code can use as the 4-D mask transformers' eager path
    builds: shape ``(B, 1, T, S)``, the dtype transformers asked for, ``0`` where a query may
    attend and the dtype's minimum where it may not.

    Its metadata (shape, dtype, device, ndim) costs nothing. Its values are formed on the
    first use that reads them (indexing, arithmetic, ``.contiguous()``, any torch function;
    the result is a plain tensor) and kept. qkv's attention function reads ``description``
    instead, so on the path that does not touch the mask nothing ``(T, S)``-sized is built.
    Under ``torch.compile`` :func:`build_mask` gives the plain :class:`HFMask`.
    """

    description: HFMask

    @staticmethod
    def __new__(cls, description: HFMask, batch_size: int, dtype: torch.dtype, device):
        shape = (batch_size, 1, description.q_length, description.kv_length)
        base = torch.zeros((), dtype=dtype, device=device).expand(shape)  # one element
        self = Tensor._make_subclass(cls, base)
        self.description, self._dense = description, None
        return self

    def dense(self) -> Tensor:
        """The mask as transformers' eager path has it: ``(B, 1, T, S)``, 0 or the minimum."""
        if self._dense is None:
            with torch._C.DisableTorchFunctionSubclass():
                B, _, T, S = self.shape
                dtype, device = self.dtype, self.device
            ok = _dense_keep(self.description, B, device)
            low = torch.finfo(dtype).min if dtype.is_floating_point else False
            self._dense = torch.where(ok, torch.zeros((), dtype=dtype, device=device),
                                      torch.full((), low, dtype=dtype, device=device))
        return self._dense

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = _pytree.tree_map_only(cls, lambda m: m.dense(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, **kwargs):
        return f"HFMaskTensor({self.description!r})"


_METADATA = {Tensor.shape.__get__, Tensor.dtype.__get__, Tensor.device.__get__,
             Tensor.ndim.__get__, Tensor.dim, Tensor.size, Tensor.layout.__get__,
             Tensor.is_floating_point, Tensor.requires_grad.__get__, Tensor.is_cuda.__get__,
             Tensor.is_meta.__get__, Tensor.numel}


def build_mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None,
               q_offset: int = 0, kv_offset: int = 0, mask_function: Callable | None = None,
               attention_mask: Tensor | None = None, use_vmap: bool = False, *,
               cache_position: Tensor | None = None, **kwargs) -> HFMaskTensor | HFMask:
    """transformers' mask interface for qkv: an :class:`HFMaskTensor` (under tracing, the
    plain :class:`HFMask`), no ``(T, S)`` tensor until model code reads its values.

    transformers before 5.4 passes the query positions as ``cache_position`` instead of
    ``q_length``/``q_offset``; both are taken.

    Shape:
        attention_mask ``(B, >= kv_offset + S)``, 2-D padding mask (True/1 = real token);
        cache_position ``(T,)``.
    """
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask

    if cache_position is not None:
        q_length, q_offset = _query_positions(cache_position)
    if q_length is None or kv_length is None:
        raise TypeError("build_mask needs q_length (or cache_position) and kv_length")
    padding = None
    if attention_mask is not None:
        full = prepare_padding_mask(attention_mask.bool(), kv_length, int(kv_offset))
        padding = full[:, int(kv_offset): int(kv_offset) + kv_length]  # (B, S)
        if not tracing() and bool(padding.all()):  # a graph keeps the all-True mask: no sync
            padding = None
    description = HFMask(mask_function or causal_mask_function, q_length, kv_length,
                         int(q_offset), int(kv_offset), padding, bool(use_vmap))
    if tracing() and not compiling_plainly():
        # torch.export's non-strict mode and torch.func cannot make the subclass from their
        # fake tensors: they get the description (a model that reads the mask fails there).
        return description
    device = kwargs.get("device") or (padding.device if padding is not None else "cpu")
    return HFMaskTensor(description, batch_size, kwargs.get("dtype") or torch.float32, device)


def _query_positions(cache_position: Tensor) -> tuple[int, int]:
    """``(T, first position)`` of consecutive query positions."""
    T = cache_position.numel()
    first = int(cache_position[0]) if T else 0
    if T and not torch.equal(cache_position.cpu(), torch.arange(first, first + T, device="cpu")):
        raise ValueError(f"attn_implementation='qkv' needs consecutive query positions, got "
                         f"cache_position {cache_position.tolist()[:8]}...")
    return T, first


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: HFMask | Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, *,
                      backend: str = "auto", **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' attention function signature, computed by qkv.

    Args:
        module: The model's attention module (``is_causal`` is read from it).
        query, key, value: Projected heads.
        attention_mask: An :class:`HFMask` from :func:`build_mask`, a prepared 4-D mask
            (bool True = may attend, or float added), or None.
        dropout: Dropout on the weights (transformers passes 0 in eval).
        scaling: Factor on the scores (None: ``1 / sqrt(D)``).
        is_causal: Overrides ``module.is_causal`` when there is no mask.
        backend: The qkv backend.
        **kwargs: ``sliding_window``, ``position_bias`` (T5), ``softcap``, ``s_aux``
            (attention sinks, gpt-oss), ``output_attentions``, ``indices`` (DeepSeek sparse
            attention's top-k keys per query) and ``block_indices`` (MiniMax-M3's top-k key
            blocks per query and indexer head), and what transformers passes along (ignored).

    Returns:
        ``(output, weights)``: weights only when the caller asked for attentions.

    Shape:
        query ``(B, H, T, D)``; key, value ``(B, G, S, D)`` -> output ``(B, T, H, D)``,
        weights ``(B, H, T, S)``.
    """
    for arg, what in _REFUSED.items():
        if kwargs.get(arg) is not None:
            raise NotImplementedError(f"qkv's attention does not implement {what} yet; run this "
                                      f"model with attn_implementation='eager' or 'sdpa'")
    T, S = query.shape[-2], key.shape[-2]
    attn_mask, mask_mod, causal = _mask_args(module, attention_mask, T, S, is_causal,
                                             kwargs.get("sliding_window"), query.device)
    attn_mask = _with_bias(attn_mask, kwargs.get("position_bias"))
    attn_mask = _with_selection(attn_mask, _selected_keys(module, query, S, kwargs))
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # gpt-oss: per head (H,); inkling2:
    if sinks is not None and sinks.dim() == 4:         # per query row (B, H, T, 1)
        sinks = sinks.squeeze(-1)
    want = _weights_wanted(kwargs)
    res = scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout, is_causal=causal,
        scale=scaling, enable_gqa=query.shape[-3] != key.shape[-3], backend=backend,
        return_trace=want, mask_mod=mask_mod,
        score_mod=masks.softcap(softcap) if softcap else None,
        sinks=None if sinks is None else sinks.to(query.device))
    out, trace = res if want else (res, None)  # (B, H, T, D)
    weights = trace.probs.to(query.dtype) if want else None  # (B, H, T, S)
    return out.transpose(1, 2).contiguous(), weights  # (B, T, H, D)


def _mask_args(module, mask, T: int, S: int, is_causal: bool | None, sliding_window,
               device=None):
    """``(attn_mask, mask_mod, is_causal)`` for qkv from what transformers passed."""
    if isinstance(mask, HFMaskTensor):
        mask = mask.description
    if isinstance(mask, HFMask):
        if (mask.q_length, mask.kv_length) != (T, S):
            if mask.kv_length == 1 and mask.q_length in (1, T):
                # A one-key mask for a call with S keys (BERT without is_decoder under
                # generate(): its cache grows, its mask does not). Eager and sdpa broadcast
                # it over every key; so does qkv, rather than refuse what they run.
                B = 1 if mask.padding is None else mask.padding.shape[0]
                return _dense_keep(mask, B, device), None, False
            raise ValueError(f"transformers built the mask for T={mask.q_length}, "
                             f"S={mask.kv_length}, but the attention call has T={T}, S={S}")
        keep = None if mask.padding is None else mask.padding[:, None, None, :]  # (B, 1, 1, S)
        mask_mod, causal = _structure(mask, T, S)
        return keep, mask_mod, causal
    if isinstance(mask, Tensor):
        if mask.shape[-1] > S:  # a static cache's mask covers its whole capacity
            mask = mask[..., :S]
        return mask, None, False
    if mask is not None:
        raise TypeError(f"attn_implementation='qkv' got an attention_mask of type "
                        f"{type(mask).__name__}; it takes the masks qkv's mask interface "
                        f"builds, 4-D tensors, or None")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal) and T > 1  # as transformers' sdpa: one query sees every key
    if causal and sliding_window:
        return None, _FixedWindow(sliding_window - 1, 0, S - T), False
    return None, None, causal


def _structure(mask: HFMask, T: int, S: int) -> tuple[MaskMod | None, bool]:
    """``(mask_mod, is_causal)`` for transformers' mask function, without padding."""
    d = mask.q_offset - mask.kv_offset  # key j may be seen by query i iff j <= i + d, causally
    window = _window_of(mask.mask_function)
    if window is None:
        return _HFFunction(mask.mask_function, mask.q_offset, mask.kv_offset,
                           mask.per_element), False
    if window is _EVERYTHING:
        return None, False
    left, right = window
    if left is None and right == 0:  # plain causal
        if d == 0:
            return None, True
        if d >= S - 1:
            return None, False  # every query sees every key
    return _FixedWindow(left, right, d), False


_EVERYTHING = ("everything",)


def _window_of(fn) -> tuple[int | None, int | None] | tuple | None:
    """transformers' mask function as a window ``(left, right)`` around the query position
    (None = unbounded), :data:`_EVERYTHING`, or None when it is not a window.

    Recognises ``causal_mask_function``, ``bidirectional_mask_function``, the sliding-window
    overlays and ``and_masks`` of those, by their code objects. Under tracing, a closure
    (the overlays, ``and_masks``) is not opened (dynamo cannot read ``__closure__``): it runs
    as a plain mask_mod traced into the graph, with the same result.
    """
    from transformers import masking_utils as mu

    if fn is mu.bidirectional_mask_function:
        return _EVERYTHING
    if fn is mu.causal_mask_function:
        return (None, 0)
    if tracing():
        return None
    code, cells = getattr(fn, "__code__", None), _cells(fn)
    if code is _code(mu.sliding_window_overlay) and isinstance(cells.get("sliding_window"), int):
        return (cells["sliding_window"] - 1, None)  # kv > q - w
    bidirectional = getattr(mu, "sliding_window_bidirectional_overlay", None)  # not in every 5.x
    if (bidirectional is not None and code is _code(bidirectional)
            and isinstance(cells.get("sliding_window"), int)):
        w = cells["sliding_window"]
        return (w, w)  # |q - kv| <= w
    if code is _code(mu.and_masks) and isinstance(cells.get("mask_functions"), tuple):
        parts = [_window_of(f) for f in cells["mask_functions"]]
        if any(p is None for p in parts):
            return None
        bounds = [p for p in parts if p is not _EVERYTHING]
        if not bounds:
            return _EVERYTHING
        return (_tightest(b[0] for b in bounds), _tightest(b[1] for b in bounds))
    return None


@functools.lru_cache(maxsize=None)
def _code(factory):
    """The code object of the closure ``factory`` returns (the same for every argument):
    the window overlays take a size, ``and_masks`` functions."""
    return factory(abs if factory.__name__ == "and_masks" else 1).__code__


def _cells(fn) -> dict:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    with contextlib.suppress(ValueError):  # an empty cell
        return {n: c.cell_contents for n, c in zip(code.co_freevars, fn.__closure__)}
    return {}


def _tightest(bounds) -> int | None:
    known = [b for b in bounds if b is not None]
    return min(known) if known else None


class _FixedWindow(masks._Window):
    """Keys in ``[q + d - left, q + d + right]``: a window whose alignment ``d`` transformers'
    cache offsets fix (not top-left or bottom-right by the call's sizes)."""

    def __init__(self, left: int | None, right: int | None, d: int) -> None:
        super().__init__(left, right, "top_left", "window", offset=d)

    def bind(self, B, H, T, S):
        return self

    def __repr__(self):
        return f"hf_window(left={self.left}, right={self.right}, offset={self.offset})"


class _HFFunction(MaskMod):
    """transformers' mask function as a qkv mask_mod, shifted to absolute positions.

    Its functions are written for broadcast index tensors (transformers' non-vmap masks);
    those transformers marks as needing vmap are evaluated per element.
    """

    def __init__(self, fn: Callable, q_offset: int, kv_offset: int, per_element: bool) -> None:
        self.fn, self.q_offset, self.kv_offset, self.per_element = fn, q_offset, kv_offset, per_element

    def __call__(self, b, h, q_idx, kv_idx):
        q, kv = q_idx + self.q_offset, kv_idx + self.kv_offset
        if self.per_element:
            from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
            with TransformGetItemToIndex():
                return masks.per_element(self.fn, None, b, h, q, kv)
        return self.fn(b, h, q, kv)

    def tensors(self):
        return masks._captured_tensors(self.fn)

    def __repr__(self):
        return f"hf_mask({getattr(self.fn, '__qualname__', self.fn)})"


def _with_bias(attn_mask: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """A float ``position_bias`` (T5) added to the scores, with a bool mask folded in as -inf.

    Shape:
        attn_mask ``(B, 1, 1, S)`` bool or None; bias ``(1 | B, H, T, S)``.
    """
    if bias is None:
        return attn_mask
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return bias.masked_fill(~attn_mask, float("-inf"))
    return bias + attn_mask


def _selected_keys(module, query: Tensor, S: int, kwargs: dict) -> Tensor | None:
    """The keys a sparse-attention indexer kept, as a bool mask (True = kept), or None.

    ``indices`` (DeepSeek-V3.2's DSA and its kin): the top-k key positions per query, the
    same for every head. ``block_indices`` (MiniMax-M3): the top-k key blocks of
    ``module.indexer.block_size`` keys per query and indexer head, -1 for an empty slot;
    each indexer head serves ``H // H_idx`` consecutive query heads. Formed densely, as
    transformers' eager attention forms it (block skipping on it is left to a later change).

    Shape:
        indices ``(B, T, k)`` -> ``(B, 1, T, S)``; block_indices ``(B, H_idx, T, k)`` ->
        ``(B, H, T, S)``.
    """
    idx, blocks = kwargs.get("indices"), kwargs.get("block_indices")
    if idx is not None and blocks is not None:
        raise ValueError("got both indices= and block_indices=; a model passes one")
    if idx is not None:
        if idx.dim() != 3 or idx.shape[1] != query.shape[-2]:
            raise ValueError(f"indices= must be (B, T, k) with T={query.shape[-2]}, "
                             f"got {tuple(idx.shape)}")
        keep = torch.zeros(idx.shape[0], idx.shape[1], S + 1, dtype=torch.bool, device=idx.device)
        keep.scatter_(-1, idx.long().masked_fill(idx < 0, S), True)  # -1 lands in a spare column
        return keep[..., :S].unsqueeze(1)
    if blocks is None:
        return None
    size = getattr(getattr(module, "indexer", None), "block_size", None)
    size = size or getattr(getattr(module, "config", None), "index_block_size", None)
    if not isinstance(size, int):
        raise ValueError("block_indices= needs the key block size: qkv reads it from "
                         "module.indexer.block_size or module.config.index_block_size, and "
                         f"{type(module).__name__} has neither")
    H, H_idx = query.shape[-3], blocks.shape[1]
    if blocks.dim() != 4 or H % H_idx:
        raise ValueError(f"block_indices= must be (B, H_idx, T, k) with H_idx dividing "
                         f"H={H}, got {tuple(blocks.shape)}")
    n = -(-S // size)
    keep = torch.zeros(*blocks.shape[:3], n + 1, dtype=torch.bool, device=blocks.device)
    keep.scatter_(-1, blocks.long().masked_fill(blocks < 0, n), True)
    keep = keep[..., :n].repeat_interleave(size, dim=-1)[..., :S]  # (B, H_idx, T, S)
    return keep.repeat_interleave(H // H_idx, dim=1)


def _with_selection(attn_mask: Tensor | None, keep: Tensor | None) -> Tensor | None:
    """``attn_mask`` with the keys an indexer dropped masked out (bool: False; float: -inf)."""
    if keep is None:
        return attn_mask
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def _weights_wanted(kwargs: dict) -> bool:
    """Did the caller ask for attention weights? ``output_attentions=True`` in the call, or
    transformers' output recorder collecting attentions (``output_attentions`` given to the
    model, which transformers does not pass down to every attention function)."""
    if kwargs.get("output_attentions"):
        return True
    from transformers.utils.output_capturing import _active_collector

    collected = _active_collector.get() or {}
    return any(k in collected for k in ("attentions", "cross_attentions"))
