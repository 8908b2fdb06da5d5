"""A lazy trace refuses to recompute after a tensor its mask_mod/score_mod reads changed in
place (issue 12, item 16d), as it already did for query, key and value."""

import pytest
import torch

import qkv
from qkv import masks

B, H, T, D = 2, 2, 12, 8


def _alibi():
    slopes = torch.tensor([-0.5, -0.25], dtype=torch.float64)
    return dict(score_mod=masks.alibi(slopes)), slopes


def _key_lengths():
    lengths = torch.tensor([5, 9])
    return dict(mask_mod=masks.key_lengths(lengths)), lengths


def _document():
    ids = torch.tensor([[0] * 6 + [1] * 6, [0] * 3 + [1] * 9])
    return dict(mask_mod=masks.document(ids)), ids


def _captured_by_mask_function():
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    return dict(mask_mod=lambda b, h, q, kv: keep[q, kv]), keep


def _captured_by_score_function():
    bias = torch.zeros(T, T, dtype=torch.float64)
    return dict(score_mod=lambda s, b, h, q, kv: s + bias[q, kv]), bias


MODS = {
    "alibi-slopes": _alibi,
    "key_lengths": _key_lengths,
    "document-ids": _document,
    "mask-closure": _captured_by_mask_function,
    "score-closure": _captured_by_score_function,
}


def _change(t):
    if t.dtype == torch.bool:
        t[..., 0] = ~t[..., 0]
    else:
        t.add_(1)


@pytest.mark.parametrize("mod", list(MODS))
def test_reading_after_a_mod_tensor_changed_raises(mod):
    kw, tensor = MODS[mod]()
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, backend="tiled", **kw)
    _, ref = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, backend="reference", **kw)
    torch.testing.assert_close(
        trace.select(rows=[3]).probs, ref.probs[:, :, [3]], rtol=0, atol=1e-12
    )
    _change(tensor)
    with pytest.raises(RuntimeError, match="modified in place"):
        _ = trace.probs
    with pytest.raises(RuntimeError, match="modified in place"):
        trace.select(rows=[3])


def test_weights_read_before_the_change_stay_readable():
    kw, slopes = _alibi()
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, backend="tiled", **kw)
    _, ref = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, backend="reference", **kw)
    probs = trace.probs
    slopes.mul_(2)
    torch.testing.assert_close(trace.probs, ref.probs, rtol=0, atol=1e-12)
    assert trace.probs is probs


def test_mod_tensors_made_under_inference_mode_are_skipped():
    """Inference tensors have no version counter (item 8): the check leaves them out."""
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    with torch.inference_mode():
        kw, _ = _alibi()
        _, trace = qkv.scaled_dot_product_attention(
            q, k, v, return_trace=True, backend="tiled", **kw
        )
    _, ref = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, backend="reference", **kw)
    torch.testing.assert_close(trace.probs, ref.probs, rtol=0, atol=1e-12)
