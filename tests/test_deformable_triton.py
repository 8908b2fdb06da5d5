"""The Triton kernels of ``qkv.deformable_attention`` (issue 40, item 1) under triton's
interpreter on the CPU.

Without a GPU the kernels run under ``qkv.ops.triton.interpreter()`` (CPU tensors, numpy per
block: about a second a forward+backward here, so sizes stay tiny: three levels (5, 7),
(3, 4), (2, 2), M = 2 heads, D = 8, P = 2 points, up to 7 queries). Held to a float64
reference written here with ``F.grid_sample`` (mmcv's ``multi_scale_deformable_attn_pytorch``),
forward and gradients for value, locations and weights: float64 to ``assert_close``'s
defaults, float32/bfloat16/float16 by the tolerance policy; points on the borders, outside by
a pixel or more (exactly zero, whatever the value holds there); the backward bit-identical run
to run where many samples share pixels; the kernel choice (``kernel="triton"``,
``QKV_DEFORMABLE_KERNEL=triton``, ``auto`` on CUDA) and its refusals. Nothing of the
interpreter leaks out of a test.

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import TEST_DEVICE

if TEST_DEVICE != "cpu":
    pytest.skip(
        "these tests run the kernels under triton's CPU interpreter; with QKV_TEST_DEVICE set, "
        "tests/test_cuda.py runs the compiled kernels on the GPU",
        allow_module_level=True,
    )

triton = pytest.importorskip(
    "triton",
    reason="triton is not installed (pip install 'qkv[triton]'): the deformable Triton kernels "
    "cannot run, not even under the CPU interpreter",
)

import qkv  # noqa: E402
from qkv.ops import deformable  # noqa: E402
from qkv.ops.deformable import op, triton_launch  # noqa: E402
from qkv.ops.deformable.inputs import level_starts  # noqa: E402
from qkv.ops.triton import interpreter  # noqa: E402
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance  # noqa: E402

LEVELS = [(5, 7), (3, 4), (2, 2)]


@pytest.fixture(autouse=True)
def _interpreter_leaves_nothing():
    """TRITON_INTERPRET and triton's interpret knob are as they were after every test."""
    env, knob = os.environ.get("TRITON_INTERPRET"), triton.knobs.runtime.interpret
    yield
    assert os.environ.get("TRITON_INTERPRET") == env
    assert triton.knobs.runtime.interpret == knob


def reference(value, levels, loc, attn):
    """One ``F.grid_sample`` per level (bilinear, zeros, ``align_corners=False``) at
    ``grid = 2 * loc - 1``, the samples summed with their weights; in the inputs' dtype.

    Shape:
        value (B, S, M, D); levels [(H, W)] * L; loc (B, Lq, M, L, P, 2); attn
        (B, Lq, M, L, P) -> (B, Lq, M * D).
    """
    B, _, M, D = value.shape
    Lq, P = loc.shape[1], loc.shape[4]
    out = 0
    for lvl, flat in enumerate(value.split([h * w for h, w in levels], dim=1)):
        h, w = levels[lvl]
        v = flat.permute(0, 2, 3, 1).reshape(B * M, D, h, w)  # (B*M, D, H, W)
        grid = (2 * loc[:, :, :, lvl] - 1).transpose(1, 2).flatten(0, 1)  # (B*M, Lq, P, 2)
        sampled = F.grid_sample(v, grid, "bilinear", "zeros", align_corners=False)
        a = attn[:, :, :, lvl].transpose(1, 2).reshape(B * M, 1, Lq, P)  # (B*M, 1, Lq, P)
        out = out + (sampled * a).sum(-1)  # (B*M, D, Lq)
    return out.view(B, M * D, Lq).transpose(1, 2)  # (B, Lq, M*D)


def inputs(B=1, Lq=7, M=2, D=8, P=2, levels=LEVELS, dtype=torch.float64, seed=0, spread=0.3):
    """value, spatial_shapes, locations (uniform over the maps widened by ``spread`` on each
    side: some points inside, some on the rim, some outside by a pixel or more), weights."""
    g = torch.Generator().manual_seed(seed)
    S, L = sum(h * w for h, w in levels), len(levels)
    value = torch.randn(B, S, M, D, generator=g, dtype=torch.float64)
    loc = torch.rand(B, Lq, M, L, P, 2, generator=g, dtype=torch.float64) * (1 + 2 * spread)
    attn = torch.rand(B, Lq, M, L, P, generator=g, dtype=torch.float64)
    return value.to(dtype), torch.tensor(levels), (loc - spread).to(dtype), attn.to(dtype)


def grads(fn, value, loc, attn, grad_out):
    """fn's output and its gradients for value, loc and attn."""
    leaves = [t.detach().requires_grad_() for t in (value, loc, attn)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


def triton_grads(value, shapes, loc, attn, grad_out):
    with interpreter():
        return grads(
            lambda v, lo, a: deformable.deformable_attention(v, shapes, lo, a, kernel="triton"),
            value,
            loc,
            attn,
            grad_out,
        )


def golden_grads(value, loc, attn, grad_out, levels=LEVELS):
    """The float64 reference's output and gradients, on the same (rounded) inputs."""
    return grads(
        lambda v, lo, a: reference(v, levels, lo, a),
        *(t.double() for t in (value, loc, attn, grad_out)),
    )


NAMES = ("out", "d_value", "d_loc", "d_attn")

# --- float64: to assert_close's defaults ----------------------------------------------------------

SIZES = {
    "B1-Lq7-M2-D8-P2": dict(B=1, Lq=7, M=2, D=8, P=2),
    "B2-Lq3-M2-D5-P2": dict(B=2, Lq=3, M=2, D=5, P=2, seed=1),  # D padded to 8 in the kernel
    "B1-Lq1-M1-D8-P3": dict(B=1, Lq=1, M=1, D=8, P=3, seed=2),
}


@pytest.mark.parametrize("size", list(SIZES))
def test_float64_forward_and_gradients_equal_the_grid_sample_reference(size):
    value, shapes, loc, attn = inputs(**SIZES[size])
    B, Lq, M, D = value.shape[0], loc.shape[1], value.shape[2], value.shape[3]
    go = torch.randn(B, Lq, M * D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    got = triton_grads(value, shapes, loc, attn, go)
    want = golden_grads(value, loc, attn, go)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


def border_locations(levels, M=2):
    """Per level, x and y at: the map's left/top edge (0), its right/bottom edge (1), a pixel
    centre (0.5 / W), just inside the half-pixel rim (0.25 / W), and outside by one pixel or
    more (-1 / W: pixel -1.5; 1 + 1 / W: pixel W + 0.5): (1, 1, M, L, 6, 2)."""
    per_level = []
    for h, w in levels:
        xs = torch.tensor([0.0, 1.0, 0.5 / w, 0.25 / w, -1 / w, 1 + 1 / w], dtype=torch.float64)
        ys = torch.tensor([1.0, 0.0, 0.5 / h, -1 / h, 0.25 / h, 1 + 1 / h], dtype=torch.float64)
        per_level.append(torch.stack((xs, ys), -1))  # (6, 2)
    loc = torch.stack(per_level)  # (L, 6, 2)
    return loc.expand(1, 1, M, *loc.shape).clone()


def test_points_on_the_borders_and_outside():
    """Edges, pixel centres and the half-pixel rim, where grid_sample's one-sided derivatives
    and dropped corners decide the numbers."""
    value, shapes, _, _ = inputs(M=2, D=8)
    loc = border_locations(LEVELS)
    g = torch.Generator().manual_seed(3)
    attn = torch.rand(loc.shape[:-1], dtype=torch.float64, generator=g)
    go = torch.randn(1, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = triton_grads(value, shapes, loc, attn, go)
    want = golden_grads(value, loc, attn, go)
    for name, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


def test_points_outside_every_map_give_exactly_zero_even_beside_inf_and_nan():
    """A point a pixel or more outside touches no pixel: output and every gradient are 0,
    though the value holds inf and NaN (a corner outside is never read, not multiplied by 0);
    a NaN location touches nothing either."""
    value, shapes, loc, attn = inputs(Lq=4)
    value[0, 0], value[0, -1] = float("inf"), float("nan")
    W = shapes[:, 1].double().view(1, 1, 1, -1, 1)
    H = shapes[:, 0].double().view(1, 1, 1, -1, 1)
    loc[..., 0] = torch.where(loc[..., 0] < 0.5, -1 / W, 1 + 1 / W)
    loc[..., 1] = torch.where(loc[..., 1] < 0.5, -1.5 / H, 1 + 1.5 / H)
    loc[0, 0, 0, 0, 0] = float("nan")
    go = torch.randn(1, 4, 16, dtype=torch.float64)
    for name, t in zip(NAMES, triton_grads(value, shapes, loc, attn, go)):
        assert torch.equal(t, torch.zeros_like(t)), name


def test_closed_form_one_pixel_map():
    """A 1x1 map sampled at its centre (0.5, 0.5) gives the pixel times the weight; at (0, 0),
    its corner, a quarter of it (three of the four bilinear corners are outside)."""
    value = torch.tensor([[[[2.0, -4.0]]]])  # (B=1, S=1, M=1, D=2)
    loc = torch.tensor([0.5, 0.5, 0.0, 0.0]).view(1, 1, 1, 1, 2, 2)  # P=2 points
    attn = torch.tensor([3.0, 1.0]).view(1, 1, 1, 1, 2)
    with interpreter():
        out = deformable.deformable_attention(value, [[1, 1]], loc, attn, kernel="triton")
    assert torch.equal(out, torch.tensor([[[3 * 2.0 + 0.5, 3 * -4.0 - 1.0]]]))


# --- low precision: the tolerance policy ----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_low_precision_within_the_policy(dtype):
    """Against the golden (float64 reference on the same rounded inputs): at most twice the
    error of the reference run in ``dtype`` (three times for gradients); half types come back
    in their dtype, accumulated in float32."""
    value, shapes, loc, attn = inputs(B=2, Lq=7, dtype=dtype, seed=5)
    go = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(6)).to(dtype)
    golden = golden_grads(value, loc, attn, go)
    baseline = grads(lambda v, lo, a: reference(v, LEVELS, lo, a), value, loc, attn, go)
    got = triton_grads(value, shapes, loc, attn, go)
    assert all(g.dtype == dtype for g in got)
    assert_tolerance(got[0], golden[0], baseline[0], factor=OUTPUT_FACTOR, name="out")
    for name, g, w, b in zip(NAMES[1:], got[1:], golden[1:], baseline[1:]):
        assert_tolerance(g, w, b, factor=GRAD_FACTOR, name=name)


# --- determinism ----------------------------------------------------------------------------------


def _crowded():
    """Every sample inside the maps, 7 queries x 2 points per head and level: on the 2 x 2
    level 14 samples share 4 pixels, so an order of adding that changed would show."""
    value, shapes, loc, attn = inputs(B=1, Lq=7, dtype=torch.float32, seed=7, spread=0)
    go = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(8))
    return value, shapes, loc, attn, go


def test_backward_is_bit_identical_across_runs():
    value, shapes, loc, attn, go = _crowded()
    first = triton_grads(value, shapes, loc, attn, go)
    second = triton_grads(value, shapes, loc, attn, go)
    for name, x, y in zip(NAMES, first, second):
        assert torch.equal(x, y), name
    # the test means something: some pixel of the last level is a corner of several samples
    with interpreter():
        keys = _keys(value, shapes, loc, attn, go)
    assert keys.unique(return_counts=True)[1].max() > 2


def _keys(value, shapes, loc, attn, go):
    """The sample keys step 1 of the backward writes (which pixels each sample touches)."""
    K = triton_launch._kernels(True)
    B, S, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    keys = torch.empty(attn.shape, dtype=torch.int64)
    K.deformable_bwd_samples[(B * M,)](
        go, value, shapes, level_starts(shapes), loc, attn, torch.empty_like(loc),
        torch.empty_like(attn), keys, S, Lq, L, P, 1, M=M, D=D, BLOCK_Q=8, BLOCK_D=8, F64=False,
    )  # fmt: skip
    return keys


def test_wide_keys_give_the_same_bits(monkeypatch):
    """Keys too large for int32 are sorted as int64: forced here, the same gradients, bit for
    bit, as the int32 keys give."""
    value, shapes, loc, attn, go = _crowded()
    narrow = triton_grads(value, shapes, loc, attn, go)
    monkeypatch.setattr(triton_launch, "_INT32_MAX", 0)
    wide = triton_grads(value, shapes, loc, attn, go)
    for name, x, y in zip(NAMES, narrow, wide):
        assert torch.equal(x, y), name


# --- which kernel runs ----------------------------------------------------------------------------


def test_the_environment_forces_triton_and_auto_on_cpu_keeps_its_kernel(monkeypatch):
    value, shapes, loc, attn = inputs(dtype=torch.float32, seed=10)
    with interpreter():
        forced = deformable.deformable_attention(value, shapes, loc, attn, kernel="triton")
        monkeypatch.setenv("QKV_DEFORMABLE_KERNEL", "triton")
        assert torch.equal(qkv.deformable_attention(value, shapes, loc, attn), forced)
        # auto never takes the interpreter: the CPU's own kernel runs
        assert op.pick_kernel("auto", torch.device("cpu")) in ("cpp", "torch")


def test_triton_on_the_cpu_outside_the_interpreter_raises_with_the_reason():
    value, shapes, loc, attn = inputs()
    with pytest.raises(RuntimeError, match=r"QKV_DEFORMABLE_KERNEL=triton.*run on CUDA tensors"):
        deformable.deformable_attention(value, shapes, loc, attn, kernel="triton")


def test_auto_on_cuda_takes_triton_where_it_imports(monkeypatch):
    """The choice alone (no GPU needed): auto on a CUDA device takes the Triton kernels;
    without triton it takes the torch path, and triton named raises with the reason."""
    cuda = torch.device("cuda")
    assert op.pick_kernel("auto", cuda) == "triton"
    assert op.pick_kernel("triton", cuda) == "triton"
    missing = "triton cannot be imported (hidden by the test)"
    monkeypatch.setattr(triton_launch, "triton_available", lambda: missing)
    assert op.pick_kernel("auto", cuda) == "torch"
    with pytest.raises(RuntimeError, match=r"=triton.*hidden by the test"):
        op.pick_kernel("triton", cuda)
