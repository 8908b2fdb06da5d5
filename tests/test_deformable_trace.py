"""The deformable trace and its capture (issue 40, item 3: see-through).

``qkv.DeformableTrace`` holds each query's sampling points in pixels of each level (the
``grid_sample`` ``align_corners=False`` convention: ``x * W - 0.5``, pixel centres at the
integers) and their weights. Checked here against closed forms (where a location lands in
pixels; a map whose values are its own pixel coordinates, sampled there), against the
module's parameters applied by hand in float64 (offsets, softmaxed weights, reference points
and boxes), and through ``qkv.capture``: recorded from ``qkv.nn.MultiScaleDeformableAttention``
(and bare ``qkv.deformable_attention`` calls) inside a model, bounded by batch/heads/rows as
an attention capture is, saved and loaded, beside ordinary attention in one model.

Shape alphabet: B batch, Lq queries, S flattened value length, C model dim, M heads, D head
dim, L levels, P points.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv
from qkv.capture import CapturedDeformable

LEVELS = [(4, 6), (3, 5), (1, 2)]  # (H, W): W != H on every level, a 1-pixel-high one
S = sum(h * w for h, w in LEVELS)
F64 = dict(dtype=torch.float64)


def _module(C=8, M=2, P=3, *, first=True, seed=0) -> qkv.nn.MultiScaleDeformableAttention:
    """A float64 module with every parameter drawn at random (mmcv's init zeroes the offset
    and weight projections, which would leave the query out of the points)."""
    m = qkv.nn.MultiScaleDeformableAttention(
        C, M, len(LEVELS), P, dropout=0.0, batch_first=first
    ).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, **F64) * 0.5)
    return m


def _by_hand(m, query, reference_points):
    """The module's points and weights from its parameters, in float64, in normalised units
    and in pixels: ``(locations_px, weights, reference_px)``.

    Shape:
        query (B, Lq, C); reference_points (B, Lq, L, 2 or 4) -> (B, Lq, M, L, P, 2),
        (B, Lq, M, L, P), (B, Lq, L, 2).
    """
    B, Lq, _ = query.shape
    M, L, P = m.num_heads, m.num_levels, m.num_points
    w_off, b_off = m.sampling_offsets.weight, m.sampling_offsets.bias
    w_att, b_att = m.attention_weights.weight, m.attention_weights.bias
    offsets = (query @ w_off.T + b_off).view(B, Lq, M, L, P, 2)
    logits = (query @ w_att.T + b_att).view(B, Lq, M, L * P)
    weights = (logits - logits.logsumexp(-1, keepdim=True)).exp().view(B, Lq, M, L, P)
    wh = torch.tensor([[w, h] for h, w in LEVELS], **F64)  # (L, 2) as (W, H)
    ref = reference_points[:, :, None, :, None, :]  # (B, Lq, 1, L, 1, 2 or 4)
    if reference_points.shape[-1] == 2:
        loc = ref + offsets / wh[:, None, :]  # offsets are in pixels of each level
    else:
        loc = ref[..., :2] + offsets / P * ref[..., 2:] * 0.5  # boxes: (x, y, w, h)
    pixels = loc * wh[:, None, :] - 0.5  # (B, Lq, M, L, P, 2)
    ref_px = reference_points[..., :2] * wh - 0.5  # (B, Lq, L, 2)
    return pixels, weights, ref_px


class Detector(nn.Module):
    """A deformable encoder layer inside a model (the site capture names)."""

    def __init__(self, m):
        super().__init__()
        self.encoder = nn.ModuleDict({"attn": m})

    def forward(self, query, value, ref):
        m = self.encoder["attn"]
        if not m.batch_first:
            query, value = query.transpose(0, 1), value.transpose(0, 1)  # (Lq, B, C), (S, B, C)
        return m(query, value=value, reference_points=ref, spatial_shapes=torch.tensor(LEVELS))


def _inputs(B=2, Lq=5, C=8, *, box=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, Lq, C, generator=g, **F64)
    value = torch.randn(B, S, C, generator=g, **F64)
    ref = torch.rand(B, Lq, len(LEVELS), 4 if box else 2, generator=g, **F64)
    if box:
        ref[..., 2:] *= 0.5
    return query, value, ref


# ----------------------------------------------------------------------------- pixels
def test_pixel_coordinates_closed_form():
    """On a 4 x 6 level: (0, 0) is the outer corner of the top-left pixel, (-0.5, -0.5);
    (1/12, 1/8) its centre, (0, 0); (0.5, 0.5) the map's centre, (2.5, 1.5); (1, 1) the
    outer corner of the bottom-right pixel, (5.5, 3.5)."""
    at = torch.tensor([[0.0, 0.0], [1 / 12, 1 / 8], [0.5, 0.5], [1.0, 1.0]], **F64)
    loc = at.view(1, 1, 1, 1, 4, 2)  # (B, Lq, M, L, P, 2)
    value = torch.zeros(1, 24, 1, 1, **F64)  # (B, S, M, D)
    w = torch.full((1, 1, 1, 1, 4), 0.25, **F64)
    out, trace = qkv.deformable_attention(value, [(4, 6)], loc, w, return_trace=True)
    assert out.shape == (1, 1, 1)
    want = torch.tensor([[-0.5, -0.5], [0.0, 0.0], [2.5, 1.5], [5.5, 3.5]], **F64)
    torch.testing.assert_close(trace.locations[0, 0, 0, 0], want, rtol=0, atol=1e-15)
    torch.testing.assert_close(trace.weights, w, rtol=0, atol=0)
    assert trace.reference_points is None  # a bare call has no reference points
    assert trace.spatial_shapes.tolist() == [[4, 6]] and trace.spatial_shapes.dtype == torch.int64
    torch.testing.assert_close(trace.sampling_locations, loc)  # and back to [0, 1]


def test_pixel_coordinates_are_where_the_sampling_reads():
    """Each level's map holds its pixels' own coordinates: value at pixel (column i, row j)
    is ``i + 10 j + 100 l``. Bilinear sampling is exact on a linear map, so a point inside
    the pixel centres' hull samples ``px + 10 py + 100 l`` of its trace coordinates: the
    trace's pixels are the sampling's pixels."""
    g = torch.Generator().manual_seed(0)
    B, Lq, M, P, L = 2, 7, 3, 2, len(LEVELS)
    maps = []
    for lvl, (h, w) in enumerate(LEVELS):
        j, i = torch.meshgrid(torch.arange(h, **F64), torch.arange(w, **F64), indexing="ij")
        maps.append((i + 10 * j + 100 * lvl).reshape(-1))  # (H*W,) row-major
    value = torch.cat(maps).view(1, S, 1, 1).expand(B, S, M, 1).contiguous()  # (B, S, M, D=1)
    wh = torch.tensor([[w, h] for h, w in LEVELS], **F64)  # (L, 2) as (W, H)
    # inside the centres' hull: normalised in [0.5 / W, 1 - 0.5 / W] (a 1-pixel side: 0.5)
    u = torch.rand(B, Lq, M, L, P, 2, generator=g, **F64)
    loc = (0.5 + u * (wh[:, None, :] - 1)) / wh[:, None, :]  # (B, Lq, M, L, P, 2)
    weights = torch.rand(B, Lq, M, L, P, generator=g, **F64)
    out, trace = qkv.deformable_attention(
        value, torch.tensor(LEVELS), loc, weights, return_trace=True
    )  # (B, Lq, M)
    px, py = trace.locations.unbind(-1)  # (B, Lq, M, L, P) each
    level = torch.arange(L, **F64).view(L, 1)
    want = (weights * (px + 10 * py + 100 * level)).sum((-2, -1))  # (B, Lq, M)
    torch.testing.assert_close(out, want)
    # and the pixels are x * W - 0.5, y * H - 0.5 of the locations given
    torch.testing.assert_close(trace.locations, loc * wh[:, None, :] - 0.5, rtol=0, atol=1e-13)


def test_half_precision_locations_are_float32_pixels():
    """A bfloat16 call's pixels are computed in float32 from its bfloat16 locations (bfloat16
    pixels would be 1 apart at x = 200)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(116, 200)]
    loc = torch.rand(1, 3, 1, 1, 2, 2, generator=g).bfloat16()
    w = torch.rand(1, 3, 1, 1, 2, generator=g).bfloat16()
    value = torch.randn(1, 116 * 200, 1, 4, generator=g).bfloat16()
    _, trace = qkv.deformable_attention(value, shapes, loc, w, return_trace=True)
    assert trace.locations.dtype == torch.float32 and trace.weights.dtype == torch.bfloat16
    want = loc.double() * torch.tensor([200.0, 116.0], **F64) - 0.5
    torch.testing.assert_close(trace.locations.double(), want, rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- the module
MODULE_CASES = {
    "points-batch-first": dict(box=False, first=True),
    "points-seq-first": dict(box=False, first=False),
    "boxes-batch-first": dict(box=True, first=True),
}


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_module_trace_and_capture_equal_the_parameters_by_hand(case):
    kw = MODULE_CASES[case]
    m = _module(first=kw["first"])
    model = Detector(m)
    query, value, ref = _inputs(box=kw["box"])
    px, weights, ref_px = _by_hand(m, query, ref)

    # return_trace: the same output, and the points by hand
    plain = model(query, value, ref)
    q_in, v_in = (query, value) if kw["first"] else (query.transpose(0, 1), value.transpose(0, 1))
    out, trace = m(
        q_in, value=v_in, reference_points=ref, spatial_shapes=torch.tensor(LEVELS),
        return_trace=True,
    )  # fmt: skip
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    torch.testing.assert_close(trace.locations, px)
    torch.testing.assert_close(trace.weights, weights)
    torch.testing.assert_close(trace.reference_points, ref_px)
    torch.testing.assert_close(trace.weights.sum((-2, -1)), torch.ones(2, 5, m.num_heads, **F64))

    # qkv.capture records the same from inside the model, and changes nothing
    with qkv.capture(model) as cap:
        captured_out = model(query, value, ref)
    torch.testing.assert_close(captured_out, plain, rtol=0, atol=0)
    assert cap.records == [] and len(cap.deformable) == 1 and cap.sites == ["encoder.attn"]
    rec = cap.deformable[0]
    assert isinstance(rec, CapturedDeformable) and cap["encoder.attn"] == [rec]
    assert cap.layer(0) == [rec] and (rec.name, rec.layer, rec.call) == ("encoder.attn", 0, 0)
    assert rec.shape == (2, 5, m.num_heads, len(LEVELS), m.num_points)
    torch.testing.assert_close(rec.locations, px)
    torch.testing.assert_close(rec.weights, weights)
    torch.testing.assert_close(rec.reference_points, ref_px)
    assert rec.spatial_shapes.tolist() == [list(s) for s in LEVELS]
    assert [t.tolist() for t in (rec.batch, rec.heads, rec.rows)] == [
        [0, 1],
        [0, 1],
        [0, 1, 2, 3, 4],
    ]
    assert not rec.locations.requires_grad and not rec.weights.requires_grad


def test_point_reference_offsets_are_pixels_of_each_level():
    """With 2-d reference points, mmcv's offsets are in pixels of each level: a point's
    pixel coordinates are its reference point's plus its offset. mmcv's initial offsets put
    head m's point p at ``(p + 1)`` times ``(cos, sin)(2 pi m / M)`` scaled to a larger
    coordinate of 1: with M = 4, heads point right, down, left, up."""
    m = qkv.nn.MultiScaleDeformableAttention(8, 4, len(LEVELS), 2, dropout=0.0, batch_first=True)
    m = m.double()  # mmcv's init: the offsets are the biases alone
    query, value, ref = _inputs(B=1, Lq=3)
    _, trace = m(
        query, value=value, reference_points=ref, spatial_shapes=torch.tensor(LEVELS),
        return_trace=True,
    )  # fmt: skip
    steps = trace.locations - trace.reference_points[:, :, None, :, None, :]  # (1, 3, 4, L, 2, 2)
    ray = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]], **F64)  # (M, 2)
    want = ray[:, None, None, :] * torch.tensor([1.0, 2.0], **F64)[None, None, :, None]
    # mmcv computes the rays in float32: cos(pi / 2) is -4.4e-8 there, times 2 points out
    torch.testing.assert_close(steps, want.expand_as(steps), rtol=0, atol=2 * 2**-23)
    torch.testing.assert_close(trace.weights, torch.full_like(trace.weights, 1 / (2 * len(LEVELS))))


def test_trace_select_picks_batch_rows_heads():
    m = _module(C=12, M=3)
    query, value, ref = _inputs(B=2, Lq=6, C=12)
    _, t = m(query, value=value, reference_points=ref, spatial_shapes=LEVELS, return_trace=True)
    part = t.select(batch=[1], rows=range(5, 1, -2), heads=2)
    assert part.weights.shape == (1, 2, 1, len(LEVELS), 3)
    torch.testing.assert_close(part.locations, t.locations[1:2, [5, 3]][:, :, [2]], rtol=0, atol=0)
    torch.testing.assert_close(part.weights, t.weights[1:2, [5, 3]][:, :, [2]], rtol=0, atol=0)
    torch.testing.assert_close(part.reference_points, t.reference_points[1:2, [5, 3]])
    with pytest.raises(ValueError, match="heads index out of range for size 3"):
        t.select(heads=[3])


# ----------------------------------------------------------------------------- capture
def test_bounded_capture_is_the_same_slice_of_the_whole():
    m = _module(C=12, M=3)
    model = Detector(m)
    query, value, ref = _inputs(B=3, Lq=6, C=12)
    with qkv.capture(model) as whole:
        model(query, value, ref)
    with qkv.capture(model, batch=[2, 0], heads=[1], rows=[-1, 0, 99]) as part:
        model(query, value, ref)
    a, b = whole.deformable[0], part.deformable[0]
    assert [t.tolist() for t in (b.batch, b.heads, b.rows)] == [[2, 0], [1], [5, 0]]
    assert b.shape == a.shape == (3, 6, 3, len(LEVELS), 3)
    pick = lambda t: t[[2, 0]][:, [5, 0]][:, :, [1]]  # noqa: E731
    torch.testing.assert_close(b.locations, pick(a.locations), rtol=0, atol=0)
    torch.testing.assert_close(b.weights, pick(a.weights), rtol=0, atol=0)
    torch.testing.assert_close(b.reference_points, a.reference_points[[2, 0]][:, [5, 0]])
    # a kept slice is its own storage: it does not hold the call's whole tensors
    assert b.locations.untyped_storage().nbytes() == b.locations.numel() * 8
    refused = r"heads \[3\] asked for, but the deformable .* heads 0\.\.2"
    with pytest.raises(ValueError, match=refused), qkv.capture(model, heads=[3]):
        model(query, value, ref)


def test_capture_sees_bare_deformable_calls_and_gradients_are_unchanged():
    """A model calling qkv.deformable_attention itself is recorded too (no reference points:
    the call is given only locations), and the forward's gradients are those uncaptured."""

    class Sampler(nn.Module):
        def forward(self, value, loc, w):
            return qkv.deformable_attention(value, torch.tensor(LEVELS), loc, w)

    model = nn.Sequential()
    model.add_module("sampler", Sampler())
    g = torch.Generator().manual_seed(0)
    value = torch.randn(1, S, 2, 3, generator=g, **F64, requires_grad=True)
    loc = torch.rand(1, 4, 2, len(LEVELS), 2, 2, generator=g, **F64, requires_grad=True)
    w = torch.rand(1, 4, 2, len(LEVELS), 2, generator=g, **F64, requires_grad=True)
    plain = model[0](value, loc, w)
    grads = torch.autograd.grad(plain.sum(), (value, loc, w))
    with qkv.capture(model) as cap:
        out = model[0](value, loc, w)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(out.sum(), (value, loc, w)), grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (rec,) = cap["sampler"]
    assert rec.reference_points is None
    wh = torch.tensor([[w_, h] for h, w_ in LEVELS], **F64)[:, None, :]  # (L, 1, 2)
    torch.testing.assert_close(rec.locations, loc.detach() * wh - 0.5, rtol=0, atol=1e-15)
    torch.testing.assert_close(rec.weights, w.detach(), rtol=0, atol=0)


class Mixed(nn.Module):
    """Self-attention, then deformable cross-attention (a Deformable DETR decoder layer)."""

    def __init__(self):
        super().__init__()
        self.self_attn = qkv.MultiHeadAttention(8, 2).double()
        self.cross_attn = _module()

    def forward(self, query, value, ref):
        query = query + self.self_attn(query)
        return self.cross_attn(
            query, value=value, reference_points=ref, spatial_shapes=torch.tensor(LEVELS)
        )


def test_one_model_with_both_kinds_saved_and_loaded(tmp_path):
    model = Mixed()
    query, value, ref = _inputs()
    with qkv.capture(model) as cap:
        model(query, value, ref)
    assert cap.sites == ["self_attn", "cross_attn"]
    assert len(cap) == 1 and [r.name for r in cap] == ["self_attn"]  # attention weights
    assert [r.name for r in cap.deformable] == ["cross_attn"] and "cross_attn" in cap
    assert isinstance(cap.layer(1)[0], CapturedDeformable)
    assert "1 records and 1 deformable from 2 of 2 sites" in repr(cap)
    assert "layer  1  cross_attn: 1 call, points (2, 5, 2, 3, 3) torch.float64" in repr(cap)
    # the capture's query runs through self-attention first: the points are of that query
    px, weights, _ = _by_hand(model.cross_attn, query + model.self_attn(query), ref)
    torch.testing.assert_close(cap.deformable[0].locations, px)
    torch.testing.assert_close(cap.deformable[0].weights, weights)

    with qkv.capture(model, layers=["cross_attn"]) as only:
        model(query, value, ref)
    assert only.records == [] and len(only.deformable) == 1

    path = tmp_path / "cap.pt"
    cap.save(path)
    back = qkv.load_capture(path)
    assert back.sites == cap.sites and len(back.records) == 1 and len(back.deformable) == 1
    a, b = cap.deformable[0], back.deformable[0]
    for name in ("locations", "weights", "reference_points", "spatial_shapes", "batch", "rows"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=0, atol=0)
    assert (b.name, b.layer, b.call, b.shape) == (a.name, a.layer, a.call, a.shape)
    torch.testing.assert_close(b.trace.locations, a.locations, rtol=0, atol=0)

    # a file written before deformable records existed has no "deformable" key
    data = torch.load(path, weights_only=True)
    del data["deformable"]
    torch.save(data, tmp_path / "old.pt")
    assert qkv.load_capture(tmp_path / "old.pt").deformable == []


def test_rows_that_match_no_query_are_refused():
    model = Detector(_module())
    query, value, ref = _inputs(Lq=5)
    refused = r"rows=\[7\] matched no query row: .* T=5"
    with pytest.raises(ValueError, match=refused), qkv.capture(model, rows=[7]):
        model(query, value, ref)
