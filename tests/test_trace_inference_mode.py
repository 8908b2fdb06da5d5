"""Traces of calls made under torch.inference_mode() (issue 12, item 8).

Inference tensors have no version counter, so the stale-input check must skip them; the
trace is read inside inference mode and after leaving it.
"""

import pytest
import torch

import qkv


def _expected_probs(q, k, scale):
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)


@pytest.mark.parametrize("read_inside", [True, False], ids=["read-inside", "read-after"])
def test_functional_trace_under_inference_mode(read_inside):
    with torch.inference_mode():
        q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (11, 13, 13))
        out, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
        if read_inside:
            probs, part = trace.probs, trace.select(heads=[2], rows=[10, 0])
    if not read_inside:
        probs, part = trace.probs, trace.select(heads=[2], rows=[10, 0])
    expected = _expected_probs(q, k, 8**-0.5)  # (2, 3, 11, 13)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(part.probs, expected[:, [2]][:, :, [10, 0]], rtol=0, atol=1e-12)
    torch.testing.assert_close(probs @ v, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("read_inside", [True, False], ids=["read-inside", "read-after"])
def test_module_trace_under_inference_mode(read_inside):
    mha = qkv.MultiHeadAttention(16, 2, dtype=torch.float64)
    with torch.inference_mode():
        x = torch.randn(3, 7, 16, dtype=torch.float64)
        _out, trace = mha(x, return_trace=True)
        if read_inside:
            probs, part = trace.probs, trace.select(batch=[1], rows=range(6, 3, -1))
    if not read_inside:
        probs, part = trace.probs, trace.select(batch=[1], rows=range(6, 3, -1))
    expected = _expected_probs(trace.q, trace.k, 8**-0.5)  # (3, 2, 7, 7)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(part.probs, expected[[1]][:, :, [6, 5, 4]], rtol=0, atol=1e-12)
    torch.testing.assert_close(probs @ trace.v, trace.heads, rtol=0, atol=1e-12)
