"""torch's SDPA takes a short call's structured mask as the dense mask it stands for (issue 38:
on an AMX Xeon, bfloat16 documents at T=1024 ran in 0.75x the tiled loop's time that way).

The dense mask is made once per mask structure and sizes and kept; the static order never
takes torch for a structured mask (its kernel visits every pair, where tiled skips blocks),
only a measurement that finds it fastest (test_autotune.py, with a fake clock) or a caller who
names it; beyond ``DENSE_MAX`` pairs torch declines and says why.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import dispatch, masks
from qkv.ops import AttentionCall, BackendUnsupportedError, torch_sdpa

B, H, T, S, D = 2, 3, 23, 23, 8
# rows 0-4 of batch 0 belong to document 9, which no key holds: rows with no key at all
Q_IDS = torch.tensor([[9] * 5 + [0] * 8 + [1] * 10, [0] * 12 + [1] * 11])
KV_IDS = torch.tensor([[0] * 11 + [1] * 12, [0] * 12 + [1] * 11])


def _mods() -> dict:
    return {
        "window": masks.sliding_window(4, 2),
        "document": masks.document(Q_IDS, KV_IDS),
        "key_lengths": masks.key_lengths(torch.tensor([7, 23])),
        "neighborhood": masks.neighborhood(5, T, dilation=2),
        "window&document": masks.sliding_window(6) & masks.document(KV_IDS),
        "function": lambda b, h, q, kv: (q + kv) % 3 != 0,
    }


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, H, L, D, generator=g, dtype=torch.float64).requires_grad_()
        for L in (T, S, S)
    ]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(_mods()))
def test_torch_runs_a_structured_mask_as_its_dense_twin(name, is_causal):
    """Output and gradients equal the reference's (float64), rows with no key 0 with 0
    gradients, on a first call (the mask made) and a second (the mask kept)."""
    mod = _mods()[name]
    q, k, v = _inputs()
    want = qkv.scaled_dot_product_attention(
        q, k, v, mask_mod=mod, is_causal=is_causal, backend="reference"
    )
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    for _ in range(2):
        out = qkv.scaled_dot_product_attention(
            q, k, v, mask_mod=mod, is_causal=is_causal, backend="torch"
        )
        torch.testing.assert_close(out, want)
        for got, expected in zip(torch.autograd.grad(out.sum(), (q, k, v)), want_grads):
            torch.testing.assert_close(got, expected)
    if name == "document":
        assert out[0, :, :5].abs().max() == 0  # document 9 has no key


def test_the_dense_mask_is_made_once_per_structure_and_sizes(monkeypatch):
    """Calls with the same mask (or one of equal content) and sizes make it once; new sizes,
    causal or ids changed in place make a new one."""
    made = []
    original = AttentionCall.dense_mask_mod

    def counted(call):
        made.append((call.T, call.is_causal))
        return original(call)

    monkeypatch.setattr(AttentionCall, "dense_mask_mod", counted)
    torch_sdpa._dense_masks.clear()
    ids = KV_IDS.clone()
    q, k, v = (t.detach() for t in _inputs())
    for _ in range(3):
        qkv.scaled_dot_product_attention(q, k, v, mask_mod=masks.document(ids), backend="torch")
    qkv.scaled_dot_product_attention(q, k, v, mask_mod=masks.document(ids.clone()), backend="torch")
    assert made == [(T, False)]
    qkv.scaled_dot_product_attention(
        q, k, v, mask_mod=masks.document(ids), is_causal=True, backend="torch"
    )
    qkv.scaled_dot_product_attention(
        q[:, :, :7], k, v, mask_mod=masks.document(ids[:, :7], ids), backend="torch"
    )
    assert made == [(T, False), (T, True), (7, False)]
    ids[0, :3] = 5  # keys 0-2 of batch 0 a document of their own: a new mask
    out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=masks.document(ids), backend="torch")
    assert len(made) == 4
    want = qkv.scaled_dot_product_attention(
        q, k, v, mask_mod=masks.document(ids), backend="reference"
    )
    torch.testing.assert_close(out, want)


def test_the_static_order_leaves_structured_masks_to_the_loops_that_skip_blocks(monkeypatch):
    """Measuring off (as in the suite): auto takes tiled for a window, torch for a plain call."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    q, k, v = (t.detach() for t in _inputs())
    window = AttentionCall.build(q, k, v, mask_mod=masks.sliding_window(4))
    assert dispatch.get_backend("torch").supports(window) is None
    assert dispatch.select(window).name == "tiled"
    assert dispatch.explain(window).startswith("tiled: the first backend of the static order")
    assert dispatch.select(AttentionCall.build(q, k, v)).name == "torch"
    causal = AttentionCall.build(q, k, v, mask_mod=masks.causal(align="bottom_right"))
    assert dispatch.select(causal).name == "torch"  # torch's own causal_lower_right


def test_beyond_dense_max_torch_declines_and_says_why():
    n = 4096  # T * S = 2**24 > DENSE_MAX
    q = k = v = torch.empty(1, 1, n, 8, device="meta")
    call = AttentionCall.build(q, k, v, mask_mod=masks.sliding_window(16))
    reason = dispatch.get_backend("torch").supports(call)
    assert reason is not None and f"T * S = {n * n}" in reason and "to_dense" in reason
    with pytest.raises(BackendUnsupportedError, match="T \\* S = 16777216"):
        dispatch.select(call, "torch")
    small = AttentionCall.build(*(t[:, :, :2048] for t in (q, k, v)), mask_mod=masks.causal())
    assert dispatch.get_backend("torch").supports(small) is None  # 2048 * 2048 = DENSE_MAX


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_learned_mask_beside_a_mask_mod(dtype):
    """A float attn_mask that wants a gradient, with a mask_mod: in float64 torch takes it and
    the mask's gradient (summed back over the rows a (1, S) mask broadcasts along) equals the
    reference's; in a half dtype torch declines, since autograd would sum that gradient in
    half precision (bfloat16, T=1, S=4: -3.9e-3 where the float64 sum is 0; the long property
    profile found it), and auto takes tiled."""
    q, k, v = (t.detach().to(dtype) for t in _inputs())
    bias = torch.randn(1, S, dtype=torch.float64).to(dtype).requires_grad_()
    kw = dict(attn_mask=bias, mask_mod=masks.sliding_window(4, 2))
    call = AttentionCall.build(q, k, v, **kw)
    if dtype != torch.float64:
        reason = dispatch.get_backend("torch").supports(call)
        assert reason is not None and "half precision" in reason
        assert dispatch.select(call).name == "tiled"
        return
    got = torch.autograd.grad(
        qkv.scaled_dot_product_attention(q, k, v, backend="torch", **kw).sum(), bias
    )
    want = torch.autograd.grad(
        qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw).sum(), bias
    )
    assert want[0].abs().max() > 1e-3  # (a key's bias moves the output)
    torch.testing.assert_close(got[0], want[0])


@pytest.mark.parametrize("prefix", [0, 1, 9, T, T + 5])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_a_prefix_lm_is_the_kernels_causal_and_the_prefix_again(monkeypatch, prefix, gqa):
    """``prefix_lm(P)`` with an int P on square attention runs as two calls of torch's kernel,
    no dense mask made: every row causal, then the prefix's rows over the prefix's keys
    alone. Output, lse (a trace's weights) and gradients equal the reference's (float64)."""

    def no_dense(call):
        raise AssertionError("a prefix LM made its dense mask")

    kernel_calls = []
    original = torch_sdpa._kernel

    def counted(call, q, k, v, mask, is_causal, *rest):
        kernel_calls.append((q.shape[-2], k.shape[-2], mask, is_causal))
        return original(call, q, k, v, mask, is_causal, *rest)

    monkeypatch.setattr(torch_sdpa, "_kernel", counted)
    q, k, v = _inputs(1)
    if gqa:
        k, v = (t.detach()[:, :1].requires_grad_() for t in (k, v))
    mod = masks.prefix_lm(prefix)
    kw = dict(mask_mod=mod, enable_gqa=gqa, return_trace=True)
    want, want_trace = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    monkeypatch.setattr(AttentionCall, "dense_mask_mod", no_dense)
    out, trace = qkv.scaled_dot_product_attention(q, k, v, backend="torch", **kw)
    P = min(prefix, T)
    assert kernel_calls == [(T, T, None, True)] + ([(P, P, None, False)] if P else [])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(trace.probs, want_trace.probs)
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    got_grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "grad"])
def test_a_prefix_lm_on_torch_keeps_the_nan_contract(dtype, grad):
    """A NaN key at position 12 of a prefix LM of 5 (T=23): rows 0-11 never see it and stay
    the reference's, rows 12 on see it and are NaN, as the reference's; an inf value at key 2,
    which every row sees, makes every row NaN in the other batch element."""
    q, k, v = (t.detach().to(dtype) for t in _inputs(3))
    k[0, :, 12, 0] = float("nan")
    v[1, :, 2, 3] = float("inf")
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    kw = dict(mask_mod=masks.prefix_lm(5))
    with torch.set_grad_enabled(grad):
        out = qkv.scaled_dot_product_attention(q, k, v, backend="torch", **kw)
        want = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    assert out[0, :, :12].isfinite().all() and out[0, :, 12:].isnan().all()
    assert out[1].isnan().all() and want[1].isnan().all()
    golden = qkv.scaled_dot_product_attention(
        *(t.detach().double() for t in (q, k, v)), backend="reference", **kw
    )
    base = (want[0, :, :12].double() - golden[0, :, :12]).abs().max()
    assert (out[0, :, :12].double() - golden[0, :, :12]).abs().max() <= 2 * base + 1e-5


def test_a_long_prefix_lm_needs_no_dense_mask():
    """Beyond ``DENSE_MAX`` pairs torch still takes an int prefix LM (it makes no dense mask);
    a prefix per batch element, or a prefix LM of T != S, it declines as other masks."""
    n = 4096
    q = k = v = torch.empty(1, 1, n, 8, device="meta")
    torch_backend = dispatch.get_backend("torch")
    assert (
        torch_backend.supports(AttentionCall.build(q, k, v, mask_mod=masks.prefix_lm(64))) is None
    )
    per_element = AttentionCall.build(q, k, v, mask_mod=masks.prefix_lm(torch.tensor([64])))
    assert "T * S" in torch_backend.supports(per_element)
    tall = AttentionCall.build(q, k[:, :, :-1], v[:, :, :-1], mask_mod=masks.prefix_lm(64))
    assert "T * S" in torch_backend.supports(tall)
