"""Linear attention, fast forms: the global (non-causal) and chunk-wise causal kernels.

Katharopoulos et al. 2020, "Transformers are RNNs": with features ``phi`` in place of
``exp(q . k)``,

    out_i = phi(q_i) sum_j phi(k_j) v_j^T / (phi(q_i) . sum_j phi(k_j) + eps)

summed over all keys (non-causal) or over ``j <= i`` (causal). Both carry a state
``kv = sum_j phi(k_j) v_j^T``, ``z = sum_j phi(k_j)`` of size ``M x Dv`` along the sequence.
Causal: inside a chunk of ``chunk_size`` positions a masked ``phi(Q_c) phi(K_c)^T`` (matmuls);
the state entering each chunk is one more matmul, with a lower-triangular ``(n, n)`` matrix
over the chunks' contributions. Memory is O(T), the work runs at matmul speed.

The sequence is walked in blocks of ``BLOCK`` positions, features computed per block: the
intermediates of a block stay small (a few MiB), so they stay in cache and are reused by the
allocator; written for the whole sequence at once, each fresh 32 MiB intermediate at T = 16k
costs ~10 ms of page faults on CPU, more than the arithmetic.

Supports: features with a per-position log-scale (FAVOR+): keys are kept in units of a running
maximum of their log-scales, carried with the state, and ``eps`` is converted to those units,
so the result equals the written-out formula without overflow. Padding keys (``key_mask``
False) contribute nothing, and their values may be anything (even inf/NaN). A query with no key
(or all-zero features) outputs 0. Does not support: arbitrary (T, S) masks (no kernel form).

The slow twins are in ``naive.py`` beside this file; tests compare the two by name.

Shape alphabet: N flattened batch x heads, T query length, S key length, D head dim,
M features, Dv value dim, n chunks in a block, L chunk length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from .feature_maps import Features

__all__ = [
    "BLOCK",
    "CHUNK_SIZE",
    "LinearState",
    "linear_attention_chunked",
    "linear_attention_global",
]

CHUNK_SIZE = 64
BLOCK = 1024

FeatureFn = Callable[[Tensor], Features]


@dataclass
class LinearState:
    """The running sums of linear attention after some keys.

    ``kv = sum_j phi(k_j) v_j^T`` and ``z = sum_j phi(k_j)``, both in units of ``exp(-m)``
    (``m`` is -inf before any key, and stays so for maps without a log-scale).

    Shape:
        kv ``(N, M, Dv)``; z ``(N, M)``; m ``(N,)``.
    """

    kv: Tensor
    z: Tensor
    m: Tensor

    @classmethod
    def zeros(cls, N: int, M: int, Dv: int, *, device, dtype) -> LinearState:
        return cls(
            torch.zeros(N, M, Dv, device=device, dtype=dtype),
            torch.zeros(N, M, device=device, dtype=dtype),
            torch.full((N,), float("-inf"), device=device, dtype=dtype),
        )


def linear_attention_global(
    phi: FeatureFn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    eps: float,
    *,
    block: int = BLOCK,
) -> Tensor:
    """Non-causal linear attention: ``phi(Q) (phi(K)^T V)`` over its normaliser.

    Shape:
        q ``(N, T, D)``; k ``(N, S, D)``; v ``(N, S, Dv)``; key_mask ``(N, S)`` or None ->
        ``(N, T, Dv)``.
    """
    M = phi(k[:1, :1]).values.shape[-1]
    state = LinearState.zeros(k.shape[0], M, v.shape[-1], device=v.device, dtype=v.dtype)
    for kb, vb, mb in zip(*_blocks(block, k, v, key_mask)):
        state = _accumulate(state, phi(kb), vb, mb)
    return _join((_readout(phi(qb), state, eps) for qb in q.split(block, 1)), q, v)


def linear_attention_chunked(
    phi: FeatureFn,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    eps: float,
    *,
    state: LinearState | None = None,
    chunk_size: int = CHUNK_SIZE,
    block: int = BLOCK,
) -> tuple[Tensor, LinearState]:
    """Causal linear attention (``j <= i``), chunk-wise, continuing from ``state``.

    Position ``i`` here is position ``len(state) + i`` of the sequence: the state's keys come
    before every query of this call.

    Returns:
        The output and the state after the last position.

    Shape:
        q, k ``(N, T, D)``; v ``(N, T, Dv)``; key_mask ``(N, T)`` or None -> ``(N, T, Dv)``.
    """
    block = max(chunk_size, block // chunk_size * chunk_size)
    if state is None:
        M = phi(k[:1, :1]).values.shape[-1]
        state = LinearState.zeros(q.shape[0], M, v.shape[-1], device=v.device, dtype=v.dtype)

    def outputs():
        nonlocal state
        for qb, kb, vb, mb in zip(*_blocks(block, q, k, v, key_mask)):
            out, state = _causal_block(phi(qb), phi(kb), vb, mb, eps, state, chunk_size)
            yield out

    return _join(outputs(), q, v), state


def _causal_block(
    fq: Features,
    fk: Features,
    v: Tensor,
    key_mask: Tensor | None,
    eps: float,
    state: LinearState,
    chunk_size: int,
) -> tuple[Tensor, LinearState]:
    """Causal linear attention over one block, from ``state``.

    Shape:
        fq, fk ``(N, P, M)``; v ``(N, P, Dv)``; key_mask ``(N, P)`` -> ``(N, P, Dv)``.
    """
    N, P, M = fq.values.shape
    Dv = v.shape[-1]
    L = max(1, min(chunk_size, P))
    n = -(-P // L)
    if n * L != P:  # padded positions are keys nobody sees and queries nobody reads
        pad = n * L - P
        key_mask = (
            torch.ones(N, P, dtype=torch.bool, device=v.device) if key_mask is None else key_mask
        )
        fq, fk = (
            Features(_pad(f.values, pad), None if f.log_scale is None else _pad(f.log_scale, pad))
            for f in (fq, fk)
        )
        v, key_mask = _pad(v, pad), _pad(key_mask, pad)
    phi_q, b = _query_units(fq)
    phi_q = phi_q.view(N, n, L, M)
    phi_k = fk.values.view(N, n, L, M)
    m = None  # running maximum of the keys' log-scales, per chunk
    if fk.log_scale is not None:
        a = _seen(fk.log_scale, key_mask).view(N, n, L)
        m = torch.cummax(torch.cat([state.m.unsqueeze(1), a.amax(-1)], 1), 1).values  # (N, 1 + n)
        scale = _key_scale(fk.log_scale, key_mask).view(N, n, L) - _finite(m[:, 1:]).unsqueeze(-1)
        phi_k = phi_k * scale.exp().unsqueeze(-1)  # (N, n, L, M): chunk c in units exp(-m_c)
    phi_k, vv = _masked(
        phi_k, v.view(N, n, L, Dv), None if key_mask is None else key_mask.view(N, n, L, 1)
    )
    causal = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
    intra = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~causal, 0)  # (N, n, L, L)
    d_kv = phi_k.transpose(-1, -2) @ vv  # (N, n, M, Dv): each chunk's contribution
    d_z = phi_k.sum(-2)  # (N, n, M)
    carry, keep = _carry_weights(m, n, v)  # (N|1, n, n), (N|1, n) or None
    kv_in = (carry @ d_kv.flatten(2)).view(N, n, M, Dv)  # from earlier chunks of this block
    z_in = carry @ d_z  # (N, n, M)
    # From the incoming state: one matmul for the whole block, then each chunk's rescaling,
    # rather than an (N, n, M, Dv) copy of the state per chunk.
    flat_q = phi_q.view(N, n * L, M)
    num_state = (flat_q @ state.kv).view(N, n, L, Dv)
    den_state = (flat_q @ state.z.unsqueeze(-1)).view(N, n, L)
    if keep is not None:
        num_state, den_state = num_state * keep[..., None, None], den_state * keep[..., None]
    num = intra @ vv + phi_q @ kv_in + num_state  # (N, n, L, Dv)
    den = intra.sum(-1) + (phi_q @ z_in.unsqueeze(-1)).squeeze(-1) + den_state  # (N, n, L)
    units = None if b is None else b.view(N, n, L)
    if m is not None:
        m_units = _finite(m[:, 1:]).unsqueeze(-1)
        units = m_units if units is None else units + m_units
    out = _normalize(num, den, eps, units).view(N, n * L, Dv)[:, :P]  # (N, P, Dv)
    kv, z = kv_in[:, -1] + d_kv[:, -1], z_in[:, -1] + d_z[:, -1]  # in the last chunk's units
    if keep is None or m is None:  # both or neither: keep is None exactly when m is
        return out, LinearState(kv + state.kv, z + state.z, state.m)
    r = keep[:, -1]  # the incoming state's rescaling into those units
    return out, LinearState(kv + r[:, None, None] * state.kv, z + r[:, None] * state.z, m[:, -1])


def _carry_weights(m: Tensor | None, n: int, like: Tensor) -> tuple[Tensor, Tensor | None]:
    """How chunk c' < c and the incoming state count in the state entering chunk c.

    Without a log-scale: 1 and 1 (an exclusive prefix sum). With one, chunk c' is in units
    ``exp(-m_c')`` and the state in ``exp(-m_in)``; entering chunk c they are rescaled to
    ``exp(-m_c)`` by ``exp(m_c' - m_c) <= 1`` (0 for a chunk with no key yet).

    Shape:
        m ``(N, 1 + n)`` -> carry ``(N, n, n)`` (strictly lower triangular), keep ``(N, n)``;
        ``(1, n, n)`` and None (all 1) when m is None.
    """
    strict = torch.ones(n, n, dtype=torch.bool, device=like.device).tril(-1)
    if m is None:
        return strict.to(like.dtype).unsqueeze(0), None
    finite = torch.isfinite(m)
    ms = _finite(m)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    ratio = torch.where(
        finite[:, :, None] & finite[:, None, :], (ms[:, None, :] - ms[:, :, None]).exp(), zero
    )  # (N, 1+n, 1+n): [c, c']
    carry = torch.where(strict, ratio[:, 1:, 1:], zero)  # (N, n, n)
    return carry, ratio[:, 1:, 0]  # the state's own units are m[:, 0]


def _accumulate(
    state: LinearState, fk: Features, v: Tensor, key_mask: Tensor | None
) -> LinearState:
    """``state`` plus the keys ``fk`` with values ``v``, in units of the largest key so far.

    Shape:
        fk ``(N, P, M)``; v ``(N, P, Dv)``; key_mask ``(N, P)`` or None.
    """
    phi_k, kv, z, m = fk.values, state.kv, state.z, state.m
    if fk.log_scale is not None:
        m_new = torch.maximum(m, _seen(fk.log_scale, key_mask).amax(-1))  # (N,)
        r = torch.where(torch.isfinite(m_new), (m - _finite(m_new)).exp(), torch.zeros_like(m))
        kv, z, m = kv * r[:, None, None], z * r[:, None], m_new
        phi_k = phi_k * (
            _key_scale(fk.log_scale, key_mask) - _finite(m).unsqueeze(-1)
        ).exp().unsqueeze(-1)
    phi_k, v = _masked(phi_k, v, None if key_mask is None else key_mask.unsqueeze(-1))
    return LinearState(kv + phi_k.transpose(-1, -2) @ v, z + phi_k.sum(-2), m)


def _readout(fq: Features, state: LinearState, eps: float) -> Tensor:
    """``phi(q) kv / (phi(q) . z + eps)`` for every query.

    Shape: ``(N, T, M)`` -> ``(N, T, Dv)``.
    """
    phi_q, b = _query_units(fq)
    num = phi_q @ state.kv  # (N, T, Dv)
    den = (phi_q @ state.z.unsqueeze(-1)).squeeze(-1)  # (N, T)
    units = None
    if b is not None:
        units = b + _finite(state.m).unsqueeze(-1)
    return _normalize(num, den, eps, units)


def _query_units(fq: Features) -> tuple[Tensor, Tensor | None]:
    """Queries in units ``exp(-b_i)``: the values times ``exp(b - b.detach())`` (1, with the
    gradient of ``b``). Returns them and ``b`` (detached), the units to convert eps to."""
    if fq.log_scale is None:
        return fq.values, None
    b = fq.log_scale.detach()
    return fq.values * (fq.log_scale - b).exp().unsqueeze(-1), b  # (N, T, M), (N, T)


def _seen(log_scale: Tensor, key_mask: Tensor | None) -> Tensor:
    """The keys' log-scales as units (detached), -inf for padding keys."""
    a = log_scale.detach()
    return a if key_mask is None else a.masked_fill(~key_mask, float("-inf"))


def _key_scale(log_scale: Tensor, key_mask: Tensor | None) -> Tensor:
    """The keys' log-scales with -inf for padding keys, before any ``exp``: a padding key may
    be larger than the units (which count real keys only), and ``exp`` of it would be inf, whose
    gradient through the later ``where`` is NaN."""
    if key_mask is None:
        return log_scale
    return torch.where(
        key_mask,
        log_scale,
        torch.full((), float("-inf"), dtype=log_scale.dtype, device=log_scale.device),
    )


def _finite(m: Tensor) -> Tensor:
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _normalize(num: Tensor, den: Tensor, eps: float, log_units: Tensor | None) -> Tensor:
    """``num / (den + eps)`` with eps in the units of num and den (``exp(-log_units)``). A row
    with nothing to attend (den + eps = 0, so num = 0 too) gives exactly 0 with zero
    gradients, never 0/0; eps = 0 divides by den exactly, however small."""
    total = den
    if eps and log_units is None:
        total = den + eps
    elif eps and log_units is not None:
        total = den + (math.log(eps) - log_units).exp()  # inf (-> output 0) when eps dominates
    total = torch.where(total > 0, total, torch.ones_like(total))
    return num / total.unsqueeze(-1)


def _masked(phi_k: Tensor, v: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """Zero the features and values of padding keys (``where``, so inf/NaN values cannot leak)."""
    if keep is None:
        return phi_k, v
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    return torch.where(keep, phi_k, zero), torch.where(keep, v, zero)


def _blocks(block: int, first: Tensor, *rest: Tensor | None) -> list[list]:
    """Each tensor cut into blocks of positions (dim 1); None stays None for every block.

    ``split`` rather than slicing in a loop: autograd then joins the blocks' gradients with one
    ``cat``, where each slice's backward would write a zero-filled full-length gradient.
    """
    tensors = (first, *rest)
    if first.shape[1] == 0:  # split gives one empty block; there is none
        return [[] for _ in tensors]
    n = len(first.split(block, 1))
    return [[None] * n if t is None else list(t.split(block, 1)) for t in tensors]


def _join(outs: Iterable[Tensor], q: Tensor, v: Tensor) -> Tensor:
    """The blocks' outputs, in order, as one ``(N, T, Dv)``.

    Without autograd each block is written into the output as it is made, so the peak is the
    output plus one block; with it, the blocks are kept for the backward and joined by cat.
    """
    N, T, Dv = q.shape[0], q.shape[1], v.shape[-1]
    if torch.is_grad_enabled():
        outs = list(outs)
        if any(o.requires_grad for o in outs):
            return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    out, s = v.new_empty(N, T, Dv), 0
    for o in outs:
        out[:, s : s + o.shape[1]] = o
        s += o.shape[1]
    return out


def _pad(t: Tensor, pad: int) -> Tensor:
    """Pad dim 1 (positions) with ``pad`` zeros (False for bool)."""
    shape = (t.shape[0], pad) + tuple(t.shape[2:])
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], 1)
