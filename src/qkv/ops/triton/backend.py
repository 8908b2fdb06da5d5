"""The ``triton`` backend: which calls the fused kernels take, and how a call becomes launches.

The kernels and what they support are described in ``kernels.py``; this file says which
calls they take (:class:`TritonBackend`, ``_why_not``) and runs one (:func:`triton_attention`).
``plan.py`` turns the call's mask into a few numbers (a band ``lo <= kv - q <= hi``, key
lengths, document ids), picks block sizes and lists per query block the FULL and PARTIAL key
blocks; ``launch.py`` launches the forward and backward kernels and holds the autograd
Function. Imports run backend -> launch -> plan.

triton is imported only when a kernel is about to run (``import qkv`` never needs it). On CPU
tensors the backend refuses every call except inside :func:`interpreter`, which runs the
kernels under triton's interpreter (``TRITON_INTERPRET=1``) for tests; ``backend="auto"``
therefore never sends a CPU call here.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim; nq/nk query/key blocks.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

from ...masks import _Alibi, _Softcap
from ..base import BackendResult
from ..call import AttentionCall
from ..reference import ReferenceBackend

# `X as X`: names read from here before the launches and the plan had files of their own
# (tests, benchmarks/tune_triton.py, profile_triton.py); a monkeypatch goes to the module
# that reads the name (launch._kernels), not to this alias
from .launch import _kernels as _kernels
from .launch import _TritonAttention
from .plan import Blocks, _kernel_mask, _mask_tensors, _Plan, clear_block_list_cache, default_blocks
from .plan import _block_list_cache as _block_list_cache
from .plan import first_blocks as first_blocks

__all__ = [
    "MAX_HEAD_DIM",
    "Blocks",
    "TritonBackend",
    "clear_block_list_cache",
    "default_blocks",
    "interpreter",
    "interpreting",
    "triton_attention",
    "triton_available",
]

MAX_HEAD_DIM = 128  # the accumulators of a (BLOCK_M, D) tile live in registers
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dim, where (batch, head) goes

_INTERPRET = {"on": False}  # set by interpreter(): CPU calls run under triton's interpreter


@contextlib.contextmanager
def interpreter():
    """Within this block the backend takes CPU tensors and runs its kernels under triton's
    interpreter (``TRITON_INTERPRET=1``), for tests without a GPU. Slow: numpy per block.

    triton reads ``TRITON_INTERPRET`` when a kernel is *decorated*, so the interpreted kernels
    are a second copy of ``kernels.py`` loaded with the variable set (see ``launch._kernels``);
    the environment and triton's settings are restored at once, and nothing leaks out of this
    block: after it, CPU calls are refused again.
    """
    before = _INTERPRET["on"]
    _INTERPRET["on"] = True
    try:
        yield
    finally:
        _INTERPRET["on"] = before


def interpreting() -> bool:
    """Whether CPU calls run under triton's interpreter now (inside :func:`interpreter`); the
    deformable kernels (``qkv.ops.deformable.triton_launch``) follow the same switch."""
    return _INTERPRET["on"]


@functools.cache
def triton_available() -> str | None:
    """None when triton can be imported, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"triton cannot be imported ({type(e).__name__}: {e}); pip install 'qkv[triton]'"
    return None


class TritonBackend:
    """Fused FlashAttention-2 forward and backward kernels in Triton, with block skipping."""

    name = "triton"
    # after torch, before tiled: on an H100 (bf16, T = 1k-16k, D = 64/128) torch's cuDNN and
    # flash kernels beat these on every call torch takes (plain, causal, dense masks),
    # so auto runs triton only for the structured masks torch cannot take
    # (benchmarks/RESULTS.md, "Triton on an H100")
    priority = 15
    traceable = False  # kernels not yet registered as torch.library custom ops

    def supports(self, call: AttentionCall) -> str | None:
        return _why_not(call)

    def run(self, call: AttentionCall) -> BackendResult:
        if call.query.numel() == 0 or call.S == 0 or 0 in call.out_shape:
            return ReferenceBackend().run(call)  # no block to run: shapes and grads as plain math
        out, lse = triton_attention(call)
        return BackendResult(out=out, lse=lse)


def _why_not(call: AttentionCall) -> str | None:
    """None when the kernels can take ``call``, else the reason, naming what can."""
    if call.sinks is not None:
        return "the triton kernels have no attention sinks (the tiled and reference backends do)"
    device = call.device.type
    if device == "cpu" and not _INTERPRET["on"]:
        return (
            "the triton kernels run on CUDA tensors; these are on cpu (tiled and torch run "
            "there; on CPU the kernels run only under qkv.ops.triton.interpreter(), for tests)"
        )
    if device not in ("cuda", "cpu"):
        return f"the triton kernels run on CUDA tensors; these are on {device}"
    missing = triton_available()
    if missing is not None:
        return missing
    if call.dropout_p > 0:
        return "the triton kernels have no dropout (use torch or reference, or dropout_p=0.0)"
    if call.attn_mask is not None:
        return (
            "the triton kernels take no dense attn_mask; describe the mask as a mask_mod "
            "(qkv.masks) or use tiled"
        )
    if call.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the triton kernels take float16, bfloat16 or float32, got {call.dtype} (use tiled)"
    if call.dtype == torch.float32 and device == "cuda":
        return (
            "the triton kernels take float16 or bfloat16 on CUDA: their float32 path (exact "
            "IEEE dots, for the CPU interpreter's tests) spills registers on a GPU; cast to "
            "bfloat16, or use torch or tiled for float32"
        )
    B, H = call.BH
    if B * H > _MAX_GRID_Y:
        return (
            f"the triton kernels launch one program row per (batch, head): B * H = {B * H} "
            f"exceeds CUDA's grid limit {_MAX_GRID_Y}; split the batch (or use tiled)"
        )
    for name, n in (("D", call.D), ("Dv", call.Dv)):
        if not 1 <= n <= MAX_HEAD_DIM:
            return (
                f"the triton kernels take head dims up to {MAX_HEAD_DIM}, got {name}={n} "
                f"(use tiled)"
            )
    mask = _kernel_mask(call)
    if isinstance(mask, str):
        return mask
    return _score_reason(call)


def _score_reason(call: AttentionCall) -> str | None:
    mod = call.score_mod
    if mod is None or isinstance(mod, _Softcap):
        return None
    if isinstance(mod, _Alibi):
        if mod.slopes.requires_grad and torch.is_grad_enabled():
            return (
                "the triton kernels give no gradient to ALiBi slopes that require grad "
                "(use tiled, or pass slopes.detach())"
            )
        return None
    return (
        f"the triton kernels apply only qkv.masks.softcap and qkv.masks.alibi as score_mod, "
        f"not {mod!r} (use tiled)"
    )


def triton_attention(call: AttentionCall, *, blocks: Blocks | None = None) -> tuple[Tensor, Tensor]:
    """Run ``call`` on the kernels; return the output and the log-sum-exp (``-inf`` on rows
    with no key). ``blocks`` overrides the block sizes (tests use small ones to get many).

    Shape:
        -> out ``(*batch, T, Dv)``, lse ``(*batch, T)`` float32.
    """
    reason = _why_not(call)
    if reason is not None:
        raise ValueError(reason)
    B, H = call.BH
    q, k, v, G = _inputs_4d(call)  # (B, H, T, D), (B, G, S, D), (B, G, S, Dv)
    mask = _kernel_mask(call)
    if isinstance(mask, str):  # refused by _why_not above
        raise ValueError(mask)
    mod = call.score_mod
    slopes = None
    if isinstance(mod, _Alibi):
        slopes = mod.slopes.detach().to(call.device, torch.float32).expand(H).contiguous()  # (H,)
    plan = _Plan(
        B,
        H,
        G,
        call.T,
        call.S,
        call.scale,
        mask,
        mod.cap if isinstance(mod, _Softcap) else None,
        slopes,
        blocks or default_blocks(max(call.D, call.Dv), banded=mask.hi is not None),
        call.device.type == "cpu",
        call.device,
    )
    plan.extras = _mask_tensors(plan)
    out, lse = _TritonAttention.apply(plan, q, k, v)  # (B, H, T, Dv), (B, H, T)
    return out.reshape(call.out_shape), lse.reshape(call.batch + (call.T,))


def _inputs_4d(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor, int]:
    """query as (B, H, T, D) and key/value with their own G heads (no GQA copy): the kernels
    map query head h to kv head h // (H // G). Broadcast dims are expanded views."""
    B, H = call.BH
    q = call.query.expand(call.batch + call.query.shape[-2:]).reshape(B, H, call.T, call.D)
    if call.enable_gqa:
        G = call.key.shape[-3]
        kv_batch = call.batch[:-1] + (G,)
    else:
        G, kv_batch = H, call.batch

    def four(t: Tensor) -> Tensor:
        return t.expand(kv_batch + t.shape[-2:]).reshape(B, G, *t.shape[-2:])

    return q, four(call.key), four(call.value), G
