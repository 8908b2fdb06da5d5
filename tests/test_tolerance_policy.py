"""Low-precision outputs and gradients of every backend by the tolerance policy of DESIGN.md,
and the policy helper itself."""

import pytest
import torch

import qkv
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance, golden_dtype, max_error

CASES = [
    pytest.param(
        T, S, D, causal, mask, id=f"B2-T{T}-S{S}-H4-D{D}-{'causal' if causal else 'full'}-{mask}"
    )
    for T, S, D in [(17, 17, 59), (97, 113, 64), (113, 97, 8), (1, 97, 64)]
    for causal in (False, True)
    for mask in ("none", "bool")
]


def _run(backend, dtype, q, k, v, mask, causal):
    """Output and (q, k, v) gradients of one backend with inputs cast to ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = qkv.scaled_dot_product_attention(
        *leaves, attn_mask=mask, is_causal=causal, backend=backend
    )
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], dtype=dtype))
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("T,S,D,causal,mask", CASES)
def test_backend_within_policy(backend, dtype, T, S, D, causal, mask):
    q, k, v = (torch.randn(2, 4, n, D, dtype=torch.float64) for n in (T, S, S))
    m = (torch.rand(T, S) < 0.8) if mask == "bool" else None
    golden = _run("reference", golden_dtype(dtype), q, k, v, m, causal)
    baseline = _run("reference", dtype, q, k, v, m, causal)
    actual = _run(backend, dtype, q, k, v, m, causal)
    assert_tolerance(actual[0], golden[0], baseline[0], factor=OUTPUT_FACTOR, name="out")
    for name, a, g, b in zip("qkv", actual[1], golden[1], baseline[1]):
        assert_tolerance(a, g, b, factor=GRAD_FACTOR, name=f"d{name}")


def test_golden_dtype():
    assert golden_dtype(torch.bfloat16) == torch.float64
    assert golden_dtype(torch.float16, "cuda") == torch.float32
    assert golden_dtype(torch.float32, "cuda") == torch.float64


def test_policy_helper_accepts_and_rejects():
    golden = torch.tensor([1.0, 2.0, float("-inf")], dtype=torch.float64)
    baseline = torch.tensor([1.001, 2.0, float("-inf")])
    assert_tolerance(torch.tensor([1.002, 2.0, float("-inf")]), golden, baseline)
    with pytest.raises(AssertionError, match=r"exceeds 2 \* max\|baseline - golden\|"):
        assert_tolerance(torch.tensor([1.003, 2.0, float("-inf")]), golden, baseline)
    with pytest.raises(AssertionError, match="NaN"):
        assert_tolerance(torch.tensor([1.0, float("nan"), float("-inf")]), golden, baseline)
    with pytest.raises(AssertionError):  # -inf expected, finite given
        assert_tolerance(torch.tensor([1.0, 2.0, 0.0]), golden, baseline)
    assert max_error(torch.tensor([float("inf")]), torch.tensor([float("inf")])) == 0.0


def test_policy_catches_a_wrong_kernel():
    """A kernel that forgets the scale is caught in bfloat16, where errors are largest."""
    q, k, v = (torch.randn(2, 4, 33, 16, dtype=torch.float64) for _ in range(3))
    golden = qkv.scaled_dot_product_attention(q, k, v, backend="reference")
    bf = [t.bfloat16() for t in (q, k, v)]
    baseline = qkv.scaled_dot_product_attention(*bf, backend="reference")
    wrong = qkv.scaled_dot_product_attention(*bf, scale=1.0 / 3.9, backend="torch")
    with pytest.raises(AssertionError):
        assert_tolerance(wrong, golden, baseline)
