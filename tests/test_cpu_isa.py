"""The CPU capability behind the half-precision route of the CPU kernels (issue 25).

Half inputs are multiplied by torch in half only where the CPU has native bfloat16 arithmetic
(AVX-512-BF16 or AMX) that torch and oneDNN may use; elsewhere in float32. This machine may
have either kind, so the decision is tested with the capability given, and both routes are
held to the tolerance policy whatever the machine.
"""

from __future__ import annotations

import json

import pytest
import torch

import qkv
from qkv.ops import bf16_scores, cpu_isa
from qkv.ops.call import AttentionCall
from qkv.ops.reference import attention_with_weights
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance

ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
ICE_LAKE = frozenset({"avx2", "avx512f", "avx512_vnni"})  # AVX-512 without BF16
ZEN3 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize(
    "features, capability, onednn, native",
    [
        (ZEN4, "AVX512", "", True),
        (SAPPHIRE_RAPIDS, "AVX512", "", True),
        (ICE_LAKE, "AVX512", "", False),
        (ZEN3, "AVX2", "", False),
        (ZEN4, "AVX2", "", False),  # ATEN_CPU_CAPABILITY=avx2 holds torch to AVX2
        (ZEN4, "AVX512", "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN to AVX2
        (ZEN4, "AVX512", "AVX512_CORE_BF16", True),
        (frozenset(), "AVX512", "", False),  # flags unreadable: the safe route
    ],
    ids=[
        "zen4",
        "sapphire-rapids",
        "ice-lake",
        "zen3",
        "zen4-aten-avx2",
        "zen4-onednn-avx2",
        "zen4-onednn-bf16",
        "unknown",
    ],
)
def test_native_bf16_from_capability(features, capability, onednn, native):
    assert cpu_isa.native_bf16(features, capability, onednn) is native


def test_environment_overrides_the_route(monkeypatch):
    monkeypatch.setenv("QKV_AUTOTUNE", "off")  # the flag rule
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda: False)
    monkeypatch.delenv("QKV_CPU_HALF_GEMM", raising=False)
    assert cpu_isa.half_gemm_route() == "float32"
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda: True)
    assert cpu_isa.half_gemm_route() == "native"
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "float32")
    assert cpu_isa.half_gemm_route() == "float32"
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "fast")
    with pytest.raises(ValueError, match="QKV_CPU_HALF_GEMM must be 'native' or 'float32'"):
        cpu_isa.half_gemm_route()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_the_weights_are_the_same_on_both_routes(dtype, monkeypatch):
    """Weights in one pass, half inputs: the same output, weights and lse whichever route
    is forced (issue 37: both products are float32 on every route, since torch's CPU half
    GEMMs round their output), within the tolerance policy of the float64 reference, and
    the lse within float32's error of float64's."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 97, 32, generator=g).to(dtype).double() for _ in range(3))
    mask = qkv.masks.sliding_window(20)
    call = AttentionCall.build(
        q.to(dtype), k.to(dtype), v.to(dtype), mask_mod=mask, return_trace=True
    )
    results = {}
    # the same float32 GEMMs on both routes, so bit for bit; the bf16 score kernel, which the
    # native route takes where it runs, sums in another order (float32's error, held to
    # float64 math in tests/test_bf16_scores.py)
    monkeypatch.setattr(bf16_scores, "available", lambda: False)
    for route in ("native", "float32"):
        monkeypatch.setenv("QKV_CPU_HALF_GEMM", route)
        results[route] = attention_with_weights(call)
    out, probs, lse = results["native"]
    for a, b in zip(results["native"], results["float32"]):
        assert torch.equal(a, b)
    golden, golden_t = qkv.scaled_dot_product_attention(
        q, k, v, mask_mod=mask, backend="reference", return_trace=True
    )
    base, base_t = qkv.scaled_dot_product_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), mask_mod=mask, backend="reference", return_trace=True
    )
    assert out.dtype == probs.dtype == dtype and lse.dtype == torch.float32
    assert_tolerance(out, golden, base, factor=OUTPUT_FACTOR, name="out")
    assert_tolerance(probs, golden_t.probs, base_t.probs, factor=OUTPUT_FACTOR, name="probs")
    torch.testing.assert_close(lse.double(), golden_t.lse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("route", ["float32", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_module_projections_by_route_meet_the_tolerance_policy(route, dtype, monkeypatch):
    """qkv.MultiHeadAttention in half precision on either route: the in- and out-projections
    (float32 products rounded once, or torch's half GEMM) keep the module within the policy
    of its float64 twin: output and weights with and without a gradient, and the input's
    gradient (issue 37: forward and backward, with and without traces); the float32 route's
    products are float32 ones: exactly F.linear in float32, rounded."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", route)
    torch.manual_seed(0)
    wide = qkv.MultiHeadAttention(48, 4, dtype=torch.float64).eval()
    half = qkv.MultiHeadAttention(48, 4, dtype=dtype).eval()
    half.load_state_dict(wide.state_dict())
    base = qkv.MultiHeadAttention(48, 4, dtype=dtype, backend="reference").eval()
    base.load_state_dict(wide.state_dict())
    x = torch.randn(2, 33, 48, dtype=torch.float64)
    x64, xb, xh = x.clone().requires_grad_(), x.to(dtype).requires_grad_(), x.to(dtype)
    golden, golden_t = wide(x64, is_causal=True, return_trace=True)
    want, want_t = base(xb, is_causal=True, return_trace=True)
    with torch.no_grad():  # the one-pass weights
        runs = {"no grad": half(xh, is_causal=True, return_trace=True)}
    xh.requires_grad_()
    runs["grad"] = half(xh, is_causal=True, return_trace=True)
    for name, (out, trace) in runs.items():
        assert_tolerance(
            out.detach(), golden.detach(), want.detach(), factor=OUTPUT_FACTOR, name=name
        )
        assert_tolerance(
            trace.probs, golden_t.probs, want_t.probs, factor=OUTPUT_FACTOR, name=f"{name} probs"
        )
    for out in (golden, want, runs["grad"][0]):
        out.double().square().sum().backward()
    assert xh.grad is not None and xh.grad.dtype == dtype
    assert_tolerance(xh.grad, x64.grad, xb.grad, factor=GRAD_FACTOR, name="grad x")
    w, b = half.in_proj_weight, half.in_proj_bias
    got = cpu_isa.linear(xh.detach(), w, b)
    if route == "float32":
        assert torch.equal(
            got, torch.nn.functional.linear(x.to(dtype).float(), w.float(), b.float()).to(dtype)
        )
    else:
        assert torch.equal(got, torch.nn.functional.linear(x.to(dtype), w, b))


def test_a_hooked_or_wrapped_out_proj_is_still_called(monkeypatch):
    """The float32 route multiplies a plain out_proj itself; a hooked one, or a module put in
    its place (a LoRA wrapper), is called as it is, so its hook or its own forward runs."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "float32")
    torch.manual_seed(0)
    m = qkv.MultiHeadAttention(32, 4, dtype=torch.bfloat16).eval().requires_grad_(False)
    x = torch.randn(1, 9, 32, dtype=torch.bfloat16)
    plain = m(x)
    seen = []
    handle = m.out_proj.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    torch.testing.assert_close(m(x), plain, rtol=0, atol=float(plain.abs().max()) * 2**-7)
    assert seen == [torch.Size([1, 9, 32])]
    handle.remove()

    class Doubled(torch.nn.Module):  # a wrapper in the place of out_proj
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            return 2 * self.inner(h)

    m.out_proj = Doubled(m.out_proj)
    torch.testing.assert_close(m(x), 2 * plain, rtol=0, atol=float(plain.abs().max()) * 2**-6)


@pytest.mark.parametrize("route", ["float32", "native"])
def test_torch_compat_module_in_bf16_matches_torch_by_either_route(route, monkeypatch):
    """qkv.torch_compat.MultiheadAttention's projections go by the route too: in bfloat16 its
    output and weights stay within a bf16 rounding or two of torch's own module."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", route)
    from torch import nn

    from qkv.torch_compat import MultiheadAttention

    torch.manual_seed(0)
    tm = nn.MultiheadAttention(64, 4, dtype=torch.bfloat16).eval()
    qm = MultiheadAttention(64, 4, dtype=torch.bfloat16).eval()
    qm.load_state_dict(tm.state_dict())
    x = torch.randn(30, 2, 64, dtype=torch.bfloat16)  # (T, B, C), torch's layout
    with torch.no_grad():
        want, want_w = tm(x, x, x, average_attn_weights=False)
        out, w = qm(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(out, want, rtol=0, atol=3e-2)
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-2)


# --- the route by measurement (issue 38, item 2) -----------------------------------------------


class Clock:
    now = 0.0


class FakeGemms:
    """``cpu_isa._gemm_runners`` with fake costs: each run of a route advances the fake clock
    by its cost (seconds, per dtype) and counts itself."""

    def __init__(self, costs: dict):
        self.costs = {dt: dict(c) for dt, c in costs.items()}  # a test may change its copy
        self.runs = {dt: dict.fromkeys(("native", "float32"), 0) for dt in costs}

    def __call__(self, dtype, one_row=False):
        """(costs keyed ``(dtype, "one row")`` for one row's products, else by dtype)"""
        key = (dtype, "one row") if one_row and (dtype, "one row") in self.costs else dtype

        def runner(route):
            def run():
                self.runs[key][route] += 1
                Clock.now += self.costs[key][route]

            return run

        return {route: runner(route) for route in ("native", "float32")}

    def total(self) -> int:
        return sum(n for per_dtype in self.runs.values() for n in per_dtype.values())


BF16, F16 = torch.bfloat16, torch.float16
NATIVE_BF16 = cpu_isa.native_bf16  # as the library has it (the fixture below replaces it)


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Measuring on, a fresh cache folder, no forced route, the fake clock; the flag rule
    says float32 (so a measured "native" is the measurement's doing). Yields a function
    that installs fake GEMM costs."""
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("QKV_CPU_HALF_GEMM", raising=False)
    monkeypatch.setattr(cpu_isa, "_clock", lambda: Clock.now)
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda: False)
    cpu_isa.forget()

    def install(costs):
        fake = FakeGemms(costs)
        monkeypatch.setattr(cpu_isa, "_gemm_runners", fake)
        return fake

    yield install
    cpu_isa.forget()


# native 1 ms vs float32 4 ms in bfloat16 (AMX), the other way round in float16
AMX_LIKE = {BF16: {"native": 1e-3, "float32": 4e-3}, F16: {"native": 9e-3, "float32": 3e-3}}


def test_the_route_measured_faster_is_taken_for_each_dtype(measuring):
    """Timed both ways, each dtype takes its faster route, whatever the flags say (float32
    here): bfloat16 native, float16 widened; the tensors' products follow."""
    fake = measuring(AMX_LIKE)
    assert cpu_isa.half_gemm_route(BF16) == "native"
    assert cpu_isa.half_gemm_route(F16) == "float32"
    choice = cpu_isa.half_gemm_choice(BF16)
    assert choice.source == "measured"
    assert choice.times == pytest.approx({"native": 1e-3, "float32": 4e-3})
    assert fake.runs[BF16]["native"] >= 3 and fake.runs[BF16]["float32"] >= 3  # 1 untimed, 2+
    assert not cpu_isa.widens_half(torch.ones(2, 3, dtype=BF16))
    assert cpu_isa.widens_half(torch.ones(2, 3, dtype=F16))
    why = cpu_isa.explain_half_gemm(BF16)
    assert why == (
        "half GEMM bfloat16 -> native: faster measured on this machine "
        "(native 1 ms, float32 4 ms; measured)"
    )


def test_one_row_products_have_a_route_of_their_own(measuring):
    """A product of one row (a decoding step's projection) is measured apart: held to AVX2,
    torch's bfloat16 matrix-vector product beat widening the weight (146 against 374 us),
    while its GEMM of 8 rows and more lost. Here one row takes native bfloat16 and 8 rows
    float32, each with the products of its route."""
    fake = measuring(
        {
            BF16: {"native": 9e-3, "float32": 3e-3},
            (BF16, "one row"): {"native": 1e-3, "float32": 4e-3},
        }
    )
    assert cpu_isa.half_gemm_route(BF16) == "float32"
    assert cpu_isa.half_gemm_route(BF16, one_row=True) == "native"
    assert fake.runs[(BF16, "one row")]["native"] >= 3 and fake.runs[BF16]["float32"] >= 3
    assert cpu_isa.half_gemm_choice(BF16, one_row=True).source == "measured"
    assert cpu_isa.explain_half_gemm(BF16, one_row=True).startswith(
        "half GEMM bfloat16/one row -> native: faster measured on this machine"
    )
    assert not cpu_isa.widens_half(torch.ones(1, 1, 5, dtype=BF16))
    assert not cpu_isa.widens_half(torch.ones(5, dtype=BF16))
    assert cpu_isa.widens_half(torch.ones(1, 8, 5, dtype=BF16))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 5, generator=g).to(BF16)
    for rows in (1, 8):
        x = torch.randn(1, rows, 5, generator=g).to(BF16)
        want = (
            torch.nn.functional.linear(x, w)
            if rows == 1
            else torch.nn.functional.linear(x.float(), w.float()).to(BF16)
        )
        assert torch.equal(cpu_isa.linear(x, w), want)


def test_a_route_is_measured_once_per_process(measuring):
    fake = measuring(AMX_LIKE)
    assert cpu_isa.half_gemm_route(BF16) == "native"
    runs = fake.total()
    fake.costs[BF16] = {"native": 8e-3, "float32": 1e-3}  # slower now: the route holds
    for _ in range(3):
        assert cpu_isa.half_gemm_route(BF16) == "native"
    assert fake.total() == runs


def test_the_route_goes_to_disk_and_a_later_process_reads_it(measuring, tmp_path):
    """The verdict is written beside auto's choices (same file, same machine key) and read
    back by a fresh process (``forget``) without measuring; ``qkv.autotune.forget`` drops
    the routes too."""
    from qkv import autotune

    fake = measuring(AMX_LIKE)
    cpu_isa.half_gemm_route(BF16)
    (stored,) = tmp_path.glob("autotune-*.json")
    assert stored == autotune.cache_path()
    data = json.loads(stored.read_text())
    assert data["machine"] == autotune.machine_key()
    entry = data["choices"]["route:half_gemm/bfloat16"]
    assert entry["route"] == "native"
    assert entry["times"] == pytest.approx({"native": 1e-3, "float32": 4e-3})
    autotune.forget()  # as a new process: memory empty, the file stays
    runs = fake.total()
    assert cpu_isa.half_gemm_route(BF16) == "native" and fake.total() == runs
    assert cpu_isa.half_gemm_choice(BF16).source == "disk"
    assert cpu_isa.explain_half_gemm(BF16).endswith("(native 1 ms, float32 4 ms; disk)")
    assert cpu_isa.half_gemm_route(F16) == "float32" and fake.total() > runs  # not on disk


def test_the_environment_wins_over_the_measurement(measuring, monkeypatch):
    fake = measuring(AMX_LIKE)
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "float32")
    assert cpu_isa.half_gemm_route(BF16) == "float32" and fake.total() == 0
    assert cpu_isa.explain_half_gemm(BF16) == (
        "half GEMM bfloat16 -> float32: forced by QKV_CPU_HALF_GEMM=float32"
    )
    monkeypatch.delenv("QKV_CPU_HALF_GEMM")
    assert cpu_isa.half_gemm_route(BF16) == "native"  # measured now
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "float32")
    assert cpu_isa.half_gemm_route(BF16) == "float32"  # and forced over the kept verdict


@pytest.mark.parametrize("native", [True, False], ids=["flags-native", "flags-float32"])
def test_autotune_off_gives_the_flag_rule(measuring, monkeypatch, native):
    fake = measuring(AMX_LIKE)
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    monkeypatch.setattr(cpu_isa, "native_bf16", lambda: native)
    want = "native" if native else "float32"
    assert cpu_isa.half_gemm_route(BF16) == cpu_isa.half_gemm_route(F16) == want
    assert fake.total() == 0
    assert "QKV_AUTOTUNE=off" in cpu_isa.explain_half_gemm(BF16)


def test_nothing_is_measured_under_tracing(measuring, monkeypatch):
    """Under vmap (torch.func) and under a dispatch mode (fake tensors), the route is the
    flag rule's and nothing is timed or kept: the next plain call measures. A verdict
    already known (here from disk) is what tracing takes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = measuring(AMX_LIKE)
    w, b = torch.randn(6, 4).to(BF16), torch.randn(6).to(BF16)
    xs = torch.randn(3, 5, 4).to(BF16)  # (N, T, C)
    seen = []

    def project(x):  # (T, C) -> (T, 3C/2)
        seen.append(cpu_isa.half_gemm_route(BF16))
        return cpu_isa.linear(x, w, b)

    torch.func.vmap(project)(xs)
    with FakeTensorMode():
        seen.append(cpu_isa.half_gemm_route(BF16))
    assert seen == ["float32", "float32"] and fake.total() == 0
    assert cpu_isa.half_gemm_route(BF16) == "native" and fake.total() > 0  # measured now
    cpu_isa.forget()  # a later process: the verdict is on disk
    seen.clear()
    torch.func.vmap(project)(xs)
    assert seen == ["native"]


def test_torch_compile_takes_the_known_route_without_measuring(measuring):
    """Under torch.compile (fullgraph) the route is looked up at trace time, a constant in
    the graph: the disk's verdict, and nothing is timed."""
    fake = measuring(AMX_LIKE)
    cpu_isa.half_gemm_route(BF16)
    cpu_isa.forget()  # a later process: the verdict is on disk
    runs = fake.total()
    w = torch.randn(6, 4).to(BF16)

    @torch.compile(fullgraph=True, backend="eager")
    def project(x):
        return cpu_isa.linear(x, w) if cpu_isa.half_gemm_route(BF16) == "native" else -x

    x = torch.randn(5, 4).to(BF16)
    torch.testing.assert_close(project(x), torch.nn.functional.linear(x, w))
    assert fake.total() == runs


def test_measuring_leaves_the_global_generator_and_grad_mode_alone(monkeypatch, tmp_path):
    """The real GEMMs run (fake clock: no timing asserted): the inputs come from a
    generator of their own, on one thread, under no_grad and without autocast; the global
    generator, the thread count, grad mode and autocast stay as they were."""
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("QKV_CPU_HALF_GEMM", raising=False)
    monkeypatch.setattr(cpu_isa, "_clock", lambda: Clock.now)
    cpu_isa.forget()
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(
        cpu_isa.F, "linear", lambda *a: seen.append(torch.get_num_threads()) or real(*a)
    )
    try:
        state, threads = torch.get_rng_state(), torch.get_num_threads()
        with torch.autocast("cpu", dtype=BF16):
            choice = cpu_isa.half_gemm_choice(F16)
            assert torch.is_autocast_enabled("cpu")
        assert choice.source == "measured" and set(choice.times) == {"native", "float32"}
        assert torch.equal(torch.get_rng_state(), state) and torch.is_grad_enabled()
        assert set(seen) == {1} and len(seen) >= 6 and torch.get_num_threads() == threads
    finally:
        cpu_isa.forget()


def test_the_dtype_must_be_half():
    want = r"dtype must be torch\.bfloat16 or torch\.float16, got torch\.float32"
    with pytest.raises(ValueError, match=want):
        cpu_isa.half_gemm_choice(torch.float32)


@pytest.mark.parametrize("autotune", ["on", "off"])
def test_a_bf16_module_compiles_whole(measuring, monkeypatch, autotune):
    """A bfloat16 MultiHeadAttention traces whole under torch.compile(fullgraph=True) with
    measuring on (the route not yet known: the flag rule's, nothing timed) and off. Before,
    dynamo traced the route's lookup into open("/proc/cpuinfo") and gave up."""
    fake = measuring(AMX_LIKE)
    monkeypatch.setenv("QKV_AUTOTUNE", autotune)
    monkeypatch.setattr(cpu_isa, "native_bf16", NATIVE_BF16)  # the real flags: /proc/cpuinfo
    flag_route = "native" if NATIVE_BF16() else "float32"
    torch.manual_seed(0)
    m = qkv.MultiHeadAttention(32, 4, dtype=BF16).eval()
    x = torch.randn(2, 9, 32).to(BF16)  # (B, T, C)
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(x)
        assert fake.total() == 0
        monkeypatch.setenv("QKV_CPU_HALF_GEMM", flag_route)
        want = m(x)
    assert torch.equal(got, want)


# --- bfloat16 linears with the bias fused (cpu_isa.fused_bias_here) ---------------------------


@pytest.fixture
def fused_calls(monkeypatch):
    """Count the calls of the fused op (where it runs here; else skip)."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    monkeypatch.delenv(cpu_isa.FUSED_BIAS_SWITCH, raising=False)
    if not cpu_isa.fused_bias_here():
        pytest.skip("oneDNN's bfloat16 linear with a fused bias does not run here")
    calls = [0]
    op = cpu_isa._FUSED_BIAS[0]

    def counted(*args):
        calls[0] += 1
        return op(*args)

    monkeypatch.setattr(cpu_isa, "_FUSED_BIAS", [counted])
    return calls


@pytest.mark.parametrize("rows", [(1, 1), (1, 7), (3, 33), (2, 130)])
@pytest.mark.parametrize("sizes", [(512, 1536), (40, 24), (96, 1)])
def test_a_fused_bias_gives_f_linear_s_bits(fused_calls, monkeypatch, rows, sizes):
    """Where the fused op runs, a bfloat16 linear with a bias takes it and gives
    ``F.linear``'s bits, for a decoding step's one row and for odd sizes; switched off
    (``QKV_CPU_FUSED_BIAS=off``) it takes ``F.linear``, to the same bits."""
    g = torch.Generator().manual_seed(0)
    C, N = sizes
    x = torch.randn(*rows, C, generator=g).to(torch.bfloat16)
    w = torch.randn(N, C, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, w, b)
    with torch.no_grad():
        fused = cpu_isa.linear(x, w, b)
        assert fused_calls[0] == 1 and torch.equal(fused, want)
        monkeypatch.setenv(cpu_isa.FUSED_BIAS_SWITCH, "off")
        assert torch.equal(cpu_isa.linear(x, w, b), want) and fused_calls[0] == 1


@pytest.mark.parametrize(
    "case",
    ["grad", "strided input", "strided weight", "no bias", "float32", "1-d", "fake", "autocast"],
)
def test_what_the_fused_bias_does_not_take_goes_to_f_linear(fused_calls, case):
    """A gradient wanted, a non-contiguous input or weight, no bias, another dtype, a 1-d input,
    CPU autocast (to float16 ``F.linear`` casts, the op would not), or a dispatch mode (fake
    tensors) take ``F.linear``: the gradient flows as before."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(12, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(12, generator=g).to(torch.bfloat16)
    if case == "grad":
        w.requires_grad_(True)
    elif case == "strided input":
        x = torch.randn(2, 18, 16, generator=g).to(torch.bfloat16)[:, ::2]
    elif case == "strided weight":
        w = torch.randn(16, 12, generator=g).to(torch.bfloat16).t()
    elif case == "no bias":
        b = None
    elif case == "float32":
        x, w, b = x.float(), w.float(), b.float()
    elif case == "1-d":
        x = x[0, 0]
    if case == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            out = cpu_isa.linear(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b))
        assert out.shape == (2, 9, 12) and fused_calls[0] == 0
        return
    if case == "autocast":
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            out, want = cpu_isa.linear(x, w, b), torch.nn.functional.linear(x, w, b)
        assert fused_calls[0] == 0 and out.dtype == torch.float16 and torch.equal(out, want)
        return
    out = cpu_isa.linear(x, w, b)
    assert fused_calls[0] == 0
    assert torch.equal(out, torch.nn.functional.linear(x, w, b))
    if case == "grad":
        out.float().sum().backward()
        assert w.grad is not None and w.grad.shape == w.shape


def test_the_fused_bias_probe_keeps_f_linear_where_the_op_fails_or_differs(monkeypatch):
    """The probe made once per process takes the op only where it runs and gives
    ``F.linear``'s bits: an op that raises (no bfloat16 primitive under this ISA) or gives
    other bits leaves every linear to ``F.linear``, and ``forget`` probes again."""
    monkeypatch.delenv(cpu_isa.FUSED_BIAS_SWITCH, raising=False)
    kept = list(cpu_isa._FUSED_BIAS)
    monkeypatch.setattr(cpu_isa, "_FUSED_BIAS", [])

    class Ops:
        def __init__(self, fn):
            self._linear_pointwise = fn

    def raises(*args):
        raise RuntimeError("could not create a primitive descriptor")

    def differs(x, w, b, *rest):
        return torch.nn.functional.linear(x, w, b) + 1

    for fn in (raises, differs):
        monkeypatch.setattr(torch.ops, "mkldnn", Ops(fn))
        cpu_isa.forget()
        assert not cpu_isa.fused_bias_here()
        x, w, b = (torch.ones(*size).bfloat16() for size in ((2, 3, 4), (5, 4), (5,)))
        with torch.no_grad():
            assert torch.equal(cpu_isa.linear(x, w, b), torch.full((2, 3, 5), 5.0).bfloat16())
    monkeypatch.undo()
    cpu_isa._FUSED_BIAS[:] = kept


def test_the_fused_bias_probe_made_under_autocast_finds_what_it_finds_without(monkeypatch):
    """The probe runs without autocast: made first under CPU autocast to float16 (where
    ``F.linear`` would cast its products), it finds what it finds outside."""
    monkeypatch.delenv(cpu_isa.FUSED_BIAS_SWITCH, raising=False)
    monkeypatch.setattr(cpu_isa, "_FUSED_BIAS", [])
    outside = cpu_isa.fused_bias_here()
    cpu_isa._FUSED_BIAS.clear()
    with torch.autocast("cpu", dtype=torch.float16):
        assert cpu_isa.fused_bias_here() == outside


@pytest.mark.parametrize("fused", ["on", "off"])
def test_a_bf16_module_gives_the_same_bits_with_the_bias_fused_or_not(monkeypatch, fused):
    """The fused bias changes speed only: a bfloat16 ``MultiHeadAttention`` call (its in- and
    out-projections) and a decoding step give the same bits switched on (where it runs) and
    off, on this machine's half GEMM route."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(64, 4).eval().to(torch.bfloat16)
    x = torch.randn(2, 11, 64).to(torch.bfloat16)
    step = torch.randn(2, 1, 64).to(torch.bfloat16)

    def run():
        with torch.no_grad():
            cache = mha.new_cache(2, 16)
            mha(x, cache=cache)
            return mha(x), mha(step, cache=cache), mha(step, cache=cache)

    monkeypatch.setenv(cpu_isa.FUSED_BIAS_SWITCH, "off")
    want = run()
    if fused == "on":
        monkeypatch.delenv(cpu_isa.FUSED_BIAS_SWITCH)
    for a, b in zip(run(), want):
        assert torch.equal(a, b)
