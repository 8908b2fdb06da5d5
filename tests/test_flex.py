"""The flex backend (compiled FlexAttention) under qkv's contract, on the CPU (issue 38).

The CPU has Flex's inference kernel only, and each new mask compiles C++ for about ten
seconds on 2 cores, so the compiled cases here are few and each checks much: several masks
against float64 math written apart from qkv (tests/reference64.py), fully masked rows, NaN in
keys a row may not see, the block-mask cache. The block lists themselves are checked without
compiling, against FlexAttention's own ``create_block_mask`` on the same mask. On CUDA,
tests/test_cuda.py runs the backend forward and backward.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim.
"""

from __future__ import annotations

import pytest
import torch
from reference64 import (
    attention64,
    causal_allowed,
    document_allowed,
    elementwise_mask,
    key_lengths_allowed,
    softcap64,
    window_allowed,
)

import qkv
from qkv import dispatch
from qkv import masks as M
from qkv.ops import AttentionCall, BackendUnsupportedError
from qkv.ops import flex as flex_ops
from qkv.testing import OUTPUT_FACTOR, assert_tolerance

pytestmark = pytest.mark.skipif(
    flex_ops.flex_available("cpu") is not None, reason=str(flex_ops.flex_available("cpu"))
)


def _inputs(B, H, G, T, S, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _check(dtype, q, k, v, allowed, score=None, **kw):
    """flex in ``dtype`` against float64 math, by the tolerance policy (baseline: the
    reference backend in ``dtype``)."""
    gqa = dict(enable_gqa=True) if q.shape[1] != k.shape[1] else {}
    with torch.no_grad():
        got = qkv.scaled_dot_product_attention(
            *(t.to(dtype) for t in (q, k, v)), backend="flex", **gqa, **kw
        )
        base = qkv.scaled_dot_product_attention(
            *(t.to(dtype) for t in (q, k, v)), backend="reference", **gqa, **kw
        )
    golden = attention64(q, k, v, allowed=allowed, score_mod=score)
    assert got.dtype == dtype and not got.isnan().any()
    assert_tolerance(got, golden, base, factor=OUTPUT_FACTOR, name=f"flex {dtype}")
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_window_softcap_gqa_odd_lengths(dtype):
    """B2-H4-G2-T300-S300-D32: a causal window with softcap (two block kinds: full and
    partial), GQA, a length that is no multiple of Flex's 128-blocks."""
    B, H, G, T, D = 2, 4, 2, 300, 32
    q, k, v = _inputs(B, H, G, T, T, D)
    allowed = window_allowed(B, H, T, T, 70, 0)
    _check(
        dtype,
        q,
        k,
        v,
        allowed,
        score=lambda s: softcap64(s, 3.0),
        mask_mod=M.sliding_window(70),
        score_mod=M.softcap(3.0),
    )


def test_documents_key_lengths_a_plain_function_and_dead_rows():
    """B2-H2-T257-S257-D16, float32: documents AND key lengths AND a plain function (Flex's own
    kind, per element); batch 1's lengths leave some rows nothing (documents that begin
    after its last key): those rows give exactly 0. NaN in keys that no row may see
    changes nothing."""
    B, H, T, D = 2, 2, 257, 16
    q, k, v = _inputs(B, H, H, T, T, D, seed=3)
    ids = torch.randint(0, 5, (B, T), generator=torch.Generator().manual_seed(1)).sort(-1).values
    lengths = torch.tensor([T, 100])

    def every_third(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) % 3 != 1

    allowed = (
        document_allowed(B, H, ids, ids)
        & key_lengths_allowed(B, H, T, T, lengths)
        & elementwise_mask(every_third, B, H, T, T)
    )
    dead = ~allowed.any(-1)  # (B, H, T)
    assert dead.any(), "the case must hold rows with no key"
    k[1, :, 150:] = float("nan")  # beyond batch 1's length: no row may see them
    v[1, :, 150:] = float("inf")
    mask = M.and_masks(M.document(ids), M.key_lengths(lengths), every_third)
    got = _check(torch.float32, q, k, v, allowed, mask_mod=mask)
    assert (got[dead] == 0).all()


def test_causal_trace_and_the_block_mask_cache(monkeypatch):
    """is_causal with a trace: weights from the CPU kernel's output (Flex gives no lse on the
    CPU); the second call with an equal mask reuses the block mask; ids changed in place give
    a new one, and the new answer."""
    B, H, T, D = 1, 2, 200, 16
    q, k, v = _inputs(B, H, H, T, T, D, seed=5)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    with torch.no_grad():
        out, trace = qkv.scaled_dot_product_attention(
            q32, k32, v32, is_causal=True, backend="flex", return_trace=True
        )
    golden = attention64(q, k, v, allowed=causal_allowed(B, H, T, T))
    assert trace.backend == "flex"
    assert (out.double() - golden).abs().max() < 1e-5
    assert (trace.probs.sum(-1) - 1).abs().max() < 1e-5
    assert (trace.probs.triu(1) == 0).all()

    built = []
    real = flex_ops._build_block_mask
    monkeypatch.setattr(flex_ops, "_build_block_mask", lambda *a: built.append(1) or real(*a))
    flex_ops.clear_block_mask_cache()
    ids = torch.zeros(B, T, dtype=torch.int64)
    ids[:, 120:] = 1
    with torch.no_grad():
        first = qkv.scaled_dot_product_attention(
            q32, k32, v32, mask_mod=M.document(ids), backend="flex"
        )
        again = qkv.scaled_dot_product_attention(
            q32, k32, v32, mask_mod=M.document(ids), backend="flex"
        )
        assert len(built) == 1 and torch.equal(first, again)
        ids[:, 60:] = 1  # in place: the first document now ends at 60
        moved = qkv.scaled_dot_product_attention(
            q32, k32, v32, mask_mod=M.document(ids), backend="flex"
        )
    assert len(built) == 2
    golden = attention64(q, k, v, allowed=document_allowed(B, H, ids, ids))
    assert (moved.double() - golden).abs().max() < 1e-5


@pytest.mark.parametrize(
    "case",
    ["window-T300-S257", "document-T300-S300", "keylen-causal-T129-S129", "function-T64-S200"],
)
def test_block_lists_allow_what_flex_own_block_mask_allows(case):
    """The block mask built from qkv's block classification allows, pair by pair, what
    FlexAttention's create_block_mask of the same function allows (no compile)."""
    from torch.nn.attention.flex_attention import create_block_mask

    kind, Ts, Ss = case.split("-")[0], case.split("-")[-2], case.split("-")[-1]
    T, S, B, H = int(Ts[1:]), int(Ss[1:]), 2, 3
    ids = torch.randint(0, 4, (B, T), generator=torch.Generator().manual_seed(2)).sort(-1).values
    mods = {
        "window": M.sliding_window(50, 20),
        "document": M.document(ids),
        "keylen": M.and_masks(M.causal(), M.key_lengths(torch.tensor([100, 17]))),
        "function": M.as_mask_mod(lambda b, h, q_idx, kv_idx: (kv_idx * 3 + h) % 7 < 3),
    }
    call = AttentionCall.build(
        torch.randn(B, H, T, 16),
        torch.randn(B, H, S, 16),
        torch.randn(B, H, S, 16),
        mask_mod=mods[kind],
    )
    ours = flex_ops._build_block_mask(call.mask_mod, B, H, T, S, torch.device("cpu"))
    theirs = create_block_mask(flex_ops._flex_mask(call.mask_mod), B, H, T, S, device="cpu")
    assert torch.equal(_dense(ours, B, H, T, S), _dense(theirs, B, H, T, S)), (
        f"{case}: block masks differ"
    )


def _dense(block_mask, B, H, T, S):
    """The pairs a BlockMask lets through: its blocks, then its mask_mod inside partial ones
    (evaluated per element, as Flex does; full blocks need no mask_mod, and it is True there
    for the masks above).

    Shape:
        -> ``(B, H, T, S)``, bool.
    """
    blocks = block_mask.to_dense().bool()  # (B?, H?, nq, nk): partial or full
    bq, bk = block_mask.BLOCK_SIZE
    cover = blocks.expand(B, H, -1, -1).repeat_interleave(bq, 2).repeat_interleave(bk, 3)
    return cover[:, :, :T, :S] & elementwise_mask(block_mask.mask_mod, B, H, T, S)


def test_refusals_say_why_and_auto_leaves_flex_to_cuda():
    """What the flex backend declines, each with its reason, and auto never takes a CPU call
    there (its first call compiles C++; the tiled backend is the CPU's)."""
    q = torch.randn(1, 2, 8, 16)
    cases = {
        "requires grad": (dict(), True, "no backward"),
        "dense mask": (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), False, "attn_mask"),
        "sinks": (dict(sinks=torch.zeros(2)), False, "sinks"),
        "dropout": (dict(dropout_p=0.1), False, "dropout"),
    }
    for kw, grad, says in cases.values():
        qq = q.clone().requires_grad_(grad)
        with pytest.raises(BackendUnsupportedError, match=says):
            qkv.scaled_dot_product_attention(qq, q, q, backend="flex", **kw)
    with pytest.raises(BackendUnsupportedError, match="float64"):
        qkv.scaled_dot_product_attention(q.double(), q.double(), q.double(), backend="flex")
    odd = torch.randn(1, 2, 8, 24)
    with pytest.raises(BackendUnsupportedError, match="D=24"):
        qkv.scaled_dot_product_attention(odd, odd, odd, backend="flex")
    call = AttentionCall.build(q, q, q, mask_mod=M.sliding_window(3))
    assert dispatch.check_backends(call)["flex"] is None
    assert dispatch.select(call).name != "flex"


def _no_build(*args, **kwargs):
    """What compiled Flex raised on an H200 for GQA at odd lengths (torch 2.11): inductor's
    error, not the call's."""
    from torch._inductor.exc import InductorError

    raise InductorError(RuntimeError("No valid triton configs"), None)


def test_a_kernel_torch_cannot_build_is_declined_and_auto_goes_on(monkeypatch):
    """When inductor fails to build Flex for a kind of call, the flex backend says so (named:
    BackendFailedError with the compiler's words), declines that kind from then on with the
    reason, and ``auto`` (here made to prefer flex on the CPU, as it does on CUDA) runs the
    same call by the next backend with a warning, the output the tiled backend's."""
    from qkv.ops.base import BackendFailedError
    from qkv.ops.flex import FlexBackend

    monkeypatch.setattr(flex_ops, "_failed", {})
    monkeypatch.setattr(flex_ops, "_built_kinds", set())
    builds = []
    monkeypatch.setattr(
        flex_ops, "_compiled", lambda: lambda *a, **k: builds.append(1) or _no_build()
    )
    q, k, v = _inputs(2, 4, 2, 97, 113, 64, seed=4)
    q, k, v = (t.float() for t in (q, k, v))
    kw = dict(mask_mod=M.sliding_window(40), enable_gqa=True)
    with pytest.raises(BackendFailedError, match=r"could not be built.*No valid triton configs"):
        qkv.scaled_dot_product_attention(q, k, v, backend="flex", **kw)
    with pytest.raises(BackendUnsupportedError, match=r"backend 'flex' cannot take.*could not be"):
        qkv.scaled_dot_product_attention(q, k, v, backend="flex", **kw)
    assert len(builds) == 1  # the second call was declined before any build
    other = dict(mask_mod=M.sliding_window(40), enable_gqa=True)
    monkeypatch.setattr(flex_ops, "_failed", {})  # (the kind forgotten: auto tries flex anew)
    monkeypatch.setattr(FlexBackend, "auto_prefers", lambda self, call: True)
    try:
        dispatch._selected.clear()
        call = AttentionCall.build(q, k, v, **other)
        assert dispatch.select(call).name == "flex"
        with pytest.warns(
            RuntimeWarning, match=r"could not be built.*auto runs such calls by tiled"
        ):
            got = qkv.scaled_dot_product_attention(q, k, v, **other)
        assert len(builds) == 2
        want = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **other)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert "could not be built" in dispatch.check_backends(call)["flex"]
        again = qkv.scaled_dot_product_attention(q, k, v, **other)  # no warning, no build
        torch.testing.assert_close(again, want, rtol=0, atol=0)
        assert len(builds) == 2
    finally:
        dispatch._selected.clear()  # (choices made while auto preferred flex here)


def test_a_backward_torch_cannot_build_is_found_before_the_call_runs(monkeypatch):
    """The backward compiles at its first use, after a forward that could not go elsewhere:
    the first call of a kind that wants a gradient runs a trial backward first (on detached
    copies), and a failure there is the kind's failure. The real call's inputs get no grad."""
    from qkv.ops.base import BackendFailedError

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q * 2

        @staticmethod
        def backward(ctx, grad):
            _no_build()

    monkeypatch.setattr(flex_ops, "_failed", {})
    monkeypatch.setattr(flex_ops, "_built_kinds", set())
    monkeypatch.setattr(
        flex_ops, "flex_attention_call", lambda call: (Fails.apply(call.query), None)
    )
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    call = AttentionCall.build(q, q.detach(), q.detach(), mask_mod=M.sliding_window(3))
    with pytest.raises(BackendFailedError, match="No valid triton configs"):
        flex_ops._built(call)
    assert q.grad is None and list(flex_ops._failed.values()) == [
        flex_ops._failed[flex_ops._kind(call)]
    ]
    fine = AttentionCall.build(q.detach(), q.detach(), q.detach(), mask_mod=M.sliding_window(3))
    out, _ = flex_ops._built(fine)  # inference: no trial, the call itself
    torch.testing.assert_close(out, q.detach() * 2)
