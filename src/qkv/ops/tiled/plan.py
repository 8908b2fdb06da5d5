"""Block planning for the tiled backend (``backend.py``): from a call's masks to the units
of work, cached by mask structure and sizes.

The masks combine into one bound mask_mod (``_plan``), which classifies every (tile, block)
pair as empty, partial or full from index bounds alone (``masks.block_states``). Each tile gets
its chunks of consecutive blocks (``_chunks``: empty blocks left out, long full runs a chunk of
their own without a mask), and tiles are joined into units (``_units``): tall tiles of rows
that visit the same keys, and, for masks and score_mods that depend on ``kv - q`` only,
diagonal groups computed in one kernel call. Masked chunks are then cut to the keys their rows
attend (``_trim_edges``, ``_split_rows``), so a document's rows need no mask. The units of a
call are cached (``_cached_units``, ``clear_plan_cache``), so a model's next layer or step with
the same mask skips all of this.

Shape alphabet: B batch, H query heads, T query length, S key length; a tile has ``tq``
queries and a chunk ``kc`` keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..._identity import IdentityCache
from ...masks import (
    EMPTY,
    FULL,
    Grid,
    MaskMod,
    ScoreMod,
    _Combined,
    _Document,
    _KeysBefore,
    _Window,
    and_masks,
    block_states,
    causal,
    evaluate_mask,
    index_grid,
    shift_invariant,
    structure_key,
)
from .._aten import flash_cpu_available
from ..call import AttentionCall
from ..plan_cache import PlanCache

BLOCK_Q = 64  # query rows per tile
BLOCK_K = 64  # keys per block (the unit of skipping)
MIN_FULL_RUN = 8  # full blocks worth a chunk of their own (no mask) rather than riding along
# B*H*tq*kc scores per chunk: 16 MiB in float32. It bounds each kernel call's scores, and
# its speed is flat, so it is not measured per machine (issue 38): on the AMX Xeon box (one
# thread, 8 heads, D=64, T=4096, medians of 5), 2^20 / 2^22 / 2^24 took for window(256)
# 37.9/37.4/36.9 ms fp32 and 44.3/43.6/44.8 bf16, document 100/91/88 and 54/51/51, causal
# 238/257/285 and 152/156/195: 2^22 within 8% of the best of the three in each case, and no
# one budget best across cases (which a measured constant per machine would need).
CHUNK_ELEMENTS = 1 << 22
# Chunk masks of single tiles kept per plan (``_Plan.kernel_mask``): 1 MiB in float32, so the
# plan cache's 64 plans hold at most 64 MiB of them; a window's first tiles take ~40k.
KEPT_MASK_ELEMENTS = 1 << 18


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
    # rows against keys of the same positions, causal: the chunk ``(0, tq, False)`` runs
    # through the flash kernel's own ``is_causal`` (row ``t0 + i`` sees keys ``t0..t0 + i``),
    # no mask and no tile of a chunk masked at the diagonal; other chunks as usual (a causal
    # call, a document's rows: ``_causal_documents``; a prefix LM's rows after the prefix)
    causal: bool = False

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
    # (mask, its rows with no key) of diagonal groups by (tq, a, b, masked, dtype), in the
    # kernel's layout (forward._group_mask), and of single tiles by ("tile", ...) (kernel_mask)
    group_masks: dict = field(default_factory=dict)

    def kernel_mask(
        self, t0: int, t1: int, k0: int, k1: int, masked: bool, dtype
    ) -> tuple[Tensor | None, Tensor | None]:
        """:meth:`chunk_mask` and its rows with no key (None where no row can lack one: an
        unmasked chunk without a bias), as the flash kernel's chunk takes them. Remembered with
        the plan's units (``group_masks``, shared by the calls with the same mask structure
        and sizes) when they come from the mask_mod alone, up to ``KEPT_MASK_ELEMENTS`` per
        plan: a window's first tiles built their masks anew at every call (an eighth of a
        float32 window(256) call at T=1024 went to the masks and their dead rows).

        Shape:
            ``(B?, H?, tq, kc)`` or None; ``(B?, H?, tq)`` bool or None.
        """
        # (a call with a float attn_mask or a score_mod may share its plan's units, and so
        # this dict, with one without: its masks are its own, neither read nor kept here)
        keep = self.bias is None and self.score_mod is None
        key = ("tile", t0, t1, k0, k1, masked, dtype)
        kept = self.group_masks.get(key) if keep else None
        if kept is not None:
            return kept
        mask = self.chunk_mask(t0, t1, k0, k1, masked, dtype)
        dead = None
        if masked or self.bias is not None:
            assert mask is not None  # a masked chunk, or a bias, makes one
            dead = torch.isneginf(mask).all(-1)  # the kernel reports lse 0 on such rows
        if keep and mask is not None:
            held = self.group_masks.get(("tile elements",), 0) + mask.numel()
            if held <= KEPT_MASK_ELEMENTS:
                self.group_masks[("tile elements",)] = held
                self.group_masks[key] = (mask, dead)
        return mask, dead

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
    return _plan_for(
        B,
        H,
        call.T,
        call.S,
        call.scale,
        mask_mod,
        call.score_mod,
        _inner(call, inner, dtype),
        call.device,
        mask is None or mask.dtype == torch.bool,
        bq,
        bk,
    )


def _inner(call: AttentionCall, inner: str | None, dtype: torch.dtype) -> str:
    """The inner kernel: the one asked for (validated), else the best that takes the call."""
    best = _pick_inner(call, dtype)
    if inner not in (None, "flash", "matmul") or (inner == "flash" and best != "flash"):
        raise ValueError(
            f"inner must be None, 'matmul' or (when it can take the call) 'flash', got {inner!r}"
        )
    return inner or best


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
    # plain: units may leave out the chunk masks that a float mask or score_mod needs (causal
    # documents), so calls with and without one keep plans of their own
    plain = no_float_mask and score_mod is None
    sizes = (B, H, T, S, bq, bk, inner, groups, plain, str(device), CHUNK_ELEMENTS)
    if structure is None:
        dense = _dense_structure(mask_mod)
        if dense is None:  # a plain function: planned anew every call
            plan.units = _plan_units(plan, bq, bk, groups, plain)
            return plan
        # a dense mask (with structured ones): its plan is remembered by the mask's identity
        # and version, so the next call with the same mask reads nothing of it on the host
        structure, tensors = dense
        plan.units = _dense_plans.get(
            tensors, (structure,) + sizes, lambda: _plan_units(plan, bq, bk, groups, plain)
        )
        return plan
    key = (structure,) + sizes
    units, group_masks = _cached_units(key, lambda: _plan_units(plan, bq, bk, groups, plain))
    plan.units = units
    if score_mod is None:  # the chunk masks come from the mask alone: shared too
        plan.group_masks = group_masks
    return plan


def _plan_units(plan: _Plan, bq: int, bk: int, groups: bool, plain: bool) -> list[_Unit]:
    """The units of ``plan`` (whose sizes, mask and inner kernel are set): blocks classified,
    chunks listed per tile, tiles joined, masked chunks trimmed and joined again; or, for
    causal packed documents (``plain``: no float mask, no score_mod), one causal unit per
    document (``_causal_documents``)."""
    if plain and plan.inner == "flash":
        if _is_causal_top_left(plan.mask_mod):  # (a padded batch's piece: T != S too)
            return [_Unit(0, plan.T, 1, ((0, plan.T, False),), causal=True)]
        prefix = _causal_prefix(plan.mask_mod, plan.T, plan.S)
        if prefix is not None:  # prefix_lm: rows of the prefix see it, later rows are causal
            P, T = prefix, plan.T
            before = ((-P, 0, False),) if P else ()
            units = [_Unit(0, P, 1, ((0, P, False),))] if P else []
            return units + [_Unit(P, T - P, 1, (*before, (0, T - P, False)), causal=True)]
        runs = _causal_documents(plan.mask_mod, plan.T, plan.S)
        if runs is not None and len(runs) * bq <= plan.T:  # (documents of 64 rows on average;
            # shorter ones take fewer calls as tiles of several documents)
            return [_Unit(a, b - a, 1, ((0, b - a, False),), causal=True) for a, b in runs]
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


# Block plans of dense masks, by the masks' identity (qkv._identity): a mask a model passes to
# every layer is read on the host once.
_dense_plans = IdentityCache(PLAN_CACHE_SIZE)


def _dense_structure(mod) -> tuple[tuple, tuple[Tensor, ...]] | None:
    """A key like ``structure_key``'s for masks holding dense masks (``_DenseMask``, alone or
    in ``and_masks``/``or_masks`` with qkv's own masks), with the dense masks' tensors apart:
    the plan is theirs as long as they are unchanged. None for anything else."""
    if type(mod) is _DenseMask:
        return ("dense",), (mod.mask,)
    if type(mod) is _Combined:
        parts = [_dense_structure(m) for m in mod.mods]
        if any(p is None for p in parts):
            return None
        tensors = tuple(t for p in parts if p is not None for t in p[1])
        return (mod.op, tuple(p[0] for p in parts if p is not None)), tensors
    key = structure_key(mod)
    return None if key is None else (key, ())


def _cached_units(key: tuple, make) -> tuple[list[_Unit], dict]:
    """``(units, group_masks)`` for ``key``: from the cache, or ``make()`` and remembered."""
    return _plan_cache.get(key, lambda: (make(), {}))


def clear_plan_cache() -> None:
    """Forget every remembered block plan (they are rebuilt on the next call)."""
    _plan_cache.clear()
    _dense_plans.clear()


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


def _is_causal_top_left(mod: MaskMod | None) -> bool:
    """Whether ``mod`` (bound) is exactly top-left causal, the flash kernel's ``is_causal``
    (row ``i`` sees keys ``0..i``, whatever T and S)."""
    return type(mod) is _Window and mod.left is None and mod.right == 0 and mod._off() == 0


def _beside_causal(mod: MaskMod | None, op: str, kind: type, T: int, S: int):
    """The part of type ``kind`` of a bound ``op`` ("and", "or") of two masks whose other
    part is top-left causal, with ``T == S``; None for any other mask."""
    if T != S or type(mod) is not _Combined or mod.op != op or len(mod.mods) != 2:
        return None
    part = next((m for m in mod.mods if type(m) is kind), None)
    if part is None or not any(_is_causal_top_left(m) for m in mod.mods):
        return None
    return part


def _causal_prefix(mod: MaskMod | None, T: int, S: int) -> int | None:
    """``P`` of a bound ``prefix_lm(P)`` (one prefix for the batch) with ``T == S`` and
    ``0 <= P < T``: the rows of the prefix see its keys ``[0, P)``, and each later row sees
    keys ``0..q``: the prefix in full and, past it, the flash kernel's own causal. Tiles
    found it per 64 rows, each a chunk masked at the diagonal (float32 at T=2048: 1.07x
    compiled Flex's time, 1.20x held to AVX2, on a Zen 4). None otherwise."""
    keys = _beside_causal(mod, "or", _KeysBefore, T, S)
    if keys is None:
        return None
    n = keys.n
    if isinstance(n, Tensor):
        if n.numel() != 1:
            return None  # a prefix per batch element
        n = max(int(n.reshape(()).item()), 0)  # (read once per plan; below 0: no prefix)
    return n if n < T else None  # (a prefix of every key: no causal part)


def _causal_documents(mod: MaskMod | None, T: int, S: int) -> list[tuple[int, int]] | None:
    """The documents ``[a, b)`` of a bound mask that is causal (top-left) within packed
    documents: ``and_masks`` of ``document(ids)`` (ids shared by the batch, the same for
    queries and keys, each id one run of positions) and ``causal()``, with T == S. Each
    document is then the flash kernel's own causal attention on its rows and keys; tiles
    found it per 64 rows, each a chunk masked at the diagonal (float32 causal documents at
    T=4096 took longer than without causal, 85 ms against 69, on a Zen 4). None otherwise."""
    doc = _beside_causal(mod, "and", _Document, T, S)
    if doc is None:
        return None
    ids = doc.q_ids
    if ids.shape[0] != 1 or not (doc.kv_ids is ids or torch.equal(doc.kv_ids, ids)):
        return None
    ids = ids[0].cpu()  # (T,): planning reads it on the host once per plan
    starts = [0] + (ids[1:] != ids[:-1]).nonzero().flatten().add(1).tolist()
    if ids[starts].unique().numel() != len(starts):
        return None  # an id in two runs: one document in pieces
    return list(zip(starts, starts[1:] + [T]))


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
