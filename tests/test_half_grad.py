"""bfloat16 attention that wants a gradient on a CPU computes in float32, rounded once
("bfloat16 gradients" in ``qkv.ops.call``).

torch's bfloat16 CPU backward is outside the tolerance policy, more so the longer the rows:
its dk/dv error against the float64 golden was 2.6x plain bfloat16 math's at T=S=128, 3.6x at
512 and 4.4x at 2048 (the policy allows 3x); at tiny sizes it missed on 12 of 100 draws at
T=1, S=2, D=4. Until 2026-11-28 qkv took it where it was faster (a measured route,
``QKV_CPU_HALF_GRAD``); now every size computes in float32 and the gradients are rounded once.
A call too small to be within the policy on torch's bfloat16 kernels without a gradient
(``qkv.ops.call.EXACT_HALF_OUTPUTS``) computes in float32 too.

Shape alphabet: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.ops.call import EXACT_HALF_OUTPUTS, EXACT_HALF_WORK, AttentionCall
from qkv.testing import ATOL, GRAD_FACTOR, OUTPUT_FACTOR, max_error

BF16 = torch.bfloat16


def _inputs(B, H, T, S, D, seed, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k, v = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in "kv")
    grad = torch.randn(B, H, T, D, generator=g).to(dtype)
    return q, k, v, grad


def _run(fn, q, k, v, grad):
    """Output and gradients of q, k, v of ``fn`` given ``grad`` for the output."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _plain(q, k, v):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
def test_a_gradient_call_is_the_float32_call_rounded_once(backend):
    """A bfloat16 call's output and gradients are the float32 call's on the widened inputs,
    rounded once to bfloat16, to the bit; torch's bfloat16 kernels give other bits (they
    round on the way)."""
    q, k, v, grad = _inputs(2, 3, 37, 45, 16, seed=0)
    got = _run(
        lambda a, b, c: qkv.scaled_dot_product_attention(a, b, c, is_causal=True, backend=backend),
        q,
        k,
        v,
        grad,
    )
    wide = _run(
        lambda a, b, c: qkv.scaled_dot_product_attention(
            a.float(), b.float(), c.float(), is_causal=True, backend=backend
        ).to(BF16),
        q,
        k,
        v,
        grad,
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, wide):
        assert a.dtype == BF16 and torch.equal(a, b), name
    native = _run(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
        q,
        k,
        v,
        grad,
    )
    assert not all(torch.equal(a, b) for a, b in zip(native, wide))


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
def test_a_shared_key_gradient_is_summed_in_float32_and_rounded_once(backend):
    """Keys and values shared by query heads (GQA) and broadcast over the batch: their
    gradients are the float32 call's on the widened inputs, rounded once (widened before the
    heads are repeated: summed per head in bfloat16, a shared key's gradient was 3.05x the
    policy's error, found by the long property profile)."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 37, 16, generator=g).to(BF16)
    k, v = (torch.randn(1, 2, 45, 16, generator=g).to(BF16) for _ in "kv")  # (1, G, S, D)
    grad = torch.randn(2, 4, 37, 16, generator=g).to(BF16)
    window = qkv.masks.sliding_window(20)

    def call(a, b, c):
        return qkv.scaled_dot_product_attention(
            a, b, c, enable_gqa=True, mask_mod=window, backend=backend
        )

    got = _run(call, q, k, v, grad)
    wide = _run(lambda a, b, c: call(a.float(), b.float(), c.float()).to(BF16), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, wide):
        assert a.dtype == BF16 and torch.equal(a, b), name


def test_small_calls_meet_the_policy_where_bfloat16_kernels_miss_it():
    """T=1, S=2, D=4, 100 draws: torch's bfloat16 gradients missed the policy on 12 (this
    CPU, torch 2.13; any number is allowed here, it is torch's); qkv's on none: computed in
    float32 and rounded once, each is at most a bfloat16 rounding of the exact value, never
    more than the bfloat16 plain math's own."""
    for seed in range(100):
        q, k, v, grad = _inputs(1, 2, 1, 2, 4, seed)
        got = _run(qkv.scaled_dot_product_attention, q, k, v, grad)
        gold = _run(_plain, q.double(), k.double(), v.double(), grad.double())
        base = _run(_plain, q, k, v, grad)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            factor = OUTPUT_FACTOR if i == 0 else GRAD_FACTOR
            bound = factor * max_error(base[i], gold[i]) + ATOL
            assert max_error(got[i], gold[i]) <= bound, f"draw {seed}, {name}"


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
def test_long_rows_meet_the_policy_where_torchs_bfloat16_backward_misses_it(backend):
    """T=S=512, causal, 2 heads of 64: torch's bfloat16 backward was 3.56x plain bfloat16
    math's dk error on this draw (the policy allows 3x; any figure is allowed here, it is
    torch's and is only reported); qkv's gradients are within the policy."""
    q, k, v, grad = _inputs(1, 2, 512, 512, 64, seed=3)

    causal = torch.ones(512, 512, dtype=torch.bool).tril()

    def plain(a, b, c):
        scores = (a @ b.transpose(-2, -1) / a.shape[-1] ** 0.5).masked_fill(~causal, -torch.inf)
        return torch.softmax(scores, -1) @ c

    got = _run(
        lambda a, b, c: qkv.scaled_dot_product_attention(a, b, c, is_causal=True, backend=backend),
        q,
        k,
        v,
        grad,
    )
    gold = _run(plain, q.double(), k.double(), v.double(), grad.double())
    base = _run(plain, q, k, v, grad)
    torchs = _run(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v, grad
    )
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        factor = OUTPUT_FACTOR if i == 0 else GRAD_FACTOR
        bound = factor * max_error(base[i], gold[i]) + ATOL
        ratio = max_error(torchs[i], gold[i]) / max_error(base[i], gold[i])
        assert max_error(got[i], gold[i]) <= bound, f"{name} (torch's kernel: {ratio:.2f}x)"


def test_the_work_dtype_is_float32_for_bfloat16_calls_wanting_a_gradient():
    q, k, v, _ = _inputs(1, 2, 1024, 1024, 16, seed=1)  # beyond the small calls' bound
    wide = torch.float32
    leaf = q.clone().requires_grad_()
    assert AttentionCall.build(leaf, k, v).work_dtype == wide
    assert AttentionCall.build(q, k, v.clone().requires_grad_()).work_dtype == wide
    assert AttentionCall.build(q, k, v).work_dtype == BF16  # no gradient wanted
    with torch.no_grad():
        assert AttentionCall.build(leaf, k, v).work_dtype == BF16
    half = [t.to(torch.float16) for t in (leaf.detach(), k, v)]
    assert AttentionCall.build(*half).work_dtype == torch.float32  # float16: always
    f32 = AttentionCall.build(leaf.detach().float().requires_grad_(), k.float(), v.float())
    assert f32.work_dtype == torch.float32


def test_module_training_step_meets_the_policy():
    """A bfloat16 ``MultiHeadAttention`` training step (projections, attention, W^O): the
    weights' gradients within the policy (3x the error of the same module on the
    reference backend in bfloat16) of the float64 module's."""
    torch.manual_seed(0)
    m64 = qkv.MultiHeadAttention(32, 4, bias=True).double()
    m16 = qkv.MultiHeadAttention(32, 4, bias=True).to(BF16)
    m16.load_state_dict({n: p.to(BF16) for n, p in m64.state_dict().items()})
    m64.load_state_dict({n: p.to(BF16).double() for n, p in m16.state_dict().items()})
    base = copy.deepcopy(m16)
    base.backend = "reference"
    x = torch.randn(2, 9, 32).to(BF16)
    for m, inp in ((m64, x.double()), (m16, x), (base, x)):
        m(inp, is_causal=True).square().sum().backward()
    for (name, p64), p16, pb in zip(m64.named_parameters(), m16.parameters(), base.parameters()):
        assert p16.grad is not None and p16.grad.dtype == BF16, name
        bound = GRAD_FACTOR * max_error(pb.grad, p64.grad) + ATOL
        assert max_error(p16.grad, p64.grad) <= bound, name


@pytest.mark.parametrize("grad", [False, True])
def test_small_bfloat16_calls_compute_in_float32(grad):
    """A bfloat16 CPU call without gradient whose output has at most ``EXACT_HALF_OUTPUTS``
    numbers computes in float32, at most ``EXACT_HALF_WORK`` multiply-adds; other calls in
    bfloat16. With a gradient, every call computes in float32."""
    beyond = torch.float32 if grad else BF16

    def work_dtype(B, H, T, S, D, leaf="q", dtype=BF16):
        q, k, v, _ = _inputs(B, H, T, S, D, seed=2, dtype=dtype)
        t = {"q": q, "k": k, "v": v}[leaf]
        t.requires_grad_(grad)
        return AttentionCall.build(q, k, v).work_dtype

    assert EXACT_HALF_OUTPUTS == 64
    assert work_dtype(1, 1, 1, 5, 4) == torch.float32  # 4 outputs
    assert work_dtype(1, 2, 2, 5, 16) == torch.float32  # 64
    assert work_dtype(1, 1, 1, 5, 128) == beyond  # 128
    assert work_dtype(1, 1, 65, 65, 1) == beyond  # 65 in each
    assert work_dtype(1, 1, 80, 1, 3, leaf="v") == beyond  # 240 outputs
    S = EXACT_HALF_WORK // 8  # T = 1, D = Dv = 4: at the bound, and one key beyond it
    assert work_dtype(1, 1, 1, S, 4) == torch.float32
    assert work_dtype(1, 1, 1, S + 1, 4) == beyond
    assert work_dtype(1, 1, 1, 5, 4, dtype=torch.float64) == torch.float64  # half dtypes only
    assert work_dtype(1, 1, 1, 5, 4, dtype=torch.float32) == torch.float32


def test_a_small_bfloat16_call_exports_with_dynamic_sizes():
    """Traced with symbolic sizes, a call counts as small only where it is for every size the
    symbols may take: asking would guard on them (``T <= 8`` here), and torch.export refused
    the dynamic T it was given. The exported program runs other sizes, the output close to
    the eager call's (computed in bfloat16 there, as any size may be)."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return qkv.scaled_dot_product_attention(q, k, v)

    q, k, v, _ = _inputs(1, 2, 6, 6, 4, seed=4)  # 48 numbers out: small in eager
    T, S = torch.export.Dim("T", min=2, max=64), torch.export.Dim("S", min=2, max=64)
    program = torch.export.export(Attend(), (q, k, v), dynamic_shapes=({2: T}, {2: S}, {2: S}))
    q, k, v, _ = _inputs(1, 2, 20, 30, 4, seed=5)
    got = program.module()(q, k, v)
    torch.testing.assert_close(got, qkv.scaled_dot_product_attention(q, k, v), atol=2e-2, rtol=0)


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
def test_small_bfloat16_inference_is_float32_rounded_once(backend):
    """A small bfloat16 call without gradient, a bool attn_mask (torch's kernel or tiled's
    generic path run it): the float32 call's output on the widened inputs, rounded once, to
    the bit; and within the policy where torch's bfloat16 kernel was not (draws found by a
    sweep: 18 of 500 missed it at T=1, S=64, D=2 through ``auto`` before; here T=3)."""
    g = torch.Generator().manual_seed(7)
    misses = 0
    for _ in range(40):
        q, k, v = (torch.randn(1, 1, n, 2, generator=g).to(BF16) for n in (3, 64, 64))
        keep = torch.rand(3, 64, generator=g) < 0.8  # per row: not the fused kernel's
        with torch.no_grad():
            got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, backend=backend)
            wide = qkv.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=keep, backend=backend
            ).to(BF16)
        assert torch.equal(got, wide)
        gold = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep)
        base = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, backend="reference")
        misses += max_error(got, gold) > OUTPUT_FACTOR * max_error(base, gold) + ATOL
    assert misses == 0


def test_a_compiled_training_step_computes_in_float32():
    """Under torch.compile the step computes in float32 as in eager: the compiled step's
    gradients are the eager step's (no graph break)."""
    q, k, v, grad = _inputs(1, 2, 16, 16, 8, seed=3)

    def step(a, b, c):
        return qkv.scaled_dot_product_attention(a, b, c, is_causal=True)

    eager = _run(step, q, k, v, grad)
    torch._dynamo.reset()
    compiled = _run(torch.compile(step, fullgraph=True), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=2**-7 * b.abs().max().item(), msg=name)
    wide = _run(
        lambda a, b, c: F.scaled_dot_product_attention(
            a.float(), b.float(), c.float(), is_causal=True
        ).to(BF16),
        q,
        k,
        v,
        grad,
    )
    assert torch.equal(eager[1], wide[1])


def test_autocast_computes_as_the_dtype_it_casts_to():
    """Under CPU autocast to bfloat16, float32 inputs wanting a gradient are cast and computed
    as bfloat16 inputs are: the same bits as the call on bfloat16 inputs cast by hand, gradients
    reaching the float32 leaves."""
    q, k, v, grad = _inputs(1, 2, 12, 20, 16, seed=4, dtype=torch.float32)
    wide = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=BF16):
        out = qkv.scaled_dot_product_attention(*wide, is_causal=True)
    assert out.dtype == BF16
    got = [out.detach(), *torch.autograd.grad(out, wide, grad.to(BF16))]
    by_hand = _run(
        lambda a, b, c: qkv.scaled_dot_product_attention(a, b, c, is_causal=True),
        *(t.to(BF16) for t in (q, k, v)),
        grad.to(BF16),
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, by_hand):
        assert torch.equal(a.to(BF16), b), name
    assert all(g.dtype == torch.float32 for g in got[1:])
