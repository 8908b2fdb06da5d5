"""Linear attention: the fast forms against their slow twins, by name.

``linear_attention`` (``chunk.linear_attention_global`` / ``linear_attention_chunked``) and
``LinearAttentionState`` (``recurrent.py``) against ``naive.linear_attention_quadratic`` (the
(T, S) normalised form) and ``naive.linear_attention_loop`` (one position at a time), over
awkward sizes (T = 1, 17, 97, 113, 1025, 2049 cross the 64-position chunk and the
1024-position block), for the elu, relu and FAVOR+ feature maps, with and without key_mask,
outputs and gradients. Then: causal equals recurrent, key_mask, FAVOR+ against exact softmax,
layouts and dtypes, the trace, errors, empty inputs.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, M features, N = B x H flattened.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.ops.linear import (
    LinearAttentionState,
    linear_attention_chunked,
    linear_attention_loop,
    linear_attention_quadratic,
    prepare,
    resolve_feature_map,
)
from qkv.ops.linear.feature_maps import orthogonal_gaussian
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance

# The bound for fast vs slow twin in float32: max|fast - slow| / max|slow|.
TWIN_RTOL = 1e-5
FEATURE_MAPS = ["elu", "relu", "favor"]


def _feature_map(name: str, D: int, seed: int = 1):
    """A name, or for "favor" a Favor built here (not the cached default of the name)."""
    return qkv.Favor(D, seed=seed) if name == "favor" else name


def _rel_err(fast: torch.Tensor, slow: torch.Tensor, scale: float | None = None) -> float:
    """``max|fast - slow| / max|slow|`` (or ``/ scale``), NaN counting as infinite."""
    if fast.numel() == 0:
        return 0.0
    diff = (fast.detach().double() - slow.detach().double()).abs()
    diff = torch.nan_to_num(diff, nan=math.inf).max()
    scale = float(slow.detach().double().abs().max()) if scale is None else scale
    return 0.0 if diff == 0 else float(diff / scale)


def _quadratic(q, k, v, feature_map="elu", *, is_causal=False, key_mask=None, eps=1e-6):
    """The slow twin with the public function's layout: the quadratic normalised form."""
    inp = prepare(q, k, v, key_mask, is_causal=is_causal)
    phi = resolve_feature_map(feature_map, q.shape[-1])
    out, _, _ = linear_attention_quadratic(
        phi(inp.q), phi(inp.k), inp.v, is_causal=is_causal, key_mask=inp.key_mask, eps=eps
    )
    return inp.restore(out)


def _loop(q, k, v, feature_map="elu", *, key_mask=None, eps=1e-6):
    """The slow twin of the causal forms: one position at a time, features written out."""
    inp = prepare(q, k, v, key_mask, is_causal=True)
    phi = resolve_feature_map(feature_map, q.shape[-1])
    return inp.restore(
        linear_attention_loop(phi(inp.q), phi(inp.k), inp.v, key_mask=inp.key_mask, eps=eps)
    )


def _key_mask(B: int, S: int, seed: int = 0) -> torch.Tensor:
    """Random padding (~25%) with the last batch element left-padded by 3 keys, so some causal
    rows (and for S <= 3 whole rows) see no key at all."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, S, generator=g) < 0.75  # (B, S)
    mask[-1, :3] = False
    return mask


def _at_most_one_key(T: int, S: int, causal: bool, key_mask: torch.Tensor | None) -> bool:
    """Whether no query sees two keys. Then ``out = A v / (A + eps)`` is v up to O(eps) for
    every query, so dq and dk are rounding noise in both forms, compared on dv's scale."""
    seen = torch.ones(1, T, S, dtype=torch.bool)
    if causal:
        seen = seen & torch.ones(T, S, dtype=torch.bool).tril()
    if key_mask is not None:
        seen = seen & key_mask[:, None, :]
    return S == 0 or T == 0 or int(seen.sum(-1).max()) <= 1


def _assert_twins(fast_fn, slow_fn, inputs, what: str, *, qk_grads_are_noise: bool = False):
    """Outputs and the gradients of one random cotangent agree within TWIN_RTOL."""
    fast = fast_fn(*inputs)
    slow = slow_fn(*inputs)
    assert not fast.isnan().any(), f"{what}: NaN in the fast output"
    err = _rel_err(fast, slow)
    assert err < TWIN_RTOL, f"{what}: output rel err {err:.2e}"
    cot = torch.randn_like(slow)
    fast_grads = torch.autograd.grad(fast, inputs, cot)
    slow_grads = torch.autograd.grad(slow, inputs, cot)
    for name, a, b in zip("qkv", fast_grads, slow_grads):
        assert not a.isnan().any(), f"{what}: NaN in d{name}"
        scale = float(slow_grads[2].abs().max()) if name in "qk" and qk_grads_are_noise else None
        err = _rel_err(a, b, scale)
        assert err < TWIN_RTOL, f"{what}: d{name} rel err {err:.2e}"


# --- closed-form values ---------------------------------------------------------------------


def test_closed_form_elu_and_relu():
    """Worked by hand with eps = 0. elu: q = 0 gives phi(q) = [1, 1]; keys [0, 0] and [1, 0]
    give phi(k) = [1, 1] and [2, 1], so A = [2, 3] and out = [2, 3] / 5. relu: phi = identity
    on these, A = [[1, 2], [0, 2]]."""
    v = torch.eye(2, dtype=torch.float64)
    q = torch.zeros(2, 2, dtype=torch.float64)
    k = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    out = qkv.linear_attention(q, k, v, eps=0)
    torch.testing.assert_close(out, torch.tensor([[0.4, 0.6], [0.4, 0.6]], dtype=torch.float64))
    out = qkv.linear_attention(q, k, v, eps=0, is_causal=True)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0], [0.4, 0.6]], dtype=torch.float64))
    q = torch.eye(2, dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [2.0, 2.0]], dtype=torch.float64)
    out = qkv.linear_attention(q, k, v, feature_map="relu", eps=0)
    torch.testing.assert_close(out, torch.tensor([[1 / 3, 2 / 3], [0.0, 1.0]], dtype=torch.float64))
    # eps counts in the normaliser: A = [1, 2] for row 0, so out = [1, 2] / (3 + eps)
    out = qkv.linear_attention(q, k, v, feature_map="relu", eps=1.0)
    torch.testing.assert_close(out[0], torch.tensor([0.25, 0.5], dtype=torch.float64))


# --- fast vs slow twin ----------------------------------------------------------------------

TWIN_SIZES = [(T, D) for T in (1, 17, 97, 113, 1025) for D in (16, 59)]


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "keymask"])
@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
@pytest.mark.parametrize("fm", FEATURE_MAPS)
@pytest.mark.parametrize("T,D", TWIN_SIZES, ids=[f"B2-T{t}-H2-D{d}" for t, d in TWIN_SIZES])
def test_fast_matches_quadratic_twin(T, D, fm, causal, masked):
    """linear_attention (global / chunked) vs naive.linear_attention_quadratic, float32.

    Non-causal runs use S = 3T/2 + 1 (T != S, and S = 1538 crosses a key block)."""
    B, H = 2, 2
    S = T if causal else 3 * T // 2 + 1
    q = torch.randn(B, H, T, D, requires_grad=True)
    k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(2))
    key_mask = _key_mask(B, S) if masked else None
    phi = _feature_map(fm, D)
    kw = dict(feature_map=phi, is_causal=causal, key_mask=key_mask)
    _assert_twins(
        lambda *x: qkv.linear_attention(*x, **kw),
        lambda *x: _quadratic(*x, **kw),
        (q, k, v),
        f"{fm} T={T} S={S} D={D}",
        qk_grads_are_noise=_at_most_one_key(T, S, causal, key_mask),
    )


def test_fast_matches_quadratic_twin_two_blocks():
    """T = 2049 crosses two 1024-position blocks: B1-T2049-H2-D16-causal, elu and FAVOR+."""
    B, H, T, D = 1, 2, 2049, 16
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    key_mask = _key_mask(B, T)
    for fm in ("elu", "favor"):
        kw = dict(feature_map=_feature_map(fm, D), is_causal=True, key_mask=key_mask)
        _assert_twins(
            lambda *x, kw=kw: qkv.linear_attention(*x, **kw),
            lambda *x, kw=kw: _quadratic(*x, **kw),
            (q, k, v),
            f"{fm} T={T}",
        )


# The loop twin is a Python loop over positions (slow): T = 1025 for two maps only.
LOOP_CASES = [
    (T, D, fm, m)
    for T, D in [(1, 16), (17, 59), (97, 16), (113, 59)]
    for fm in FEATURE_MAPS
    for m in (False, True)
] + [(1025, 59, "elu", True), (1025, 59, "favor", True)]


@pytest.mark.parametrize(
    "T,D,fm,masked",
    LOOP_CASES,
    ids=[
        f"B2-T{t}-H1-D{d}-causal-{fm}-{'keymask' if m else 'nomask'}" for t, d, fm, m in LOOP_CASES
    ],
)
def test_chunked_causal_matches_loop_twin(T, D, fm, masked):
    """linear_attention(is_causal=True) vs naive.linear_attention_loop, float32."""
    B, H = 2, 1
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    key_mask = _key_mask(B, T) if masked else None
    phi = _feature_map(fm, D)
    _assert_twins(
        lambda *x: qkv.linear_attention(*x, feature_map=phi, is_causal=True, key_mask=key_mask),
        lambda *x: _loop(*x, feature_map=phi, key_mask=key_mask),
        (q, k, v),
        f"{fm} T={T}",
        qk_grads_are_noise=_at_most_one_key(T, T, True, key_mask),
    )


@pytest.mark.parametrize("fm", FEATURE_MAPS)
@pytest.mark.parametrize(
    "chunk_size,block", [(1, 1), (5, 7), (16, 16), (64, 40), (200, 1024)], ids=str
)
def test_chunk_sizes_and_blocks_agree(chunk_size, block, fm):
    """The chunked kernel's chunk and block lengths change the arithmetic, not the result."""
    N, T, D = 3, 97, 16
    q, k, v = (torch.randn(N, T, D, dtype=torch.float64) for _ in range(3))
    key_mask = _key_mask(N, T)
    phi = resolve_feature_map(_feature_map(fm, D), D)
    out, _ = linear_attention_chunked(
        phi, q, k, v, key_mask, 1e-6, chunk_size=chunk_size, block=block
    )
    ref, _, _ = linear_attention_quadratic(
        phi(q), phi(k), v, is_causal=True, key_mask=key_mask, eps=1e-6
    )
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("fm", ["elu", "favor"])
@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_gradcheck_float64(causal, fm):
    """Gradients of linear_attention, and of the chunked kernel with several chunks and blocks
    (so the carried state and, for FAVOR+, its rescaling to new units are differentiated)."""
    B, H, T, D = 1, 1, 5, 3
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    key_mask = torch.tensor([[True, False, True, True, True]])
    phi = qkv.Favor(D, 5, seed=2, dtype=torch.float64) if fm == "favor" else fm
    assert torch.autograd.gradcheck(
        lambda q, k, v: qkv.linear_attention(
            q, k, v, feature_map=phi, is_causal=causal, key_mask=key_mask
        ),
        (q, k, v),
    )
    if causal:
        fn = resolve_feature_map(phi, D)
        assert torch.autograd.gradcheck(
            lambda q, k, v: linear_attention_chunked(
                fn, q, k, v, key_mask, 1e-6, chunk_size=2, block=4
            )[0],
            (q[0], k[0], v[0]),
        )


# --- causal equals recurrent ----------------------------------------------------------------


def _state_map(fm: str, D: int):
    return qkv.Favor(D, seed=3).eval() if fm == "favor" else fm


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "keymask"])
@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_step_equals_causal_forward(fm, masked):
    """B2-T70-H4-G2-D16: token-by-token steps (O(1) each) equal the chunked causal forward
    and the loop twin (GQA heads too)."""
    B, H, G, T, D = 2, 4, 2, 70, 16
    q = torch.randn(B, H, T, D)
    k, v = (torch.randn(B, G, T, D) for _ in range(2))
    key_mask = _key_mask(B, T) if masked else None
    phi = _state_map(fm, D)
    full = qkv.linear_attention(q, k, v, feature_map=phi, is_causal=True, key_mask=key_mask)
    state = LinearAttentionState(phi)
    steps = torch.stack(
        [
            state.step(
                q[:, :, t], k[:, :, t], v[:, :, t], None if key_mask is None else key_mask[:, t]
            )
            for t in range(T)
        ],
        -2,
    )
    assert state.position == T
    assert _rel_err(steps, full) < TWIN_RTOL
    loop = _loop(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), phi, key_mask=key_mask)
    assert _rel_err(steps, loop) < TWIN_RTOL


@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_extend_in_pieces_then_step_equals_causal_forward(fm):
    """B2-T150-H2-D16: a prompt extended in uneven pieces (40 | 1 | 87, the last crossing two
    chunks), then 22 steps, with key_mask, equals one causal forward."""
    B, H, T, D = 2, 2, 150, 16
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    key_mask = _key_mask(B, T)
    phi = _state_map(fm, D)
    full = qkv.linear_attention(q, k, v, feature_map=phi, is_causal=True, key_mask=key_mask)
    state = LinearAttentionState(phi)
    outs, start = [], 0
    for n in (40, 1, 87):
        sl = slice(start, start + n)
        outs.append(state.extend(q[:, :, sl], k[:, :, sl], v[:, :, sl], key_mask[:, sl]))
        start += n
    assert state.position == 128
    for t in range(start, T):
        outs.append(state.step(q[:, :, t], k[:, :, t], v[:, :, t], key_mask[:, t]).unsqueeze(-2))
    out = torch.cat(outs, -2)  # (B, H, T, D)
    assert _rel_err(out, full) < TWIN_RTOL
    M = phi.M if fm == "favor" else D
    assert state.kv.shape == (B * H, M, D) and state.z.shape == (B * H, M)


def test_state_reset_and_gradients():
    """reset() forgets tokens and layout; gradients flow through steps like the forward."""
    B, H, T, D = 1, 2, 9, 8
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    state = LinearAttentionState("elu")
    state.step(torch.randn(3, 1, D), torch.randn(3, 1, D), torch.randn(3, 1, D))
    assert state.reset() is state and state.position == 0 and state.kv is None
    steps = torch.stack([state.step(q[:, :, t], k[:, :, t], v[:, :, t]) for t in range(T)], -2)
    full = qkv.linear_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(steps, full)
    cot = torch.randn_like(full)
    for a, b in zip(
        torch.autograd.grad(steps, (q, k, v), cot), torch.autograd.grad(full, (q, k, v), cot)
    ):
        torch.testing.assert_close(a, b)


# --- key_mask -------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_padded_keys_cannot_leak(fm, causal):
    """Keys and values at padded positions, even inf/NaN, change nothing; gradients of q, v
    and of the real keys stay the same and finite."""
    B, H, T, D = 2, 2, 97, 16
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    key_mask = _key_mask(B, T)
    phi = _feature_map(fm, D)
    kw = dict(feature_map=phi, is_causal=causal, key_mask=key_mask)
    pad = ~key_mask[:, None, :, None]  # (B, 1, T, 1)
    runs = []
    for poison in (None, math.inf, math.nan, 1e4):
        ins = [
            q.clone(),
            k.masked_fill(pad, poison) if poison else k.clone(),
            v.masked_fill(pad, poison) if poison else v.clone(),
        ]
        ins = [t.requires_grad_() for t in ins]
        out = qkv.linear_attention(*ins, **kw)
        assert out.isfinite().all(), f"poison {poison}"
        out.backward(torch.ones_like(out))
        runs.append((poison, out.detach(), *(t.grad for t in ins)))
    _, out0, dq0, dk0, dv0 = runs[0]
    real = key_mask[:, None, :, None].expand_as(dk0)
    for poison, out, dq, dk, dv in runs[1:]:
        assert torch.equal(out, out0), f"poison {poison}"
        assert torch.equal(dq, dq0) and torch.equal(dv, dv0), f"poison {poison}"
        assert torch.equal(dk[real], dk0[real]), f"poison {poison}"
    _, _, _, dk, dv = runs[-1]  # finite garbage: the padded keys get exactly zero gradient
    assert (dk[~real] == 0).all() and (dv[~real] == 0).all()


@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_key_mask_equals_dropping_the_keys(fm):
    """Non-causal: padded keys dropped entirely. Causal: padded positions dropped from the
    sequence, queries too, leave the real positions' outputs unchanged."""
    B, H, T, S, D = 2, 2, 33, 70, 8
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(2))
    key_mask = _key_mask(B, S)
    phi = qkv.Favor(D, seed=1, dtype=torch.float64) if fm == "favor" else fm
    out = qkv.linear_attention(q, k, v, feature_map=phi, key_mask=key_mask)
    qc = torch.randn(B, H, S, D, dtype=torch.float64)
    causal = qkv.linear_attention(qc, k, v, feature_map=phi, key_mask=key_mask, is_causal=True)
    for b in range(B):
        keep = key_mask[b]
        ref = qkv.linear_attention(q[b], k[b][:, keep], v[b][:, keep], feature_map=phi)
        torch.testing.assert_close(out[b], ref)
        ref = qkv.linear_attention(
            qc[b][:, keep], k[b][:, keep], v[b][:, keep], feature_map=phi, is_causal=True
        )
        torch.testing.assert_close(causal[b][:, keep], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_rows_with_nothing_to_attend_are_zero(fm, causal, dtype):
    """Batch 0 has no real key: its output is exactly 0 and every gradient of it exactly 0.
    Batch 1 is left-padded by 3: causal rows 0-2 see nothing and are 0 too."""
    B, H, T, D = 2, 2, 77, 16
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[0] = False
    key_mask[1, :3] = False
    out = qkv.linear_attention(
        q, k, v, feature_map=_feature_map(fm, D), is_causal=causal, key_mask=key_mask
    )
    out.backward(torch.randn_like(out))
    assert out.dtype == dtype
    for t in (out, q.grad, k.grad, v.grad):
        assert t.isfinite().all()
        assert (t[0] == 0).all()
    if causal:
        assert (out[1, :, :3] == 0).all() and (q.grad[1, :, :3] == 0).all()
        assert (out[1, :, 3:].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_relu_query_with_zero_features_outputs_zero(causal):
    """A query whose relu features all vanish attends to nothing: exactly 0, no 0/0, and its
    gradient is 0. Causal row 0 sees only a key with zero features: den = 0 there too."""
    B, H, T, D = 1, 2, 97, 16
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    q[:, :, 50] = -q[:, :, 50].abs() - 0.1
    k[:, :, 0] = -k[:, :, 0].abs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = qkv.linear_attention(q, k, v, feature_map="relu", is_causal=causal)
    out.backward(torch.randn_like(out))
    assert (out[:, :, 50] == 0).all() and (q.grad[:, :, 50] == 0).all()
    for t in (out, q.grad, k.grad, v.grad):
        assert t.isfinite().all()
    if causal:
        assert (out[:, :, 0] == 0).all()
    ref = _quadratic(q, k, v, "relu", is_causal=causal)
    assert _rel_err(out, ref) < TWIN_RTOL


def test_relu_zero_normaliser_eps_zero_gradient_is_finite():
    q = torch.tensor([[1.0, 1.0]], requires_grad=True)
    k = torch.tensor([[-1.0, -1.0]], requires_grad=True)  # relu features 0: den = 0
    v = torch.tensor([[3.0, 4.0]], requires_grad=True)
    out = qkv.linear_attention(q, k, v, feature_map="relu", is_causal=True, eps=0)
    assert (out == 0).all()
    out.sum().backward()
    assert (q.grad == 0).all(), q.grad  # got [[nan, nan]]


# --- FAVOR+ (Performer) ---------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_favor_error_against_softmax_falls_with_features(causal):
    """B1-T64-H2-D16: FAVOR+'s error against exact softmax attention, averaged over 4 fixed
    seeds, falls monotonically as M grows 4x (about 1/sqrt(M) in theory: 0.5 per step).
    Inputs have modest norms: the estimator's variance grows like exp(|q + k|^2)."""
    B, H, T, D = 1, 2, 64, 16
    q, k = (torch.randn(B, H, T, D) * 0.5 for _ in range(2))
    v = torch.randn(B, H, T, D)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    errs = []
    for M in (16, 64, 256, 1024):
        e = [
            (
                qkv.linear_attention(q, k, v, feature_map=qkv.Favor(D, M, seed=s), is_causal=causal)
                - exact
            ).norm()
            / exact.norm()
            for s in range(4)
        ]
        errs.append(float(sum(e) / len(e)))
    for small, big in itertools.pairwise(errs):
        assert big < 0.8 * small, errs
    assert errs[-1] < 0.1, errs


def test_favor_kernel_estimate_is_unbiased():
    """E[phi(q) . phi(k)] = exp(q . k / sqrt(D)): the mean over 300 seeds is within 4.5
    standard errors of the exact kernel for every (q, k) pair."""
    D, M, n = 8, 64, 300
    q = torch.randn(5, D, dtype=torch.float64) * 0.5
    k = torch.randn(6, D, dtype=torch.float64) * 0.5
    exact = torch.exp(q @ k.T / math.sqrt(D))  # (5, 6)
    est = []
    for s in range(n):
        f = qkv.Favor(D, M, seed=1000 + s, dtype=torch.float64)
        est.append(f(q).dense() @ f(k).dense().T)
    est = torch.stack(est)  # (n, 5, 6)
    z = (est.mean(0) - exact) / (est.std(0) / math.sqrt(n))
    assert z.abs().max() < 4.5, z
    assert ((est.mean(0) - exact) / exact).abs().max() < 0.05
    assert (est > 0).all()  # positive features: no negative kernel estimates


def test_favor_by_name_is_favor_seed_0():
    """ "favor" and "performer" name FAVOR+ with M = round(D ln D) features and seed 0; the
    named map is never redrawn, however often it is called."""
    D = 16
    q, k, v = (torch.randn(2, 3, 40, D) for _ in range(3))
    ref = qkv.linear_attention(q, k, v, feature_map=qkv.Favor(D, seed=0))
    for name in ("favor", "performer"):
        for _ in range(3):
            out = qkv.linear_attention(q, k, v, feature_map=name)
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert not torch.equal(ref, qkv.linear_attention(q, k, v, feature_map=qkv.Favor(D, seed=1)))


def test_favor_projection_is_orthogonal_blocks_and_seeded():
    D, M = 8, 20
    W = qkv.Favor(D, M, seed=5).projection  # (M, D)
    assert W.shape == (M, D)
    for start in range(0, M, D):  # rows of one block are mutually orthogonal
        blk = W[start : start + D].double()
        gram = blk @ blk.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-4 * gram.diagonal().max()
    norms = W.norm(dim=1)
    assert norms.std() > 0.1  # chi(D) lengths, not unit rows
    assert torch.equal(W, qkv.Favor(D, M, seed=5).projection)
    assert not torch.equal(W, qkv.Favor(D, M, seed=6).projection)
    assert round(D * math.log(D)) == qkv.Favor(D).M


def _run_favor(f, x):
    qkv.linear_attention(x, x, x, feature_map=f)
    return f.projection.clone()


def test_favor_redraw_schedule():
    """redraw=2 in training mode: the projection changes every 2 calls (draw i from seed + i),
    the same sequence for two modules with one seed; both q and k see the new one; never
    in eval mode; a state_dict round trip resumes the schedule."""
    D, M = 8, 16
    x = torch.randn(1, 1, 10, D)
    a, b = qkv.Favor(D, M, seed=3, redraw=2), qkv.Favor(D, M, seed=3, redraw=2)
    p0 = a.projection.clone()
    seq_a = [_run_favor(a, x) for _ in range(6)]
    seq_b = [_run_favor(b, x) for _ in range(6)]
    for pa, pb in zip(seq_a, seq_b):
        assert torch.equal(pa, pb)
    expected = [qkv.Favor(D, M, seed=3 + i).projection for i in (0, 0, 1, 1, 2, 2)]
    for i, (got, want) in enumerate(zip(seq_a, expected)):
        assert torch.equal(got, want), f"call {i + 1}"
    assert torch.equal(seq_a[0], p0) and not torch.equal(seq_a[2], p0)
    assert int(a.calls) == 6 and int(a.draws) == 2
    # call 7 redraws (seed 6) before computing: it equals a fixed Favor with that seed
    out = qkv.linear_attention(x, x, x, feature_map=a)
    ref = qkv.linear_attention(x, x, x, feature_map=qkv.Favor(D, M, seed=6))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # resume: a fresh module loading the state_dict continues the same sequence
    c = qkv.Favor(D, M, seed=3, redraw=2)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c.projection, a.projection)
    for _ in range(3):
        assert torch.equal(_run_favor(c, x), _run_favor(a, x))
    # eval mode: never redrawn, calls not counted
    a.eval()
    p, calls = a.projection.clone(), int(a.calls)
    for _ in range(5):
        assert torch.equal(_run_favor(a, x), p)
    assert int(a.calls) == calls
    # redraw=True: every call after the first
    e = qkv.Favor(D, M, seed=0, redraw=True)
    seq = [_run_favor(e, x) for _ in range(3)]
    assert all(not torch.equal(s, t) for s, t in itertools.pairwise(seq))
    assert torch.equal(seq[2], orthogonal_gaussian(M, D, 2))
    # no redraw (the default): training mode keeps the projection
    f = qkv.Favor(D, M, seed=0)
    assert torch.equal(_run_favor(f, x), _run_favor(f, x))


def test_favor_state_dict_round_trip():
    a = qkv.Favor(16, 32, seed=11)
    b = qkv.Favor(16, 32, seed=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.projection, b.projection)
    x = torch.randn(2, 40, 16)
    torch.testing.assert_close(
        qkv.linear_attention(x, x, x, feature_map=a),
        qkv.linear_attention(x, x, x, feature_map=b),
        rtol=0,
        atol=0,
    )
    assert set(a.state_dict()) == {"projection", "draws", "calls"}


@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_favor_large_norms_stay_finite(causal):
    """B2-T97-H2-D16 with |q|, |k| ~ 120 (randn * 30): the features written out underflow
    (log-scales ~ -3000), the kernels keep them in units of a running maximum, so outputs and
    gradients are finite and match the quadratic twin in float64 (tolerance policy, float32)."""
    B, H, T, D = 2, 2, 97, 16
    f = qkv.Favor(D, 64, seed=2)
    q64, k64 = (torch.randn(B, H, T, D, dtype=torch.float64) * 30 for _ in range(2))
    v64 = torch.randn(B, H, T, D, dtype=torch.float64)
    key_mask = _key_mask(B, T)
    kw = dict(feature_map=f, is_causal=causal, key_mask=key_mask)
    assert (f(q64.float()).dense() == 0).any()  # written out, these would be 0
    golden = _quadratic(q64, k64, v64, **kw)
    q, k, v = (t.float().requires_grad_() for t in (q64, k64, v64))
    out = qkv.linear_attention(q, k, v, **kw)
    out.backward(torch.randn_like(out))
    for t in (out, q.grad, k.grad, v.grad):
        assert t.isfinite().all()
    assert_tolerance(out, golden, _quadratic(q, k, v, **kw), factor=OUTPUT_FACTOR)
    torch.testing.assert_close(qkv.linear_attention(q64, k64, v64, **kw), golden)
    q, k, v = (t.float().requires_grad_() for t in (q64, k64, v64))
    out = qkv.linear_attention(q, k, v, feature_map=f, is_causal=causal)  # no padding
    out.backward(torch.randn_like(out))
    for t in (out, q.grad, k.grad, v.grad):
        assert t.isfinite().all()


@pytest.mark.parametrize("form", ["global", "causal", "step"])
def test_favor_padded_key_gradient_is_zero_with_large_norms(form):
    torch.manual_seed(0)
    q = (torch.randn(1, 1, 4, 8) * 30).requires_grad_()
    k = q.detach().clone()
    k[..., 3, :] = 0  # the padding key: log-scale ~ -2, the real keys' ~ -1000
    k.requires_grad_()
    v = torch.randn(1, 1, 4, 8, requires_grad=True)
    key_mask = torch.tensor([[True, True, True, False]])
    f = qkv.Favor(8, seed=0)
    if form == "step":
        state = LinearAttentionState(f)
        out = torch.stack(
            [state.step(q[:, :, t], k[:, :, t], v[:, :, t], key_mask[:, t]) for t in range(4)], -2
        )
    else:
        out = qkv.linear_attention(
            q, k, v, feature_map=f, key_mask=key_mask, is_causal=form == "causal"
        )
    out.sum().backward()
    assert (k.grad[..., 3, :] == 0).all(), k.grad  # got NaN


def test_favor_rows_straddling_eps_match_twin():
    """Per-row norms from 0.1 to 10 put phi(q) . sum phi(k) on both sides of eps (in units of
    exp(-log_scale), which the kernels convert eps into): fast equals twin by the policy."""
    B, H, T, D = 1, 2, 97, 16
    f = qkv.Favor(D, 64, seed=4)
    norms = torch.logspace(-1, 1, T, dtype=torch.float64).view(1, 1, T, 1)
    golden_in = [torch.randn(B, H, T, D, dtype=torch.float64) * norms for _ in range(2)]
    golden_in.append(torch.randn(B, H, T, D, dtype=torch.float64))
    for causal in (False, True):
        golden = _quadratic(*golden_in, f, is_causal=causal)
        ins = [t.float().requires_grad_() for t in golden_in]
        out = qkv.linear_attention(*ins, feature_map=f, is_causal=causal)
        base = _quadratic(*ins, f, is_causal=causal)
        assert_tolerance(out, golden, base, factor=OUTPUT_FACTOR, name=f"causal={causal}")
        assert out[..., -10:, :].abs().max() < out[..., :10, :].abs().max()  # damped by eps
        assert _rel_err(out, base) < TWIN_RTOL


def test_favor_large_norms_eps_zero_matches_twin():
    """eps = 0 means out = num / den, which stays well defined in units of the running max."""
    D = 4
    f = qkv.Favor(D, 8, seed=0)
    q = torch.full((1, 1, D), 30.0, dtype=torch.float64)
    v = torch.ones(1, 1, D, dtype=torch.float64)
    golden = _quadratic(q, q, v, f, eps=0.0)  # one key, weight 1: out = v
    torch.testing.assert_close(golden, v)
    torch.testing.assert_close(qkv.linear_attention(q, q, v, feature_map=f, eps=0), golden)


# --- layouts, dtypes, trace -----------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
def test_layouts(causal):
    """(B, X, H, T, D), (B, H, T, D), (H, T, D) and (T, D) inputs give the same rows."""
    B, X, H, T, D = 2, 3, 2, 21, 8
    q, k, v = (torch.randn(B, X, H, T, D, dtype=torch.float64) for _ in range(3))
    km = torch.rand(B, X, T) < 0.8
    kw = dict(is_causal=causal)
    out5 = qkv.linear_attention(q, k, v, key_mask=km, **kw)
    assert out5.shape == (B, X, H, T, D)
    flat = [t.reshape(B * X, H, T, D) for t in (q, k, v)]
    out4 = qkv.linear_attention(*flat, key_mask=km.reshape(B * X, T), **kw)
    torch.testing.assert_close(out5.reshape(B * X, H, T, D), out4, rtol=0, atol=0)
    out3 = qkv.linear_attention(q[1, 2], k[1, 2], v[1, 2], key_mask=km[1, 2], **kw)
    torch.testing.assert_close(out3, out5[1, 2], rtol=0, atol=0)
    out2 = qkv.linear_attention(q[1, 2, 0], k[1, 2, 0], v[1, 2, 0], key_mask=km[1, 2], **kw)
    assert out2.shape == (T, D)
    torch.testing.assert_close(out2, out5[1, 2, 0])


@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_gqa_equals_repeated_heads_and_value_dim(fm):
    """G = 2 key/value heads for H = 6 query heads (each serves 3); Dv != D; T != S."""
    B, H, G, T, S, D, Dv = 2, 6, 2, 19, 31, 8, 5
    q = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, G, S, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, G, S, Dv, dtype=torch.float64, requires_grad=True)
    km = _key_mask(B, S)
    phi = qkv.Favor(D, seed=1, dtype=torch.float64) if fm == "favor" else fm
    out = qkv.linear_attention(q, k, v, feature_map=phi, key_mask=km)
    assert out.shape == (B, H, T, Dv)
    ref = qkv.linear_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), feature_map=phi, key_mask=km
    )
    torch.testing.assert_close(out, ref)
    cot = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_half_inputs(fm, causal, dtype):
    """B2-T97-H2-D16: half inputs are computed in float32 and returned in their dtype; outputs
    and gradients within the tolerance policy (golden: quadratic twin in float64; baseline:
    the twin on the half inputs)."""
    B, H, T, D = 2, 2, 97, 16
    golden_in = [torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    phi = _feature_map(fm, D)
    kw = dict(feature_map=phi, is_causal=causal, key_mask=_key_mask(B, T))
    outs, grads = {}, {}
    for which, dt in (("golden", torch.float64), ("baseline", dtype), ("fast", dtype)):
        ins = (
            golden_in
            if dt == torch.float64
            else [t.detach().to(dt).requires_grad_() for t in golden_in]
        )
        out = (qkv.linear_attention if which == "fast" else _quadratic)(*ins, **kw)
        assert out.dtype == dt
        grads[which] = torch.autograd.grad(out, ins, torch.ones_like(out) / T)
        outs[which] = out.detach()
    assert_tolerance(outs["fast"], outs["golden"], outs["baseline"], factor=OUTPUT_FACTOR)
    for i, g in enumerate("qkv"):
        assert grads["fast"][i].dtype == dtype
        assert_tolerance(
            grads["fast"][i],
            grads["golden"][i],
            grads["baseline"][i],
            factor=GRAD_FACTOR,
            name=f"d{g}",
        )
    # computed in float32: exactly the float32 result on the rounded inputs, rounded
    rounded = [t.detach().to(dtype).float() for t in golden_in]
    assert torch.equal(outs["fast"], qkv.linear_attention(*rounded, **kw).to(dtype))


@pytest.mark.parametrize("causal", [False, True], ids=["global", "causal"])
@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_trace(fm, causal):
    """probs @ v is the output; rows sum to 1 - eps / exp(lse) <= 1; masked entries are 0."""
    B, H, G, T, D = 2, 4, 2, 23, 8
    S = T if causal else 30
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k, v = (torch.randn(B, G, S, D, dtype=torch.float64) for _ in range(2))
    km = _key_mask(B, S)
    phi = qkv.Favor(D, seed=1, dtype=torch.float64) if fm == "favor" else fm
    eps = 1e-3
    out, trace = qkv.linear_attention(
        q, k, v, feature_map=phi, is_causal=causal, key_mask=km, eps=eps, return_trace=True
    )
    assert torch.equal(
        out, qkv.linear_attention(q, k, v, feature_map=phi, is_causal=causal, key_mask=km, eps=eps)
    )
    assert trace.backend == "linear"
    assert trace.scores.shape == trace.probs.shape == (B, H, T, S)
    assert trace.lse.shape == (B, H, T)
    probs = trace.probs
    torch.testing.assert_close(probs @ v.repeat_interleave(2, 1), out)
    sums = probs.sum(-1)
    assert (sums <= 1 + 1e-12).all()
    seen = torch.isfinite(trace.lse)
    torch.testing.assert_close(sums[seen], (1 - eps * torch.exp(-trace.lse))[seen])
    hidden = ~km[:, None, None, :].expand(B, H, T, S)
    if causal:
        hidden = hidden | ~torch.ones(T, S, dtype=torch.bool).tril()
    assert (probs[hidden] == 0).all() and torch.isneginf(trace.scores[hidden]).all()
    assert not probs.requires_grad


# --- errors ---------------------------------------------------------------------------------


def _la(q=None, k=None, v=None, **kw):
    q = torch.randn(2, 4, 5, 8) if q is None else q
    k = torch.randn(2, 4, 6, 8) if k is None else k
    v = torch.randn(2, 4, 6, 8) if v is None else v
    return qkv.linear_attention(q, k, v, **kw)


BAD = {
    "unknown-name": (
        ValueError,
        (
            r"unknown feature_map 'softmax'; choose one of \['elu', "
            r"'favor', 'performer', 'relu'\].*qkv\.Favor"
        ),
        dict(feature_map="softmax"),
    ),
    "not-callable": (
        TypeError,
        r"feature_map must be a name, a FeatureMap or a function, got int",
        dict(feature_map=3),
    ),
    "favor-head-dim": (
        ValueError,
        r"built for head_dim=16, got inputs with D=8; build Favor\(8",
        dict(feature_map=qkv.Favor(16)),
    ),
    "feature-fn-shape": (
        ValueError,
        r"feature_map function must map \(\.\.\., L, D\)",
        dict(feature_map=lambda x: x.sum(-2)),
    ),
    "head-dim": (
        ValueError,
        r"same head dim D.*query \(2, 4, 5, 8\), key \(2, 4, 6, 7\)",
        dict(k=torch.randn(2, 4, 6, 7)),
    ),
    "key-value-length": (
        ValueError,
        r"key and value need the same length S",
        dict(v=torch.randn(2, 4, 7, 8)),
    ),
    "dims-count": (
        ValueError,
        r"same number of dims",
        dict(k=torch.randn(4, 6, 8), v=torch.randn(4, 6, 8)),
    ),
    "one-dim": (
        ValueError,
        r"same number of dims \(2 or more",
        dict(q=torch.randn(8), k=torch.randn(8), v=torch.randn(8)),
    ),
    "batch-dims": (
        ValueError,
        r"same batch dims",
        dict(k=torch.randn(3, 4, 6, 8), v=torch.randn(3, 4, 6, 8)),
    ),
    "gqa-not-multiple": (
        ValueError,
        (
            r"got H=4 query heads and G=3 key/value heads; H must be a "
            r"multiple of G"
        ),
        dict(k=torch.randn(2, 3, 6, 8), v=torch.randn(2, 3, 6, 8)),
    ),
    "causal-T-ne-S": (
        ValueError,
        r"is_causal needs T == S.*got T=5, S=6.*LinearAttentionState",
        dict(is_causal=True),
    ),
    "key-mask-shape": (
        ValueError,
        (
            r"key_mask must have shape \(\*batch, S\) = \(2, 6\).*got "
            r"\(2, 4, 6\)"
        ),
        dict(key_mask=torch.ones(2, 4, 6, dtype=torch.bool)),
    ),
    "key-mask-dtype": (
        TypeError,
        r"key_mask must be a bool tensor.*got torch.float32",
        dict(key_mask=torch.ones(2, 6)),
    ),
    "key-mask-list": (
        TypeError,
        r"key_mask must be a bool tensor.*got list",
        dict(key_mask=[True] * 6),
    ),
    "int-inputs": (
        TypeError,
        r"query must be a floating tensor",
        dict(q=torch.ones(2, 4, 5, 8, dtype=torch.long)),
    ),
    "dtype-mix": (
        TypeError,
        r"share a dtype",
        dict(v=torch.randn(2, 4, 6, 8, dtype=torch.float64)),
    ),
    "negative-eps": (ValueError, r"eps must be a finite number >= 0, got -1e-06", dict(eps=-1e-6)),
    "nan-eps": (ValueError, r"eps must be a finite number >= 0, got nan", dict(eps=math.nan)),
    "str-eps": (ValueError, r"eps must be a finite number", dict(eps="1e-6")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_error(case):
    exc, pattern, kw = BAD[case]
    with pytest.raises(exc, match=pattern):
        _la(**kw)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(head_dim=0), r"head_dim must be a positive int, got 0"),
        (dict(head_dim=8, num_features=0), r"num_features must be a positive int, got 0"),
        (dict(head_dim=8, redraw=-1), r"redraw must be True, False or a positive int.*got -1"),
        (dict(head_dim=8, scale=0.0), r"scale must be a positive finite number or None, got 0.0"),
        (dict(head_dim=8, scale=math.inf), r"scale must be a positive finite number"),
    ],
    ids=["head_dim", "num_features", "redraw", "scale-zero", "scale-inf"],
)
def test_bad_favor_settings(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        qkv.Favor(**kwargs)


def test_state_errors():
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0"):
        LinearAttentionState(eps=-1)
    with pytest.raises(ValueError, match=r"unknown feature_map 'softmax'"):
        LinearAttentionState("softmax").step(*(torch.randn(1, 2, 8) for _ in range(3)))
    state = LinearAttentionState()
    state.step(*(torch.randn(2, 4, 8) for _ in range(3)))
    with pytest.raises(
        ValueError,
        match=r"holds \(\*batch, H\) = \(2, 4\), got inputs with "
        r"\(3, 4\).*reset\(\)",
    ):
        state.step(*(torch.randn(3, 4, 8) for _ in range(3)))
    with pytest.raises(ValueError, match=r"holds \(\*batch, H\) = \(2, 4\), got .*\(2, 2\)"):
        state.extend(*(torch.randn(2, 2, 5, 8) for _ in range(3)))
    assert state.position == 1  # the refused calls changed nothing
    with pytest.raises(
        ValueError,
        match=r"step takes one token, \(\*batch, H, D\); query is "
        r"\(8,\)",
    ):
        state.step(torch.randn(8), torch.randn(8), torch.randn(8))
    with pytest.raises(ValueError, match=r"extend takes \(\*batch, H, T, D\) inputs"):
        state.extend(*(torch.randn(5, 8) for _ in range(3)))
    with pytest.raises(ValueError, match=r"key_mask must have shape"):
        state.step(
            *(torch.randn(2, 4, 8) for _ in range(3)), key_mask=torch.ones(3, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match=r"built for head_dim=16, got inputs with D=8"):
        LinearAttentionState(qkv.Favor(16)).step(*(torch.randn(1, 2, 8) for _ in range(3)))


# --- empty inputs ---------------------------------------------------------------------------


@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_empty_inputs(fm):
    """S = 0: every query attends to nothing, output 0. T = 0 or B = 0: empty output."""
    D = 8
    phi = _feature_map(fm, D)
    q = torch.randn(2, 3, 5, D, requires_grad=True)
    k = torch.randn(2, 3, 0, D, requires_grad=True)
    v = torch.randn(2, 3, 0, 4, requires_grad=True)
    out = qkv.linear_attention(
        q, k, v, feature_map=phi, key_mask=torch.ones(2, 0, dtype=torch.bool)
    )
    assert out.shape == (2, 3, 5, 4) and (out == 0).all()
    out.sum().backward()
    assert (q.grad == 0).all()
    out, trace = qkv.linear_attention(q, k, v, feature_map=phi, return_trace=True)
    assert (out == 0).all() and trace.probs.shape == (2, 3, 5, 0)
    torch.testing.assert_close(trace.lse, torch.full((2, 3, 5), math.log(1e-6)))  # log(0 + eps)
    for causal in (False, True):
        e = torch.randn(2, 3, 0, D)
        out = qkv.linear_attention(e, e, e[..., :4], feature_map=phi, is_causal=causal)
        assert out.shape == (2, 3, 0, 4)
        out = qkv.linear_attention(e, k, v, feature_map=phi, is_causal=causal)
        assert out.shape == (2, 3, 0, 4)
        b0 = torch.randn(0, 3, 5, D)
        out = qkv.linear_attention(b0, b0, b0, feature_map=phi, is_causal=causal)
        assert out.shape == (0, 3, 5, D)
    state = LinearAttentionState(_state_map(fm, D))
    out = state.extend(*(torch.randn(1, 2, 0, D) for _ in range(3)))
    assert out.shape == (1, 2, 0, D) and state.position == 0
    y = state.step(*(torch.randn(1, 2, D) for _ in range(3)))
    assert y.isfinite().all() and state.position == 1
