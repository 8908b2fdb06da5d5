"""The NaN/inf contract of a call wanting a gradient, kept two ways (issue 38): on the CPU by
the fused row passes (``qkv.ops.nonfinite_rows``: the zeroed copies of q, k and v with their
bad rows in one pass per input, the NaN rows set in one pass), elsewhere by tensor ops
(``nan_to_num``, a matrix-vector product per input for its bad rows, a product and a sum for
the NaN rows). The two give the same bits; tests/test_nonfinite_eager.py holds both to
float64 math (its ``no-reads`` and ``no-reads-fused`` ways).

Shape alphabet: B batch, H heads, G key/value heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from routes import force_native_rows

import qkv

B, H, T, S, D = 2, 3, 11, 13, 8


@pytest.mark.parametrize(
    "shape",
    [
        "plain",
        "causal",
        "gqa",
        "expanded-batch",
        "3d",
        "transposed",
        "bfloat16",
        "float64",
        "sum",
    ],
)
def test_a_gradient_call_is_the_same_by_the_fused_passes_and_by_tensor_ops(shape, monkeypatch):
    """A call wanting a gradient keeps the contract by the fused row passes on the CPU (the
    zeroed copies and their bad rows in one pass per input, the NaN rows set in one pass) and
    by tensor ops elsewhere: both give the same output and gradients, on the inputs users
    pass (GQA, a batch expanded with stride 0, 3-D, transposed views, half and double, a
    gradient of stride 0 coming back), with NaN and inf in query, key and value rows."""
    g = torch.Generator().manual_seed(5)
    dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64}.get(shape, torch.float32)
    G = 1 if shape == "gqa" else H
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, G, S, D, generator=g) for _ in "kv")
    q[1, 2, 3, 0] = float("nan")
    k[0, 0, 4, 5] = float("inf")
    v[1, 0, 9, 1] = float("-inf")
    if shape == "expanded-batch":  # one batch element's inputs for both (stride 0)
        q, k, v = (x[:1].expand(B, *x.shape[1:]) for x in (q, k, v))
    if shape == "3d":
        q, k, v = q[0], k[0], v[0]
    if shape == "transposed":  # (B, T, H, D) memory seen as (B, H, T, D)
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    kw = dict(is_causal=shape in ("causal", "gqa"), enable_gqa=shape == "gqa")
    dout = torch.randn(q.shape[:-1] + (D,), generator=g).to(dtype)
    results = []
    for fused in (True, False):
        force_native_rows(monkeypatch, on=fused)
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = qkv.scaled_dot_product_attention(*inputs, backend="torch", **kw)
        assert (type(out.grad_fn).__name__ == "_NanRowsBackward") == fused  # the way taken
        if shape == "sum":  # a gradient of stride 0 (the tensor ops' way back)
            out.sum().backward()
        else:
            out.backward(dout)
        results.append([out.detach()] + [x.grad for x in inputs])
    assert results[0][0].isnan().any() and not results[0][0].isnan().all()
    for fused, plain in zip(*results):
        torch.testing.assert_close(fused, plain, rtol=0, atol=0, equal_nan=True)
    for grad in results[0][1:]:
        assert torch.isfinite(grad).all()
