"""The NaN/inf contract's first pass by one Triton launch per tensor (``ops/nonfinite_triton.py``),
CUDA's in place of 11 tensor ops, run here under triton's interpreter: the same zeroed copies
and the same bad rows as the tensor ops, bit for bit, and the same outputs of whole calls."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TEST_DEVICE
from routes import force_host_reads, force_native_rows

if TEST_DEVICE != "cpu":
    pytest.skip(
        "these tests run the kernel under triton's CPU interpreter (tests/test_cuda.py runs "
        "the calls on the GPU)",
        allow_module_level=True,
    )
pytest.importorskip("triton", reason="triton is not installed: the kernel cannot run")

import qkv
from qkv.ops import AttentionCall, nonfinite, nonfinite_triton
from qkv.ops.triton import interpreter

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _spoiled(shape, dtype, seed=0):
    """Random values with a NaN, a +inf and a -inf in three rows, and one row all NaN."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    flat = t.view(-1, shape[-1])
    n = flat.shape[0]
    for row, col, value in (
        (0, -1, math.nan),
        (n // 2, 0, math.inf),
        (n - 1, 1 % shape[-1], -math.inf),
    ):
        flat[row, col] = value
    if n > 3:
        flat[1] = math.nan
    return t.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 37, 24), (1, 1, 5, 1), (2, 1, 300, 59), (4, 130, 64)])
def test_copies_and_flags_are_the_tensor_ops(shape, dtype):
    x = _spoiled(shape, dtype)
    bad = (~torch.isfinite(x).all(-1)).float()
    with interpreter():
        assert nonfinite_triton.takes(x)
        flags = torch.full(shape[:-1], 7.0)  # (every entry is written)
        copy = nonfinite_triton.copy_rows(x, flags)
        kept = torch.zeros(shape[:-1])
        kept.view(-1)[2] = 1.0  # a row flagged before: kept with ``accumulate``
        same = nonfinite_triton.copy_rows(x, kept, copy=False, accumulate=True)
    assert torch.equal(copy, x.nan_to_num(0.0, 0.0, 0.0)) and copy.data_ptr() != x.data_ptr()
    assert torch.equal(flags, bad)
    assert same is x
    want = bad.clone()
    want.view(-1)[2] = 1.0
    assert torch.equal(kept, want)


def test_what_it_takes():
    x = torch.randn(2, 4, 8)
    assert not nonfinite_triton.takes(x)  # the CPU, outside the interpreter
    with interpreter():
        assert nonfinite_triton.takes(x, None, x.double())
        assert not nonfinite_triton.takes(x.transpose(-2, -1))  # not contiguous
        assert not nonfinite_triton.takes(x[..., :0])  # empty
        assert not nonfinite_triton.takes(torch.randn(2, nonfinite_triton.MAX_E + 1))
        assert not nonfinite_triton.takes(x.int())
        assert not nonfinite_triton.takes(x.clone().requires_grad_())
        with torch.no_grad():
            assert nonfinite_triton.takes(x.clone().requires_grad_())


CASES = {
    "causal": dict(is_causal=True),
    "window": dict(mask_mod=qkv.masks.sliding_window(6)),
    "document": dict(mask_mod=qkv.masks.document(torch.tensor([[0] * 9 + [1] * 12 + [2] * 9]))),
    "key-lengths": dict(mask_mod=qkv.masks.key_lengths(torch.tensor([30, 11]))),
    "no-keys": dict(mask_mod=qkv.masks.key_lengths(torch.tensor([0, 17]))),  # batch 0 none
    "window-both": dict(mask_mod=qkv.masks.sliding_window(4, 3)),
    "bottom-right": dict(mask_mod=qkv.masks.causal("bottom_right")),
    "window-lengths": dict(  # rows past batch 1's 11 keys: empty ranges (lo > its length)
        mask_mod=qkv.masks.and_masks(
            qkv.masks.sliding_window(4), qkv.masks.key_lengths(torch.tensor([30, 11]))
        )
    ),
}
RANGES = (
    "causal",
    "window",
    "key-lengths",
    "no-keys",
    "window-both",
    "bottom-right",
    "window-lengths",
)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_a_call_guarded_by_triton_is_the_tensor_ops_call(monkeypatch, case, dtype, gqa):
    """The GPU's way (no host reads, no fused C++ passes), masked inference with NaN/inf in
    q, k and v: the guard by the kernel holds the tensor ops' copies and flags; rows that see
    ranges of keys are set by the second kernel; the whole call's output is the same bits."""
    force_host_reads(monkeypatch, free=False)
    force_native_rows(monkeypatch, on=False)
    B, H, T, S, D = 2, 4, 30, 30, 16
    if case == "bottom-right":
        T = 21  # T < S: bottom-right differs from top-left
    G = 2 if gqa else H
    q = _spoiled((B, H, T, D), dtype, 0)
    k, v = (_spoiled((B, G, S, D), dtype, seed) for seed in (1, 2))
    kw = {**CASES[case], **(dict(enable_gqa=True) if gqa else {})}
    backend = "torch"  # (its kernel keeps no contract of its own; the masks made dense)
    call = AttentionCall.build(q, k, v, **kw)
    made, set_rows = [], []
    by_kernel, rows_by_kernel = nonfinite._prepare_by_triton, nonfinite._nan_rows_by_triton
    monkeypatch.setattr(nonfinite, "_prepare_by_triton", lambda c: made.append(1) or by_kernel(c))
    monkeypatch.setattr(
        nonfinite, "_nan_rows_by_triton", lambda *a: set_rows.append(1) or rows_by_kernel(*a)
    )
    with torch.no_grad(), interpreter():
        guard = nonfinite.prepare(call)
        got = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    assert made == [1, 1], "the calls did not take the kernel's way"
    assert set_rows == ([1] if case in RANGES else []), "rows set by the other way"
    monkeypatch.setattr(nonfinite_triton, "takes", lambda *t: False)
    with torch.no_grad():
        want_guard = nonfinite.prepare(call)
        want = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    assert guard.check == want_guard.check == "eager"
    for a, b in zip(
        (guard.call.query, guard.call.key, guard.call.value, guard.bad.keys, guard.bad.rows),
        (want_guard.call.query, want_guard.call.key, want_guard.call.value)
        + (want_guard.bad.keys, want_guard.bad.rows),
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().any() and not got.isnan().all()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_a_kernel_triton_cannot_run_leaves_the_contract_to_the_tensor_ops(monkeypatch):
    """Should triton fail to build or launch the kernel on a GPU it does not know, qkv says so
    once and keeps the contract by the tensor ops: the same output."""
    force_host_reads(monkeypatch, free=False)
    force_native_rows(monkeypatch, on=False)
    monkeypatch.setattr(nonfinite_triton, "_REFUSED", [])

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(nonfinite_triton, "copy_rows", broken)
    q, k, v = (_spoiled((1, 2, 20, 8), torch.float32, seed) for seed in range(3))
    with torch.no_grad():
        want = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="torch")
        with interpreter():
            with pytest.warns(RuntimeWarning, match="no kernel image.*the tensor ops keep"):
                got = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="torch")
            assert not nonfinite_triton.takes(q)  # (refused for the process: no second try)
            again = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="torch")
    for out in (got, again):
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", ["causal", "window", "document"])
def test_a_gradient_call_guarded_by_triton_is_the_tensor_ops_call(monkeypatch, case):
    """With a gradient wanted, the zeroed copies and bad rows by the kernel (its gradient
    passed through, ``_ZeroNonfiniteRows``): the output and the gradients of q, k and v are
    the tensor ops' way's, bits and NaN alike."""
    force_host_reads(monkeypatch, free=False)
    force_native_rows(monkeypatch, on=False)
    q, k, v = (_spoiled((2, 2, 30, 16), torch.float32, seed) for seed in range(3))
    kw = CASES[case]
    made = []
    apply = nonfinite._ZeroNonfiniteRows.apply
    monkeypatch.setattr(
        nonfinite._ZeroNonfiniteRows, "apply", lambda *a: made.append(a[-1]) or apply(*a)
    )

    def run():
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = qkv.scaled_dot_product_attention(*ins, backend="torch", **kw)
        out.nan_to_num().square().sum().backward()
        return [out.detach()] + [t.grad for t in ins]

    with interpreter():
        got = run()
    assert made == [True], "the call did not take the kernel's way"
    monkeypatch.setattr(nonfinite_triton, "takes", lambda *t: False)
    want = run()
    assert made == [True], "(the tensor ops' way takes no such copies)"
    assert got[0].isnan().any() and not got[0].isnan().all()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
