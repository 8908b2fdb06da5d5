"""Multi-scale deformable attention (issue 40, item 1): ``qkv.deformable_attention``.

Every kernel (``cpp``, the C++ loop; ``torch``, plain PyTorch ops) and the slow twin
(``naive``, one ``grid_sample`` per level) is held to a float64 reference written here with
``F.grid_sample`` (mmcv's ``multi_scale_deformable_attn_pytorch``): forward, gradients for value,
locations and weights (``gradcheck`` on tiny sizes), half precision by the tolerance policy,
points on and outside the borders, empty sizes; the backward is bit-identical run to run;
the custom op compiles whole and exports; bad inputs raise with their numbers.

Shape alphabet: B batch, S flattened value length, M heads, D head dim, Lq queries, L levels,
P points.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import qkv
from qkv.ops import deformable
from qkv.ops.deformable import native
from qkv.testing import GRAD_FACTOR, assert_tolerance

ODD_LEVELS = [(1, 1), (3, 5), (7, 2)]


def reference(value, shapes, loc, attn):
    """mmcv's ``multi_scale_deformable_attn_pytorch``, in the inputs' dtype.

    Shape:
        value (B, S, M, D); shapes [(H, W)] * L; loc (B, Lq, M, L, P, 2); attn (B, Lq, M, L, P)
        -> (B, Lq, M * D).
    """
    B, _, M, D = value.shape
    _, Lq, _, L, P, _ = loc.shape
    levels = value.split([h * w for h, w in shapes], dim=1)
    samples = []
    for lvl, (h, w) in enumerate(shapes):
        v = levels[lvl].flatten(2).transpose(1, 2).reshape(B * M, D, h, w)  # (B*M, D, H, W)
        grid = (2 * loc[:, :, :, lvl] - 1).transpose(1, 2).flatten(0, 1)  # (B*M, Lq, P, 2)
        samples.append(F.grid_sample(v, grid, "bilinear", "zeros", align_corners=False))
    stacked = torch.stack(samples, dim=-2).flatten(-2)  # (B*M, D, Lq, L*P)
    weights = attn.transpose(1, 2).reshape(B * M, 1, Lq, L * P)
    out = (stacked * weights).sum(-1).view(B, M * D, Lq)
    return out.transpose(1, 2)  # (B, Lq, M*D)


def inputs(B=2, Lq=5, M=3, D=4, P=2, levels=ODD_LEVELS, dtype=torch.float64, seed=0, spread=0.3):
    """value, spatial_shapes, locations (some outside the maps by up to ``spread``), weights."""
    g = torch.Generator().manual_seed(seed)
    S, L = sum(h * w for h, w in levels), len(levels)
    value = torch.randn(B, S, M, D, generator=g, dtype=torch.float64).to(dtype)
    loc = torch.rand(B, Lq, M, L, P, 2, generator=g, dtype=torch.float64) * (1 + 2 * spread)
    loc = (loc - spread).to(dtype)
    attn = torch.rand(B, Lq, M, L, P, generator=g, dtype=torch.float64).to(dtype)
    return value, torch.tensor(levels), loc, attn


def cpp_or_skip():
    if torch.empty(0).device.type != "cpu":
        pytest.skip("the C++ kernel runs on the CPU (QKV_TEST_DEVICE puts tensors elsewhere)")
    if native.library() is None:
        pytest.skip(f"the C++ kernel is not built here: {native.unavailable_reason()}")


KERNELS = ["cpp", "torch"]


def run(kernel, *args, **kw):
    if kernel == "cpp":
        cpp_or_skip()
    if kernel == "naive":
        return deformable.deformable_attention_naive(*args)
    return deformable.deformable_attention(*args, kernel=kernel, **kw)


def grads(fn, value, loc, attn, grad_out):
    leaves = [t.detach().requires_grad_() for t in (value, loc, attn)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


# --- forward and gradients against the float64 grid_sample reference ------------------------------

SIZES = {
    "B2-Lq5-M3-D4-P2-odd": dict(B=2, Lq=5, M=3, D=4, P=2),
    "B1-Lq1-M1-D5-P1-odd": dict(B=1, Lq=1, M=1, D=5, P=1),
    "B2-Lq7-M2-D3-P3-one-level": dict(B=2, Lq=7, M=2, D=3, P=3, levels=[(4, 6)]),
}


@pytest.mark.parametrize("kernel", [*KERNELS, "naive"])
@pytest.mark.parametrize("size", list(SIZES))
def test_forward_and_gradients_equal_the_float64_reference(kernel, size):
    value, shapes, loc, attn = inputs(**SIZES[size])
    levels = [tuple(s) for s in shapes.tolist()]
    go = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3]).double()
    want = grads(lambda v, lo, a: reference(v, levels, lo, a), value, loc, attn, go)
    got = grads(lambda v, lo, a: run(kernel, v, shapes, lo, a), value, loc, attn, go)
    for name, g, w in zip(["out", "d_value", "d_loc", "d_attn"], got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_gradcheck_value_locations_weights(kernel):
    value, shapes, loc, attn = inputs(B=2, Lq=3, M=2, D=3, P=2, spread=0.2, seed=1)
    if kernel == "cpp":
        cpp_or_skip()

    def fn(v, lo, a):
        return deformable.deformable_attention(v, shapes, lo, a, kernel=kernel)

    leaves = [t.requires_grad_() for t in (value, loc, attn)]
    assert torch.autograd.gradcheck(fn, leaves)


def border_locations(levels, M=2, P=6):
    """Per level, x and y at: the map's left/top edge (0), its right/bottom edge (1), a pixel
    centre (0.5 / W), just inside the half-pixel rim (0.25 / W), and outside by one pixel or
    more (-1 / W: pixel -1.5; 1 + 1 / W: pixel W + 0.5): (1, 1, M, L, P, 2)."""
    per_level = []
    for h, w in levels:
        xs = torch.tensor([0.0, 1.0, 0.5 / w, 0.25 / w, -1 / w, 1 + 1 / w], dtype=torch.float64)
        ys = torch.tensor([1.0, 0.0, 0.5 / h, -1 / h, 0.25 / h, 1 + 1 / h], dtype=torch.float64)
        per_level.append(torch.stack((xs, ys), -1)[:P])  # (P, 2)
    loc = torch.stack(per_level)  # (L, P, 2)
    return loc.expand(1, 1, M, *loc.shape).clone()


@pytest.mark.parametrize("kernel", [*KERNELS, "naive"])
def test_points_on_the_borders_and_outside(kernel):
    value, shapes, _, _ = inputs(B=1, M=2, D=3)
    levels = [tuple(s) for s in shapes.tolist()]
    loc = border_locations(levels)
    attn = torch.rand(
        loc.shape[:-1], dtype=torch.float64, generator=torch.Generator().manual_seed(2)
    )
    go = torch.randn(1, 1, 6, dtype=torch.float64)
    want = grads(lambda v, lo, a: reference(v, levels, lo, a), value, loc, attn, go)
    got = grads(lambda v, lo, a: run(kernel, v, shapes, lo, a), value, loc, attn, go)
    for name, g, w in zip(["out", "d_value", "d_loc", "d_attn"], got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_points_outside_every_map_give_exactly_zero(kernel):
    """A point a pixel or more outside touches no pixel: output and all gradients are 0, even
    where the value holds inf and NaN (a corner outside is never read, not multiplied by 0)."""
    value, shapes, loc, attn = inputs(B=1, Lq=4, M=2, D=3)
    value[0, 0], value[0, -1] = float("inf"), float("nan")
    W = shapes[:, 1].double().view(1, 1, 1, -1, 1)
    H = shapes[:, 0].double().view(1, 1, 1, -1, 1)
    loc[..., 0] = torch.where(loc[..., 0] < 0.5, -1 / W, 1 + 1 / W)
    loc[..., 1] = torch.where(loc[..., 1] < 0.5, -1.5 / H, 1 + 1.5 / H)
    go = torch.randn(1, 4, 6, dtype=torch.float64)
    out, d_value, d_loc, d_attn = grads(
        lambda v, lo, a: run(kernel, v, shapes, lo, a), value, loc, attn, go
    )
    for t in (out, d_value, d_loc, d_attn):
        assert torch.equal(t, torch.zeros_like(t))


def test_closed_form_one_pixel_map():
    """A 1x1 map sampled at its centre (0.5, 0.5) gives the pixel times the weight; at (0, 0),
    its corner, a quarter of it (three of the four bilinear corners are outside)."""
    value = torch.tensor([[[[2.0, -4.0]]]])  # (B=1, S=1, M=1, D=2)
    loc = torch.tensor([0.5, 0.5, 0.0, 0.0]).view(1, 1, 1, 1, 2, 2)  # P=2 points
    attn = torch.tensor([3.0, 1.0]).view(1, 1, 1, 1, 2)
    out = qkv.deformable_attention(value, torch.tensor([[1, 1]]), loc, attn)
    torch.testing.assert_close(out, torch.tensor([[[3 * 2.0 + 0.5, 3 * -4.0 - 1.0]]]))


# --- sizes: empty and the level start index -------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dims", ["Lq0", "B0", "P0"])
def test_empty_sizes(kernel, dims):
    kw = dict(B=2, Lq=3, P=2)
    kw[dims[:-1]] = 0
    value, shapes, loc, attn = inputs(M=2, D=3, **kw)
    go = torch.ones(kw["B"], kw["Lq"], 6, dtype=torch.float64)
    out, d_value, d_loc, d_attn = grads(
        lambda v, lo, a: run(kernel, v, shapes, lo, a), value, loc, attn, go
    )
    assert out.shape == (kw["B"], kw["Lq"], 6) and not out.any()
    assert d_value.shape == value.shape and not d_value.any()
    assert d_loc.shape == loc.shape and d_attn.shape == attn.shape


def test_level_start_index_given_and_spatial_shapes_as_a_list():
    value, shapes, loc, attn = inputs()
    want = qkv.deformable_attention(value, shapes, loc, attn)
    got = qkv.deformable_attention(
        value, ODD_LEVELS, loc, attn, level_start_index=torch.tensor([0, 1, 16])
    )
    assert torch.equal(got, want)


# --- half precision: the tolerance policy ---------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_low_precision_within_the_policy(kernel, dtype):
    """Against the golden (float64 reference on the same rounded inputs): at most twice the
    error of the reference run in ``dtype`` (three times for gradients)."""
    value, shapes, loc, attn = inputs(B=2, Lq=16, M=4, D=8, P=4, dtype=dtype, seed=3)
    levels = [tuple(s) for s in shapes.tolist()]
    go = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    golden = grads(
        lambda v, lo, a: reference(v, levels, lo, a),
        *(t.double() for t in (value, loc, attn, go)),
    )
    baseline = grads(lambda v, lo, a: reference(v, levels, lo, a), value, loc, attn, go)
    got = grads(lambda v, lo, a: run(kernel, v, shapes, lo, a), value, loc, attn, go)
    assert got[0].dtype == dtype and all(g.dtype == dtype for g in got[1:])
    assert_tolerance(got[0], golden[0], baseline[0], name="out")
    for name, g, w, b in zip(["d_value", "d_loc", "d_attn"], got[1:], golden[1:], baseline[1:]):
        assert_tolerance(g, w, b, factor=GRAD_FACTOR, name=name)


# --- the two kernels, determinism, the fallback ---------------------------------------------------


def test_cpp_and_torch_kernels_agree():
    """The C++ loop and the PyTorch ops compute the same sums (different orders of adding)."""
    cpp_or_skip()
    value, shapes, loc, attn = inputs(B=2, Lq=9, M=3, D=5, P=3, dtype=torch.float32, seed=5)
    go = torch.randn(2, 9, 15, generator=torch.Generator().manual_seed(6))
    a, b = (
        grads(lambda v, lo, at, k=k: run(k, v, shapes, lo, at), value, loc, attn, go)
        for k in KERNELS
    )
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_is_bit_identical_across_runs_and_thread_counts(kernel, dtype):
    """Many queries hitting the same pixels (so a racy scatter would show), run three times at
    2 threads and once at 1: every gradient has the same bits."""
    if torch.empty(0).device.type != "cpu":
        pytest.skip("bit-identical on the CPU; CUDA's index_add_ adds in any order")
    value, shapes, loc, attn = inputs(B=1, Lq=400, M=2, D=8, P=4, dtype=dtype, seed=7, spread=0)
    go = torch.randn(1, 400, 16, generator=torch.Generator().manual_seed(8)).to(dtype)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 2, 2, 1):
            torch.set_num_threads(n)
            runs.append(grads(lambda v, lo, a: run(kernel, v, shapes, lo, a), value, loc, attn, go))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x, y)


def test_without_a_compiler_the_torch_path_runs_warns_and_gives_the_same_numbers(monkeypatch):
    cpp_or_skip()
    value, shapes, loc, attn = inputs(dtype=torch.float32, seed=9)
    go = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(10))
    with_cpp = grads(lambda v, lo, a: run("auto", v, shapes, lo, a), value, loc, attn, go)
    # a fresh build cache and warning, so this test neither sees nor leaves the real ones
    monkeypatch.setattr(native, "_build", functools.cache(native._build.__wrapped__))
    monkeypatch.setattr(native, "_warn_once", functools.cache(native._warn_once.__wrapped__))
    monkeypatch.setenv("CXX", "qkv-no-such-compiler")
    assert "no C++ compiler found" in native.unavailable_reason()
    with pytest.warns(RuntimeWarning, match="pure-PyTorch path.*no C\\+\\+ compiler"):
        without = grads(lambda v, lo, a: run("auto", v, shapes, lo, a), value, loc, attn, go)
    for x, y in zip(with_cpp, without):
        torch.testing.assert_close(x, y)
    with pytest.raises(RuntimeError, match=r"QKV_DEFORMABLE_KERNEL=cpp.*no C\+\+ compiler"):
        deformable.deformable_attention(value, shapes, loc, attn, kernel="cpp")


def test_the_environment_forces_a_kernel(monkeypatch):
    value, shapes, loc, attn = inputs()
    monkeypatch.setenv("QKV_DEFORMABLE_KERNEL", "torch")
    torch.testing.assert_close(
        qkv.deformable_attention(value, shapes, loc, attn),
        deformable.deformable_attention(value, shapes, loc, attn, kernel="torch"),
    )
    monkeypatch.setenv("QKV_DEFORMABLE_KERNEL", "fast")
    with pytest.raises(ValueError, match="QKV_DEFORMABLE_KERNEL='fast'; use one of auto, cpp"):
        qkv.deformable_attention(value, shapes, loc, attn)


# --- compile and export ---------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles_as_one_graph_forward_and_backward(kernel):
    if kernel == "cpp":
        cpp_or_skip()
    value, shapes, loc, attn = inputs(dtype=torch.float32, seed=11)
    go = torch.randn(2, 5, 12, generator=torch.Generator().manual_seed(12))

    def attend(v, lo, a):
        return deformable.deformable_attention(v, shapes, lo, a, kernel=kernel) * 2

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    got = grads(compiled, value, loc, attn, go)
    want = grads(attend, value, loc, attn, go)
    assert counter.frame_count == 1
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


def test_exports_and_runs_at_another_query_count():
    value, shapes, loc, attn = inputs(dtype=torch.float32, seed=13)

    class Sample(torch.nn.Module):
        def forward(self, v, lo, a):
            return qkv.deformable_attention(v, shapes, lo, a)

    queries = torch.export.Dim("Lq", min=1, max=1024)
    program = torch.export.export(
        Sample(), (value, loc, attn), dynamic_shapes=(None, {1: queries}, {1: queries})
    )
    assert "qkv.deformable_attention" in str(program.graph)
    value, shapes, loc, attn = inputs(Lq=11, dtype=torch.float32, seed=14)
    torch.testing.assert_close(program.module()(value, loc, attn), Sample()(value, loc, attn))


def test_vmap_and_per_sample_gradients_equal_a_loop():
    """vmap over a leading dim of value and locations (the weights shared), and vmap of
    torch.func.grad (both run the gather path as plain torch ops): each sample as its own
    call would give."""
    samples = [inputs(B=2, Lq=4, M=2, D=3, seed=20 + i) for i in range(3)]
    shapes = samples[0][1]
    value = torch.stack([s[0] for s in samples])  # (V, B, S, M, D)
    loc = torch.stack([s[2] for s in samples])  # (V, B, Lq, M, L, P, 2)
    attn = samples[0][3]  # shared

    def attend(v, lo, a):
        return qkv.deformable_attention(v, shapes, lo, a)

    got = torch.vmap(attend, in_dims=(0, 0, None))(value, loc, attn)
    want = torch.stack([attend(value[i], loc[i], attn) for i in range(3)])
    torch.testing.assert_close(got, want)

    def loss(v, lo, a):
        return (attend(v, lo, a) ** 2).sum()

    got = torch.vmap(torch.func.grad(loss, argnums=(0, 1, 2)), in_dims=(0, 0, None))(
        value, loc, attn
    )
    for i in range(3):
        want = torch.func.grad(loss, argnums=(0, 1, 2))(value[i], loc[i], attn)
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w)


# --- validation -----------------------------------------------------------------------------------


def _bad(**changes):
    value, shapes, loc, attn = inputs(dtype=torch.float32)
    args = dict(value=value, spatial_shapes=shapes, sampling_locations=loc, attention_weights=attn)
    args.update(changes)
    return args


ERRORS = {
    "value-3d": (
        lambda: _bad(value=torch.zeros(2, 16, 12)),
        ValueError,
        r"value must be \(B, S, M, D\), 4 dims; got shape \(2, 16, 12\)",
    ),
    "loc-last-dim-3": (
        lambda: _bad(sampling_locations=torch.zeros(2, 5, 3, 3, 2, 3)),
        ValueError,
        r"sampling_locations must be \(B, Lq, M, L, P, 2\).*got shape \(2, 5, 3, 3, 2, 3\)",
    ),
    "heads-disagree": (
        lambda: _bad(sampling_locations=torch.zeros(2, 5, 4, 3, 2, 2)),
        ValueError,
        r"has B=2, M=4 but value \(B, S, M, D\) has B=2, M=3",
    ),
    "weights-shape": (
        lambda: _bad(attention_weights=torch.zeros(2, 5, 3, 3, 1)),
        ValueError,
        (
            r"attention_weights must be \(B, Lq, M, L, P\) = \(2, 5, 3, 3, 2\)"
            r".*got shape \(2, 5, 3, 3, 1\)"
        ),
    ),
    "levels-disagree": (
        lambda: _bad(spatial_shapes=torch.tensor([[1, 1], [3, 5]])),
        ValueError,
        r"spatial_shapes must be \(L, 2\).*shape \(3, 2\); got shape \(2, 2\)",
    ),
    "levels-do-not-sum-to-S": (
        lambda: _bad(spatial_shapes=torch.tensor([[1, 1], [3, 5], [7, 3]])),
        ValueError,
        r"cover sum\(H\*W\) = 37 rows, but value has S = 30",
    ),
    "level-of-zero": (
        lambda: _bad(spatial_shapes=torch.tensor([[0, 1], [3, 5], [15, 1]])),
        ValueError,
        r"\(H, W\) >= 1 per level; got \[\[0, 1\], \[3, 5\], \[15, 1\]\]",
    ),
    "start-index-disagrees": (
        lambda: _bad(level_start_index=torch.tensor([0, 1, 15])),
        ValueError,
        r"level_start_index \[0, 1, 15\] disagrees .* start at \[0, 1, 16\]",
    ),
    "start-index-shape": (
        lambda: _bad(level_start_index=torch.tensor([0, 1])),
        ValueError,
        r"level_start_index must be \(L,\), shape \(3,\); got shape \(2,\)",
    ),
    "float-shapes": (
        lambda: _bad(spatial_shapes=torch.tensor([[1.0, 1], [3, 5], [7, 2]])),
        TypeError,
        r"spatial_shapes must hold integers .* got torch.float32",
    ),
    "int-value": (
        lambda: _bad(value=torch.zeros(2, 30, 3, 4, dtype=torch.int64)),
        TypeError,
        r"value is torch.int64; deformable_attention takes float16, bfloat16, float32",
    ),
    "mixed-dtypes": (
        lambda: _bad(attention_weights=torch.zeros(2, 5, 3, 3, 2, dtype=torch.float64)),
        TypeError,
        r"attention_weights is torch.float64 but value is torch.float32; .*\.to\(value.dtype\)",
    ),
    "meta-device": (
        lambda: _bad(sampling_locations=torch.zeros(2, 5, 3, 3, 2, 2, device="meta")),
        ValueError,
        r"sampling_locations is on meta but value is on (\S+); move it to \1",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_inputs_raise_with_the_numbers(case):
    make, kind, message = ERRORS[case]
    with pytest.raises(kind, match=message):
        qkv.deformable_attention(**make())
