"""Traces survive torch.save / torch.load and copy.deepcopy (issue 12, item 16b).

A lazy trace holds functions that recompute its weights; pickling them failed with
AttributeError. Pickling now computes scores and weights and keeps them as tensors.
"""

import copy
import io

import pytest
import torch

import qkv


def _round_trip(trace):
    buf = io.BytesIO()
    torch.save(trace, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _assert_same(loaded, trace, names=("scores", "probs", "lse")):
    assert type(loaded) is type(trace) and loaded.backend == trace.backend
    for name in names:
        torch.testing.assert_close(getattr(loaded, name), getattr(trace, name), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "tiled", "reference"])
def test_functional_trace_round_trip(backend):
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (7, 5, 5))
    _, trace = qkv.scaled_dot_product_attention(
        q, k, v, is_causal=True, backend=backend, return_trace=True
    )
    _, expected = qkv.scaled_dot_product_attention(
        q, k, v, is_causal=True, backend="reference", return_trace=True
    )
    loaded = _round_trip(trace)
    q.add_(1)  # the loaded trace keeps its numbers: nothing is recomputed from the inputs
    for name in ("scores", "probs", "lse"):
        torch.testing.assert_close(
            getattr(loaded, name), getattr(expected, name), rtol=0, atol=1e-12
        )
    torch.testing.assert_close(
        loaded.select(heads=[2], rows=[6, 0]).probs,
        expected.probs[:, [2]][:, :, [6, 0]],
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_module_trace_round_trip(batched):
    mha = qkv.MultiHeadAttention(16, 2, dtype=torch.float64)
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    x = x if batched else x[0]
    _, trace = mha(x, return_trace=True)
    loaded = _round_trip(trace)
    _assert_same(loaded, trace, ("scores", "probs", "lse", "q", "k", "v", "heads"))
    torch.testing.assert_close(loaded.probs @ loaded.v, loaded.heads, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        loaded.select(heads=[1], rows=[5]).probs,
        trace.select(heads=[1], rows=[5]).probs,
        rtol=0,
        atol=1e-12,
    )


def test_trace_loads_with_weights_only_when_allowed():
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
    buf = io.BytesIO()
    torch.save(trace, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([qkv.AttentionTrace]):
        loaded = torch.load(buf, weights_only=True)
    _assert_same(loaded, trace)


def test_deepcopy_of_a_lazy_trace():
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
    _assert_same(copy.deepcopy(trace), trace)
