"""qkv.masks: every ready-made mask_mod/score_mod against a dense twin built by hand.

The twins here use Python loops or torch.tril/triu, never qkv code, so a shared mistake
cannot hide. Block classification must be exact or conservative (never FULL with a masked
pair, never EMPTY with an allowed pair), and exact for the masks whose blocks follow from
index bounds alone. Float64 comparisons use torch.testing.assert_close defaults (DESIGN.md).

Shape alphabet: B batch, H query heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import rand

import qkv
from qkv.masks import (
    EMPTY,
    FULL,
    PARTIAL,
    Grid,
    alibi,
    alibi_slopes,
    and_masks,
    block_states,
    block_summary,
    causal,
    document,
    index_grid,
    key_lengths,
    or_masks,
    prefix_lm,
    sliding_window,
    softcap,
    to_dense,
)

B, H = 2, 3
SIZES = [(1, 1), (5, 5), (17, 17), (33, 33), (5, 17), (17, 33), (33, 17)]
BLOCKS = [1, 3, (4, 5), 64]  # 64: one block larger than any T, S here


def sdpa(q, k, v, **kw):
    return qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)


# --- dense twins, by hand ---------------------------------------------------------------------


def band(T: int, S: int, lo: int | None, hi: int | None) -> torch.Tensor:
    """Keys j with ``i + lo <= j <= i + hi`` (None = unbounded), via tril/triu.

    Shape:
        ``(1, 1, T, S)``, bool.
    """
    m = torch.ones(T, S, dtype=torch.bool)
    if hi is not None:
        m = m.tril(hi)
    if lo is not None:
        m = m.triu(lo)
    return m[None, None]  # (1, 1, T, S)


def loops(shape_bh: tuple[int, int], T: int, S: int, rule) -> torch.Tensor:
    """``rule(b, h, i, j) -> bool`` over every index, with plain Python loops.

    Shape:
        ``(Bm, Hm, T, S)`` for ``shape_bh = (Bm, Hm)``, bool.
    """
    Bm, Hm = shape_bh
    return torch.tensor(
        [
            [[[bool(rule(b, h, i, j)) for j in range(S)] for i in range(T)] for h in range(Hm)]
            for b in range(Bm)
        ],
        dtype=torch.bool,
    ).view(Bm, Hm, T, S)


def sorted_ids(n: int, docs: int = 3) -> torch.Tensor:
    """Sorted document ids of length n (each id one contiguous run), shape ``(n,)``."""
    return torch.randint(0, docs, (n,)).sort().values


# --- the catalogue: name -> (mod, twin, expected to_dense shape, blocks exact?) ----------------
# Each builder takes (T, S) and returns (mod, twin (Bm, Hm, T, S), allowed shapes, exact).
# Random ids come from the per-test seed (conftest), so a case is the same in every test.


def _causal(T, S):
    return causal("top_left"), band(T, S, None, 0), {(1, 1, T, S)}, True


def _causal_br(T, S):
    return causal("bottom_right"), band(T, S, None, S - T), {(1, 1, T, S)}, True


def _window(T, S):
    return sliding_window(3), band(T, S, -3, 0), {(1, 1, T, S)}, True


def _window_right(T, S):
    return sliding_window(2, 1), band(T, S, -2, 1), {(1, 1, T, S)}, True


def _window_br(T, S):
    off = S - T
    return (
        sliding_window(4, 2, align="bottom_right"),
        band(T, S, off - 4, off + 2),
        {(1, 1, T, S)},
        True,
    )


def _prefix_int(T, S):
    return (
        prefix_lm(3),
        loops((1, 1), T, S, lambda b, h, i, j: j < 3 or j <= i),
        {(1, 1, T, S)},
        False,
    )


def _prefix_tensor(T, S):
    p = [4, 1]
    twin = loops((B, 1), T, S, lambda b, h, i, j: j < p[b] or j <= i)
    return prefix_lm(torch.tensor(p)), twin, {(B, 1, T, S)}, False


def _doc_sorted(T, S):
    ids = sorted_ids(T)
    twin = loops((1, 1), T, S, lambda b, h, i, j: ids[i] == ids[j])
    return document(ids), twin, {(1, 1, T, S), (B, 1, T, S)}, True


def _doc_unsorted(T, S):
    ids = torch.randint(0, 3, (T,))
    twin = loops((1, 1), T, S, lambda b, h, i, j: ids[i] == ids[j])
    return document(ids), twin, {(1, 1, T, S), (B, 1, T, S)}, False


def _doc_batch(T, S):
    ids = torch.stack([sorted_ids(T), sorted_ids(T, docs=5)])  # (B, T)
    twin = loops((B, 1), T, S, lambda b, h, i, j: ids[b, i] == ids[b, j])
    return document(ids), twin, {(B, 1, T, S)}, True


def _doc_cross(T, S):
    q_ids, kv_ids = torch.randint(0, 3, (B, T)), torch.randint(0, 3, (B, S))
    twin = loops((B, 1), T, S, lambda b, h, i, j: q_ids[b, i] == kv_ids[b, j])
    return document(q_ids, kv_ids), twin, {(B, 1, T, S)}, False


def _keys_int(T, S):
    n = S // 2  # 0 when S = 1: every row empty
    return (
        key_lengths(n),
        loops((1, 1), T, S, lambda b, h, i, j: j < n),
        {(1, 1, 1, S)},
        True,
    )  # independent of the query too


def _keys_tensor(T, S):
    n = [S // 2 + 1, 0]  # batch element 1 has no keys at all
    twin = loops((B, 1), T, S, lambda b, h, i, j: j < n[b])
    return key_lengths(torch.tensor(n)), twin, {(B, 1, 1, S)}, True


def _and(T, S):
    n = [S - 1, 2]
    mod = and_masks(sliding_window(4), key_lengths(torch.tensor(n)))
    return (
        mod,
        loops((B, 1), T, S, lambda b, h, i, j: i - 4 <= j <= i and j < n[b]),
        {(B, 1, T, S)},
        False,
    )


def _or(T, S):
    mod = or_masks(sliding_window(0, 2), key_lengths(2))
    return (
        mod,
        loops((1, 1), T, S, lambda b, h, i, j: i <= j <= i + 2 or j < 2),
        {(1, 1, T, S)},
        False,
    )


def _amp(T, S):
    n = [S, S // 3]
    mod = causal("bottom_right") & key_lengths(torch.tensor(n))
    twin = loops((B, 1), T, S, lambda b, h, i, j: j <= i + S - T and j < n[b])
    return mod, twin, {(B, 1, T, S)}, False


def _pipe(T, S):
    mod = sliding_window(1, 1) | prefix_lm(2)
    twin = loops((1, 1), T, S, lambda b, h, i, j: i - 1 <= j <= i + 1 or j < 2 or j <= i)
    return mod, twin, {(1, 1, T, S)}, False


def _lambda_h(T, S):
    def striped(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx + h) % 3 != 0

    twin = loops((1, H), T, S, lambda b, h, i, j: (i + j + h) % 3 != 0)
    return striped, twin, {(1, H, T, S)}, True  # blocks found by evaluation: exact


def _lambda_b(T, S):
    twin = loops((B, 1), T, S, lambda b, h, i, j: j <= i + 2 * b)
    return (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 2 * b), twin, {(B, 1, T, S)}, True


MASKS = {
    "causal": (_causal, False),
    "causal-br": (_causal_br, False),
    "window": (_window, False),
    "window-right": (_window_right, False),
    "window-br": (_window_br, False),
    "prefix-int": (_prefix_int, False),
    "prefix-tensor": (_prefix_tensor, False),
    "doc-sorted": (_doc_sorted, True),
    "doc-unsorted": (_doc_unsorted, True),
    "doc-batch": (_doc_batch, True),
    "doc-cross": (_doc_cross, False),
    "keys-int": (_keys_int, False),
    "keys-tensor": (_keys_tensor, False),
    "and": (_and, False),
    "or": (_or, False),
    "amp": (_amp, False),
    "pipe": (_pipe, False),
    "lambda-h": (_lambda_h, False),
    "lambda-b": (_lambda_b, False),
}  # name -> (builder, needs T == S: self-attention document ids)


def _cases(marks_for=lambda name: ()):
    return [
        pytest.param(name, T, S, id=f"T{T}-S{S}-{name}", marks=marks_for(name))
        for name, (_, square) in MASKS.items()
        for T, S in SIZES
        if T == S or not square
    ]


CASES = _cases()


# --- 1. ready-made mask_mods equal their dense twins -------------------------------------------


@pytest.mark.parametrize("name, T, S", CASES)
def test_to_dense_equals_twin(name, T, S):
    mod, twin, _, _ = MASKS[name][0](T, S)
    dense = to_dense(mod, B, H, T, S)
    assert dense.dtype == torch.bool and dense.dim() == 4
    assert torch.equal(dense.expand(B, H, T, S), twin.expand(B, H, T, S))


def test_causal_bottom_right_rows_by_hand():
    """T=4 > S=2 bottom-right: the first T - S rows are empty; T=2 < S=4 sees S - T more keys."""
    tall = to_dense(causal("bottom_right"), 1, 1, 4, 2)[0, 0]
    assert tall.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    wide = to_dense(causal("bottom_right"), 1, 1, 2, 4)[0, 0]
    assert wide.tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize(
    "name, T, S", [p for p in _cases(lambda n: ()) if p.values[1:] in ((5, 5), (17, 33))]
)
def test_to_dense_keeps_unused_dims_at_one(name, T, S):
    """sliding_window gives (1, 1, T, S), per-batch document/key_lengths (B, 1, T, S)."""
    mod, _, shapes, _ = MASKS[name][0](T, S)
    assert tuple(to_dense(mod, B, H, T, S).shape) in shapes


def _naive_attention(q, k, v, allowed=None, bias=None, cap=None, scale=None):
    """softmax(scores) v by hand; a row with no allowed key outputs 0 (the mask contract).

    Shape:
        q ``(B, H, T, D)``, k/v ``(B, H, S, D)``, allowed/bias broadcastable to ``(B, H, T, S)``.
    """
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, T, S)
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if bias is not None:
        scores = scores + bias
    if allowed is None:
        allowed = torch.ones_like(scores, dtype=torch.bool)
    allowed = allowed & torch.isfinite(scores)
    row_max = scores.masked_fill(~allowed, -1e300).amax(-1, keepdim=True)  # (B, H, T, 1)
    w = torch.where(allowed, torch.exp(scores - row_max), 0.0)  # (B, H, T, S)
    total = w.sum(-1, keepdim=True)  # (B, H, T, 1)
    return (w / torch.where(total == 0, 1.0, total)) @ v  # (B, H, T, D)


@pytest.mark.parametrize(
    "name, T, S", [p for p in CASES if p.values[1:] in ((5, 5), (17, 33), (33, 17))]
)
def test_mask_mod_through_reference_backend(name, T, S):
    """mask_mod= on the reference backend equals attention under the twin, empty rows 0."""
    mod, twin, _, _ = MASKS[name][0](T, S)
    q, k, v = rand(B, H, T, 8), rand(B, H, S, 8), rand(B, H, S, 8)
    out = sdpa(q, k, v, mask_mod=mod)
    torch.testing.assert_close(out, _naive_attention(q, k, v, allowed=twin))
    empty = ~twin.expand(B, H, T, S).any(-1)  # (B, H, T)
    assert bool((out[empty] == 0).all()) and not out.isnan().any()


# --- 2. block classification: exact or conservative ---------------------------------------------


def _twin_blocks(twin: torch.Tensor, bq: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(all allowed, none allowed) per block of the twin, padding ragged blocks by hand.

    Shape:
        twin ``(B, H, T, S)`` -> two ``(B, H, nq, nk)`` bool tensors.
    """
    Bt, Ht, T, S = twin.shape
    nq, nk = -(-T // bq), -(-S // bk)
    pad = (0, nk * bk - S, 0, nq * bq - T)
    tiles = lambda fill: F.pad(twin, pad, value=fill).view(Bt, Ht, nq, bq, nk, bk)  # noqa: E731
    return tiles(True).all(-1).all(-2), ~tiles(False).any(-1).any(-2)


@pytest.mark.parametrize("name, T, S", CASES)
def test_block_states_sound_and_exact(name, T, S):
    mod, twin, _, exact = MASKS[name][0](T, S)
    bound = qkv.masks.as_mask_mod(mod).bind(B, H, T, S)
    twin = twin.expand(B, H, T, S)
    for block in BLOCKS:
        bq, bk = (block, block) if isinstance(block, int) else block
        state = block_states(bound, Grid(B, H, T, S, bq, bk, twin.device))
        state = state.expand(B, H, -1, -1)  # (B, H, nq, nk)
        all_, none = _twin_blocks(twin, bq, bk)
        where = f"block {bq}x{bk}"
        assert state.shape == all_.shape, where
        assert not bool((state == FULL)[~all_].any()), f"{where}: FULL block with a masked pair"
        assert not bool((state == EMPTY)[~none].any()), f"{where}: EMPTY block with an allowed pair"
        if exact:
            expected = torch.where(all_, FULL, torch.where(none, EMPTY, PARTIAL)).to(state.dtype)
            assert torch.equal(state, expected), where


def test_blocks_of_mask_mod_that_ignores_kv_idx():
    """Query padding, ``q_idx < 3``, reads no kv_idx: rows 0-2 may attend to every key."""
    summary = block_summary(lambda b, h, q_idx, kv_idx: q_idx < 3, 1, 1, 8, 8, block=4)
    assert summary.state[0, 0].tolist() == [[PARTIAL, PARTIAL], [EMPTY, EMPTY]]


def test_block_summary_causal_closed_form():
    """T = S = 8, blocks 2x2: 4 partial on the diagonal, 6 full below, 6 empty above."""
    s = block_summary(causal(), 1, 1, 8, 8, block=2)
    assert s.counts() == {"full": 6, "partial": 4, "empty": 6}
    assert s.density == pytest.approx(10 / 16)
    lines = str(s).splitlines()
    assert "T=8, S=8, blocks 2x2 -> 4x4; full 6, partial 4, empty 6 (computed 62.5%)" in lines[0]
    assert lines[1:] == ["+...", "#+..", "##+.", "###+"]


def test_block_summary_per_batch_counts_every_head():
    """Per-batch document ids: counts cover all B * H; the drawing shows each b once."""
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 2, 3]])  # (B, T)
    s = block_summary(document(ids), 2, 3, 4, 4, block=2)
    # b=0: [[#, .], [., #]]; b=1: [[+, .], [., +]]; each drawn for H=3 heads in the counts.
    assert s.counts() == {"full": 2 * 3, "partial": 2 * 3, "empty": 4 * 3}
    lines = str(s).splitlines()
    assert lines[1:] == ["b=0 h=*", "#.", ".#", "b=1 h=*", "+.", ".+"]


def test_block_summary_long_sequence_is_quick():
    """T = 4096, sliding_window(64), 128x128 blocks: the diagonal and the block left of it
    are partial (the window reaches 64 keys back), nothing is full, the rest is skipped."""
    start = time.perf_counter()
    s = block_summary(sliding_window(64), 1, 1, 4096, 4096, block=128)
    text = str(s)
    assert time.perf_counter() - start < 1.0
    assert s.counts() == {"full": 0, "partial": 32 + 31, "empty": 32 * 32 - 63}
    rows = text.splitlines()[1:]
    assert len(rows) == 32
    assert (
        rows[0] == "+" + "." * 31 and rows[5] == "....++" + "." * 26 and rows[31] == "." * 30 + "++"
    )


# --- 3. score mods against dense twins ---------------------------------------------------------

SCORE_SIZES = [pytest.param(T, S, id=f"T{T}-S{S}") for T, S in [(1, 1), (5, 5), (17, 33), (33, 17)]]


def _alibi_bias(slopes: list[float], T: int, S: int) -> torch.Tensor:
    """``slopes[h] * (j - i)`` by hand. Shape: ``(1, H, T, S)``, float64."""
    return torch.tensor(
        [[[s * (j - i) for j in range(S)] for i in range(T)] for s in slopes], dtype=torch.float64
    )[None]


@pytest.mark.parametrize("T, S", SCORE_SIZES)
def test_alibi_equals_float_attn_mask_of_torch(T, S):
    slopes = torch.rand(4, dtype=torch.float64)
    q, k, v = rand(B, 4, T, 8), rand(B, 4, S, 8), rand(B, 4, S, 6)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_alibi_bias(slopes.tolist(), T, S))
    torch.testing.assert_close(sdpa(q, k, v, score_mod=alibi(slopes)), expected)


def test_alibi_one_slope_is_shared_by_every_head():
    q, k, v = rand(B, 4, 5, 8), rand(B, 4, 7, 8), rand(B, 4, 7, 8)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_alibi_bias([0.3] * 4, 5, 7))
    out = sdpa(q, k, v, score_mod=alibi(torch.tensor([0.3], dtype=torch.float64)))
    torch.testing.assert_close(out, expected)


PAPER_SLOPES = {  # Press et al. 2022: 2^(-8i/n); else the 2^k-head slopes + every other 2^(k+1)
    1: [2.0**-8],
    2: [2.0**-4, 2.0**-8],
    6: [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3],
    8: [2.0**-i for i in range(1, 9)],
    12: [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5],
}


@pytest.mark.parametrize("n", list(PAPER_SLOPES), ids=lambda n: f"H{n}")
def test_alibi_slopes_paper_values(n):
    torch.testing.assert_close(
        alibi_slopes(n).double(), torch.tensor(PAPER_SLOPES[n], dtype=torch.float64)
    )


def test_alibi_of_H_uses_the_paper_slopes():
    q, k, v = rand(1, 6, 5, 4), rand(1, 6, 9, 4), rand(1, 6, 9, 4)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_alibi_bias(PAPER_SLOPES[6], 5, 9))
    torch.testing.assert_close(sdpa(q, k, v, score_mod=alibi(6)), expected)


@pytest.mark.parametrize("T, S", SCORE_SIZES)
def test_softcap_equals_hand_written(T, S):
    q, k, v = rand(B, H, T, 8) * 3, rand(B, H, S, 8), rand(B, H, S, 8)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)  # (B, H, T, S)
    assert scores.abs().max() > 2  # the cap bites
    expected = torch.softmax(0.7 * torch.tanh(scores / 0.7), dim=-1) @ v  # (B, H, T, D)
    out, trace = sdpa(q, k, v, score_mod=softcap(0.7), return_trace=True)
    torch.testing.assert_close(out, expected)
    assert trace.scores.abs().max() <= 0.7  # tanh rounds to exactly 1 far out, even in float64


def test_plain_lambda_score_mod():
    q, k, v = rand(B, H, 17, 8), rand(B, H, 33, 8), rand(B, H, 33, 8)
    bias = torch.tensor(
        [
            [
                [[0.5 * (h + 1) - 0.1 * abs(i - j) + 0.2 * b for j in range(33)] for i in range(17)]
                for h in range(H)
            ]
            for b in range(B)
        ],
        dtype=torch.float64,
    )  # (B, H, T, S)

    def bias_mod(score, b, h, q_idx, kv_idx):
        return score + 0.5 * (h + 1) - 0.1 * (q_idx - kv_idx).abs() + 0.2 * b

    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    torch.testing.assert_close(sdpa(q, k, v, score_mod=bias_mod), expected)


@pytest.mark.parametrize("T, S", SCORE_SIZES)
def test_mask_mod_score_mod_attn_mask_and_causal_combine(T, S):
    """A key must pass mask_mod, the bool attn_mask and is_causal; softcap applies to the rest."""
    n = [S, max(S - 4, 0)]
    mod = sliding_window(5, 3) & key_lengths(torch.tensor(n))
    keep = torch.rand(B, 1, T, S) < 0.7  # (B, 1, T, S)
    allowed = keep & loops((B, 1), T, S, lambda b, h, i, j: i - 5 <= j <= i and j < n[b])
    q, k, v = rand(B, H, T, 8) * 2, rand(B, H, S, 8), rand(B, H, S, 8)
    out = sdpa(q, k, v, attn_mask=keep, is_causal=True, mask_mod=mod, score_mod=softcap(1.5))
    torch.testing.assert_close(out, _naive_attention(q, k, v, allowed=allowed, cap=1.5))
    assert not out.isnan().any()


@pytest.mark.parametrize("T, S", SCORE_SIZES)
def test_alibi_with_float_attn_mask_mask_mod_and_causal(T, S):
    """Additive terms add up: scores + alibi + float attn_mask, then the masks."""
    slopes = torch.rand(H, dtype=torch.float64)
    float_mask = rand(1, H, T, S)
    ids = torch.randint(0, 2, (B, T))  # (B, T); T == S or cross-attention ids below
    kv_ids = torch.randint(0, 2, (B, S))
    allowed = loops((B, 1), T, S, lambda b, h, i, j: ids[b, i] == kv_ids[b, j] and j <= i)
    q, k, v = rand(B, H, T, 8), rand(B, H, S, 8), rand(B, H, S, 8)
    out = sdpa(
        q,
        k,
        v,
        attn_mask=float_mask,
        is_causal=True,
        mask_mod=document(ids, kv_ids),
        score_mod=alibi(slopes),
    )
    expected = _naive_attention(
        q, k, v, allowed=allowed, bias=_alibi_bias(slopes.tolist(), T, S) + float_mask
    )
    torch.testing.assert_close(out, expected)


# --- 4. gradients reach score_mod tensors ---------------------------------------------------------


@pytest.mark.parametrize(
    "mask_mod", [None, causal("bottom_right")], ids=["T3-S4-alibi", "T3-S4-alibi-causal-br"]
)
def test_gradcheck_alibi_slopes(mask_mod):
    q, k, v = (
        rand(1, 2, 3, 3, requires_grad=True),
        rand(1, 2, 4, 3, requires_grad=True),
        rand(1, 2, 4, 2, requires_grad=True),
    )
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)

    def f(q, k, v, slopes):
        return sdpa(q, k, v, mask_mod=mask_mod, score_mod=alibi(slopes))

    assert torch.autograd.gradcheck(f, (q, k, v, slopes))
    f(q, k, v, slopes).sum().backward()
    assert slopes.grad is not None and bool((slopes.grad != 0).all())


# --- 5. errors name the numbers and the fix ----------------------------------------------------


def _sdpa_small(B_=2, H_=4, T=5, S=6, **kw):
    return sdpa(
        torch.randn(B_, H_, T, 8), torch.randn(B_, H_, S, 8), torch.randn(B_, H_, S, 8), **kw
    )


ERRORS = {
    "window-negative": (
        ValueError,
        r"sliding_window: left must be an int >= 0, got -1",
        lambda: sliding_window(-1),
    ),
    "window-right-float": (
        ValueError,
        r"sliding_window: right must be an int >= 0, got 1.5",
        lambda: sliding_window(2, 1.5),
    ),
    "align-middle": (
        ValueError,
        r"align must be 'top_left' or 'bottom_right', got 'middle'",
        lambda: causal(align="middle"),
    ),
    "doc-float-ids": (
        ValueError,
        (
            r"document: ids must be an integer tensor \(B, T\) or \(T,\), got "
            r"torch.float32"
        ),
        lambda: document(torch.zeros(5)),
    ),
    "doc-wrong-T": (
        ValueError,
        (
            r"document: ids has shape \(1, 4\) but the call has B=2 and T=5; "
            r"give \(2, 5\) or \(1, 5\) ids"
        ),
        lambda: _sdpa_small(T=5, S=5, mask_mod=document(torch.zeros(4, dtype=torch.long))),
    ),
    "doc-wrong-B": (
        ValueError,
        r"document: ids has shape \(3, 5\) but the call has B=2",
        lambda: _sdpa_small(T=5, S=5, mask_mod=document(torch.zeros(3, 5, dtype=torch.long))),
    ),
    "doc-wrong-S": (
        ValueError,
        r"document: kv_ids has shape \(1, 5\) but the call has B=2 and S=6",
        lambda: _sdpa_small(
            mask_mod=document(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long))
        ),
    ),
    "keys-wrong-count": (
        ValueError,
        (
            r"key_lengths: got 3 lengths for a batch of B=2; give one per "
            r"batch element, shape \(2,\)"
        ),
        lambda: _sdpa_small(mask_mod=key_lengths(torch.tensor([1, 2, 3]))),
    ),
    "keys-float": (
        ValueError,
        r"key_lengths: lengths must be an int or a 1-D integer tensor",
        lambda: key_lengths(torch.tensor([1.0, 2.0])),
    ),
    "keys-negative": (ValueError, r"key_lengths: expected an int >= 0", lambda: key_lengths(-2)),
    "prefix-negative": (
        ValueError,
        (
            r"prefix_lm: expected an int >= 0 or a \(B,\) integer tensor, "
            r"got -1"
        ),
        lambda: prefix_lm(-1),
    ),
    "and-masks-empty": (ValueError, r"and_masks needs at least one mask_mod", and_masks),
    "or-masks-empty": (ValueError, r"or_masks needs at least one mask_mod", or_masks),
    "block-0": (
        ValueError,
        r"block sizes must be >= 1, got 0",
        lambda: block_summary(causal(), 1, 1, 4, 4, block=0),
    ),
    "alibi-wrong-count": (
        ValueError,
        (
            r"alibi: got 3 slopes for H=4 heads; give one per query head, "
            r"e\.g\. qkv\.masks\.alibi_slopes\(4\)"
        ),
        lambda: _sdpa_small(score_mod=alibi(torch.ones(3))),
    ),
    "alibi-2d": (
        ValueError,
        r"alibi: slopes must be a 1-D float tensor",
        lambda: alibi(torch.ones(2, 2)),
    ),
    "alibi-slopes-0": (
        ValueError,
        r"alibi_slopes: num_heads must be an int >= 1, got 0",
        lambda: alibi_slopes(0),
    ),
    "softcap-0": (
        ValueError,
        r"softcap: cap must be a finite number > 0, got 0",
        lambda: softcap(0),
    ),
    "softcap-inf": (
        ValueError,
        r"softcap: cap must be a finite number > 0, got inf",
        lambda: softcap(float("inf")),
    ),
    "mask-returns-float": (
        TypeError,
        (
            r"returned torch.float32; it must return a bool tensor "
            r"\(True = may attend\)"
        ),
        lambda: _sdpa_small(mask_mod=lambda b, h, q, kv: (q >= kv).float()),
    ),
    "mask-returns-5d": (
        ValueError,
        (
            r"returned shape \(1,\) for a single \(b, h, q_idx, kv_idx\); "
            r"mask_mod and score_mod are evaluated per element"
        ),
        lambda: _sdpa_small(mask_mod=lambda b, h, q, kv: (q >= kv)[None]),
    ),
    "mask-not-callable": (
        TypeError,
        (
            r"mask_mod must be a function \(b, h, q_idx, kv_idx\) -> bool "
            r"tensor or a qkv.masks mask, got Tensor"
        ),
        lambda: _sdpa_small(mask_mod=torch.ones(5, 6, dtype=torch.bool)),
    ),
    "score-not-callable": (
        TypeError,
        (
            r"score_mod must be a function \(score, b, h, q_idx, kv_idx\) "
            r"-> score or a qkv.masks score mod, got float"
        ),
        lambda: _sdpa_small(score_mod=0.5),
    ),
    "score-returns-bool": (
        TypeError,
        r"score_mod .* must return a float tensor, got torch.bool",
        lambda: _sdpa_small(score_mod=lambda s, b, h, q, kv: s > 0),
    ),
    "mask-5d-inputs": (
        ValueError,
        (
            r"inputs must have at most 4 dims \(B, H, T, D\); got leading "
            r"dims \(2, 3, 4\): reshape to \(B \* X, H, T, D\)"
        ),
        lambda: sdpa(
            torch.randn(2, 3, 4, 5, 8),
            torch.randn(2, 3, 4, 5, 8),
            torch.randn(2, 3, 4, 5, 8),
            mask_mod=causal(),
        ),
    ),
    "unbound-bottom-right": (
        ValueError,
        (
            r"causal\(align='bottom_right'\) needs the lengths T and S "
            r"to align bottom-right: pass it as mask_mod="
        ),
        lambda: causal("bottom_right")(*index_grid(1, 1, 2, 4)),
    ),
    "unbound-bottom-right-blocks": (
        ValueError,
        r"needs the lengths T and S to align bottom-right",
        lambda: sliding_window(2, align="bottom_right").blocks(
            Grid(1, 1, 2, 4, 1, 1, torch.device("cpu"))
        ),
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_error_message(case):
    exc, pattern, call = ERRORS[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_prefix_lm_wrong_count_names_prefix_lm():
    with pytest.raises(ValueError, match=r"^prefix_lm: got 3 lengths for a batch of B=2"):
        _sdpa_small(mask_mod=prefix_lm(torch.tensor([1, 2, 3])))


# --- a piece of a call (ring attention's shards): offset_mask / offset_score -----------------


@pytest.mark.parametrize("name, T, S", CASES)
def test_offset_mask_is_the_piece_of_the_whole_mask(name, T, S):
    """A piece of queries [q0, q0+t) x keys [k0, k0+s): the moved mask equals that slice of
    the whole mask, and its blocks (from shifted bounds for qkv's masks, by evaluation for
    functions) are sound, and exact where the whole mask's are."""
    mod, twin, _, exact = MASKS[name][0](T, S)
    bound = qkv.masks.as_mask_mod(mod).bind(B, H, T, S)
    twin = twin.expand(B, H, T, S)
    for q0, k0 in ((T // 3, S // 2), (1, 0), (0, S - 1)):
        t, s = T - q0, S - k0
        piece = qkv.masks.offset_mask(bound, q0, k0)
        idx = qkv.masks.index_grid(B, H, t, s)
        want = twin[:, :, q0:, k0:]
        got = qkv.masks.evaluate_mask(piece, *idx).expand(B, H, t, s)
        assert torch.equal(got, want), (q0, k0)
        for bq, bk in ((3, 5), (4, 4)):
            state = block_states(piece, Grid(B, H, t, s, bq, bk, want.device))
            state = state.expand(B, H, -1, -1)
            all_, none = _twin_blocks(want, bq, bk)
            assert not bool((state == FULL)[~all_].any()), (q0, k0, bq, bk)
            assert not bool((state == EMPTY)[~none].any()), (q0, k0, bq, bk)
            if exact:
                expected = torch.where(all_, FULL, torch.where(none, EMPTY, PARTIAL)).to(
                    state.dtype
                )
                assert torch.equal(state, expected), (q0, k0, bq, bk)


def test_offset_mask_of_a_subclass_with_its_own_blocks_classifies_by_evaluation():
    """A user MaskMod whose ``blocks`` ignores Grid's offsets cannot be trusted on a piece:
    the piece is classified by evaluating it (exact), never by that ``blocks``."""

    class FirstKeys(qkv.masks.MaskMod):
        def __call__(self, b, h, q_idx, kv_idx):
            return kv_idx < 4

        def blocks(self, grid):  # ignores grid.kv_start: wrong for any piece but the first
            return grid.kv_hi < 4, grid.kv_lo - grid.kv_start >= 4

    piece = qkv.masks.offset_mask(FirstKeys(), 0, 2)  # keys 2.. of the whole: 2 and 3 allowed
    state = block_states(piece, Grid(1, 1, 4, 8, 4, 2, torch.device("cpu")))
    assert state[0, 0, 0].tolist() == [FULL, EMPTY, EMPTY, EMPTY]


def test_offset_score_moves_positions():
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    whole = alibi(slopes)
    piece = qkv.masks.offset_score(whole, 3, 1)
    assert piece.additive
    score = torch.zeros(1, 2, 2, 4, dtype=torch.float64)
    got = piece(score, *qkv.masks.index_grid(1, 2, 2, 4))
    want = whole(torch.zeros(1, 2, 6, 5, dtype=torch.float64), *qkv.masks.index_grid(1, 2, 6, 5))
    torch.testing.assert_close(got, want[:, :, 3:5, 1:5])


@pytest.mark.parametrize("name", ["softcap-0.5", "softcap-3", "alibi"])
def test_closed_form_score_derivatives_equal_autograd(name):
    """``ScoreMod.derivative`` (the tiled custom op's backward pulls dS back by it, having no
    autograd; issue 41, item 5) equals autograd's, in float64 at scores up to 10 caps."""
    mod = alibi(torch.tensor([0.5, 0.25], dtype=torch.float64)) if name == "alibi" else None
    mod = mod or softcap(float(name.split("-")[1]))
    score = (torch.randn(1, 2, 5, 7, dtype=torch.float64) * 8).requires_grad_(True)
    idx = qkv.masks.index_grid(1, 2, 5, 7)
    (want,) = torch.autograd.grad(mod(score, *idx).sum(), score)
    got = mod.derivative(score.detach(), *idx).expand(score.shape)
    torch.testing.assert_close(got, want)
    assert qkv.masks.as_score_mod(lambda s, b, h, q, kv: s * 2).derivative(score, *idx) is None
