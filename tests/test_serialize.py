"""``qkv.masks.serialize``: point clouds along z-order and Hilbert curves, PTv3's patches as
documents (issue 40, item 5).

Z-order codes are held to ``reference64.morton_code`` (a loop over Python ints); the Hilbert
curve to what defines it, on every cell of full grids of 1 to 3 dims: each cell once, each
step to a face neighbour, from the origin, and every aligned sub-cube one run of the curve.
Serialized patch attention (sorted, ``document`` over patch ids, put back) is held in
float64 to attention with a dense mask of "same patch" built from the twin's order.

Shape alphabet: N points, n grid dims, B batch, H heads, T = S = N, D head dim.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from reference64 import attention64, morton_code

import qkv
from qkv import masks as M
from qkv.masks.points import _codes


def _full_grid(n: int, depth: int) -> torch.Tensor:
    side = range(2**depth)
    return torch.tensor(list(itertools.product(side, repeat=n)))  # (2^(n*depth), n)


def _sizes(*pairs: tuple[int, int]) -> list:
    """(n, depth) cases with ids like ``n3-depth16``."""
    return [pytest.param(n, d, id=f"n{n}-depth{d}") for n, d in pairs]


def _cloud(N: int, n: int = 3, side: int = 20, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, side, (N, n), generator=g)  # (N, n), repeats cells


@pytest.mark.parametrize("n, depth", _sizes((1, 5), (2, 3), (3, 2), (3, 16)))
def test_z_codes_equal_the_loop_twin(n, depth):
    cells = _cloud(300, n, side=min(2**depth, 1000))
    want = torch.tensor([morton_code(tuple(c.tolist()), depth) for c in cells])
    assert torch.equal(_codes(cells, "z", depth), want)


def test_closed_forms():
    """2x2 grids by hand, and 3D z-codes by bit: x is the most significant dim."""
    square = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    assert _codes(square, "z", 1).tolist() == [0, 1, 2, 3]  # Z: (0,0) (0,1) (1,0) (1,1)
    assert _codes(square, "hilbert", 1).tolist() == [0, 1, 3, 2]  # U: (0,0) (0,1) (1,1) (1,0)
    cube = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [3, 0, 0], [0, 0, 2]])
    assert _codes(cube, "z", 2).tolist() == [4, 2, 1, 4 + 32, 8]


def test_hilbert_codes_are_ptv3s():
    """Codes PTv3's encoder (serialization/hilbert.py, depth 16, and depth 3) gives for these
    cells, written down from a run of it: the same curve, the same orientation."""
    cells = torch.tensor([[1, 2, 3], [100, 7, 65535], [40000, 12345, 3], [0, 0, 1], [65535, 0, 0]])
    assert _codes(cells, "hilbert", 16).tolist() == [
        36,
        40210711253878,
        267092512510910,
        1,
        281474976710655,
    ]
    assert _codes(torch.tensor([[3, 1, 2], [0, 7, 5], [6, 6, 6]]), "hilbert", 3).tolist() == [
        36,
        154,
        360,
    ]


@pytest.mark.parametrize("n, depth", _sizes((1, 4), (2, 1), (2, 2), (2, 4), (3, 1), (3, 2), (3, 3)))
def test_hilbert_walks_every_cell_by_face_neighbours(n, depth):
    cells = _full_grid(n, depth)
    codes = _codes(cells, "hilbert", depth)
    assert torch.equal(codes.sort().values, torch.arange(len(cells)))  # a bijection
    walk = cells[codes.argsort()]  # (2^(n*depth), n) cells in curve order
    assert walk[0].tolist() == [0] * n
    steps = (walk[1:] - walk[:-1]).abs().sum(-1)
    assert torch.equal(steps, torch.ones_like(steps))  # each step one cell along one dim


@pytest.mark.parametrize("curve", ["z", "hilbert"])
@pytest.mark.parametrize("n, depth", _sizes((2, 3), (3, 3)))
def test_aligned_subcubes_are_runs(curve, n, depth):
    """Each aligned cube of side 2^j is visited in one go (both curves are octree orders)."""
    cells = _full_grid(n, depth)
    walk = cells[_codes(cells, curve, depth).argsort()]
    for j in range(1, depth):
        cube = walk // 2**j  # (N, n): the cube of side 2^j of each cell
        changes = (cube[1:] != cube[:-1]).any(-1).sum().item()
        assert changes == 2 ** (n * (depth - j)) - 1


@pytest.mark.parametrize("curve", ["z", "hilbert"])
def test_layout_sorts_stably_and_puts_back(curve):
    cells = _cloud(200, side=4)  # many points share a cell
    perm, inverse = layout = M.serialize(cells, curve)
    codes = _codes(cells, curve, 16)
    assert torch.equal(inverse[perm], torch.arange(200))
    assert (codes[perm][1:] >= codes[perm][:-1]).all()
    same = codes[perm][1:] == codes[perm][:-1]
    assert (perm[1:][same] > perm[:-1][same]).all()  # a cell's points keep their input order
    x = torch.randn(2, 200, 5)
    assert torch.equal(layout.from_tiles(layout.to_tiles(x, dim=1), dim=1), x)


def test_batch_keeps_clouds_apart_in_order():
    cells = _cloud(120, side=8)
    batch = torch.arange(120) % 3  # three clouds, interleaved
    perm, _ = M.serialize(cells, "hilbert", batch=batch, depth=3)
    assert torch.equal(batch[perm], torch.arange(3).repeat_interleave(40))
    for b in range(3):
        mine = (batch == b).nonzero().squeeze(1)  # (40,) the cloud's points
        alone, _ = M.serialize(cells[mine], "hilbert", depth=3)
        assert torch.equal(perm[b * 40 : (b + 1) * 40], mine[alone])


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.rand(5, 3),), {}, "integer tensor .N, n."),
        ((torch.zeros(5, 4, dtype=torch.long),), {}, "n = 1 to 3"),
        ((torch.zeros(5, 3, dtype=torch.long), "peano"), {}, "curve must be one of"),
        ((torch.zeros(5, 3, dtype=torch.long),), {"depth": 21}, "n \\* depth <= 62"),
        ((torch.tensor([[0, -1, 2]]),), {}, "run from -1 to 2 but depth=16"),
        ((torch.tensor([[0, 8, 2]]),), {"depth": 3}, "hold 0 to 7; subtract the minimum"),
        ((torch.zeros(5, 3, dtype=torch.long),), {"batch": torch.zeros(4)}, "batch must be"),
        (
            (torch.zeros(2, 3, dtype=torch.long),),
            {"batch": torch.tensor([0, 2**15])},
            "must lie in 0..32767",
        ),
    ],
    ids=["float", "4-dims", "curve", "depth", "negative", "off-grid", "batch-shape", "batch-big"],
)
def test_errors_name_the_numbers(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        M.serialize(*args, **kwargs)


@pytest.mark.parametrize("backend", ["tiled", "reference", "auto"])
def test_patch_attention_equals_dense_same_patch_mask(backend):
    """PTv3's attention: sort along z, patches of K as documents, put back; the golden sorts
    by the loop twin's codes and allows pairs in the same patch."""
    N, K, B, H, D = 97, 16, 1, 2, 8
    g = torch.Generator().manual_seed(1)
    xyz = torch.rand(N, 3, generator=g, dtype=torch.float64)  # (N, 3) in the unit cube
    cells = (xyz / 0.1).floor().long()  # (N, 3) grid of 10 cells a side
    q, k, v = torch.randn(3, B, H, N, D, generator=g, dtype=torch.float64).unbind(0)
    layout = M.serialize(cells, "z", depth=4)
    patch = torch.arange(N) // K  # (N,) patch of each position along the curve
    out = qkv.scaled_dot_product_attention(
        *(layout.to_tiles(t) for t in (q, k, v)), mask_mod=M.document(patch), backend=backend
    )
    out = layout.from_tiles(out)  # (B, H, N, D) input order

    order = sorted(range(N), key=lambda i: (morton_code(tuple(cells[i].tolist()), 4), i))
    patch_of = {point: pos // K for pos, point in enumerate(order)}
    allowed = torch.tensor([[patch_of[i] == patch_of[j] for j in range(N)] for i in range(N)])
    torch.testing.assert_close(out, attention64(q, k, v, allowed=allowed))
    # the same patches as documents in input order, without sorting: the same result
    unsorted = qkv.scaled_dot_product_attention(
        q, k, v, mask_mod=M.document(layout.inverse // K), backend=backend
    )
    torch.testing.assert_close(unsorted, out)


def test_compiles_whole():
    """One graph, no break, equal to eager. aot_eager: the graph dynamo and AOTAutograd make of
    qkv's code is what is tested; inductor's C++ for the Hilbert loop took 70 s to build cold."""
    cells = _cloud(64, side=16)
    eager = M.serialize(cells, "hilbert", depth=4)
    compiled = torch.compile(M.serialize, fullgraph=True, backend="aot_eager")(
        cells, "hilbert", depth=4
    )
    assert torch.equal(compiled.perm, eager.perm) and torch.equal(compiled.inverse, eager.inverse)
