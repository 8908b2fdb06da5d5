"""Every bad input gets a ValueError/TypeError that names the numbers and the fix."""

import math
import re

import pytest
import torch

import qkv


def sdpa(q=None, k=None, v=None, **kw):
    q = torch.randn(2, 4, 5, 8) if q is None else q
    k = torch.randn(2, 4, 6, 8) if k is None else k
    v = torch.randn(2, 4, 6, 8) if v is None else v
    return qkv.scaled_dot_product_attention(q, k, v, **kw)


BAD = {
    "batch-mismatch": (
        ValueError,
        r"batch mismatch.*\(2, 4\).*\(3, 4\).*equal or 1",
        dict(k=torch.randn(3, 4, 6, 8), v=torch.randn(3, 4, 6, 8)),
    ),
    "head-mismatch": (
        ValueError,
        r"head mismatch.*H=4 heads but key .* has 3.*give key and value 4",
        dict(k=torch.randn(2, 3, 6, 8), v=torch.randn(2, 3, 6, 8)),
    ),
    "head-mismatch-hint-gqa": (
        ValueError,
        r"H=4 heads but key .* has 2; .* pass enable_gqa=True",
        dict(k=torch.randn(2, 2, 6, 8), v=torch.randn(2, 2, 6, 8)),
    ),
    "head-dim-mismatch": (
        ValueError,
        r"head-dim mismatch.*D=8 but key .* has D=7",
        dict(k=torch.randn(2, 4, 6, 7)),
    ),
    "kv-length-mismatch": (
        ValueError,
        r"key .* has S=6 positions but value .* has 5",
        dict(v=torch.randn(2, 4, 5, 8)),
    ),
    "gqa-not-multiple": (
        ValueError,
        (
            r"got H=12 query heads and G=5 key/value heads; H must be a "
            r"multiple of G"
        ),
        dict(
            q=torch.randn(2, 12, 5, 8),
            k=torch.randn(2, 5, 6, 8),
            v=torch.randn(2, 5, 6, 8),
            enable_gqa=True,
        ),
    ),
    "gqa-kv-heads-differ": (
        ValueError,
        r"key has G=2 heads but value has 4",
        dict(k=torch.randn(2, 2, 6, 8), enable_gqa=True),
    ),
    "gqa-2d": (
        ValueError,
        r"enable_gqa=True needs a heads dim",
        dict(q=torch.randn(5, 8), k=torch.randn(6, 8), v=torch.randn(6, 8), enable_gqa=True),
    ),
    "int-mask": (
        TypeError,
        r"attn_mask has dtype torch.int64; use a bool mask.*attn_mask.bool\(\)",
        dict(attn_mask=torch.ones(5, 6, dtype=torch.int64)),
    ),
    "uint8-mask": (
        TypeError,
        r"attn_mask has dtype torch.uint8",
        dict(attn_mask=torch.ones(5, 6, dtype=torch.uint8)),
    ),
    "mask-no-broadcast": (
        ValueError,
        (
            r"attn_mask of shape \(5, 5\) does not broadcast to the "
            r"scores' shape \(\*batch, T, S\) = \(2, 4, 5, 6\)"
        ),
        dict(attn_mask=torch.ones(5, 6 - 1, dtype=torch.bool)),
    ),
    "mask-grows-batch": (
        ValueError,
        r"attn_mask of shape \(3, 4, 5, 6\) does not broadcast",
        dict(attn_mask=torch.ones(3, 4, 5, 6, dtype=torch.bool)),
    ),
    "mask-not-tensor": (
        TypeError,
        r"attn_mask must be a torch.Tensor or None, got list",
        dict(attn_mask=[[True]]),
    ),
    "dtype-mismatch": (
        TypeError,
        (
            r"share a dtype, got query torch.float32, key torch.float64.*"
            r"\.to\(torch.float32\)"
        ),
        dict(k=torch.randn(2, 4, 6, 8).double()),
    ),
    "int-inputs": (
        TypeError,
        r"query has dtype torch.int64; attention needs floating point",
        dict(q=torch.ones(2, 4, 5, 8, dtype=torch.int64)),
    ),
    "not-a-tensor": (TypeError, r"value must be a torch.Tensor, got list", dict(v=[[1.0]])),
    "1-dim": (
        ValueError,
        r"query must have at least 2 dims \(\.\.\., L, E\), got shape \(8,\)",
        dict(q=torch.randn(8)),
    ),
    "nan-scale": (
        ValueError,
        (
            r"scale must be finite, got nan; pass None for the default "
            r"1/sqrt\(D\) = 0.353553"
        ),
        dict(scale=float("nan")),
    ),
    "inf-scale": (ValueError, r"scale must be finite, got inf", dict(scale=float("inf"))),
    "str-scale": (TypeError, r"scale must be a float or None, got str", dict(scale="0.1")),
    "dropout-1": (ValueError, r"dropout_p must be in \[0, 1\), got 1.0", dict(dropout_p=1.0)),
    "dropout-negative": (
        ValueError,
        r"dropout_p must be in \[0, 1\), got -0.1",
        dict(dropout_p=-0.1),
    ),
    "causal-not-bool": (
        TypeError,
        r"is_causal must be True or False, got 'yes'",
        dict(is_causal="yes"),
    ),
    "sparse-query": (
        TypeError,
        r"query is a torch.sparse_coo tensor; attention takes dense tensors: .*to_dense\(\)",
        dict(q=torch.randn(2, 4, 5, 8).to_sparse()),
    ),
    "sparse-mask": (  # (it failed inside torch: "Cannot access storage of SparseTensorImpl")
        TypeError,
        r"attn_mask is a torch.sparse_coo tensor; .* use attn_mask.to_dense\(\)",
        dict(attn_mask=(torch.rand(5, 6) > 0.5).to_sparse()),
    ),
    "unknown-backend": (
        ValueError,
        (
            r"unknown backend 'flash'; choose 'auto' or one of torch, flex, triton, "
            r"tiled, reference"
        ),
        dict(backend="flash"),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_message(case):
    exc, pattern, kw = BAD[case]
    with pytest.raises(exc, match=pattern):
        sdpa(**kw)


def test_device_mismatch_message(monkeypatch):
    """No second device here: the check compares devices, so a meta tensor stands in."""
    with pytest.raises(
        ValueError,
        match=r"one device, got query on cpu, key on meta, value on "
        r"cpu; move them with .to\('cpu'\)",
    ):
        sdpa(k=torch.randn(2, 4, 6, 8, device="meta"))
    with pytest.raises(ValueError, match=r"attn_mask is on meta but query is on cpu"):
        sdpa(attn_mask=torch.ones(5, 6, dtype=torch.bool, device="meta"))


def test_torch_would_accept_what_we_reject_for_good_reason():
    """torch silently accepts key/value of different lengths; qkv names the problem."""
    k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 7, 8)
    torch.nn.functional.scaled_dot_product_attention(torch.randn(2, 4, 5, 8), k, v)
    with pytest.raises(ValueError, match=re.escape("key (2, 4, 6, 8) has S=6")):
        sdpa(k=k, v=v)


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_scale_that_overflows_the_scores_raises_naming_it(backend, grad):
    """scale=1e38 is finite and accepted, but q.k * scale overflows float32: softmax gave NaN
    rows on every backend. Now a ValueError names the overflow (checked only when the output
    is not finite, so no call pays for it); a scale the dtype holds still gives the hard max."""
    q = torch.randn(1, 2, 5, 4, generator=torch.Generator().manual_seed(0), requires_grad=grad)
    with pytest.raises(ValueError, match=r"scaled scores overflow: scale=1e\+38"):
        qkv.scaled_dot_product_attention(q, q, q, scale=1e38, backend=backend)
    sharp = qkv.scaled_dot_product_attention(q, q, q, scale=1e30, backend=backend)
    scores = q @ q.transpose(-2, -1)
    hard = torch.nn.functional.one_hot(scores.argmax(-1), 5).to(q.dtype) @ q  # the hard max
    torch.testing.assert_close(sharp, hard)


def test_checks_still_refuse_after_a_structure_is_remembered():
    """``AttentionCall.build`` remembers what its checks found for a structure (shapes,
    dtypes, devices, mask layout, flags) and skips them for the next call of it; a look-alike
    of a good call (``is_causal=1``, an int dropout, a mask of another dtype or shape) is not
    that structure and is still refused, and a remembered call equals a checked one."""
    from qkv.ops import AttentionCall

    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool)
    first = AttentionCall.build(q, k, v, mask, 0.0, True, None)
    again = AttentionCall.build(q.clone(), k, v, mask, 0.0, True, None)  # remembered
    fields = set(first.__dict__) - {"query"}
    assert {f: again.__dict__[f] for f in fields} == {f: first.__dict__[f] for f in fields}
    assert again.scale == 1 / math.sqrt(8) and again.batch == (2, 3) and again.is_causal is True
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        AttentionCall.build(q, k, v, mask, 0.0, 1, None)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        AttentionCall.build(q, k, v, mask, True, True, None)
    with pytest.raises(TypeError, match=r"attn_mask has dtype torch\.int64"):
        AttentionCall.build(q, k, v, mask.long(), 0.0, True, None)
    with pytest.raises(ValueError, match="does not broadcast"):
        AttentionCall.build(q, k, v, torch.ones(4, 5, dtype=torch.bool), 0.0, True, None)
    with pytest.raises(ValueError, match="scale must be finite"):
        AttentionCall.build(q, k, v, mask, 0.0, True, float("nan"))
    with pytest.raises(TypeError, match=r"key is a torch\.sparse_coo tensor"):  # same shape
        AttentionCall.build(q, k.to_sparse(), v, mask, 0.0, True, None)
    with pytest.raises(TypeError, match=r"attn_mask is a torch\.sparse_coo tensor"):
        AttentionCall.build(q, k, v, mask.to_sparse(), 0.0, True, None)
