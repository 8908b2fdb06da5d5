"""The mask transformers' models receive from qkv: :class:`HFMask` (the description of what
transformers asked for), :class:`HFMaskTensor` (that description as the 4-D tensor model code
may read) and :func:`build_mask`; and their mapping onto qkv's vocabulary (windows, padding,
per-block mask functions) for the attention function.

Shape alphabet: B batch, T query length, S key length.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils import _pytree

from ... import masks
from ...masks import MaskMod
from ...ops.base import compiling_plainly, tracing

__all__ = ["HFMask", "HFMaskTensor", "build_mask"]


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

    Model code may also write into the mask (``mask[..., 0] = min``, ``masked_fill_``,
    ``zero_``, in a forward hook, say): the write lands in the kept values, and from then on
    qkv's attention reads those values (:meth:`written_values`) instead of the description,
    in this layer and every later one (transformers hands every layer the same mask object,
    so a write reaches the next layers, as in eager). A write is seen by the values' version
    counter, which every in-place op bumps, through views of the values too; where it cannot
    be (inference tensors keep no version counter; in a compiled graph it is a symbol no
    Python branch can read; ``.data``, ``.numpy()`` and storages alias the values without
    it), the values, once formed, are taken as written. That costs the structured path, not
    the result: the values read as formed, 0 adds nothing and the dtype's minimum means "may
    not attend", so values nobody changed give what the description gives.

    Under ``torch.export`` and ``torch.func`` transforms :func:`build_mask` gives the plain
    :class:`HFMask`.
    """

    description: HFMask
    _dense: Tensor | None  # the values, once formed
    _clean: int | None  # the values' version when formed; None: a write cannot be seen

    @staticmethod
    def __new__(cls, description: HFMask, batch_size: int, dtype: torch.dtype, device):
        shape = (batch_size, 1, description.q_length, description.kv_length)
        base = torch.zeros((), dtype=dtype, device=device).expand(shape)  # one element
        self = Tensor._make_subclass(cls, base)
        self.description, self._dense, self._clean = description, None, None
        return self

    def dense(self) -> Tensor:
        """The mask as transformers' eager path has it: ``(B, 1, T, S)``, 0 or the minimum."""
        if self._dense is None:
            with torch._C.DisableTorchFunctionSubclass():
                B = self.shape[0]
                dtype, device = self.dtype, self.device
            ok = _dense_keep(self.description, B, device)
            low = torch.finfo(dtype).min if dtype.is_floating_point else False
            dense = torch.where(
                ok,
                torch.zeros((), dtype=dtype, device=device),
                torch.full((), low, dtype=dtype, device=device),
            )  # (B, 1, T, S)
            self._dense = dense
            # made in inference mode, the values are an inference tensor: no version
            # counter; in a graph, the count is a symbol that a Python branch cannot read
            untracked = tracing() or dense.is_inference()
            self._clean = None if untracked else dense._version
        return self._dense

    def written(self) -> bool:
        """Whether model code may have written into the values since they were formed (a
        Python-side check of the version counter: no tensor value is read)."""
        dense = self._dense
        if dense is None:
            return False
        return self._clean is None or dense._version != self._clean

    def written_values(self) -> Tensor:
        """The values as model code left them, for qkv's attention: a float mask added to the
        scores, the dtype's minimum read as ``-inf`` (may not attend), so a row left with no
        key outputs 0 as everywhere in qkv, and values nobody changed give exactly what the
        description gives.

        Shape:
            -> ``(B, 1, T, S)``.
        """
        dense = self.dense()
        if not dense.is_floating_point():
            return dense
        low = torch.finfo(dense.dtype).min
        return dense.masked_fill(dense == low, float("-inf"))  # (B, 1, T, S)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _UNTRACKED_ALIASES:  # writes through these bypass the version counter
            _pytree.tree_map_only(cls, _untracked, (args, kwargs))
        args, kwargs = _pytree.tree_map_only(cls, lambda m: m.dense(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self, **kwargs):
        return f"HFMaskTensor({self.description!r})"


def _untracked(mask: HFMaskTensor) -> None:
    mask.dense()
    mask._clean = None  # taken as written from now on


def _getter(name: str) -> Callable:
    """The getter of Tensor's property ``name``, the function ``__torch_function__`` sees (the
    stubs type the properties as plain attributes: ``Tensor.shape`` as a ``Size``)."""
    return getattr(Tensor, name).__get__


_METADATA = {
    _getter("shape"),
    _getter("dtype"),
    _getter("device"),
    _getter("ndim"),
    Tensor.dim,
    Tensor.size,
    _getter("layout"),
    Tensor.is_floating_point,
    _getter("requires_grad"),
    _getter("is_cuda"),
    _getter("is_meta"),
    Tensor.numel,
}

# Aliases of the values that do not share their version counter: a write through them is
# invisible to HFMaskTensor.written, so handing one out counts as a write.
_UNTRACKED_ALIASES = {
    _getter("data"),
    Tensor.numpy,
    Tensor.__array__,
    Tensor.__dlpack__,
    Tensor.untyped_storage,
    Tensor.storage,
}


def build_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    use_vmap: bool = False,
    *,
    cache_position: Tensor | None = None,
    **kwargs,
) -> HFMaskTensor | HFMask:
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
        assert full is not None  # a tensor for a tensor (None only for None)
        padding = full[:, int(kv_offset) : int(kv_offset) + kv_length]  # (B, S)
        if not tracing() and bool(padding.all()):  # a graph keeps the all-True mask: no sync
            padding = None
    description = HFMask(
        mask_function or causal_mask_function,
        q_length,
        kv_length,
        int(q_offset),
        int(kv_offset),
        padding,
        bool(use_vmap),
    )
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
        raise ValueError(
            f"attn_implementation='qkv' needs consecutive query positions, got "
            f"cache_position {cache_position.tolist()[:8]}..."
        )
    return T, first


def _mask_args(module, mask, T: int, S: int, is_causal: bool | None, sliding_window, device=None):
    """``(attn_mask, mask_mod, is_causal)`` for qkv from what transformers passed."""
    if isinstance(mask, HFMaskTensor):
        # model code wrote into it: its values, not the description, are the mask now
        mask = mask.written_values() if mask.written() else mask.description
    if isinstance(mask, HFMask):
        if (mask.q_length, mask.kv_length) != (T, S):
            if mask.kv_length == 1 and mask.q_length in (1, T):
                # A one-key mask for a call with S keys (BERT without is_decoder under
                # generate(): its cache grows, its mask does not). Eager and sdpa broadcast
                # it over every key; so does qkv, rather than refuse what they run.
                B = 1 if mask.padding is None else mask.padding.shape[0]
                return _dense_keep(mask, B, device), None, False
            raise ValueError(
                f"transformers built the mask for T={mask.q_length}, "
                f"S={mask.kv_length}, but the attention call has T={T}, S={S}"
            )
        keep = None if mask.padding is None else mask.padding[:, None, None, :]  # (B, 1, 1, S)
        mask_mod, causal = _structure(mask, T, S)
        return keep, mask_mod, causal
    if isinstance(mask, Tensor):
        if mask.shape[-1] > S:  # a static cache's mask covers its whole capacity
            mask = mask[..., :S]
        return mask, None, False
    if mask is not None:
        raise TypeError(
            f"attn_implementation='qkv' got an attention_mask of type "
            f"{type(mask).__name__}; it takes the masks qkv's mask interface "
            f"builds, 4-D tensors, or None"
        )
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
        return _HFFunction(
            mask.mask_function, mask.q_offset, mask.kv_offset, mask.per_element
        ), False
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
    if (
        bidirectional is not None
        and code is _code(bidirectional)
        and isinstance(cells.get("sliding_window"), int)
    ):
        w = cells["sliding_window"]
        return (w, w)  # |q - kv| <= w
    if code is _code(mu.and_masks) and isinstance(cells.get("mask_functions"), tuple):
        parts = [_window_of(f) for f in cells["mask_functions"]]
        if any(p is None for p in parts):
            return None
        bounds = [p for p in parts if p is not None and p is not _EVERYTHING]
        if not bounds:
            return _EVERYTHING
        return (_tightest(b[0] for b in bounds), _tightest(b[1] for b in bounds))
    return None


@functools.cache
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
        self.fn, self.q_offset, self.kv_offset, self.per_element = (
            fn,
            q_offset,
            kv_offset,
            per_element,
        )

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
