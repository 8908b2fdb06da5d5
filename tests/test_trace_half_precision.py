"""Traces of float16/bfloat16 calls recompute their scores in float32 (issue 12, item 10).

A fast backend's lse comes from float32 scores; half scores minus it scaled whole rows (rows
summed to 1 +- 0.13 in bfloat16 at scale=3). The weights are now formed in float32 and
returned in the inputs' dtype, for the full trace and for select().
"""

import pytest
import torch

import qkv
from qkv import lazy_trace
from qkv.ops import AttentionCall
from qkv.testing import assert_tolerance

HALF = [torch.bfloat16, torch.float16]


def _inputs(dtype, T=64, S=64, D=32):
    q, k, v = (torch.randn(2, 3, n, D, dtype=torch.float64) for n in (T, S, S))
    return [t.to(dtype) for t in (q, k, v)]


def _row_sum_error(probs):
    return (probs.double().sum(-1) - 1).abs().max().item()


def _traces(low, **kw):
    """(golden float64 trace, baseline trace in the low dtype) of the reference backend."""
    _, golden = qkv.scaled_dot_product_attention(
        *(t.double() for t in low), backend="reference", return_trace=True, **kw
    )
    _, baseline = qkv.scaled_dot_product_attention(
        *low, backend="reference", return_trace=True, **kw
    )
    return golden, baseline


@pytest.mark.parametrize("backend", ["torch", "tiled"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_trace_rows_sum_to_one_at_large_scale(dtype, backend):
    low = _inputs(dtype)
    golden, baseline = _traces(low, scale=3.0)
    _, trace = qkv.scaled_dot_product_attention(*low, scale=3.0, backend=backend, return_trace=True)
    assert trace.probs.dtype == dtype and trace.scores.dtype == dtype
    assert _row_sum_error(trace.probs) <= _row_sum_error(baseline.probs)
    assert_tolerance(trace.probs, golden.probs, baseline.probs, name="probs")
    assert_tolerance(trace.scores, golden.scores, baseline.scores, name="scores")


@pytest.mark.parametrize("backend", ["torch", "tiled"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_select_is_formed_in_float32_too(dtype, backend):
    low = _inputs(dtype)
    golden, baseline = _traces(low, scale=3.0, is_causal=True)
    _, trace = qkv.scaled_dot_product_attention(
        *low, scale=3.0, is_causal=True, backend=backend, return_trace=True
    )
    rows, heads = [63, 0, 40], [2, 0]
    part = trace.select(heads=heads, rows=rows)
    assert part.probs.dtype == dtype

    def pick(t):
        return t[:, heads][:, :, rows]

    assert _row_sum_error(part.probs) <= _row_sum_error(baseline.probs)
    assert_tolerance(part.probs, pick(golden.probs), pick(baseline.probs), name="select probs")
    torch.testing.assert_close(part.probs, trace.probs[:, heads][:, :, rows], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_trace_without_backend_lse(dtype):
    """A backend that keeps no lse: the trace computes it from float32 scores."""
    low = _inputs(dtype)
    keep = torch.rand(64, 64) < 0.7
    keep[5] = False  # a row with no key: weights 0
    golden, baseline = _traces(low, scale=3.0, attn_mask=keep)
    call = AttentionCall.build(*low, attn_mask=keep, scale=3.0, return_trace=True)
    trace = lazy_trace.trace_from_lse(call, None, "no-lse")
    assert trace.lse.dtype == torch.float32
    assert torch.all(trace.probs[..., 5, :] == 0) and torch.isneginf(trace.lse[..., 5]).all()
    assert_tolerance(trace.probs, golden.probs, baseline.probs, name="probs")
    assert_tolerance(trace.lse, golden.lse, baseline.lse, name="lse")


BLOCK_CASES = {
    "4D-causal-bool": (
        (2, 3, 37, 8),
        (2, 3, 29, 8),
        {"is_causal": True, "attn_mask": torch.rand(37, 29) < 0.7},
    ),
    "3D-float-mask": (
        (3, 37, 8),
        (3, 29, 8),
        {"attn_mask": torch.randn(3, 37, 29, dtype=torch.float64)},
    ),
    "5D": ((2, 2, 3, 37, 8), (2, 2, 3, 29, 8), {}),
    "2D": ((37, 8), (29, 8), {"is_causal": True}),
    "gqa": ((2, 4, 37, 8), (2, 2, 29, 8), {"enable_gqa": True}),
    "window-alibi": (
        (2, 2, 37, 8),
        (2, 2, 29, 8),
        {
            "mask_mod": qkv.masks.sliding_window(5),
            "score_mod": qkv.masks.alibi(torch.tensor([-0.5, -1.0])),
        },
    ),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_trace_computed_in_row_blocks_equals_reference(case, monkeypatch):
    """Blocks of 16 rows (the smallest) give exactly the reference's trace, lse included."""
    monkeypatch.setattr(lazy_trace, "_BLOCK_ELEMENTS", 1)
    qs, ks, kw = BLOCK_CASES[case]
    q, k, v = (torch.randn(*s, dtype=torch.float64) for s in (qs, ks, ks))
    _, ref = qkv.scaled_dot_product_attention(q, k, v, backend="reference", return_trace=True, **kw)
    call = AttentionCall.build(q, k, v, return_trace=True, **kw)
    for lse in (ref.lse, None):
        trace = lazy_trace.trace_from_lse(call, lse, "blocks")
        for name in ("scores", "probs", "lse"):
            torch.testing.assert_close(getattr(trace, name), getattr(ref, name), rtol=0, atol=1e-12)
