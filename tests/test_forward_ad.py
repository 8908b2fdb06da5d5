"""Forward-mode AD (dual tensors of ``torch.autograd.forward_ad``) through every backend that
can take it, against plain math's tangents by ``torch.func.jvp``.

A call with a trace once gave NaN tangents on every row, clean inputs included: the NaN/inf
contract's fused C++ pass wrote the output in place, with no forward-mode rule. The tiled
backend's autograd Function and torch's fused kernels have none either (they raised). A call
with a tangent now takes the ways of tensor ops, as one with a gradient does, and ``auto``
runs it by the reference's plain math.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import qkv
from qkv import masks

B, H, T, D = 2, 2, 11, 4


def _plain(q, k, v, *, allowed=None, bias=None, sinks=None, softcap=None, slopes=None):
    """softmax(q k^T / sqrt(D) + bias) v written out, rows with no key 0: the math the
    tangents are checked against (nothing of qkv's)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        i = torch.arange(s.shape[-2]).view(-1, 1)
        j = torch.arange(s.shape[-1]).view(1, -1)
        s = s + slopes.view(-1, 1, 1) * (j - i)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(-1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    finite = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(finite, s, 0.0), -1) * finite
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


_I, _J = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
_LENGTHS = torch.tensor([0, 7])  # batch 0 has no key: its rows are 0
_IDS = (torch.arange(T) // 4).expand(B, T)

CASES = {
    # name: (qkv keyword arguments, the plain math's, which extra tensors carry tangents)
    "plain": (dict(), dict(), ()),
    "causal": (dict(is_causal=True), dict(allowed=_J <= _I), ()),
    "window": (
        dict(mask_mod=masks.sliding_window(3, 2)),
        dict(allowed=(_I - _J <= 3) & (_J - _I <= 2)),
        (),
    ),
    "key-lengths-with-empty-rows": (
        dict(mask_mod=masks.key_lengths(_LENGTHS)),
        dict(allowed=(_LENGTHS.view(B, 1, 1, 1) > _J)),
        (),
    ),
    "documents": (
        dict(mask_mod=masks.document(_IDS)),
        dict(allowed=(_IDS[:, None, :, None] == _IDS[:, None, None, :])),
        (),
    ),
    "softcap": (dict(score_mod=masks.softcap(2.0)), dict(softcap=2.0), ()),
    "float-bias": (dict(), dict(), ("bias",)),
    "sinks": (dict(), dict(), ("sinks",)),
    "learned-alibi": (dict(), dict(), ("slopes",)),
}


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    primal = dict(q=r(B, H, T, D), k=r(B, H, T, D), v=r(B, H, T, D), bias=r(T, T), sinks=r(H))
    primal["slopes"] = r(H).abs() * 0.3
    tangent = {n: r(*t.shape) for n, t in primal.items()}
    return primal, tangent


def _qkv_kwargs(kw, extra, t):
    kw = dict(kw)
    if "bias" in extra:
        kw["attn_mask"] = t["bias"]
    if "sinks" in extra:
        kw["sinks"] = t["sinks"]
    if "slopes" in extra:
        kw["score_mod"] = masks.alibi(t["slopes"])
        kw["mask_mod"] = masks.causal()  # (ALiBi's bias is -slope * distance to the past)
    return kw


def _plain_kwargs(kw, extra, t):
    kw = dict(kw)
    for n in extra:
        kw[n] = t[n]
    if "slopes" in extra:
        kw["allowed"] = _J <= _I
    return kw


def _want(name, dtype):
    _, plain_kw, extra = CASES[name]
    primal, tangent = _tensors()
    names = ["q", "k", "v", *extra]

    def f(*ts):
        t = dict(zip(names, ts))
        return _plain(t["q"], t["k"], t["v"], **_plain_kwargs(plain_kw, extra, t))

    return torch.func.jvp(f, tuple(primal[n] for n in names), tuple(tangent[n] for n in names))


def _got(name, backend, dtype, *, trace=False, no_grad=False):
    kw, _, extra = CASES[name]
    primal, tangent = _tensors()
    names = ["q", "k", "v", *extra]
    with fwAD.dual_level(), torch.set_grad_enabled(not no_grad):
        t = {n: fwAD.make_dual(primal[n].to(dtype), tangent[n].to(dtype)) for n in names}
        res = qkv.scaled_dot_product_attention(
            t["q"], t["k"], t["v"], backend=backend, return_trace=trace, **_qkv_kwargs(kw, extra, t)
        )
        out = res[0] if trace else res
        p, tan = fwAD.unpack_dual(out)
    assert tan is not None, "the output lost its tangent"
    return p, tan


@pytest.mark.parametrize("trace", [False, True], ids=["out", "trace"])
@pytest.mark.parametrize("backend", ["auto", "tiled", "reference"])
@pytest.mark.parametrize("name", list(CASES))
def test_tangents_equal_plain_maths_in_float64(name, backend, trace):
    want_out, want_tan = _want(name, torch.float64)
    out, tan = _got(name, backend, torch.float64, trace=trace)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(tan, want_tan)
    assert want_tan.abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["plain", "window", "key-lengths-with-empty-rows", "sinks"])
def test_tangents_in_half_and_float32_are_close_and_finite(name, dtype):
    """Half and float32 calls with tangents compute in float32 (as a gradient's do)."""
    _, want_tan = _want(name, torch.float64)
    _, tan = _got(name, "auto", dtype, no_grad=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(tan.double(), want_tan, rtol=tol, atol=tol * 4)


def test_bad_values_in_hidden_keys_leave_the_tangents_alone():
    """NaN/inf in keys no row may see change nothing, tangents included."""
    kw, plain_kw, _ = CASES["key-lengths-with-empty-rows"]
    primal, tangent = _tensors()
    k, v = primal["k"].clone(), primal["v"].clone()
    k[1, 0, 9], v[1, 1, 8] = float("nan"), float("inf")  # batch 1 sees its first 7 keys
    want = torch.func.jvp(
        lambda q, k, v: _plain(q, k, v, **plain_kw),
        (primal["q"], primal["k"], primal["v"]),
        (tangent["q"], tangent["k"], tangent["v"]),
    )[1]
    for backend in ("auto", "tiled", "reference"):
        with fwAD.dual_level():
            q, kk, vv = (
                fwAD.make_dual(p, tangent[n]) for p, n in ((primal["q"], "q"), (k, "k"), (v, "v"))
            )
            out = qkv.scaled_dot_product_attention(q, kk, vv, backend=backend, **kw)
            tan = fwAD.unpack_dual(out).tangent
        torch.testing.assert_close(tan, want, msg=lambda m, b=backend: f"{b}: {m}")


def test_decoding_steps_keep_their_tangents():
    """Steps at decode sizes, which take a kept lane of C++ passes after the first call of
    their kind: a tangent keeps every step on tensor ops."""
    g = torch.Generator().manual_seed(3)
    q, k, v, tq, tk, tv = (
        torch.randn(1, 4, 1 if i % 3 == 0 else 40, 16, generator=g) for i in range(6)
    )
    want = torch.func.jvp(_plain, (q, k, v), (tq, tk, tv))[1]
    for _ in range(3):  # a plain step first: the lane for this kind is kept
        qkv.scaled_dot_product_attention(q, k, v)
    for _ in range(3):
        with fwAD.dual_level():
            duals = (fwAD.make_dual(a, b) for a, b in ((q, tq), (k, tk), (v, tv)))
            out = qkv.scaled_dot_product_attention(*duals)
            tan = fwAD.unpack_dual(out).tangent
        assert tan is not None
        torch.testing.assert_close(tan, want, rtol=1e-5, atol=1e-5)


def test_named_torch_backend_keeps_torchs_answer():
    """torch's fused kernels have no forward-mode rule (torch raises); its math kernel has."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, want = _want("causal", torch.float64)
    with sdpa_kernel(SDPBackend.MATH):
        _, tan = _got("causal", "torch", torch.float64)
    torch.testing.assert_close(tan, want)
