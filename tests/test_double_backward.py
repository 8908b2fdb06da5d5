"""Second derivatives (``create_graph=True``: gradient penalties, Hessian-vector products)
through the tiled backend, against the reference's plain math.

The tiled backend's autograd Function once ran its FlashAttention backward with the graph on:
with a score_mod that is not additive (softcap) the chunk matmuls built a partial graph, and
the second derivatives came out silently wrong (0.09 and 0.23 off in float64); with every other
mask the backward's torch kernel refused. A backward with a graph now recomputes the attention
in differentiable math. torch's own kernels keep torch's answer (its fused kernels refuse; its
math kernel, chosen by ``torch.nn.attention.sdpa_kernel``, has them); the triton and ring
backwards refuse.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import qkv
from qkv import masks
from qkv.testing import GRAD_FACTOR, assert_tolerance


def _ids(T):
    return (torch.arange(T) * 3 // T).expand(2, T)  # 3 documents


CASES = {
    # name: sizes and what the call passes (tensors that want gradients are made per run)
    "window": dict(mask_mod=lambda T: masks.sliding_window(7)),
    "document-causal": dict(mask_mod=lambda T: masks.document(_ids(T)), is_causal=True),
    "key-lengths-with-empty-rows": dict(
        mask_mod=lambda T: masks.key_lengths(torch.tensor([0, 19]))
    ),
    "softcap": dict(score_mod=lambda T: masks.softcap(2.0)),
    "alibi-causal": dict(score_mod=lambda T: masks.alibi(4), is_causal=True),
    "learned-alibi": dict(learned_slopes=True, is_causal=True),
    "sinks": dict(sinks=True, mask_mod=lambda T: masks.sliding_window(5)),
    "float-bias": dict(float_bias=True),
    "bool-mask": dict(bool_mask=True),
    "gqa-window": dict(G=2, mask_mod=lambda T: masks.sliding_window(4, 2)),
    "cross-bottom-right": dict(S=41, mask_mod=lambda T: masks.causal("bottom_right")),
    "few-rows": dict(T=2, S=40, mask_mod=lambda T: masks.sliding_window(30)),
    "no-batch": dict(no_batch=True, mask_mod=lambda T: masks.sliding_window(6)),
}


def _inputs(case, dtype, seed=0):
    """The call's tensors that want gradients, as leaves, and the keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    T = case.get("T", 37)
    S = case.get("S", T)
    H, G = 4, case.get("G", 4)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    lead = () if case.get("no_batch") else (2,)
    leaves = {
        "q": r(*lead, H, T, 8),
        "k": r(*lead, G, S, 8),
        "v": r(*lead, G, S, 6),
    }
    if case.get("learned_slopes"):
        leaves["slopes"] = r(H, scale=0.3).abs()
    if case.get("sinks"):
        leaves["sinks"] = r(H)
    if case.get("float_bias"):
        leaves["bias"] = r(T, S)
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    kw = dict(is_causal=case.get("is_causal", False), enable_gqa=G != H)
    if "mask_mod" in case:
        kw["mask_mod"] = case["mask_mod"](T)
    if "score_mod" in case:
        kw["score_mod"] = case["score_mod"](T)
    if case.get("learned_slopes"):
        kw["score_mod"] = masks.alibi(leaves["slopes"])
    if case.get("sinks"):
        kw["sinks"] = leaves["sinks"]
    if case.get("float_bias"):
        kw["attn_mask"] = leaves["bias"]
    if case.get("bool_mask"):
        kw["attn_mask"] = torch.rand(T, S, generator=g) > 0.4
    return leaves, kw


def _second_derivatives(case, backend, dtype):
    """A Hessian-vector product: the gradient of <grad(L), w> for every input, where L weighs
    the output by a fixed random tensor and w is fixed and random too."""
    leaves, kw = _inputs(case, dtype)
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    out = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    inputs = list(leaves.values())
    grads = torch.autograd.grad(out, inputs, dout, create_graph=True)
    w = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) for t in grads]
    inner = sum((gi * wi).sum() for gi, wi in zip(grads, w))
    return dict(zip(leaves, torch.autograd.grad(inner, inputs)))


@pytest.mark.parametrize("name", list(CASES))
def test_second_derivatives_equal_the_references_in_float64(name):
    got = _second_derivatives(CASES[name], "tiled", torch.float64)
    want = _second_derivatives(CASES[name], "reference", torch.float64)
    for n in want:
        assert want[n].abs().max() > 0  # every input's second derivative is there to check
        torch.testing.assert_close(got[n], want[n], msg=lambda m, n=n: f"{name}, d{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["window", "softcap", "sinks", "float-bias"])
def test_second_derivatives_in_half_and_float32_meet_the_tolerance_policy(name, dtype):
    got = _second_derivatives(CASES[name], "tiled", dtype)
    golden = _second_derivatives(CASES[name], "reference", torch.float64)
    baseline = _second_derivatives(CASES[name], "reference", dtype)
    for n in golden:
        assert_tolerance(got[n], golden[n], baseline[n], factor=GRAD_FACTOR, name=f"{name} d{n}")


def test_a_first_backward_with_a_graph_gives_the_first_derivatives_too():
    """create_graph=True changes how the gradients are made, not what they are."""
    leaves, kw = _inputs(CASES["softcap"], torch.float64)
    q, k, v = leaves.values()
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    with_graph = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    plain = torch.autograd.grad(out.square().sum(), (q, k, v))
    for a, b in zip(with_graph, plain):
        assert a.requires_grad and not b.requires_grad
        torch.testing.assert_close(a, b)


def test_torchs_math_kernel_is_honoured_and_gives_the_second_derivatives():
    """torch's kernels keep torch's answer: its math kernel, chosen by ``sdpa_kernel``, has
    second derivatives (its fused kernels refuse them, in torch's words)."""
    with sdpa_kernel(SDPBackend.MATH):
        got = _second_derivatives(CASES["window"], "torch", torch.float64)
    want = _second_derivatives(CASES["window"], "reference", torch.float64)
    for n in want:
        torch.testing.assert_close(got[n], want[n])
