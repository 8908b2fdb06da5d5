"""``qkv.nn.MultiScaleDeformableAttention`` (issue 40, item 2): mmcv's module on qkv's kernel.

A state dict laid out as mmcv's (four ``nn.Linear`` under mmcv's names) loads unchanged and
gives the outputs and gradients of mmcv's forward, written here from its definition on a
float64 ``grid_sample`` sampling (``reference`` of test_deformable.py): 2-d reference points,
4-d reference boxes, ``key_padding_mask`` (True = padding), ``batch_first`` both ways,
``query_pos`` and ``identity``. The initialisation is mmcv's, drawn from the same random stream.

Shape alphabet: B batch, Lq queries, S flattened value length, C model dim, M heads, L levels,
P points.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_deformable import reference
from torch import nn

import qkv

LEVELS = [(5, 7), (3, 4), (1, 2)]
S = sum(h * w for h, w in LEVELS)


class MmcvLayout(nn.Module):
    """mmcv's MultiScaleDeformableAttention, its parameters, initialisation and forward,
    sampling with the float64 grid_sample reference."""

    def __init__(self, embed_dims, num_heads, num_levels, num_points, value_proj_ratio=1.0):
        super().__init__()
        self.M, self.L, self.P = num_heads, num_levels, num_points
        value_dims = int(embed_dims * value_proj_ratio)
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, value_dims)
        self.output_proj = nn.Linear(value_dims, embed_dims)
        # mmcv's init_weights: zero offset weights, the ray-per-head offset biases, zero
        # attention weights, Xavier-uniform projections (value_proj first) with zero biases
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        thetas = torch.arange(num_heads, dtype=torch.float32) * (2.0 * math.pi / num_heads)
        grid = torch.stack([thetas.cos(), thetas.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(num_heads, 1, 1, 2)
        grid = grid.repeat(1, num_levels, num_points, 1)
        for i in range(num_points):
            grid[:, :, i, :] *= i + 1
        self.sampling_offsets.bias.data = grid.view(-1)
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        for proj in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1)
            nn.init.constant_(proj.bias, 0.0)

    def forward(self, query, value, identity, query_pos, key_padding_mask, ref, shapes, first):
        value = query if value is None else value
        identity = query if identity is None else identity
        query = query if query_pos is None else query + query_pos
        if not first:
            query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
        B, Lq, _ = query.shape
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(B, S, self.M, -1)
        offsets = self.sampling_offsets(query).view(B, Lq, self.M, self.L, self.P, 2)
        weights = self.attention_weights(query).view(B, Lq, self.M, self.L * self.P)
        weights = weights.softmax(-1).view(B, Lq, self.M, self.L, self.P)
        if ref.shape[-1] == 2:
            norm = torch.stack([shapes[..., 1], shapes[..., 0]], -1)
            loc = ref[:, :, None, :, None, :] + offsets / norm[None, None, None, :, None, :]
        else:
            loc = (
                ref[:, :, None, :, None, :2] + offsets / self.P * ref[:, :, None, :, None, 2:] * 0.5
            )
        out = self.output_proj(reference(value, LEVELS, loc, weights))
        if not first:
            out = out.permute(1, 0, 2)
        return out + identity


def _randomised(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter redrawn (mmcv's init zeroes the offset and weight projections, which
    would leave most of the forward untested)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return module


CASES = {
    "points-batch-first": dict(box=False, first=True),
    "points-seq-first": dict(box=False, first=False),
    "boxes-batch-first": dict(box=True, first=True),
    "points-padding-query-pos-identity": dict(box=False, first=True, extras=True),
    "boxes-ratio-half-seq-first-padding": dict(box=True, first=False, extras=True, ratio=0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_mmcv_state_dict_loads_and_gives_mmcv_outputs_and_gradients(case):
    kw = CASES[case]
    C, M, P, B, Lq = 16, 4, 3, 2, 6
    ratio = kw.get("ratio", 1.0)
    mmcv = _randomised(MmcvLayout(C, M, len(LEVELS), P, ratio), seed=0).double()
    ours = qkv.nn.MultiScaleDeformableAttention(
        C, M, len(LEVELS), P, dropout=0.0, batch_first=kw["first"], value_proj_ratio=ratio
    ).double()
    ours.load_state_dict(mmcv.state_dict())  # strict: the same names and shapes
    g = torch.Generator().manual_seed(1)
    lead = (B, Lq) if kw["first"] else (Lq, B)
    query = torch.randn(*lead, C, generator=g, dtype=torch.float64, requires_grad=True)
    vlead = (B, S) if kw["first"] else (S, B)
    value = torch.randn(*vlead, C, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.rand(B, Lq, len(LEVELS), 4 if kw["box"] else 2, generator=g, dtype=torch.float64)
    if kw["box"]:
        ref[..., 2:] *= 0.5  # boxes of up to half the map
    shapes = torch.tensor(LEVELS)
    extras = {}
    if kw.get("extras"):
        extras = dict(
            identity=torch.randn(*lead, C, generator=g, dtype=torch.float64),
            query_pos=torch.randn(*lead, C, generator=g, dtype=torch.float64),
            key_padding_mask=torch.arange(S) >= torch.tensor([[S], [S - 9]]),  # (B, S)
        )
    want = mmcv(
        query,
        value,
        extras.get("identity"),
        extras.get("query_pos"),
        extras.get("key_padding_mask"),
        ref,
        shapes,
        kw["first"],
    )
    got = ours(query, value=value, reference_points=ref, spatial_shapes=shapes, **extras)
    torch.testing.assert_close(got, want)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    leaves = [query, value, *ours.parameters()]
    mine = torch.autograd.grad(got, leaves, grad)
    theirs = torch.autograd.grad(want, [query, value, *mmcv.parameters()], grad)
    for name, a, b in zip(["query", "value", *dict(ours.named_parameters())], mine, theirs):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_initialisation_is_mmcvs_from_the_same_random_stream():
    with torch.random.fork_rng():
        torch.manual_seed(5)
        want = MmcvLayout(32, 8, 4, 4).state_dict()
        torch.manual_seed(5)
        got = qkv.nn.MultiScaleDeformableAttention(32, 8, 4, 4).state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # head 1 of 8 points at 45 degrees: its 3rd point's offset is 3 * (1, 1)
    bias = got["sampling_offsets.bias"].view(8, 4, 4, 2)
    torch.testing.assert_close(bias[1, 0, 2], torch.tensor([3.0, 3.0]))


def test_key_mask_is_the_opposite_polarity_of_key_padding_mask():
    module = _randomised(qkv.nn.MultiScaleDeformableAttention(8, 2, 3, 2, batch_first=True), 3)
    module.eval()
    g = torch.Generator().manual_seed(4)
    query, value = torch.randn(2, 5, 8, generator=g), torch.randn(2, S, 8, generator=g)
    ref = torch.rand(2, 5, 3, 2, generator=g)
    pad = torch.arange(S) >= torch.tensor([[S], [20]])  # (B, S): True = padding
    kw = dict(value=value, reference_points=ref, spatial_shapes=torch.tensor(LEVELS))
    torch.testing.assert_close(
        module(query, key_mask=~pad, **kw), module(query, key_padding_mask=pad, **kw)
    )
    with pytest.raises(ValueError, match=r"key_padding_mask .* or key_mask .* not both"):
        module(query, key_mask=~pad, key_padding_mask=pad, **kw)
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool tensor \(B, S\)"):
        module(query, key_padding_mask=pad[:, :5], **kw)
    with pytest.raises(ValueError, match=r"reference_points must be .* got shape \(2, 5, 3, 3\)"):
        module(query, value=value, reference_points=torch.rand(2, 5, 3, 3), spatial_shapes=LEVELS)


def test_bad_head_count_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"embed_dims=30 .* divisible by num_heads=8"):
        qkv.nn.MultiScaleDeformableAttention(30, 8)


@pytest.mark.parametrize("way", ["modules", "apply", "own-params-only", "init_weights"])
def test_a_module_built_on_meta_gets_mmcvs_initialisation(way):
    """Built on the meta device and materialised with ``to_empty``, the module is initialised
    as mmcv's whichever way torch's idioms call ``reset_parameters``: every module parent
    first (``modules()``), children first (``apply``), or only those holding parameters of
    their own (FSDP's way, which skips this module): the projections initialise themselves.
    Before, those ways gave ``nn.Linear``'s initialisation (or left memory as it was)."""
    with torch.device("meta"):
        module = qkv.nn.MultiScaleDeformableAttention(16, 4, 3, 2, batch_first=True)
    module.to_empty(device="cpu")
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))  # what to_empty leaves is garbage
    if way == "modules":
        for m in module.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    elif way == "apply":
        module.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    elif way == "own-params-only":
        for m in module.modules():
            if any(True for _ in m.parameters(recurse=False)):
                m.reset_parameters()
    else:
        module.init_weights()
    want = qkv.nn.MultiScaleDeformableAttention(16, 4, 3, 2, batch_first=True).state_dict()
    got = module.state_dict()
    for name in ("sampling_offsets.weight", "sampling_offsets.bias", "attention_weights.weight"):
        assert torch.equal(got[name], want[name]), name
    for name in ("attention_weights.bias", "value_proj.bias", "output_proj.bias"):
        assert torch.equal(got[name], torch.zeros_like(want[name])), name
    for name in ("value_proj.weight", "output_proj.weight"):  # Xavier-uniform's range
        w = got[name]
        bound = (6.0 / (w.shape[0] + w.shape[1])) ** 0.5
        assert torch.isfinite(w).all() and w.abs().max() <= bound and w.std() > bound / 3, name
