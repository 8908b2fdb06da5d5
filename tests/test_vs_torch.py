"""Agreement with torch.nn.functional.scaled_dot_product_attention, float64, to 1e-12."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKENDS, make_mask, rand
from torch.nn.attention import SDPBackend

import qkv

SIZES = [1, 2, 17, 97, 113]
MASKS = ["none", "bool-TS", "bool-keypad", "float-BHTS", "causal"]
GRID = [
    pytest.param(T, S, D, m, id=f"B2-T{T}-S{S}-H3-D{D}-{m}")
    for T, S, D, m in itertools.product(SIZES, SIZES, [8, 59, 64], MASKS)
]


def _assert_all_backends_match(q, k, v, **kw):
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    for backend in BACKENDS:
        got = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=backend)


@pytest.mark.parametrize("T,S,D,mask", GRID)
def test_grid_float64(T, S, D, mask):
    B, H = 2, 3
    q, k, v = rand(B, H, T, D), rand(B, H, S, D), rand(B, H, S, D)
    attn_mask = make_mask(mask, B, H, T, S)
    _assert_all_backends_match(q, k, v, attn_mask=attn_mask, is_causal=mask == "causal")


@pytest.mark.parametrize("T,S", [(1, 17), (17, 1), (97, 113), (113, 97)], ids=str)
@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (6, 1), (8, 2)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_float64(T, S, H, G, causal):
    q, k, v = rand(2, H, T, 59), rand(2, G, S, 59), rand(2, G, S, 16)
    mask = torch.rand(T, S) < 0.8
    _assert_all_backends_match(q, k, v, is_causal=causal, enable_gqa=True)
    _assert_all_backends_match(q, k, v, attn_mask=mask, enable_gqa=True)


SHAPES = {
    "2D": ((17, 8), (13, 8), (13, 5)),
    "3D": ((3, 17, 8), (3, 13, 8), (3, 13, 5)),
    "5D": ((2, 3, 4, 17, 8), (2, 3, 4, 13, 8), (2, 3, 4, 13, 5)),
    "bcast-batch": ((2, 4, 17, 8), (1, 4, 13, 8), (1, 4, 13, 5)),
    "bcast-heads": ((2, 4, 17, 8), (2, 1, 13, 8), (2, 1, 13, 5)),
    "2D-q-4D-kv": ((17, 8), (2, 4, 13, 8), (2, 4, 13, 5)),
    "4D-q-2D-kv": ((2, 4, 17, 8), (13, 8), (13, 5)),
    "kv-lead-differ": ((2, 4, 17, 8), (1, 4, 13, 8), (2, 4, 13, 5)),
}


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_leading_dims_as_torch(name, causal):
    qs, ks, vs = SHAPES[name]
    q, k, v = rand(*qs), rand(*ks), rand(*vs)
    _assert_all_backends_match(q, k, v, is_causal=causal)
    _assert_all_backends_match(q, k, v, attn_mask=torch.rand(17, 13) < 0.8)


@pytest.mark.parametrize(
    "shapes",
    [
        ((6, 17, 8), (2, 13, 8), (2, 13, 8)),
        ((2, 3, 8, 17, 8), (2, 3, 4, 13, 8), (2, 3, 4, 13, 8)),
    ],
    ids=["3D", "5D"],
)
def test_gqa_other_ranks(shapes):
    q, k, v = (rand(*s) for s in shapes)
    _assert_all_backends_match(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("scale", [0.0, 0.1, -0.5, 3.0])
def test_scale(scale):
    q, k, v = rand(2, 3, 17, 8), rand(2, 3, 13, 8), rand(2, 3, 13, 8)
    _assert_all_backends_match(q, k, v, scale=scale)


@pytest.mark.parametrize("mask_dims", [(17, 13), (1, 13), (17, 1), (3, 1, 13), (2, 1, 17, 13)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcast_shapes(mask_dims, kind):
    q, k, v = rand(2, 3, 17, 8), rand(2, 3, 13, 8), rand(2, 3, 13, 8)
    mask = torch.rand(*mask_dims) < 0.8
    if kind == "float":
        mask = torch.randn(*mask_dims, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    _assert_all_backends_match(q, k, v, attn_mask=mask)


def test_float32_mask_with_bfloat16_inputs_as_torch_or_closer():
    """torch takes a float32 mask for half inputs; so do we, and on CPU keep the mask's
    precision through the softmax (computing in float32): never further from float64 math
    than torch's own bfloat16 kernel."""
    q, k, v = (rand(2, 3, 17, 8, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(17, 17)
    # plain float64 math (not torch's SDPA: on an H100 its result here held NaN, so the
    # comparison read nan <= nan; gpu-check, 2026-11-26)
    scores = q.double() @ k.double().transpose(-2, -1) / 8**0.5 + bias.double()  # (2, 3, T, S)
    golden = scores.softmax(-1) @ v.double()  # (2, 3, T, 8)
    torch_err = (
        (F.scaled_dot_product_attention(q, k, v, attn_mask=bias).double() - golden).abs().max()
    )
    # where torch's own kernel is not finite (CUDA), the tolerance policy's bound instead
    base = qkv.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend="reference")
    bound = torch_err if torch_err.isfinite() else 2 * (base.double() - golden).abs().max()
    for backend in ["torch", "auto", "tiled"]:
        got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
        assert got.dtype == torch.bfloat16
        assert (got.double() - golden).abs().max() <= bound, backend


def test_empty_keys_and_queries():
    q, k, v = rand(2, 3, 5, 8), rand(2, 3, 0, 8), rand(2, 3, 0, 4)
    for backend in BACKENDS:
        out = qkv.scaled_dot_product_attention(q, k, v, backend=backend)
        assert out.shape == (2, 3, 5, 4) and bool((out == 0).all())
        out = qkv.scaled_dot_product_attention(
            q[:, :, :0], v[:, :, :0].new_zeros(2, 3, 4, 8), rand(2, 3, 4, 4), backend=backend
        )
        assert out.shape == (2, 3, 0, 4)


def test_cudnn_takes_no_masked_call_that_wants_a_gradient():
    """torch's kernel order on CUDA (``torch_sdpa._kernel_order``, asked with a stand-in for a
    CUDA call: the CPU cannot make one): cuDNN's backward with a mask gives NaN in dq where T %
    128 == 64 and a row's log-sum-exp is below -88.7 (pytorch/pytorch#196678), so a masked
    call that wants a gradient runs without it; a plain half call tries cuDNN first; a masked
    inference call keeps torch's order. tests/test_cuda.py holds the first to the plain math
    on the GPU."""
    import types

    from qkv.ops import torch_sdpa

    def cuda_call(grad, dtype=torch.bfloat16):
        return types.SimpleNamespace(
            device=torch.device("cuda"), dtype=dtype, dropout_p=0.0, wants_grad=grad
        )

    mask = torch.ones(4, 4, dtype=torch.bool)
    order = torch._C._get_sdp_priority_order()
    for dtype in (torch.bfloat16, torch.float32):
        with torch_sdpa._kernel_order(cuda_call(True, dtype), mask):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()  # (restored)
    with torch_sdpa._kernel_order(cuda_call(False), mask):
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert torch._C._get_sdp_priority_order() == order
    with torch_sdpa._kernel_order(cuda_call(True), None):
        assert torch._C._get_sdp_priority_order()[0] == SDPBackend.CUDNN_ATTENTION.value
    assert torch._C._get_sdp_priority_order() == order
