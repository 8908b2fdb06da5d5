"""The triton backend's kernels against their slow twin, the reference backend, on CPU.

Without a GPU the kernels run under triton's interpreter (``qkv.ops.triton.interpreter()``:
CPU tensors, numpy per block; about 10-20 ms a block, so shapes stay small). Compared by the
tolerance policy (golden: reference in float64; baseline: reference in the kernel's dtype):
outputs, log-sum-exps and gradients over awkward sizes (T, S in 1, 17, 113, 1025), every mask
the kernels evaluate (causal in both alignments, windows, key lengths, documents, GQA,
softcap, ALiBi, custom scale), head dims 32/64 and the padded 59, fully masked rows, block
skipping, and the refusals ``supports(call)`` gives. Nothing of the interpreter leaks out of a
test: the environment variable and triton's settings are checked after.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from conftest import TEST_DEVICE

if TEST_DEVICE != "cpu":
    pytest.skip(
        "these tests run the kernels under triton's CPU interpreter; with "
        "QKV_TEST_DEVICE set, tests/test_cuda.py runs the compiled kernels on the GPU",
        allow_module_level=True,
    )

triton = pytest.importorskip(
    "triton",
    reason="triton is not installed (pip install 'qkv[triton]'): the triton backend's "
    "kernels cannot run, not even under the CPU interpreter",
)

import qkv  # noqa: E402
from qkv import masks as M  # noqa: E402
from qkv.dispatch import select  # noqa: E402
from qkv.ops import AttentionCall, BackendUnsupportedError  # noqa: E402
from qkv.ops.triton import Blocks, TritonBackend, interpreter, triton_attention  # noqa: E402
from qkv.ops.triton.backend import _kernels  # noqa: E402
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance  # noqa: E402

SMALL = Blocks(32, 32, 32, 32, 32, 32)  # many blocks on small shapes: skipping is exercised


def _ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """Packed documents: sorted ids, runs of random lengths."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(1, T // 30), (B, T), generator=g).sort(-1).values


def _cases(B: int, H: int, T: int, S: int) -> list[tuple[str, dict]]:
    """(id, keyword arguments) of the masks and score mods the kernels evaluate."""
    cases = [
        ("none", {}),
        ("causal", dict(is_causal=True)),
        ("bottom-right", dict(mask_mod=M.causal("bottom_right"))),
        ("window", dict(mask_mod=M.sliding_window(40, 7))),
        ("window-bottom-right", dict(mask_mod=M.sliding_window(20, 3, align="bottom_right"))),
        ("keylen", dict(mask_mod=M.key_lengths(torch.tensor([S, max(1, S // 3)])[:B]))),
        ("causal-alibi", dict(is_causal=True, score_mod=M.alibi(H))),
        (
            "window-softcap-scale",
            dict(
                mask_mod=M.sliding_window(30), score_mod=M.softcap(2.0), is_causal=True, scale=0.7
            ),
        ),
        (
            "document-keylen",
            dict(
                mask_mod=M.and_masks(
                    M.document(_ids(B, T, 1), _ids(B, S, 1)), M.key_lengths(max(1, S - 5))
                )
            ),
        ),
    ]
    return cases


def _inputs(B, H, G, T, S, D, Dv=None, seed=0):
    """q, k, v and an output gradient in float64 (each test casts them)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, T, D), (B, G, S, D), (B, G, S, Dv or D), (B, H, T, Dv or D))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    return q, k, v, dout


def _results(q, k, v, dout, dtype, backend, **kw):
    """out, lse, (dq, dk, dv) of one backend in ``dtype``; triton runs under the interpreter."""
    ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    if backend == "triton":
        with interpreter():
            out, trace = qkv.scaled_dot_product_attention(
                *ins, backend="triton", return_trace=True, **kw
            )
            grads = torch.autograd.grad(out, ins, dout.to(dtype))
    else:
        out, trace = qkv.scaled_dot_product_attention(
            *ins, backend=backend, return_trace=True, **kw
        )
        grads = torch.autograd.grad(out, ins, dout.to(dtype))
    return out.detach(), trace.lse, grads


def _check(q, k, v, dout, dtype, name, **kw):
    """Triton in ``dtype`` within the tolerance policy: out and lse 2x, gradients 3x the
    reference's own error in ``dtype`` against the reference in float64."""
    golden = _results(q, k, v, dout, torch.float64, "reference", **kw)
    baseline = _results(q, k, v, dout, dtype, "reference", **kw)
    got = _results(q, k, v, dout, dtype, "triton", **kw)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for i, what in enumerate(("out", "lse")):
        assert_tolerance(
            got[i], golden[i], baseline[i], factor=OUTPUT_FACTOR, name=f"{name} {what}"
        )
    for g_got, g_gold, g_base, what in zip(got[2], golden[2], baseline[2], "qkv"):
        assert_tolerance(g_got, g_gold, g_base, factor=GRAD_FACTOR, name=f"{name} d{what}")
    return got


SIZES = [(1, 1), (17, 17), (113, 113), (17, 113), (113, 17)]


@pytest.mark.parametrize("T,S", SIZES, ids=[f"T{t}-S{s}" for t, s in SIZES])
def test_float32_matches_reference_by_tolerance_policy(T, S):
    B, H, D = 2, 2, 32
    q, k, v, dout = _inputs(B, H, H, T, S, D)
    for name, kw in _cases(B, H, T, S):
        _check(q, k, v, dout, torch.float32, f"B{B}-T{T}-S{S}-H{H}-D{D}-{name}", **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_precision_matches_reference_by_tolerance_policy(dtype):
    """Half inputs: dots of half operands accumulated in float32 (in the interpreter, bfloat16
    operands are widened first: triton 3.9's interpreter multiplies their raw bits)."""
    B, H, T, S, D = 1, 2, 113, 97, 64
    q, k, v, dout = _inputs(B, H, H, T, S, D, seed=1)
    for name, kw in _cases(B, H, T, S)[:2] + _cases(B, H, T, S)[6:8]:
        _check(q, k, v, dout, dtype, f"T{T}-S{S}-D{D}-{name}", **kw)


def test_gqa_sums_each_groups_key_and_value_gradients():
    B, H, G, T, S, D = 2, 4, 2, 33, 47, 32
    q, k, v, dout = _inputs(B, H, G, T, S, D)
    for name, kw in [("gqa", {}), ("gqa-causal-alibi", dict(is_causal=True, score_mod=M.alibi(H)))]:
        _check(q, k, v, dout, torch.float32, name, enable_gqa=True, **kw)


def test_a_second_derivative_is_refused_not_silently_left_out():
    """A gradient penalty through the kernels: once_differentiable let its term vanish from a
    sum that reaches the inputs another way; the backward now refuses a graph by name."""
    q, k, v, _ = _inputs(1, 2, 2, 17, 17, 32)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    with interpreter():
        out = qkv.scaled_dot_product_attention(q, k, v, backend="triton", is_causal=True)
        with pytest.raises(RuntimeError, match="triton backend has no second derivative"):
            (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
            torch.autograd.grad(out.sum() + dq.square().sum(), k)


def test_head_dims_64_59_and_value_dim_unlike_query_dim():
    """D = 64 fills its block; D = 59 and Dv = 40 are padded to 64 inside the kernel."""
    for D, Dv in ((64, 64), (59, 59), (32, 40)):
        q, k, v, dout = _inputs(1, 2, 2, 49, 70, D, Dv)
        _check(
            q, k, v, dout, torch.float32, f"D{D}-Dv{Dv}-window", mask_mod=M.sliding_window(25, 10)
        )


@pytest.mark.parametrize("T,S", [(17, 113), (113, 17)], ids=["T17-S113", "T113-S17"])
def test_and_masks_of_both_alignments_and_two_key_lengths_merge(T, S):
    """Windows of different alignments AND into one band lo <= kv - q <= hi; two key
    lengths (an int and a tensor) into their minimum."""
    q, k, v, dout = _inputs(2, 2, 2, T, S, 32)
    mask_mod = M.and_masks(
        M.causal("bottom_right"),
        M.sliding_window(60, 5),
        M.key_lengths(S - 2),
        M.key_lengths(torch.tensor([S, S // 2])),
    )
    _check(q, k, v, dout, torch.float32, f"T{T}-S{S}-and", mask_mod=mask_mod)


def test_long_sequence_1025_window_and_documents():
    T = S = 1025
    q, k, v, dout = _inputs(1, 1, 1, T, S, 32)
    _check(q, k, v, dout, torch.float32, "T1025-window", mask_mod=M.sliding_window(100, 20))
    _check(
        q,
        k,
        v,
        dout,
        torch.float32,
        "T1025-document",
        mask_mod=M.document(_ids(1, T, 3) * 0 + torch.arange(T) // 300),
    )


def test_small_blocks_and_broadcast_kv_heads_and_3d_inputs():
    """Many blocks per row (FULL, PARTIAL and EMPTY ones), one key head broadcast to all
    query heads without GQA, and (H, T, D) inputs."""
    q, k, v, dout = _inputs(2, 2, 1, 80, 70, 32)
    for name, kw in _cases(2, 2, 80, 70):
        ins = [t.float().requires_grad_() for t in (q, k, v)]
        with interpreter():
            call = AttentionCall.build(*ins, **kw)
            out, _lse = triton_attention(call, blocks=SMALL)
            grads = torch.autograd.grad(out, ins, dout.float())
        ref = [t.requires_grad_() for t in (q.clone(), k.clone(), v.clone())]
        want = qkv.scaled_dot_product_attention(*ref, backend="reference", **kw)
        want_grads = torch.autograd.grad(want, ref, dout)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5, msg=name)
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4, msg=name)
    q3, k3, v3 = (t[0].float() for t in (q, k, v))  # (H, T, D), (1, S, D)
    with interpreter():
        out = qkv.scaled_dot_product_attention(q3, k3, v3, is_causal=True, backend="triton")
    want = qkv.scaled_dot_product_attention(q3, k3, v3, is_causal=True, backend="reference")
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)


def test_fully_masked_rows_output_zero_lse_minus_inf_and_zero_gradients():
    """The mask contract: batch 0 has no key at all; rows 0..11 of bottom-right causal with
    T = 17 > S = 5 see none."""
    q, k, v, dout = _inputs(2, 2, 2, 17, 5, 32)
    for name, kw, dead in [
        ("keylen-0", dict(mask_mod=M.key_lengths(torch.tensor([0, 5]))), (0, slice(None))),
        ("bottom-right", dict(mask_mod=M.causal("bottom_right")), (slice(None), slice(0, 12))),
    ]:
        out, lse, (dq, dk, dv) = _check(q, k, v, dout, torch.float32, name, **kw)
        b, rows = dead
        assert torch.equal(out[b][..., rows, :], torch.zeros_like(out[b][..., rows, :]))
        assert torch.isneginf(lse[b][..., rows]).all()
        assert torch.equal(dq[b][..., rows, :], torch.zeros_like(dq[b][..., rows, :]))
        for t in (out, lse, dq, dk, dv):
            assert not t.isnan().any(), name
        if name == "keylen-0":  # no query of batch 0 attends to any key of it
            assert torch.equal(dk[0], torch.zeros_like(dk[0]))
            assert torch.equal(dv[0], torch.zeros_like(dv[0]))


def test_empty_blocks_are_never_read():
    """Keys past the key length are NaN; their blocks are EMPTY for every query block, so the
    kernels must not load them: the output and gradients stay finite and right."""
    q, k, v, dout = _inputs(1, 2, 2, 80, 128, 32)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[..., 64:, :] = float("nan")  # key blocks 2 and 3 of 32
    v_nan[..., 64:, :] = float("nan")
    kw = dict(mask_mod=M.key_lengths(64))
    ins = [t.float().requires_grad_() for t in (q, k_nan, v_nan)]
    with interpreter():
        out, _lse = triton_attention(AttentionCall.build(*ins, **kw), blocks=SMALL)
        dq, dk, dv = torch.autograd.grad(out, ins, dout.float())
    want = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    assert not dq.isnan().any()
    assert torch.equal(dk[..., 64:, :], torch.zeros_like(dk[..., 64:, :]))
    assert torch.equal(dv[..., 64:, :], torch.zeros_like(dv[..., 64:, :]))


def test_block_lists_follow_the_tiled_classification():
    """The kernels visit exactly the FULL and PARTIAL blocks ``qkv.masks.block_summary``
    reports (the classification the tiled backend skips by), except that the last key block,
    cut short by S = 190, is visited as PARTIAL (its mask checks kv < S)."""
    from qkv.ops.triton.backend import _kernel_mask, _Plan

    B, H, T, S = 2, 1, 200, 190
    mask_mod = M.and_masks(M.sliding_window(50, 10), M.document(_ids(B, T, 2), _ids(B, S, 2)))
    q, k, v = (torch.randn(B, H, n, 32) for n in (T, S, S))
    call = AttentionCall.build(q, k, v, mask_mod=mask_mod)
    with interpreter():
        plan = _Plan(
            B, H, H, T, S, call.scale, _kernel_mask(call), None, None, SMALL, True, call.device
        )
        full_num, full_idx, part_num, part_idx = plan.lists(32, 32)
    state = M.block_summary(mask_mod, B, H, T, S, block=32).state.clone()  # (B, 1, nq, nk)
    counts = {kind: int((state == kind).sum()) for kind in (M.FULL, M.PARTIAL)}
    assert counts[M.FULL] > 0 and counts[M.PARTIAL] > 0 and int((state == M.EMPTY).sum()) > 0
    state[..., -1][state[..., -1] == M.FULL] = M.PARTIAL
    assert int(full_num.sum()) + int(part_num.sum()) == counts[M.FULL] + counts[M.PARTIAL]
    for b in range(B):
        for i in range(state.shape[2]):
            full = full_idx[b, 0, i, : full_num[b, 0, i]].tolist()
            assert full == torch.nonzero(state[b, 0, i] == M.FULL).flatten().tolist()
            part = part_idx[b, 0, i, : part_num[b, 0, i]].tolist()
            assert part == torch.nonzero(state[b, 0, i] == M.PARTIAL).flatten().tolist()


def test_trace_from_the_kernels_lse_matches_reference_weights():
    q, k, v, _ = _inputs(1, 2, 2, 40, 50, 32)
    q, k, v = q.float(), k.float(), v.float()
    kw = dict(mask_mod=M.sliding_window(10, 5), score_mod=M.softcap(3.0))
    with interpreter():
        _, trace = qkv.scaled_dot_product_attention(
            q, k, v, backend="triton", return_trace=True, **kw
        )
        probs = trace.probs
    assert trace.backend == "triton"
    _, ref = qkv.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), backend="reference", return_trace=True, **kw
    )
    torch.testing.assert_close(probs.double(), ref.probs, rtol=0, atol=1e-5)


def _call(**kw):
    shape = kw.pop("shape", (1, 2, 8, 32))
    dtype = kw.pop("dtype", torch.float32)
    q = torch.randn(shape, dtype=dtype)
    return AttentionCall.build(q, q, q, **kw)


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(dropout_p=0.1), "dropout"),
        (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), "attn_mask"),
        (dict(dtype=torch.float64), "float64"),
        (dict(shape=(1, 2, 8, 200)), "D=200"),
        (dict(mask_mod=lambda b, h, q, kv: q >= kv), "not <lambda>"),
        (dict(mask_mod=M.prefix_lm(3)), "prefix_lm"),
        (
            dict(
                mask_mod=M.and_masks(
                    M.document(torch.zeros(8, dtype=torch.long)),
                    M.document(torch.ones(8, dtype=torch.long)),
                )
            ),
            "one document",
        ),
        (dict(score_mod=lambda s, b, h, q, kv: s * 2), "softcap and qkv.masks.alibi"),
        (dict(score_mod=M.alibi(torch.ones(2, requires_grad=True))), "slopes"),
    ],
    ids=[
        "dropout",
        "attn_mask",
        "float64",
        "D200",
        "function-mask",
        "or-mask",
        "two-documents",
        "function-score",
        "alibi-grad",
    ],
)
def test_refusals_say_why(kw, words):
    with interpreter():
        reason = TritonBackend().supports(_call(**kw))
    assert reason is not None and words in reason, reason


def test_cpu_calls_refused_outside_the_interpreter_and_auto_never_picks_it_on_cpu():
    call = _call(is_causal=True)
    reason = TritonBackend().supports(call)
    assert "CUDA" in reason and "interpreter()" in reason
    assert "triton" in qkv.backend_names() and select(call).name != "triton"
    with pytest.raises(BackendUnsupportedError, match="CUDA"):
        qkv.scaled_dot_product_attention(call.query, call.key, call.value, backend="triton")
    with interpreter():
        assert TritonBackend().supports(call) is None
    assert TritonBackend().supports(call) is not None  # the context restores the refusal


def test_interpreter_leaves_no_global_state_behind():
    """TRITON_INTERPRET is set only while the interpreted copy of the kernels is decorated;
    the compiled kernels stay compiled, and triton's knob and environment are as before."""
    before_env = os.environ.get("TRITON_INTERPRET")
    before_knob = triton.knobs.runtime.interpret
    with interpreter():
        interpreted = _kernels(True)
        out = qkv.scaled_dot_product_attention(*(torch.randn(1, 1, 5, 32),) * 3, backend="triton")
    assert out.shape == (1, 1, 5, 32)
    assert os.environ.get("TRITON_INTERPRET") == before_env
    assert triton.knobs.runtime.interpret == before_knob
    assert type(interpreted.attn_fwd).__name__ == "InterpretedFunction"
    if not before_knob:
        assert isinstance(_kernels(False).attn_fwd, triton.runtime.JITFunction)


def _record_launches(monkeypatch, call: AttentionCall) -> list:
    """The kernel launches of ``call``'s forward and backward, recorded instead of run."""
    from qkv.ops.triton import kernels, launch

    launches = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

    recorders = types.SimpleNamespace(
        **{n: Recorder(getattr(kernels, n)) for n in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")}
    )
    monkeypatch.setattr(launch, "_kernels", lambda interpret: recorders)  # read there
    with interpreter():  # CPU tensors stand in for CUDA ones: only their dtypes matter here
        out, _ = triton_attention(call)
        torch.autograd.grad(out, (call.query, call.key, call.value), torch.ones_like(out))
    return launches


def test_kernels_compile_for_hopper_without_a_gpu(monkeypatch):
    """Every kernel, with every feature switched on, compiles for sm_90 (TTIR -> PTX -> cubin
    with triton's bundled ptxas) under the GPU's own specialisation at the default blocks, and
    its shared memory fits an H100 (227 KiB a block; a GPU with less gets fewer stages at
    launch): what the interpreter cannot check (it runs any Python triton accepts)."""
    specialize = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    from qkv.ops.triton.backend import default_blocks

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend to compile for")
    B, H, G, T, S = 2, 4, 2, 300, 280
    for dtype, D, kw in [
        (
            torch.bfloat16,
            128,
            dict(
                mask_mod=M.and_masks(
                    M.sliding_window(100, 20, align="bottom_right"),
                    M.document(_ids(B, T), _ids(B, S)),
                    M.key_lengths(torch.tensor([200, 280])),
                ),
                score_mod=M.softcap(20.0),
            ),
        ),
        (torch.float16, 64, dict(is_causal=True, score_mod=M.alibi(H))),
    ]:
        q, k, v = (
            torch.randn(B, n, L, D, dtype=dtype, requires_grad=True)
            for n, L in ((H, T), (G, S), (G, S))
        )
        call = AttentionCall.build(q, k, v, enable_gqa=True, **kw)
        blocks = default_blocks(D, banded=True)  # both cases have an upper band
        launches = _record_launches(monkeypatch, call)
        names = [fn.__name__ for fn, _, _ in launches]
        assert names == ["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"]
        for which, (fn, args, kwargs) in enumerate(launches):
            signature, constexprs, attrs = {}, dict(kwargs, UPCAST=False), {}
            for i, (name, value) in enumerate(zip(fn.arg_names, args)):
                kind, attr = specialize(BaseBackend, value, False, True, True)[:2]
                signature[name] = kind
                if kind == "constexpr":
                    constexprs[name] = value
                elif attr == "D":
                    attrs[(i,)] = [["tt.divisibility", 16]]
            signature.update({n: "constexpr" for n in constexprs})
            signature = {n: signature[n] for n in fn.arg_names}
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs),
                target=GPUTarget("cuda", 90, 32),
                options=dict(
                    num_warps=blocks.warps[which],
                    num_stages=blocks.stages[which],
                    enable_fp_fusion=True,
                ),
            )
            assert "ptx" in compiled.asm and compiled.metadata.shared <= 232448, fn.__name__
