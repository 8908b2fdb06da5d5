"""The NaN/inf contract in tensor ops, eagerly (ops/nonfinite.py): checked against float64
math written here, for the ways the contract is now kept without reading on the host.

* A call with no mask and no gradient wanted checks its output alone: every row of a head
  that holds a bad key is NaN, every other row exact.
* Any other call without gradient, where a read on the host is free (the CPU), runs on q,
  k, v as they are and is checked by three sums read after its kernel; when that finds a
  NaN/inf it runs again the next way.
* Any other call runs on q, k, v with their NaN/inf zeroed and sets NaN on the rows that may
  attend a bad key (and on bad query rows that may attend some key), counted from the masks
  (ops/key_counts.py); gradients reach no bad input and come from no NaN row.
"""

from __future__ import annotations

import math

import pytest
import torch
from routes import force_host_reads, force_native_rows

import qkv
from qkv import masks
from qkv.ops import AttentionCall
from qkv.ops.nonfinite import allowed

B, H, T, S, D = 2, 3, 11, 13, 8


@pytest.fixture(autouse=True, params=["cpu-reads", "no-reads", "no-reads-fused"])
def _host_reads(request, monkeypatch):
    """Each test runs every way of keeping the contract (tests/routes.py): checked after the
    kernel by a read on the host, as on the CPU on request; in tensor ops only, as on CUDA;
    and by the CPU's fused row passes (``nonfinite_rows``), the default on the CPU."""
    force_host_reads(monkeypatch, free=request.param == "cpu-reads")
    force_native_rows(monkeypatch, on=request.param == "no-reads-fused")


def _golden(q, k, v, ok):
    """float64 attention of the finite inputs under the allowed pairs ``ok`` (B, H, T, S);
    rows with no key 0."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(D)
    scores = scores.masked_fill(~ok, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v.double()


def _inputs(g, grad=False):
    return [torch.randn(B, H, n, D, generator=g).requires_grad_(grad) for n in (T, S, S)]


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled", "reference"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_no_mask_no_grad_sets_every_row_of_a_bad_head_nan(backend, bad):
    g = torch.Generator().manual_seed(0)
    q, k, v = _inputs(g)
    want = _golden(q, k, v, torch.ones(B, H, T, S, dtype=torch.bool))
    v[1, 2, 5, 3] = bad  # head (1, 2): every row may attend key 5
    q[0, 1, 4, 0] = bad  # row (0, 1, 4)
    out = qkv.scaled_dot_product_attention(q, k, v, backend=backend)
    hit = torch.zeros(B, H, T, dtype=torch.bool)
    hit[1, 2] = True
    hit[0, 1, 4] = True
    assert out[hit].isnan().all()
    torch.testing.assert_close(out[~hit].double(), want[~hit], rtol=1e-5, atol=1e-6)


def _mask_case(name, g):
    if name == "none":
        return {}
    if name == "document":
        ids = torch.randint(0, 3, (B, max(T, S)), generator=g)
        return {"mask_mod": masks.document(ids[:, :T], ids[:, :S])}
    if name == "key_lengths":
        return {"mask_mod": masks.key_lengths(torch.tensor([4, S]))}
    if name == "window":
        return {"mask_mod": masks.sliding_window(2, 1, align="bottom_right")}
    if name == "causal":
        return {"is_causal": True}
    if name == "bool-mask":
        return {"attn_mask": torch.rand(B, 1, T, S, generator=g) < 0.5}
    if name == "float-mask":
        bias = torch.randn(T, S, generator=g)
        return {"attn_mask": bias.masked_fill(torch.rand(T, S, generator=g) < 0.5, -math.inf)}
    raise ValueError(name)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("backend", ["auto", "torch", "tiled", "reference"])
@pytest.mark.parametrize(
    "case", ["none", "document", "key_lengths", "window", "causal", "bool-mask", "float-mask"]
)
def test_bad_keys_reach_exactly_the_rows_that_may_attend_them(case, backend, grad):
    """A NaN in some keys and values and in some queries: rows that may attend a bad key, and
    bad query rows with a key, are NaN; every other row equals float64 math on the clean
    inputs, and so do the gradients, which are 0 on every bad input row."""
    g = torch.Generator().manual_seed(1)
    kw = _mask_case(case, g)
    q, k, v = _inputs(g, grad)
    call = AttentionCall.build(q, k, v, **kw)
    if backend == "torch" and qkv.dispatch.get_backend("torch").supports(call) is not None:
        pytest.skip("torch's SDPA takes no mask_mod")
    ok = allowed(call)  # (B, H, T, S)
    bias = kw.get("attn_mask")
    with torch.no_grad():
        bad_k, bad_v, bad_q = (torch.zeros(B, H, n, dtype=torch.bool) for n in (S, S, T))
        bad_k[0, 1, [2, 7]] = True
        bad_v[1, 0, 9] = True
        bad_q[1, 2, 3] = True
    inputs = [x.detach().clone() for x in (q, k, v)]
    for x, bad in zip(inputs, (bad_q, bad_k, bad_v)):
        x[bad] = float("nan")
        x.requires_grad_(grad)
    out = qkv.scaled_dot_product_attention(*inputs, backend=backend, **kw)
    bad_keys = bad_k | bad_v  # (B, H, S)
    hit = (ok & bad_keys[:, :, None, :]).any(-1) | (bad_q & ok.any(-1))  # (B, H, T)
    clean = [
        x.detach().double().masked_fill(b.unsqueeze(-1), 0.0).requires_grad_(grad)
        for x, b in zip((q, k, v), (bad_q, bad_k, bad_v))
    ]
    scores = clean[0] @ clean[1].transpose(-2, -1) / math.sqrt(D)
    if bias is not None and bias.dtype != torch.bool:
        scores = scores + bias.double()
    scores = scores.masked_fill(~ok, float("-inf"))
    want = torch.softmax(scores, -1).nan_to_num(0.0) @ clean[2]
    assert out[hit].isnan().all(), case
    torch.testing.assert_close(out[~hit].double(), want[~hit].detach(), rtol=1e-5, atol=1e-6)
    if not grad:
        return
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)  # a NaN row passes no gradient: as if its dout were 0
    want.backward(dout.double().masked_fill(hit.unsqueeze(-1), 0.0))
    for x, c, bad in zip(inputs, clean, (bad_q, bad_k, bad_v)):
        assert torch.isfinite(x.grad).all() and (x.grad[bad] == 0).all()
        torch.testing.assert_close(x.grad.double(), c.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled", "reference"])
@pytest.mark.parametrize("shape", ["key-padding", "one-row"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_that_hide_keys_from_every_row_alike(backend, shape, kind):
    """A key padding mask (or any mask of a one-row call, a decoding step's): a NaN in a
    hidden key changes nothing; in a shown key it makes the head's rows NaN; a NaN query row
    is NaN where it has a key and exactly 0 where it has none."""
    g = torch.Generator().manual_seed(2)
    Tq = 1 if shape == "one-row" else T
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (Tq, S, S))
    shown = torch.ones(B, 1, 1, S, dtype=torch.bool)
    shown[0, 0, 0, 9:] = False  # batch 0: keys 9.. hidden
    shown[1] = False  # batch 1: no key at all
    if shape == "one-row":
        shown = shown.expand(B, H, 1, S).clone()
        shown[0, 2, 0, 3] = False  # one head hides key 3 too
    mask = shown if kind == "bool" else torch.zeros(shown.shape).masked_fill(~shown, -math.inf)
    ok = shown.expand(B, H, Tq, S)
    want = _golden(q, k, v, ok)
    k[0, 1, 11, 0] = math.nan  # hidden from every row of head (0, 1)
    v[0, 2, 3, 1] = math.inf  # hidden in the one-row case, shown in the key-padding one
    q[1, 0, 0, 2] = math.nan  # batch 1 has no key: its rows stay 0
    q[0, 0, 0, 2] = math.nan  # batch 0, head 0 row 0 has keys: NaN
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    hit = torch.zeros(B, H, Tq, dtype=torch.bool)
    hit[0, 0, 0] = True
    if shape == "key-padding":
        hit[0, 2] = True  # every row of head (0, 2) may attend key 3
    assert out[hit].isnan().all()
    assert (out[1] == 0).all()
    torch.testing.assert_close(out[~hit].double(), want[~hit], rtol=1e-5, atol=1e-6)
