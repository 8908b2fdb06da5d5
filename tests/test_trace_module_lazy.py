"""A module's trace is as lazy as the functional one (issue 12, item 15).

MultiHeadTrace used to read trace.probs when built (the whole (B, H, T, S) weights: 2.5 GB
at T=8192) and dropped the trace's row-wise recomputation, so select() recomputed every
score. Shown by behaviour: the largest tensor any op makes stays below one (T, S) matrix.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import qkv
import qkv.dispatch


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel] + sizes)
        return out


def _rows_of_softmax(q, k, scale, rows, keep=None):
    """Weights of some query rows, straight from the formula. q (..., T, D), k (..., S, D)."""
    scores = q[..., rows, :].double() @ k.double().transpose(-2, -1) * scale  # (..., nr, S)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1)


def test_long_module_trace_builds_no_full_weights(monkeypatch):
    """A call whose weights exceed the one-pass limit (lowered here to keep the test short;
    2^27 by default) keeps its trace lazy even without a gradient."""
    T, C, H = 4096, 32, 2
    monkeypatch.setattr(qkv.dispatch, "ONE_PASS_MAX_ELEMENTS", H * T * T - 1)
    mha = qkv.MultiHeadAttention(C, H)
    x = torch.randn(1, T, C)
    with torch.no_grad(), LargestTensor() as seen:
        _out, trace = mha(x, return_trace=True)
        rows = [4095, 0, 2047]
        part = trace.select(heads=[1], rows=rows)
    assert seen.numel < T * T  # nothing (T, S)-sized: no weights, no scores were computed
    assert part.probs.shape == (1, 1, 3, T)
    expected = _rows_of_softmax(trace.q[:, [1]], trace.k[:, [1]], (C // H) ** -0.5, rows)
    torch.testing.assert_close(part.probs.double(), expected, rtol=0, atol=1e-6)
    assert trace.lse.shape == (1, H, T)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_module_select_equals_rows_of_full_probs(causal):
    mha = qkv.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64)
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    keep = torch.rand(3, 11) < 0.8
    keep[:, 0] = True
    _, trace = mha(x, key_mask=keep, is_causal=causal, return_trace=True)
    part = trace.select(batch=[2, 0], heads=[3, 1], rows=[10, 4])
    _, again = mha(x, key_mask=keep, is_causal=causal, return_trace=True)
    full = again.probs  # (3, 4, 11, 11)
    torch.testing.assert_close(
        part.probs, full[[2, 0]][:, [3, 1]][:, :, [10, 4]], rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        part.scores, again.scores[[2, 0]][:, [3, 1]][:, :, [10, 4]], rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        full @ trace.v.repeat_interleave(2, 1), trace.heads, rtol=0, atol=1e-12
    )


def test_unbatched_module_trace_selects_lazily(monkeypatch):
    """The unbatched module trace drops the batch dim of 1 (index=0) and keeps select lazy
    (weights this small would be formed in one pass: the limit is lowered to keep it lazy)."""
    monkeypatch.setattr(qkv.dispatch, "ONE_PASS_MAX_ELEMENTS", 0)
    T, C, H = 512, 16, 2
    mha = qkv.MultiHeadAttention(C, H, dtype=torch.float64)
    x = torch.randn(T, C, dtype=torch.float64)
    with torch.no_grad(), LargestTensor() as seen:
        _, trace = mha(x, return_trace=True)
        part = trace.select(heads=1, rows=range(T - 1, T - 4, -1))
    assert seen.numel < T * T
    assert trace.lse.shape == (H, T) and part.probs.shape == (1, 3, T)
    expected = _rows_of_softmax(trace.q[1], trace.k[1], (C // H) ** -0.5, [T - 1, T - 2, T - 3])
    torch.testing.assert_close(part.probs[0], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(trace.probs[1, [T - 1, T - 2, T - 3]], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_self_attention_trace_selects_rows(batched):
    """SelfAttention has no heads: its (B, T, S) trace selects batch elements as 'heads'."""
    sa = qkv.SelfAttention(8, 4, dtype=torch.float64)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    x = x if batched else x[1]
    _, trace = sa(
        x,
        key_mask=torch.ones(x.shape[:-1], dtype=torch.bool).index_fill(
            -1, torch.tensor([3]), False
        ),
        return_trace=True,
    )
    part = trace.select(heads=[1], rows=[8, 0]) if batched else trace.select(rows=[8, 0])
    q, k = (trace.q[1], trace.k[1]) if batched else (trace.q, trace.k)
    keep = torch.arange(9) != 3
    expected = _rows_of_softmax(q, k, 0.5, [8, 0], keep)
    torch.testing.assert_close(part.probs.reshape(2, 9), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("lazy", [False, True], ids=["one-pass", "lazy"])
def test_decode_step_trace_stays_readable_after_the_cache_appends(lazy, monkeypatch):
    """Issue 25: the KV cache writes in place, so a (lazy) trace of one decoding step raised
    "modified in place" once the next step appended. A traced step keeps its own copy of the
    cached keys and values; its weights equal the formula's on the keys of that step."""
    if lazy:
        monkeypatch.setattr(qkv.dispatch, "ONE_PASS_MAX_ELEMENTS", 0)
    mha = qkv.MultiHeadAttention(16, 2, num_kv_heads=1).eval()
    cache = mha.new_cache(batch_size=1, capacity=16)
    x = torch.randn(1, 9, 16)
    with torch.no_grad():
        mha(x[:, :5], cache=cache)  # the prompt
        _, trace = mha(x[:, 5:6], cache=cache, return_trace=True)  # step 6 sees keys 0..5
        for t in range(6, 9):
            mha(x[:, t : t + 1], cache=cache)  # later steps overwrite nothing it saw, but bump
        probs = trace.probs  # the cache's version counter
    assert probs.shape == (1, 2, 1, 6)
    want = _rows_of_softmax(trace.q, trace.k, (16 // 2) ** -0.5, [0])
    torch.testing.assert_close(probs.double(), want, rtol=0, atol=1e-6)
