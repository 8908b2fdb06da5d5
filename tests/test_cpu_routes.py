"""Every CPU route on every machine (issue 37), and NaN from the native half route (issue 41).

qkv took torch's half GEMMs for half inputs on CPUs with AVX-512-BF16 or AMX (the "native"
route, ``QKV_CPU_HALF_GEMM``), and those round their output to half: the one-pass weights
(``auto`` with ``return_trace`` and no gradient) had bfloat16 scores and a bfloat16-accurate
lse, were off by up to 0.7 in the weights, and were NaN at ``scale=0`` (a half ``baddbmm``
with ``alpha=0`` reads its output buffer). Nothing caught it: the suite ran only the route
its machine picked. Here each route is forced (tests/routes.py) and held to float64 math
written apart from qkv (tests/reference64.py).

Shape alphabet: B batch, H heads, T query length, S key length, D head dim.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference64 import attention64_trace, product_size
from routes import HALF_GEMM_ROUTES, MACHINE_PROBES, ROUTES, force_route

import qkv
from qkv.ops import reference
from qkv.testing import ATOL, OUTPUT_FACTOR, assert_tolerance, max_error

B, H, D = 2, 4, 32
SCALES = (None, 0.0, -0.5, 3.0)


def _grid_case(T: int, causal: bool, scale: float | None, masked: bool, seed: int):
    """bfloat16 q, k, v ``(B, H, T, D)`` and a bool mask ``(T, T)`` (or None), and the keys
    each row may attend to ``(T, T)``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = torch.rand(T, T, generator=g) < 0.7 if masked else None
    allowed = torch.ones(T, T, dtype=torch.bool) if mask is None else mask.clone()
    if causal:
        allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    return q, k, v, mask, allowed


def _torch_error(q, k, v, allowed, scale, golden) -> float:
    """The error of torch's own bfloat16 SDPA against ``golden``, on the rows that may attend
    to something (torch gives NaN on the others, and for ``is_causal`` with ``scale=0``, so
    the causal mask goes in as a bool mask)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    rows = allowed.any(-1)  # (T,)
    return max_error(out[:, :, rows], golden[:, :, rows])


def _check_grid_case(T: int, causal: bool, scale: float | None, masked: bool, seed: int):
    """One case of the issue's grid: the reasons it fails (none when it passes)."""
    q, k, v, mask, allowed = _grid_case(T, causal, scale, masked, seed)
    with torch.no_grad():
        out, trace = qkv.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, return_trace=True
        )
        _, base_trace = qkv.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            backend="reference",
            return_trace=True,
        )
    assert trace.backend == "reference", "not the one-pass weights"
    up = [t.double() for t in (q, k, v)]
    gold_out, _, gold_probs, gold_lse = attention64_trace(*up, scale=scale, allowed=allowed)
    bad = []
    for name, t in (("out", out), ("probs", trace.probs), ("lse", trace.lse)):
        if t.isnan().any():
            bad.append(f"{name}: {int(t.isnan().sum())} NaN")
    if bad:
        return bad
    err, torch_err = max_error(out, gold_out), _torch_error(q, k, v, allowed, scale, gold_out)
    if err > OUTPUT_FACTOR * torch_err + ATOL:
        bad.append(f"out: error {err:.3g} > {OUTPUT_FACTOR:g} x torch's {torch_err:.3g}")
    try:
        assert_tolerance(trace.probs, gold_probs, base_trace.probs, name="probs")
    except AssertionError as e:
        bad.append(str(e))
    # Weights formed in float32 and rounded once: within half a bfloat16 ulp of the exact
    # ones, plus float32's error (1e-4 relative is 40 times below that ulp).
    half_ulp = gold_probs * (torch.finfo(torch.bfloat16).eps / 2 + 1e-4) + 1e-7
    worst = float(((trace.probs.double() - gold_probs).abs() - half_ulp).max())
    if worst > 0:
        bad.append(f"probs: beyond half an ulp of the exact weights by {worst:.3g}")
    lse_err, size = max_error(trace.lse, gold_lse), product_size(q, k, scale)
    if lse_err > ATOL * size:
        bad.append(f"lse: error {lse_err:.3g} > {ATOL:g} x {size:.3g} (float32's)")
    return bad


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("T", [1, 7, 64, 300], ids=lambda t: f"B{B}-T{t}-H{H}-D{D}")
@pytest.mark.parametrize("route", HALF_GEMM_ROUTES)
def test_bf16_one_pass_traces_on_the_issue_grid(route, T, causal, monkeypatch):
    """Issue 37's 64 cases (T in 1, 7, 64, 300; causal or not; scale None, 0, -0.5, 3; with
    and without a bool mask), bfloat16 with a trace and no gradient, on each route: no NaN,
    the output within 2x torch's own bfloat16 SDPA error, the weights within the tolerance
    policy and half an ulp of float64's, the lse float32's. The native route had 20 cases
    bad: NaN at scale=0, weights off by 0.71 at scale=0 causal T=64, by 0.04-0.08 at 3."""
    force_route(monkeypatch, route)
    failures = {}
    for i, (scale, masked) in enumerate(itertools.product(SCALES, [False, True])):
        bad = _check_grid_case(T, causal, scale, masked, seed=100 * T + 10 * causal + i)
        if bad:
            failures[f"scale={scale} mask={masked}"] = bad
    assert not failures, failures


def _nan_filled_empty_large(shape, *, dtype, device):
    """``empty_large`` whose memory happens to hold NaN, as torch.empty's may."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("S", [256, 257, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("route", HALF_GEMM_ROUTES)
def test_scale_zero_weights_are_uniform(route, dtype, S, monkeypatch):
    """Issue 41, item 4: ``scale=0``, half inputs, a trace without a gradient, on the
    native route: output, weights and lse were NaN for S > 256 (a half ``baddbmm`` with
    ``alpha=0`` reads its output, the weights' uninitialised buffer; NaN-filled here so the
    test does not depend on what memory holds). Every weight is 1/S, the lse log S, and the
    output the mean of the values rounded once."""
    force_route(monkeypatch, route)
    monkeypatch.setattr(reference, "empty_large", _nan_filled_empty_large)
    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g).to(dtype) for n in (3, S, S))
    with torch.no_grad():
        out, trace = qkv.scaled_dot_product_attention(q, k, v, scale=0.0, return_trace=True)
    assert trace.backend == "reference", "not the one-pass weights"
    assert torch.equal(trace.probs, torch.full_like(trace.probs, 1 / S))
    torch.testing.assert_close(trace.lse.double(), torch.full((1, 2, 3), math.log(S)).double())
    mean = v.double().mean(-2, keepdim=True).expand(1, 2, 3, 8)  # (1, 2, 3, 8)
    half_ulp = mean.abs() * torch.finfo(dtype).eps / 2 + ATOL
    assert ((out.double() - mean).abs() <= half_ulp).all()


@pytest.mark.parametrize("path", ["one-pass", "tiled", "torch"])
def test_bf16_scale_zero_causal_repro(path, cpu_route):
    """Issue 37's repro on every route and path: ``scale=0, is_causal=True``, bfloat16, a
    trace (320 NaN in trace.probs on the native route; torch's own kernel gives NaN there
    too): row t of the weights is 1/(t+1) on keys 0..t, and the output the mean of those
    values."""
    q, k, v = (torch.randn(1, 2, 64, 8).to(torch.bfloat16) for _ in range(3))
    kw = dict(scale=0.0, is_causal=True, return_trace=True)
    if path == "one-pass":
        with torch.no_grad():
            out, trace = qkv.scaled_dot_product_attention(q, k, v, **kw)
        assert trace.backend == "reference"
    else:
        out, trace = qkv.scaled_dot_product_attention(q, k, v, backend=path, **kw)
    n = torch.arange(1, 65, dtype=torch.float64).view(-1, 1)  # (64, 1): keys row t may see
    want = torch.ones(64, 64, dtype=torch.float64).tril() / n  # (64, 64)
    assert not trace.probs.isnan().any() and not out.isnan().any()
    torch.testing.assert_close(
        trace.probs.double(), want.expand(1, 2, 64, 64).to(torch.bfloat16).double()
    )
    assert not trace.lse.isnan().any()
    if path == "one-pass":  # tiled and torch take torch's bf16 kernel's lse: ~1e-5 relative
        lse_err = max_error(trace.lse, n.log().view(64).expand(1, 2, 64))
        assert lse_err <= ATOL, f"lse off by {lse_err:.3g}"
    mean = want @ v.double()  # (1, 2, 64, 8)
    assert_tolerance(out, mean, want.to(torch.bfloat16) @ v, factor=OUTPUT_FACTOR, name="out")


# --- every machine choice has a route ----------------------------------------------------------

# What reads the machine or the environment: calls and attributes by name, and string
# constants (environment variables of qkv, oneDNN and ATen; the kernel's CPU flags).
_PROBE_NAMES = {
    "get_cpu_capability",
    "flash_cpu_available",
    "flex_available",
    "cpu_features",
    "native_bf16",
    "get_device_capability",
    "is_bf16_supported",
    "mkldnn",
}
_PROBE_STRING = re.compile(r"^(QKV_|ONEDNN_|ATEN_|DNNL_)\w+$|^/proc/cpuinfo$")


def _probes(path: Path) -> set[str]:
    """The probes of the machine in one source file (docstrings and comments not counted)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in _PROBE_NAMES:
            found.add(node.attr)
        elif isinstance(node, ast.Name) and node.id in _PROBE_NAMES:
            found.add(node.id)
        elif isinstance(node, ast.FunctionDef) and node.name in _PROBE_NAMES:
            found.add(node.name)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _PROBE_STRING.match(node.value)
        ):
            found.add(node.value)
    return found


def test_every_machine_choice_is_listed():
    """Each file of the library that reads the CPU, the torch build's kernels or an
    environment variable of qkv, oneDNN or ATen is one tests/routes.py lists (with the route
    that forces it, or why it is no route). A new one fails here until it is listed, so that
    the suite forces it rather than leaving it to the machines that pick it."""
    root = Path(qkv.__file__).parent
    found = {
        str(p.relative_to(root)): sorted(probes)
        for p in sorted(root.rglob("*.py"))
        if (probes := _probes(p))
    }
    assert set(found) == set(MACHINE_PROBES), (
        f"files probing the machine: {found}; tests/routes.py lists {sorted(MACHINE_PROBES)}"
    )
    assert set(ROUTES.values()) == set(itertools.product(HALF_GEMM_ROUTES, (True, False)))


def test_without_a_compiler_flex_declines_and_auto_is_unchanged(monkeypatch):
    """The flex backend needs a C++ compiler on CPU (``ops.flex.flex_available``): on a
    machine without one it declines with that reason, and ``auto``, which takes flex on CPU
    only as measured, gives the same result as where one is found."""
    from qkv.ops import flex

    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    window = qkv.masks.sliding_window(5)
    want = qkv.scaled_dot_product_attention(q, k, v, mask_mod=window)
    reason = "compiled FlexAttention on CPU needs a C++ compiler (hidden by the test)"
    monkeypatch.setattr(flex, "flex_available", lambda device: reason)
    with pytest.raises(qkv.BackendUnsupportedError, match="needs a C\\+\\+ compiler"):
        qkv.scaled_dot_product_attention(q, k, v, mask_mod=window, backend="flex")
    assert torch.equal(qkv.scaled_dot_product_attention(q, k, v, mask_mod=window), want)
