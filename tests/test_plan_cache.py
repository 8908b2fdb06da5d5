"""The tiled backend's block plans, reused across calls (``qkv.ops.tiled.plan._cached_units``) under
``qkv.masks.structure_key``: the same structure and sizes reuse a plan, anything else plans
anew, and a reused plan gives the answer of a fresh one (float64, compared with the reference).
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.ops import AttentionCall, tiled


@pytest.fixture(autouse=True)
def _empty_cache():
    tiled.clear_plan_cache()
    yield
    tiled.clear_plan_cache()


def _qkv(B=1, H=2, T=200, S=200, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (T, S, S))


def _check(q, k, v, **kw):
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    ref = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_same_structure_reuses_one_plan_and_new_sizes_plan_anew():
    q, k, v = _qkv()
    _check(q, k, v, mask_mod=M.sliding_window(30))
    _check(q, k, v, mask_mod=M.sliding_window(30))  # a new object, the same structure
    assert len(tiled._plan_cache) == 1
    _check(q, k, v, mask_mod=M.sliding_window(31))
    _check(*_qkv(T=201, S=201), mask_mod=M.sliding_window(30))
    _check(*_qkv(H=3), mask_mod=M.sliding_window(30))
    assert len(tiled._plan_cache) == 4


def test_document_ids_changed_in_place_get_a_new_plan():
    T = 300
    q, k, v = _qkv(T=T, S=T)
    ids = torch.arange(T) // 100  # three documents of 100
    _check(q, k, v, mask_mod=M.document(ids))
    key = M.structure_key(M.document(ids))
    ids[:150] = 0  # the same tensor, other documents: a stale plan would mix them up
    assert M.structure_key(M.document(ids)) != key
    _check(q, k, v, mask_mod=M.document(ids))
    assert len(tiled._plan_cache) == 2


def test_key_lengths_of_other_values_get_their_own_plan(monkeypatch):
    monkeypatch.setattr(tiled.batch, "PIECE_SCORES", 0)  # cut however small the batch
    q, k, v = _qkv(B=2)
    _check(q, k, v, mask_mod=M.key_lengths(torch.tensor([50, 50])))
    _check(q, k, v, mask_mod=M.key_lengths(torch.tensor([120, 120])))
    assert len(tiled._plan_cache) == 2
    # lengths that differ: each batch element attends its own keys, one plan per length
    _check(q, k, v, mask_mod=M.key_lengths(torch.tensor([50, 200])))
    _check(q, k, v, mask_mod=M.key_lengths(torch.tensor([120, 7])))
    assert len(tiled._plan_cache) == 6


@pytest.mark.parametrize("name", ["function", "subclass", "dense"])
def test_masks_without_a_structure_key_are_never_cached(name):
    q, k, v = _qkv()

    class Band(M.MaskMod):  # a subclass may read anything: no key
        def __call__(self, b, h, q_idx, kv_idx):
            return (kv_idx - q_idx).abs() <= 9

    kw = {
        "function": dict(mask_mod=lambda b, h, qi, ki: (ki - qi).abs() <= 9),
        "subclass": dict(mask_mod=Band()),
        "dense": dict(attn_mask=M.to_dense(M.sliding_window(9, 9), 1, 1, 200, 200)[0, 0]),
    }[name]
    if "mask_mod" in kw:
        assert M.structure_key(M.as_mask_mod(kw["mask_mod"])) is None
    _check(q, k, v, **kw)
    _check(q, k, v, **kw)
    assert len(tiled._plan_cache) == 0


def test_structure_keys_of_combinations_and_offsets():
    w, c = M.sliding_window(4), M.causal()
    assert M.structure_key(M.and_masks(w, c)) == M.structure_key(
        M.and_masks(M.sliding_window(4), M.causal())
    )
    assert M.structure_key(M.and_masks(w, c)) != M.structure_key(M.or_masks(w, c))
    assert M.structure_key(M.and_masks(w, lambda b, h, q, kv: q >= kv)) is None
    bound = M.causal("bottom_right")
    assert M.structure_key(bound.bind(1, 1, 3, 5)) != M.structure_key(bound.bind(1, 1, 5, 5))
    assert M.structure_key(M.offset_mask(w.bind(1, 1, 9, 9), 2, 0)) != M.structure_key(
        M.offset_mask(w.bind(1, 1, 9, 9), 3, 0)
    )


def test_a_reused_plan_serves_other_inputs_score_mods_and_gradients():
    T = 257
    mm = M.sliding_window(40, 3)
    for seed, sm in enumerate([None, M.alibi(2), M.softcap(3.0)]):
        q, k, v = (t.requires_grad_() for t in _qkv(T=T, S=T, seed=seed))
        out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=mm, score_mod=sm)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref = qkv.scaled_dot_product_attention(
            q, k, v, backend="reference", mask_mod=mm, score_mod=sm
        )
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


def test_the_cache_is_bounded():
    q, k, v = _qkv(T=40, S=40)
    for w in range(tiled.PLAN_CACHE_SIZE + 5):
        qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=M.sliding_window(w))
    assert len(tiled._plan_cache) == tiled.PLAN_CACHE_SIZE


def test_chunk_masks_of_a_kept_plan_are_built_once(monkeypatch):
    """A window's first tiles and its diagonal group take their chunk masks (and the rows
    without a key) from the kept plan at the next call: none is built again, in the forward
    or the backward, and the answer is the fresh plan's. A score_mod's masks are built at
    every call, and past ``KEPT_MASK_ELEMENTS`` a plan keeps no more of them."""
    from qkv.ops.tiled import plan as tiled_plan

    built = []
    chunk_mask = tiled_plan._Plan.chunk_mask

    def counting(self, *args):
        built.append(args)
        return chunk_mask(self, *args)

    monkeypatch.setattr(tiled_plan._Plan, "chunk_mask", counting)
    q, k, v = (t.requires_grad_() for t in _qkv(T=300, S=300))
    mm = M.sliding_window(100)
    first = 0
    for _call in range(2):
        built.clear()
        out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=mm)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref = qkv.scaled_dot_product_attention(q, k, v, backend="reference", mask_mod=mm)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-10)
        first = first or len(built)
    assert first >= 3 and built == []  # (single tiles and the group's mask, then none)
    with torch.no_grad():
        for _ in range(2):
            built.clear()
            qkv.scaled_dot_product_attention(
                q, k, v, backend="tiled", mask_mod=mm, score_mod=M.alibi(1)
            )
        assert len(built) >= 3  # masks holding a score_mod's bias: built at every call
        monkeypatch.setattr(tiled_plan, "KEPT_MASK_ELEMENTS", 0)
        tiled.clear_plan_cache()
        for _ in range(2):
            built.clear()
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=mm)
        assert len(built) == first - 1  # only the group's mask kept (the tiles' over budget)


def test_masks_kept_under_inference_mode_serve_a_call_with_a_gradient():
    """Masks kept by a call under ``inference_mode`` are inference tensors; a later call
    with the same plan that wants gradients reads them in its forward and backward."""
    q, k, v = _qkv(T=300, S=300)
    mm = M.sliding_window(100)
    with torch.inference_mode():
        first = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=mm)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=mm)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = qkv.scaled_dot_product_attention(q, k, v, backend="reference", mask_mod=mm)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(first, ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


@pytest.mark.parametrize("first", ["mask_mod", "bias", "score_mod"])
def test_a_float_mask_or_score_mod_never_reads_masks_kept_without_one(first):
    """A call with a float attn_mask (or a score_mod) and one without share their plan's units
    when the mask_mod is the same and not shift-invariant (no diagonal groups); the chunk
    masks kept by the one without hold no bias, and the other must not read them (it gave
    1.3 off, float64, before it checked), in either order."""
    T = 300
    q, k, v = _qkv(T=T, S=T)
    mm = M.and_masks(M.sliding_window(100), M.key_lengths(torch.tensor([250])))
    bias = torch.randn(1, 1, T, T, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    calls = {"mask_mod": {}, "bias": dict(attn_mask=bias), "score_mod": dict(score_mod=M.alibi(2))}
    order = [first] + [name for name in calls if name != first]
    with torch.no_grad():
        for name in order + order:
            _check(q, k, v, mask_mod=mm, **calls[name])


def _units_of(T, B=1, **kw):
    q = torch.zeros(B, 2, T, 8)
    call = AttentionCall.build(q, q, q, **kw)
    return tiled.plan._plan(call, B, 2, None, 64, 64, torch.float32).units


def test_causal_documents_run_as_one_causal_kernel_call_each():
    """Packed documents with causal attention within each: one unit per document that the
    flash kernel runs with its own is_causal (tiles of 64 rows masked at the diagonal took
    float32 longer than the documents without causal), forward and backward as the
    reference; other shapes of the mask keep their tiles."""
    lengths = [150, 1, 230, 119]
    T = sum(lengths)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    starts = [0, 150, 151, 381]
    for kw in (
        dict(mask_mod=M.document(ids), is_causal=True),
        dict(mask_mod=M.and_masks(M.causal("bottom_right"), M.document(ids[None]))),
    ):
        units = _units_of(T, **kw)
        assert [(u.t0, u.tq, u.causal) for u in units] == [
            (a, n, True) for a, n in zip(starts, lengths)
        ]
        q, k, v = (t.requires_grad_() for t in _qkv(T=T, S=T))
        for backend in ("tiled", "reference"):
            out = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            if backend == "tiled":
                got = (out, *grads)
        for a, b in zip(got, (out, *grads)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    # what keeps its tiles: an id in two runs, documents of fewer than 64 rows on average,
    # ids per batch element, a float mask or a score_mod (their chunks need the mask)
    split = ids.clone()
    split[400:] = 0
    short = torch.arange(T) // 40
    kinds = [
        dict(mask_mod=M.document(split), is_causal=True),
        dict(mask_mod=M.document(short), is_causal=True),
        dict(mask_mod=M.document(torch.stack([ids, ids.flip(0)])), is_causal=True, B=2),
        dict(mask_mod=M.document(ids), is_causal=True, attn_mask=torch.zeros(T, T)),
        dict(mask_mod=M.document(ids), is_causal=True, score_mod=M.alibi(2)),
    ]
    for kw in kinds:
        assert not any(u.causal for u in _units_of(T, **kw))


@pytest.mark.parametrize("prefix", [0, 1, 70, 199, 200, 250])
def test_a_prefix_lm_is_the_prefix_in_full_then_the_kernels_own_causal(prefix):
    """``prefix_lm(P)``: the prefix's rows see its keys in full; each later row sees the
    prefix (a chunk without mask) and, past it, causal keys (the flash kernel's is_causal), so
    no tile is masked at the diagonal; forward, gradients and sinks as the reference's."""
    T = 200
    for mod in (M.prefix_lm(prefix), M.prefix_lm(torch.tensor([prefix]))):
        units = [(u.t0, u.tq, u.chunks, u.causal) for u in _units_of(T, mask_mod=mod)]
        if prefix >= T:  # every key is the prefix's
            assert units == [(0, T, ((0, T, False),), False)]
        else:
            before = ((-prefix, 0, False),) if prefix else ()
            first = [(0, prefix, ((0, prefix, False),), False)] if prefix else []
            assert units == [*first, (prefix, T - prefix, (*before, (0, T - prefix, False)), True)]
        sinks = torch.tensor([0.5, -3.0], dtype=torch.float64, requires_grad=True)
        q, k, v = (t.requires_grad_() for t in _qkv(T=T, S=T))
        runs = []
        for backend in ("tiled", "reference"):
            out = qkv.scaled_dot_product_attention(
                q, k, v, backend=backend, mask_mod=mod, sinks=sinks
            )
            runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, sinks))))
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    # a negative prefix in a tensor (an int one is refused) is none: causal alone
    negative = M.prefix_lm(torch.tensor([-5]))
    assert [(u.t0, u.tq, u.causal) for u in _units_of(T, mask_mod=negative)] == [(0, T, True)]
    q, k, v = _qkv(T=T, S=T)
    _check(q, k, v, mask_mod=negative)
    # a prefix per batch element keeps its tiles
    per_batch = M.prefix_lm(torch.tensor([prefix, 3]))
    assert not any(u.causal for u in _units_of(T, mask_mod=per_batch, B=2))


@pytest.mark.parametrize(
    "name",
    [
        "window",
        "window-and-lengths",
        "lengths",
        "causal",
        "bottom-right",
        "document",
        "causal-documents",
    ],
)
def test_calls_sharing_a_plan_with_other_extras_each_give_their_own_answer(name):
    """One mask structure and sizes, called in turn with nothing else, a float attn_mask, a
    bool attn_mask, score_mods, sinks, a gradient and in float32: whatever the kept plan
    holds from the calls before, each answer is the reference's (a bias once read the masks
    an earlier call without one had kept)."""
    T, S, B, H = 130, 130, 2, 2
    g = torch.Generator().manual_seed(7)
    mm = {
        "window": M.sliding_window(30, 5),
        "window-and-lengths": M.and_masks(M.sliding_window(90), M.key_lengths(torch.tensor([93]))),
        "lengths": M.key_lengths(torch.tensor([77, 120])),
        "causal": M.causal(),
        "bottom-right": M.causal(align="bottom_right"),
        "document": M.document(torch.randint(0, 4, (B, T), generator=g).sort(-1).values),
        "causal-documents": M.and_masks(M.document(torch.arange(T) // 65), M.causal()),
    }[name]
    q, k, v = (torch.randn(B, H, n, 8, generator=g, dtype=torch.float64) for n in (T, S, S))
    extras = {
        "none": {},
        "bias": dict(attn_mask=torch.randn(1, 1, T, S, generator=g, dtype=torch.float64)),
        "bool": dict(attn_mask=torch.rand(B, 1, T, S, generator=g) > 0.2),
        "alibi": dict(score_mod=M.alibi(torch.rand(H, generator=g, dtype=torch.float64))),
        "softcap": dict(score_mod=M.softcap(2.0)),
        "sinks": dict(sinks=torch.randn(H, generator=g, dtype=torch.float64)),
    }
    for extra in ["none", "bias", "bool", "none", "alibi", "softcap", "sinks", "bias", "none"]:
        with torch.no_grad():
            _check(q, k, v, mask_mod=mm, **extras[extra])
            if extra in ("none", "bool"):  # float32 beside float64: a plan of the same sizes
                ref = qkv.scaled_dot_product_attention(
                    q, k, v, backend="reference", mask_mod=mm, **extras[extra]
                )
                out = qkv.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), backend="tiled", mask_mod=mm, **extras[extra]
                )
                torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    q.requires_grad_()
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=mm, **extras["bias"])
    ref = qkv.scaled_dot_product_attention(
        q, k, v, backend="reference", mask_mod=mm, **extras["bias"]
    )
    (g_out,), (g_ref,) = (torch.autograd.grad(o.square().sum(), (q,)) for o in (out, ref))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_out, g_ref, rtol=0, atol=1e-10)
