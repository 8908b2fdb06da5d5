"""A user's default device is not where qkv makes its own tensors.

``torch.set_default_device("cuda")`` (or ``with torch.device("cuda"):``) sends every factory call
without a device there. qkv's host-side bookkeeping (the tiled backend's layout of key lengths
and documents, masks' grids, scalars) must still be made where it is read, and the call's own
tensors where its inputs are. On the H200 of the eighteenth session, 104 calls of the core
files under ``QKV_TEST_DEVICE=cuda`` failed with "Expected all tensors to be on the same
device, cuda:0 and cpu". Here the foreign default is ``meta``: a CPU tensor meeting a meta one
raises just as it meets a CUDA one, so the CPU finds every such factory call.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks

B, H, T, S, D = 2, 4, 9, 9, 8


def _inputs(dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for n in (T, S, S))
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v


def _key_padding():
    m = torch.ones(B, 1, 1, S, dtype=torch.bool)
    m[0, ..., 6:] = False  # element 0: its last 3 keys are padding
    return m


def _draw(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator(device="cpu").manual_seed(seed))


def _cases():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]] * B)
    return {
        "plain": {},
        "causal": dict(is_causal=True),
        "key-padding": dict(attn_mask=_key_padding()),
        "bool-TS": dict(attn_mask=_draw(T, S, seed=1) > -0.5),
        "float-mask": dict(attn_mask=_draw(B, 1, T, S, seed=2)),
        "window": dict(mask_mod=masks.sliding_window(3)),
        "document": dict(mask_mod=masks.document(ids)),
        "document+padding": dict(mask_mod=masks.document(ids), attn_mask=_key_padding()),
        "sinks": dict(sinks=torch.linspace(-1.0, 1.0, H)),
        "alibi": dict(score_mod=masks.alibi(H)),
    }


CASES = list(_cases())


def _call(q, k, v, backend, kw, trace=False):
    return qkv.scaled_dot_product_attention(q, k, v, backend=backend, return_trace=trace, **kw)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["tiled", "torch", "reference", "auto"])
def test_calls_under_a_foreign_default_device_give_the_same_outputs(backend, case):
    q, k, v = _inputs()
    try:
        want = _call(q, k, v, backend, _cases()[case])
    except qkv.ops.BackendUnsupportedError:
        pytest.skip(f"{backend} does not take {case}")
    kw = _cases()[case]  # new masks: no layout or plan kept from the call above
    with torch.device("meta"):
        got = _call(q, k, v, backend, kw)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["plain", "causal", "key-padding", "window", "document", "sinks"])
def test_traces_and_gradients_under_a_foreign_default_device(case):
    def run(q, k, v, kw):
        out, trace = _call(q, k, v, "auto", kw, trace=True)
        (out.square().sum() + trace.probs.sum()).backward()
        return out, trace.probs, q.grad, k.grad, v.grad

    want = run(*_inputs(grad=True), _cases()[case])
    args = *_inputs(grad=True), _cases()[case]
    with torch.device("meta"):
        got = run(*args)
    for a, b in zip(got, want):
        assert a.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_nonfinite_keys_a_mask_hides_stay_hidden_under_a_foreign_default_device():
    q, k, v = _inputs()
    k[0, :, 7] = float("nan")
    v[0, :, 8] = float("inf")
    want = _call(q, k, v, "auto", dict(attn_mask=_key_padding()))
    mask = _key_padding()
    with torch.device("meta"):
        got = _call(q, k, v, "auto", dict(attn_mask=mask))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_module_decoding_with_a_cache_under_a_foreign_default_device():
    torch.manual_seed(0)
    mha = qkv.nn.MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, 6, 16)

    def decode(cache):
        outs = [mha(x[:, :4], cache=cache, is_causal=True)]
        outs += [mha(x[:, i : i + 1], cache=cache) for i in range(4, 6)]
        return torch.cat(outs, 1)

    def new_cache():
        return qkv.nn.KVCache(batch_size=2, num_kv_heads=2, head_dim=8, capacity=8, device="cpu")

    with torch.no_grad():
        want = decode(new_cache())
        cache = new_cache()
        with torch.device("meta"):
            got = decode(cache)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_neighborhood_mask_under_a_foreign_default_device():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    want = qkv.scaled_dot_product_attention(q, k, v, mask_mod=masks.neighborhood((3, 3), (4, 4)))
    mod = masks.neighborhood((3, 3), (4, 4))
    with torch.device("meta"):
        got = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mod)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
