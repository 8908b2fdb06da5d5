"""The tiled backend against its slow twin, the reference backend, by the tolerance policy.

Awkward sizes (1, 17, 97, 113, 1025 and the tile boundaries 2047/2048/2049), every mask_mod and
score_mod, both inner kernels (``flash``: torch's CPU kernel per chunk; ``matmul``: plain ops),
gradients, fully masked rows and blocks, non-contiguous inputs, GQA, block skipping, dispatch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import TEST_DEVICE

import qkv
from qkv import masks as M
from qkv.ops.call import AttentionCall
from qkv.ops.tiled import MIN_FULL_RUN, _plan, tiled_attention
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance

# "flash" is torch's CPU flash kernel per chunk: on another device tiled has only "matmul",
# and the plans that rely on it (diagonal groups, documents as unmasked calls) are CPU plans
CPU_PLANS = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="plans of the CPU flash inner kernel")
INNERS = [pytest.param("flash", marks=CPU_PLANS), "matmul"]


def _ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """Packed documents: sorted ids, runs of random lengths."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(1, T // 40), (B, T), generator=g).sort(-1).values


def _mods(B, H, T, S):
    """(name, mask_mod, score_mod, is_causal) cases valid for these sizes."""
    cases = [
        ("none", None, None, False),
        ("causal", None, None, True),
        ("bottom-right", M.causal("bottom_right"), None, False),
        ("window", M.sliding_window(40, 7), None, False),
        ("keylen", M.key_lengths(torch.tensor([max(0, S // 3), S])[-B:]), None, False),
        ("prefix-alibi", M.prefix_lm(min(5, S)), M.alibi(H), False),
        ("window-softcap", M.sliding_window(30), M.softcap(2.0), True),
    ]
    if T == S:
        cases.append(("document", M.document(_ids(B, T)), None, False))
    return cases


def _run(q, k, v, backend, **kw):
    return qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)


SIZES = [
    (1, 1),
    (17, 17),
    (97, 113),
    (113, 97),
    (1025, 1025),
    (17, 1025),
    (2047, 2047),
    (2048, 2048),
    (2049, 2049),
]


@pytest.mark.parametrize("T,S", SIZES, ids=[f"T{t}-S{s}" for t, s in SIZES])
def test_tiled_matches_reference_float64(T, S):
    B, H, D = (2, 2, 16) if T * S < 1 << 20 else (1, 2, 8)
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64) for n in (T, S, S))
    for name, mm, sm, causal in _mods(B, H, T, S):
        kw = dict(mask_mod=mm, score_mod=sm, is_causal=causal)
        out = _run(q, k, v, "tiled", **kw)
        ref = _run(q, k, v, "reference", **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=f"{name}")


_POLICY_SHAPE = (1, 2, 32)  # B, H, D of the tolerance-policy cases


@functools.cache
def _policy_inputs(T: int, S: int) -> tuple[torch.Tensor, ...]:
    """q, k, v in float64 for the tolerance-policy cases of these sizes."""
    B, H, D = _POLICY_SHAPE
    g = torch.Generator().manual_seed(T * 10_000 + S)
    return tuple(torch.randn(B, H, n, D, dtype=torch.float64, generator=g) for n in (T, S, S))


@functools.cache
def _reference_results(T: int, S: int, dtype: torch.dtype) -> dict[str, tuple]:
    """Per case of ``_mods``: the reference's output and q/k/v gradients in ``dtype``, from
    ``_policy_inputs``. The golden (float64) results are the same for every (dtype, inner) of a
    size and the baseline's for both inner kernels: computed once each (the float64 reference at
    T = 2049 was 3/4 of the test's time, six times over)."""
    B, H, _ = _POLICY_SHAPE
    results = {}
    for name, mm, sm, causal in _mods(B, H, T, S):
        ins = [t.to(dtype).requires_grad_() for t in _policy_inputs(T, S)]
        out = _run(*ins, "reference", mask_mod=mm, score_mod=sm, is_causal=causal)
        grads = torch.autograd.grad(out, ins, torch.ones_like(out) / out.shape[-2])
        results[name] = (out.detach(), grads)
    return results


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"]
)
@pytest.mark.parametrize(
    "T,S", [(97, 113), (1025, 1025), (2049, 2049)], ids=["T97-S113", "T1025", "T2049"]
)
def test_tiled_tolerance_policy(T, S, dtype, inner):
    """Outputs within 2x and gradients within 3x the error of plain math in the same dtype.
    T = 2049: with 2049 keys a merged tile's rows x keys pass CHUNK_ELEMENTS, so the units split
    (at 1025 they do not)."""
    B, H, _ = _POLICY_SHAPE
    golden, baseline = _reference_results(T, S, torch.float64), _reference_results(T, S, dtype)
    for name, mm, sm, causal in _mods(B, H, T, S):
        if inner == "flash" and sm is not None and not sm.additive:
            continue
        ins = [t.to(dtype).requires_grad_() for t in _policy_inputs(T, S)]
        call = AttentionCall.build(*ins, is_causal=causal, mask_mod=mm, score_mod=sm)
        out = tiled_attention(call, inner=inner)[0]
        grads = torch.autograd.grad(out, ins, torch.ones_like(out) / out.shape[-2])
        (golden_out, golden_grads), (base_out, base_grads) = golden[name], baseline[name]
        assert_tolerance(
            out.detach(), golden_out, base_out, factor=OUTPUT_FACTOR, name=f"{name} out"
        )
        for i, g in enumerate("qkv"):
            assert_tolerance(
                grads[i], golden_grads[i], base_grads[i], factor=GRAD_FACTOR, name=f"{name} d{g}"
            )


@pytest.mark.parametrize("inner", INNERS)
def test_flash_and_matmul_inner_kernels_agree_with_gradients(inner):
    """The fast inner kernel and its readable twin give the reference's values and gradients."""
    B, H, T, S, D = 2, 3, 300, 260, 16
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True) for n in (T, S, S))
    for name, mm, sm, causal in _mods(B, H, T, S):
        if inner == "flash" and sm is not None and not sm.additive:
            continue
        call = AttentionCall.build(q, k, v, is_causal=causal, mask_mod=mm, score_mod=sm)
        out = tiled_attention(call, inner=inner, block_q=64, block_k=32)[0]
        ref = _run(q, k, v, "reference", is_causal=causal, mask_mod=mm, score_mod=sm)
        g = torch.randn_like(ref)
        for a, b in zip(
            torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=name)


def test_gradcheck_tiled_with_score_mod_tensors_and_float_mask():
    """Gradients reach q, k, v, a float attn_mask and the tensors a score_mod reads."""
    T, S = 9, 11
    q = torch.randn(1, 2, T, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, S, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, S, 3, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 1, T, S, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    table = torch.randn(2, T + S, dtype=torch.float64, requires_grad=True)

    def rel(score, b, h, qi, ki):  # a learned relative-position bias read from a captured table
        return score + table[h, ki - qi + T]

    def f(q, k, v, bias, slopes, table):
        call = AttentionCall.build(
            q,
            k,
            v,
            bias,
            mask_mod=M.sliding_window(4, 2),
            score_mod=lambda s, b, h, qi, ki: rel(M.alibi(slopes)(s, b, h, qi, ki), b, h, qi, ki),
        )
        return tiled_attention(call, block_q=4, block_k=3)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, bias, slopes, table))


def test_fully_masked_rows_and_blocks_give_zero_and_zero_grads():
    """Rows with no key (whole key blocks skipped, or every key of a visited chunk masked)."""
    B, H, T, S, D = 2, 2, 300, 200, 8
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(B, H, n, D, dtype=dtype, requires_grad=True) for n in (T, S, S))
        # batch 0 has no key at all; queries past 150 see only keys past S (none)
        mm = M.and_masks(M.key_lengths(torch.tensor([0, S])), M.sliding_window(T, 0))
        mm = M.or_masks(mm, lambda b, h, qi, ki: (qi > 1000) & (ki >= 0))
        shifted = M.and_masks(M.key_lengths(torch.tensor([0, S])), lambda b, h, qi, ki: qi < 150)
        for mod in (mm, shifted):
            out = _run(q, k, v, "tiled", mask_mod=mod)
            assert not out.isnan().any()
            assert out[0].abs().max() == 0
            (out.float() * torch.randn(out.shape)).sum().backward()
            for t in (q, k, v):
                assert not t.grad.isnan().any()
            assert q.grad[0].abs().max() == 0 and k.grad[0].abs().max() == 0
            assert v.grad[0].abs().max() == 0
            if mod is shifted:
                assert out[1, :, 150:].abs().max() == 0 and q.grad[1, :, 150:].abs().max() == 0
            for t in (q, k, v):
                t.grad = None


def test_non_contiguous_inputs_and_gqa():
    B, T, S, H, G, D = 2, 130, 150, 4, 2, 16
    q = torch.randn(B, T, H, D, dtype=torch.float64).transpose(1, 2)  # (B, H, T, D) view
    k = torch.randn(B, S, G, D, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, G, D, S, dtype=torch.float64).transpose(-1, -2)
    assert not q.is_contiguous() and not v.is_contiguous()
    for mm in (None, M.sliding_window(20, 20), M.document(_ids(B, T), _ids(B, S, seed=1))):
        kw = dict(mask_mod=mm, enable_gqa=True)
        torch.testing.assert_close(
            _run(q, k, v, "tiled", **kw), _run(q, k, v, "reference", **kw), rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("kind", ["bool", "float", "keypad-bool", "float-with-causal"])
def test_dense_masks_and_leading_dims(kind):
    """Dense attn_mask on tiled: broadcast shapes, 3-D and 5-D inputs, combined with is_causal."""
    T, S = 140, 131
    q = torch.randn(2, 3, 2, T, 8, dtype=torch.float64)
    k = torch.randn(2, 1, 2, S, 8, dtype=torch.float64)
    v = torch.randn(2, 1, 2, S, 8, dtype=torch.float64)
    mask = {
        "bool": torch.rand(T, S) < 0.3,
        "float": torch.randn(3, 1, T, S, dtype=torch.float64),
        "keypad-bool": torch.arange(S).view(1, 1, 1, 1, S)
        < torch.tensor([3, 70]).view(2, 1, 1, 1, 1),
        "float-with-causal": torch.randn(1, T, 1, dtype=torch.float64),
    }[kind]
    kw = dict(attn_mask=mask, is_causal=kind == "float-with-causal")
    torch.testing.assert_close(
        _run(q, k, v, "tiled", **kw), _run(q, k, v, "reference", **kw), rtol=0, atol=1e-12
    )
    q3, k3, v3 = q[0, 0], k[0, 0], v[0, 0]  # (H, T, D)
    kw3 = dict(attn_mask=torch.rand(T, S) < 0.5)
    torch.testing.assert_close(
        _run(q3, k3, v3, "tiled", **kw3), _run(q3, k3, v3, "reference", **kw3), rtol=0, atol=1e-12
    )


def _visited(call: AttentionCall, bq=128, bk=64):
    """The plan, and the (query, key) pairs it computes: all, and those computed with a mask."""
    plan = _plan(call, *call.BH, None, bq, bk, call.dtype)
    pairs = sum(u.n * u.tq * (b - a) for u in plan.units for a, b, _ in u.chunks)
    masked = sum(u.n * u.tq * (b - a) for u in plan.units for a, b, m in u.chunks if m)
    return plan, pairs, masked


@CPU_PLANS
def test_empty_blocks_are_skipped_and_full_blocks_unmasked():
    T = 4096
    q = k = v = torch.randn(1, 1, T, 8)
    plan, pairs, _ = _visited(AttentionCall.build(q, k, v, mask_mod=M.sliding_window(100)))
    assert pairs <= T * (100 + 128 + 64)  # per tile: window + tile + one block
    # the band's tiles past the first are one diagonal group: one kernel call for them all
    assert [(u.t0, u.n, u.chunks) for u in plan.units] == [
        (0, 1, ((0, 128, True),)),
        (128, T // 128 - 1, ((-128, 128, True),)),
    ]
    plan, _, _ = _visited(AttentionCall.build(q, k, v, is_causal=True))
    assert [(u.t0, u.tq, u.causal) for u in plan.units] == [(0, T, True)]  # flash's own causal
    # with a float mask (which flash's is_causal does not take beside it): tiles
    bias = torch.zeros(1, T, 1)
    _, pairs, masked = _visited(AttentionCall.build(q, k, v, is_causal=True, attn_mask=bias))
    assert pairs == 128 * sum(min(T, (i + 1) * 128) for i in range(T // 128))  # lower triangle
    # only the diagonal blocks carry a mask, with full runs shorter than MIN_FULL_RUN blocks
    short = sum(min(2 * i, MIN_FULL_RUN - 1) * 64 for i in range(T // 128) if 2 * i < MIN_FULL_RUN)
    assert masked == 128 * ((T // 128) * 128 + short)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([1024, 512, 2048, 512]))[None]
    plan, pairs, _ = _visited(AttentionCall.build(q, k, v, mask_mod=M.document(ids)))
    assert pairs == 1024 * 1024 + 512 * 512 + 2048 * 2048 + 512 * 512  # documents align to tiles
    # each document's rows are one tall tile: one kernel call per document
    assert [(u.t0, u.tq, u.n, u.chunks) for u in plan.units] == [
        (0, 1024, 1, ((0, 1024, False),)),
        (1024, 512, 1, ((0, 512, False),)),
        (1536, 2048, 1, ((0, 2048, False),)),
        (3584, 512, 1, ((0, 512, False),)),
    ]
    # a dense bool mask is classified too: an empty half of the keys is never visited
    dense = torch.arange(T) < T // 2
    _, pairs, masked = _visited(AttentionCall.build(q, k, v, dense.view(1, T)))
    assert pairs == T * T // 2 and masked == 0


def test_auto_routes_structured_masks_to_tiled_and_plain_calls_to_torch():
    # inputs that want gradients: without, a trace call is formed in one pass (reference)
    q, k, v = (torch.randn(1, 2, 50, 8, requires_grad=True) for _ in range(3))
    _, trace = _run(q, k, v, "auto", mask_mod=M.sliding_window(5), return_trace=True)
    assert trace.backend == "tiled"
    _, trace = _run(q, k, v, "auto", score_mod=M.softcap(5.0), return_trace=True)
    assert trace.backend == "tiled"
    for kw in (
        {},
        {"is_causal": True},
        {"mask_mod": M.causal()},
        {"mask_mod": M.causal("bottom_right")},
    ):  # T == S: the same as top-left
        _, trace = _run(q, k, v, "auto", return_trace=True, **kw)
        assert trace.backend == "torch", kw
    with pytest.raises(qkv.BackendUnsupportedError, match="tiled has no dropout"):
        _run(q, k, v, "tiled", dropout_p=0.1)
    # named, torch takes a short call's window as its dense twin (test_torch_dense_masks.py)
    dense = _run(q, k, v, "torch", mask_mod=M.sliding_window(5))
    torch.testing.assert_close(dense, _run(q, k, v, "tiled", mask_mod=M.sliding_window(5)))
    _out, trace = _run(
        q, k, v, "auto", mask_mod=M.sliding_window(5), dropout_p=0.2, return_trace=True
    )
    assert trace.backend == "reference"  # the only one that takes both


def test_trace_select_recomputes_only_the_rows_asked_for():
    B, H, T, S = 2, 3, 300, 280
    q, k, v = (torch.randn(B, H, n, 16, dtype=torch.float64) for n in (T, S, S))
    kw = dict(
        mask_mod=M.sliding_window(50), score_mod=M.alibi(H), attn_mask=torch.rand(B, 1, T, S) < 0.9
    )
    _, fast = _run(q, k, v, "tiled", return_trace=True, **kw)
    _, ref = _run(q, k, v, "reference", return_trace=True, **kw)
    part = fast.select(batch=1, heads=[0, 2], rows=range(100, 110))
    assert part.probs.shape == (1, 2, 10, S)
    torch.testing.assert_close(part.probs, ref.probs[1:2, [0, 2], 100:110], rtol=0, atol=1e-12)
    torch.testing.assert_close(part.scores, ref.scores[1:2, [0, 2], 100:110], rtol=0, atol=1e-12)
    torch.testing.assert_close(part.lse, ref.lse[1:2, [0, 2], 100:110], rtol=0, atol=1e-12)
    assert callable(fast._probs)  # the full (B, H, T, S) weights were never built
    torch.testing.assert_close(fast.probs, ref.probs, rtol=0, atol=1e-12)
    eager = ref.select(heads=slice(0, 2), rows=[-1])
    torch.testing.assert_close(eager.probs, ref.probs[:, 0:2, -1:])
    with pytest.raises(ValueError, match="rows index out of range"):
        fast.select(rows=[T])


def test_lazy_trace_refuses_after_inputs_change_in_place():
    q, k, v = (torch.randn(1, 1, 20, 8) for _ in range(3))
    _, trace = _run(q, k, v, "tiled", mask_mod=M.sliding_window(3), return_trace=True)
    q.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        _ = trace.probs


def test_multihead_module_takes_mask_mod_and_score_mod():
    """The module passes structured masks through: equal to their dense twins, on tiled."""
    mha = qkv.MultiHeadAttention(32, 4, dtype=torch.float64)
    x = torch.randn(2, 70, 32, dtype=torch.float64)
    keep = torch.arange(70) < torch.tensor([[70], [50]])  # (B, S): True = a real key
    y, trace = mha(
        x, key_mask=keep, mask_mod=M.sliding_window(8, 8), score_mod=M.alibi(4), return_trace=True
    )
    assert trace.backend == "tiled"
    dense = M.to_dense(M.sliding_window(8, 8), 2, 4, 70, 70)
    bias = M.alibi(4)(torch.zeros(()), *M.index_grid(2, 4, 70, 70)).double()
    mha.backend = "reference"
    twin = mha(x, key_mask=keep, attn_mask=bias.masked_fill(~dense, float("-inf")))
    torch.testing.assert_close(y, twin, rtol=0, atol=1e-12)


def _layouts(B, H, T, S, D, G):
    """q, k, v float64 in three layouts: contiguous, (B, T, H, D) transposed (B and H cannot
    be read as one dim) and k/v heads broadcast by GQA."""

    def make(n, heads, transposed):
        if transposed:
            return torch.randn(B, n, heads, D, dtype=torch.float64).transpose(1, 2)
        return torch.randn(B, heads, n, D, dtype=torch.float64)

    for name, transposed, kv_heads in (
        ("contiguous", False, H),
        ("transposed", True, H),
        ("gqa", False, G),
    ):
        ins = [make(T, H, transposed), make(S, kv_heads, transposed), make(S, kv_heads, transposed)]
        yield name, [t.requires_grad_() for t in ins], kv_heads != H


@CPU_PLANS
@pytest.mark.parametrize("B", [1, 2])
def test_diagonal_groups_match_reference_with_gradients(B):
    """Band masks compute many tiles per kernel call through overlapping strided views of the
    keys (and add the key gradients back strip by strip): outputs and q/k/v/slope gradients
    equal the reference in float64, for windows of every alignment, ALiBi, GQA and layouts whose
    batch and head dims cannot be merged."""
    H, G, D = 4, 2, 8
    cases = [  # (name, T, S, mask_mod, score_mod, is_causal)
        ("window", 700, 700, M.sliding_window(50), None, False),
        ("band", 700, 700, M.sliding_window(40, 90), None, False),
        ("window-bottom-right", 500, 777, M.sliding_window(70, align="bottom_right"), None, False),
        ("window-causal-alibi", 640, 640, M.sliding_window(100, 100), M.alibi(H), True),
        (
            "or-windows",
            600,
            600,
            M.or_masks(M.sliding_window(10), M.sliding_window(0, 10)),
            None,
            False,
        ),
    ]
    for name, T, S, mm, sm, causal in cases:
        for layout, (q, k, v), gqa in _layouts(B, H, T, S, D, G):
            call = AttentionCall.build(
                q, k, v, is_causal=causal, mask_mod=mm, score_mod=sm, enable_gqa=gqa
            )
            plan = _plan(call, *call.BH, None, 64, 64, call.dtype)
            assert max(u.n for u in plan.units) >= 5, (name, plan.units)  # groups were formed
            out = tiled_attention(call, block_q=64, block_k=64)[0]
            ref = _run(
                q, k, v, "reference", is_causal=causal, mask_mod=mm, score_mod=sm, enable_gqa=gqa
            )
            msg = f"{name} {layout}"
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-12, msg=msg)
            g = torch.randn_like(ref)
            for a, b in zip(
                torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)
            ):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-11, msg=msg)


def test_shift_invariance_is_claimed_only_for_masks_that_have_it():
    """Only masks that depend on kv - q alone may share one mask across tiles; each claimed
    mask is checked on shifted grids, and the others (documents, lengths, user functions,
    subclasses) are not claimed."""
    T = S = 40
    claimed = [
        M.causal(),
        M.sliding_window(5, 3),
        M.causal("bottom_right").bind(1, 1, 30, S),
        M.and_masks(M.causal(), M.sliding_window(7)),
        M.offset_mask(M.sliding_window(4), 8, 3),
    ]
    for m in claimed:
        assert M.shift_invariant(m)
        dense = M.to_dense(m, 1, 1, T, S)[0, 0]
        for d in (1, 7):  # the mask at (q + d, kv + d) is the mask at (q, kv)
            assert torch.equal(dense[d:, d:], dense[:-d, :-d]), m
    assert M.shift_invariant(M.alibi(4)) and M.shift_invariant(None)
    # a user subclass of a window may read absolute positions in its __call__
    not_claimed = [
        M.document(_ids(1, T)),
        M.key_lengths(10),
        M.prefix_lm(5),
        M.as_mask_mod(lambda b, h, q, kv: kv <= q),
        M.softcap(3.0),
        type("MyWindow", (type(M.causal()),), {})(None, 0, "top_left", "causal"),
    ]
    for m in not_claimed:
        assert not M.shift_invariant(m), m


@CPU_PLANS
def test_documents_are_one_unmasked_call_each():
    """Documents that do not start on a block boundary: the partial edge blocks are cut to the
    document's keys and the tiles straddling two documents are cut at the boundary, so each
    document's rows are one unit over exactly its keys, without a mask."""
    lengths = [300, 700, 350]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    T = ids.shape[-1]
    q = torch.randn(1, 2, T, 16)
    call = AttentionCall.build(q, q, q, mask_mod=M.document(ids))
    plan = _plan(call, 1, 2, None, 64, 64, call.dtype)
    assert [(u.t0, u.tq, u.n, u.chunks) for u in plan.units] == [
        (0, 300, 1, ((0, 300, False),)),
        (300, 700, 1, ((0, 700, False),)),
        (1000, 350, 1, ((0, 350, False),)),
    ]
    for mm in (M.document(ids), M.and_masks(M.document(ids), M.causal())):
        ref = _run(q, q, q, "reference", mask_mod=mm)
        torch.testing.assert_close(_run(q, q, q, "tiled", mask_mod=mm), ref)
    # rows that differ by batch element keep their mask (and stay exact)
    ids2 = torch.cat([ids, ids.roll(100, -1).sort(-1).values])
    q2 = torch.randn(2, 2, T, 16)
    torch.testing.assert_close(
        _run(q2, q2, q2, "tiled", mask_mod=M.document(ids2)),
        _run(q2, q2, q2, "reference", mask_mod=M.document(ids2)),
    )


def test_dense_masks_broadcast_along_keys_or_queries_are_cut_right():
    """A bool attn_mask of one key column (rows on/off) or one query row (keys on/off) is
    evaluated at the size it broadcasts to when chunks are cut to what rows attend."""
    T, S = 200, 150
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (T, S, S))
    rows = torch.ones(T, 1, dtype=torch.bool)
    rows[70:90] = False  # these rows attend nothing: output 0
    keys = torch.ones(1, S, dtype=torch.bool)
    keys[:, 40:100] = False  # a gap in the keys: not consecutive, so the chunk keeps its mask
    edge = torch.zeros(1, S, dtype=torch.bool)
    edge[:, 3:77] = True  # consecutive keys, not on block boundaries: cut to them, no mask
    for mask in (rows, keys, edge, rows & edge):
        out = _run(q, k, v, "tiled", attn_mask=mask)
        torch.testing.assert_close(
            out, _run(q, k, v, "reference", attn_mask=mask), rtol=0, atol=1e-12
        )
    assert _run(q, k, v, "tiled", attn_mask=rows)[..., 70:90, :].abs().max() == 0
