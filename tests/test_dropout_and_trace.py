"""Dropout reproducible under a seed (and equal to torch's), and traces from every backend."""

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKENDS, DROPOUT_BACKENDS

import qkv
from qkv.testing import assert_tolerance


def _seeded(fn, seed=7):
    torch.manual_seed(seed)
    return fn()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("backend", DROPOUT_BACKENDS)
def test_dropout_same_as_torch_under_seed(backend, dtype):
    q, k, v = (torch.randn(2, 3, n, 16, dtype=dtype) for n in (17, 13, 13))
    keep = torch.rand(17, 13) < 0.8
    ours = _seeded(
        lambda: qkv.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=0.4, backend=backend
        )
    )
    again = _seeded(
        lambda: qkv.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=0.4, backend=backend
        )
    )
    torch_out = _seeded(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=0.4)
    )
    assert torch.equal(ours, again)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(ours, torch_out, rtol=0, atol=tol)
    plain = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, backend=backend)
    assert (ours - plain).abs().max() > 0.1  # dropout did something


def test_dropout_weights_are_scaled_dropped_probs():
    """v = I makes the output the dropped weights: each is 0 or prob / (1 - p)."""
    q, k = torch.randn(64, 8, dtype=torch.float64), torch.randn(32, 8, dtype=torch.float64)
    v = torch.eye(32, dtype=torch.float64)
    out, trace = _seeded(
        lambda: qkv.scaled_dot_product_attention(
            q, k, v, dropout_p=0.25, backend="reference", return_trace=True
        )
    )
    kept = out != 0
    torch.testing.assert_close(out[kept], trace.probs[kept] / 0.75)
    assert 0.70 < kept.double().mean() < 0.80


def _reference_trace(q, k, v, **kw):
    return qkv.scaled_dot_product_attention(q, k, v, backend="reference", return_trace=True, **kw)


TRACE_CASES = {
    "4D-flash-lse": ((2, 4, 17, 16), (2, 4, 13, 16), (2, 4, 13, 16), {}),
    "4D-causal-mask": (
        (2, 4, 17, 16),
        (2, 4, 13, 16),
        (2, 4, 13, 16),
        {"is_causal": True, "attn_mask": torch.rand(17, 13) < 0.8},
    ),
    "gqa-lse-from-scores": ((2, 4, 17, 16), (2, 2, 13, 16), (2, 2, 13, 16), {"enable_gqa": True}),
    "Dv-differs": ((2, 4, 17, 16), (2, 4, 13, 16), (2, 4, 13, 5), {}),
    "3D-float-mask": ((4, 17, 16), (4, 13, 16), (4, 13, 16), {"attn_mask": torch.randn(17, 13)}),
}


@pytest.mark.parametrize("case", list(TRACE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_trace_matches_reference_float64(backend, case):
    qs, ks, vs, kw = TRACE_CASES[case]
    q, k, v = (torch.randn(*s, dtype=torch.float64) for s in (qs, ks, vs))
    kw = {
        n: (m.double() if torch.is_tensor(m) and m.is_floating_point() else m)
        for n, m in kw.items()
    }
    out, trace = qkv.scaled_dot_product_attention(q, k, v, backend=backend, return_trace=True, **kw)
    ref_out, ref = _reference_trace(q, k, v, **kw)
    # auto, with no gradient wanted, forms output and weights in one pass of plain math
    expected_backend = "reference" if backend == "auto" else backend
    assert trace.backend == expected_backend
    for name in ("scores", "probs", "lse"):
        torch.testing.assert_close(getattr(trace, name), getattr(ref, name), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    # the trace explains the output: probs @ v == out
    kv = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3) if kw.get("enable_gqa") else v
    torch.testing.assert_close(trace.probs @ kv, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(trace.lse, torch.logsumexp(trace.scores, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_auto_trace_low_precision_within_policy(dtype):
    q, k, v = (torch.randn(2, 4, n, 64, dtype=torch.float64) for n in (97, 113, 113))
    keep = torch.rand(97, 113) < 0.8
    _, golden = _reference_trace(q, k, v, attn_mask=keep, is_causal=True)
    low = [t.to(dtype) for t in (q, k, v)]
    _, baseline = _reference_trace(*low, attn_mask=keep, is_causal=True)
    _, trace = qkv.scaled_dot_product_attention(
        *low, attn_mask=keep, is_causal=True, return_trace=True
    )
    for name in ("probs", "lse"):
        assert_tolerance(
            getattr(trace, name), getattr(golden, name), getattr(baseline, name), name=name
        )


def test_trace_probs_are_pre_dropout():
    q, k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    _, trace = qkv.scaled_dot_product_attention(q, k, v, dropout_p=0.5, return_trace=True)
    _, plain = _reference_trace(q, k, v)
    torch.testing.assert_close(trace.probs, plain.probs, rtol=0, atol=1e-12)
