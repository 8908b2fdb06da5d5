"""Regression tests for the silent wrong answers, NaNs and crashes of issue 12 (items 1-7, 9,
11-14), each against plain float64 math written here, not against another backend alone.

Shape alphabet: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import qkv
from qkv import masks
from qkv.ops import nonfinite_rows

BACKENDS = ["reference", "torch", "tiled", "auto"]


def plain(q, k, v, allowed=None, bias=None, scale=None, score_fn=None):
    """softmax(q k^T * scale (+ score_fn) + bias, masked) v in float64; empty rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    if score_fn is not None:
        s = score_fn(s)
    if bias is not None:
        s = s + bias.double()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    return (e / torch.where(z == 0, 1.0, z)) @ v


def tril(T, S, offset=0):
    return torch.ones(T, S, dtype=torch.bool).tril(offset)


# --- 1: strided layouts ---------------------------------------------------------------------


def _layout(name, B=2, H=3, T=37, D=8):
    """``(base, view)``: a base tensor and the strided view of it that attention is fed."""
    return {
        "last-dim-step": (torch.randn(B, T, H, 2 * D), lambda t: t[..., ::2].transpose(1, 2)),
        "transposed-storage": (torch.randn(B, T, H, D), lambda t: t.transpose(1, 2)),
        "last-dim-transposed": (torch.randn(B, H, D, T), lambda t: t.transpose(-1, -2)),
        "channels-last": (torch.randn(B, D, H, T), lambda t: t.permute(0, 2, 3, 1)),
        "expanded-heads": (torch.randn(B, 1, T, D), lambda t: t.expand(B, H, T, D)),
    }[name]


LAYOUTS = [
    "last-dim-step",
    "transposed-storage",
    "last-dim-transposed",
    "channels-last",
    "expanded-heads",
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("how", ["tiled-is_causal", "tiled-window", "auto-window", "torch-trace"])
def test_any_stride_layout_gives_the_contiguous_answer(layout, how):
    base, view = _layout(layout)
    backend, kind = how.split("-", 1)
    window = kind == "window"
    kw = dict(mask_mod=masks.sliding_window(5)) if window else dict(is_causal=True)
    leaf = base.clone().requires_grad_(True)
    y = view(leaf)
    assert y.stride(-1) != 1 or not y.is_contiguous()
    T = y.shape[-2]
    allowed = tril(T, T) & ~tril(T, T, -6) if window else tril(T, T)
    ref = base.double().requires_grad_(True)
    want = plain(view(ref), view(ref), view(ref), allowed)
    if kind == "trace":
        got, trace = qkv.scaled_dot_product_attention(
            y, y, y, backend=backend, return_trace=True, **kw
        )
        eye = torch.eye(T).expand(y.shape[0], y.shape[1], T, T)
        assert (trace.probs.double() - plain(y, y, eye, allowed)).abs().max() < 1e-5
    else:
        got = qkv.scaled_dot_product_attention(y, y, y, backend=backend, **kw)
    assert (got.double() - want).abs().max() < 1e-5
    got.square().sum().backward()
    want.square().sum().backward()
    assert (leaf.grad.double() - ref.grad).abs().max() < 1e-4


# --- 2: float64 q/k/v with a float32 mask -----------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T, S", [(4, 8), (8, 4), (8, 8)])
def test_float64_inputs_with_a_float32_mask_are_exact(backend, T, S):
    q = torch.randn(2, 3, T, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 3, S, 8, dtype=torch.float64),
        torch.randn(2, 3, S, 8, dtype=torch.float64),
    )
    mask = torch.randn(T, S)  # float32
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    torch.testing.assert_close(got, plain(q, k, v, bias=mask))


# --- 3: the gradient of a float mask beside a non-additive score_mod ---------------------------


@pytest.mark.parametrize("mod", ["softcap", "times-half"])
def test_float_mask_gradient_with_a_non_additive_score_mod(mod):
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(9, 9, dtype=torch.float64, requires_grad=True)
    score_mod, fn = {
        "softcap": (masks.softcap(2.0), lambda s: torch.tanh(s / 2.0) * 2.0),
        "times-half": (lambda s, b, h, qi, ki: s * 0.5, lambda s: s * 0.5),
    }[mod]
    qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, score_mod=score_mod, backend="tiled"
    ).square().sum().backward()
    got = mask.grad.clone()
    mask.grad = None
    plain(q, k, v, bias=mask, score_fn=fn).square().sum().backward()
    torch.testing.assert_close(got, mask.grad)


# --- 4: every tensor a score_mod reads gets its gradient --------------------------------------

GLOBAL_BIAS = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)


def _global_bias(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_BIAS[q_idx, kv_idx]


class _Biased(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(2, 8, dtype=torch.float64))

    def per_head(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[h][kv_idx]

    def forward(self, score, b, h, q_idx, kv_idx, bias=None):
        return score + bias[b][q_idx]


def _captures():
    m = _Biased()
    t = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    held = [torch.randn(8, dtype=torch.float64, requires_grad=True)]

    def in_list(score, b, h, q_idx, kv_idx):
        return score * held[0][kv_idx]

    return {
        "module-level": (_global_bias, GLOBAL_BIAS, lambda s, B, H, T, S: s + GLOBAL_BIAS),
        "bound-method-parameter": (
            m.per_head,
            m.bias,
            lambda s, B, H, T, S: s + m.bias[None, :, None, :],
        ),
        "partial": (functools.partial(m, bias=t), t, lambda s, B, H, T, S: s + t[:, None, :, None]),
        "list-in-closure": (in_list, held[0], lambda s, B, H, T, S: s * held[0]),
    }


@pytest.mark.parametrize(
    "case", ["module-level", "bound-method-parameter", "partial", "list-in-closure"]
)
@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_every_tensor_a_score_mod_reads_gets_its_gradient(case, backend):
    score_mod, tensor, dense = _captures()[case]
    q, k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    tensor.grad = None
    qkv.scaled_dot_product_attention(
        q, k, v, score_mod=score_mod, backend=backend
    ).square().sum().backward()
    got = tensor.grad
    assert got is not None
    tensor.grad = None
    plain(q, k, v, score_fn=lambda s: dense(s, 2, 2, 8, 8)).square().sum().backward()
    torch.testing.assert_close(got, tensor.grad)


class _Hidden:
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)  # a class attribute


def test_a_tensor_the_tiled_backend_cannot_find_raises_with_the_reason():
    q, k, v = (torch.randn(1, 1, 8, 4, dtype=torch.float64) for _ in range(3))

    def hidden(score, b, h, q_idx, kv_idx):
        return score + _Hidden.weight[kv_idx]

    with pytest.raises(
        ValueError, match=r"reads tensors that require grad \(\(8,\)\).*backend='reference'"
    ):
        qkv.scaled_dot_product_attention(q, k, v, score_mod=hidden, backend="tiled")
    with torch.no_grad():  # no gradient wanted: nothing to lose
        out = qkv.scaled_dot_product_attention(q, k, v, score_mod=hidden, backend="tiled")
    torch.testing.assert_close(out, plain(q, k, v, score_fn=lambda s: s + _Hidden.weight.detach()))


# --- 5: torch's CausalBias objects ------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T, S", [(3, 5), (5, 3), (4, 4)])
def test_torch_causal_bias_objects_keep_their_meaning(backend, T, S):
    q, k, v = torch.randn(1, 2, T, 4), torch.randn(1, 2, S, 4), torch.randn(1, 2, S, 4)
    upper = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_upper_left(T, S), backend=backend
    )
    lower = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(T, S), backend=backend
    )
    assert (upper.double() - plain(q, k, v, tril(T, S))).abs().max() < 1e-5
    assert (lower.double() - plain(q, k, v, tril(T, S, S - T))).abs().max() < 1e-5


def test_a_causal_bias_of_other_lengths_is_refused():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(
        ValueError, match=r"CausalBias for \(T, S\) = \(3, 6\) but the call has \(T, S\) = \(3, 3\)"
    ):
        qkv.scaled_dot_product_attention(q, q, q, attn_mask=causal_lower_right(3, 6))


# --- 6: keys a row may not attend to have no effect on it --------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["nan-key", "inf-value", "neg-inf-key", "nan-value"])
def test_masked_keys_holding_nan_or_inf_do_not_reach_rows_that_cannot_see_them(backend, bad):
    T = 85
    q, k, v = torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
    j = 60
    clean = plain(q, k, v, tril(T, T))
    t, val = {
        "nan-key": (k, math.nan),
        "inf-value": (v, math.inf),
        "neg-inf-key": (k, -math.inf),
        "nan-value": (v, math.nan),
    }[bad]
    t[0, 1, j, 3] = val
    out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    assert (
        out[:, :, :j].double() - clean[:, :, :j]
    ).abs().max() < 1e-5  # rows before j cannot see it
    assert (out[:, 0].double() - clean[:, 0]).abs().max() < 1e-5  # head 0 holds no bad key
    seen = out[0, 1, j:]  # rows that may attend to it
    if bad != "neg-inf-key" or not nonfinite_rows.available() or not q.is_cpu:
        assert seen.isnan().all()  # not finite, as in plain math (or the cheaper rule's NaN)
        return
    # its score is +inf (a NaN row) or -inf (weight 0: a finite row) by the sign of q[..., 3];
    # inference on the CPU's fused passes gives the plain math's rows
    want = plain(q, k, v, tril(T, T))[0, 1, j:]
    nan = ~torch.isfinite(want).all(-1)
    assert nan.any() and (~nan).any()
    assert seen[nan].isnan().all()
    assert (seen[~nan].double() - want[~nan]).abs().max() < 1e-5


# --- 7: scale <= 0 and large scales ------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T, S", [(3, 5), (64, 64)])
@pytest.mark.parametrize("scale", [0.0, -1.0, -0.3, 1e4, 1e30])
def test_any_finite_scale_with_is_causal_is_finite_and_exact(backend, T, S, scale):
    q, k, v = torch.randn(2, 2, T, 8), torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)
    out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, backend=backend)
    assert not out.isnan().any()
    want = plain(q, k, v, tril(T, S), scale=scale)
    if abs(scale) < 1e3:  # exact; at 1e4+ a row is one-hot on its largest score either way
        assert (out.double() - want).abs().max() < 1e-5
    else:
        close = (out.double() - want).abs().amax(-1) < 1e-4
        assert close.float().mean() > 0.95  # ties in float32 scores may differ from float64


# --- 9: a 3-D mask with return_trace -----------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_three_dim_mask_with_a_trace(backend, mask_kind):
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    mask = torch.rand(3, 5, 6) < 0.7 if mask_kind == "bool" else torch.randn(3, 5, 6)
    out, trace = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, return_trace=True, backend=backend
    )
    allowed, bias = (mask, None) if mask_kind == "bool" else (None, mask)
    assert (out.double() - plain(q, k, v, allowed, bias)).abs().max() < 1e-5
    want = plain(q, k, torch.eye(6).expand(2, 3, 6, 6), allowed, bias)  # probs, by v = I
    assert (trace.probs.double() - want).abs().max() < 1e-5


# --- 11: empty batch, rank-0 and rank-1 masks --------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    q = torch.randn(0, 2, 4, 8, requires_grad=True)
    out = qkv.scaled_dot_product_attention(q, q, q, is_causal=True, backend=backend)
    assert out.shape == (0, 2, 4, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", ["bool-0d", "float-0d", "bool-1d", "float-1d"])
def test_masks_of_rank_0_and_1_broadcast_as_in_torch(backend, mask):
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    m = {
        "bool-0d": torch.tensor(True),
        "float-0d": torch.tensor(0.5),
        "bool-1d": torch.tensor([True, False, True, True, False, True]),
        "float-1d": torch.randn(6),
    }[mask]
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=m, backend=backend)
    want = plain(q, k, v, m) if m.dtype == torch.bool else plain(q, k, v, bias=m)  # broadcast
    assert (out.double() - want).abs().max() < 1e-5


# --- 12: meta tensors --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tiled", "auto", "reference"])
@pytest.mark.parametrize("kw", ["window", "document", "is_causal", "bool-mask"])
def test_meta_tensors_give_shapes_and_a_backward(backend, kw):
    q = torch.empty(2, 4, 16, 8, device="meta", requires_grad=True)
    kv = torch.empty(2, 2, 16, 8, device="meta")
    extra = {
        "window": dict(mask_mod=masks.sliding_window(3)),
        "document": dict(
            mask_mod=masks.document(torch.zeros(2, 16, dtype=torch.long, device="meta"))
        ),
        "is_causal": dict(is_causal=True),
        "bool-mask": dict(attn_mask=torch.empty(16, 16, dtype=torch.bool, device="meta")),
    }[kw]
    out = qkv.scaled_dot_product_attention(q, kv, kv, enable_gqa=True, backend=backend, **extra)
    assert out.shape == (2, 4, 16, 8) and out.device.type == "meta"
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert grad.shape == q.shape


@pytest.mark.parametrize("backend", ["torch", "tiled", "auto", "reference"])
@pytest.mark.parametrize("kw", ["plain", "is_causal", "bool-mask"])
def test_meta_tensors_give_a_trace_of_the_right_shapes(backend, kw):
    """Issue 25: ``return_trace=True`` on meta tensors raised "Tensor.item() cannot be called
    on meta tensors" on torch and auto (the trace's row blocks read their indices on the
    tensors' device)."""
    q = torch.empty(2, 4, 16, 8, device="meta")
    kv = torch.empty(2, 4, 12, 8, device="meta")
    extra = {
        "plain": {},
        "is_causal": dict(is_causal=True),
        "bool-mask": dict(attn_mask=torch.empty(16, 12, dtype=torch.bool, device="meta")),
    }[kw]
    out, trace = qkv.scaled_dot_product_attention(
        q, kv, kv, backend=backend, return_trace=True, **extra
    )
    assert out.shape == (2, 4, 16, 8) and out.device.type == "meta"
    assert trace.probs.shape == trace.scores.shape == (2, 4, 16, 12)
    assert trace.lse.shape == (2, 4, 16) and trace.probs.device.type == "meta"


# --- 13: autocast --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_autocast_gives_torchs_dtype_on_every_backend(backend, amp):
    a = torch.randn(1, 2, 8, 4)
    with torch.autocast(torch.get_default_device().type, dtype=amp):
        want = torch.nn.functional.scaled_dot_product_attention(a, a, a).dtype
        out = qkv.scaled_dot_product_attention(a, a, a, backend=backend)
        mha = qkv.MultiHeadAttention(8, 2)(a.reshape(1, 8, 8))
    assert want == amp and out.dtype == amp
    assert (out.double() - plain(a, a, a)).abs().max() < 0.03  # half precision of the inputs
    assert mha.dtype == amp  # its projections autocast as any nn.Linear


# --- 14: score_mod/mask_mod per element, scores in float32 ---------------------------------------


@pytest.mark.parametrize("backend", ["tiled", "reference", "auto"])
def test_chained_subscripts_in_a_score_mod_mean_what_they_say(backend):
    B, H, T = 3, 2, 7
    bias = torch.randn(B, T)
    q, k, v = torch.randn(B, H, T, 4), torch.randn(B, H, T, 4), torch.randn(B, H, T, 4)
    out = qkv.scaled_dot_product_attention(
        q, k, v, backend=backend, score_mod=lambda s, b, h, qi, ki: s + bias[b][qi]
    )
    assert (out.double() - plain(q, k, v, bias=bias[:, None, :, None])).abs().max() < 1e-5
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2]] * B)
    doc = qkv.scaled_dot_product_attention(
        q, k, v, backend=backend, mask_mod=lambda b, h, qi, ki: ids[b][qi] == ids[b][ki]
    )
    allowed = ids[:, None, :, None] == ids[:, None, None, :]
    assert (doc.double() - plain(q, k, v, allowed)).abs().max() < 1e-5


def test_bf16_score_mods_see_float32_scores_and_err_no_more_than_a_plain_call():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 4, 256, 64).bfloat16() for _ in range(3))
    seen = []

    def halve(score, b, h, q_idx, kv_idx):
        seen.append(score.dtype)
        return score * 0.5

    out = qkv.scaled_dot_product_attention(q, k, v, score_mod=halve, backend="tiled")
    assert set(seen) == {torch.float32}
    golden = plain(q, k, v, scale=0.5 / 8)
    plain_call = qkv.scaled_dot_product_attention(q, k, v, scale=0.5 / 8, backend="tiled")
    err = (out.double() - golden).abs().max()
    assert err <= (plain_call.double() - golden).abs().max()  # the same scores, by scale
