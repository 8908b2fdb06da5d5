"""Torch backend: ``torch.nn.functional.scaled_dot_product_attention`` under qkv's contract.

Supports: every dense-mask call (torch picks its flash/efficient/math kernel), and a
``mask_mod`` of a short call as the dense mask it stands for (up to ``DENSE_MAX`` pairs; made
once per mask and sizes, guarded and additive, and kept): torch's kernel visits every pair,
so the static order leaves structured masks to the backends that skip blocks
(``in_static_order``), and only ``auto``'s measurement, or a caller who names ``torch``, takes
it there (bfloat16 documents at T=1024 ran in 0.75x the tiled loop's time on an AMX Xeon, a
window of 256 in 1.75x; benchmarks/RESULTS.md). A prefix LM with one prefix length (T == S)
needs no dense mask at any length: torch's causal kernel, then the prefix's rows again
(:func:`_prefix_lm`). Not ``score_mod`` or sinks.
What it adds on top of torch:
  * ``attn_mask`` together with ``is_causal=True`` (torch refuses the pair): the masks are
    merged into one, a key must pass both.
  * Query rows that may attend to nothing give exactly 0 with 0 gradients whatever kernel
    torch picks: such rows are handed to torch as "attend everywhere" and zeroed after.
  * float16 on CPU (and float16/bfloat16 with a float32 attn_mask, whose precision plain
    math keeps through the softmax) runs torch's float32 kernel and rounds the output: torch's own
    float16 CPU kernel measured ~7x slower for forward+backward (T=2048, D=64) and its dV error
    up to 3.4x that of plain float16 math, outside the tolerance policy; through float32 the
    error stays within it (benchmarks/RESULTS.md).
  * A half float ``attn_mask`` that wants a gradient, where the kernel computes in float32,
    is widened before its merge with ``is_causal``: its gradient is summed back to its shape
    in float32 (``_mask_work_dtype``).
  * On CUDA, plain and causal half calls try cuDNN's attention first (``_kernel_order``):
    measured faster than flash, which torch's own order picks at some lengths.
  * The log-sum-exp for traces: on CPU, torch's flash kernel returns it with the output
    (``aten._scaled_dot_product_flash_attention_for_cpu``) when the call fits that kernel
    (4-D, equal batch and heads, D == Dv, no dropout); otherwise the dispatcher derives it.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import Tensor

from .._identity import IdentityCache
from ..masks import _Combined, _KeysBefore, _Window, merge_causal, structure_key
from . import nonfinite
from ._aten import (
    CUDA_LSE_KERNELS,
    _no_pairs,
    cuda_forward,
    flash_cpu_available,
    flash_forward,
    sdpa,
)
from .base import BackendResult, tracing
from .call import AttentionCall
from .key_counts import is_window
from .plan_cache import PlanCache

__all__ = ["TorchBackend"]


class TorchBackend:
    """PyTorch's own SDPA kernels."""

    name = "torch"
    priority = 10
    traceable = True  # torch's own SDPA

    def supports(self, call: AttentionCall) -> str | None:
        if call.sinks is not None:
            return "torch's SDPA has no attention sinks (the tiled and reference backends do)"
        if call.score_mod is not None:
            return "torch's SDPA has no score_mod (the tiled and reference backends do)"
        mask = call.attn_mask
        if (
            call.mask_mod is not None
            and mask is not None
            and mask.requires_grad
            and mask.dtype in (torch.float16, torch.bfloat16)
        ):
            return (
                "torch's SDPA would take the half attn_mask merged with the mask_mod as one "
                "(T, S) tensor, and autograd would sum its gradient back to the mask's shape in "
                "half precision (the tiled backend sums it in float32)"
            )
        if call.mask_mod is not None and not _dense_fits(call) and _prefix_rows(call) is None:
            return (
                f"torch's SDPA takes a structured mask only as a dense tensor, made here for at "
                f"most {DENSE_MAX} (T, S) pairs and {DENSE_MAX * 4} (B, T, S); this call has "
                f"T * S = {call.T * call.S}, B * T * S = {call.BH[0] * call.T * call.S}. Pass "
                "attn_mask=qkv.masks.to_dense(mask_mod, B, H, T, S) to run it there anyway"
            )
        return None

    def in_static_order(self, call: AttentionCall) -> bool:
        """Whether the static order (measuring off, or nothing measured) may take torch for
        ``call``: not for a structured mask, which torch runs dense, visiting every pair,
        where the tiled and triton loops skip the hidden blocks. Measured, it may win."""
        return call.mask_mod is None or _is_bottom_right_causal(call.mask_mod)

    def run(self, call: AttentionCall) -> BackendResult:
        q, k, v = call.query, call.key, call.value
        if (  # the common call (a decoding step's): torch's kernel as it is, nothing around it
            call.attn_mask is None
            and call.mask_mod is None
            and not call.return_trace
            and q.is_cpu
            and call.work_dtype == call.dtype
        ):
            if _with_lse(call):  # the same kernel F.sdpa takes, and the lse it drops
                fast = flash_forward(q, k, v, scale=call.scale, is_causal=call.is_causal)
                return BackendResult(out=fast[0], lse=fast[1])
            out = sdpa(
                q,
                k,
                v,
                attn_mask=None,
                dropout_p=call.dropout_p,
                is_causal=call.is_causal,
                scale=call.scale,
                enable_gqa=call.enable_gqa,
            )  # (*batch, T, Dv)
            return BackendResult(out=out)
        prefix = _prefix_rows(call)
        if prefix is not None:  # prefix_lm: causal for every row, the prefix's rows again
            return _prefix_lm(call, prefix)
        mask: Tensor | None
        if call.mask_mod is not None and call.attn_mask is None:
            mask, row_ok, factor = _structured_for_kernel(call)  # causal merged in
            is_causal = False
        else:
            # a half float mask that wants a gradient is widened before it is merged: the
            # gradient's sum back to its shape (a scalar's over every pair) is then float32's
            # (in bfloat16 a scalar mask's gradient was 5x the policy's bound, T=13, S=3)
            mask = call.mask(dtype=_mask_work_dtype(call))
            is_causal = call.is_causal and mask is None  # merged into mask otherwise
            mask, row_ok, factor = _guard_for_kernel(
                mask, remember=mask is call.attn_mask, dtype=call.work_dtype
            )
        return _kernel(call, q, k, v, mask, is_causal, row_ok, factor)


def _kernel(
    call: AttentionCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    row_ok: Tensor | None = None,
    factor: Tensor | None = None,
) -> BackendResult:
    """torch's kernel on ``q``, ``k`` and ``v`` (the call's, or rows of them) with the mask
    as the kernel takes it, the call's other arguments, and its empty rows (``row_ok``,
    ``factor``: :func:`_guard_for_kernel`'s) set to 0 after."""
    if _upcast(call):
        q, k, v = q.float(), k.float(), v.float()
        mask = mask.float() if mask is not None and mask.is_floating_point() else mask
    fused = None if call.return_trace or q.is_cpu else _cuda_forward(call, q, k, v, mask, is_causal)
    if fused is not None:  # (B, H, T, Dv), (B, H, T)
        out, lse = fused
    elif not call.return_trace and _with_lse(call, mask, is_causal):  # (as above)
        additive = None if mask is None else _as_additive(mask, q.dtype)
        out, lse = flash_forward(
            q, k, v, is_causal=is_causal, scale=call.scale, attn_mask=additive
        )  # (B, H, T, Dv), (B, H, T)
    elif call.return_trace and _fits_flash_cpu(call, mask, q.dtype):
        k, v = _shared_heads(q, k), _shared_heads(q, v)  # (B, H, S, D): GQA's kv per head
        out, lse = flash_forward(
            q,
            k,
            v,
            is_causal=is_causal,
            scale=call.scale,
            attn_mask=None if mask is None else _as_additive(mask, q.dtype),
        )  # (B, H, T, Dv), (B, H, T)
    else:
        with _kernel_order(call, mask):
            out = sdpa(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=call.dropout_p,
                is_causal=is_causal,
                scale=call.scale,
                enable_gqa=call.enable_gqa,
            )  # (*batch, T, Dv)
        lse = None
    if out.dtype != call.dtype:
        out = out.to(call.dtype)
    if row_ok is not None:  # rows with no key -> exactly 0 (a finite row: the guard's)
        if factor is None or factor.dtype != out.dtype:
            factor = row_ok.unsqueeze(-1).to(out.dtype)  # (..., T, 1)
        out = out * factor if out.requires_grad else out.mul_(factor)  # (a fresh output)
        if lse is not None:  # the kernel saw the guard's full row there
            lse = lse.masked_fill(~row_ok, float("-inf"))
    return BackendResult(out=out, lse=lse)


def _prefix_rows(call: AttentionCall) -> int | None:
    """P where ``call``'s mask is ``prefix_lm(P)`` with an int P (top-left causal, or the
    first P keys) and nothing else, on square attention (T == S) without dropout (whose draws
    are per (T, S) pair of one kernel call); else None. Such a call needs no dense mask: row
    ``i >= P`` sees the keys ``[0, i]``, top-left causal's own, and a row of the prefix sees
    the first P keys, all of them (:func:`_prefix_lm`)."""
    mod = call.mask_mod
    if (
        type(mod) is not _Combined
        or mod.op != "or"
        or len(mod.mods) != 2
        or call.attn_mask is not None
        or call.is_causal
        or call.T != call.S
        or call.dropout_p > 0
    ):
        return None
    causal = [m for m in mod.mods if is_window(m)]
    keys = [m.n for m in mod.mods if type(m) is _KeysBefore and isinstance(m.n, int)]
    if len(causal) != 1 or len(keys) != 1:
        return None
    w = causal[0]
    if w.left is not None or w.right != 0 or w._off() != 0:
        return None
    return min(max(int(keys[0]), 0), call.T)


def _prefix_lm(call: AttentionCall, prefix: int) -> BackendResult:
    """A prefix LM by torch's kernel without a dense mask: every row causal (the kernel's own
    ``is_causal``), then the prefix's rows again over the prefix's keys alone (no mask); its
    rows of the first call are dropped. Measured on the AMX Xeon (bfloat16, B=4, H=8,
    T=2048, P=256): 43 ms, against 64-74 ms by the tiled backend and 60-72 by compiled Flex.

    Shape:
        -> out ``(*batch, T, Dv)``, lse ``(*batch, T)`` or None.
    """
    q, k, v = call.query, call.key, call.value
    every = _kernel(call, q, k, v, None, True)
    if prefix == 0:
        return every
    head = _kernel(
        call, q[..., :prefix, :], k[..., :prefix, :], v[..., :prefix, :], None, False
    )  # (*batch, P, Dv)
    out = torch.cat([head.out, every.out[..., prefix:, :]], dim=-2)  # (*batch, T, Dv)
    lse = None
    if head.lse is not None and every.lse is not None:
        lse = torch.cat([head.lse, every.lse[..., prefix:]], dim=-1)  # (*batch, T)
    return BackendResult(out=out, lse=lse)


def _kernel_order(call: AttentionCall, mask: Tensor | None) -> contextlib.AbstractContextManager:
    """On CUDA, plain and causal half-precision calls try cuDNN's fused attention first.

    On an H100 (torch 2.11, cuDNN 9.19, bf16, D = 128) cuDNN ran 1.1-1.9x faster than flash
    forward and forward+backward at T = 1k-16k, yet torch's own order ran flash at T = 1k
    (0.43 ms against cuDNN's 0.23; benchmarks/RESULTS.md, "The public API on an H100 ...").
    Where cuDNN cannot take a call, torch goes on down the list (flash, efficient, math).
    Dense masks keep torch's order, but for a call that wants a gradient, which never goes
    to cuDNN: its backward with a mask gives NaN in dq where T % 128 == 64 and a row's
    log-sum-exp is below -88.7 (torch 2.11+, H100/H200; pytorch/pytorch#196678; efficient
    and math are right there). Not while tracing: the compiler chooses.
    """
    if call.device.type != "cuda" or tracing():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if mask is not None and call.wants_grad:
        return sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        )
    if call.dtype not in (torch.float16, torch.bfloat16) or mask is not None or call.dropout_p > 0:
        return contextlib.nullcontext()

    order = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    return sdpa_kernel(order, set_priority=True)


def _with_lse(
    call: AttentionCall, mask: Tensor | None = None, is_causal: bool | None = None
) -> bool:
    """Whether a call without trace runs torch's CPU flash kernel for its log-sum-exp too:
    half dtypes, whose output rows the kernel may get wrong without a sign there (a ``+inf``
    score gives a finite row; the lse is not finite), in 4 dims with one key head per query
    head and no broadcast batch, a key and a row, without dropout or a gradient; and where
    ``torch.nn.functional``'s call takes that kernel (``torch._fused_sdp_choice``), so the bits
    are its. ``mask``: the mask the kernel is given (bool, or additive of the call's dtype;
    ``is_causal`` then the flag it is given with it), None for the call's own flag alone."""
    q, k, v = call.query, call.key, call.value
    if is_causal is None:
        is_causal = call.is_causal
    if (
        call.dtype not in (torch.float16, torch.bfloat16)
        or not q.is_cpu
        or call.work_dtype != call.dtype
        or (mask is not None and mask.dtype not in (torch.bool, call.dtype))
        or (mask is not None and mask.requires_grad)
        or call.dropout_p != 0.0
        or not q.dim() == k.dim() == v.dim() == 4
        or not q.shape[:2] == k.shape[:2] == v.shape[:2]
        or q.numel() == 0
        or k.shape[-2] == 0
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        or not flash_cpu_available()
        or tracing()  # (eager only: the guard reads the lse eagerly; the choice is no tensor)
    ):
        return False
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=call.scale)
    return choice == _FLASH


def _cuda_forward(
    call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool
) -> tuple[Tensor, Tensor] | None:
    """The output and log-sum-exp of torch's CUDA kernel for a call :func:`_cuda_lse` takes,
    else None (F's own call then runs it). Should this torch refuse the kernel's direct call
    (RuntimeError), it says so once and the process goes on by F's call: the same kernel, the
    tensor ops' check (``_CUDA_LSE_REFUSED``)."""
    if _CUDA_LSE_REFUSED:
        return None
    choice = _cuda_lse(call, mask, is_causal)
    if choice is None:
        return None
    try:
        return cuda_forward(q, k, v, scale=call.scale, choice=choice)
    except RuntimeError as e:
        _CUDA_LSE_REFUSED.append(f"{type(e).__name__}: {e}")
        warnings.warn(
            f"qkv: torch's CUDA attention kernel {choice} refused a direct call ({e}); "
            "plain half calls run by F.scaled_dot_product_attention from now on (the same "
            "kernel, their rows checked by tensor ops)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


_CUDA_LSE_REFUSED: list[str] = []  # why torch refused the direct call, once it did


def _cuda_lse(call: AttentionCall, mask: Tensor | None, is_causal: bool) -> int | None:
    """On CUDA, the kernel (cuDNN's or flash's, as ``torch._fused_sdp_choice`` picks it under
    :func:`_kernel_order`) whose log-sum-exp a call's NaN/inf check reads instead of scanning
    q and k (``nonfinite._restore_output_by_lse``): half inputs without mask, causal flag,
    dropout, gradient or GQA, in 4 dims; None for other calls (F's own call, and the tensor
    ops' check). On an H200 the tensor ops' check was 14 of a plain call's 20 kernels and most
    of its 0.7 ms on the host, against cuDNN's 0.23 ms (T = 1024, bf16; RESULTS.md)."""
    q, k, v = call.query, call.key, call.value
    if (
        mask is not None
        or is_causal
        or q.device.type != "cuda"
        or call.dtype not in (torch.float16, torch.bfloat16)
        or call.work_dtype != call.dtype
        or call.dropout_p != 0.0
        or not q.dim() == k.dim() == v.dim() == 4
        or not q.shape[:2] == k.shape[:2] == v.shape[:2]
        or q.numel() == 0
        or k.shape[-2] == 0
        or q.shape[-1] % 8
        or v.shape[-1] % 8  # (F pads other head dims for its kernels; called here, they are not)
        or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        or tracing()
    ):
        return None
    with _kernel_order(call, None):
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=call.scale)
    return choice if choice in CUDA_LSE_KERNELS else None


_FLASH = torch.nn.attention.SDPBackend.FLASH_ATTENTION.value  # (the choice, as an int)


def _is_bottom_right_causal(mask_mod) -> bool:
    """The mask of torch's own ``causal_lower_right``: torch takes it as a dense mask too."""
    return (
        isinstance(mask_mod, _Window)
        and mask_mod.name == "causal"
        and mask_mod.align == "bottom_right"
    )


DENSE_MAX = 1 << 22  # (T, S) pairs of a structured mask made dense: T = S = 2048


def _dense_fits(call: AttentionCall) -> bool:
    """Whether ``call``'s structured mask is small enough to make dense and keep: at most
    ``DENSE_MAX`` (T, S) pairs, and 4 times that over the batch (a document mask holds one
    (T, S) plane per batch row): 16 MiB as bool; the four kept (``_dense_masks``) hold at most
    64 MiB beside the additive ones of at most ``_DENSE_ADDITIVE_MAX`` elements."""
    pairs = call.T * call.S
    return pairs <= DENSE_MAX and call.BH[0] * pairs <= 4 * DENSE_MAX


def _structured_for_kernel(call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``call.mask_mod`` (with ``is_causal`` merged) as torch's kernel takes it, with the empty
    rows guarded (``_guard_for_kernel``'s three): made once per mask structure
    (``qkv.masks.structure_key``), batch, sizes, device and kernel dtype, and kept, so the next
    call reads nothing on the host. A mask with no structure key (a plain function) is made
    every call.

    Shape:
        -> mask ``(*batch or 1s, T, S)``, row_ok ``(*batch or 1s, T)``, factor ``(..., T, 1)``.
    """
    dtype = call.work_dtype

    def make() -> tuple[Tensor, Tensor | None, Tensor | None]:
        structured = call.dense_mask_mod()  # (*batch or 1s, T, S), bool
        if call.is_causal:
            structured = merge_causal(structured, call.T, call.S)
        return _lean(*_guarded(structured), dtype, additive_max=_DENSE_ADDITIVE_MAX)

    if tracing() or call.device.type == "meta":
        return make()  # (a structure key reads a document's ids on the host)
    key = structure_key(call.mask_mod)
    if key is None:
        return make()
    sizes = (tuple(call.batch), call.T, call.S, call.is_causal, call.device, dtype)
    return _dense_masks.get((key, sizes), make)


_dense_masks = PlanCache(4)  # (a model meets a mask structure or two per size)
_DENSE_ADDITIVE_MAX = DENSE_MAX  # structured masks kept additive (torch converts a bool one
# each call: 5-15% of a call at T=1024 on an AMX Xeon); beyond, kept bool


def _guard_empty_rows(
    mask: Tensor | None, remember: bool = True
) -> tuple[Tensor | None, Tensor | None]:
    """Let rows that may attend to nothing attend everywhere; say which rows are real.

    Torch's kernels disagree on such rows across versions and devices (NaN, 0, or a uniform
    average). Giving them a harmless full row and zeroing their output afterwards makes the
    result exactly 0 and, since the zeroed output passes no gradient, the gradients 0 too.
    Every row is guarded, in tensor ops: asking whether one is empty would read on the host
    (a device sync on CUDA).

    ``remember``: ``mask`` is the caller's own tensor, which a model passes again and again:
    the guarded mask is remembered by the mask's identity and version (``qkv._identity``)
    when it is small enough to keep beside it.

    Returns (mask to hand to torch, row_ok).
    Shape:
        mask ``(..., T, S)`` -> same, and row_ok ``(..., T)``.
    """
    guarded, row_ok, _ = _guard_for_kernel(mask, remember)
    return guarded, row_ok


def _guard_for_kernel(
    mask: Tensor | None, remember: bool = True, dtype: torch.dtype | None = None
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_guard_empty_rows`, and for a remembered mask with the kernel's ``dtype``: a
    small bool mask as the additive mask torch would make of it each call, and ``row_ok`` as
    the factor ``(..., T, 1)`` in ``dtype`` that zeroes the empty rows (else None)."""
    if mask is None:
        return None, None, None
    if not remember or tracing() or mask.numel() > _REMEMBER_MAX:
        return (*_guarded(mask), None)
    return _guards.get((mask,), dtype, lambda: _lean(*_guarded(mask), dtype))


def _lean(
    mask: Tensor, row_ok: Tensor, dtype: torch.dtype | None, additive_max: int | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """A remembered guard: a small bool mask (``additive_max`` elements at most, by default
    ``_ADDITIVE_MAX``) made additive once (torch converts one each call),
    and without its ``row_ok`` where every row has a key (a padded batch's mask, a decoding
    step's): nothing to zero after the kernel. That is asked once per mask, by a read on the
    host, where such reads are allowed (``nonfinite.host_reads_free``)."""
    most = _ADDITIVE_MAX if additive_max is None else additive_max
    if dtype is not None and mask.dtype == torch.bool and mask.numel() <= most:
        mask = _as_additive(mask, dtype)
    if nonfinite.host_reads_free(mask.device) and bool(row_ok.all()):
        return mask, None, None
    factor = None if dtype is None else row_ok.unsqueeze(-1).to(dtype)  # (..., T, 1)
    return mask, row_ok, factor


_guards = IdentityCache(16)
_REMEMBER_MAX = 1 << 24  # masks of up to 16 Mi elements: the guarded copy is kept beside them
_ADDITIVE_MAX = 1 << 16  # bool masks of up to 64 Ki elements (key masks) kept additive


def _guarded(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Every empty row of ``mask`` made full, and which rows were not empty, in tensor ops (the
    bool ones through uint8 views, which this CPU reduces and compares 10-20x faster)."""
    if mask.shape[-1] == 0:  # no key at all: no row has one (and no reduction of none)
        return mask, torch.zeros(mask.shape[:-1], dtype=torch.bool, device=mask.device)
    if mask.dtype == torch.bool and tracing():  # (ONNX has no view of bool as uint8)
        row_ok = mask.any(-1)  # (..., T)
        return mask | ~row_ok.unsqueeze(-1), row_ok
    if mask.dtype == torch.bool:
        bytes_ = mask.view(torch.uint8)  # (..., T, S)
        row_ok = bytes_.amax(-1).view(torch.bool)  # (..., T)
        empty = (~row_ok).view(torch.uint8).unsqueeze(-1)  # (..., T, 1)
        return torch.maximum(bytes_, empty).view(torch.bool), row_ok
    row_ok = mask.amax(-1) != float("-inf")  # (..., T): a NaN is not a hidden key
    low = torch.zeros(row_ok.shape, dtype=mask.dtype, device=mask.device)
    low = low.masked_fill_(row_ok, float("-inf")).unsqueeze(-1)  # (..., T, 1): 0 on empty rows
    return torch.maximum(mask, low), row_ok  # an empty row's -inf become 0; others as they are


def _mask_work_dtype(call: AttentionCall) -> torch.dtype | None:
    """float32 for a half float ``attn_mask`` that wants a gradient where the kernel computes
    in float32 (``_upcast``); else None (the mask as it is: merged exactly in its dtype)."""
    mask = call.attn_mask
    if (
        mask is None
        or not mask.requires_grad
        or mask.dtype not in (torch.float16, torch.bfloat16)
        or not _upcast(call)
    ):
        return None
    return call.work_dtype


def _upcast(call: AttentionCall) -> bool:
    """float16 on CPU, and half inputs with a float32 mask, go through torch's float32 kernel
    (see the module docstring and ``AttentionCall.work_dtype``)."""
    return call.work_dtype != call.dtype


def _fits_flash_cpu(call: AttentionCall, mask: Tensor | None, dtype: torch.dtype) -> bool:
    """Can torch's CPU flash kernel, which returns the log-sum-exp, take this call exactly?"""
    q, k, v = call.query, call.key, call.value
    return (
        flash_cpu_available()
        and call.device.type == "cpu"
        and not _no_pairs(q, k)  # empty: the kernel dies of SIGFPE (and the trace needs a graph)
        and q.dim() == k.dim() == v.dim() == 4
        and q.shape[0] == k.shape[0] == v.shape[0]
        and k.shape[1] == v.shape[1]
        and (q.shape[1] == k.shape[1] or call.enable_gqa)
        and call.Dv == call.D
        and call.dropout_p == 0.0
        and (mask is None or mask.dtype in (torch.bool, dtype))
        and not (mask is not None and mask.requires_grad)
    )


def _shared_heads(q: Tensor, kv: Tensor) -> Tensor:
    """GQA's G key/value heads repeated for the H query heads that share each (head ``h``
    reads ``h // (H / G)``), for the flash kernel, which takes one kv head per query head.
    A copy of ``(B, H, S, D)``: small beside the ``(T, S)`` weights a trace is for.

    Shape:
        q ``(B, H, T, D)``, kv ``(B, G, S, D)`` -> ``(B, H, S, D)``.
    """
    H, G = q.shape[1], kv.shape[1]
    return kv if H == G else kv.repeat_interleave(H // G, dim=1)


def _as_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may attend) as the float mask torch's flash kernel wants."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )
