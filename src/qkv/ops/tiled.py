"""Tiled backend: FlashAttention's algorithm in PyTorch ops, for structured masks.

Supports: CPU and CUDA; float64/32, bfloat16, float16; ``mask_mod``/``score_mod`` (see
``qkv.masks``), dense bool or float ``attn_mask``, ``is_causal``, GQA, broadcast leading dims,
forward and backward (a float ``attn_mask`` that requires grad gets its gradient, through the
``matmul`` inner kernel). Not supported: dropout (use ``torch`` or ``reference``).

The algorithm (Dao et al. 2022, FlashAttention; Rabe & Staats 2021): queries are cut into tiles
of ``bq`` rows and keys into blocks of ``bk``. Before any arithmetic, the mask classifies every
(tile, block) pair as empty, partial or full from index bounds alone (``MaskMod.blocks``):
empty pairs are never computed, full ones need no mask. Each query tile visits the key blocks
it needs in chunks of consecutive blocks; each chunk gives an output normalised over its keys
and the log-sum-exp of its scores, and chunks merge by their log-sum-exps (the online
softmax). Only the output and the log-sum-exp are kept: extra memory is O(T + S) plus one
chunk's scores. Backward recomputes each chunk's weights from the saved log-sum-exp.

Tiles are joined into units before any arithmetic (``_units``), so that the kernel sees few,
large calls: consecutive tiles that visit the same keys become one tall tile (a document's
rows; its partial edge blocks are then cut to the keys every row may attend, and a tile
straddling two documents is cut at the boundary, so it needs no mask: ``_trim_edges``,
``_split_rows``), and, for masks and score_mods that depend on ``kv - q`` only
(``masks.shift_invariant``: windows, ALiBi), consecutive tiles whose chunks sit at the same
place relative to the tile become a *diagonal group*: one kernel call for all of them, with
the keys read through an overlapping strided view and one mask shared by every tile.
The units of a call are cached by mask structure and sizes (``masks.structure_key``,
``clear_plan_cache``), so a model's next layer or step with the same mask skips planning.

Two inner kernels compute a chunk:
  * ``flash``: torch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
    and its backward), which returns the chunk's log-sum-exp. Its backward takes the *global*
    output and log-sum-exp, which is exactly the per-chunk decomposition FlashAttention's
    backward needs. Used on CPU when D == Dv and the score_mod is absent or additive.
  * ``matmul``: matmul, softmax and matmul in PyTorch ops; any device, any score_mod (its
    gradient by autograd on the chunk), and gradients for tensors a score_mod reads.
Half precision: the ``matmul`` kernel multiplies in float32 (a score_mod sees scores not
rounded to half, and the weights meet the values unrounded), and the softmax, the merge and
all gradient accumulation are float32 on both kernels; on CPU, float16 inputs and half inputs
with a float32 attn_mask run in float32 (``AttentionCall.work_dtype``).

Shape alphabet: B batch, H query heads, T query length, S key length, D head dim, Dv value
head dim; a tile has ``tq`` queries and a chunk ``kc`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..masks import (
    EMPTY,
    FULL,
    Grid,
    MaskMod,
    ScoreMod,
    and_masks,
    block_states,
    causal,
    evaluate_mask,
    evaluate_score,
    index_grid,
    score_mod_gradient_inputs,
    shift_invariant,
    structure_key,
)
from ._aten import flash_backward, flash_cpu_available, flash_forward
from .base import BackendResult
from .call import AttentionCall
from .plan_cache import PlanCache
from .reference import ReferenceBackend

__all__ = [
    "TiledBackend",
    "clear_plan_cache",
    "merge_by_lse",
    "piece_backward",
    "piece_forward",
    "tiled_attention",
]

BLOCK_Q = 64  # query rows per tile
BLOCK_K = 64  # keys per block (the unit of skipping)
MIN_FULL_RUN = 8  # full blocks worth a chunk of their own (no mask) rather than riding along
CHUNK_ELEMENTS = 1 << 22  # B*H*tq*kc scores per chunk: 16 MiB in float32


class TiledBackend:
    """Blockwise exact attention with block skipping for structured masks."""

    name = "tiled"
    priority = 20  # after torch and triton, before reference

    def supports(self, call: AttentionCall) -> str | None:
        if call.dropout_p > 0:
            return "tiled has no dropout (use torch or reference, or dropout_p=0.0)"
        return None

    def traceable(self, call: AttentionCall) -> bool:
        """Under torch.compile, calls whose masks the custom ops can carry (``tiled_op``)."""
        from . import tiled_op

        return tiled_op.usable(call)

    def run(self, call: AttentionCall) -> BackendResult:
        if _nothing_to_tile(call):
            return ReferenceBackend().run(call)
        if torch.compiler.is_compiling():
            from . import tiled_op

            if tiled_op.usable(call):
                out, lse = tiled_op.tiled_attention_op(call)
                return BackendResult(out=out, lse=lse)
        out, lse = tiled_attention(call)
        return BackendResult(out=out, lse=lse)


def _nothing_to_tile(call: AttentionCall) -> bool:
    """Empty sizes (no tile at all) and meta tensors (no values to plan blocks on): the
    reference gives the right shapes, dtypes and autograd graph at no cost there."""
    return (
        call.query.numel() == 0 or call.S == 0 or 0 in call.out_shape or call.device.type == "meta"
    )


@dataclass(frozen=True)
class _Unit:
    """Query rows ``[t0, t0 + n * tq)`` computed together: ``n`` stacked tiles of ``tq`` rows,
    tile ``m`` visiting keys ``[t0 + m*tq + a, t0 + m*tq + b)`` for each chunk ``(a, b, masked)``.

    ``n > 1`` (a *diagonal group*) needs a mask and score_mod that depend on ``kv - q`` only
    (``qkv.masks.shift_invariant``): every stacked tile then has the same chunk mask, and one
    kernel call computes them all, reading the keys through an overlapping strided view.
    """

    t0: int
    tq: int
    n: int
    chunks: tuple[tuple[int, int, bool], ...]

    @property
    def rows(self) -> slice:
        return slice(self.t0, self.t0 + self.n * self.tq)


@dataclass
class _Plan:
    """Everything a pass needs besides q, k, v: sizes, masks and which chunks to visit."""

    B: int
    H: int
    T: int
    S: int
    scale: float
    mask_mod: MaskMod | None
    bias: Tensor | None  # a dense float attn_mask, (B?, H?, T, S); set by the Function
    score_mod: ScoreMod | None
    inner: str
    units: list[_Unit]
    device: torch.device
    group_masks: dict = field(default_factory=dict)  # (tq, a, b, dtype) -> kernel-layout mask

    def chunk_mask(self, t0: int, t1: int, k0: int, k1: int, masked: bool, dtype) -> Tensor | None:
        """The chunk's additive float mask for the flash kernel (-inf = may not attend).

        Shape:
            ``(B?, H?, tq, kc)`` or None.
        """
        add = None
        if self.bias is not None:
            # the flash kernel reads a mask with leading dims as if it were contiguous
            add = _tile(self.bias, t0, t1, k0, k1).to(dtype).contiguous()
        if self.score_mod is not None:  # additive: its bias is score_mod(0)
            b, h, q, kv = index_grid(
                self.B, self.H, t1 - t0, k1 - k0, q_start=t0, kv_start=k0, device=self.device
            )
            bias = self.score_mod(torch.zeros((), dtype=dtype, device=self.device), b, h, q, kv)
            add = bias if add is None else add + bias
        if masked:
            allowed = self.allowed(t0, t1, k0, k1)
            if add is None:
                return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(
                    ~allowed, float("-inf")
                )
            add = add.masked_fill(~allowed, float("-inf"))
        return add

    def allowed(self, t0: int, t1: int, k0: int, k1: int) -> Tensor:
        """``mask_mod`` on the chunk, as a view of every (query, key) pair even where the mask
        does not vary (a dense mask of one key column). Shape: ``(B?, H?, tq, kc)``, bool."""
        b, h, q, kv = index_grid(
            self.B, self.H, t1 - t0, k1 - k0, q_start=t0, kv_start=k0, device=self.device
        )
        ok = evaluate_mask(self.mask_mod, b, h, q, kv)
        ok = ok.reshape((1,) * (4 - ok.dim()) + tuple(ok.shape))
        return ok.expand(*ok.shape[:2], t1 - t0, k1 - k0)


def tiled_attention(
    call: AttentionCall, *, inner: str | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> tuple[Tensor, Tensor]:
    """Run ``call`` tiled; return the output and the log-sum-exp (``-inf`` on rows with no key).

    ``inner`` forces ``"flash"`` or ``"matmul"`` (tests compare the two); None picks.

    Shape:
        -> out ``(*batch, T, Dv)``, lse ``(*batch, T)`` float32 (float64 for float64 inputs).
    """
    q, k, v, bias = work_inputs(call)
    B, H = call.BH
    if bias is not None and bias.requires_grad:
        inner = _refuse_flash(inner, "a float attn_mask that requires grad")
    plan = _plan(call, B, H, inner, block_q, block_k, q.dtype)
    # tensors the score_mod reads that want gradients (ValueError if hidden)
    grads: tuple[Tensor, ...] = ()
    if plan.score_mod is not None:
        grads = score_mod_gradient_inputs(plan.score_mod, dtype=_acc(q.dtype), device=q.device)
    sinks = sinks_by_row(call)  # (B, H, T) or None
    out, lse = _TiledAttention.apply(plan, q, k, v, bias, sinks, *grads)  # (B, H, T, Dv), (B, H, T)
    out = out.to(call.dtype).reshape(call.out_shape)
    return out, lse.reshape(call.batch + (call.T,))


def work_inputs(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v as ``(B, H, L, E)`` in the work dtype (GQA heads expanded), and a float
    attn_mask as the additive bias ``(B?, H?, T, S)`` (None for none or a bool mask)."""
    q, k, v = call.as_4d()  # (B, H, T, D), (B, H, S, D), (B, H, S, Dv)
    mask = call.attn_mask
    bias = call.mask_4d(mask) if mask is not None and mask.is_floating_point() else None
    if call.work_dtype != call.dtype:
        q, k, v = q.to(call.work_dtype), k.to(call.work_dtype), v.to(call.work_dtype)
    return q, k, v, bias


def piece_forward(
    call: AttentionCall, *, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp of ``call`` as one piece of a larger attention (a ring step):
    no autograd graph, the output in the accumulation dtype so that pieces merge unrounded.
    ``call`` has no dense ``attn_mask`` and no dropout; its mask_mod and score_mod carry the
    piece's positions (``qkv.masks.offset_mask``).

    Shape:
        -> out ``(B, H, T, Dv)`` float32 (float64 for float64 inputs), lse ``(B, H, T)``.
    """
    q, k, v = _work_4d(call)
    B, H = call.BH
    plan = _plan(call, B, H, None, block_q, block_k, q.dtype)
    with torch.no_grad():
        return _forward(plan, q, k, v, out_dtype=_acc(q.dtype))


def piece_backward(
    call: AttentionCall,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
):
    """Gradients of one piece (see :func:`piece_forward`) from the *whole* attention's output
    and log-sum-exp of these query rows, FlashAttention's decomposition: the pieces' dq add
    up to the whole dq, and each piece's dk and dv are its keys' share.

    Returns:
        ``(dq, dk, dv, d_score_tensors)`` in the accumulation dtype; dk and dv with the
        call's G key/value heads (GQA groups summed).

    Shape:
        out, dout ``(B, H, T, Dv)``, lse ``(B, H, T)`` -> dq ``(B, H, T, D)``,
        dk ``(B, G, S, D)``, dv ``(B, G, S, Dv)``.
    """
    q, k, v = _work_4d(call)
    B, H = call.BH
    plan = _plan(call, B, H, None, block_q, block_k, q.dtype)
    grads: tuple[Tensor, ...] = ()
    if plan.score_mod is not None:
        grads = score_mod_gradient_inputs(plan.score_mod, dtype=_acc(q.dtype), device=q.device)
    with torch.no_grad():
        dq, dk, dv, _, dts = _backward(
            plan, q, k, v, out.to(q.dtype), lse, dout, grads, False, cast=False
        )
    if call.enable_gqa:
        G = call.key.shape[-3]
        dk = dk.view(B, G, H // G, *dk.shape[2:]).sum(2)  # (B, G, S, D)
        dv = dv.view(B, G, H // G, *dv.shape[2:]).sum(2)  # (B, G, S, Dv)
    return dq, dk, dv, dts


def _work_4d(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
    return work_inputs(call)[:3]


def _plan(
    call: AttentionCall, B: int, H: int, inner: str | None, bq: int, bk: int, dtype: torch.dtype
) -> _Plan:
    """Combine the masks into one mask_mod, classify its blocks and list the units to compute
    (reused from an earlier call with the same mask structure and sizes: see
    :func:`_cached_units`)."""
    mods = [m for m in (call.mask_mod, causal() if call.is_causal else None) if m is not None]
    mask = call.attn_mask
    if mask is not None and mask.dtype == torch.bool:
        mods.append(_DenseMask(call.mask_4d(mask)))
    mask_mod = None if not mods else (mods[0] if len(mods) == 1 else and_masks(*mods))
    if mask_mod is not None:
        mask_mod = mask_mod.bind(B, H, call.T, call.S)
    best = _pick_inner(call, dtype)
    if inner not in (None, "flash", "matmul") or (inner == "flash" and best != "flash"):
        raise ValueError(
            f"inner must be None, 'matmul' or (when it can take the call) 'flash', got {inner!r}"
        )
    return _plan_for(
        B,
        H,
        call.T,
        call.S,
        call.scale,
        mask_mod,
        call.score_mod,
        inner or best,
        call.device,
        mask is None or mask.dtype == torch.bool,
        bq,
        bk,
    )


def _plan_for(
    B: int,
    H: int,
    T: int,
    S: int,
    scale: float,
    mask_mod: MaskMod | None,
    score_mod: ScoreMod | None,
    inner: str,
    device: torch.device,
    no_float_mask: bool,
    bq: int,
    bk: int,
) -> _Plan:
    """The plan of a call with these sizes and bound masks (see :func:`_plan`)."""
    groups = (
        inner == "flash"
        and no_float_mask
        and shift_invariant(mask_mod)
        and shift_invariant(score_mod)
    )
    plan = _Plan(B, H, T, S, scale, mask_mod, None, score_mod, inner, [], device)
    structure = structure_key(mask_mod)
    if structure is None:  # a dense mask or a plain function: planned anew every call
        plan.units = _plan_units(plan, bq, bk, groups)
        return plan
    key = (structure, B, H, T, S, bq, bk, inner, groups, str(device), CHUNK_ELEMENTS)
    units, group_masks = _cached_units(key, lambda: _plan_units(plan, bq, bk, groups))
    plan.units = units
    if score_mod is None:  # the chunk masks come from the mask alone: shared too
        plan.group_masks = group_masks
    return plan


def _plan_units(plan: _Plan, bq: int, bk: int, groups: bool) -> list[_Unit]:
    """The units of ``plan`` (whose sizes, mask and inner kernel are set): blocks classified,
    chunks listed per tile, tiles joined, masked chunks trimmed and joined again."""
    grid = Grid(plan.B, plan.H, plan.T, plan.S, bq, bk, plan.device)
    if plan.mask_mod is None:
        states = torch.full((1, 1, grid.nq, grid.nk), FULL, dtype=torch.int8, device="cpu")
    else:
        states = block_states(plan.mask_mod, grid).cpu()  # (B?, H?, nq, nk)
    kc_blocks = max(1, CHUNK_ELEMENTS // (plan.B * plan.H * bq * bk))
    rows = _chunks(states, bk, plan.S, kc_blocks)
    # how many rows a merged tile may have: its masks (flash) or scores (matmul) stay bounded
    per_row = states.shape[0] * states.shape[1] if plan.inner == "flash" else plan.B * plan.H
    tiles = [
        _Unit(
            i * bq, min(bq, plan.T - i * bq), 1, tuple((a - i * bq, b - i * bq, m) for a, b, m in c)
        )
        for i, c in enumerate(rows)
        if c
    ]
    units = _units(tiles, bq, groups, CHUNK_ELEMENTS // per_row)
    if plan.mask_mod is not None:  # masked chunks cut to what their rows attend, then joined again
        plan.units = units
        pieces = [p for u in units for p in _split_rows(plan, _trim_edges(plan, u)) if p.chunks]
        units = _units(pieces, bq, False, CHUNK_ELEMENTS // per_row)
    return units


# Block plans of recent calls, by mask structure and sizes (masks.structure_key): a model
# calls attention with the same mask in every layer and step, and planning costs up to a tenth
# of a call. Units are immutable; the chunk masks of diagonal groups are shared when no
# score_mod takes part in them.
PLAN_CACHE_SIZE = 64
_plan_cache = PlanCache(PLAN_CACHE_SIZE)


def _cached_units(key: tuple, make) -> tuple[list[_Unit], dict]:
    """``(units, group_masks)`` for ``key``: from the cache, or ``make()`` and remembered."""
    return _plan_cache.get(key, lambda: (make(), {}))


def clear_plan_cache() -> None:
    """Forget every remembered block plan (they are rebuilt on the next call)."""
    _plan_cache.clear()


def _refuse_flash(inner: str | None, why: str) -> str:
    if inner == "flash":
        raise ValueError(f"inner='flash' cannot take {why}; use 'matmul'")
    return "matmul"


def _tile(t: Tensor, t0: int, t1: int, k0: int, k1: int) -> Tensor:
    """Rows [t0, t1) and columns [k0, k1) of a (B?, H?, T?, S?) tensor; size-1 dims broadcast."""
    rows = slice(t0, t1) if t.shape[-2] > 1 else slice(None)
    cols = slice(k0, k1) if t.shape[-1] > 1 else slice(None)
    return t[..., rows, cols]


def _pick_inner(call: AttentionCall, dtype: torch.dtype) -> str:
    mod = call.score_mod
    flash_ok = (
        flash_cpu_available()
        and call.device.type == "cpu"
        and call.Dv == call.D
        and dtype in (torch.float32, torch.bfloat16, torch.float64)
        and (mod is None or (mod.additive and not any(t.requires_grad for t in mod.tensors())))
    )
    return "flash" if flash_ok else "matmul"


def _chunks(states: Tensor, bk: int, S: int, kc_blocks: int) -> list[list[tuple[int, int, bool]]]:
    """Per query tile, the chunks of keys to visit: ``(k0, k1, masked)``.

    Empty blocks are left out. A run of full blocks long enough to pay for a second kernel
    call (``MIN_FULL_RUN`` blocks) becomes its own chunk without a mask; shorter ones ride
    along in the masked chunk beside them. No chunk exceeds ``kc_blocks`` blocks.
    """
    flat = states.flatten(0, 1)  # (B?*H?, nq, nk)
    kind = (flat != EMPTY).any(0).to(torch.int8) + (flat == FULL).all(0).to(torch.int8)
    nq, nk = kind.shape  # kind: 0 not needed, 1 needs the mask (for some b, h), 2 full
    start = torch.ones(nq, nk, dtype=torch.bool, device=kind.device)  # planning: on the CPU,
    # whatever torch.set_default_device says
    start[:, 1:] = kind[:, 1:] != kind[:, :-1]
    i_s, j_s = start.nonzero(as_tuple=True)  # runs of one kind, row by row
    ends = torch.cat([j_s[1:], j_s.new_tensor([nk])])
    last = torch.cat([i_s[1:] != i_s[:-1], i_s.new_ones(1, dtype=torch.bool)])  # a row's last run
    ends = torch.where(last, nk, ends)
    runs: list[list[list]] = [[] for _ in range(nq)]  # per tile: [j0, j1, masked, partial runs]
    for i, j0, j1, k in zip(i_s.tolist(), j_s.tolist(), ends.tolist(), kind[i_s, j_s].tolist()):
        if k == 0:
            continue
        masked = k == 1 or j1 - j0 < MIN_FULL_RUN  # short full runs ride along with a mask
        partial = [(j0, j1)] if k == 1 else []
        row = runs[i]
        if row and row[-1][1] == j0 and row[-1][2] == masked:
            row[-1][1] = j1
            row[-1][3].extend(partial)
        else:
            row.append([j0, j1, masked, partial])
    rows = []
    for row in runs:
        chunks = []
        for j0, j1, masked, partial in row:
            for c0 in range(j0, j1, kc_blocks):
                c1 = min(j1, c0 + kc_blocks)  # masked only if a partial block is inside
                needs_mask = masked and any(p0 < c1 and c0 < p1 for p0, p1 in partial)
                chunks.append((c0 * bk, min(c1 * bk, S), needs_mask))
        rows.append(chunks)
    return rows


def _units(tiles: list[_Unit], bq: int, groups: bool, max_elements: int) -> list[_Unit]:
    """Units joined (see :class:`_Unit`): consecutive single tiles visiting the same keys become
    one taller tile (a document's rows; at most ``max_elements`` rows x keys per chunk), and,
    when ``groups``, consecutive full tiles whose chunks sit at the same place relative to the
    tile become one diagonal group (a band's rows). Rows in no unit output 0."""
    units: list[_Unit] = []
    for u in tiles:
        last = units[-1] if units else None
        if last is not None and u.n == 1 and last.rows.stop == u.t0:
            if (
                last.n == 1
                and _absolute(last) == _absolute(u)
                and ((last.tq + u.tq) * max(b - a for a, b, _ in u.chunks) <= max_elements)
            ):
                units[-1] = _Unit(last.t0, last.tq + u.tq, 1, last.chunks)
                continue
            if groups and u.tq == last.tq == bq and last.chunks == u.chunks:
                units[-1] = _Unit(last.t0, bq, last.n + 1, u.chunks)
                continue
        units.append(u)
    return units


def _split_rows(plan: _Plan, u: _Unit) -> list[_Unit]:
    """``u`` (one masked chunk, e.g. a tile straddling two documents) cut into runs of rows
    that attend the same consecutive keys, each run a unit of its own without a mask, when
    every row's keys are consecutive and the same for every b, h; else ``[u]``."""
    if u.n > 1 or len(u.chunks) != 1 or not u.chunks[0][2]:
        return [u]
    a, b, _ = u.chunks[0]
    ok = plan.allowed(u.t0, u.t0 + u.tq, u.t0 + a, u.t0 + b)  # (B?, H?, tq, kc)
    if ok.shape[0] * ok.shape[1] != 1:
        return [u]
    ok = ok[0, 0]  # (tq, kc)
    kc = ok.shape[-1]
    count = ok.sum(-1)  # (tq,)
    first = ok.to(torch.int8).argmax(-1)  # first allowed key of each row (0 if none)
    last = kc - 1 - ok.flip(-1).to(torch.int8).argmax(-1)
    if not ((count == last - first + 1) | (count == 0)).all():
        return [u]  # some row's keys are not consecutive: keep the mask
    span = torch.stack([first, last]).masked_fill(count == 0, -1)  # (2, tq), -1: no key
    starts = [0] + (span[:, 1:] != span[:, :-1]).any(0).nonzero().flatten().add(1).tolist()
    if len(starts) > 8:
        return [u]  # rows change too often to pay for a call each
    pieces = []
    for r0, r1 in zip(starts, starts[1:] + [u.tq]):
        c0, c1 = span[:, r0].tolist()
        if c0 >= 0:
            pieces.append(_Unit(u.t0 + r0, r1 - r0, 1, ((a + c0 - r0, a + c1 + 1 - r0, False),)))
    return pieces


def _trim_edges(plan: _Plan, u: _Unit) -> _Unit:
    """``u`` with its masked chunks cut to the keys its rows may attend, when those are the
    same keys for every row (and b, h) and consecutive (a document's rows against its partial
    edge blocks): such a chunk needs no mask and joins the unmasked chunk beside it, so a
    document's rows take one kernel call without a mask. Costs one evaluation of the mask on
    the chunk, as building its mask would."""
    if u.n > 1:
        return u
    # joined chunks stay within the widest chunk the unit was planned with (matmul holds a
    # chunk's scores); the flash kernel keeps none
    max_kc = plan.S if plan.inner == "flash" else max(b - a for a, b, _ in u.chunks)
    chunks: list[tuple[int, int, bool]] = []
    for chunk in u.chunks:
        a, b, masked = chunk  # cut to the keys its rows attend, below
        if masked:
            ok = plan.allowed(u.t0, u.t0 + u.tq, u.t0 + a, u.t0 + b)  # (B?, H?, tq, kc)
            ok = ok.reshape(-1, ok.shape[-1])
            every, some = ok.all(0), ok.any(0)  # (kc,) for every / some row
            cols = every.nonzero().flatten().tolist()
            if torch.equal(every, some) and (not cols or cols[-1] - cols[0] + 1 == len(cols)):
                if not cols:
                    continue  # no row attends any of these keys
                a, b, masked = a + cols[0], a + cols[-1] + 1, False
        if (
            chunks
            and not masked
            and not chunks[-1][2]
            and chunks[-1][1] == a
            and (b - chunks[-1][0] <= max_kc)
        ):
            chunks[-1] = (chunks[-1][0], b, False)
        else:
            chunks.append((a, b, masked))
    return _Unit(u.t0, u.tq, 1, tuple(chunks))


def _absolute(u: _Unit) -> tuple:
    return tuple((u.t0 + a, u.t0 + b, m) for a, b, m in u.chunks)


class _DenseMask(MaskMod):
    """A dense bool attn_mask seen as a mask_mod, so that its empty blocks are skipped too."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask  # (B?, H?, T, S)

    def __call__(self, b, h, q_idx, kv_idx):
        idx = [
            i if n > 1 else i.new_zeros((1,) * i.dim())
            for i, n in zip((b, h, q_idx, kv_idx), self.mask.shape)
        ]  # size-1 dims broadcast
        return self.mask[idx[0], idx[1], idx[2], idx[3]]

    def __repr__(self):
        return f"attn_mask{tuple(self.mask.shape)}"


class _TiledAttention(torch.autograd.Function):
    """Forward keeps out and lse; backward recomputes each chunk's weights from lse."""

    @staticmethod
    def forward(
        ctx,
        plan: _Plan,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        sinks: Tensor | None,
        *grad_tensors: Tensor,
    ):
        plan.bias = None if bias is None else bias.detach()
        out, lse = _forward(plan, q, k, v)  # (B, H, T, Dv), (B, H, T)
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks.detach())
        ctx.plan, ctx.bias_grad = plan, bias is not None and bias.requires_grad
        ctx.has_sinks = sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks, *grad_tensors)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor):
        q, k, v, out, lse, sinks, *grad_tensors = ctx.saved_tensors
        # With sinks, out and lse are the whole softmax's (the sink a key with no value), and
        # FlashAttention's backward from them is exactly the sink-augmented attention's.
        dq, dk, dv, dbias, dts = _backward(
            ctx.plan, q, k, v, out, lse, dout, grad_tensors, ctx.bias_grad
        )
        dsinks = None
        if ctx.has_sinks and ctx.needs_input_grad[5]:
            dsinks = _sink_grad(sinks, out, lse, dout)
        return (None, dq, dk, dv, dbias, dsinks, *dts)


def sinks_by_row(call: AttentionCall) -> Tensor | None:
    """The call's sinks as one logit per row of the 4-D view, ``(B, H, T)`` (autograd sums
    the gradient back over the rows a head's logit stands for)."""
    if call.sinks is None:
        return None
    B, H = call.BH
    return call.sinks.expand(call.batch + (call.T,)).reshape(B, H, call.T)


def _sink_grad(sinks: Tensor, out: Tensor, lse: Tensor, dout: Tensor) -> Tensor:
    """The sinks' gradient, ``-p_sink * rowsum(dO * O)`` per row (a key with no value: its dP
    is 0, so its dS is ``-p_sink * delta``), from the sink-inclusive output and lse.

    Shape:
        sinks ``(B, H, T)``, out and dout ``(B, H, T, Dv)``, lse ``(B, H, T)`` -> ``(B, H, T)``.
    """
    acc = lse.dtype
    p_sink = torch.exp(sinks.to(acc) - lse)  # (B, H, T)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, T): rowsum(dO * O)
    return -(p_sink * delta).to(sinks.dtype)


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp of the softmax that also holds each row's sink (a key with no
    value): ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``. A row with no
    key keeps output 0 (``exp(-inf) = 0``).

    Shape:
        out ``(B, H, T, Dv)``, lse and sinks ``(B, H, T)`` -> out, lse.
    """
    total = torch.logaddexp(lse, sinks.to(lse.dtype))  # (B, H, T)
    return (out.to(lse.dtype) * torch.exp(lse - total).unsqueeze(-1)).to(out.dtype), total


def _forward(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, out_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """All units; each merges its chunks by log-sum-exp (the online softmax). The output is in
    ``out_dtype`` (default q's)."""
    B, H, T, Dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
    acc = _acc(q.dtype)
    out = q.new_zeros(B, H, T, Dv, dtype=out_dtype or q.dtype)  # rows with no key stay exactly 0
    lse = q.new_full((B, H, T), float("-inf"), dtype=acc)
    chunk_fn = _flash_chunk if plan.inner == "flash" else _matmul_chunk
    if any(u.n > 1 for u in plan.units):
        q, k, v = _mergeable(q), _mergeable(k), _mergeable(v)
    for u in plan.units:
        merged: tuple[Tensor, Tensor] | None = None  # the unit's output and lse so far
        t0, t1 = u.t0, u.t0 + u.tq
        for a, b, masked in u.chunks:
            if u.n == 1:
                o_c, l_c = chunk_fn(
                    plan,
                    q[:, :, t0:t1],
                    k[:, :, t0 + a : t0 + b],
                    v[:, :, t0 + a : t0 + b],
                    (t0, t1, t0 + a, t0 + b, masked),
                )  # (B, H, tq, Dv), (B, H, tq)
            else:
                o_c, l_c = _group_flash_chunk(plan, q, k, v, u, a, b, masked)  # (B*H, n, tq, Dv)
            merged = (o_c, l_c) if merged is None else merge_by_lse(*merged, o_c, l_c)
        assert merged is not None  # every unit has a chunk (the planner drops empty ones)
        o_u, l_u = merged
        out[:, :, u.rows] = o_u.reshape(B, H, -1, Dv)
        lse[:, :, u.rows] = l_u.reshape(B, H, -1)
    return out, lse


def _mergeable(x: Tensor) -> Tensor:
    """``x`` ``(B, H, L, E)``, copied only if its B and H dims cannot be read as one dim."""
    B, H = x.shape[:2]
    if H == 1 or B == 1 or x.stride(0) == H * x.stride(1):
        return x
    return x.contiguous()


def _stacked(x: Tensor, u: _Unit, a: int, b: int) -> Tensor:
    """Rows ``[t0 + m*tq + a, t0 + m*tq + b)`` of ``x`` for each stacked tile ``m`` of ``u``,
    as a view (overlapping when ``b - a > tq``). ``x`` has passed :func:`_mergeable`.

    Shape:
        x ``(B, H, L, E)`` -> ``(B*H, n, b - a, E)``.
    """
    B, H, _, E = x.shape
    s_bh = x.stride(0) if H == 1 else x.stride(1)
    return x.as_strided(
        (B * H, u.n, b - a, E),
        (s_bh, u.tq * x.stride(2), x.stride(2), x.stride(3)),
        x.storage_offset() + (u.t0 + a) * x.stride(2),
    )


def _group_mask(plan: _Plan, u: _Unit, a: int, b: int, masked: bool, dtype) -> Tensor | None:
    """The chunk mask shared by every tile of a diagonal group, laid out for the kernel's
    ``(B*H, n)`` batch dims; computed once per plan (forward and backward share it).

    Shape:
        ``(B*H or 1, 1, tq, b - a)`` or None.
    """
    key = (u.tq, a, b, masked, dtype)
    if key not in plan.group_masks:
        m = plan.chunk_mask(
            u.t0, u.t0 + u.tq, u.t0 + a, u.t0 + b, masked, dtype
        )  # (B?, H?, tq, kc)
        if m is not None and m.shape[:2] != (1, 1):
            m = m.expand(plan.B, plan.H, *m.shape[2:]).reshape(plan.B * plan.H, 1, *m.shape[2:])
        plan.group_masks[key] = m
    return plan.group_masks[key]


def _group_flash_chunk(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, u: _Unit, a: int, b: int, masked: bool
) -> tuple[Tensor, Tensor]:
    """One chunk of every tile of a diagonal group in one call of the flash kernel.

    Shape:
        -> out ``(B*H, n, tq, Dv)``, lse ``(B*H, n, tq)``.
    """
    mask = _group_mask(plan, u, a, b, masked, _mask_dtype(q))
    o, lse = flash_forward(
        _stacked(q, u, 0, u.tq),
        _stacked(k, u, a, b),
        _stacked(v, u, a, b),
        attn_mask=mask,
        scale=plan.scale,
    )
    if masked:
        assert mask is not None  # a masked chunk has a mask
        lse = lse.masked_fill(torch.isneginf(mask).all(-1), float("-inf"))  # rows with no key
    return o, lse


def merge_by_lse(o_a: Tensor, l_a: Tensor, o_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial outputs by their log-sum-exps.

    ``o = (e^l_a o_a + e^l_b o_b) / (e^l_a + e^l_b)``; a part with ``l = -inf`` weighs 0.
    Shape:
        o ``(B, H, tq, Dv)``, l ``(B, H, tq)``.
    """
    lse = torch.logaddexp(l_a, l_b)  # (B, H, tq)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    w_a = torch.exp(l_a - safe).unsqueeze(-1)  # (B, H, tq, 1)
    w_b = torch.exp(l_b - safe).unsqueeze(-1)
    return o_a.to(w_a.dtype) * w_a + o_b.to(w_b.dtype) * w_b, lse


def _flash_chunk(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, where: tuple):
    """One chunk through torch's CPU flash kernel; rows with no key in the chunk get lse -inf."""
    t0, t1, k0, k1, masked = where
    mask = plan.chunk_mask(t0, t1, k0, k1, masked, _mask_dtype(q))  # (B?, H?, tq, kc) or None
    o, lse = flash_forward(q, k, v, attn_mask=mask, scale=plan.scale)  # (B, H, tq, Dv), (B, H, tq)
    if masked or plan.bias is not None:
        assert mask is not None  # a masked chunk, or a bias, makes one
        dead = torch.isneginf(mask).all(-1)  # (B?, H?, tq): the kernel reports lse 0 there
        lse = lse.masked_fill(dead, float("-inf"))
    return o, lse


def _mask_dtype(q: Tensor) -> torch.dtype:
    """float32 masks for half inputs: a bias such as ALiBi's keeps its precision."""
    return torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype


def _matmul_chunk(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, where: tuple):
    """One chunk as matmul, softmax, matmul; softmax statistics in float32 or wider."""
    scores = _chunk_scores(plan, q, k, where)  # (B, H, tq, kc), float32+ and masked
    row_max = scores.amax(-1, keepdim=True)  # (B, H, tq, 1)
    row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    p = scores.sub_(row_max).exp_()  # (B, H, tq, kc)
    total = p.sum(-1, keepdim=True)  # (B, H, tq, 1); 0 on rows with no key
    o = (p @ v.to(p.dtype)) / torch.where(
        total == 0, 1.0, total
    )  # (B, H, tq, Dv), weights unrounded
    lse = (row_max + total.log()).squeeze(-1)  # (B, H, tq); log 0 = -inf
    return o, lse


def _chunk_scores(plan: _Plan, q: Tensor, k: Tensor, where: tuple, raw: Tensor | None = None):
    """Scaled, score-modified and masked scores of a chunk in the accumulation dtype.

    ``raw`` (the scaled scores) may be passed in, e.g. as a leaf to differentiate score_mod.
    Shape:
        ``(B, H, tq, kc)``.
    """
    t0, t1, k0, k1, masked = where
    if raw is None:
        raw = _raw_scores(plan, q, k)
    scores = raw
    if plan.score_mod is not None:
        b, h, qi, ki = index_grid(
            plan.B, plan.H, t1 - t0, k1 - k0, q_start=t0, kv_start=k0, device=q.device
        )
        scores = evaluate_score(plan.score_mod, scores, b, h, qi, ki)
    if plan.bias is not None:
        scores = scores + _tile(plan.bias, t0, t1, k0, k1)
    if masked:
        scores = scores.masked_fill(~plan.allowed(t0, t1, k0, k1), float("-inf"))
    return scores


def _raw_scores(plan: _Plan, q: Tensor, k: Tensor) -> Tensor:
    """Scaled scores in the accumulation dtype: half inputs are multiplied in float32, so a
    score_mod sees scores not rounded to half (as FlexAttention's kernels give them)."""
    acc = _acc(q.dtype)
    return (q.to(acc) * plan.scale) @ k.to(acc).transpose(-2, -1)  # (B, H, tq, kc)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax statistics and accumulation: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _backward(
    plan: _Plan, q, k, v, out, lse, dout, grad_tensors, bias_grad: bool, cast: bool = True
):
    """FlashAttention's backward, chunk by chunk, from the saved log-sum-exp. The gradients
    come in the inputs' dtypes, or (``cast=False``) in the accumulation dtype."""
    acc = _acc(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    dts = [torch.zeros_like(t, dtype=acc) for t in grad_tensors]
    bias = plan.bias if bias_grad else None  # bias_grad is asked only where there is a bias
    dbias = None if bias is None else torch.zeros_like(bias, dtype=acc)
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)  # rows with no key: p = e^-inf = 0
    dout = dout.to(q.dtype)
    if any(u.n > 1 for u in plan.units):
        q, k, v, out, dout, lse_safe = (_mergeable(t) for t in (q, k, v, out, dout, lse_safe))
    for u in plan.units:
        rows = slice(u.t0, u.t0 + u.tq)
        for a, b, masked in u.chunks:
            if u.n > 1:
                _group_flash_backward(
                    plan, q, k, v, out, lse_safe, dout, u, a, b, masked, dq, dk, dv
                )
                continue
            where, cols = (u.t0, u.t0 + u.tq, u.t0 + a, u.t0 + b, masked), slice(u.t0 + a, u.t0 + b)
            args = (
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                out[:, :, rows],
                lse_safe[:, :, rows],
                dout[:, :, rows],
            )
            if plan.inner == "flash":
                g = _flash_chunk_backward(plan, *args, where)
            else:
                g = _matmul_chunk_backward(plan, *args, where, grad_tensors, dbias)
            dq[:, :, rows] += g[0]
            dk[:, :, cols] += g[1]
            dv[:, :, cols] += g[2]
            for acc_t, g_t in zip(dts, g[3:]):
                acc_t.add_(g_t)
    if not cast:
        return dq, dk, dv, dbias, dts
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        None if dbias is None or bias is None else dbias.to(bias.dtype),
        [d.to(t.dtype) for d, t in zip(dts, grad_tensors)],
    )


def _group_flash_backward(
    plan: _Plan,
    q,
    k,
    v,
    out,
    lse,
    dout,
    u: _Unit,
    a: int,
    b: int,
    masked: bool,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
) -> None:
    """Gradients of one chunk of every tile of a diagonal group, added into dq, dk, dv
    ``(B, H, L, E)``. Overlapping key windows are added in strips of ``tq`` keys, each strip a
    non-overlapping view."""
    mask = _group_mask(plan, u, a, b, masked, _mask_dtype(q))
    lse_u = _stacked(lse.unsqueeze(-1), u, 0, u.tq).squeeze(-1).contiguous()  # (B*H, n, tq)
    g_q, g_k, g_v = flash_backward(
        _stacked(dout, u, 0, u.tq),
        _stacked(q, u, 0, u.tq),
        _stacked(k, u, a, b),
        _stacked(v, u, a, b),
        _stacked(out, u, 0, u.tq),
        lse_u.float() if q.dtype != torch.float64 else lse_u,
        attn_mask=mask,
        scale=plan.scale,
    )
    dq[:, :, u.rows] += g_q.reshape(dq.shape[0], dq.shape[1], -1, dq.shape[-1])
    for acc_t, g_t in ((dk, g_k), (dv, g_v)):  # g_t: (B*H, n, kc, E)
        for p0 in range(0, b - a, u.tq):
            p1 = min(b - a, p0 + u.tq)
            _stacked(acc_t, u, a + p0, a + p1).add_(g_t[:, :, p0:p1])


def _flash_chunk_backward(plan: _Plan, q, k, v, out, lse, dout, where):
    t0, t1, k0, k1, masked = where
    mask = plan.chunk_mask(t0, t1, k0, k1, masked, _mask_dtype(q))
    dq, dk, dv = flash_backward(
        dout,
        q,
        k,
        v,
        out,
        lse.float() if q.dtype != torch.float64 else lse,
        attn_mask=mask,
        scale=plan.scale,
    )
    return dq, dk, dv


def _matmul_chunk_backward(plan: _Plan, q, k, v, out, lse, dout, where, grad_tensors, dbias):
    """dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O)); dQ = dS K * scale; dK = dS^T Q * scale,
    with dS pulled back through score_mod by autograd when there is one."""
    acc = lse.dtype
    with torch.enable_grad():
        raw = _raw_scores(plan, q.detach(), k.detach())  # (B, H, tq, kc)
        if plan.score_mod is not None:
            raw.requires_grad_(True)
        scores = _chunk_scores(plan, q, k, where, raw=raw)
        p = torch.exp(scores.detach() - lse.unsqueeze(-1))  # (B, H, tq, kc)
        do = dout.to(acc)
        dv = p.transpose(-2, -1) @ do  # (B, H, kc, Dv)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)  # (B, H, tq, 1)
        ds = p * (do @ v.to(acc).transpose(-2, -1) - delta)  # (B, H, tq, kc)
        if dbias is not None:  # the bias is added after score_mod: its gradient is this dS,
            tile = _tile(dbias, *where[:4])  # summed over the dims it broadcast along
            # not ds.sum(dims): with no broadcast dim that list is empty, and sum([]) sums
            # every dim (a full-rank (B, H, T, S) bias got the whole tile's total everywhere)
            tile += ds.sum_to_size(tile.shape)
        dts = []
        if plan.score_mod is not None:
            inputs = (raw,) + tuple(grad_tensors)
            ds, *dts = torch.autograd.grad(scores, inputs, ds, allow_unused=True)
            dts = [torch.zeros_like(t) if g is None else g for g, t in zip(dts, grad_tensors)]
    dq = (ds @ k.to(acc)) * plan.scale  # (B, H, tq, D)
    dk = (ds.transpose(-2, -1) @ q.to(acc)) * plan.scale  # (B, H, kc, D)
    return (dq, dk, dv, *dts)
