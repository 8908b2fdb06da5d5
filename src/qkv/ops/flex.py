"""The ``flex`` backend: torch's compiled FlexAttention, with qkv's contract on top.

qkv does not out-write every peer's kernel. On an H100 (bf16, T = 1k-16k, D = 128) compiled
FlexAttention ran windows and documents 1.3-2.7x faster than qkv's triton kernels
(benchmarks/RESULTS.md, "The public API on an H100 ..."), so on CUDA ``auto`` sends the
structured masks torch's SDPA cannot take here. What qkv adds around the kernel:

  * the vocabulary: qkv's ready-made ``mask_mod``/``score_mod`` objects, their combinations
    and plain functions, as Flex takes them (``_flex_mask``, ``_flex_score``);
  * block masks built from qkv's own block classification (``MaskMod.blocks``: exact, from
    each block's index bounds, nothing ``(T, S)``-sized) and kept across calls by mask
    structure and sizes, the mask's tensors by identity and version counter (no value is
    read on the host: a document mask's ids changed in place give a new block mask);
  * the contract: rows that may attend to nothing give exactly 0 (Flex's own answer, with
    its lse ``-inf``); NaN/inf in keys a row may not see changes nothing
    (``ops/nonfinite.py``, as for every backend); traces from Flex's lse.

Supports: CUDA, and CPU for inference (Flex's CPU kernel has no backward); float16, bfloat16
and float32; ``(B, H, T, D)`` query with ``(B, G, S, D)`` key and value (GQA by
``enable_gqa``), D == Dv a power of two in [16, 256]; ``is_causal``, ``mask_mod``,
``score_mod``. Not: a dense ``attn_mask`` (torch's SDPA takes those), dropout, sinks, empty
sizes, float64 (tiled and reference take each of these), or a machine where torch cannot
compile (no C++ compiler on CPU, no triton on CUDA): it declines and says why.

Compilation: one ``torch.compile(flex_attention)`` for the process, called eagerly; under a
caller's ``torch.compile`` ``flex_attention`` itself is called and compiled with the graph.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim; nq/nk query/key blocks of 128.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import sysconfig

import torch
from torch import Tensor

from ..masks import MaskMod, ScoreMod, and_masks, causal
from ..masks.blocks import EMPTY, FULL, Grid, block_states
from ..masks.vocabulary import _Combined, _Function, _ScoreFunction
from .base import BackendFailedError, BackendResult, compiling_plainly, tracing
from .call import AttentionCall
from .plan_cache import PlanCache

__all__ = ["FlexBackend", "flex_available"]

BLOCK = 128  # Flex's own default block, queries and keys alike
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_block_masks = PlanCache(64)


class FlexBackend:
    """Compiled FlexAttention (torch), for the mask and score vocabulary."""

    name = "flex"
    # after torch (plain, causal and dense masks: cuDNN/flash won those on an H100), before
    # triton (which compiled Flex beat 1.3-2.7x on windows and documents there)
    priority = 12

    def traceable(self, call: AttentionCall) -> bool:
        return compiling_plainly()  # flex_attention compiles with the caller's graph; export
        # and torch.func transforms take the tiled custom op or the plain math instead

    def supports(self, call: AttentionCall) -> str | None:
        return _why_not(call)

    def auto_prefers(self, call: AttentionCall) -> bool:
        """``auto`` sends calls here on CUDA only. On CPU its first call compiles C++ for tens
        of seconds, it has no backward, and on this project's AVX-512 CPU the tiled backend
        ran fp32 windows faster (issue 38 measures the CPU choice)."""
        return call.device.type == "cuda"

    def run(self, call: AttentionCall) -> BackendResult:
        if tracing():  # (compiled with the caller's graph: its compiler's errors are its own)
            out, lse = flex_attention_call(call)
        else:
            out, lse = _built(call)
        return BackendResult(out=out, lse=lse)


# Calls whose kernels torch could not build on this machine, by kind -> why. On an H200 (torch
# 2.11) inductor failed to build Flex for GQA at odd lengths (B=2, H=4, G=2, T=97, S=113, D=64,
# with gradients): every mask in float32, every structured mask in half ("InductorError" in
# select_algorithm, 2026-11-28). A kind seen failing is declined with the reason after that,
# so ``auto`` takes the next backend, and ``explain`` says why.
_failed: dict[tuple, str] = {}
_built_kinds: set[tuple] = set()  # kinds whose forward (and backward, wanted) built


def _kind(call: AttentionCall) -> tuple:
    """What a compiled Flex kernel is built for: device, dtype, shapes, gradient, and the
    mask's and score's types (their code; not the tensors they hold)."""
    mods = tuple(type(m).__name__ for m in (call.mask_mod, call.score_mod))
    shapes = tuple(tuple(t.shape) for t in (call.query, call.key, call.value))
    return (call.device.type, call.dtype, shapes, call.wants_grad, call.is_causal, mods)


def _built(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """:func:`flex_attention_call`, after making sure its kernels build for calls of this
    kind: the first call of a kind that wants a gradient runs a trial forward and backward on
    detached copies (the backward compiles at its first use, past the point where a failure
    could still go to another backend). A compiler failure marks the kind (``_failed``) and
    raises :class:`BackendFailedError`."""
    kind = _kind(call)
    if kind not in _built_kinds:
        from torch._dynamo.exc import TorchDynamoException

        try:
            if call.wants_grad:
                _trial_backward(call)
            result = flex_attention_call(call)
        except TorchDynamoException as e:  # inductor's and dynamo's errors, not the call's
            first = (str(e).strip().splitlines() or [""])[0][:300]
            why = _failed[kind] = (
                f"compiled FlexAttention could not be built for calls of this kind on this "
                f"machine ({type(e).__name__}: {first})"
            )
            raise BackendFailedError(why) from e
        _built_kinds.add(kind)
        return result
    return flex_attention_call(call)


def _trial_backward(call: AttentionCall) -> None:
    """One forward and backward on detached copies of the call's inputs (what wants a
    gradient wants it here too), so that both kernels are compiled."""
    q, k, v = (
        t.detach().requires_grad_(t.requires_grad) for t in (call.query, call.key, call.value)
    )
    out, _ = flex_attention_call(dataclasses.replace(call, query=q, key=k, value=v))
    wrt = [t for t in (q, k, v) if t.requires_grad]
    if wrt:
        torch.autograd.grad(out, wrt, torch.ones_like(out))


def _why_not(call: AttentionCall) -> str | None:
    """None when compiled Flex can take ``call``, else why not, naming what can."""
    if call.sinks is not None:
        return "FlexAttention has no attention sinks (the tiled and reference backends do)"
    if call.attn_mask is not None:
        return (
            "the flex backend takes masks as mask_mod, not a dense attn_mask (torch, tiled "
            "and reference take attn_mask)"
        )
    if call.dropout_p > 0:
        return "FlexAttention has no dropout (torch and reference have)"
    if call.dtype not in _DTYPES:
        return f"the flex backend takes float16, bfloat16 or float32, got {call.dtype} (use tiled)"
    device = call.device.type
    if device not in ("cuda", "cpu"):
        return f"the flex backend runs on CUDA and CPU tensors; these are on {device}"
    if device == "cpu" and call.wants_grad:
        return (
            "FlexAttention's CPU kernel has no backward (inputs require grad): the tiled "
            "backend has one"
        )
    q, k, v = call.query, call.key, call.value
    if not (q.dim() == k.dim() == v.dim() == 4):
        return (
            f"the flex backend takes 4-D (B, H, T, D) inputs, got {q.dim()}-D, {k.dim()}-D "
            f"and {v.dim()}-D"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        return (
            f"the flex backend takes one batch size and key/value heads alike, got query "
            f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
        )
    if q.shape[1] != k.shape[1] and not call.enable_gqa:
        return f"got {q.shape[1]} query heads and {k.shape[1]} key heads without enable_gqa"
    D, Dv = call.D, call.Dv
    if Dv != D or D < 16 or D > 256 or D & (D - 1):
        return (
            f"the flex backend takes one head dim for keys and values, a power of two in "
            f"[16, 256]; got D={D}, Dv={Dv} (tiled takes any)"
        )
    if call.T == 0 or call.S == 0:
        return "the flex backend takes no empty sizes (T or S of 0: tiled and reference do)"
    if _failed and not tracing():
        failed = _failed.get(_kind(call))
        if failed is not None:
            return failed
    return flex_available(device)


def flex_available(device: str) -> str | None:
    """None when FlexAttention can be compiled for ``device`` here, else why not.

    Under torch.compile the answer is None without looking: the caller's graph is being
    compiled already, and Flex compiles with it (dynamo cannot trace the file-system look-ups,
    and marking them constant would import dynamo with qkv)."""
    if torch.compiler.is_compiling():
        return None
    return _flex_available(device)


@functools.cache
def _flex_available(device: str) -> str | None:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as e:  # torch older than 2.5
        return f"this torch ({torch.__version__}) has no FlexAttention ({e})"
    if device == "cuda":
        try:
            import triton  # noqa: F401
        except Exception as e:
            return f"compiled FlexAttention on CUDA needs triton ({type(e).__name__}: {e})"
        return None
    compiler = sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None and shutil.which("g++") is None:
        return (
            "compiled FlexAttention on CPU needs a C++ compiler (torch.compile's inductor), "
            "and none was found; the tiled backend needs none"
        )
    return None


@functools.cache
def _compiled():
    """The process's one compiled FlexAttention (each new shape class compiles once; dynamo
    marks a size dynamic after it changes)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention_call(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """Run ``call`` through FlexAttention: the output and the lse (float32; None on CPU).

    Shape:
        ``(B, H, T, D)`` and ``(B, H, T)``.
    """
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = call.query, call.key, call.value
    mask_mod = _mask_of(call)
    block_mask = None if mask_mod is None else _block_mask(mask_mod, call)
    score_mod = None if call.score_mod is None else _flex_score(call.score_mod)
    attend = flex_attention if tracing() else _compiled()
    # Flex's compiled CPU kernel gives no lse ("return_lse is not supported yet", torch 2.13):
    # a trace of a CPU call computes it from the scores instead
    with_lse = call.device.type == "cuda"
    result = attend(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=call.scale,
        enable_gqa=call.enable_gqa and q.shape[1] != k.shape[1],
        **(_lse_request() if with_lse else {}),
    )
    if not with_lse:
        return result, None
    out, lse = result
    if not isinstance(lse, Tensor):  # an AuxOutput (return_aux)
        lse = lse.lse
    return out, lse


@functools.cache
def _lse_request() -> dict:
    """How this torch asks Flex for the lse: ``return_aux`` (2.9+) or ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _mask_of(call: AttentionCall) -> MaskMod | None:
    """The call's whole mask as one mask_mod: ``is_causal`` (top-left) and its mask_mod."""
    if not call.is_causal:
        return call.mask_mod
    top_left = causal().bind(*call.BH, call.T, call.S)
    return top_left if call.mask_mod is None else and_masks(top_left, call.mask_mod)


def _block_mask(mask_mod: MaskMod, call: AttentionCall):
    """Flex's BlockMask of ``mask_mod`` for this call's sizes, kept across calls (not while
    tracing: built in the graph there)."""
    B, H = call.BH
    if tracing():
        return _build_block_mask(mask_mod, B, H, call.T, call.S, call.device)
    key = _mask_key(mask_mod)
    if key is None:  # a mask whose structure cannot be told without reading it: per call
        return _build_block_mask(mask_mod, B, H, call.T, call.S, call.device)
    full_key = (key, B, H, call.T, call.S, str(call.device))
    return _block_masks.get(
        full_key, lambda: _build_block_mask(mask_mod, B, H, call.T, call.S, call.device)
    )


def _mask_key(mod) -> tuple | None:
    """A key equal for masks that allow the same pairs: the mask's type and numbers, its
    tensors by identity and version counter (the cached entry holds the mask, so the tensor
    and its id stay alive with it). Inference tensors keep no version counter: None."""
    try:
        tensors = tuple((id(t), t._version) for t in mod.tensors())
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
    if isinstance(mod, _Function):
        return ("function", id(mod.fn), tensors)
    if isinstance(mod, _Combined):
        parts = tuple(_mask_key(m) for m in mod.mods)
        return None if None in parts else (mod.op, parts)
    numbers = tuple(
        (name, value)
        for name, value in sorted(vars(mod).items())
        if isinstance(value, (int, float, str, bool, type(None)))
    )
    return (type(mod).__qualname__, numbers, tensors)


def _build_block_mask(mask_mod: MaskMod, B: int, H: int, T: int, S: int, device):
    """A BlockMask from qkv's block classification: per query block, the partial key blocks
    (the mask is evaluated there) and the full ones (it is not), partial/full first in each
    row by a stable sort, all in tensor ops.

    Shape:
        block states ``(B or 1, H or 1, nq, nk)``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    states = block_states(mask_mod, Grid(B, H, T, S, BLOCK, BLOCK, device))  # (B?, H?, nq, nk)
    partial = (states != FULL) & (states != EMPTY)
    full = states == FULL

    def listed(which: Tensor) -> tuple[Tensor, Tensor]:
        count = which.sum(-1, dtype=torch.int32)  # (B?, H?, nq)
        order = torch.argsort((~which).to(torch.int8), dim=-1, stable=True)  # chosen first
        return count, order.to(torch.int32)  # (B?, H?, nq), (B?, H?, nq, nk)

    kv_num, kv_idx = listed(partial)
    full_num, full_idx = listed(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=_flex_mask(mask_mod),
        seq_lengths=(T, S),
    )


def _flex_mask(mod: MaskMod):
    """``mod`` as Flex calls a mask_mod (per element): a plain function as it was written,
    combinations part by part, qkv's ready-made masks as they are (broadcasting ops)."""
    if isinstance(mod, _Function):
        return mod.fn
    if isinstance(mod, _Combined):
        parts = [_flex_mask(m) for m in mod.mods]
        both = mod.op == "and"

        def combined(b, h, q_idx, kv_idx):
            result = parts[0](b, h, q_idx, kv_idx)
            for part in parts[1:]:
                other = part(b, h, q_idx, kv_idx)
                result = (result & other) if both else (result | other)
            return result

        return combined
    return mod


def _flex_score(mod: ScoreMod):
    """``mod`` as Flex calls a score_mod: a plain function as written, else the object."""
    return mod.fn if isinstance(mod, _ScoreFunction) else mod


def clear_block_mask_cache() -> None:
    _block_masks.clear()
