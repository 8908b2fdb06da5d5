"""What the triton kernels are told besides q, k, v: the mask, the block sizes, the block lists.

The mask becomes a few numbers (:func:`_kernel_mask`: a band ``lo <= kv - q <= hi``, key
lengths, document ids) and its tensors on the device (:func:`_mask_tensors`); :class:`Blocks`
holds the block sizes, warps and stages (:func:`default_blocks`, measured); :class:`_Plan`
gathers them and lists, per query block, the FULL and PARTIAL key blocks from
``qkv.masks.block_states`` -- the classification the tiled backend uses -- kept for recent
calls in a plan cache. Nothing here imports triton.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim; nq/nk query/key blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

import torch
from torch import Tensor

from ...masks import (
    FULL,
    PARTIAL,
    Grid,
    _Combined,
    _Document,
    _KeysBefore,
    _Window,
    and_masks,
    block_states,
    causal,
    structure_key,
)
from ..call import AttentionCall
from ..plan_cache import PlanCache

__all__ = ["Blocks", "clear_block_list_cache", "default_blocks", "first_blocks"]


# --- the mask ------------------------------------------------------------------------------


@dataclass
class _Mask:
    """A mask the kernels evaluate: ``lo <= kv - q <= hi`` (None = unbounded), ``kv <
    kv_len[b]`` and ``q_doc[b, q] == kv_doc[b, kv]``."""

    lo: int | None = None
    hi: int | None = None
    kv_len: int | Tensor | None = None
    docs: tuple[Tensor, Tensor] | None = None
    parts: list = field(default_factory=list)  # the mask_mods, for the block classification


def _and_parts(mod):
    if isinstance(mod, _Combined) and mod.op == "and":
        for m in mod.mods:
            yield from _and_parts(m)
    else:
        yield mod


def _kernel_mask(call: AttentionCall) -> _Mask | str:
    """The call's mask_mod and is_causal as a ``_Mask``, or why the kernels cannot evaluate it."""
    mask = _Mask()
    parts = list(_and_parts(call.mask_mod)) if call.mask_mod is not None else []
    if call.is_causal:
        parts.append(causal().bind(*call.BH, call.T, call.S))
    for m in parts:
        if isinstance(m, _Window):
            off = m._off()
            if m.left is not None:
                lo = off - m.left
                mask.lo = lo if mask.lo is None else max(mask.lo, lo)
            if m.right is not None:
                hi = off + m.right
                mask.hi = hi if mask.hi is None else min(mask.hi, hi)
        elif isinstance(m, _KeysBefore) and m.name == "key_lengths":
            n = m.n
            if mask.kv_len is None:
                mask.kv_len = n
            elif isinstance(n, int) and isinstance(mask.kv_len, int):
                mask.kv_len = min(n, mask.kv_len)
            else:
                mask.kv_len = torch.minimum(
                    torch.as_tensor(mask.kv_len, device="cpu"), torch.as_tensor(n, device="cpu")
                )  # (B,) or (1,)
        elif isinstance(m, _Document) and mask.docs is None:
            mask.docs = (m.q_ids, m.kv_ids)
        else:
            return (
                f"the triton kernels evaluate causal, sliding_window, key_lengths and one "
                f"document mask and their and_masks, not {m!r} (use tiled)"
            )
    mask.parts = parts
    return mask


# --- block sizes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    """Block sizes of the forward (m queries x n keys), the backward's dK/dV (m1 x n1) and
    dQ (m2 x n2) kernels, and their warps and pipeline stages (forward, dK/dV, dQ; the
    interpreter ignores these two)."""

    m: int = 128
    n: int = 64
    m1: int = 32
    n1: int = 128
    m2: int = 128
    n2: int = 32
    warps: tuple[int, int, int] = (8, 8, 8)
    stages: tuple[int, int, int] = (3, 3, 3)


def default_blocks(D: int, banded: bool = False) -> Blocks:
    """Blocks for half inputs with head dims padded to at most ``D``; ``banded``: the mask
    has an upper band (causal, sliding windows), which changes the best forward at D <= 64.

    Measured on an H100 and an H200 (bf16, 16k tokens, H*D = 2048; each kernel's
    configurations timed with the others fixed: ``benchmarks/tune_triton.py``, RESULTS.md
    "Triton block sizes, measured"). The first choice (:func:`first_blocks`, picked by
    compiling for sm_90 without a GPU: no register spills, shared memory within an A100's
    164 KiB) stays where nothing beat it.

    * D <= 64: the forward with 4 warps for banded masks (causal 1.4x faster than 8 warps at
      T = 1k-16k) and 8 otherwise (4 warps lost 4-6% without a mask and 23-26% on documents);
      dK/dV on 64 x 64 blocks with 4 warps, dQ on 128 x 64 blocks with 2 stages.
    * D = 128: the forward on 128 x 128 blocks (1.07-1.29x), dK/dV on 64 x 128, dQ on 128 x 64.

    A GPU with less shared memory gets fewer stages at launch (:func:`_launch`).
    """
    if _pad(D) <= 64:
        return Blocks(
            m=128,
            n=64,
            m1=64,
            n1=64,
            m2=128,
            n2=64,
            warps=(4 if banded else 8, 4, 8),
            stages=(3, 3, 2),
        )
    return Blocks(m=128, n=128, m1=64, n1=128, m2=128, n2=64, warps=(8, 8, 8), stages=(3, 2, 3))


def first_blocks(D: int) -> Blocks:
    """The untuned blocks :func:`default_blocks` gave before the H100 measurements (kept as the
    baseline of ``benchmarks/tune_triton.py --baseline``)."""
    return Blocks() if _pad(D) <= 64 else Blocks(stages=(3, 2, 3))


def _pad(n: int) -> int:
    """The block width a head dim is padded to: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())


# --- the plan and its block lists ----------------------------------------------------------


class _Extras(TypedDict, total=False):
    """The mask's tensors on the device, as the kernels read them."""

    kv_len: Tensor  # (B,) int32
    docs: tuple[Tensor, Tensor]  # (B?, T), (B?, S) int32


@dataclass
class _Plan:
    """What the three kernels need besides q, k, v, out, lse."""

    B: int
    H: int
    G: int
    T: int
    S: int
    scale: float
    mask: _Mask
    cap: float | None
    slopes: Tensor | None  # (H,) float32 on the device, or None
    blocks: Blocks
    interpret: bool
    device: torch.device
    extras: _Extras = field(default_factory=_Extras)  # kv_len, docs on the device
    _lists: dict = field(default_factory=dict)  # (bm, bn, transposed) -> block lists

    def lists(self, bm: int, bn: int, transposed: bool = False) -> tuple[Tensor, ...]:
        """``(full_num, full_idx, part_num, part_idx)`` for blocks of bm x bn: per query block
        (per key block when ``transposed``) how many FULL / PARTIAL blocks and which, in order.
        The states are ``qkv.masks.block_states``'s, except that a last key block cut short by
        S is PARTIAL rather than FULL (its mask checks ``kv < S``).

        Shape:
            num ``(B, H, nq)`` (expanded views: stride 0 where the mask does not depend on
            b or h), idx ``(B?, H?, nq, nk)`` int32; transposed: nq and nk swapped.
        """
        key = (bm, bn, transposed)
        if key not in self._lists:
            structure = tuple(structure_key(p) for p in self.mask.parts)
            if None in structure:  # a mask that cannot be keyed: planned anew
                self._lists[key] = _block_lists(self, bm, bn, transposed)
            else:
                self._lists[key] = _block_list_cache.get(
                    ("triton", structure, self.B, self.H, self.T, self.S, *key, str(self.device)),
                    lambda: _block_lists(self, bm, bn, transposed),
                )
        return self._lists[key]


def _mask_tensors(plan: _Plan) -> _Extras:
    """Key lengths ``(B,)`` and document ids ``(B?, T)``, ``(B?, S)`` as int32 on the device."""
    dev, extras = plan.device, _Extras()
    n = plan.mask.kv_len
    if n is not None:
        n = torch.as_tensor(n, device=dev).reshape(-1).clamp(max=plan.S)
        extras["kv_len"] = n.expand(plan.B).to(torch.int32).contiguous()  # (B,)
    if plan.mask.docs is not None:
        q_ids, kv_ids = (t.to(dev, torch.int32).contiguous() for t in plan.mask.docs)
        extras["docs"] = (q_ids, kv_ids)  # (B?, T), (B?, S)
    return extras


# Block lists of recent calls, by mask structure and sizes (qkv.ops.plan_cache): on an H100 at
# T=4096 listing a window's blocks took 1.7 ms of host work per call against 0.4 ms of kernel.
_block_list_cache = PlanCache(64)


def clear_block_list_cache() -> None:
    """Forget every remembered block list (they are rebuilt on the next call)."""
    _block_list_cache.clear()


def _block_lists(plan: _Plan, bm: int, bn: int, transposed: bool) -> tuple[Tensor, ...]:
    grid = Grid(plan.B, plan.H, plan.T, plan.S, bm, bn, plan.device)
    parts = plan.mask.parts
    if not parts:
        states = torch.full((1, 1, grid.nq, grid.nk), FULL, dtype=torch.int8, device=plan.device)
    else:
        mod = parts[0] if len(parts) == 1 else and_masks(*parts)
        states = block_states(mod.bind(plan.B, plan.H, plan.T, plan.S), grid)  # (B?, H?, nq, nk)
        states = states.to(plan.device)
    assert states.shape[1] == 1, "the dK/dV kernel shares block lists across a group's heads"
    if plan.S % bn:  # the last key block ends at S: visited as PARTIAL, which checks kv < S,
        states = states.clone()  # so FULL blocks never test bounds
        last = states[..., -1]
        states[..., -1] = torch.where(last == FULL, PARTIAL, last)
    if transposed:
        states = states.transpose(-1, -2)  # (B?, H?, nk, nq)
    n = states.shape[-1]
    order = torch.arange(n, device=plan.device, dtype=torch.int32)
    out = []
    for kind in (FULL, PARTIAL):
        chosen = states == kind
        num = chosen.sum(-1, dtype=torch.int32)  # (B?, H?, rows)
        idx = torch.where(chosen, order, order + n).argsort(-1).to(torch.int32)  # chosen first
        out += [num.expand(plan.B, plan.H, -1), idx.contiguous()]
    return tuple(out)
