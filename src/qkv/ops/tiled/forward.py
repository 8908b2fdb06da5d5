"""The tiled backend's forward (``backend.py``): every unit of a plan (``plan.py``), each
chunk through an inner kernel, the chunks merged by log-sum-exp (the online softmax).

``flash`` runs a chunk through torch's CPU flash kernel, a diagonal group's tiles in one call
through overlapping strided views; ``matmul`` runs it as matmul, softmax, matmul in the
accumulation dtype. The score helpers (``_chunk_scores``, ``_raw_scores``) are the backward's
too: it recomputes each chunk's weights with them. The slow twin is the reference backend
(``reference.py``).

Shape alphabet: B batch, H query heads, T query length, D head dim, Dv value head dim; a tile
has ``tq`` queries, a diagonal group ``n`` tiles and a chunk ``kc`` keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...masks import evaluate_score, index_grid
from .._aten import flash_forward
from .plan import _Plan, _tile, _Unit


def _with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Output and log-sum-exp of the softmax that also holds each row's sink (a key with no
    value): ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``. A row with no
    key keeps output 0 (``exp(-inf) = 0``), a ``-inf`` sink included: there ``lse'`` is
    ``-inf`` too and ``exp(-inf - -inf)`` would be NaN, so the rescale subtracts 0 instead
    (a tensor op, no branch on values: one graph under compile, no host read).

    Shape:
        out ``(B, H, T, Dv)``, lse and sinks ``(B, H, T)`` -> out, lse.
    """
    total = torch.logaddexp(lse, sinks.to(lse.dtype))  # (B, H, T)
    shift = torch.where(torch.isneginf(total), 0.0, total)  # (B, H, T): finite where lse is
    return (out.to(lse.dtype) * torch.exp(lse - shift).unsqueeze(-1)).to(out.dtype), total


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
    # a unit's running lse in float64 (MPS has none): merged in float32, each of many chunks
    # rounded it, and the backward's weights exp(s - lse) carried that (grad q 20x the
    # reference's error with 17 chunks, float32; tests/test_properties.py's regressions)
    running = torch.float64 if q.device.type != "mps" else acc
    if any(u.n > 1 for u in plan.units):
        q, k, v = _mergeable(q), _mergeable(k), _mergeable(v)
    for u in plan.units:
        merged: tuple[Tensor, Tensor] | None = None  # the unit's output and lse so far
        t0, t1 = u.t0, u.t0 + u.tq
        for a, b, masked in u.chunks:
            if u.causal and (a, b) == (0, u.tq):  # the kernel's own causal (_Unit.causal)
                o_c, l_c = flash_forward(
                    q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1], scale=plan.scale, is_causal=True
                )  # (B, H, tq, Dv), (B, H, tq)
            elif u.n == 1:
                o_c, l_c = chunk_fn(
                    plan,
                    q[:, :, t0:t1],
                    k[:, :, t0 + a : t0 + b],
                    v[:, :, t0 + a : t0 + b],
                    (t0, t1, t0 + a, t0 + b, masked),
                )  # (B, H, tq, Dv), (B, H, tq)
            else:
                o_c, l_c = _group_flash_chunk(plan, q, k, v, u, a, b, masked)  # (B*H, n, tq, Dv)
            l_c = l_c.to(running)  # the running lse: one rounding, not one a merge
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


def _group_mask(
    plan: _Plan, u: _Unit, a: int, b: int, masked: bool, dtype
) -> tuple[Tensor | None, Tensor | None]:
    """The chunk mask shared by every tile of a diagonal group, laid out for the kernel's
    ``(B*H, n)`` batch dims, and its rows with no key (None unless masked); computed once per
    plan (forward and backward share them), as ``_Plan.kernel_mask`` keeps a single tile's.

    Shape:
        ``(B*H or 1, 1, tq, b - a)`` or None; ``(B*H or 1, 1, tq)`` bool or None.
    """
    key = (u.tq, a, b, masked, dtype)
    if key not in plan.group_masks:
        m = plan.chunk_mask(
            u.t0, u.t0 + u.tq, u.t0 + a, u.t0 + b, masked, dtype
        )  # (B?, H?, tq, kc)
        if m is not None and m.shape[:2] != (1, 1):
            m = m.expand(plan.B, plan.H, *m.shape[2:]).reshape(plan.B * plan.H, 1, *m.shape[2:])
        dead = torch.isneginf(m).all(-1) if masked and m is not None else None
        plan.group_masks[key] = (m, dead)
    return plan.group_masks[key]


def _group_flash_chunk(
    plan: _Plan, q: Tensor, k: Tensor, v: Tensor, u: _Unit, a: int, b: int, masked: bool
) -> tuple[Tensor, Tensor]:
    """One chunk of every tile of a diagonal group in one call of the flash kernel.

    Shape:
        -> out ``(B*H, n, tq, Dv)``, lse ``(B*H, n, tq)``.
    """
    mask, dead = _group_mask(plan, u, a, b, masked, _mask_dtype(q))
    o, lse = flash_forward(
        _stacked(q, u, 0, u.tq),
        _stacked(k, u, a, b),
        _stacked(v, u, a, b),
        attn_mask=mask,
        scale=plan.scale,
    )
    if dead is not None:  # a masked chunk's rows with no key: the kernel reports lse 0 there
        lse = lse.masked_fill(dead, float("-inf"))
    return o, lse


def merge_by_lse(o_a: Tensor, l_a: Tensor, o_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial outputs by their log-sum-exps.

    ``o = (e^l_a o_a + e^l_b o_b) / (e^l_a + e^l_b)``; a part with ``l = -inf`` weighs 0.
    The output comes in float32 or the parts' wider dtype, the lse in the wider of the two
    lse's (a float64 running lse stays float64: ``_forward``).
    Shape:
        o ``(B, H, tq, Dv)``, l ``(B, H, tq)``.
    """
    lse = torch.logaddexp(l_a, l_b)  # (B, H, tq)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    acc = torch.promote_types(torch.promote_types(o_a.dtype, o_b.dtype), torch.float32)
    w_a = torch.exp(l_a - safe).unsqueeze(-1).to(acc)  # (B, H, tq, 1)
    w_b = torch.exp(l_b - safe).unsqueeze(-1).to(acc)
    return o_a.to(acc) * w_a + o_b.to(acc) * w_b, lse


def _flash_chunk(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, where: tuple):
    """One chunk through torch's CPU flash kernel; rows with no key in the chunk get lse -inf."""
    t0, t1, k0, k1, masked = where
    # (B?, H?, tq, kc) or None; (B?, H?, tq): rows with no key, where the kernel reports lse 0
    mask, dead = plan.kernel_mask(t0, t1, k0, k1, masked, _mask_dtype(q))
    o, lse = flash_forward(q, k, v, attn_mask=mask, scale=plan.scale)  # (B, H, tq, Dv), (B, H, tq)
    if dead is not None:
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
