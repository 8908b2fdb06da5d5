"""ONNX export of deformable attention (issue 40, item 1): standard ops, ``GridSample`` per level.

ONNX has no deformable op, so under ``torch.onnx.export`` ``qkv.deformable_attention`` writes
its slow twin (one ``GridSample`` per level, opset 16's operator). These tests export the
function and ``qkv.nn.MultiScaleDeformableAttention`` on a tiny BEVFormer-like level set
(116x200, 58x100, 29x50, 15x25 scaled down) with points inside and outside the maps, check that
the graph holds only standard ONNX operators, and run it in onnxruntime: its output equals
qkv's (the C++ kernel) at float32 tolerance and is held to the float64 ``grid_sample``
reference by the tolerance policy, at the exported sizes and, where spatial_shapes is an
input, at other level sizes and query counts.

Shape alphabet: B batch, Lq queries, S flattened value length, C model dim, M heads, D head
dim, L levels, P points.
"""

from __future__ import annotations

import pytest
import torch
from test_deformable import reference

import qkv
from qkv.testing import assert_tolerance

for _name in ("onnx", "onnxscript"):
    pytest.importorskip(_name, reason=f"{_name} (in the test extras) is not installed")
ort = pytest.importorskip(
    "onnxruntime", reason="onnxruntime (in the test extras) runs the exported models"
)

BEV_LEVELS = [(8, 14), (4, 7), (2, 4), (1, 2)]  # BEVFormer's 116x200 ... 15x25, scaled down
OTHER_LEVELS = [(5, 9), (3, 5), (2, 3), (1, 1)]


def inputs(levels, *, B=2, Lq=6, M=2, D=4, P=3, seed=0, spread=0.3):
    """value, spatial_shapes, locations (some outside the maps by up to ``spread``), weights,
    in float64."""
    g = torch.Generator().manual_seed(seed)
    S, L = sum(h * w for h, w in levels), len(levels)
    value = torch.randn(B, S, M, D, generator=g, dtype=torch.float64)
    loc = torch.rand(B, Lq, M, L, P, 2, generator=g, dtype=torch.float64) * (1 + 2 * spread)
    attn = torch.rand(B, Lq, M, L, P, generator=g, dtype=torch.float64)
    return value, torch.tensor(levels), loc - spread, attn


def session(program):
    return ort.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )


def run(sess, **tensors):
    """The model's output for the named inputs (an input the graph does not read, such as
    level_start_index, is not one of its inputs)."""
    names = {i.name for i in sess.get_inputs()}
    (out,) = sess.run(None, {n: t.numpy() for n, t in tensors.items() if n in names})
    return torch.from_numpy(out)


def assert_standard_with_grid_sample(program, opset):
    model = program.model_proto
    assert {(o.domain, o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")} == {
        ("", opset)
    }
    domains = {n.domain for n in model.graph.node}
    assert domains <= {"", "ai.onnx"}, f"non-standard operators from {domains}"
    assert len(model.functions) == 0  # nothing hidden in a local function either
    kinds = [n.op_type for n in model.graph.node]
    assert kinds.count("GridSample") == len(BEV_LEVELS)  # one per level


class Functional(torch.nn.Module):
    def forward(self, value, spatial_shapes, sampling_locations, attention_weights):
        return qkv.deformable_attention(
            value, spatial_shapes, sampling_locations, attention_weights
        )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_function_exports_to_opset_16_and_runs_at_other_levels_and_query_counts():
    """spatial_shapes is a graph input: the level sizes are read at run time, so the model runs
    at another level set (and S) and another query count than it was exported at."""
    value, shapes, loc, attn = inputs(BEV_LEVELS)
    value, loc, attn = value.float(), loc.float(), attn.float()
    S, Lq = torch.export.Dim("S", min=4, max=4096), torch.export.Dim("Lq", min=1, max=1024)
    program = torch.onnx.export(
        Functional(),
        (value, shapes, loc, attn),
        dynamo=True,
        verbose=False,
        opset_version=16,
        dynamic_shapes=({1: S}, None, {1: Lq}, {1: Lq}),
    )
    assert_standard_with_grid_sample(program, 16)
    sess = session(program)
    for levels, Lq, seed in [(BEV_LEVELS, 6, 1), (OTHER_LEVELS, 11, 2)]:
        value, shapes, loc, attn = inputs(levels, Lq=Lq, seed=seed)  # float64
        golden = reference(value, levels, loc, attn)
        value, loc, attn = value.float(), loc.float(), attn.float()
        got = run(
            sess, value=value, spatial_shapes=shapes, sampling_locations=loc, attention_weights=attn
        )  # (B, Lq, M*D)
        torch.testing.assert_close(got, qkv.deformable_attention(value, shapes, loc, attn))
        assert_tolerance(got, golden, reference(value, levels, loc, attn))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_function_with_constant_levels_exports_at_the_default_opset():
    """spatial_shapes given as a list (constant in the graph), the exporter's default opset."""
    value, _, loc, attn = inputs(BEV_LEVELS, seed=3)
    value, loc, attn = value.float(), loc.float(), attn.float()

    class Constant(torch.nn.Module):
        def forward(self, v, lo, a):
            return qkv.deformable_attention(v, BEV_LEVELS, lo, a)

    program = torch.onnx.export(Constant(), (value, loc, attn), dynamo=True, verbose=False)
    opset = next(o.version for o in program.model_proto.opset_import if o.domain == "")
    assert opset >= 16
    assert_standard_with_grid_sample(program, opset)
    got = run(session(program), v=value, lo=loc, a=attn)
    torch.testing.assert_close(got, qkv.deformable_attention(value, BEV_LEVELS, loc, attn))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_module_exports_and_equals_its_eager_output_in_onnxruntime():
    """mmcv's module as BEVFormer calls it: spatial_shapes and level_start_index inputs,
    key_padding_mask (True = padding), batch_first=False, 2-d reference points; C=16, M=2,
    L=4, P=3."""
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)  # the module's own initialisation
    module = qkv.nn.MultiScaleDeformableAttention(16, 2, len(BEV_LEVELS), 3, dropout=0.0)
    with torch.no_grad():
        for p in module.parameters():  # mmcv's init zeroes the offsets' weights; redraw all
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    module.eval()
    shapes = torch.tensor(BEV_LEVELS)
    S, Lq, B = int(shapes.prod(1).sum()), 7, 2
    query = torch.randn(Lq, B, 16, generator=g)
    value = torch.randn(S, B, 16, generator=g)
    ref = torch.rand(B, Lq, len(BEV_LEVELS), 2, generator=g) * 1.4 - 0.2  # some outside
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, -9:] = True
    starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = module

        def forward(self, query, value, padding, ref, shapes, starts):
            return self.attn(
                query,
                value=value,
                key_padding_mask=padding,
                reference_points=ref,
                spatial_shapes=shapes,
                level_start_index=starts,
            )

    args = dict(query=query, value=value, padding=padding, ref=ref, shapes=shapes, starts=starts)
    program = torch.onnx.export(
        Call(), (), kwargs=args, dynamo=True, verbose=False, opset_version=16
    )
    assert_standard_with_grid_sample(program, 16)
    got = run(session(program), **args)
    with torch.no_grad():
        want = Call()(**args)  # (Lq, B, C)
    assert got.shape == (Lq, B, 16)
    torch.testing.assert_close(got, want)
