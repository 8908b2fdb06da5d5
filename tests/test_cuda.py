"""Every backend on a CUDA GPU against the float64 reference on CPU (issue 29).

Skipped without CUDA: CI never has a GPU. Run on a GPU machine with ``pytest tests/test_cuda.py``
(tensors name their device here; ``QKV_TEST_DEVICE=cuda`` runs the rest of the suite there too).

Compared by the tolerance policy (DESIGN.md): golden = the reference backend in float64 on the
CPU, baseline = the reference backend in the call's dtype on the GPU, and
``max|out - golden| <= F * max|baseline - golden| + 1e-5`` (F = 2 outputs, 3 gradients): the
torch, tiled, triton and auto backends, float32/bfloat16/float16, every mask the kernels
evaluate (causal both alignments, windows, key lengths, documents, ALiBi, softcap, dense bool
masks with dead rows, a learned float bias), GQA, head dims 64 and 128 and odd lengths. Then the
mask contract on the GPU (rows with no key give exactly 0 and zero gradients; NaN in keys a row
may not see changes nothing) and whether a call synchronises the host with the device. Last,
``qkv.deformable_attention``'s Triton kernels against a float64 ``grid_sample`` reference, and
their backward bit-identical run to run.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.ops import BackendUnsupportedError, deformable
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
BACKENDS = ["torch", "flex", "tiled", "triton", "auto"]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _ids(B: int, L: int, seed: int) -> torch.Tensor:
    """Packed documents (B, L): sorted ids, runs of random lengths."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, max(1, L // 30), (B, L), generator=g).sort(-1).values


def _cases(B: int, H: int, T: int, S: int) -> dict:
    """name -> (keyword arguments on the GPU); each a callable so tensors are made fresh."""
    g = torch.Generator(device="cpu").manual_seed(5)
    dead = torch.rand(B, 1, T, S, generator=g) < 0.8
    dead[:, :, : T // 4] = False  # a quarter of the rows may see no key at all
    bias = torch.randn(B, H, T, S, generator=g, dtype=torch.float64)
    return {
        "none": dict,
        "causal": lambda: dict(is_causal=True),
        "bottom-right": lambda: dict(mask_mod=M.causal("bottom_right")),
        "window": lambda: dict(mask_mod=M.sliding_window(40, 7)),
        "keylen": lambda: dict(
            mask_mod=M.key_lengths(torch.tensor([S, max(1, S // 3)])[:B].to(CUDA))
        ),
        "causal-alibi": lambda: dict(is_causal=True, score_mod=M.alibi(H)),
        "window-softcap-scale": lambda: dict(
            mask_mod=M.sliding_window(30), score_mod=M.softcap(2.0), is_causal=True, scale=0.7
        ),
        "document": lambda: dict(
            mask_mod=M.document(_ids(B, T, 1).to(CUDA), _ids(B, S, 1).to(CUDA))
        ),
        "bool-dead-rows": lambda: dict(attn_mask=dead.to(CUDA)),
        "learned-bias": lambda: dict(attn_mask=bias.to(CUDA)),
    }


def _run(backend: str, q, k, v, dout, dtype, device, kw: dict):
    """out and the gradients (q, k, v, and a float attn_mask's) of one backend in ``dtype``."""
    ins = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    kw = dict(kw)
    mask = kw.get("attn_mask")
    if mask is not None:
        mask = mask.to(device)
        if mask.is_floating_point():
            mask = mask.to(dtype).requires_grad_()
        kw["attn_mask"] = mask
    out = qkv.scaled_dot_product_attention(*ins, backend=backend, **kw)
    wrt = ins + ([mask] if mask is not None and mask.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, dout.to(device, dtype))
    return out.detach(), grads


def _to_cpu(kw: dict) -> dict:
    """The same call for the CPU reference: tensors inside masks moved by rebuilding them."""
    return {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()}


def _check(backend: str, name: str, dtype, B, H, G, T, S, D, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = ((B, H, T, D), (B, G, S, D), (B, G, S, D), (B, H, T, D))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    make = _cases(B, H, T, S)[name]
    gqa = dict(enable_gqa=True) if G != H else {}
    try:
        got = _run(backend, q, k, v, dout, dtype, CUDA, {**make(), **gqa})
    except BackendUnsupportedError as e:
        pytest.skip(f"{backend} refuses {name} in {dtype}: {e}")
    golden = _run(
        "reference", q, k, v, dout, torch.float64, "cpu", _to_cpu_case(B, H, T, S, name, gqa)
    )
    baseline = _run("reference", q, k, v, dout, dtype, CUDA, {**make(), **gqa})
    where = f"{backend} {name} {dtype} B{B}-H{H}-G{G}-T{T}-S{S}-D{D}"
    assert got[0].device.type == "cuda" and got[0].dtype == dtype, where
    assert_tolerance(
        got[0].cpu(), golden[0], baseline[0].cpu(), factor=OUTPUT_FACTOR, name=f"{where} out"
    )
    for a, b, c, what in zip(got[1], golden[1], baseline[1], ("dq", "dk", "dv", "dmask")):
        assert_tolerance(a.cpu(), b, c.cpu(), factor=GRAD_FACTOR, name=f"{where} {what}")


def _to_cpu_case(B, H, T, S, name, gqa) -> dict:
    """The case's keyword arguments with every tensor on the CPU (masks built there)."""
    kw = {**_cases(B, H, T, S)[name](), **gqa}
    mod = kw.get("mask_mod")
    if name == "keylen":
        kw["mask_mod"] = M.key_lengths(torch.tensor([S, max(1, S // 3)])[:B])
    elif name == "document":
        kw["mask_mod"] = M.document(_ids(B, T, 1), _ids(B, S, 1))
    elif mod is not None:
        kw["mask_mod"] = mod
    return _to_cpu(kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(_cases(1, 1, 1, 1)))
def test_matches_float64_reference_gqa_odd_lengths(backend, dtype, name):
    _check(backend, name, dtype, B=2, H=4, G=2, T=97, S=113, D=64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["none", "causal", "window", "document", "causal-alibi"])
def test_head_dim_128_long_and_one_query(backend, name):
    _check(backend, name, torch.bfloat16, B=1, H=2, G=2, T=1025, S=1025, D=128)
    _check(backend, name, torch.bfloat16, B=2, H=2, G=1, T=1, S=300, D=128, seed=1)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("T, S", [(1, 128), (1, 97), (64, 192)])
def test_a_plain_gradient_with_every_score_near_minus_128(backend, T, S):
    """NVIDIA/cudnn-frontend#1072: cuDNN 9.26's backward gave NaN dk and dv for one query over
    128 keys whose scores are all about -128 (finite inputs, no mask; its inputs). qkv's plain
    calls that want a gradient try cuDNN first (``_kernel_order``): dq, dk, dv finite and
    within the policy of the float64 math, whichever cuDNN the machine has."""
    import math

    D = 64
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(2, 2, T, D, generator=g, dtype=torch.float64) * 0.1
    k = torch.randn(2, 2, S, D, generator=g, dtype=torch.float64) * 0.1
    v = torch.randn(2, 2, S, D, generator=g, dtype=torch.float64)
    q[..., 0], k[..., 0] = 1.0, -128 * math.sqrt(D)
    dout = torch.randn(2, 2, T, D, generator=g, dtype=torch.float64)
    got = _run(backend, q, k, v, dout, torch.bfloat16, CUDA, {})
    golden = _run("reference", q, k, v, dout, torch.float64, "cpu", {})
    baseline = _run("reference", q, k, v, dout, torch.bfloat16, CUDA, {})
    for a, b, c, what in zip(got[1], golden[1], baseline[1], ("dq", "dk", "dv")):
        assert torch.isfinite(a).all(), f"{backend}: {what} not finite"
        assert_tolerance(a.cpu(), b, c.cpu(), factor=GRAD_FACTOR, name=f"{backend} {what}")


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_masked_gradient_where_cudnns_backward_gave_nan(backend):
    """pytorch/pytorch#196678 (torch 2.11+, H100/H200): cuDNN's backward with a mask gave NaN
    in dq where T % 128 == 64 and every row's log-sum-exp is below -88.7 (its inputs, T =
    192). qkv's masked calls that want a gradient run without cuDNN: dq, dk, dv finite and
    within the policy of the float64 math."""
    import math

    T, D = 192, 64
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64) * 0.1
    k = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64) * 0.1
    v = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(D)  # every score about -120
    dout = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    got = _run(backend, q, k, v, dout, torch.bfloat16, CUDA, dict(attn_mask=mask))
    golden = _run("reference", q, k, v, dout, torch.float64, "cpu", dict(attn_mask=mask))
    baseline = _run("reference", q, k, v, dout, torch.bfloat16, CUDA, dict(attn_mask=mask))
    for a, b, c, what in zip(got[1], golden[1], baseline[1], ("dq", "dk", "dv")):
        assert torch.isfinite(a).all(), f"{backend}: {what} not finite"
        assert_tolerance(a.cpu(), b, c.cpu(), factor=GRAD_FACTOR, name=f"{backend} {what}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize(
    "bad", ["k+inf", "k-inf", "k-inf-all", "k-nan", "k-nan-all", "v+inf", "v-nan"]
)
def test_plain_half_rows_checked_by_the_kernels_lse_are_the_plain_maths(
    monkeypatch, bad, backend, dtype
):
    """A half call without mask runs cuDNN's or flash's kernel with its log-sum-exp, and its
    rows are checked by it (``nonfinite._restore_output_by_lse``): NaN exactly where the
    plain math (float64) is, the math's rows elsewhere; a ``-inf`` key among finite ones
    weighs 0, and a row whose every key is ``-inf`` is NaN (0 / 0), which leans on the
    kernel's lse of such a row."""
    import test_nonfinite_plain_math as P

    from qkv.ops import nonfinite

    seen = []
    by_lse = nonfinite._restore_output_by_lse
    monkeypatch.setattr(
        nonfinite, "_restore_output_by_lse", lambda out, lse: seen.append(1) or by_lse(out, lse)
    )
    (q, k, v), _, sees, bad_keys = P._case("none", bad, dtype)
    want = P._plain(q, k, v, sees)
    with torch.no_grad():
        got = qkv.scaled_dot_product_attention(*(t.to(CUDA) for t in (q, k, v)), backend=backend)
    assert seen == [1], "the call did not take the kernel's lse"
    P._check(got.cpu(), want, sees, bad_keys, dtype, exact=True)


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_rows_with_no_key_are_zero_and_masked_nan_keys_change_nothing(backend, dtype):
    """The mask contract on the GPU: batch 0 has no key (key_lengths 0), rows 0..11 of
    bottom-right causal with T = 17 > S = 5 see none; keys past the length are NaN."""
    B, H, T, S, D = 2, 2, 17, 5, 64
    g = torch.Generator(device="cpu").manual_seed(3)
    q, k, v, dout = (
        torch.randn(s, generator=g).to(CUDA, dtype)
        for s in ((B, H, T, D), (B, H, S, D), (B, H, S, D), (B, H, T, D))
    )
    k[1, :, 3:] = float("nan")
    v[1, :, 3:] = float("nan")
    mask_mod = M.and_masks(
        M.causal("bottom_right"), M.key_lengths(torch.tensor([0, 3], device=CUDA))
    )
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        out = qkv.scaled_dot_product_attention(*ins, mask_mod=mask_mod, backend=backend)
    except BackendUnsupportedError as e:
        pytest.skip(f"{backend}: {e}")
    dq, dk, dv = torch.autograd.grad(out, ins, dout)
    for t, what in ((out, "out"), (dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert not t.isnan().any(), f"{backend}: NaN in {what}"
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[:, :, :12], torch.zeros_like(out[:, :, :12]))
    assert torch.equal(dq[0], torch.zeros_like(dq[0]))
    assert torch.equal(dk[0], torch.zeros_like(dk[0])) and torch.equal(
        dv[0], torch.zeros_like(dv[0])
    )
    k_ok, v_ok = k.clone(), v.clone()
    k_ok[1, :, 3:] = 0
    v_ok[1, :, 3:] = 0
    clean = qkv.scaled_dot_product_attention(q, k_ok, v_ok, mask_mod=mask_mod, backend=backend)
    assert torch.equal(out.detach(), clean), f"{backend}: masked NaN keys changed the output"


SYNC_CASES = {
    "none": dict,
    "causal": lambda: dict(is_causal=True),
    "window": lambda: dict(mask_mod=M.sliding_window(64)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(SYNC_CASES))
def test_a_call_does_not_synchronise_the_device(backend, name):
    """DESIGN.md: nothing on the hot path syncs the device. torch's sync debug mode raises on
    any synchronising operation inside the call (a ``.item()``, ``bool(tensor)``, a copy to the
    host). Forward, and forward plus backward."""
    q, k, v = (
        torch.randn(2, 4, 256, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    kw = SYNC_CASES[name]()
    try:
        qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)  # warm: compile, plan
    except BackendUnsupportedError as e:
        pytest.skip(f"{backend}: {e}")
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        out = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(before)


def test_triton_block_lists_are_reused_and_follow_ids_changed_in_place():
    """The triton backend keeps the block lists of recent calls by mask structure and sizes
    (listing a window's blocks took 1.7 ms of host work per call against a 0.4 ms kernel);
    document ids changed in place must give new lists, and the right answer."""
    from qkv.ops.triton import backend as tb

    tb.clear_block_list_cache()
    q, k, v = (torch.randn(1, 2, 300, 64, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    window = M.sliding_window(50)
    for _ in range(3):
        qkv.scaled_dot_product_attention(q, k, v, mask_mod=window, backend="triton")
    assert len(tb._block_list_cache) == 1
    ids = torch.zeros(1, 300, dtype=torch.long, device=CUDA)
    doc = M.document(ids)
    qkv.scaled_dot_product_attention(q, k, v, mask_mod=doc, backend="triton")
    ids[:, 150:] = 1  # two documents now: the cached lists of one document no longer hold
    out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=doc, backend="triton")
    assert len(tb._block_list_cache) == 3
    tb.clear_block_list_cache()
    assert len(tb._block_list_cache) == 0
    fresh = qkv.scaled_dot_product_attention(
        q, k, v, mask_mod=M.document(ids.clone()), backend="triton"
    )  # planned anew
    assert torch.equal(out, fresh)
    tb.clear_block_list_cache()


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
def test_cpu_calls_stay_on_the_cpu_under_a_cuda_default_device(backend):
    """``torch.set_default_device("cuda")`` (common in GPU scripts) with CPU inputs: planning,
    traces and row selection made their index tensors on the default device, and the tiled
    backend failed on every structured mask ("indices should be either on cpu or on the same
    device as the indexed tensor")."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 16, generator=g) for _ in range(3))
    ids = (torch.arange(37) // 10).expand(2, 37)
    calls = {
        "window": dict(mask_mod=M.sliding_window(5)),
        "document": dict(mask_mod=M.document(ids)),
        "bool": dict(attn_mask=torch.rand(37, 37, generator=g) > 0.3),
        "rank0": dict(attn_mask=torch.tensor(True)),
    }
    want = {}
    for name, kw in calls.items():
        try:
            want[name] = qkv.scaled_dot_product_attention(
                q, k, v, backend=backend, return_trace=True, **kw
            )
        except BackendUnsupportedError:
            continue
    before = torch.get_default_device()
    torch.set_default_device("cuda")
    try:
        for name, (out_w, trace_w) in want.items():
            out, trace = qkv.scaled_dot_product_attention(
                q, k, v, backend=backend, return_trace=True, **calls[name]
            )
            assert out.device.type == "cpu" and torch.equal(out, out_w), name
            torch.testing.assert_close(
                trace.select(heads=[1], rows=[0, 5]).probs,
                trace_w.select(heads=[1], rows=[0, 5]).probs,
            )
    finally:
        torch.set_default_device(before)


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_broadcast_masks_of_rank_0_and_1_on_cuda(backend):
    """torch's CUDA kernel raises "(*bias): last dimension must be contiguous" for a mask
    broadcast along keys (a rank-0 mask expanded, a (T, 1) column): qkv hands it a copy."""
    q, k, v = (torch.randn(1, 2, 7, 16, device=CUDA) for _ in range(3))
    for mask in (
        torch.tensor(0.5, device=CUDA),
        torch.randn(7, 1, device=CUDA),
        torch.tensor(True, device=CUDA),
    ):
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        want = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="reference")
        torch.testing.assert_close(out, want)


# --- multi-scale deformable attention's Triton kernels (issue 40, item 1) -------------------------

DEFORM_LEVELS = [(13, 17), (7, 9), (4, 5), (2, 3)]  # odd sizes, four levels as BEVFormer's


def _deform_reference(value, levels, loc, attn):
    """One ``F.grid_sample`` per level (bilinear, zeros, ``align_corners=False``) at
    ``2 * loc - 1``, the samples summed with their weights (mmcv's pytorch fallback).

    Shape: value (B, S, M, D); loc (B, Lq, M, L, P, 2); attn (B, Lq, M, L, P) -> (B, Lq, M*D).
    """
    import torch.nn.functional as F

    B, _, M, D = value.shape
    Lq, P = loc.shape[1], loc.shape[4]
    out = 0
    for lvl, flat in enumerate(value.split([h * w for h, w in levels], dim=1)):
        h, w = levels[lvl]
        v = flat.permute(0, 2, 3, 1).reshape(B * M, D, h, w)  # (B*M, D, H, W)
        grid = (2 * loc[:, :, :, lvl] - 1).transpose(1, 2).flatten(0, 1)  # (B*M, Lq, P, 2)
        sampled = F.grid_sample(v, grid, "bilinear", "zeros", align_corners=False)
        a = attn[:, :, :, lvl].transpose(1, 2).reshape(B * M, 1, Lq, P)
        out = out + (sampled * a).sum(-1)  # (B*M, D, Lq)
    return out.view(B, M * D, Lq).transpose(1, 2)  # (B, Lq, M*D)


def _deform_inputs(B=2, Lq=300, M=4, D=32, P=4, spread=0.2, seed=0):
    """float64 CPU value, locations (some outside the maps), weights and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    S, L = sum(h * w for h, w in DEFORM_LEVELS), len(DEFORM_LEVELS)
    value = torch.randn(B, S, M, D, generator=g, dtype=torch.float64)
    loc = torch.rand(B, Lq, M, L, P, 2, generator=g, dtype=torch.float64) * (1 + 2 * spread)
    attn = torch.rand(B, Lq, M, L, P, generator=g, dtype=torch.float64)
    go = torch.randn(B, Lq, M * D, generator=g, dtype=torch.float64)
    return value, loc - spread, attn, go


def _deform_grads(fn, value, loc, attn, go):
    leaves = [t.detach().requires_grad_() for t in (value, loc, attn)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, go))


def _deform_triton(v, lo, a, kernel="triton"):
    """The op with its kernel named (``auto``: the public call, which picks it)."""
    shapes = torch.tensor(DEFORM_LEVELS, device=v.device)  # on the GPU, as mmcv keeps it
    if kernel == "auto":
        return qkv.deformable_attention(v, shapes, lo, a)
    return deformable.deformable_attention(v, shapes, lo, a, kernel=kernel)


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.float64],
    ids=["bf16", "f16", "f32", "f64"],
)
def test_deformable_triton_matches_the_float64_reference(dtype):
    """Forward and gradients for value, locations and weights on the GPU against the float64
    grid_sample reference on the CPU: float64 to assert_close's defaults, the rest by the
    tolerance policy (baseline: grid_sample in the dtype on the GPU)."""
    value, loc, attn, go = _deform_inputs()
    rounded = [t.to(dtype) for t in (value, loc, attn, go)]
    got = _deform_grads(_deform_triton, *(t.to(CUDA) for t in rounded))
    golden = _deform_grads(
        lambda v, lo, a: _deform_reference(v, DEFORM_LEVELS, lo, a),
        *(t.double() for t in rounded),
    )
    names = ("out", "d_value", "d_loc", "d_attn")
    assert all(g.device.type == CUDA.type and g.dtype == dtype for g in got)
    if dtype == torch.float64:
        for name, a, b in zip(names, got, golden):
            torch.testing.assert_close(a.cpu(), b, msg=lambda m, name=name: f"{name}: {m}")
        return
    baseline = _deform_grads(
        lambda v, lo, a: _deform_reference(v, DEFORM_LEVELS, lo, a),
        *(t.to(CUDA) for t in rounded),
    )
    for i, (name, a, b, c) in enumerate(zip(names, got, golden, baseline)):
        factor = OUTPUT_FACTOR if i == 0 else GRAD_FACTOR
        assert_tolerance(a.cpu().double(), b, c.cpu().double(), factor=factor, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_deformable_triton_backward_is_bit_identical_and_auto_takes_it(dtype):
    """Thousands of samples on the same pixels (where the original kernel's atomicAdd would
    add in a different order each run): three backward runs give the same bits; auto on CUDA
    is the Triton kernel, bit for bit."""
    value, loc, attn, go = (
        t.to(CUDA, dtype) for t in _deform_inputs(B=1, Lq=2000, M=2, P=4, spread=0.0, seed=1)
    )
    runs = [_deform_grads(_deform_triton, value, loc, attn, go) for _ in range(3)]
    auto = _deform_grads(lambda v, lo, a: _deform_triton(v, lo, a, "auto"), value, loc, attn, go)
    for other in [*runs[1:], auto]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x, y)
