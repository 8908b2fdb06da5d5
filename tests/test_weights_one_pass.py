"""Output and weights in one pass (``auto`` + ``return_trace`` when no gradient is wanted).

The one-pass path (``qkv.ops.reference.attention_with_weights``) must give what the other
paths give: the reference's output, weights and log-sum-exp in float64, the tolerance policy
in half precision, the mask contract on rows with no key, and a trace whose ``select`` and
``scores`` behave as a lazy trace's. It must not be taken when a gradient is wanted, when a
backend is named, or when the weights would be too large to hold.
"""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
from routes import force_native_softmax
from torch import nn

import qkv
from qkv import dispatch
from qkv import masks as M
from qkv.ops import reference, softmax_rows
from qkv.ops.reference import _lse_of, _softmax_rows_, masked_softmax
from qkv.testing import OUTPUT_FACTOR, assert_tolerance


def _cases(B, H, T, S):
    """(name, kwargs) of calls covering every way a mask reaches the scores."""
    lengths = torch.tensor([0, S // 2])[-B:]  # batch element 0 has no key at all
    dense_bool = torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(1)) > 0.3
    dense_float = torch.randn(
        1, H, T, S, dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )
    return [
        ("none", {}),
        ("causal", dict(is_causal=True)),
        ("window", dict(mask_mod=M.sliding_window(7, 3))),
        ("key-lengths", dict(mask_mod=M.key_lengths(lengths))),
        ("dense-bool", dict(attn_mask=dense_bool)),
        ("dense-float", dict(attn_mask=dense_float)),
        ("alibi-causal", dict(score_mod=M.alibi(H), is_causal=True)),
        ("softcap-window", dict(score_mod=M.softcap(2.0), mask_mod=M.sliding_window(20))),
    ]


def _one_pass(q, k, v, **kw):
    with torch.no_grad():
        out, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, **kw)
    assert trace.backend == "reference" and not callable(trace._probs), "not the one-pass path"
    return out, trace


@pytest.mark.parametrize("T,S", [(1, 1), (37, 53), (300, 300)])
def test_one_pass_equals_reference_float64(T, S):
    B, H, D = 2, 3, 8
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (T, S, S))
    for name, case_kw in _cases(B, H, T, S):
        kw = case_kw
        if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
            kw = dict(kw, attn_mask=kw["attn_mask"].to(q.dtype))
        out, trace = _one_pass(q, k, v, **kw)
        ref, rtrace = qkv.scaled_dot_product_attention(
            q, k, v, return_trace=True, backend="reference", **kw
        )
        torch.testing.assert_close(out, ref, msg=name)
        torch.testing.assert_close(trace.probs, rtrace.probs, msg=name)
        torch.testing.assert_close(trace.lse, rtrace.lse, msg=name)  # -inf where no key
        torch.testing.assert_close(trace.scores, rtrace.scores, msg=name)
        if name == "key-lengths":  # the element with no key: output 0, weights 0, lse -inf
            assert out[0].abs().max() == 0 and trace.probs[0].abs().max() == 0
            assert torch.isneginf(trace.lse[0]).all()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"]
)
def test_one_pass_tolerance_policy(dtype):
    """Half inputs are multiplied in float32 and rounded once: within 2x the error of plain
    math in the same dtype, for the output and the weights."""
    B, H, T, S, D = 1, 4, 200, 260, 32
    golden_in = [torch.randn(B, H, n, D, dtype=torch.float64) for n in (T, S, S)]
    for name, case_kw in _cases(B, H, T, S):
        kw = case_kw
        if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
            kw = dict(kw, attn_mask=kw["attn_mask"].to(dtype))
        golden = qkv.scaled_dot_product_attention(
            *golden_in, return_trace=True, backend="reference", **kw
        )
        baseline = qkv.scaled_dot_product_attention(
            *(t.to(dtype) for t in golden_in), return_trace=True, backend="reference", **kw
        )
        out, trace = _one_pass(*(t.to(dtype) for t in golden_in), **kw)
        assert out.dtype == trace.probs.dtype == dtype
        assert_tolerance(out, golden[0], baseline[0], factor=OUTPUT_FACTOR, name=f"{name} out")
        assert_tolerance(
            trace.probs,
            golden[1].probs,
            baseline[1].probs,
            factor=OUTPUT_FACTOR,
            name=f"{name} probs",
        )


def test_one_pass_gqa_leading_dims_and_select():
    """GQA and 5-D inputs; select() gives the stored weights and recomputed scores of the
    rows asked for."""
    q = torch.randn(2, 3, 4, 50, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 3, 2, 70, 8, dtype=torch.float64),
        torch.randn(2, 3, 2, 70, 5, dtype=torch.float64),
    )
    out, trace = _one_pass(q, k, v, enable_gqa=True, is_causal=True)
    ref, rtrace = qkv.scaled_dot_product_attention(
        q, k, v, return_trace=True, backend="reference", enable_gqa=True, is_causal=True
    )
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(trace.probs, rtrace.probs)
    q, k, v = q[0], k[0], v[0]  # (B, H, T, D) with a mask_mod
    kw = dict(enable_gqa=True, mask_mod=M.sliding_window(9))
    _, trace = _one_pass(q, k, v, **kw)
    _, rtrace = qkv.scaled_dot_product_attention(
        q, k, v, return_trace=True, backend="reference", **kw
    )
    part = trace.select(batch=[1], heads=[0, 3], rows=[0, 17, 49])
    rpart = rtrace.select(batch=[1], heads=[0, 3], rows=[0, 17, 49])
    torch.testing.assert_close(part.probs, rpart.probs)
    torch.testing.assert_close(part.scores, rpart.scores)


def test_one_pass_is_not_taken_when_it_should_not_be(monkeypatch):
    """A wanted gradient, a named backend, dropout, or weights above the size limit keep the
    kernel with its lazy trace; the gradient still flows."""
    q, k, v = (torch.randn(1, 2, 64, 8, requires_grad=True) for _ in range(3))
    out, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
    assert trace.backend != "reference" and callable(trace._probs)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    with torch.no_grad():
        _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, backend="torch")
        assert trace.backend == "torch"
        monkeypatch.setattr(dispatch, "ONE_PASS_MAX_ELEMENTS", 2 * 64 * 64 - 1)
        _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
        assert trace.backend != "reference" and callable(trace._probs)
        monkeypatch.setattr(dispatch, "ONE_PASS_MAX_ELEMENTS", 2 * 64 * 64)
        _one_pass(q, k, v)
    # no grad wanted although grad mode is on: the inputs do not require it
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    _, trace = qkv.scaled_dot_product_attention(qd, kd, vd, return_trace=True)
    assert trace.backend == "reference"


@pytest.mark.parametrize("way", ["native", "torch-ops"])
def test_in_place_softmax_equals_masked_softmax(monkeypatch, way):
    """The softmax written over its own input equals masked_softmax, with rows of -inf, a
    row with no key, huge and tiny scores, rows of 37 and 40 keys (a vector's tail), on a
    block of several heads; a row holding NaN or +inf is NaN throughout, as torch's softmax
    gives it. Both ways: the one pass of C++ (``ops/softmax_rows.py``) and torch's ops (as
    where no C++ compiler is found)."""
    force_native_softmax(monkeypatch, on=way == "native")
    ran = []
    native = softmax_rows.softmax_rows_
    monkeypatch.setattr(softmax_rows, "softmax_rows_", lambda *a: ran.append(native(*a)) or ran[-1])
    g = torch.Generator().manual_seed(0)
    for dtype, S in itertools.product((torch.float32, torch.float64), (37, 40)):
        scores = torch.randn(2, 11, S, generator=g, dtype=dtype) * 30
        scores[0, 2] = float("-inf")  # no key
        scores[1, 5, ::2] = float("-inf")
        scores[0, 7] = 1e30
        scores[1, 8, 3] = 1e4
        scores[1, 9, 33] = float("nan")
        scores[0, 10, 36] = float("inf")
        want, want_lse = masked_softmax(scores.clone())
        score_max = torch.empty(2, 11, dtype=dtype)
        _softmax_rows_(scores, score_max)
        assert scores[1, 9].isnan().all() and scores[0, 10].isnan().all()  # (as torch's)
        assert (scores[0, 2] == 0).all() and score_max[0, 2] == float("-inf")
        rows = torch.ones(2, 11, dtype=torch.bool)
        rows[1, 9] = rows[0, 10] = False  # (masked_softmax keeps a +inf row's finite keys 0)
        torch.testing.assert_close(scores[rows], want[rows])
        torch.testing.assert_close(_lse_of(score_max, scores.amax(-1))[rows], want_lse[rows])
    assert ran == [way == "native"] * 4


@pytest.mark.parametrize("budget", [3 * 53, 2 * 37 * 53], ids=["rows-of-3", "two-heads"])
def test_blocks_of_rows_and_of_heads_equal_reference(monkeypatch, budget):
    """Blocks of 3 rows of one head, or of two whole heads: the same output, weights and
    log-sum-exp as the reference, float64 and (by the tolerance policy) bfloat16."""
    monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", budget)
    B, H, T, S, D = 2, 3, 37, 53, 8
    golden_in = [torch.randn(B, H, n, D, dtype=torch.float64) for n in (T, S, S)]
    for name, case_kw in _cases(B, H, T, S):
        kw = case_kw
        if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
            kw = dict(kw, attn_mask=kw["attn_mask"].to(torch.float64))
        monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", budget)
        out, trace = _one_pass(*golden_in, **kw)
        ref, rtrace = qkv.scaled_dot_product_attention(
            *golden_in, return_trace=True, backend="reference", **kw
        )
        torch.testing.assert_close(out, ref, msg=name)
        torch.testing.assert_close(trace.probs, rtrace.probs, msg=name)
        torch.testing.assert_close(trace.lse, rtrace.lse, msg=name)
        if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
            kw = dict(kw, attn_mask=kw["attn_mask"].to(torch.bfloat16))
        half = [t.to(torch.bfloat16) for t in golden_in]
        monkeypatch.setattr(reference, "_BLOCK_ELEMENTS", 8 * budget)  # half: an eighth of it
        base, btrace = qkv.scaled_dot_product_attention(
            *half, return_trace=True, backend="reference", **kw
        )
        out, trace = _one_pass(*half, **kw)
        assert_tolerance(out, ref, base, factor=OUTPUT_FACTOR, name=f"{name} out")
        assert_tolerance(
            trace.probs, rtrace.probs, btrace.probs, factor=OUTPUT_FACTOR, name=f"{name} probs"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_module_weights_in_inference_equal_torch_module(dtype):
    """qkv.MultiHeadAttention with return_trace in inference gives torch's module's output and
    per-head weights (need_weights=True, average_attn_weights=False), from one pass."""
    torch.manual_seed(0)
    tm = nn.MultiheadAttention(64, 4, batch_first=True, dtype=dtype).eval()
    qm = qkv.MultiHeadAttention.from_torch(tm).eval()
    x = torch.randn(2, 90, 64, dtype=dtype)
    with torch.no_grad():
        want, want_w = tm(x, x, x, need_weights=True, average_attn_weights=False)
        out, trace = qm(x, return_trace=True)
    assert trace.backend == "reference"
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(trace.probs, want_w, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_output_is_rounded_once(dtype, cpu_route):
    """In half precision the output is the float32 weights times the values, rounded once
    (issue 37): within half an ulp of the output's dtype of float64 attention on the same
    inputs, plus float32's error, on every CPU route. The rounded weights times the values
    (what the output was) are not: a second rounding, up to an ulp."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g).to(dtype) for n in (70, 90, 90))
    with torch.no_grad():
        out, trace = _one_pass(q, k, v, mask_mod=M.sliding_window(20))
    scores = (q.double() @ k.double().transpose(-2, -1)) / 4  # (2, 3, 70, 90)
    i, j = torch.arange(70).view(-1, 1), torch.arange(90)
    keep = (j >= i - 20) & (j <= i)  # (70, 90): sliding_window(20), written out
    exact = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v.double()  # (2, 3, 70, 16)
    assert out.dtype == dtype and trace.probs.dtype == dtype
    half_ulp = exact.abs() * torch.finfo(dtype).eps / 2 + 1e-5
    assert ((out.double() - exact).abs() <= half_ulp).all()
    twice = (trace.probs.double() @ v.double()).to(dtype)  # the rounded weights' product
    assert not ((twice.double() - exact).abs() <= half_ulp).all()


def test_float_lse_is_computed_when_read_and_right():
    """float32/float64 one-pass traces compute the log-sum-exp when it is first read (a pass
    over the weights a caller who never reads it does not pay): the reference's lse, for
    every mask kind, through select, a module's trace and a pickle."""
    B, H, T, S, D = 2, 3, 37, 53, 8
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (T, S, S))
    for name, case_kw in _cases(B, H, T, S):
        kw = case_kw
        if "attn_mask" in kw and kw["attn_mask"].is_floating_point():
            kw = dict(kw, attn_mask=kw["attn_mask"].to(q.dtype))
        _, trace = _one_pass(q, k, v, **kw)
        assert callable(trace._lse), name
        _, rtrace = qkv.scaled_dot_product_attention(
            q, k, v, return_trace=True, backend="reference", **kw
        )
        part = trace.select(batch=[1], heads=[2, 0], rows=[5, 0])
        torch.testing.assert_close(
            part.lse, rtrace.select(batch=[1], heads=[2, 0], rows=[5, 0]).lse
        )
        copy = pickle.loads(pickle.dumps(trace))  # computed now: no function is pickled
        torch.testing.assert_close(copy.lse, rtrace.lse, msg=name)
        torch.testing.assert_close(trace.lse, rtrace.lse, msg=name)
        assert not callable(trace._lse)
    torch.manual_seed(0)
    tm = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    qm = qkv.MultiHeadAttention.from_torch(tm).eval()
    x = torch.randn(20, 32)  # unbatched: the trace picks batch element 0
    with torch.no_grad():
        _, trace = qm(x, return_trace=True)
    assert callable(trace._lse) and repr(trace).endswith("lse(4, 20), backend='reference')")
    scores = trace.scores.double()
    torch.testing.assert_close(trace.lse.double(), torch.logsumexp(scores, -1), rtol=0, atol=1e-5)


def test_lazy_lse_after_the_weights_or_inputs_change_in_place():
    """The lazy lse reads the weights it made, which are the caller's: changed in place
    before it is read, it is computed from the inputs instead (still right); with the inputs
    changed too it refuses, as the recomputed scores do. Inference tensors cannot tell a
    change, so their lse is computed at once."""
    q, k, v = (torch.randn(2, 3, 30, 8) for _ in range(3))
    want = torch.logsumexp(q.double() @ k.double().transpose(-2, -1) / 8**0.5, -1)
    _, trace = _one_pass(q, k, v)
    trace.probs.mul_(0.5)  # a caller rescaling the weights
    torch.testing.assert_close(trace.lse.double(), want, rtol=0, atol=1e-5)
    _, trace = _one_pass(q, k, v)
    trace.probs.zero_()
    k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        _ = trace.lse
    k.sub_(1.0)
    with torch.inference_mode():
        _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
    assert trace.backend == "reference" and not callable(trace._lse)
    torch.testing.assert_close(trace.lse.double(), want, rtol=0, atol=1e-5)


def test_half_lse_is_formed_in_the_pass():
    """Half weights are rounded: their largest one gives the lse to 2^-9 only, so a half
    call's lse is formed in the pass from the float32 weights (not deferred)."""
    q, k, v = (torch.randn(1, 2, 40, 16).to(torch.bfloat16) for _ in range(3))
    _, trace = _one_pass(q, k, v)
    assert not callable(trace._lse) and trace.lse.dtype == torch.float32
    want = torch.logsumexp(q.double() @ k.double().transpose(-2, -1) / 4, -1)
    torch.testing.assert_close(trace.lse.double(), want, rtol=0, atol=1e-5)
