"""gradcheck in float64 for every backend, and float64 gradients equal torch's."""

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKENDS

import qkv


def _leaves(*shapes):
    return [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]


CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "bool-mask": dict(attn_mask=torch.rand(5, 7) < 0.7),
    "mask+causal": dict(attn_mask=torch.rand(5, 7) < 0.7, is_causal=True),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend, case):
    kw = dict(CASES[case])
    if "attn_mask" in kw:
        kw["attn_mask"] = kw["attn_mask"].clone()
        kw["attn_mask"][:, 0] = True  # gradcheck needs a smooth function: no empty rows here
    # D = 2: each perturbed element costs gradcheck two calls; D = 59 and Dv != D at full
    # precision are test_float64_gradients_equal_torch's
    q, k, v = _leaves((2, 3, 5, 2), (2, 3, 7, 2), (2, 3, 7, 3))

    def f(q, k, v):
        return qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_gqa_and_float_mask(backend):
    q, k, v = _leaves((2, 4, 5, 2), (2, 2, 7, 2), (2, 2, 7, 2))
    bias = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, bias):
        return qkv.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, enable_gqa=True, backend=backend
        )

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_with_empty_rows(backend):
    """A fully masked row is constant 0: its gradient is 0 and gradcheck holds around it."""
    q, k, v = _leaves((1, 2, 4, 3), (1, 2, 6, 3), (1, 2, 6, 3))
    keep = torch.rand(4, 6) < 0.7
    keep[:, 0] = True
    keep[2] = False

    def f(q, k, v):
        return qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_gradients_equal_torch(backend):
    q, k, v = _leaves((2, 4, 97, 59), (2, 2, 113, 59), (2, 2, 113, 17))
    keep = torch.rand(2, 1, 97, 113) < 0.8
    cotangent = torch.randn(2, 4, 97, 17, dtype=torch.float64)
    grads = []
    for fn in (
        F.scaled_dot_product_attention,
        lambda *a, **kw: qkv.scaled_dot_product_attention(*a, backend=backend, **kw),
    ):
        out = fn(q, k, v, attn_mask=keep, enable_gqa=True)
        grads.append(torch.autograd.grad(out, (q, k, v), cotangent))
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
