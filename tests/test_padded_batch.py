"""Padded batches and packed rows with documents of their own on the tiled backend: each run
of batch elements attends its own keys (``qkv.ops.tiled.batch.batch_pieces``), so a window
keeps its diagonal groups and no chunk is masked for padding or boundaries that only some
elements have. Which calls are cut and how, when cutting pays, and that the answers are the
reference's (float64), gradients, sinks, traces and NaN in padding included.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.ops import AttentionCall
from qkv.ops.tiled import batch as Bt
from qkv.ops.tiled import plan as P

B, H, T, S, D = 4, 2, 150, 150, 8


@pytest.fixture(autouse=True)
def _cut_every_padded_batch(monkeypatch):
    """These batches are small: cutting them costs more than it saves (``_worth_cutting``),
    and the tests are about the cut calls. Pieces cost nothing here but in the test of that."""
    monkeypatch.setattr(Bt, "PIECE_SCORES", 0)


def _qkv(T=T, S=S, G=H, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, h, n, D, generator=g, dtype=torch.float64).requires_grad_(grad)
        for h, n in ((H, T), (G, S), (G, S))
    )


def _pieces(q, k, v, **kw):
    call = AttentionCall.build(q, k, v, **kw)
    pieces = Bt.batch_pieces(call, *call.BH, None, P.BLOCK_Q, P.BLOCK_K, q.dtype)
    return None if pieces is None else [(p.index, p.k0, p.k1) for p in pieces]


LENGTHS = torch.tensor([150, 90, 0, 90])
# packed rows with documents of their own: 3, 2, 2 (as the row before) and 1 documents
DOCS = torch.stack(
    [torch.arange(S) // 50, torch.arange(S) // 100, torch.arange(S) // 100, torch.zeros(S)]
).long()
RIGHT = (torch.arange(S) < LENGTHS[:, None])[:, None, None, :]  # (B, 1, 1, S)
LEFT = (torch.arange(S) >= S - LENGTHS[:, None])[:, None, None, :]


def test_padded_batches_are_cut_by_each_elements_keys():
    q, k, v = _qkv()
    # consecutive elements with the same keys share a piece; an element with no key gets one
    # key that none may attend
    want = [(slice(0, 1), 0, 150), (slice(1, 2), 0, 90), (slice(2, 3), 0, 1), (slice(3, 4), 0, 90)]
    assert _pieces(q, k, v, mask_mod=M.key_lengths(LENGTHS)) == want
    assert _pieces(q, k, v, attn_mask=RIGHT, is_causal=True) == want
    assert _pieces(q, k, v, attn_mask=LEFT, mask_mod=M.sliding_window(9)) == [
        (slice(0, 1), 0, 150),
        (slice(1, 2), 60, 150),
        (slice(2, 3), 0, 1),
        (slice(3, 4), 60, 150),
    ]
    # documents per element: rows 1 and 2 have the same, one piece
    assert _pieces(q, k, v, mask_mod=M.document(DOCS)) == [
        (slice(0, 1), 0, 150),
        (slice(1, 3), 0, 150),
        (slice(3, 4), 0, 150),
    ]
    assert _pieces(q, k, v, mask_mod=M.key_lengths(torch.tensor([150, 90, 90, 0]))) == [
        (slice(0, 1), 0, 150),
        (slice(1, 3), 0, 90),
        (slice(3, 4), 0, 1),
    ]
    # key lengths and a key mask together: their intersection
    both = dict(attn_mask=LEFT, mask_mod=M.key_lengths(torch.tensor([100, 100, 150, 150])))
    assert _pieces(q, k, v, **both) == [
        (slice(0, 1), 0, 100),
        (slice(1, 2), 60, 100),
        (slice(2, 3), 0, 1),
        (slice(3, 4), 60, 150),
    ]


@pytest.mark.parametrize(
    "kw",
    [
        dict(mask_mod=M.key_lengths(torch.tensor([90, 90, 90, 90]))),  # one range for all
        dict(mask_mod=M.key_lengths(90)),
        dict(attn_mask=RIGHT.expand(B, 1, T, S)),  # a mask per row: not padding
        dict(attn_mask=RIGHT.expand(B, H, 1, S)),  # a mask per head
        dict(attn_mask=RIGHT & (torch.arange(S) % 7 != 3)),  # holes in the keys
        dict(attn_mask=RIGHT.double().log()),  # a float mask
        dict(mask_mod=M.or_masks(M.key_lengths(LENGTHS), M.causal())),
        dict(mask_mod=M.and_masks(M.document(torch.arange(S) // 50), M.document(DOCS))),
        dict(mask_mod=M.document(DOCS[:1].expand(B, S))),  # ids per element, all the same
        dict(mask_mod=M.key_lengths(LENGTHS), score_mod=M.softcap(5.0)),
        dict(mask_mod=M.and_masks(M.key_lengths(LENGTHS), lambda b, h, q, k: k != q)),
    ],
    ids=lambda kw: "-".join(sorted(kw)),
)
def test_what_is_not_a_padded_batch_is_not_cut(kw):
    q, k, v = _qkv()
    assert _pieces(q, k, v, **kw) is None
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    ref = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


CASES = {
    "key lengths": dict(mask_mod=M.key_lengths(LENGTHS)),
    "causal": dict(mask_mod=M.key_lengths(LENGTHS), is_causal=True),
    "window": dict(mask_mod=M.and_masks(M.sliding_window(20), M.key_lengths(LENGTHS))),
    "left padded causal": dict(attn_mask=LEFT, is_causal=True),
    "right padded band": dict(attn_mask=RIGHT, mask_mod=M.sliding_window(7, 5)),
    "bottom-right window": dict(
        attn_mask=LEFT, mask_mod=M.sliding_window(30, 0, align="bottom_right")
    ),
    "alibi": dict(attn_mask=LEFT, score_mod=M.alibi(M.alibi_slopes(H)), is_causal=True),
    "sinks": dict(mask_mod=M.key_lengths(LENGTHS), is_causal=True, sinks=torch.tensor([0.5, -1])),
    # (documents: queries' ids of their own length, the first of the keys')
    "documents per element": lambda T: dict(mask_mod=M.document(DOCS[:, :T], DOCS)),
    "causal documents per element": lambda T: dict(
        mask_mod=M.document(DOCS[:, :T], DOCS), is_causal=True
    ),
    "padded documents": lambda T: dict(
        attn_mask=LEFT, mask_mod=M.document(torch.arange(T) // 40, torch.arange(S) // 40)
    ),
    "padded documents per element": lambda T: dict(
        mask_mod=M.and_masks(
            M.document(DOCS[:, :T], DOCS), M.key_lengths(LENGTHS), M.sliding_window(30)
        )
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shape", ["self", "cross", "gqa"])
def test_padded_batches_give_the_references_answer(name, shape):
    Tq, G = (61, H) if shape == "cross" else (T, 1 if shape == "gqa" else H)
    kw = CASES[name](Tq) if callable(CASES[name]) else dict(CASES[name])
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].double().requires_grad_()
    runs = {}
    for backend in ("tiled", "reference"):
        q, k, v = _qkv(T=Tq, G=G, grad=True)
        out = qkv.scaled_dot_product_attention(q, k, v, backend=backend, enable_gqa=G != H, **kw)
        wrt = (q, k, v) + ((kw["sinks"],) if "sinks" in kw else ())
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
        runs[backend] = (out, *torch.autograd.grad(out, wrt, dout))
    assert _pieces(q, k, v, enable_gqa=G != H, **kw) is not None
    for got, want in zip(runs["tiled"], runs["reference"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_traces_and_second_derivatives_of_a_padded_batch():
    kw = CASES["window"]
    traces = {}
    for backend in ("tiled", "reference"):
        q, k, v = _qkv(grad=True)
        out, trace = qkv.scaled_dot_product_attention(
            q, k, v, backend=backend, return_trace=True, **kw
        )
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        hvp = torch.autograd.grad(dq.sum(), (q, k, v))
        traces[backend] = (out, trace.probs, trace.lse, dq, *hvp)
    for got, want in zip(traces["tiled"], traces["reference"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", ["tiled", "auto"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_values_in_padding_have_no_effect(backend, poison):
    q, k, v = _qkv(grad=False)
    k, v = k.clone(), v.clone()
    pad = ~RIGHT[:, 0, 0, :]  # (B, S)
    want = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **CASES["causal"])
    k[:, 0][pad], v[:, 1][pad] = poison, poison
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **CASES["causal"])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_a_causal_piece_is_one_call_of_the_kernels_own_causal():
    """Causal with key lengths: each element's piece is top-left causal on its keys, the
    flash kernel's ``is_causal`` in one call (no tile masked at the diagonal)."""
    q, k, v = _qkv()
    call = AttentionCall.build(q, k, v, **CASES["causal"])
    if P._pick_inner(call, q.dtype) != "flash":
        pytest.skip("torch's CPU flash kernel is not available here")
    pieces = Bt.batch_pieces(call, *call.BH, None, P.BLOCK_Q, P.BLOCK_K, q.dtype)
    assert pieces is not None
    units = {(p.k0, p.k1): [(u.t0, u.tq, u.causal) for u in p.plan.units] for p in pieces}
    assert units == {(0, 150): [(0, T, True)], (0, 90): [(0, T, True)], (0, 1): []}
    # causal documents per element: one causal call per document of each element's own
    call = AttentionCall.build(q, k, v, mask_mod=M.document(DOCS), is_causal=True)
    pieces = Bt.batch_pieces(call, *call.BH, None, P.BLOCK_Q, P.BLOCK_K, q.dtype)
    assert pieces is not None
    units = [[(u.t0, u.tq, u.causal) for u in p.plan.units] for p in pieces]
    assert not any(c for _, _, c in units[0])  # documents of 50 rows: under 64, tiles
    assert units[1:] == [[(0, 100, True), (100, 50, True)], [(0, T, True)]]


def test_a_batch_is_cut_only_where_its_pieces_save_more_than_they_cost(monkeypatch):
    """Each piece costs ``PIECE_SCORES`` scores beside its work; a batch is cut where the
    scores its pieces leave out (padding keys, times rows and heads, under its windows) are
    more than that."""

    def worth(T, windows=(), H=2):  # keys 100, 60, 60: two pieces; the union is [0, 100)
        lengths = [M.key_lengths(torch.tensor([100, 60, 60]))]
        layout = Bt._layout(lengths, None, None, 3, T, 100)
        assert layout is not None and len(layout.runs) == 2
        return Bt._worth_cutting(layout, list(windows), H)

    monkeypatch.setattr(Bt, "PIECE_SCORES", 1000)
    # no window: 2 elements x 40 keys x T rows x H heads saved
    assert not worth(T=12)  # 1920 <= 2 x 1000
    assert worth(T=13)  # 2080
    # causal (top-left): row q sees keys 0..q, so rows below 60 lose nothing to the padding
    causal = M.causal().bind(3, 2, 100, 100)
    saved = 2 * 2 * sum(max(0, q - 59) for q in range(100))  # 2 elements x 2 heads x 820
    assert saved == 3280
    monkeypatch.setattr(Bt, "PIECE_SCORES", 1639)
    assert worth(100, [causal])
    monkeypatch.setattr(Bt, "PIECE_SCORES", 1640)  # two pieces cost as much as they save
    assert not worth(100, [causal])
    # a window of 10 keys back from each row: only the rows that reach past key 60 save
    band = M.sliding_window(10).bind(3, 2, 100, 100)
    monkeypatch.setattr(Bt, "PIECE_SCORES", 0)
    assert worth(100, [band])
    assert not worth(60, [band])  # rows 0..59 never reach key 60
