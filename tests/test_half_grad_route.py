"""bfloat16 attention that wants a gradient on a CPU: in bfloat16 or in float32, by measurement
(``qkv.ops.cpu_isa.half_grad_route``, ``QKV_CPU_HALF_GRAD``).

Measured on an AMD Zen 4 (AVX-512-BF16, one thread), torch's bfloat16 forward and backward
was 1.9-2.5x slower than widening to float32 up to T = S = 128 and 1.1-1.3x faster from 512
on; held to AVX2 it was 3-5x slower at every length. Its gradients were also outside the
tolerance policy on 12 of 100 draws at T=1, S=2, D=4, where float32's, rounded once, never
are. So each size class takes the route measured faster here, and both routes run on every
machine: forced here, and by the ``cpu_route`` fixture (tests/routes.py). A call too small
to be within the policy on torch's bfloat16 kernels (``qkv.ops.call.EXACT_HALF_OUTPUTS``)
computes in float32 on either route, with or without a gradient.

Shape alphabet: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.ops import cpu_isa
from qkv.ops.call import EXACT_HALF_OUTPUTS, EXACT_HALF_WORK, AttentionCall
from qkv.testing import ATOL, GRAD_FACTOR, OUTPUT_FACTOR, max_error

BF16 = torch.bfloat16


@pytest.fixture(params=["native", "float32"])
def route(request, monkeypatch):
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", request.param)
    return request.param


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
def test_the_float32_route_is_float32_rounded_once(monkeypatch, backend):
    """Forced to float32, a bfloat16 call's output and gradients are the float32 call's on
    the widened inputs, rounded once to bfloat16, to the bit; forced native they are not all
    (torch's bfloat16 kernels round on the way)."""
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", "float32")
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
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", "native")
    native = _run(
        lambda a, b, c: qkv.scaled_dot_product_attention(a, b, c, is_causal=True, backend=backend),
        q,
        k,
        v,
        grad,
    )
    assert not all(torch.equal(a, b) for a, b in zip(native, wide))


@pytest.mark.parametrize("backend", ["auto", "torch", "tiled"])
def test_a_shared_key_gradient_is_summed_in_float32_and_rounded_once(monkeypatch, backend):
    """Keys and values shared by query heads (GQA) and broadcast over the batch: on the
    float32 route their gradients are the float32 call's on the widened inputs, rounded once
    (widened before the heads are repeated: summed per head in bfloat16, a shared key's
    gradient was 3.05x the policy's error, found by the long property profile)."""
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", "float32")
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


def test_small_calls_meet_the_policy_where_bfloat16_kernels_miss_it(route):
    """T=1, S=2, D=4, 100 draws: torch's bfloat16 gradients missed the policy on 12 (this
    CPU, torch 2.13; any number is allowed here, it is torch's); qkv's, on either route, on
    none: a call this small is computed in float32 and rounded once, at most a bfloat16
    rounding of the exact value, never more than the bfloat16 plain math's own."""
    for seed in range(100):
        q, k, v, grad = _inputs(1, 2, 1, 2, 4, seed)
        got = _run(qkv.scaled_dot_product_attention, q, k, v, grad)
        gold = _run(_plain, q.double(), k.double(), v.double(), grad.double())
        base = _run(_plain, q, k, v, grad)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            factor = OUTPUT_FACTOR if i == 0 else GRAD_FACTOR
            bound = factor * max_error(base[i], gold[i]) + ATOL
            assert max_error(got[i], gold[i]) <= bound, f"draw {seed}, {name}"


def test_the_work_dtype_follows_the_route_only_for_bfloat16_calls_wanting_a_gradient(route):
    q, k, v, _ = _inputs(1, 2, 8, 8, 16, seed=1)
    wide = torch.float32 if route == "float32" else BF16
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


def test_module_training_step_on_each_route_meets_the_policy(route):
    """A bfloat16 ``MultiHeadAttention`` training step (projections, attention, W^O) on each
    route: the weights' gradients within the policy (3x the error of the same module on the
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
def test_small_bfloat16_calls_compute_in_float32_on_either_route(route, grad):
    """A bfloat16 CPU call whose output (or, with a gradient, the smallest of the output and
    q's, k's and v's gradients) has at most ``EXACT_HALF_OUTPUTS`` numbers computes in
    float32, at most ``EXACT_HALF_WORK`` multiply-adds; other calls as the route says."""
    route_dtype = torch.float32 if grad and route == "float32" else BF16

    def work_dtype(B, H, T, S, D, leaf="q", dtype=BF16):
        q, k, v, _ = _inputs(B, H, T, S, D, seed=2, dtype=dtype)
        t = {"q": q, "k": k, "v": v}[leaf]
        t.requires_grad_(grad)
        return AttentionCall.build(q, k, v).work_dtype

    assert EXACT_HALF_OUTPUTS == 64
    assert work_dtype(1, 1, 1, 5, 4) == torch.float32  # 4 outputs
    assert work_dtype(1, 2, 2, 5, 16) == torch.float32  # 64
    assert work_dtype(1, 1, 1, 5, 128) == route_dtype  # 128
    assert work_dtype(1, 1, 65, 65, 1) == route_dtype  # 65 in each
    # 240 outputs, but v's and k's gradient have 3 numbers each
    assert work_dtype(1, 1, 80, 1, 3, leaf="v") == (torch.float32 if grad else BF16)
    S = EXACT_HALF_WORK // 8  # T = 1, D = Dv = 4: at the bound, and one key beyond it
    assert work_dtype(1, 1, 1, S, 4) == torch.float32
    assert work_dtype(1, 1, 1, S + 1, 4) == route_dtype
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


def test_size_classes_go_by_the_keys_a_row_sees(measuring):
    """``short`` up to 256 keys a row may see, ``long`` beyond; a sliding window counts its
    width, whatever S is: here short measured float32 and long native."""
    assert cpu_isa.half_grad_bucket(256) == "short"
    assert cpu_isa.half_grad_bucket(257) == "long"
    q, k, v, _ = _inputs(1, 1, 1024, 1024, 8, seed=5)
    q.requires_grad_()
    assert AttentionCall.build(q, k, v).work_dtype == BF16  # long: native
    window = qkv.masks.sliding_window(127)  # 128 keys
    assert AttentionCall.build(q, k, v, mask_mod=window).work_dtype == torch.float32
    wide = qkv.masks.sliding_window(200, 100)  # 301 keys
    assert AttentionCall.build(q, k, v, mask_mod=wide).work_dtype == BF16
    assert AttentionCall.build(q, k[..., :200, :], v[..., :200, :]).work_dtype == torch.float32


class Clock:
    now = 0.0


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Measuring on, a fresh cache folder, no forced route, a fake clock and fake runners
    whose costs the test sets (``costs[bucket][route]`` seconds); the flags' rule says
    native. Yields the runs made, per bucket and route."""
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("QKV_CPU_HALF_GRAD", raising=False)
    monkeypatch.setattr(cpu_isa, "_clock", lambda: Clock.now)
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda: True)
    costs = {"short": {"native": 4e-3, "float32": 1e-3}, "long": {"native": 5e-3, "float32": 9e-3}}
    runs: dict = {}

    def runners(bucket):
        def runner(route):
            def run():
                runs[bucket, route] = runs.get((bucket, route), 0) + 1
                Clock.now += costs[bucket][route]

            return run

        return {r: runner(r) for r in ("native", "float32")}

    monkeypatch.setattr(cpu_isa, "_grad_runners", runners)
    cpu_isa.forget()
    yield costs, runs
    cpu_isa.forget()


def test_each_size_class_takes_the_route_measured_faster(measuring):
    costs, runs = measuring
    assert cpu_isa.half_grad_route("short") == "float32"
    assert cpu_isa.half_grad_route("long") == "native"
    choice = cpu_isa.HALF_GRAD.choice("short")
    assert choice.source == "measured"
    assert choice.times == pytest.approx({"native": 4e-3, "float32": 1e-3})
    assert runs["short", "native"] >= 3 and runs["short", "float32"] >= 3  # 1 untimed, 2+
    assert cpu_isa.explain_half_grad("short") == (
        "bfloat16 attention gradient (short) -> float32: faster measured on this machine "
        "(float32 1 ms, native 4 ms; measured)"
    )
    q, k, v, _ = _inputs(1, 2, 8, 8, 16, seed=2)
    assert AttentionCall.build(q.requires_grad_(), k, v).work_dtype == torch.float32
    made = dict(runs)
    costs["short"] = {"native": 1e-3, "float32": 8e-3}  # the process keeps its verdict
    assert cpu_isa.half_grad_route("short") == "float32" and runs == made


def test_the_verdict_goes_to_disk_and_a_later_process_reads_it(measuring, tmp_path):
    from qkv import autotune

    _, runs = measuring
    cpu_isa.half_grad_route("short")
    (stored,) = tmp_path.glob("autotune-*.json")
    entry = json.loads(stored.read_text())["choices"]["route:half_grad/bfloat16/short"]
    assert entry["route"] == "float32"
    assert entry["times"] == pytest.approx({"native": 4e-3, "float32": 1e-3})
    autotune.forget()  # as a new process: memory empty, the file stays
    made = dict(runs)
    assert cpu_isa.half_grad_route("short") == "float32" and runs == made
    assert cpu_isa.HALF_GRAD.choice("short").source == "disk"


def test_forced_off_and_traced_routes_time_nothing(measuring, monkeypatch):
    _, runs = measuring
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", "native")
    assert cpu_isa.half_grad_route("short") == "native"
    assert "forced by QKV_CPU_HALF_GRAD=native" in cpu_isa.explain_half_grad("short")
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", "fast")
    with pytest.raises(ValueError, match="QKV_CPU_HALF_GRAD must be 'native' or 'float32'"):
        cpu_isa.half_grad_route("short")
    monkeypatch.delenv("QKV_CPU_HALF_GRAD")
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    assert cpu_isa.half_grad_route("short") == "native"  # the flags' rule
    assert "QKV_AUTOTUNE=off" in cpu_isa.explain_half_grad("short")
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda: False)
    assert cpu_isa.half_grad_route("long") == "float32"
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert cpu_isa.half_grad_route("short") == "float32"  # the flags' rule, untimed
    assert runs == {}
    assert cpu_isa.half_grad_route("short") == "float32"  # measured now
    assert runs


def test_qkv_tune_measures_both_size_classes(measuring, monkeypatch):
    from qkv.bench.tune import tune_routes

    rows = {r["choice"]: r for r in tune_routes()}
    short = rows["bfloat16 gradient (short)"]
    assert short["route"] == "float32" and "forced" not in short
    assert rows["bfloat16 gradient (long)"]["route"] == "native"
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", "float32")
    rows = {r["choice"]: r for r in tune_routes()}
    long = rows["bfloat16 gradient (long)"]
    assert (long["forced"], long["switch"]) == ("float32", "QKV_CPU_HALF_GRAD")


def test_the_real_runners_run_both_routes(monkeypatch):
    """The representative call of each size class by each route: bfloat16 gradients of the
    right shapes, and torch's thread count and grad mode as they were."""
    threads = torch.get_num_threads()
    with torch.no_grad():
        for bucket in cpu_isa.HALF_GRAD_BUCKETS:
            for name, run in cpu_isa._grad_runners(bucket).items():
                grads = run()
                heads, L = cpu_isa._GRAD_CASES[bucket]
                assert [g.shape for g in grads] == [(1, heads, L, 64)] * 3, name
                assert all(g.dtype == BF16 and torch.isfinite(g).all() for g in grads), name
            if bucket == "short":
                times = cpu_isa._time_grad_routes(bucket)
                assert set(times) == {"native", "float32"} and min(times.values()) > 0
        assert torch.get_num_threads() == threads and not torch.is_grad_enabled()


def test_a_compiled_training_step_keeps_the_route(monkeypatch):
    """Under torch.compile the route enters the graph as a constant: the compiled step's
    gradients are the eager step's on the float32 route (no graph break)."""
    monkeypatch.setenv("QKV_CPU_HALF_GRAD", "float32")
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


def test_autocast_takes_the_route_of_the_dtype_it_casts_to(route):
    """Under CPU autocast to bfloat16, float32 inputs wanting a gradient are cast and take the
    bfloat16 route: the same bits as the call on bfloat16 inputs cast by hand, gradients
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
