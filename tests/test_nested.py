"""Nested (jagged) tensors: a batch of sequences of different lengths without padding, as
torch's SDPA takes them, run as packed sequences with a document mask.

Each case is checked against every sequence attended on its own (dense, float64), output and
gradients. Before, qkv refused such inputs with a misleading message ("key has S=j2
positions but value has j3") and its module with torch's internal one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv

LENGTHS = [5, 0, 9, 3]  # an empty sequence among them


def _nested(lengths, H, D, seed, leaf=False):
    """A jagged ``(B, H, j, D)`` tensor (from ``(B, j, H, D)``, as projections give it) and
    its leaf ``(B, j, H, D)`` for gradients."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(L, H, D, generator=g, dtype=torch.float64) for L in lengths]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=leaf)
    return x.transpose(1, 2), x


def _per_sequence(q, k, v, **kw):
    """Each sequence attended on its own by torch's math, dense: the expected output."""
    return [
        F.scaled_dot_product_attention(a, b, c, **kw)
        if a.shape[-2]
        else a.new_zeros(*a.shape[:-1], c.shape[-1])
        for a, b, c in zip(q.unbind(), k.unbind(), v.unbind())
    ]


def _check(out, want, query):
    assert out.is_nested and out.shape[0] == len(want)
    assert out.shape[2] == query.shape[2]  # the query's ragged size: x + out adds
    for got, w in zip(out.unbind(), want):
        torch.testing.assert_close(got, w)


@pytest.mark.parametrize("backend", ["auto", "tiled", "reference", "torch"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_self_attention_equals_each_sequence_alone(backend, is_causal):
    q, _ = _nested(LENGTHS, 4, 8, 0)
    k, _ = _nested(LENGTHS, 2, 8, 1)  # GQA: 2 key heads
    v, _ = _nested(LENGTHS, 2, 6, 2)  # Dv != D
    out = qkv.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, enable_gqa=True, backend=backend
    )
    _check(out, _per_sequence(q, k, v, is_causal=is_causal, enable_gqa=True), q)


def test_cross_attention_pairs_the_ith_sequences():
    q, _ = _nested(LENGTHS, 2, 8, 0)
    k, _ = _nested([4, 6, 0, 11], 2, 8, 1)  # a query sequence with no key: its rows are 0
    v, _ = _nested([4, 6, 0, 11], 2, 8, 2)
    out = qkv.scaled_dot_product_attention(q, k, v, scale=0.3)
    want = _per_sequence(q, k, v, scale=0.3)
    want[2] = torch.zeros_like(want[2])  # qkv's contract: a row with no key is 0
    _check(out, want, q)


def test_sinks_per_head():
    q, _ = _nested(LENGTHS, 2, 8, 0)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out = qkv.scaled_dot_product_attention(q, q, q, sinks=sinks)
    want = [
        qkv.scaled_dot_product_attention(a, a, a, sinks=sinks, backend="reference")
        for a in q.unbind()
    ]
    _check(out, want, q)


def test_gradients_reach_the_nested_leaves_as_each_sequence_alone():
    q, xq = _nested(LENGTHS, 2, 8, 0, leaf=True)
    k, xk = _nested(LENGTHS, 2, 8, 1, leaf=True)
    out = qkv.scaled_dot_product_attention(q, k, k, is_causal=True)
    out.values().square().sum().backward()
    for i, L in enumerate(LENGTHS):
        a = xq.unbind()[i].detach().transpose(0, 1).requires_grad_()  # (H, L, D)
        b = xk.unbind()[i].detach().transpose(0, 1).requires_grad_()
        if L:
            F.scaled_dot_product_attention(a, b, b, is_causal=True).square().sum().backward()
            torch.testing.assert_close(xq.grad.unbind()[i], a.grad.transpose(0, 1))
            torch.testing.assert_close(xk.grad.unbind()[i], b.grad.transpose(0, 1))
        assert xq.grad.unbind()[i].shape == (L, 2, 8)


def test_one_head_three_dims():
    q, _ = _nested(LENGTHS, 1, 8, 0)
    q3 = q.transpose(1, 2).flatten(-2)  # (B, j, 8)
    out = qkv.scaled_dot_product_attention(q3, q3, q3, is_causal=True)
    want = [w[0] for w in _per_sequence(q, q, q, is_causal=True)]
    for got, w in zip(out.unbind(), want):
        torch.testing.assert_close(got, w)


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(attn_mask=torch.ones(9, 9, dtype=torch.bool)), "not attn_mask"),
        (dict(mask_mod=qkv.masks.sliding_window(2)), "not mask_mod"),
        (dict(score_mod=qkv.masks.softcap(2.0)), "not score_mod"),
        (dict(return_trace=True), "not return_trace"),
        (dict(sinks=torch.zeros(4, 5 + 0 + 9 + 3)), "not sinks by row"),
    ],
)
def test_what_nested_inputs_do_not_take_is_refused_by_name(kw, words):
    q, _ = _nested(LENGTHS, 4, 8, 0)
    with pytest.raises(ValueError, match=words):
        qkv.scaled_dot_product_attention(q, q, q, **kw)


def test_malformed_nested_inputs_are_refused_with_the_fix():
    q, x = _nested(LENGTHS, 2, 8, 0)
    dense = torch.randn(4, 2, 9, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="all nested"):
        qkv.scaled_dot_product_attention(q, dense, dense)
    with pytest.raises(ValueError, match="ragged dim second to last"):
        qkv.scaled_dot_product_attention(x, x, x)  # (B, j, H, D): not transposed
    strided = torch.nested.nested_tensor([torch.randn(2, 3, 4), torch.randn(2, 5, 4)])
    with pytest.raises(ValueError, match=r"layout=torch\.jagged"):
        qkv.scaled_dot_product_attention(strided, strided, strided)
    k, _ = _nested([4, 6, 1, 2], 2, 8, 1)
    with pytest.raises(ValueError, match="causal within a sequence"):
        qkv.scaled_dot_product_attention(q, k, k, is_causal=True)
    k, _ = _nested([4, 6], 2, 8, 1)
    with pytest.raises(ValueError, match="holds 4 sequences, key 2"):
        qkv.scaled_dot_product_attention(q, k, k)


@pytest.mark.parametrize("G", [4, 2])
def test_multi_head_attention_module_equals_each_sequence_alone(G):
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 4, num_kv_heads=G).double()
    parts = [torch.randn(L, 16, dtype=torch.float64) for L in LENGTHS]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    memory = torch.nested.nested_tensor(
        [torch.randn(L, 16, dtype=torch.float64) for L in [3, 1, 4, 8]], layout=torch.jagged
    )
    for kw, want in [
        (dict(is_causal=True), [mha(p[None], is_causal=True)[0] for p in parts]),
        (
            dict(key=memory, value=memory),
            [mha(p[None], m[None], m[None])[0] for p, m in zip(parts, memory.unbind())],
        ),
    ]:
        out = mha(x, **kw)
        assert out.is_nested
        for got, w in zip(out.unbind(), want):
            torch.testing.assert_close(got, w)
    y = x + mha(x, is_causal=True)  # the query's ragged size: the residual adds
    y.values().sum().backward()
    assert mha.in_proj_weight.grad.abs().sum() > 0 and x.grad is not None


def test_single_head_module_and_the_modules_that_refuse():
    torch.manual_seed(0)
    parts = [torch.randn(L, 16) for L in LENGTHS]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged)
    sa = qkv.nn.SelfAttention(16, 8)
    for got, p in zip(sa(x, is_causal=True).unbind(), parts):
        torch.testing.assert_close(got, sa(p, is_causal=True))
    with pytest.raises(ValueError, match="not key_mask"):
        qkv.MultiHeadAttention(16, 4)(x, key_mask=torch.ones(4, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="LinearMultiHeadAttention takes no nested"):
        qkv.nn.LinearMultiHeadAttention(16, 4)(x)


def test_a_capture_records_the_packed_call():
    """qkv.capture of a model fed nested inputs records the packed call (it failed: the
    capture asked the call for a trace, which nested inputs refuse)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(qkv.MultiHeadAttention(16, 4))
    parts = [torch.randn(L, 16) for L in LENGTHS]
    x = torch.nested.nested_tensor(parts, layout=torch.jagged)
    with torch.no_grad(), qkv.capture(model) as cap:
        y = model(x)
    for got, p in zip(y.unbind(), parts):
        torch.testing.assert_close(got, model(p[None])[0])
    (record,) = cap.records  # one call, the packed one
    probs = record.probs  # (1, H, total, total)
    total = sum(LENGTHS)
    assert probs.shape == (1, 4, total, total)
    ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    across = ids[:, None] != ids[None, :]
    assert probs[..., across].abs().max() == 0 and probs.sum(-1).sub(1).abs().max() < 1e-5
