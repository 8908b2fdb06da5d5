"""``qkv.masks.neighborhood``: NATTEN's neighborhood attention on 1D/2D/3D token grids, and
``qkv.masks.tile_layout`` (issue 40, item 4).

The mask is held to ``reference64.neighborhood_allowed``, NATTEN's rules written as loops
over coordinates and lists of each dilation group (apart from qkv), on odd grids (13, 5x7,
3x4x6), kernels 1, 3, 5 and the whole dim, dilation 1 and 2, causal or not per dim. Block
classification is checked against the dense mask block by block (sound always, exact where
each block fills its box of coordinates), and attention with the mask on the tiled,
reference and (compiled, CPU inference) flex backends against float64 SDPA with the dense
brute-force mask. A tiled layout, attended and put back, equals the row-major result.

Shape alphabet: B batch, H heads, T query length, S key length, D head dim; N tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference64 import neighborhood_allowed, tile_order

import qkv
from qkv import masks as M
from qkv.masks.blocks import _classify_by_evaluation
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance

SHAPES = [(13,), (5, 7), (3, 4, 6)]
KERNELS = [1, 3, 5, "whole"]


def _cases():
    """(shape, kernel, dilation, causal) over the grids, kernels, dilations and causality the
    issue asks for; a kernel is cut to what the dim holds (``k * d <= n``); one case per
    grid mixes causal and non-causal dims."""
    out = []
    for shape in SHAPES:
        for kernel in KERNELS:
            for d in (1, 2):
                ks = tuple(n // d if kernel == "whole" else min(kernel, n // d) for n in shape)
                for causal in (False, True):
                    out.append((shape, ks, (d,) * len(shape), (causal,) * len(shape)))
        mixed = tuple(i % 2 == 1 for i in range(len(shape)))
        out.append((shape, tuple(min(3, n) for n in shape), (1,) * len(shape), mixed))
    return out


def _id(case) -> str:
    shape, ks, dil, causal = case
    c = "causal" if all(causal) else ("mixed" if any(causal) else "full")

    def x(t):
        return "x".join(map(str, t))

    return f"{len(shape)}D-{x(shape)}-k{x(ks)}-d{x(dil)}-{c}"


CASES = _cases()


def _dense(mask, N: int) -> torch.Tensor:
    return M.to_dense(mask, 1, 1, N, N)[0, 0]  # (N, N)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_matches_natten_brute_force(case):
    shape, ks, dil, causal = case
    N = math.prod(shape)
    got = _dense(M.neighborhood(ks, shape, dil, causal), N)
    want = neighborhood_allowed(shape, ks, dil, causal)
    assert torch.equal(got, want), (got ^ want).nonzero()[:5].tolist()
    if not any(causal):  # the window shifts at the borders: every query sees prod(ks) keys
        assert (got.sum(-1) == math.prod(ks)).all()


def test_closed_form_1d_and_2d():
    """kernel 3 over 5 tokens, drawn: the first and last rows see the border's 3 keys; with
    dilation 2 over 6 tokens the even and odd tokens form two groups of 3."""
    x = [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert _dense(M.neighborhood(3, 5), 5).int().tolist() == x
    dilated = _dense(M.neighborhood(3, 6, dilation=2), 6)
    even, odd = [1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1]
    assert dilated.int().tolist() == [even, odd] * 3
    causal = _dense(M.neighborhood(2, 4, is_causal=True), 4)
    assert causal.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    # 2D: the corner (0, 0) of a 4x4 grid with a 3x3 kernel sees rows 0-2 x columns 0-2
    corner = _dense(M.neighborhood(3, (4, 4)), 16)[0].view(4, 4)
    assert corner.int().tolist() == [[1, 1, 1, 0]] * 3 + [[0, 0, 0, 0]]


@pytest.mark.parametrize("kernel", [2, 4], ids=["k2", "k4"])
def test_even_kernels_have_one_more_key_before(kernel):
    """NATTEN's even kernels: ``k // 2`` keys before the query, ``k // 2 - 1`` after."""
    shape = (9, 6)
    got = _dense(M.neighborhood(kernel, shape), 54)
    assert torch.equal(got, neighborhood_allowed(shape, (kernel,) * 2, (1, 1), (False, False)))
    row = got[4 * 6 + 3].view(9, 6)  # the query at (4, 3), far from the borders
    assert row[4].nonzero().flatten().tolist() == list(range(3 - kernel // 2, 3 + kernel // 2))


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(kernel_size=7, shape=(5, 7)), r"kernel_size \* dilation = 7 \* 1 = 7 .* only 5"),
        (dict(kernel_size=3, shape=(5, 7), dilation=2), r"3 \* 2 = 6 .* only 5; use a kernel"),
        (dict(kernel_size=0, shape=(5,)), "kernel_size and dilation must be >= 1"),
        (dict(kernel_size=(3, 3, 3), shape=(5, 7)), "tuple of 2"),
        (dict(kernel_size=3, shape=(5, 7), is_causal=1), "is_causal must be a bool"),
        (dict(kernel_size=3, shape=(2, 2, 2, 2)), "1 to 3 ints"),
        (dict(kernel_size=3, shape=(5, 0)), "1 to 3 ints"),
    ],
    ids=["k7-n5", "k3-d2-n5", "k0", "k-3dims-2D", "causal-int", "4D", "zero-dim"],
)
def test_bad_arguments_name_the_numbers(args, match):
    with pytest.raises(ValueError, match=match):
        M.neighborhood(**args)


def test_call_sizes_and_layout_are_checked():
    q = torch.randn(1, 1, 30, 16)
    with pytest.raises(ValueError, match=r"grid \(5, 7\) has 35 tokens .* T=30 .* S=30"):
        qkv.scaled_dot_product_attention(q, q, q, mask_mod=M.neighborhood(3, (5, 7)))
    with pytest.raises(ValueError, match=r"permutation of 0\.\.34"):
        M.neighborhood(3, (5, 7), layout=torch.zeros(35, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer tensor \(35,\)"):
        M.neighborhood(3, (5, 7), layout=torch.arange(34))
    with pytest.raises(ValueError, match=r"tile \(6, 2\) must be >= 1 and at most"):
        M.tile_layout((5, 7), (6, 2))


# --- blocks -------------------------------------------------------------------------------------

BLOCK_CASES = [
    ((5, 7), (3, 3), (1, 1), (False, False), None),
    ((5, 7), (3, 5), (1, 1), (True, False), None),
    ((5, 7), (2, 3), (2, 2), (False, False), None),
    ((3, 4, 6), (3, 3, 5), (1, 1, 1), (False, False, False), None),
    ((3, 4, 6), (1, 2, 3), (1, 2, 2), (False, True, False), None),
    ((5, 7), (3, 3), (1, 1), (False, False), (2, 4)),
    ((3, 4, 6), (3, 3, 3), (1, 1, 2), (False, False, False), (2, 2, 3)),
    ((40,), (5,), (2,), (False,), None),
    ((40,), (7,), (1,), (True,), (8,)),
]


@pytest.mark.parametrize("block", [(1, 1), (3, 5), (8, 8), (16, 4), (64, 64)], ids=str)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-k{c[1]}-d{c[2]}-t{c[4]}")
def test_blocks_are_sound_and_exact_on_single_pairs(case, block):
    """A block called full is full, one called empty is empty (against the dense mask, by
    evaluation); blocks of one pair are classified exactly."""
    shape, ks, dil, causal, tile = case
    N = math.prod(shape)
    layout = None if tile is None else M.tile_layout(shape, tile)
    mask = M.neighborhood(ks, shape, dil, causal, layout=layout).bind(1, 1, N, N)
    grid = M.Grid(1, 1, N, N, *block, torch.device("cpu"))
    full, empty = mask.blocks(grid)
    true_full, true_empty = (t[0, 0] for t in _classify_by_evaluation(mask, grid))
    assert full.shape == empty.shape == (grid.nq, grid.nk)
    assert not (full & ~true_full).any(), "a block called full is not"
    assert not (empty & ~true_empty).any(), "a block called empty is not"
    if block == (1, 1):
        assert torch.equal(full, true_full) and torch.equal(empty, true_empty)


@pytest.mark.parametrize(
    "shape, tile, ks, dil, causal",
    [
        ((8, 8), None, (3, 3), (1, 1), (False, False)),
        ((8, 8), (4, 4), (5, 3), (1, 1), (False, True)),
        ((12, 12), (4, 4), (3, 3), (2, 2), (False, False)),
        ((4, 8, 8), None, (3, 3, 5), (1, 2, 1), (True, False, False)),
        ((8, 8, 8), (2, 4, 4), (3, 3, 3), (1, 1, 1), (False, False, False)),
    ],
    ids=["rows", "tiles-causal-col", "tiles-dilated", "3D-rows", "3D-tiles"],
)
def test_blocks_are_exact_when_blocks_fill_their_boxes(shape, tile, ks, dil, causal):
    """Row-major blocks of whole rows and tiles of one block's size: a block's tokens are a
    box of coordinates, and the classification is exact."""
    N = math.prod(shape)
    size = shape[-1] if tile is None else math.prod(tile)
    layout = None if tile is None else M.tile_layout(shape, tile)
    mask = M.neighborhood(ks, shape, dil, causal, layout=layout)
    grid = M.Grid(1, 1, N, N, size, size, torch.device("cpu"))
    full, empty = mask.blocks(grid)
    true_full, true_empty = (t[0, 0] for t in _classify_by_evaluation(mask, grid))
    assert torch.equal(full, true_full) and torch.equal(empty, true_empty)
    assert empty.any()  # something is skipped


def test_blocks_of_a_shard_take_its_offsets():
    """Ring attention's shards see the mask through ``offset_mask``: their blocks are
    classified from the shifted bounds, and still sound."""
    shape, N = (6, 8), 48
    mask = M.neighborhood((3, 5), shape, is_causal=(True, False)).bind(1, 1, N, N)
    assert M._blocks_take_offsets(mask)
    piece = M.offset_mask(mask, 16, 24)
    grid = M.Grid(1, 1, 16, 24, 4, 4, torch.device("cpu"))
    full, empty = piece.blocks(grid)
    true_full, true_empty = (t[0, 0] for t in _classify_by_evaluation(piece, grid))
    assert torch.equal(full, true_full) and torch.equal(empty, true_empty)


def test_tiled_layout_skips_more_blocks_at_128x128():
    """A 13x13 kernel on a 128x128 grid, blocks of 64: row-major strips reach 13 rows, two
    blocks each; 8x8 tiles reach 3 tiles per dim."""
    shape, N = (128, 128), 128 * 128
    rows = M.block_summary(M.neighborhood(13, shape), 1, 1, N, N, block=64)
    tiles = M.block_summary(
        M.neighborhood(13, shape, layout=M.tile_layout(shape, (8, 8))), 1, 1, N, N, block=64
    )
    assert rows.density <= 26 / 256 + 1e-9  # at most 13 rows x 2 half-rows of 256 key blocks
    assert tiles.density < rows.density / 1.5


def test_structure_keys_tell_masks_apart():
    a = M.neighborhood(3, (8, 8))
    assert M.structure_key(a) == M.structure_key(M.neighborhood((3, 3), [8, 8]))
    others = [
        M.neighborhood(5, (8, 8)),
        M.neighborhood(3, (8, 8), dilation=2),
        M.neighborhood(3, (8, 8), is_causal=(True, False)),
        M.neighborhood(3, (4, 16)),
        M.neighborhood(3, (8, 8), layout=M.tile_layout((8, 8), (4, 4))),
    ]
    keys = {M.structure_key(m) for m in [a, *others]}
    assert None not in keys and len(keys) == 6
    from qkv.ops.flex import _mask_key  # the flex backend's block-mask cache key

    assert len({_mask_key(m) for m in [a, *others]}) == 6


# --- attention ----------------------------------------------------------------------------------


def _inputs(B, H, N, D, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def _sdpa64(q, k, v, allowed):
    """float64 SDPA with the dense brute-force mask."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=allowed
    )


ATTENTION_CASES = [
    ((5, 7), (3, 5), (1, 1), (False, False)),
    ((5, 7), (3, 3), (1, 2), (True, False)),
    ((3, 4, 6), (3, 2, 3), (1, 2, 1), (False, False, True)),
    ((13,), (5,), (2,), (False,)),
]


@pytest.mark.parametrize("backend", ["tiled", "reference", "auto"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_id)
def test_attention_equals_dense_sdpa_float64(backend, case):
    """Output and gradients of q, k, v, float64, against SDPA with the brute-force mask."""
    shape, ks, dil, causal = case
    N = math.prod(shape)
    q, k, v = (t.requires_grad_() for t in _inputs(2, 3, N, 8))
    allowed = neighborhood_allowed(shape, ks, dil, causal)
    mask = M.neighborhood(ks, shape, dil, causal)
    out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend=backend)
    want = _sdpa64(q, k, v, allowed)
    torch.testing.assert_close(out, want)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for g, w in zip(got, torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tiled_2d_image_within_the_tolerance_policy(dtype):
    """B1-H2-T1024-D32 (a 32x32 image, 7x7 kernel, 8x8 tiles): several 64-blocks per side,
    output and gradients against float64 math, baseline the reference backend in ``dtype``."""
    shape, ks = (32, 32), (7, 7)
    N = 1024
    q64, k64, v64 = (t.requires_grad_() for t in _inputs(1, 2, N, 32, seed=1))
    layout = M.tile_layout(shape, (8, 8))
    allowed = neighborhood_allowed(shape, ks, (1, 1), (False, False), perm=layout.perm.tolist())
    mask = M.neighborhood(ks, shape, layout=layout)
    golden = _sdpa64(q64, k64, v64, allowed)
    dout = torch.randn_like(golden)
    gold_grads = torch.autograd.grad(golden, (q64, k64, v64), dout)
    results = {}
    for backend in ("tiled", "reference"):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
        out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend=backend)
        results[backend] = out, torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    (out, grads), (base, base_grads) = results["tiled"], results["reference"]
    assert_tolerance(out, golden, base, factor=OUTPUT_FACTOR, name=f"tiled {dtype}")
    for name, g, gold, b in zip("qkv", grads, gold_grads, base_grads):
        assert_tolerance(g, gold, b, factor=GRAD_FACTOR, name=f"grad {name} {dtype}")


def test_tiled_backend_never_builds_a_t_by_s_mask(monkeypatch):
    """The tiled backend classifies blocks from coordinate ranges and evaluates the mask only
    on the chunks it computes: no evaluation is (T, S)-sized."""
    from qkv.masks.grids import _Neighborhood
    from qkv.ops import tiled

    tiled.clear_plan_cache()
    seen = []
    call = _Neighborhood.__call__

    def counting(self, b, h, q_idx, kv_idx):
        out = call(self, b, h, q_idx, kv_idx)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(_Neighborhood, "__call__", counting)
    shape, N = (32, 32), 1024
    q, k, v = _inputs(1, 2, N, 16, dtype=torch.float32)
    mask = M.neighborhood(5, shape, layout=M.tile_layout(shape, (8, 8)))
    qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend="tiled")
    assert max(seen, default=0) <= N * N // 8, f"a mask of {max(seen)} elements was evaluated"


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"{c[0]}-k{c[1]}-d{c[2]}-t{c[4]}")
def test_key_counts_equal_the_dense_count(case):
    """Per query, the marked keys its window holds and all its keys, summed box by box
    without the mask (O(N)), equal the dense mask's row sums; a shuffled order too."""
    shape, ks, dil, causal, tile = case
    N = math.prod(shape)
    g = torch.Generator().manual_seed(8)
    for layout in (
        None if tile is None else M.tile_layout(shape, tile),
        torch.randperm(N, generator=g),
    ):
        mask = M.neighborhood(ks, shape, dil, causal, layout=layout)
        allowed = _dense(mask, N).double()  # (T, S)
        marked = (torch.rand(2, 3, N, generator=g) < 0.3).double()  # (B, H, S)
        hits, keys = mask.key_counts(marked)
        assert torch.equal(hits, marked @ allowed.T)  # (B, H, T)
        assert torch.equal(keys, allowed.sum(-1).long())


@pytest.mark.parametrize(
    "shape, tile, ks, dil, causal",
    [
        ((8, 12), (4, 4), (5, 5), (1, 1), (False, False)),
        ((5, 7), (2, 4), (3, 5), (1, 1), (False, True)),  # tiles that do not divide the grid
        ((4, 6, 8), (2, 3, 4), (3, 3, 3), (1, 2, 2), (False, False, False)),
    ],
    ids=["2D-8x12-t4x4", "2D-5x7-t2x4", "3D-4x6x8-t2x3x4"],
)
def test_tiled_layout_unpermuted_equals_row_major(shape, tile, ks, dil, causal):
    """Inputs laid out tile by tile, attended with the mask in that order and put back, equal
    the row-major call (float64, tiled backend)."""
    N = math.prod(shape)
    layout = M.tile_layout(shape, tile)
    assert layout.perm.tolist() == tile_order(shape, tile)
    assert torch.equal(layout.perm[layout.inverse], torch.arange(N))
    q, k, v = _inputs(2, 2, N, 8, seed=4)
    rows = qkv.scaled_dot_product_attention(
        q, k, v, mask_mod=M.neighborhood(ks, shape, dil, causal), backend="tiled"
    )
    tiled_out = qkv.scaled_dot_product_attention(
        *(layout.to_tiles(t) for t in (q, k, v)),
        mask_mod=M.neighborhood(ks, shape, dil, causal, layout=layout),
        backend="tiled",
    )
    torch.testing.assert_close(layout.from_tiles(tiled_out), rows)
    torch.testing.assert_close(rows, _sdpa64(q, k, v, neighborhood_allowed(shape, ks, dil, causal)))


def test_flex_compiled_cpu_inference_equals_dense_sdpa():
    """One compiled FlexAttention call (CPU inference, float32): a 2D neighborhood with
    dilation in the tiled layout, against float64 SDPA with the brute-force mask."""
    from qkv.ops import flex as flex_ops

    why = flex_ops.flex_available("cpu")
    if why is not None:
        pytest.skip(why)
    shape, ks, dil = (12, 16), (5, 3), (2, 1)
    N = 192
    layout = M.tile_layout(shape, (4, 8))
    q64, k64, v64 = _inputs(1, 2, N, 16, seed=5)
    allowed = neighborhood_allowed(shape, ks, dil, (False, True), perm=layout.perm.tolist())
    mask = M.neighborhood(ks, shape, dil, (False, True), layout=layout)
    with torch.no_grad():
        q, k, v = (t.float() for t in (q64, k64, v64))
        got = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend="flex")
        base = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend="reference")
    assert_tolerance(got, _sdpa64(q64, k64, v64, allowed), base, name="flex float32")


def test_compiles_whole_and_exports():
    """``torch.compile(fullgraph=True)`` (forward and backward) and ``torch.export`` of a call
    with a neighborhood in a tiled layout give the eager result (DESIGN: one graph). The graph
    is qkv's (aot_eager: dynamo and AOTAutograd, forward and backward); inductor's C++ for it
    is inductor's own and took 10 s to build cold."""
    shape, N = (5, 7), 35
    mask = M.neighborhood(3, shape, is_causal=(False, True), layout=M.tile_layout(shape, (2, 4)))
    q, k, v = _inputs(1, 2, N, 16, seed=6, dtype=torch.float32)

    def attend(q, k, v):
        return qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask)

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attend(q, k, v)

    eager = attend(q, k, v)
    torch.testing.assert_close(torch.export.export(Attend(), (q, k, v)).module()(q, k, v), eager)
    qg = q.clone().requires_grad_()
    out = torch.compile(attend, fullgraph=True, backend="aot_eager")(qg, k, v)
    torch.testing.assert_close(out, eager)
    q_eager = q.clone().requires_grad_()
    (grad,) = torch.autograd.grad(out.sum(), qg)
    (want,) = torch.autograd.grad(attend(q_eager, k, v).sum(), q_eager)
    torch.testing.assert_close(grad, want)


def test_a_layout_changed_in_place_is_followed():
    """The tiled backend's plan is kept by the mask's structure key, which reads the layout
    by content: swapping two tokens of the layout in place makes the next call plan anew (a
    stale plan would skip the blocks where the moved tokens' keys now are)."""
    shape, N = (8, 32), 256  # four 8x8 tiles in a row: tile 0 sees tiles 0 and 1 only
    layout = M.tile_layout(shape, (8, 8)).perm.clone()  # (N,) of its own memory
    mask = M.neighborhood(3, shape, layout=layout)
    q, k, v = _inputs(1, 2, N, 8, seed=7)
    qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend="tiled")  # planned
    layout[[0, 255]] = layout[[255, 0]].clone()  # the first and last positions swap tokens
    out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend="tiled")
    allowed = neighborhood_allowed(shape, (3, 3), (1, 1), (False, False), perm=layout.tolist())
    torch.testing.assert_close(out, _sdpa64(q, k, v, allowed))


@pytest.mark.parametrize("backend", ["tiled", "reference"])
def test_a_nan_key_reaches_exactly_the_rows_whose_window_holds_it(backend):
    """The mask contract's NaN/inf part: a NaN value poisons the rows that may attend its key
    (its window's queries) and no other; the rest equal float64 SDPA on the clean inputs."""
    shape, ks, dil = (6, 9), (3, 4), (1, 2)
    N = 54
    layout = M.tile_layout(shape, (3, 3))
    mask = M.neighborhood(ks, shape, dil, (False, True), layout=layout)
    allowed = neighborhood_allowed(shape, ks, dil, (False, True), perm=layout.perm.tolist())
    q, k, v = _inputs(1, 2, N, 8, seed=9)
    clean = _sdpa64(q, k, v, allowed)
    v[:, :, 20] = float("nan")
    out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend=backend)
    hit = allowed[:, 20]  # (T,): the rows whose window holds key 20
    assert hit.any() and not hit.all()
    assert out[:, :, hit].isnan().all()
    torch.testing.assert_close(out[:, :, ~hit], clean[:, :, ~hit])
