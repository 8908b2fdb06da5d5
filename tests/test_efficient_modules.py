"""LinearMultiHeadAttention, LocalMultiHeadAttention and KVCache decoding.

Equivalences: cached (or recurrent) decoding equals the full causal forward, for every kind of
attention module; the modules are interchangeable in one Transformer block; linear and local
modules equal their functional twins (linear_attention; MHA with a dense window mask).
"""

import pytest
import torch
from torch import nn

import qkv
from qkv import masks

KINDS = {
    "exact": qkv.MultiHeadAttention,
    "linear": qkv.LinearMultiHeadAttention,
    "performer": lambda C, H, **kw: qkv.LinearMultiHeadAttention(C, H, feature_map="favor", **kw),
    "local": lambda C, H, **kw: qkv.LocalMultiHeadAttention(C, H, window=5, **kw),
}


class Block(nn.Module):
    """A pre-norm Transformer block that knows nothing of which attention it holds."""

    def __init__(self, C: int, H: int, kind: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = KINDS[kind](C, H, num_kv_heads=H // 2)
        self.mlp = nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))

    def forward(self, x, *, key_mask=None, cache=None):
        x = x + self.attn(self.norm1(x), is_causal=True, key_mask=key_mask, cache=cache)
        return x + self.mlp(self.norm2(x))


def _decode(run, x, key_mask, splits):
    """Feed x in pieces ending at ``splits``, then one token at a time."""
    outs, start = [], 0
    for end in list(splits) + list(range(splits[-1] + 1, x.shape[1] + 1)):
        outs.append(run(x[:, start:end], key_mask[:, start:end]))
        start = end
    return torch.cat(outs, 1)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("splits", [(1,), (7, 19)], ids=["steps", "prompt7-12"])
def test_block_decoding_equals_full_causal_forward(kind, splits):
    torch.manual_seed(0)
    block = Block(32, 4, kind).double().eval()
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    key_mask = torch.ones(2, 37, dtype=torch.bool)
    key_mask[1, 25:] = False  # the second sequence ends early: padding after it
    full = block(x, key_mask=key_mask)
    cache = block.attn.new_cache(2, 64)
    dec = _decode(lambda xs, km: block(xs, key_mask=km, cache=cache), x, key_mask, splits)
    torch.testing.assert_close(dec, full)
    assert cache.position == 37


@pytest.mark.parametrize("kind", list(KINDS))
def test_padding_never_leaks(kind):
    torch.manual_seed(1)
    m = KINDS[kind](16, 2).double()
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    key_mask = torch.ones(2, 23, dtype=torch.bool)
    key_mask[0, 17:] = False
    x2 = x.clone()
    x2[0, 17:] = torch.randn(6, 16, dtype=torch.float64) * 100
    for causal in (False, True):
        a = m(x, key_mask=key_mask, is_causal=causal)
        b = m(x2, key_mask=key_mask, is_causal=causal)
        torch.testing.assert_close(a[0, :17], b[0, :17])
        torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize("kind", ["linear", "local"])
def test_state_dict_is_multihead_attentions(kind):
    mha = qkv.MultiHeadAttention(24, 3, num_kv_heads=1)
    other = KINDS[kind](24, 3, num_kv_heads=1)
    other.load_state_dict(mha.state_dict())  # strict: the same parameters
    assert set(other.state_dict()) == set(mha.state_dict())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_linear_module_is_projections_around_linear_attention(causal, feature_map):
    torch.manual_seed(2)
    m = qkv.LinearMultiHeadAttention(32, 4, num_kv_heads=2, feature_map=feature_map).double()
    x = torch.randn(3, 19, 32, dtype=torch.float64)
    q, k, v = m._project(x, x, x)  # (B, H, T, D), (B, G, T, D) x2
    heads = qkv.linear_attention(q, k, v, feature_map=feature_map, is_causal=causal)
    want = m.out_proj(heads.transpose(1, 2).reshape(3, 19, 32))
    torch.testing.assert_close(m(x, is_causal=causal), want)


def test_linear_module_trace_weights_give_the_heads():
    torch.manual_seed(3)
    m = qkv.LinearMultiHeadAttention(16, 2).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    _, trace = m(x, is_causal=True, return_trace=True)
    torch.testing.assert_close(trace.probs @ trace.v, trace.heads)
    assert trace.probs.shape == (2, 2, 11, 11)
    assert torch.all(trace.probs.triu(1) == 0)  # causal: nothing above the diagonal
    assert trace.backend == "linear"


def test_local_module_equals_dense_window_mask_and_runs_tiled():
    torch.manual_seed(4)
    local = qkv.LocalMultiHeadAttention(32, 4, window=(6, 2)).double()
    mha = qkv.MultiHeadAttention(32, 4).double()
    mha.load_state_dict(local.state_dict())
    x = torch.randn(2, 150, 32, dtype=torch.float64)
    dense = masks.to_dense(masks.sliding_window(6, 2), 1, 1, 150, 150)
    for causal in (False, True):
        out, trace = local(x, is_causal=causal, return_trace=True)
        torch.testing.assert_close(out, mha(x, attn_mask=dense, is_causal=causal))
        assert trace.backend == "tiled"
        assert torch.all(trace.probs[..., 100, :93] == 0) and torch.all(
            trace.probs[..., 100, 103:] == 0
        )


def test_linear_module_favor_is_its_own_buffer_and_redraws_in_training_only():
    m = qkv.LinearMultiHeadAttention(16, 2, feature_map=qkv.Favor(8, 16, seed=3, redraw=1))
    assert "feature_map.projection" in m.state_dict()
    x = torch.randn(1, 5, 16)
    first = m.feature_map.projection.clone()
    m.eval()
    m(x), m(x)
    assert torch.equal(m.feature_map.projection, first)
    m.train()
    m(x), m(x)  # the first training call keeps the projection, the second redraws
    assert not torch.equal(m.feature_map.projection, first)
    assert int(m.feature_map.draws) == 1


def test_linear_module_gradients_are_finite_in_float32():
    torch.manual_seed(5)
    m = qkv.LinearMultiHeadAttention(32, 4, feature_map="favor")
    x = torch.randn(2, 130, 32, requires_grad=True)
    m(x, is_causal=True).square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


def test_kv_cache_buffers_mask_and_capacity():
    cache = qkv.KVCache(2, 3, 4, capacity=5, value_dim=6)
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 6)
    keys, values, key_mask = cache.append(k, v)
    assert key_mask is None and keys.shape == (2, 3, 2, 4) and torch.equal(values, v)
    _, _, key_mask = cache.append(k[:, :, :1], v[:, :, :1], torch.tensor([[True], [False]]))
    assert key_mask.tolist() == [[True, True, True], [True, True, False]]
    with pytest.raises(
        ValueError, match="KVCache is full: it holds 3 of 5 positions and cannot take 3"
    ):
        cache.append(torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 6))
    with pytest.raises(ValueError, match=r"need key \(B, G, T, D\)"):
        cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 6))
    assert cache.reset().position == 0 and cache.key_mask is None


def test_module_decoding_errors():
    mha = qkv.MultiHeadAttention(16, 2)
    cache = mha.new_cache(1, 4)
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="self-attention"):
        mha(x, torch.randn(1, 3, 16), cache=cache)
    with pytest.raises(ValueError, match="attn_mask cannot be combined with a cache"):
        mha(x, attn_mask=torch.ones(3, 3, dtype=torch.bool), cache=cache)
    mha(x, cache=cache)
    with pytest.raises(ValueError, match="KVCache is full"):
        mha(x, cache=cache)
    lin = qkv.LinearMultiHeadAttention(16, 2)
    with pytest.raises(TypeError, match="LinearAttentionState"):
        lin(x, cache=mha.new_cache(1, 4))
    with pytest.raises(ValueError, match="return_trace is not available while decoding"):
        lin(x, cache=lin.new_cache(1), return_trace=True)


def test_efficient_module_argument_errors():
    with pytest.raises(ValueError, match=r"dropout=0.0 only"):
        qkv.LinearMultiHeadAttention(16, 2, dropout=0.1)
    with pytest.raises(ValueError, match="unknown feature_map 'softmax'"):
        qkv.LinearMultiHeadAttention(16, 2, feature_map="softmax")
    with pytest.raises(ValueError, match="built for head_dim=16"):
        qkv.LinearMultiHeadAttention(16, 2, feature_map=qkv.Favor(16))
    lin = qkv.LinearMultiHeadAttention(16, 2)
    x = torch.randn(1, 3, 16)
    for kw in (
        dict(attn_mask=torch.ones(3, 3, dtype=torch.bool)),
        dict(mask_mod=masks.sliding_window(2)),
    ):
        with pytest.raises(ValueError, match="no \\(T, S\\) scores"):
            lin(x, **kw)
    with pytest.raises(ValueError, match="left must be an int >= 0"):
        qkv.LocalMultiHeadAttention(16, 2, window=-1)


@pytest.mark.parametrize("kind", ["linear", "performer", "local"])
def test_efficient_modules_name_a_wrong_input_dtype(kind):
    """Issue 12, item 16a: qkv's message with the fix, not torch's raw matmul error."""
    m = KINDS[kind](16, 2)
    with pytest.raises(
        TypeError,
        match=r"query has dtype torch.int64 but the module's weights "
        r"are torch.float32: .*embed token ids first",
    ):
        m(torch.randint(0, 10, (1, 3)))
    x = torch.randn(1, 3, 16, dtype=torch.float64)
    with pytest.raises(
        TypeError, match=r"query has dtype torch.float64 .* module.to\(torch.float64\)"
    ):
        m(x)
    torch.testing.assert_close(
        m.to(torch.float64)(x), m.float()(x.float()).double(), rtol=1e-5, atol=1e-6
    )
