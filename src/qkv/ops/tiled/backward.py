"""The tiled backend's backward (``backend.py``): FlashAttention's backward over the plan's units
(``plan.py``), chunk by chunk from the saved output and log-sum-exp; each chunk's
weights are recomputed with the forward's helpers (``forward.py``).

``flash`` takes torch's CPU flash backward, which reads the *global* output and log-sum-exp:
exactly the per-chunk decomposition. ``matmul`` writes dV, dS, dQ and dK out, pulling dS back
through a score_mod by autograd (gradients for the tensors it reads too) and summing it into a
float attn_mask's gradient. The sinks' gradient is closed-form (``_sink_grad``).

A backward asked for a graph of its own (``create_graph=True``: a gradient penalty, a
Hessian-vector product) is no FlashAttention pass: ``_dense_backward`` recomputes the attention
in plain differentiable math and takes its gradients by autograd, whose graph then reaches
q, k, v and every other input. O(T * S) memory, as the reference's.

Shape alphabet: B batch, H query heads, T query length, S key length, D head dim, Dv value
head dim; a tile has ``tq`` queries, a diagonal group ``n`` tiles and a chunk ``kc`` keys.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ...masks import apply_mask_, evaluate_mask, evaluate_score, index_grid
from .._aten import flash_backward
from .forward import (
    _acc,
    _chunk_scores,
    _group_mask,
    _mask_dtype,
    _mergeable,
    _raw_scores,
    _stacked,
)
from .plan import _Plan, _tile, _Unit


def _sink_grad(sinks: Tensor, out: Tensor, lse: Tensor, dout: Tensor) -> Tensor:
    """The sinks' gradient, ``-p_sink * rowsum(dO * O)`` per row (a key with no value: its dP
    is 0, so its dS is ``-p_sink * delta``), from the sink-inclusive output and lse. A row
    whose lse is ``-inf`` (no key and a ``-inf`` sink) has ``p_sink = 0``, not
    ``exp(-inf - -inf)`` = NaN: its lse is read as 0 there, a tensor op as in the forward.

    Shape:
        sinks ``(B, H, T)``, out and dout ``(B, H, T, Dv)``, lse ``(B, H, T)`` -> ``(B, H, T)``.
    """
    acc = lse.dtype
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)  # (B, H, T); sink -inf there
    p_sink = torch.exp(sinks.to(acc) - lse_safe)  # (B, H, T)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, T): rowsum(dO * O)
    return -(p_sink * delta).to(sinks.dtype)


def _dense_backward(
    plan: _Plan, inputs: tuple[Tensor | None, ...], needs: tuple[bool, ...], dout: Tensor
) -> list[Tensor | None]:
    """The gradients of ``inputs`` (q, k, v, bias, sinks and the score_mod's tensors, as the
    Function takes them) from plain math with a graph (for ``create_graph=True``): the
    attention recomputed densely, the plan's masks and score_mod evaluated on the whole
    ``(B, H, T, S)`` grid, rows with no key 0 as the kernels give them. ``needs`` says which
    inputs want a gradient; the others get None.

    Shape:
        q ``(B, H, T, D)``, k ``(B, H, S, D)``, v ``(B, H, S, Dv)``, bias ``(B?, H?, T, S)``,
        sinks ``(B, H, T)``, dout ``(B, H, T, Dv)`` -> a gradient per input, its shape.
    """
    from ..reference import masked_softmax  # (reference imports nothing of tiled)

    q, k, v, bias, sinks = inputs[:5]
    assert q is not None and k is not None and v is not None
    acc = _acc(q.dtype)
    with torch.enable_grad():
        scores = (q.to(acc) * plan.scale) @ k.to(acc).transpose(-2, -1)  # (B, H, T, S)
        if bias is not None:
            scores = scores + bias.to(acc)
        grid = index_grid(plan.B, plan.H, plan.T, plan.S, device=q.device)
        if plan.score_mod is not None:
            scores = evaluate_score(plan.score_mod, scores, *grid)
        if plan.mask_mod is not None:
            scores = apply_mask_(scores.clone(), evaluate_mask(plan.mask_mod, *grid))
        if sinks is not None:  # the head's sink: one more key, with no value
            scores = torch.cat([scores, sinks.to(acc).unsqueeze(-1)], dim=-1)  # (B, H, T, S+1)
        probs, _ = masked_softmax(scores)
        if sinks is not None:
            probs = probs[..., :-1]  # (B, H, T, S)
        out = (probs @ v.to(acc)).to(q.dtype)  # (B, H, T, Dv)
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    found = iter(
        torch.autograd.grad(out, wanted, dout, create_graph=True, allow_unused=True)
        if wanted
        else ()
    )
    return [next(found) if need and t is not None else None for t, need in zip(inputs, needs)]


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
    wide = _wide_stand_ins(grad_tensors, acc)  # made once: every chunk's score_mod reads them
    bias = plan.bias if bias_grad else None  # bias_grad is asked only where there is a bias
    dbias = None if bias is None else torch.zeros_like(bias, dtype=acc)
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)  # rows with no key: p = e^-inf = 0
    dout = dout.to(q.dtype)
    if plan.inner == "flash" or any(u.n > 1 for u in plan.units):
        out = out.to(q.dtype)  # torch's flash backward takes O in q's dtype (its delta from it)
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
            if u.causal and (a, b) == (0, u.tq):  # the kernel's own causal (_Unit.causal)
                g = _causal_flash_backward(plan, *args)
            elif plan.inner == "flash":
                g = _flash_chunk_backward(plan, *args, where)
            else:
                g = _matmul_chunk_backward(plan, *args, where, grad_tensors, dbias, wide)
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
    mask, _ = _group_mask(plan, u, a, b, masked, _mask_dtype(q))
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


def _score_slope(plan: _Plan, raw: Tensor, where) -> Tensor | None:
    """``d score_mod / d score`` on the chunk's raw scores in closed form, or None (no
    score_mod, or one that gives no derivative)."""
    if plan.score_mod is None:
        return None
    t0, t1, k0, k1, _ = where
    b, h, qi, ki = index_grid(
        plan.B, plan.H, t1 - t0, k1 - k0, q_start=t0, kv_start=k0, device=raw.device
    )
    return plan.score_mod.derivative(raw, b, h, qi, ki)


def _causal_flash_backward(plan: _Plan, q, k, v, out, lse, dout):
    """The gradients of a causal unit (``_Unit.causal``): the flash kernel's own causal
    backward on the document's rows and keys."""
    lse = lse.float() if q.dtype != torch.float64 else lse
    return flash_backward(dout, q, k, v, out, lse, scale=plan.scale, is_causal=True)


def _flash_chunk_backward(plan: _Plan, q, k, v, out, lse, dout, where):
    t0, t1, k0, k1, masked = where
    mask, _ = plan.kernel_mask(t0, t1, k0, k1, masked, _mask_dtype(q))
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


def _matmul_chunk_backward(
    plan: _Plan, q, k, v, out, lse, dout, where, grad_tensors, dbias, wide: dict[int, Tensor]
):
    """dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O)); dQ = dS K * scale; dK = dS^T Q * scale,
    with dS pulled back through score_mod: by its closed-form derivative where it gives one
    and no tensor it reads wants a gradient (inside the custom op under torch.compile there
    is no autograd to call), by autograd otherwise, reading ``wide``'s float32 stand-ins of
    its half tensors (``_wide_stand_ins``)."""
    acc = lse.dtype
    raw = _raw_scores(plan, q.detach(), k.detach())  # (B, H, tq, kc)
    slope = None if grad_tensors else _score_slope(plan, raw, where)  # (B?, H?, tq?, kc?)
    by_autograd = plan.score_mod is not None and slope is None
    with torch.enable_grad():
        if by_autograd:
            raw.requires_grad_(True)
        with _ReadsWide(wide) if wide and by_autograd else contextlib.nullcontext():
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
        if by_autograd:
            inputs = (raw,) + tuple(wide.get(id(t), t) for t in grad_tensors)
            ds, *dts = torch.autograd.grad(scores, inputs, ds, allow_unused=True)
            dts = [torch.zeros_like(t) if g is None else g for g, t in zip(dts, grad_tensors)]
    if slope is not None:
        ds = ds * slope  # (B, H, tq, kc); 0 where masked (p = 0 there)
    dq = (ds @ k.to(acc)) * plan.scale  # (B, H, tq, D)
    dk = (ds.transpose(-2, -1) @ q.to(acc)) * plan.scale  # (B, H, kc, D)
    return (dq, dk, dv, *dts)


def _wide_stand_ins(tensors, acc: torch.dtype) -> dict[int, Tensor]:
    """Leaf stand-ins in ``acc`` for the half tensors a score_mod reads, by ``id``. Autograd
    takes a tensor's gradient in its own dtype: read as float16 it came rounded per element
    and summed in float16 over each chunk's scores, and a learned bias's gradient was over
    the tolerance policy (the long property profile found 2.97e-3 against a bound of
    2.81e-3, window(1), float16). Read as float32 it is summed in float32 and rounded once,
    at the end of the backward."""
    return {
        id(t): t.detach().to(acc).requires_grad_(True)
        for t in tensors
        if t.is_floating_point() and torch.finfo(t.dtype).bits < torch.finfo(acc).bits
    }


class _ReadsWide(TorchFunctionMode):
    """While a score_mod runs, every torch function it calls on one of the swapped tensors
    gets its stand-in (``_wide_stand_ins``) instead: indexing, arithmetic, ``F.embedding``.
    The values are the same (a half value is exact in float32); what the score_mod then
    computes from them runs in float32, as the backward's scores do anyway."""

    def __init__(self, swap: dict[int, Tensor]):
        super().__init__()
        self.swap = swap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(self._stand_in, (args, kwargs or {}))
        return func(*args, **kwargs)

    def _stand_in(self, a):
        return self.swap.get(id(a), a) if isinstance(a, Tensor) else a
