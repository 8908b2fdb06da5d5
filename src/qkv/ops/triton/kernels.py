"""Triton kernels: FlashAttention-2's forward and backward with qkv's mask contract.

Supported:
  * CUDA tensors in float16 and bfloat16 (tensor-core dots, float32 accumulation, float32
    softmax statistics). float32 (IEEE float32 dots, exact like the reference) runs only under
    the CPU interpreter, for tests: compiled for a GPU it spills registers, so the backend
    refuses float32 CUDA tensors.
  * Head dims D (query/key) and Dv (value) up to 128, each padded inside the kernel to the next
    power of two >= 16 by masked loads (32, 64 and 128 waste nothing; 59 computes as 64).
  * Any T and S: rows and columns past the end of the last block are masked, not assumed away
    (a last key block cut short by S is always visited as PARTIAL, so FULL blocks need no
    bounds check; query rows past T load zeros, are never stored and get ``p = 0``).
  * Masks evaluated in the kernel from a handful of numbers, never from a (T, S) tensor:
    ``is_causal``, ``causal`` and ``sliding_window`` in either alignment (every AND of them is
    one band ``lo <= kv - q <= hi``), ``key_lengths`` (an int or one per batch element),
    ``document`` ids (one document mask; self- or cross-attention ids), and ``and_masks`` of
    these.
  * score mods: ``softcap(cap)`` and ``alibi(slopes)`` (slopes not requiring grad), applied
    to the scaled scores in that order (FlexAttention's ``score_mod`` semantics), custom
    ``scale``.
  * GQA: query head ``h`` reads key/value head ``h // (H // G)``; the backward sums each
    group's key/value gradients inside the kernel (one program per key block and kv head).
  * Block skipping (FlexAttention's ``BlockMask``): the caller classifies every (query block,
    key block) pair as EMPTY, PARTIAL or FULL with ``qkv.masks.block_states`` -- the same
    classification the tiled backend uses -- and passes, per query block, the list of FULL key
    blocks (visited without evaluating the mask) and of PARTIAL ones (mask evaluated); EMPTY
    blocks are never loaded. The backward's key-block programs get the transposed lists.
  * The mask contract: a query row with no allowed key outputs exactly 0, its log-sum-exp is
    ``-inf`` and its gradients are 0; no NaN anywhere (the running max is taken as 0 while a
    row has seen no key, so no ``-inf - -inf``).
  * Outputs: ``out`` in the inputs' dtype and ``lse`` (natural log, float32).

Not supported (the backend's ``supports(call)`` says so and names a backend that can):
dropout, dense ``attn_mask`` tensors, float64, D or Dv above 128, ``or_masks`` (``prefix_lm``),
more than one ``document`` mask, plain-function ``mask_mod``/``score_mod`` (the kernel cannot
run Python), other score mods, ALiBi slopes that require grad, double backward.

How it differs from the reference (``qkv.ops.reference``, plain softmax(QK^T)V):
  * Half inputs: scores and the softmax stay in float32 (the reference in bfloat16 rounds the
    scores and weights to bfloat16); the weights meet V rounded to the inputs' dtype, and dS
    meets Q and K rounded likewise (FlashAttention's choice: the tensor cores take half
    operands). Errors stay within the tolerance policy's 2x (outputs) and 3x (gradients) of
    the reference's own error in that dtype.
  * The softmax is computed online in base 2 (``exp2`` of scores times log2(e)); the lse is
    returned in natural log.
  * Summation order differs (blockwise), so results agree to rounding, not bit for bit.

Algorithm: Dao 2023 (FlashAttention-2), as in Triton's fused-attention tutorial: the forward
runs one program per (query block, batch x head) keeping a running max ``m``, sum ``l`` and
accumulator; the backward computes ``delta = rowsum(dO * O)`` (in PyTorch), then one program
per (key block, batch x kv head) accumulates dK, dV over the query blocks that see it, and one
per (query block, batch x head) accumulates dQ -- no atomics, so it is deterministic.

Interpreter (``TRITON_INTERPRET=1``, CPU tensors, for tests): triton 3.9's interpreter
multiplies bfloat16 dot operands as their raw uint16 bit patterns (``create_dot`` in
``triton/runtime/interpreter.py`` converts only 8-bit floats), so there the caller sets
``UPCAST`` and bfloat16 operands are widened to float32 before each dot. bfloat16 products are
exact in float32, so this gives what the tensor cores give, up to summation order.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim; a block has BLOCK_M queries and BLOCK_N keys.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in base 2: exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


# Row max and row sum as tl.reduce with triton's own combine functions, not tl.max/tl.sum:
# those are @jit functions of triton.language, decorated when triton was imported, so an
# interpreted copy of this file could not call them unless TRITON_INTERPRET=1 was set before
# `import triton`. The interpreter recognises these two combine functions and reduces with
# numpy (a combine function of ours would run once per element: ~100x slower). The compiled
# kernels get the same reductions either way.
_MAX = getattr(tl.standard, "_elementwise_max", _maximum)
_SUM = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` accumulated in float32 (see the module docstring for UPCAST)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    """tanh in float32 from exp, for softcap (tl has no portable tanh)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(qk, q_pos, kv_pos, S, scale, cap, slope, lo, hi, kv_len, q_doc, kv_doc,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
            HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_KVLEN: tl.constexpr,
            HAS_DOC: tl.constexpr):
    """Raw dot products -> score-modified, masked scores in base-2 units, and tanh(s / cap)
    (for the softcap's derivative; 0 without softcap).

    ``q_pos``/``kv_pos`` (and ``q_doc``/``kv_doc``) broadcast to qk's shape, so the same
    function serves the (queries, keys) tiles of the forward and dQ and the transposed
    (keys, queries) tiles of dK/dV.
    """
    t = 0.0
    if SOFTCAP or ALIBI:
        s = qk * scale
        if SOFTCAP:
            t = _tanh(s / cap)
            s = cap * t
        if ALIBI:
            s = s + slope * (kv_pos - q_pos).to(tl.float32)
        s = s * LOG2E
    else:
        s = qk * (scale * LOG2E)
    if MASKED:
        keep = kv_pos < S
        if HAS_LO:
            keep = keep & (kv_pos - q_pos >= lo)
        if HAS_HI:
            keep = keep & (kv_pos - q_pos <= hi)
        if HAS_KVLEN:
            keep = keep & (kv_pos < kv_len)
        if HAS_DOC:
            keep = keep & (q_doc == kv_doc)
        s = tl.where(keep, s, float("-inf"))
    return s, t


@triton.jit
def _load(ptrs, rows, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr,
          EVEN_ROWS: tl.constexpr):
    """A (rows, cols) tile, zeros past the last row or past the head dim."""
    if EVEN_ROWS and N_COLS == BLOCK_COLS:
        return tl.load(ptrs)
    if EVEN_ROWS:
        return tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
    if N_COLS == BLOCK_COLS:
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)


@triton.jit
def _store(ptrs, x, rows, n_rows, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    if N_COLS == BLOCK_COLS:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))


@triton.jit
def _tile_scores(a, offs_a, a_doc, B, stride_bn, stride_bd, start_b, n_b, BDOC,
                 S, scale, cap, slope, lo, hi, kv_len,
                 D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
                 A_IS_QUERY: tl.constexpr, B_DOC_ABSENT: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
                 B_IN_RANGE: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                 HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The prologue of every block step, shared by the three kernels: the other side's
    (BLOCK_B, D) tile loaded, ``a @ b^T`` in float32, the other side's document ids, and the
    masked, score-modified scores of ``_scores``.

    Forward and dQ: ``a`` is the program's query block and ``b`` a key block; the tiles are
    (queries, keys). dK/dV: ``a`` is the program's key block and ``b`` a query block; the
    tiles are (keys, queries), the transposed scores from the same arithmetic. ``a_doc`` is
    the program's own document ids, already shaped to broadcast along the tile's rows.
    Returns the loaded tile, its positions, the scores (base 2) and tanh(s / cap).
    """
    offs_b = start_b + tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, BLOCK_D)
    b = _load(B + offs_b[:, None] * stride_bn + offs_d[None, :] * stride_bd,
              offs_b, n_b, offs_d, D, BLOCK_D, B_IN_RANGE)  # (BLOCK_B, BLOCK_D)
    ab = _dot(a, tl.trans(b), tl.full([a.shape[0], BLOCK_B], 0.0, tl.float32), UPCAST,
              PRECISION)  # (BLOCK_A, BLOCK_B)
    b_doc = 0
    if MASKED and HAS_DOC:
        b_doc = tl.load(BDOC + offs_b, mask=offs_b < n_b, other=B_DOC_ABSENT)[None, :]
    if A_IS_QUERY:
        s, t = _scores(ab, offs_a[:, None], offs_b[None, :], S, scale, cap, slope, lo, hi,
                       kv_len, a_doc, b_doc, SOFTCAP, ALIBI, MASKED, HAS_LO, HAS_HI,
                       HAS_KVLEN, HAS_DOC)
    else:
        s, t = _scores(ab, offs_b[None, :], offs_a[:, None], S, scale, cap, slope, lo, hi,
                       kv_len, b_doc, a_doc, SOFTCAP, ALIBI, MASKED, HAS_LO, HAS_HI,
                       HAS_KVLEN, HAS_DOC)
    return b, offs_b, s, t


@triton.jit
def _fwd_block(acc, l_i, m_i, q, K, V, KDOC, start_n, offs_m, q_doc,
               stride_kn, stride_kd, stride_vn, stride_vd,
               S, scale, cap, slope, lo, hi, kv_len,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
               KEYS_IN_RANGE: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
               HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One key block into the running (acc, l, m) of a query block: the online softmax."""
    _, offs_n, s, _ = _tile_scores(q, offs_m, q_doc, K, stride_kn, stride_kd, start_n, S, KDOC,
                                   S, scale, cap, slope, lo, hi, kv_len, D, BLOCK_N, BLOCK_D,
                                   True, -1, SOFTCAP, ALIBI, MASKED, KEYS_IN_RANGE, HAS_LO,
                                   HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST,
                                   PRECISION)  # s: (BLOCK_M, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))  # (BLOCK_M,)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no -inf - -inf
    p = tl.math.exp2(s - m_use[:, None])  # (BLOCK_M, BLOCK_N)
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    v = _load(V + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
              offs_n, S, offs_dv, DV, BLOCK_DV, KEYS_IN_RANGE)  # (BLOCK_N, BLOCK_DV)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
    return acc, l_i, m_new


@triton.jit
def attn_fwd(Q, K, V, OUT, LSE,
             FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KVLEN, QDOC, KDOC, SLOPES,
             stride_qb, stride_qh, stride_qm, stride_qd,
             stride_kb, stride_kh, stride_kn, stride_kd,
             stride_vb, stride_vh, stride_vn, stride_vd,
             stride_ob, stride_oh, stride_om, stride_od,
             stride_nb, stride_nh, stride_ib, stride_ih, stride_im,
             stride_qdoc, stride_kdoc, stride_slope,
             H, T, S, GROUPS, scale, cap, lo, hi,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, EVEN_M: tl.constexpr,
             EVEN_N: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
             HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
             UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (query block, b * H + h): out (B, H, T, Dv) and lse (B, H, T)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
              + offs_d[None, :] * stride_qd, offs_m, T, offs_d, D, BLOCK_D, EVEN_M)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh

    kv_len = 0
    if HAS_KVLEN:
        kv_len = tl.load(KVLEN + b)
    q_doc = 0
    if HAS_DOC:
        q_doc = tl.load(QDOC + b * stride_qdoc + offs_m, mask=offs_m < T, other=-2)[:, None]
        KDOC += b * stride_kdoc
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + h * stride_slope)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    num = b * stride_nb + h * stride_nh + pid_m
    idx = b * stride_ib + h * stride_ih + pid_m * stride_im
    for t in range(tl.load(FULL_NUM + num)):  # blocks every pair of which may attend: no mask
        start_n = tl.load(FULL_IDX + idx + t) * BLOCK_N
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, K, V, KDOC, start_n, offs_m, q_doc,
                                   stride_kn, stride_kd, stride_vn, stride_vd,
                                   S, scale, cap, slope, lo, hi, kv_len,
                                   D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, SOFTCAP, ALIBI, False,
                                   True, HAS_LO, HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST, PRECISION)
    for t in range(tl.load(PART_NUM + num)):  # partial blocks: the mask is evaluated
        start_n = tl.load(PART_IDX + idx + t) * BLOCK_N
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, K, V, KDOC, start_n, offs_m, q_doc,
                                   stride_kn, stride_kd, stride_vn, stride_vd,
                                   S, scale, cap, slope, lo, hi, kv_len,
                                   D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, SOFTCAP, ALIBI, True,
                                   EVEN_N, HAS_LO, HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST, PRECISION)

    empty = l_i == 0.0  # no allowed key: out exactly 0, lse -inf (the mask contract)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    _store(OUT + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
           + offs_dv[None, :] * stride_od, out.to(OUT.dtype.element_ty), offs_m, T, offs_dv, DV,
           BLOCK_DV)
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, lse, mask=offs_m < T)


@triton.jit
def _dkdv_block(dk, dv, k, v, Q, DO, LSE, DELTA, QDOC, start_m, offs_n, kv_doc,
                stride_qm, stride_qd, stride_dom, stride_dod,
                T, S, scale, cap, slope, lo, hi, kv_len,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
                EVEN_M: tl.constexpr, HAS_LO: tl.constexpr,
                HAS_HI: tl.constexpr, HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One query block into a key block's dK, dV, computed transposed: (keys, queries) tiles."""
    q, offs_m, sT, tT = _tile_scores(k, offs_n, kv_doc, Q, stride_qm, stride_qd, start_m, T,
                                     QDOC, S, scale, cap, slope, lo, hi, kv_len, D, BLOCK_M,
                                     BLOCK_D, False, -2, SOFTCAP, ALIBI, MASKED, EVEN_M, HAS_LO,
                                     HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST,
                                     PRECISION)  # sT: (BLOCK_N, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    do = _load(DO + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
               offs_m, T, offs_dv, DV, BLOCK_DV, EVEN_M)  # (BLOCK_M, BLOCK_DV)
    lse = tl.load(LSE + offs_m, mask=offs_m < T, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # no key: p = 0
    delta = tl.load(DELTA + offs_m, mask=offs_m < T, other=0.0)
    pT = tl.math.exp2(sT - lse[None, :])  # (BLOCK_N, BLOCK_M)
    dv = _dot(pT.to(do.dtype), do, dv, UPCAST, PRECISION)  # dV += P^T dO
    dpT = _dot(v, tl.trans(do), tl.full([k.shape[0], BLOCK_M], 0.0, tl.float32), UPCAST,
               PRECISION)  # (dO V^T)^T
    dsT = pT * (dpT - delta[None, :])  # dS = P * (dP - rowsum(dO * O))
    if SOFTCAP:
        dsT = dsT * (1.0 - tT * tT)  # d(cap * tanh(s / cap)) / ds
    return _dot(dsT.to(q.dtype), q, dk, UPCAST, PRECISION), dv  # dK += dS^T Q (scaled later)


@triton.jit
def attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK_OUT, DV_OUT,
                  FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KVLEN, QDOC, KDOC, SLOPES,
                  stride_qb, stride_qh, stride_qm, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_dob, stride_doh, stride_dom, stride_dod,
                  stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                  stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                  stride_nb, stride_nh, stride_ib, stride_ih, stride_im,
                  stride_qdoc, stride_kdoc, stride_slope,
                  H, G, T, S, GROUPS, scale, cap, lo, hi,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, EVEN_M: tl.constexpr,
                  EVEN_N: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                  HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (key block, b * G + g): dK (B, G, S, D) and dV (B, G, S, Dv), summed
    over the GROUPS query heads that share kv head g. The lists are per key block: the query
    blocks (FULL, then PARTIAL) that may attend to it; they are the same for every head, so
    the head strides stride_nh, stride_ih go unused here."""
    pid_n = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = (pid_bg % G).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load(K + b * stride_kb + g * stride_kh + offs_n[:, None] * stride_kn
              + offs_d[None, :] * stride_kd, offs_n, S, offs_d, D, BLOCK_D, EVEN_N)
    v = _load(V + b * stride_vb + g * stride_vh + offs_n[:, None] * stride_vn
              + offs_dv[None, :] * stride_vd, offs_n, S, offs_dv, DV, BLOCK_DV, EVEN_N)
    kv_len = 0
    if HAS_KVLEN:
        kv_len = tl.load(KVLEN + b)
    kv_doc = 0
    if HAS_DOC:
        kv_doc = tl.load(KDOC + b * stride_kdoc + offs_n, mask=offs_n < S, other=-1)[:, None]
        QDOC += b * stride_qdoc
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
    # The query heads of the group (GROUPS of them share kv head g) and their blocks as one
    # loop: the block lists do not depend on the head (no mask the kernels evaluate does), and
    # a nested loop per head costs registers (spills at D = 128).
    num = b * stride_nb + pid_n
    idx = b * stride_ib + pid_n * stride_im
    n_full = tl.load(FULL_NUM + num)
    for t in range(n_full * GROUPS):
        j = t // n_full
        h = g * GROUPS + j
        slope = 0.0
        if ALIBI:
            slope = tl.load(SLOPES + h * stride_slope)
        start_m = tl.load(FULL_IDX + idx + t - j * n_full) * BLOCK_M
        row = (b * H + h) * T
        dk, dv = _dkdv_block(dk, dv, k, v, Q + b * stride_qb + h * stride_qh,
                             DO + b * stride_dob + h * stride_doh, LSE + row, DELTA + row, QDOC,
                             start_m, offs_n, kv_doc, stride_qm, stride_qd, stride_dom, stride_dod,
                             T, S, scale, cap, slope, lo, hi, kv_len,
                             D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, SOFTCAP, ALIBI, False,
                             EVEN_M, HAS_LO, HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST, PRECISION)
    n_part = tl.load(PART_NUM + num)
    for t in range(n_part * GROUPS):
        j = t // n_part
        h = g * GROUPS + j
        slope = 0.0
        if ALIBI:
            slope = tl.load(SLOPES + h * stride_slope)
        start_m = tl.load(PART_IDX + idx + t - j * n_part) * BLOCK_M
        row = (b * H + h) * T
        dk, dv = _dkdv_block(dk, dv, k, v, Q + b * stride_qb + h * stride_qh,
                             DO + b * stride_dob + h * stride_doh, LSE + row, DELTA + row, QDOC,
                             start_m, offs_n, kv_doc, stride_qm, stride_qd, stride_dom, stride_dod,
                             T, S, scale, cap, slope, lo, hi, kv_len,
                             D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, SOFTCAP, ALIBI, True,
                             EVEN_M, HAS_LO, HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST, PRECISION)
    _store(DK_OUT + b * stride_dkb + g * stride_dkh + offs_n[:, None] * stride_dkn
           + offs_d[None, :] * stride_dkd, (dk * scale).to(DK_OUT.dtype.element_ty), offs_n, S,
           offs_d, D, BLOCK_D)
    _store(DV_OUT + b * stride_dvb + g * stride_dvh + offs_n[:, None] * stride_dvn
           + offs_dv[None, :] * stride_dvd, dv.to(DV_OUT.dtype.element_ty), offs_n, S, offs_dv, DV,
           BLOCK_DV)


@triton.jit
def _dq_block(dq, q, do, lse, delta, K, V, KDOC, start_n, offs_m, q_doc,
              stride_kn, stride_kd, stride_vn, stride_vd,
              S, scale, cap, slope, lo, hi, kv_len,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, MASKED: tl.constexpr,
              KEYS_IN_RANGE: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
              HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One key block into a query block's dQ."""
    k, offs_n, s, t = _tile_scores(q, offs_m, q_doc, K, stride_kn, stride_kd, start_n, S, KDOC,
                                   S, scale, cap, slope, lo, hi, kv_len, D, BLOCK_N, BLOCK_D,
                                   True, -1, SOFTCAP, ALIBI, MASKED, KEYS_IN_RANGE, HAS_LO,
                                   HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST,
                                   PRECISION)  # s: (BLOCK_M, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    v = _load(V + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
              offs_n, S, offs_dv, DV, BLOCK_DV, KEYS_IN_RANGE)  # (BLOCK_N, BLOCK_DV)
    p = tl.math.exp2(s - lse[:, None])  # (BLOCK_M, BLOCK_N)
    dp = _dot(do, tl.trans(v), tl.full([q.shape[0], BLOCK_N], 0.0, tl.float32), UPCAST,
              PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return _dot(ds.to(k.dtype), k, dq, UPCAST, PRECISION)  # dQ += dS K (scaled later)


@triton.jit
def attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ,
                FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KVLEN, QDOC, KDOC, SLOPES,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_dob, stride_doh, stride_dom, stride_dod,
                stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                stride_nb, stride_nh, stride_ib, stride_ih, stride_im,
                stride_qdoc, stride_kdoc, stride_slope,
                H, T, S, GROUPS, scale, cap, lo, hi,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, EVEN_M: tl.constexpr,
                EVEN_N: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
                HAS_KVLEN: tl.constexpr, HAS_DOC: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (query block, b * H + h): dQ (B, H, T, D)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
              + offs_d[None, :] * stride_qd, offs_m, T, offs_d, D, BLOCK_D, EVEN_M)
    do = _load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
               + offs_dv[None, :] * stride_dod, offs_m, T, offs_dv, DV, BLOCK_DV, EVEN_M)
    row = pid_bh.to(tl.int64) * T
    lse = tl.load(LSE + row + offs_m, mask=offs_m < T, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # no key: p = 0
    delta = tl.load(DELTA + row + offs_m, mask=offs_m < T, other=0.0)
    K += b * stride_kb + hk * stride_kh
    V += b * stride_vb + hk * stride_vh
    kv_len = 0
    if HAS_KVLEN:
        kv_len = tl.load(KVLEN + b)
    q_doc = 0
    if HAS_DOC:
        q_doc = tl.load(QDOC + b * stride_qdoc + offs_m, mask=offs_m < T, other=-2)[:, None]
        KDOC += b * stride_kdoc
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + h * stride_slope)
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    num = b * stride_nb + h * stride_nh + pid_m
    idx = b * stride_ib + h * stride_ih + pid_m * stride_im
    for t in range(tl.load(FULL_NUM + num)):
        start_n = tl.load(FULL_IDX + idx + t) * BLOCK_N
        dq = _dq_block(dq, q, do, lse, delta, K, V, KDOC, start_n, offs_m, q_doc,
                       stride_kn, stride_kd, stride_vn, stride_vd,
                       S, scale, cap, slope, lo, hi, kv_len,
                       D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, SOFTCAP, ALIBI, False,
                       True, HAS_LO, HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST, PRECISION)
    for t in range(tl.load(PART_NUM + num)):
        start_n = tl.load(PART_IDX + idx + t) * BLOCK_N
        dq = _dq_block(dq, q, do, lse, delta, K, V, KDOC, start_n, offs_m, q_doc,
                       stride_kn, stride_kd, stride_vn, stride_vd,
                       S, scale, cap, slope, lo, hi, kv_len,
                       D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, SOFTCAP, ALIBI, True,
                       EVEN_N, HAS_LO, HAS_HI, HAS_KVLEN, HAS_DOC, UPCAST, PRECISION)
    _store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm
           + offs_d[None, :] * stride_dqd, (dq * scale).to(DQ.dtype.element_ty), offs_m, T,
           offs_d, D, BLOCK_D)
