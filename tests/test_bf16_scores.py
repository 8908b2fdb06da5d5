"""bfloat16 attention scores in float32 by the C++ kernel of ops/bf16_scores.cpp (issues 37, 38).

``qkv.ops.bf16_scores`` forms ``scale * q @ k^T`` of bfloat16 inputs with float32 sums, never
rounded to bfloat16, on the CPU's AMX units or AVX512-BF16 (``bf16_scores.cpp``, each GEMM
forced in turn by the ``bf16_gemm`` fixture); the one-pass weights take it
on the native half route. Its results are held to float64 math of the same bfloat16 inputs,
written here: float32 accumulation error only. Where it cannot run (neither, no compiler), the
widened float32 GEMM (its slow twin, ``scores_widened_``) is taken, and the kernel's own tests
skip with the reason; the fallback tests run everywhere.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from routes import force_few_rows

import qkv
from qkv.ops import AttentionCall, bf16_scores, cpu_isa, reference
from qkv.testing import ATOL, OUTPUT_FACTOR, assert_tolerance, max_error

SIZES = [1, 7, 33, 100, 257]
HEAD_DIMS = [16, 64, 80, 128]
# float32 sums of D exact products: |error| <= ~D * 2^-24 * sum|q_i k_i| <= D * 6e-8 * |q||k|;
# the brief's bound for D=64 is 1e-6 of |q||k| (64 * 6e-8 = 3.8e-6 is the worst case, the
# typical error of a sum of random signs is far below it)
REL_BOUND = 1e-6


@pytest.fixture(params=list(bf16_scores.GEMMS))
def bf16_gemm(request, monkeypatch) -> str:
    """Each GEMM of the kernel forced in turn (``QKV_BF16_GEMM``): oneDNN's on AMX tiles and
    qkv's own on AVX512-BF16, so that every one that runs on this machine is tested here (an
    AMX CPU runs both); one that does not run here is skipped with the reason."""
    monkeypatch.setenv("QKV_BF16_GEMM", request.param)
    return request.param


def kernel_or_skip() -> None:
    if not bf16_scores.available():
        pytest.skip(
            f"the bfloat16 score kernel does not run here: {bf16_scores.unavailable_reason()}"
        )


def _inputs(N, T, S, D, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:  # (N, T, D) views of a (T, N, D) layout, as a module's heads are
        q = torch.randn(T, N, D, generator=g).bfloat16().transpose(0, 1)  # (N, T, D)
        k = torch.randn(S, N, D, generator=g).bfloat16().transpose(0, 1)  # (N, S, D)
    else:
        q = torch.randn(N, T, D, generator=g).bfloat16()
        k = torch.randn(N, S, D, generator=g).bfloat16()
    return q, k


def _relative_error(out, q, k, scale):
    """max |out - float64 math| / (|scale| |q_t| |k_s|), over every score."""
    exact = scale * (q.double() @ k.double().transpose(-2, -1))  # (N, T, S)
    norms = q.double().norm(dim=-1)[..., :, None] * k.double().norm(dim=-1)[..., None, :]
    return float(((out.double() - exact).abs() / (abs(scale) * norms).clamp_min(1e-30)).max())


@pytest.mark.parametrize("D", HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("S", SIZES, ids=lambda s: f"S{s}")
@pytest.mark.parametrize("T", SIZES, ids=lambda t: f"T{t}")
def test_kernel_equals_float64_math(bf16_gemm, T, S, D):
    kernel_or_skip()
    q, k = _inputs(3, T, S, D, seed=T * 1000 + S)
    out = torch.full((3, T, S), float("nan"))  # every element must be written
    bf16_scores.scores_kernel_(out, q, k, 0.125)
    assert not out.isnan().any()
    err = _relative_error(out, q, k, 0.125)
    assert err < REL_BOUND, f"relative error {err:.3g} at T={T} S={S} D={D}"


@pytest.mark.parametrize(
    "T,S,D,strided",
    [(33, 100, 64, True), (257, 7, 80, True), (100, 257, 15, False), (7, 33, 1, False)],
    ids=["T33-S100-D64-strided", "T257-S7-D80-strided", "T100-S257-D15-odd", "T7-S33-D1-odd"],
)
def test_kernel_strided_inputs_odd_head_dims_and_a_strided_output(bf16_gemm, T, S, D, strided):
    kernel_or_skip()
    q, k = _inputs(4, T, S, D, seed=5, strided=strided)
    buf = torch.full((4, T + 3, S), float("nan"))  # out is a view with a row stride of S
    out = buf[:, 1 : T + 1]  # (4, T, S)
    bf16_scores.scores_kernel_(out, q, k, -0.5)
    assert _relative_error(out, q, k, -0.5) < REL_BOUND
    assert buf[:, 0].isnan().all() and buf[:, T + 1 :].isnan().all(), "wrote outside out"


def test_kernel_is_deterministic_across_thread_counts(bf16_gemm):
    kernel_or_skip()
    q, k = _inputs(6, 257, 193, 64, seed=3)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(bf16_scores.scores_kernel_(torch.empty(6, 257, 193), q, k, 0.3))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_kernel_scale_zero_gives_zeros_not_nan(bf16_gemm):
    kernel_or_skip()
    q, k = _inputs(2, 7, 65, 16, seed=4)
    out = torch.full((2, 7, 65), float("nan"))
    assert torch.equal(bf16_scores.scores_kernel_(out, q, k, 0.0), torch.zeros(2, 7, 65))


def test_kernel_refuses_wrong_dtypes_and_shapes_with_the_numbers(bf16_gemm):
    kernel_or_skip()
    q, k = _inputs(2, 7, 9, 16)
    with pytest.raises(TypeError, match=r"bfloat16.*torch\.float16"):
        bf16_scores.scores_kernel_(torch.empty(2, 7, 9), q.half(), k, 1.0)
    with pytest.raises(ValueError, match=r"got out \(2, 9, 7\)"):
        bf16_scores.scores_kernel_(torch.empty(2, 9, 7), q, k, 1.0)


# --- the fallback: runs on every machine ---------------------------------------------------


def _hide_kernel(monkeypatch, why="hidden by the test"):
    """As on a CPU where the kernel cannot run: a fresh build cache that reports ``why``."""
    monkeypatch.setattr(bf16_scores, "_build", functools.cache(lambda: (None, why)))
    monkeypatch.setattr(
        bf16_scores, "_note_once", functools.cache(bf16_scores._note_once.__wrapped__)
    )


@pytest.mark.parametrize(
    "T,S,D",
    [(1, 1, 16), (33, 257, 64), (100, 7, 80)],
    ids=["T1-S1-D16", "T33-S257-D64", "T100-S7-D80"],
)
def test_without_the_kernel_scores_take_the_widened_gemm(monkeypatch, T, S, D):
    _hide_kernel(monkeypatch)
    assert not bf16_scores.available()
    assert bf16_scores.unavailable_reason() == "hidden by the test"
    q, k = _inputs(2, T, S, D, seed=7)
    out = bf16_scores.scores_(torch.empty(2, T, S), q, k, 0.125)
    assert _relative_error(out, q, k, 0.125) < REL_BOUND
    with pytest.raises(RuntimeError, match="cannot run here: hidden by the test"):
        bf16_scores.scores_kernel_(torch.empty(2, T, S), q, k, 0.125)


def test_without_a_compiler_the_kernel_is_unavailable_quietly(monkeypatch, caplog):
    monkeypatch.setattr(bf16_scores, "_build", functools.cache(bf16_scores._build.__wrapped__))
    monkeypatch.setattr(
        bf16_scores, "_note_once", functools.cache(bf16_scores._note_once.__wrapped__)
    )
    monkeypatch.setenv("CXX", "qkv-no-such-compiler")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning, only a debug note
        with caplog.at_level(logging.DEBUG, logger=bf16_scores.__name__):
            assert not bf16_scores.available() and not bf16_scores.available()
    assert "no C++ compiler found" in bf16_scores.unavailable_reason()
    notes = [r for r in caplog.records if r.name == bf16_scores.__name__]
    assert len(notes) == 1 and notes[0].levelno == logging.DEBUG


def test_a_forced_gemm_that_does_not_run_here_leaves_the_kernel_unused(monkeypatch):
    """``QKV_BF16_GEMM`` forces the kernel's GEMM: on a machine where only one runs (shown here
    as a CPU with AVX512-BF16 and no AMX, whatever this one has), ``auto`` takes it, the other
    forced leaves the kernel unused with the reason, and an unknown name is refused."""
    if bf16_scores._build()[0] is None:
        pytest.skip(f"the kernel did not build here: {bf16_scores._build()[1]}")
    monkeypatch.setattr(bf16_scores, "_runs", lambda lib: (("avx512_bf16",), "no AMX (test)"))
    for forced, code in (("auto", 2), ("avx512_bf16", 2), ("amx", 0)):
        monkeypatch.setenv("QKV_BF16_GEMM", forced)
        assert bf16_scores._route()[0] == code and bf16_scores.available() == (code != 0)
    assert bf16_scores.unavailable_reason() == (
        "QKV_BF16_GEMM=amx does not run here: no AMX (test)"
    )
    q, k = _inputs(1, 3, 5, 16)
    with pytest.raises(RuntimeError, match="cannot run here: QKV_BF16_GEMM=amx does not run"):
        bf16_scores.scores_kernel_(torch.empty(1, 3, 5), q, k, 0.5)
    monkeypatch.setattr(bf16_scores, "_runs", lambda lib: ((), "no AMX; no AVX512-BF16 (test)"))
    monkeypatch.setenv("QKV_BF16_GEMM", "auto")
    assert not bf16_scores.available()
    assert bf16_scores.unavailable_reason() == "no AMX; no AVX512-BF16 (test)"
    monkeypatch.setenv("QKV_BF16_GEMM", "avx512")
    with pytest.raises(ValueError, match="one of auto, amx, avx512_bf16; got 'avx512'"):
        bf16_scores.available()


def test_the_kernel_refuses_a_gemm_that_does_not_run_here_instead_of_crashing():
    """The C++ side checks the GEMM code itself: AVX512-BF16's instruction on a CPU without it
    would stop the process (an illegal instruction), so an unknown code, or one whose GEMM
    does not run here, is an error returned, and the process lives on."""
    lib = bf16_scores._build()[0]
    if lib is None:
        pytest.skip(f"the kernel did not build here: {bf16_scores._build()[1]}")
    q, k = _inputs(1, 2, 3, 16)
    out = torch.zeros(1, 2, 3)
    absent = [
        code for name, code in bf16_scores.GEMMS.items() if not lib.qkv_bf16_gemm_usable(code)
    ]
    for code in [0, 99, *absent]:
        args = (q.data_ptr(), k.data_ptr(), out.data_ptr(), 1, 2, 3, 16, 6, 3, 1.0, code)
        assert lib.qkv_bf16_scores(*args) == 1
        assert lib.qkv_bf16_scores_error().decode() == f"bfloat16 GEMM {code} does not run here"
    assert torch.equal(out, torch.zeros(1, 2, 3))


def test_the_gemms_agree_where_both_run(monkeypatch):
    """On a CPU that runs both GEMMs (AMX CPUs have AVX512-BF16 too) the fused kernel gives
    the same weights and outputs by either, to float32 summation order."""
    if set(bf16_scores.gemm_routes()) != set(bf16_scores.GEMMS):
        pytest.skip(f"not every GEMM runs here, only {bf16_scores.gemm_routes()}")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 130, 64, generator=g).bfloat16() for _ in range(3))
    runs = []
    for name in bf16_scores.GEMMS:
        monkeypatch.setenv("QKV_BF16_GEMM", name)
        runs.append(bf16_scores.weights_kernel(q, k, v, 0.125, causal=True))
    for a, b in zip(*runs):
        assert (a.float() - b.float()).abs().max() <= 2**-7 * b.float().abs().max()


# --- the one-pass weights, kernel on and off --------------------------------------------------


def _golden_and_baseline(q, k, v, scale, causal):
    """Attention in float64 of the bfloat16 inputs, and the same plain math in bfloat16."""
    T, S = q.shape[-2], k.shape[-2]
    keep = (
        torch.ones(T, S, dtype=torch.bool).tril() if causal else torch.ones(T, S, dtype=torch.bool)
    )

    def attend(q, k, v):
        scores = ((q @ k.transpose(-2, -1)) * scale).masked_fill(
            ~keep, float("-inf")
        )  # (B, H, T, S)
        probs = torch.softmax(scores, dim=-1)
        return probs @ v, probs, scores

    return attend(q.double(), k.double(), v.double()), attend(q, k, v)


@pytest.mark.parametrize("kernel", ["fused", "scores", "widened"])
@pytest.mark.parametrize(
    "T,scale,causal",
    [(1, None, False), (33, 3.0, False), (100, 0.0, True), (257, None, True)],
    ids=["T1", "T33-scale3", "T100-scale0-causal", "T257-causal"],
)
def test_one_pass_weights_of_bf16_meet_the_tolerance_policy(
    bf16_gemm, monkeypatch, kernel, T, scale, causal
):
    """B2-H4-D64 bfloat16 with a trace on the native route: the one-pass weights take the fused
    kernel, the score kernel with the rest in torch ops (the fused one forced off), or the
    widened GEMM (both kernels forced off); the kernels' cases skip where they cannot run."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    if kernel == "widened":
        _hide_kernel(monkeypatch)
    else:
        kernel_or_skip()
    if kernel == "scores":
        monkeypatch.setattr(reference, "_fusable", lambda call: None)
    calls = []
    for name in ("scores_kernel_", "attend_kernel"):
        real = getattr(bf16_scores, name)
        monkeypatch.setattr(
            bf16_scores, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw)
        )
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, 4, T, 64, generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        out, trace = qkv.scaled_dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, return_trace=True
        )
    assert trace.backend == "reference" and not callable(trace._probs), "not the one-pass path"
    expected = {"fused": {"attend_kernel"}, "scores": {"scores_kernel_"}, "widened": set()}
    assert set(calls) == expected[kernel]
    s = 64**-0.5 if scale is None else scale
    gold, base = _golden_and_baseline(q, k, v, s, causal)
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    assert_tolerance(trace.probs, gold[1], base[1], factor=OUTPUT_FACTOR, name="probs")
    # the lse from float32 scores: float32's relative error of the largest score
    size = max(1.0, float(gold[2].masked_fill(gold[2].isinf(), 0).abs().max()))
    assert max_error(trace.lse, torch.logsumexp(gold[2], dim=-1)) <= ATOL * size


# --- the fused one-pass kernel (weights_kernel) -----------------------------------------------


def _spy_on_the_kernel(monkeypatch) -> list[bool]:
    """The list that each later ``attend_kernel`` call appends its ``weights`` flag to."""
    calls: list[bool] = []
    real = bf16_scores.attend_kernel

    def spy(*args, **kwargs):
        calls.append(kwargs["weights"])
        return real(*args, **kwargs)

    monkeypatch.setattr(bf16_scores, "attend_kernel", spy)
    return calls


FUSED_CASES = [  # N, T, S, D, Dv, scale, causal: block edges of 64 keys, odd D, Dv past 64
    (2, 1, 1, 16, 16, 0.25, False),
    (3, 7, 5, 15, 3, 3.0, False),
    (2, 65, 63, 64, 64, -0.5, True),
    (2, 64, 64, 64, 100, 0.125, False),
    (1, 300, 65, 33, 128, 0.0, False),
    (2, 70, 300, 64, 16, 3.0, True),
    (1, 257, 1000, 80, 64, 0.125, False),
    (1, 500, 200, 64, 64, 0.2, True),
    # scores spread over hundreds: most exps underflow to 0 (the AVX-512 exp's cut below 2^-126)
    (2, 40, 200, 16, 16, 30.0, False),
    (1, 33, 129, 16, 8, -20.0, True),
]


def _fused_inputs(N, T, S, D, Dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, T, D, generator=g).bfloat16()
    k = torch.randn(N, S, D, generator=g).bfloat16()
    v = torch.randn(N, S, Dv, generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize(
    "N,T,S,D,Dv,scale,causal",
    FUSED_CASES,
    ids=[
        f"N{c[0]}-T{c[1]}-S{c[2]}-D{c[3]}-Dv{c[4]}-scale{c[5]}" + ("-causal" * c[6])
        for c in FUSED_CASES
    ],
)
def test_fused_kernel_equals_float64_math(bf16_gemm, N, T, S, D, Dv, scale, causal):
    kernel_or_skip()
    q, k, v = _fused_inputs(N, T, S, D, Dv, seed=T + S)
    out, probs, lse = bf16_scores.weights_kernel(q, k, v, scale, causal=causal)
    assert out.dtype == probs.dtype == torch.bfloat16 and lse.dtype == torch.float32
    gold, base = _golden_and_baseline(q, k, v, scale, causal)
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    # each weight is a float32-accurate weight rounded once: within one bfloat16 step (2^-8
    # of it) of float64's, and exactly 0 where causal hides the key
    assert float(((probs.double() - gold[1]).abs() - gold[1] * 2**-8).max()) <= 1e-30
    if causal:
        hidden = ~torch.ones(T, S, dtype=torch.bool).tril()
        assert (probs[:, hidden] == 0).all()
    size = max(1.0, float(gold[2].masked_fill(gold[2].isinf(), 0).abs().max()))
    assert max_error(lse, torch.logsumexp(gold[2], dim=-1)) <= ATOL * size


def test_fused_kernel_is_deterministic_across_thread_counts(bf16_gemm):
    kernel_or_skip()
    q, k, v = _fused_inputs(3, 257, 193, 64, 80, seed=5)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(bf16_scores.weights_kernel(q, k, v, 0.3, causal=True))
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_fused_kernel_scale_zero_is_the_mean_of_the_values_for_long_rows(bf16_gemm):
    """scale=0 with S > 256 (issue 41 item 4's NaN): weights 1/S, lse log S, the mean of v."""
    kernel_or_skip()
    q, k, v = _fused_inputs(2, 3, 700, 32, 16, seed=6)
    out, probs, lse = bf16_scores.weights_kernel(q, k, v, 0.0, causal=False)
    assert torch.equal(probs, torch.full_like(probs, 1 / 700))
    assert max_error(lse, torch.full((2, 3), math.log(700))) <= 1e-6
    mean = v.double().mean(-2, keepdim=True).expand(2, 3, 16)
    assert max_error(out, mean) <= float(mean.abs().max()) * 2**-8


def test_fused_kernel_empty_sizes_and_refusals(bf16_gemm):
    kernel_or_skip()
    q, k, v = _fused_inputs(2, 0, 5, 16, 8, seed=0)
    out, probs, lse = bf16_scores.weights_kernel(q, k, v, 1.0, causal=False)
    assert out.shape == (2, 0, 8) and probs.shape == (2, 0, 5) and lse.shape == (2, 0)
    q, k, v = _fused_inputs(2, 3, 5, 16, 0, seed=0)  # no value columns: weights still formed
    out, probs, lse = bf16_scores.weights_kernel(q, k, v, 1.0, causal=False)
    assert out.shape == (2, 3, 0) and torch.allclose(
        probs.float().sum(-1), torch.ones(2, 3), atol=0.02
    )
    with pytest.raises(ValueError, match=r"S >= 1.*k \(1, 2, 0, 16\)"):
        bf16_scores.weights_kernel(q, k[:, :0], v[:, :0], 1.0, causal=False)
    with pytest.raises(TypeError, match=r"torch\.float16"):
        bf16_scores.weights_kernel(q.half(), k, v, 1.0, causal=False)


_CONVERT_SCRIPT = """
import sys, torch
from qkv.ops import bf16_scores, reference
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 97, 64, generator=g).bfloat16() for _ in range(3))
q[0, 5] = 3e38  # its scores overflow to +-inf in float32: a NaN row of weights, as torch's
torch.save(bf16_scores.weights_kernel(q, k, v, 2.0, causal=True), sys.argv[1])
"""


def test_fused_kernel_rounds_alike_with_and_without_avx512_bf16(bf16_gemm, tmp_path):
    """The weights are rounded by AVX512-BF16's instruction where the CPU has it, else by
    integer arithmetic (QKV_BF16_GENERIC_CVT=1 forces that, read once per process): the two
    give the same bits, NaN rows (from scores that overflow) included."""
    kernel_or_skip()
    runs = []
    for generic in ("", "1"):
        path = tmp_path / f"run{generic}.pt"
        env = {**os.environ, "QKV_BF16_GENERIC_CVT": generic}
        subprocess.run([sys.executable, "-c", _CONVERT_SCRIPT, str(path)], env=env, check=True)
        runs.append(torch.load(path))
    for a, b in zip(*runs):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert runs[0][1][0, 5, :6].isnan().all() and not runs[0][1][0, 4].isnan().any()


def test_float16_and_the_float32_route_keep_the_widened_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(bf16_scores, "scores_kernel_", lambda *a: calls.append(1))
    q, k, v = (torch.randn(1, 2, 17, 16) for _ in range(3))
    with torch.no_grad():
        monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
        qkv.scaled_dot_product_attention(q.half(), k.half(), v.half(), return_trace=True)
        monkeypatch.setenv("QKV_CPU_HALF_GEMM", "float32")
        qkv.scaled_dot_product_attention(
            q.bfloat16(), k.bfloat16(), v.bfloat16(), return_trace=True
        )
    assert calls == []


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("where", ["q", "k", "v", "none"])
def test_fused_kernel_keeps_the_nonfinite_contract_as_the_guard_does(
    bf16_gemm, monkeypatch, where, causal
):
    """NaN/inf in q, k or v (B2-H3-T70-S70-D16 bfloat16 with a trace): the fused kernel keeps
    the contract itself (nonfinite has nothing to add), and gives the bits of the same kernel
    under ops/nonfinite.py's guard: finite weights and lse from the zeroed inputs, NaN output on
    the bad query row and on every row that may attend the bad key."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 70, 16, generator=g).bfloat16() for _ in range(3))
    bad = {"q": q, "k": k, "v": v}.get(where)
    if bad is not None:
        bad[1, 2, 40, 5] = float("nan")
        bad[0, 0, 65, 0] = float("inf")
    calls = _spy_on_the_kernel(monkeypatch)

    def attend():
        with torch.no_grad():
            return qkv.scaled_dot_product_attention(q, k, v, is_causal=causal, return_trace=True)

    call = qkv.ops.call.AttentionCall.build(q, k, v, is_causal=causal, return_trace=True)
    assert qkv.dispatch.choose(call).keeps_nonfinite_contract
    out, trace = attend()
    assert calls == [True]
    # the same kernel on the inputs ops/nonfinite.py zeroes, its NaN rows added after
    monkeypatch.setattr(qkv.dispatch, "one_pass_keeps_contract", lambda call: False)
    assert not qkv.dispatch.choose(call).keeps_nonfinite_contract
    out_guarded, trace_guarded = attend()
    assert calls == [True, True]
    assert torch.equal(out.nan_to_num(9.0), out_guarded.nan_to_num(9.0))
    assert torch.equal(trace.probs, trace_guarded.probs) and torch.equal(
        trace.lse, trace_guarded.lse
    )
    assert trace.probs.isfinite().all() and trace.lse.isfinite().all()
    rows = out.isnan().all(-1)  # (B, H, T): NaN rows, and no row NaN only in part
    assert torch.equal(rows, out.isnan().any(-1))
    expected = torch.zeros(2, 3, 70, dtype=torch.bool)
    t = torch.arange(70)
    if where == "q":
        expected[1, 2, 40] = expected[0, 0, 65] = True
    elif where in ("k", "v"):
        expected[1, 2] = t >= 40 if causal else True
        expected[0, 0] = t >= 65 if causal else True
    assert torch.equal(rows, expected)


def test_fused_kernel_memory_kept_between_calls_carries_nothing_over(bf16_gemm):
    """A thread keeps a call's scratch memory for its next call (``Scratch`` in the .cpp): a
    call whose keys hold NaN, then the same shape with clean keys, must give the clean call's
    own bits (no NaN row from the first call's flags of bad keys), as it does in a process
    where it runs first; the same for a shorter call after a longer one."""
    kernel_or_skip()
    q, k, v = _fused_inputs(3, 70, 130, 16, 24, seed=21)
    clean = _fused_kernel_in_a_fresh_process(q, k, v)
    dirty = k.clone()
    dirty[:, ::7, 3] = float("nan")  # every head has bad keys: every row would be NaN
    out_dirty = bf16_scores.weights_kernel(q, dirty, v, 0.25, causal=False)[0]
    assert out_dirty.isnan().all()
    for _ in range(2):
        out, probs, lse = bf16_scores.weights_kernel(q, k, v, 0.25, causal=False)
        assert torch.equal(out, clean[0]) and torch.equal(probs, clean[1])
        assert torch.equal(lse, clean[2])
    # a longer call first (more memory kept), then the short one again: the same bits
    bf16_scores.weights_kernel(*_fused_inputs(3, 300, 900, 16, 24, seed=22), 0.25, causal=True)
    assert torch.equal(bf16_scores.weights_kernel(q, k, v, 0.25, causal=False)[0], clean[0])


def test_fused_kernel_rows_above_a_tasks_kept_memory_meet_the_policy(bf16_gemm):
    """A task's score rows over what a thread of the pool keeps (16 MiB: 16 rows of 140,000
    keys take 17 MiB) are allocated for the call and freed: the output and weights of such a
    call meet the policy against float64 math, and a small call after it too."""
    kernel_or_skip()
    q, k, v = _fused_inputs(1, 16, 140_000, 16, 16, seed=24)
    out, probs, lse = bf16_scores.weights_kernel(q, k, v, 0.25, causal=False)
    gold, base = _golden_and_baseline(q, k, v, 0.25, False)
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    assert float(((probs.double() - gold[1]).abs() - gold[1] * 2**-8).max()) <= 1e-30
    size = max(1.0, float(gold[2].abs().max()))
    assert max_error(lse, torch.logsumexp(gold[2], dim=-1)) <= ATOL * size
    q, k, v = _fused_inputs(2, 40, 200, 16, 16, seed=25)
    gold, base = _golden_and_baseline(q, k, v, 0.25, True)
    out = bf16_scores.weights_kernel(q, k, v, 0.25, causal=True)[0]
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out after")


_FRESH_SCRIPT = """
import sys, torch
from qkv.ops import bf16_scores
q, k, v = torch.load(sys.argv[1])
torch.save(bf16_scores.weights_kernel(q, k, v, 0.25, causal=False), sys.argv[2])
"""


def _fused_kernel_in_a_fresh_process(q, k, v):
    """:func:`bf16_scores.weights_kernel` of (q, k, v) at scale 0.25, in a process of its own
    (its first call there: no memory kept from another call)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        inputs, result = os.path.join(tmp, "in.pt"), os.path.join(tmp, "out.pt")
        torch.save((q, k, v), inputs)
        subprocess.run(
            [sys.executable, "-c", _FRESH_SCRIPT, inputs, result],
            check=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            timeout=300,
        )
        return torch.load(result)


def test_fused_kernel_above_the_kept_memory_gives_the_bits_of_smaller_calls(bf16_gemm):
    """A call whose packed keys and values pass what a thread keeps (64 MiB: here 16 heads
    of 16384 keys, D=Dv=64, 64 MiB + 64 KiB) allocates its own and frees it: its heads give
    the bits of the same heads called four at a time (under the kept size), and it leaves
    nothing that changes the next call."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(23)
    N, T, S, D = 16, 5, 16384 + 64, 64
    q = torch.randn(N, T, D, generator=g).bfloat16()
    k = torch.randn(N, S, D, generator=g).bfloat16()
    v = torch.randn(N, S, D, generator=g).bfloat16()
    out, probs, lse = bf16_scores.weights_kernel(q, k, v, 0.125, causal=False)
    for h in range(0, N, 4):
        part = bf16_scores.weights_kernel(
            q[h : h + 4], k[h : h + 4], v[h : h + 4], 0.125, causal=False
        )
        assert torch.equal(out[h : h + 4], part[0]) and torch.equal(probs[h : h + 4], part[1])
        assert torch.equal(lse[h : h + 4], part[2])
    assert out.isfinite().all() and probs.sum() > 0


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_fused_kernel_weights_streamed_past_the_caches_give_the_bits_of_smaller_calls(
    bf16_gemm, causal
):
    """Returned weights above 4 MiB are stored past the caches where a row's start is 32-byte
    aligned (here 4 heads of 740 x 740: 4.2 MiB; a row of 1480 bytes, so the rows' starts
    take every alignment of 8 bytes): they, the output and the lse are the bits of the same
    heads called two at a time (2.1 MiB, stored as before), each row of weights summing to 1."""
    kernel_or_skip()
    q, k, v = _fused_inputs(4, 740, 740, 32, 40, seed=31)
    out, probs, lse = bf16_scores.weights_kernel(q, k, v, 0.2, causal=causal)
    for h in (0, 2):
        part = bf16_scores.weights_kernel(
            q[h : h + 2], k[h : h + 2], v[h : h + 2], 0.2, causal=causal
        )
        assert torch.equal(out[h : h + 2], part[0]) and torch.equal(probs[h : h + 2], part[1])
        assert torch.equal(lse[h : h + 2], part[2])
    sums = probs.double().sum(-1)
    assert (sums - 1).abs().max() < 0.02 and probs.isfinite().all()


@pytest.mark.parametrize("T", [3, 70], ids=["T3", "T70"])  # (T <= 4: the few-rows path on kDot)
@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no-weights"])
def test_fused_kernel_reads_gqa_heads_as_the_repeated_heads(bf16_gemm, T, weights):
    """Keys and values of Hk = 2 heads for 8 query heads (GQA), read where they lie (a strided
    (B, S, Hk, D) layout) and packed once per key head: the bits of the same call with each
    head repeated 4 times, NaN rows from a bad key in one head included; a key head count
    that does not divide the query heads is refused with the shapes."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(31)
    q = torch.randn(2, 8, T, 16, generator=g).bfloat16()
    k = torch.randn(2, 90, 2, 16, generator=g).bfloat16().transpose(1, 2)  # (2, 2, 90, 16)
    v = torch.randn(2, 90, 2, 24, generator=g).bfloat16().transpose(1, 2)
    k[1, 1, 1, 3] = float("nan")  # key 1 of key head 1: query heads 4-7 of element 1
    lo = torch.zeros(1, T, dtype=torch.int64)
    hi = torch.arange(2, T + 2).clamp(max=90)[None]  # (1, T): causal, every row sees key 1
    grouped = bf16_scores.attend_kernel(q, k, v, 0.3, lo, hi, weights=weights)
    repeated = bf16_scores.attend_kernel(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), 0.3, lo, hi, weights=weights
    )
    for a, b in zip(grouped, repeated):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    rows = grouped[0].isnan().all(-1)  # (2, 8, T)
    assert rows[1, 4:].all() and not rows[0].any() and not rows[1, :4].any()
    with pytest.raises(ValueError, match=r"Hk dividing H.*k \(2, 3, 90, 16\)"):
        k3 = torch.randn(2, 3, 90, 16).bfloat16()
        bf16_scores.attend_kernel(q, k3, k3, 0.3, lo, hi, weights=weights)


def test_gqa_bfloat16_calls_give_the_kernel_their_key_heads(monkeypatch):
    """A bfloat16 GQA call whose rows attend ranges (a window, with a trace and without)
    reaches the fused kernel with its key and value heads as given (no repeated copy), and
    meets the tolerance policy against float64 math."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    seen = []
    kernel = bf16_scores.attend_kernel

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(bf16_scores, "attend_kernel", spy)
    g = torch.Generator().manual_seed(32)
    q = torch.randn(2, 8, 100, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 100, 16, generator=g).bfloat16() for _ in range(2))
    window = qkv.masks.sliding_window(20)
    keep = torch.arange(100)[:, None] - torch.arange(100)[None] <= 20
    keep &= torch.arange(100)[:, None] >= torch.arange(100)[None]  # (100, 100)
    kr, vr = k.repeat_interleave(4, 1).double(), v.repeat_interleave(4, 1).double()
    scores = (q.double() @ kr.transpose(-2, -1)) * 0.25
    gold = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ vr
    base_scores = (q @ k.repeat_interleave(4, 1).transpose(-2, -1)).float() * 0.25
    base = base_scores.masked_fill(~keep, float("-inf")).softmax(
        -1
    ).bfloat16() @ v.repeat_interleave(4, 1)
    for trace in (False, True):
        with torch.no_grad():
            result = qkv.scaled_dot_product_attention(
                q, k, v, mask_mod=window, enable_gqa=True, backend="tiled", return_trace=trace
            )
        out = result[0] if trace else result
        assert seen and seen[-1] == (8, 2, 2), seen
        assert_tolerance(out, gold, base.double(), factor=OUTPUT_FACTOR, name=f"trace={trace}")


def test_fused_kernel_reads_strided_heads_and_writes_heads_merged(bf16_gemm):
    """A module's heads ((B, T, H, D) memory seen as (B, H, T, D)) and a value with a last
    stride of 2 give the bits of contiguous inputs; the output is (B, T, H, Dv) memory."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(8)
    B, T, S, H, D = 2, 77, 90, 3, 32
    q = torch.randn(B, T, H, D, generator=g).bfloat16().transpose(1, 2)  # (B, H, T, D)
    k = torch.randn(B, S, H, D, generator=g).bfloat16().transpose(1, 2)  # (B, H, S, D)
    v = torch.randn(B, H, S, 2 * D, generator=g).bfloat16()[..., ::2]  # (B, H, S, D), stride 2
    strided = bf16_scores.weights_kernel(q, k, v, 0.3, causal=True)
    dense = bf16_scores.weights_kernel(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.3, causal=True
    )
    assert all(torch.equal(a, b) for a, b in zip(strided, dense))
    out = strided[0]
    assert out.shape == (B, H, T, D) and out.transpose(1, 2).is_contiguous()


# --- the fused kernel with rows' key ranges (attend_kernel), and the tiled backend on it -----


def _range_golden(q, k, v, scale, allowed):
    """float64 and bfloat16 plain math of a bool mask, rows with no key 0 (the contract)."""

    def attend(q, k, v):
        scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows: 0
        return probs @ v, probs, torch.logsumexp(scores, dim=-1)

    return attend(q.double(), k.double(), v.double()), attend(q, k, v)


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no-weights"])
@pytest.mark.parametrize("per_batch", [False, True], ids=["shared", "per-batch"])
def test_attend_kernel_with_key_ranges_equals_float64_math(bf16_gemm, weights, per_batch):
    """B2-H3-T150-S200-D32 with random ranges, empty ones included: the keys outside each
    row's range have no effect and weight 0; a row with no key outputs 0 and lse -inf."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(12)
    B, H, T, S, D = 2, 3, 150, 200, 32
    q = torch.randn(B, H, T, D, generator=g).bfloat16()
    k = torch.randn(B, H, S, D, generator=g).bfloat16()
    v = torch.randn(B, H, S, D, generator=g).bfloat16()
    nb = B if per_batch else 1
    lo = torch.randint(0, S, (nb, T), generator=g)
    hi = (lo + torch.randint(-20, 120, (nb, T), generator=g)).clamp(0, S)  # some lo >= hi
    assert (lo >= hi).any() and (hi - lo > 64).any()
    out, probs, lse = bf16_scores.attend_kernel(q, k, v, 0.2, lo, hi, weights=weights)
    j = torch.arange(S)
    allowed = ((j >= lo[..., None]) & (j < hi[..., None]))[:, None]  # (nb, 1, T, S)
    gold, base = _range_golden(q, k, v, 0.2, allowed)
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    empty = (lo >= hi)[:, None].expand(B, H, T)
    assert (out[empty] == 0).all() and lse[empty].isneginf().all()
    assert max_error(lse, gold[2]) <= ATOL * 10
    if weights:
        assert probs is not None and (probs[~allowed.expand(B, H, T, S)] == 0).all()
        assert float(((probs.double() - gold[1]).abs() - gold[1] * 2**-8).max()) <= 1e-30
    else:
        assert probs is None


FEW_ROW_CASES = [  # T, S, D, Dv: the last partial 32 of D and 16 of Dv, one key, long rows
    (1, 1, 16, 16),
    (1, 4096, 64, 64),
    (2, 77, 80, 3),
    (3, 200, 130, 17),
    (4, 65, 2, 80),
]


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "no-weights"])
@pytest.mark.parametrize(
    "T,S,D,Dv", FEW_ROW_CASES, ids=[f"T{t}-S{s}-D{d}-Dv{dv}" for t, s, d, dv in FEW_ROW_CASES]
)
def test_a_few_rows_read_the_keys_in_place_and_meet_the_policy_as_the_tiles_do(
    bf16_gemm, weights, T, S, D, Dv
):
    """Up to 4 query rows (a decoding step) on AVX512-BF16 skip the packing of the keys and
    values (``attend_few``: each row's dot products with its keys as they lie, the output by
    float32 multiply-adds); ``rows=T`` forces the packed tiles on the same call. Both meet
    the policy against float64 math, over random key ranges (empty ones included) of strided
    heads, with the same rows 0 and the same lse -inf."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(T * 1000 + S)
    B, H = 2, 3
    q = torch.randn(B, T, H, D, generator=g).bfloat16().transpose(1, 2)  # (B, H, T, D) strided
    k = torch.randn(B, H, S, D, generator=g).bfloat16()
    v = torch.randn(B, S, H, Dv, generator=g).bfloat16().transpose(1, 2)  # (B, H, S, Dv)
    lo = torch.randint(0, S, (B, T), generator=g)
    hi = (lo + torch.randint(-3, S + 1, (B, T), generator=g)).clamp(0, S)
    lo[0, 0], hi[0, 0] = 0, S  # one row sees every key
    if T > 1:
        lo[1, 1], hi[1, 1] = 5, 5  # one sees none
    j = torch.arange(S)
    allowed = ((j >= lo[..., None]) & (j < hi[..., None]))[:, None]  # (B, 1, T, S)
    gold, base = _range_golden(q, k, v, 0.3, allowed)
    empty = (lo >= hi)[:, None].expand(B, H, T)
    for rows in (0, T):  # the few rows' way, the tiles
        out, probs, lse = bf16_scores.attend_kernel(
            q, k, v, 0.3, lo, hi, weights=weights, rows=rows
        )
        assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name=f"out, rows={rows}")
        assert (out[empty] == 0).all() and lse[empty].isneginf().all()
        assert max_error(lse[~empty], gold[2][~empty]) <= ATOL * 10
        if weights:
            assert probs is not None and (probs[~allowed.expand(B, H, T, S)] == 0).all()
            assert float(((probs.double() - gold[1]).abs() - gold[1] * 2**-8).max()) <= 1e-30


@pytest.mark.parametrize("where", ["q", "k-in", "k-out", "v-in", "v-out", "inf-k"])
def test_a_few_rows_keep_the_nonfinite_contract_as_the_tiles_do(bf16_gemm, where):
    """NaN/inf in a query row, or in a key or value inside or outside a row's range: the few
    rows' way and the tiles give the same NaN rows (a bad query row, a bad key or value in the
    row's range; those outside have no effect) and outputs within the policy elsewhere."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(5)
    B, H, T, S, D = 1, 2, 3, 150, 64
    q, k, v = (torch.randn(B, H, n, D, generator=g).bfloat16() for n in (T, S, S))
    lo, hi = torch.tensor([[0, 40, 100]]), torch.tensor([[50, 90, 150]])  # keys 90-99: none's
    bad = {"q": (q, 1, 3), "k-in": (k, 45, 0), "k-out": (k, 95, 5), "v-in": (v, 110, 63)}
    bad |= {"v-out": (v, 92, 2), "inf-k": (k, 130, 7)}
    x, row, col = bad[where]
    x[0, 1, row, col] = float("inf") if where == "inf-k" else float("nan")
    j = torch.arange(S)
    allowed = ((j >= lo[..., None]) & (j < hi[..., None]))[:, None]  # (1, 1, T, S)
    clean = [t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)]
    gold, base = _range_golden(*clean, 0.125, allowed)
    want_nan = torch.zeros(B, H, T, dtype=torch.bool)
    if where == "q":
        want_nan[0, 1, row] = True
    elif where in ("k-in", "v-in", "inf-k"):
        want_nan[0, 1] = allowed[0, 0, :, row]
    for rows in (0, T):
        out, _, _ = bf16_scores.attend_kernel(q, k, v, 0.125, lo, hi, weights=False, rows=rows)
        assert (
            torch.equal(out.isnan().all(-1), want_nan)
            and not out.isnan().any(-1).logical_xor(want_nan).any()
        ), f"rows={rows}"
        keep = ~want_nan
        assert_tolerance(out[keep], gold[0][keep], base[0][keep], factor=OUTPUT_FACTOR)


_I, _J = torch.arange(130).view(130, 1), torch.arange(130).view(1, 130)
_LENGTHS = torch.tensor([0, 97]).view(2, 1, 1, 1)
RANGE_MASKS = {  # the call's mask arguments, and its allowed pairs by hand (B?, 1, T, S)
    "window16": (dict(mask_mod=qkv.masks.sliding_window(16)), (_J >= _I - 16) & (_J <= _I)),
    "window40-right7": (
        dict(mask_mod=qkv.masks.sliding_window(40, 7)),
        (_J >= _I - 40) & (_J <= _I + 7),
    ),
    "causal": (dict(is_causal=True), _J <= _I),
    "lengths": (dict(mask_mod=qkv.masks.key_lengths(torch.tensor([0, 97]))), _J < _LENGTHS),
    "window-and-lengths": (
        dict(
            mask_mod=qkv.masks.and_masks(
                qkv.masks.sliding_window(30), qkv.masks.key_lengths(torch.tensor([0, 97]))
            )
        ),
        (_J >= _I - 30) & (_J <= _I) & (_J < _LENGTHS),
    ),
}


@pytest.mark.parametrize("kind", list(RANGE_MASKS))
def test_tiled_bf16_inference_with_range_masks_runs_the_kernel(bf16_gemm, monkeypatch, kind):
    """The tiled backend sends bfloat16 inference with range masks to the kernel (B2-H4-T130
    -D64), within the tolerance policy of float64 math; with a gradient wanted it does not."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    calls = _spy_on_the_kernel(monkeypatch)
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 4, 130, 64, generator=g).bfloat16() for _ in range(3))
    kw, allowed = RANGE_MASKS[kind]
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    assert calls == [False]
    gold, base = _range_golden(q, k, v, 64**-0.5, allowed)
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    qg = q.clone().requires_grad_()
    qkv.scaled_dot_product_attention(qg, k, v, backend="tiled", **kw)
    assert calls == [False], "a call that wants a gradient took the inference kernel"


def _key_masks(B, S, g):
    """Bool key masks ``(Bm, 1, 1, S)``: shared, per batch (left and right padding, a hidden
    middle, one batch element with no key), and the causal call's."""
    per = torch.ones(B, 1, 1, S, dtype=torch.bool)
    per[0, ..., :9] = False  # left padding
    per[1, ..., S - 30 :] = False  # right padding
    per[2, ..., 40:47] = False  # a hole: its rows compare ids
    per[3] = False  # no key at all
    shared = torch.rand(1, 1, 1, S, generator=g) > 0.3
    return {"shared": shared, "per-batch": per}


@pytest.mark.parametrize("T", [1, 3, 70])
@pytest.mark.parametrize("layout", ["shared", "per-batch", "per-batch-causal"])
def test_tiled_bf16_key_masks_run_the_kernel(bf16_gemm, monkeypatch, T, layout):
    """A bool key mask ``(B?, 1, 1, S)`` (a padded batch's, a decoding step's) goes to the
    kernel as document ids (visible keys id 0, hidden 1), with is_causal too: within the
    policy of float64 math, NaN/inf in hidden keys and values without effect, a batch element
    with no key 0. A trace of the same call takes the kernel with weights. Other bool masks
    (per head, per query row) and float masks keep the other ways. (Calls of a few rows take
    the few-rows kernel first: off here, test_few_rows.py holds it.)"""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    force_few_rows(monkeypatch, False)
    kernel_or_skip()
    calls = _spy_on_the_kernel(monkeypatch)
    g = torch.Generator().manual_seed(T)
    B, H, S = 4, 2, 150
    q = torch.randn(B, H, T, 32, generator=g).bfloat16()
    k, v = (torch.randn(B, H, S, 32, generator=g).bfloat16() for _ in range(2))
    mask = _key_masks(B, S, g)[layout.removesuffix("-causal")]
    causal = layout.endswith("causal")
    hidden = (~mask).expand(B, 1, 1, S).nonzero()[:5]
    for b, _, _, j in hidden.tolist():  # NaN/inf in hidden keys and values: no effect
        k[b, 0, j, 1], v[b, 1, j, 2] = float("nan"), float("inf")
    allowed = mask.expand(B, 1, T, S)
    if causal:
        allowed = allowed & (torch.arange(S) <= torch.arange(T)[:, None])
    clean = [t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)]
    gold, base = _range_golden(*clean, 32**-0.5, allowed)
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, backend="tiled"
        )
        traced, trace = qkv.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, return_trace=True
        )
    assert calls == [False, True]
    none = ~allowed.any(-1).expand(B, H, T)
    for got in (out, traced):
        assert not got.isnan().any()
        assert (got[none] == 0).all()
        assert_tolerance(got, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    assert (trace.probs[~allowed.expand(B, H, T, S)] == 0).all()
    others = [
        mask.expand(B, H, 1, S).clone(),  # per head
        mask.expand(B, 1, T, S).clone(),  # per query row (refused where T > 1)
        torch.zeros(B, 1, 1, S, dtype=torch.bfloat16).masked_fill(~mask, float("-inf")),
    ]
    with torch.no_grad():
        for other in others:
            qkv.scaled_dot_product_attention(q, k, v, attn_mask=other, backend="tiled")
    assert calls == [False, True] + ([False] if T == 1 else [])


def test_a_calls_kernel_ranges_are_asked_again_when_its_route_changes(monkeypatch):
    """``reference._fusable`` remembers its answer for the last call object (the plan and the
    tiled backend ask it in turn), but not past a change of the half GEMM route or of the
    kernel's GEMM, and not for another call."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    q, k, v = (torch.randn(1, 2, 5, 16).bfloat16() for _ in range(3))
    call = AttentionCall.build(q, k, v, is_causal=True)
    assert reference._fusable(call) is not None
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "float32")  # widened half GEMMs: no kernel
    assert reference._fusable(call) is None
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    assert reference._fusable(call) is not None
    monkeypatch.setenv("QKV_BF16_GEMM", "avx512")  # (an unknown name: refused, not remembered)
    with pytest.raises(ValueError, match="QKV_BF16_GEMM must be one of"):
        reference._fusable(call)
    monkeypatch.delenv("QKV_BF16_GEMM")
    plain = AttentionCall.build(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    assert reference._fusable(plain) is None and reference._fusable(call) is not None


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_tiled_bf16_kernel_keeps_the_nonfinite_contract(bf16_gemm, monkeypatch, where):
    """NaN/inf in q, k or v with a window (and a batch element with no key at all): the kernel
    keeps the contract itself (nonfinite adds nothing) and NaNs the rows the tiled loop under
    the guard does, with the same finite rows within the policy; rows with no key stay 0."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(2, 2, 90, 16, generator=g).bfloat16() for _ in range(3))
    bad = {"q": q, "k": k, "v": v}[where]
    bad[1, 1, 40, 3] = float("nan")
    bad[0, 0, 5, 0] = float("-inf")
    mod = qkv.masks.and_masks(
        qkv.masks.sliding_window(10), qkv.masks.key_lengths(torch.tensor([0, 90]))
    )
    call = qkv.ops.call.AttentionCall.build(q, k, v, mask_mod=mod)
    with torch.no_grad():
        assert qkv.dispatch.choose(call, "tiled").keeps_nonfinite_contract
        out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mod, backend="tiled")
        monkeypatch.setattr(qkv.ops.tiled.backend, "bf16_fusable", lambda call: False)
        assert not qkv.dispatch.choose(call, "tiled").keeps_nonfinite_contract
        looped = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mod, backend="tiled")
    assert torch.equal(out.isnan(), looped.isnan())
    assert (out[0] == 0).all(), "batch element 0 has no key: its rows are 0, never NaN"
    t = torch.arange(90)
    nan_rows = out[1, 1].isnan().all(-1)
    expected = (t == 40) if where == "q" else (t >= 40) & (t <= 50)
    assert torch.equal(nan_rows, expected)
    assert max_error(out.nan_to_num(0), looped.nan_to_num(0)) <= 2**-7


@pytest.mark.parametrize("kind", ["window40-right7", "window-and-lengths"])
def test_bf16_traces_of_range_masks_take_the_fused_kernel(bf16_gemm, monkeypatch, kind):
    """A bfloat16 trace (the one-pass weights) of a window or of lengths runs the kernel with
    weights: every weight within one bfloat16 step of float64's, 0 outside the mask; rows with
    no key (batch element 0 of the lengths) output 0 with weights 0."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    calls = _spy_on_the_kernel(monkeypatch)
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(2, 4, 130, 64, generator=g).bfloat16() for _ in range(3))
    kw, allowed = RANGE_MASKS[kind]
    with torch.no_grad():
        out, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, **kw)
    assert calls == [True] and trace.backend == "reference"
    gold, base = _range_golden(q, k, v, 64**-0.5, allowed)
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    assert float(((trace.probs.double() - gold[1]).abs() - gold[1] * 2**-8).max()) <= 1e-30


def test_fused_kernel_one_row_calls_meet_the_policy_with_and_without_weights(bf16_gemm):
    """400 one-row calls (S=2..8, D=4, Dv=1, scores up to ~20): the output is the float32
    weights times the values, rounded once, with weights and without. The flash kernel's way
    without weights (unnormalised exps rounded to bfloat16, one GEMM) was outside the policy
    on 3 of these; rounded normalised weights on 29."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(0)
    lo = torch.zeros(1, 1, dtype=torch.int64)
    for i in range(400):
        S = 2 + i % 7
        q = torch.randn(1, 1, 1, 4, generator=g).bfloat16() * 3
        k = torch.randn(1, 1, S, 4, generator=g).bfloat16() * 3
        v = torch.randn(1, 1, S, 1, generator=g).bfloat16()
        gold, base = _range_golden(q, k, v, 0.5, torch.ones(1, S, dtype=torch.bool))
        for weights in (True, False):
            hi = torch.full((1, 1), S)
            out, _, _ = bf16_scores.attend_kernel(q, k, v, 0.5, lo, hi, weights=weights)
            assert_tolerance(out, gold[0], base[0], name=f"case {i}, weights={weights}")


def test_attend_kernel_with_document_ids_equals_float64_math(bf16_gemm):
    """Ids compared within each row's range (B2-H2-T120-S140-D16): keys of other ids have no
    effect; ids need not be contiguous; a row whose id no key carries, or whose range holds
    none of its id, outputs 0 with lse -inf."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(16)
    B, H, T, S = 2, 2, 120, 140
    q = torch.randn(B, H, T, 16, generator=g).bfloat16()
    k = torch.randn(B, H, S, 16, generator=g).bfloat16()
    v = torch.randn(B, H, S, 16, generator=g).bfloat16()
    q_ids = torch.randint(0, 5, (B, T), generator=g)
    kv_ids = torch.randint(0, 4, (1, S), generator=g)  # shared; id 4 has no key
    lo = torch.randint(0, 70, (1, T), generator=g)
    hi = (lo + torch.randint(0, 90, (1, T), generator=g)).clamp(max=S)
    out, probs, lse = bf16_scores.attend_kernel(
        q, k, v, 0.3, lo, hi, weights=True, ids=(q_ids, kv_ids)
    )
    j = torch.arange(S)
    allowed = (j >= lo[..., None]) & (j < hi[..., None]) & (q_ids[..., None] == kv_ids[:, None])
    allowed = allowed[:, None]  # (B, 1, T, S)
    gold, base = _range_golden(q, k, v, 0.3, allowed)
    assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name="out")
    none = ~allowed.any(-1).expand(B, H, T)
    assert none.any() and (out[none] == 0).all() and lse[none].isneginf().all()
    assert (probs[~allowed.expand(B, H, T, S)] == 0).all()
    assert float(((probs.double() - gold[1]).abs() - gold[1] * 2**-8).max()) <= 1e-30
    assert max_error(lse, gold[2]) <= ATOL * 10


@pytest.mark.parametrize("T", [1, 3, 4])
@pytest.mark.parametrize("mixed", [False, True], ids=["ids", "ids-and-mixed"])
def test_a_few_rows_with_document_ids_meet_the_policy_as_the_tiles_do(bf16_gemm, T, mixed):
    """Document ids with up to 4 query rows (the few rows' way compares them itself): keys of
    other ids, NaN ones included, have no effect; a row whose range holds none of its id
    outputs 0 with lse -inf; with ``mixed`` only the flagged rows compare. The same as the
    tiles (``rows=T``) and float64 math."""
    kernel_or_skip()
    g = torch.Generator().manual_seed(17 + T)
    B, H, S, D = 2, 2, 90, 32
    q = torch.randn(B, H, T, D, generator=g).bfloat16()
    k = torch.randn(B, H, S, D, generator=g).bfloat16()
    v = torch.randn(B, H, S, D, generator=g).bfloat16()
    q_ids = torch.randint(0, 4, (B, T), generator=g)
    q_ids[1, 0] = 9  # no key has it
    q_ids[0, 0] = 1
    kv_ids = torch.randint(0, 3, (B, S), generator=g)
    kv_ids[0, 20] = 1  # (row 0's id has a key)
    kv_ids[0, 10] = 7  # a key of an id no row has, NaN/inf in its key and value
    k[0, 1, 10, 3] = float("nan")
    v[0, 0, 10, 5] = float("inf")
    lo = torch.zeros(1, T, dtype=torch.int64)
    hi = torch.full((1, T), S)
    flags = torch.ones(B, T, dtype=torch.bool)
    ids = (q_ids, kv_ids, flags) if mixed else (q_ids, kv_ids)
    j = torch.arange(S)
    allowed = (j >= lo[..., None]) & (j < hi[..., None]) & (q_ids[..., None] == kv_ids[:, None])
    allowed = allowed[:, None]  # (B, 1, T, S)
    clean = [t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)]
    gold, base = _range_golden(*clean, 0.3, allowed)
    none = ~allowed.any(-1).expand(B, H, T)
    assert none.any()
    for rows in (0, T):
        out, probs, lse = bf16_scores.attend_kernel(
            q, k, v, 0.3, lo, hi, weights=True, ids=ids, rows=rows
        )
        assert not out.isnan().any(), f"rows={rows}: another id's NaN key reached a row"
        assert_tolerance(out, gold[0], base[0], factor=OUTPUT_FACTOR, name=f"out, rows={rows}")
        assert (out[none] == 0).all() and lse[none].isneginf().all()
        assert (probs[~allowed.expand(B, H, T, S)] == 0).all()
        assert max_error(lse[~none], gold[2][~none]) <= ATOL * 10
    j0 = int((kv_ids[0] == q_ids[0, 0]).nonzero()[0, 0])  # a key of row 0's id: NaN reaches
    k[0, 0, j0, 1] = float("nan")  # every row of head 0 of that id
    want = torch.zeros(T, dtype=torch.bool)
    want[q_ids[0] == kv_ids[0, j0]] = True
    for rows in (0, T):
        out, _, _ = bf16_scores.attend_kernel(
            q, k, v, 0.3, lo, hi, weights=False, ids=ids, rows=rows
        )
        assert torch.equal(out[0, 0].isnan().all(-1), want) and not out[0, 1].isnan().any()


def _packed_ids(T, g):
    """Packed sequences of 5-40 tokens: (1, T) ids, each one contiguous run."""
    lengths = torch.randint(5, 40, (T,), generator=g)
    return torch.repeat_interleave(torch.arange(T), lengths)[:T].view(1, T)


@pytest.mark.parametrize("layout", ["packed", "shuffled", "packed-causal"])
def test_tiled_bf16_documents_run_the_kernel(bf16_gemm, monkeypatch, layout):
    """Documents through the tiled backend in inference and through traces take the kernel,
    within the tolerance policy of float64 math, NaN/inf kept to its document (B2-H2-T150)."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    calls = _spy_on_the_kernel(monkeypatch)
    g = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(2, 2, 150, 32, generator=g).bfloat16() for _ in range(3))
    ids = _packed_ids(150, g)
    if layout == "shuffled":
        ids = ids[:, torch.randperm(150, generator=g)]
    mod = qkv.masks.document(ids)
    allowed = (ids[:, :, None] == ids[:, None, :])[:, None]  # (1, 1, T, S)
    if layout == "packed-causal":
        mod = qkv.masks.and_masks(mod, qkv.masks.causal())
        allowed = allowed & torch.ones(150, 150, dtype=torch.bool).tril()
    v[1, 0, 60, 2] = float("nan")
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mod, backend="tiled")
        traced, trace = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mod, return_trace=True)
    assert calls == [False, True]
    nan_rows = allowed[0, 0, :, 60]  # the rows that may attend key 60 of (1, 0)
    assert torch.equal(out[1, 0].isnan().all(-1), nan_rows) and not out[1, 1].isnan().any()
    assert torch.equal(traced.isnan(), out.isnan())
    v[1, 0, 60, 2] = 0.0
    gold, base = _range_golden(q, k, v, 32**-0.5, allowed)
    finite = ~out.isnan()
    for got in (out, traced):
        assert_tolerance(
            got.nan_to_num(0), gold[0].masked_fill(~finite, 0), base[0].masked_fill(~finite, 0)
        )
    assert float(((trace.probs.double() - gold[1]).abs() - gold[1] * 2**-8).max()) <= 1e-30


def test_calls_past_the_kernels_key_bound_take_the_other_ways(bf16_gemm, monkeypatch):
    """More keys than FUSED_MAX_KEYS (lowered to 64 here): the tiled loop and the unfused
    pass run the call, within the policy, and the kernel is not called."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    kernel_or_skip()
    monkeypatch.setattr(reference, "FUSED_MAX_KEYS", 64)
    calls = _spy_on_the_kernel(monkeypatch)
    g = torch.Generator().manual_seed(18)
    q, k, v = (torch.randn(1, 2, 65, 16, generator=g).bfloat16() for _ in range(3))
    kw, _ = RANGE_MASKS["window16"]
    allowed = RANGE_MASKS["window16"][1][:65, :65]
    gold, base = _range_golden(q, k, v, 16**-0.5, allowed)
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        traced, _ = qkv.scaled_dot_product_attention(q, k, v, return_trace=True, **kw)
    assert calls == []
    assert_tolerance(out, gold[0], base[0])
    assert_tolerance(traced, gold[0], base[0])


@pytest.mark.parametrize("B", [2, 3])
def test_per_batch_key_lengths_with_shared_document_ids(B):
    """Key lengths per batch element combined with document ids shared by the batch: the
    kernel's rows of mixed ids are per batch element while the ids are not (B = 2 raised
    ``RuntimeError: The expanded size of the tensor (1) must match the existing size (2)``;
    the long profile's test_visible_bad_keys_give_nan_where_the_plain_math_does found it).
    Each row is the float64 math's within the tolerance policy; a row with no key is 0."""
    g = torch.Generator().manual_seed(0)
    T = S = 9
    q, k, v = (torch.randn(B, 2, n, 8, generator=g).bfloat16() for n in (T, S, S))
    lengths = torch.tensor([0, 5, 9][:B])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    mask = qkv.masks.key_lengths(lengths) & qkv.masks.document(ids)
    with torch.no_grad():
        got = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend="tiled")
        base = qkv.scaled_dot_product_attention(q, k, v, mask_mod=mask, backend="reference")
        gold = qkv.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), mask_mod=mask, backend="reference"
        )
    assert (got[0] == 0).all()  # batch element 0 has no key
    assert_tolerance(got, gold, base)


# --- auto's GEMM where two run: measured (issue 38, item 2) -----------------------------------


class _Clock:
    now = 0.0


@pytest.fixture
def two_gemms(monkeypatch, tmp_path):
    """A machine where both GEMMs run (an AMX CPU), with fake costs: measuring on, a fresh
    cache folder, ``QKV_BF16_GEMM`` unset, the fake clock, and runners that advance it by their
    GEMM's cost and count themselves. Yields the costs and the counts (a test may change the
    costs). The kernel itself is not called: what is tested is which code ``auto`` hands it."""
    if bf16_scores._build()[0] is None:
        pytest.skip(f"the kernel does not build here: {bf16_scores._build()[1]}")
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("QKV_BF16_GEMM", raising=False)
    monkeypatch.setattr(bf16_scores, "_runs", lambda lib: (("amx", "avx512_bf16"), ""))
    monkeypatch.setattr(bf16_scores, "_clock", lambda: _Clock.now)
    costs = {"amx": 3e-3, "avx512_bf16": 1e-3}  # the second in the static order, faster
    runs = dict.fromkeys(costs, 0)

    def fake_runners(names):
        def runner(name):
            def run():
                runs[name] += 1
                _Clock.now += costs[name]

            return run

        return {name: runner(name) for name in names}

    monkeypatch.setattr(bf16_scores, "_gemm_runners", fake_runners)
    bf16_scores.forget_gemm()
    yield costs, runs
    bf16_scores.forget_gemm()


def test_auto_takes_the_gemm_measured_faster_where_two_run(two_gemms, monkeypatch):
    """Where AMX and AVX512-BF16 both run, ``auto`` times the kernel on each once and takes the
    faster, whatever the static order says (AMX first); the choice holds in the process (no
    timing again, even if the costs change), a later process reads it from disk, and
    ``QKV_AUTOTUNE=off`` and ``QKV_BF16_GEMM`` override it without timing."""
    costs, runs = two_gemms
    assert bf16_scores._route() == (bf16_scores.GEMMS["avx512_bf16"], "")
    choice = bf16_scores.gemm_choice(measure=False)
    assert choice.source == "measured" and choice.route == "avx512_bf16"
    assert choice.times == pytest.approx(costs)
    assert runs["amx"] >= 3 and runs["avx512_bf16"] >= 3  # one untimed, two timed at least
    assert "avx512_bf16: faster measured on this machine (avx512_bf16 1 ms, amx 3 ms" in (
        choice.reason()
    )
    seen = dict(runs)
    costs.update(amx=1e-4)  # faster now: the process keeps its verdict, no timing again
    assert bf16_scores._route()[0] == bf16_scores.GEMMS["avx512_bf16"] and runs == seen
    bf16_scores.forget_gemm()  # a later process on this machine: the disk's verdict
    assert bf16_scores._route()[0] == bf16_scores.GEMMS["avx512_bf16"] and runs == seen
    assert bf16_scores.gemm_choice(measure=False).source == "disk"
    monkeypatch.setenv("QKV_AUTOTUNE", "off")  # the static order, nothing timed
    assert bf16_scores._route()[0] == bf16_scores.GEMMS["amx"] and runs == seen
    assert bf16_scores.gemm_choice().source == "static"
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_BF16_GEMM", "amx")  # forced
    assert bf16_scores._route()[0] == bf16_scores.GEMMS["amx"] and runs == seen
    fresh = bf16_scores.gemm_choice(fresh=True)  # qkv tune: timed again, the new verdict kept
    assert fresh.route == "amx" and runs["amx"] > seen["amx"]
    monkeypatch.delenv("QKV_BF16_GEMM")
    assert bf16_scores._route()[0] == bf16_scores.GEMMS["amx"]


def test_auto_times_nothing_where_one_gemm_runs_or_under_tracing(two_gemms, monkeypatch):
    """One GEMM that runs is taken without timing; under a dispatch mode (fake tensors, op
    counters) nothing is timed and the static order holds until a plain call measures."""
    _costs, runs = two_gemms
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Counter():
        assert bf16_scores._route()[0] == bf16_scores.GEMMS["amx"]
    assert sum(runs.values()) == 0
    assert bf16_scores.gemm_choice(measure=False).source == "static"
    monkeypatch.setattr(bf16_scores, "_runs", lambda lib: (("avx512_bf16",), "no AMX"))
    choice = bf16_scores.gemm_choice()
    assert (choice.route, choice.source) == ("avx512_bf16", "only") and sum(runs.values()) == 0


def test_the_gemm_runners_run_the_kernel_on_each_gemm_that_runs_here():
    """The representative call behind the measurement runs the kernel on the GEMM it names
    (its thread held to that code while it runs, and let go after), to the tiles' output."""
    kernel_or_skip()
    runs = bf16_scores.gemm_routes()
    runners = bf16_scores._gemm_runners(runs)
    assert set(runners) == set(runs)
    for name, run in runners.items():
        out = run()[0]
        assert out.shape == (1, 4, 256, 64) and torch.isfinite(out).all(), name
        assert getattr(bf16_scores._TIMING, "gemm", 0) == 0


def test_qkv_tune_names_the_kernels_gemm_and_the_switch_that_holds_it(monkeypatch, tmp_path):
    """``qkv tune``'s routes end with the kernel's GEMM: the one ``auto`` takes here and why,
    and the ``QKV_BF16_GEMM`` value that holds the process where it is set."""
    from qkv.bench.tune import tune_routes

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.delenv("QKV_CPU_HALF_GEMM", raising=False)
    monkeypatch.delenv("QKV_BF16_GEMM", raising=False)
    try:
        row = list(tune_routes())[-1]
        runs = bf16_scores.gemm_routes()
        assert row["choice"] == "bfloat16 kernel GEMM" and "forced" not in row
        assert row["route"] == (runs[0] if len(runs) == 1 else row["route"])
        assert row["route"] in runs or (not runs and row["route"] == "")
        assert row["reason"] == bf16_scores.gemm_choice(measure=False).reason()
        monkeypatch.setenv("QKV_BF16_GEMM", "avx512_bf16")
        row = list(tune_routes())[-1]
        assert (row["forced"], row["switch"]) == ("avx512_bf16", "QKV_BF16_GEMM")
    finally:
        bf16_scores.forget_gemm()
        cpu_isa.forget()
