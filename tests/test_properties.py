"""Property-based tests: every backend against an independent float64 reference (issue 12).

Hypothesis draws whole calls (tests/strategies.py): sizes of 1, odd sizes, T != S and empty
sizes; contiguous, transposed, strided, offset and expanded (stride-0) layouts; float64,
float32, bfloat16 and float16 (and float32 masks on other dtypes); bool and float attn_masks
of every broadcast shape with fully masked rows; is_causal; qkv.masks mask_mods and plain
functions, alone and combined; score_mods (ALiBi, softcap, plain functions reading captured
tensors); GQA; scales of 0, negative and large. Each call runs on a backend and is compared,
output and gradients (q, k, v, a float attn_mask that requires grad, tensors a score_mod
reads), with tests/reference64.py, float64 attention written without qkv.

The tolerance is DESIGN.md's: golden = reference64 on the float64 upcast of the inputs,
baseline = qkv's ``reference`` backend in the inputs' dtype, and
``max|out - golden| <= F * max|baseline - golden| + 1e-5`` (F = 2 outputs, 3 gradients), no
NaN anywhere (the golden never has one); float64 uses ``assert_close`` defaults.

``tiled-small`` is the tiled backend with tiny blocks and chunks (patched for the test), so
that calls of T, S <= 40 cross tile and block boundaries, skip blocks and merge chunks by
their log-sum-exps, as long sequences do with the real sizes.

Profiles: ``ci`` (default: fixed examples, derandomized) and ``long`` (5000 examples per test,
random): ``QKV_HYPOTHESIS_PROFILE=long pytest tests/test_properties.py``.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import qkv
from reference64 import attention64
from strategies import (COPYING_FREE_LAYOUTS, Alibi, Case, Causal, Combine, Document, KeyLengths,
                        MaskFn, MaskSpec, ScoreFn, Softcap, Window, cases)

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=36, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=5000, derandomize=False, **_COMMON)
PROFILE = settings.get_profile(os.environ.get("QKV_HYPOTHESIS_PROFILE", "ci"))
LONG = PROFILE.max_examples > 100


def budget(n: int) -> settings:
    """``n`` examples under ``ci``; the profile's own count under ``long``."""
    return settings(PROFILE, max_examples=PROFILE.max_examples if LONG else n)


BACKENDS = ["reference", "torch", "tiled", "auto", "tiled-small"]
OUTPUT_FACTOR, GRAD_FACTOR, ATOL = 2.0, 3.0, 1e-5


# --- running a case ---------------------------------------------------------------------------

@contextmanager
def small_tiles(bq: int, bk: int, chunk_blocks: int, full_run: int):
    """The tiled backend with ``bq``-row tiles, ``bk``-key blocks, chunks of at most
    ``chunk_blocks`` blocks and full runs of ``full_run`` blocks taken unmasked."""
    from qkv.ops import tiled as tiled_mod

    fn = tiled_mod.tiled_attention
    kw = getattr(fn, "__kwdefaults__", None) or {}
    names = ("CHUNK_ELEMENTS", "MIN_FULL_RUN")
    if "block_q" not in kw or "block_k" not in kw or not all(hasattr(tiled_mod, n) for n in names):
        pytest.skip("qkv.ops.tiled no longer has block_q/block_k defaults or CHUNK_ELEMENTS/"
                    "MIN_FULL_RUN: update small_tiles() to shrink its tiles")
    saved = dict(kw), {n: getattr(tiled_mod, n) for n in names}
    fn.__kwdefaults__ = {**kw, "block_q": bq, "block_k": bk}
    tiled_mod.MIN_FULL_RUN = full_run
    tiled_mod.CHUNK_ELEMENTS = bq * bk * chunk_blocks  # times B*H: qkv divides by B*H*bq*bk
    try:
        yield
    finally:
        fn.__kwdefaults__ = saved[0]
        for n, value in saved[1].items():
            setattr(tiled_mod, n, value)


def draw_tiles(data, case: Case):
    bq = data.draw(st.sampled_from([4, 1, 3, 8, 16]), label="block_q")
    bk = data.draw(st.sampled_from([4, 1, 2, 5, 16]), label="block_k")
    chunk = data.draw(st.sampled_from([1, 2, 64]), label="chunk_blocks")
    full_run = data.draw(st.sampled_from([1, 2, 8]), label="min_full_run")
    return bq, bk, chunk * max(1, case.B * case.H), full_run


def run_qkv(case: Case, inp: dict, backend: str, tiles=None):
    """qkv's output, or None when the backend says it cannot take the call."""
    kw = case.qkv_kwargs(inp)
    name = "tiled" if backend == "tiled-small" else backend
    try:
        if backend == "tiled-small":
            with small_tiles(*tiles):
                return qkv.scaled_dot_product_attention(inp["q"], inp["k"], inp["v"],
                                                        backend=name, **kw)
        return qkv.scaled_dot_product_attention(inp["q"], inp["k"], inp["v"], backend=name, **kw)
    except qkv.BackendUnsupportedError:
        if backend == "auto":
            raise
        return None


def grad_inputs(inp: dict) -> dict:
    """The tensors gradients are compared for, by name."""
    out = {"q": inp["q"], "k": inp["k"], "v": inp["v"]}
    if inp["mask"] is not None and inp["mask"].requires_grad:
        out["attn_mask"] = inp["mask"]
    for name, t in inp["score_tensors"].items():
        if t.requires_grad:
            out[f"score_mod.{name}"] = t
    return out


def grads(out: torch.Tensor, wrt: dict, dout: torch.Tensor, tiles=None) -> dict:
    """Gradients of ``(out * dout).sum()``; zeros for inputs the output does not depend on."""
    assert out.requires_grad, (
        f"the output {tuple(out.shape)} does not require grad although its inputs do: "
        f"out.sum().backward() would raise")
    ctx = small_tiles(*tiles) if tiles is not None else _nothing()
    with ctx:
        got = torch.autograd.grad(out, list(wrt.values()), dout, allow_unused=True,
                                  materialize_grads=True)
    return dict(zip(wrt, got))


@contextmanager
def _nothing():
    yield


def golden_run(case: Case, inp: dict):
    """reference64 on the float64 upcast of the inputs: output and gradients by name."""
    def up(t):
        return t.detach().to(torch.float64).contiguous().clone().requires_grad_(True)

    q, k, v = up(inp["q"]), up(inp["k"]), up(inp["v"])
    bias = None
    mask = inp["mask"]
    if mask is not None and mask.dtype != torch.bool:
        bias = up(mask)
    tensors64 = {n: up(t) for n, t in inp["score_tensors"].items()}
    out = attention64(q, k, v, scale=case.scale, allowed=case.golden_allowed(), bias=bias,
                      score_mod=case.golden_score_mod(tensors64))
    wrt = {"q": q, "k": k, "v": v}
    if mask is not None and mask.requires_grad:
        wrt["attn_mask"] = bias
    for name, t in inp["score_tensors"].items():
        if t.requires_grad:
            wrt[f"score_mod.{name}"] = tensors64[name]
    g = torch.autograd.grad(out, list(wrt.values()), inp["dout"].to(torch.float64),
                            allow_unused=True, materialize_grads=True)
    return out.detach(), dict(zip(wrt, g))


# --- the tolerance policy ---------------------------------------------------------------------

def max_error(actual: torch.Tensor, golden: torch.Tensor) -> float:
    """``max|actual - golden|`` in float64; a NaN or an infinity counts as infinite error."""
    if actual.numel() == 0:
        return 0.0
    diff = (actual.detach().to(torch.float64) - golden.to(torch.float64)).abs()
    return float(torch.nan_to_num(diff, nan=math.inf).max())


def check(name: str, actual, golden: torch.Tensor, baseline, factor: float, where: str):
    """DESIGN.md's tolerance policy for one tensor (float64: assert_close defaults)."""
    assert actual is not None, f"{where}: {name} has no gradient"
    assert tuple(actual.shape) == tuple(golden.shape), (
        f"{where}: {name} has shape {tuple(actual.shape)}, expected {tuple(golden.shape)}")
    nan = torch.isnan(actual.detach())
    if bool(nan.any()):
        first = tuple(nan.nonzero()[0].tolist())
        raise AssertionError(f"{where}: {name} is NaN at {first} ({int(nan.sum())} NaNs) where "
                             f"the golden is {golden[first].item():.6g}")
    if actual.dtype == torch.float64:
        torch.testing.assert_close(actual.detach(), golden, msg=lambda m: f"{where}: {name}: {m}")
        return
    err, base = max_error(actual, golden), max_error(baseline, golden)
    bound = factor * base + ATOL
    assert err <= bound, (
        f"{where}: {name}: max|out - golden| = {err:.3e} exceeds {factor:g} * "
        f"max|baseline - golden| ({base:.3e}) + {ATOL:g} = {bound:.3e} (dtype {actual.dtype})")


def check_call(case: Case, backend: str, tiles=None, *, with_grads: bool = True):
    """Run ``case`` on ``backend`` and on the reference, compare both with the golden."""
    inp = case.inputs()
    where = f"backend={backend}" + (f" tiles={tiles}" if tiles else "")
    out = run_qkv(case, inp, backend, tiles)
    if out is None:
        return
    gold_out, gold_grads = golden_run(case, inp)
    base_out = run_qkv(case, inp, "reference")
    assert out.dtype == inp["q"].dtype, f"{where}: output dtype {out.dtype}, inputs {inp['q'].dtype}"
    check("output", out, gold_out, base_out, OUTPUT_FACTOR, where)
    if not with_grads:
        return
    wrt = grad_inputs(inp)
    got = grads(out, wrt, inp["dout"], tiles if backend == "tiled-small" else None)
    base = grads(base_out, wrt, inp["dout"])
    for name in wrt:
        assert got[name].dtype == wrt[name].dtype
        check(f"grad {name}", got[name], gold_grads[name], base[name], GRAD_FACTOR, where)


# --- properties -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@budget(36)
@given(case=cases(), data=st.data())
def test_matches_float64_reference(backend, case, data):
    """Output and gradients within the tolerance policy of the float64 reference."""
    tiles = draw_tiles(data, case) if backend == "tiled-small" else None
    check_call(case, backend, tiles)


@pytest.mark.parametrize("backend", BACKENDS)
@budget(30)
@given(case=cases(structured=False), data=st.data())
def test_dense_masks_match_float64_reference(backend, case, data):
    """The same without mask_mod/score_mod, so that the torch backend takes every call."""
    tiles = draw_tiles(data, case) if backend == "tiled-small" else None
    check_call(case, backend, tiles)


def _kv_view(allowed: torch.Tensor, G: int) -> torch.Tensor:
    B, H, T, S = allowed.shape
    return allowed.reshape(B, G, H // G, T, S)  # (B, G, H/G, T, S)


@pytest.mark.parametrize("backend", BACKENDS)
@budget(16)
@given(case=cases(layouts=COPYING_FREE_LAYOUTS, need_mask=True), data=st.data())
def test_masked_keys_have_no_effect(backend, case, data):
    """NaN/inf in keys and values a row may not attend to change nothing of that row.

    ``dead`` mode: every key no row may attend to (per batch element and kv head), and maybe
    the queries of rows that may attend to nothing, hold NaN or inf; output and every
    gradient must be those of the clean call. ``row`` mode: one key masked for some rows
    holds NaN or inf; the outputs of the rows that may not attend to it must be unchanged.
    """
    tiles = draw_tiles(data, case) if backend == "tiled-small" else None
    B, H, G, T, S = case.B, case.H, case.G, case.T, case.S
    allowed = _kv_view(case.golden_allowed(), G)  # (B, G, H/G, T, S)
    dead = ~allowed.any(2).any(2)  # (B, G, S): no row of these heads may attend the key
    masked_somewhere = (~allowed).any(2).any(2) & ~dead  # (B, G, S)
    mode = data.draw(st.sampled_from(["dead", "row"]), label="mode")
    assume(bool(dead.any()) if mode == "dead" else bool(masked_somewhere.any()))
    poison = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]), label="poison")
    where = f"backend={backend} mode={mode} poison={poison}"

    inp = case.inputs()
    gold_out, gold_grads = golden_run(case, inp)  # on the clean inputs
    base_out = run_qkv(case, inp, "reference")
    wrt = grad_inputs(inp)
    base_grads = grads(base_out, wrt, inp["dout"]) if mode == "dead" else None
    k, v, q = inp["k"].detach(), inp["v"].detach(), inp["q"].detach()  # share storage
    if mode == "dead":
        k[dead] = poison
        v[dead] = poison
        if data.draw(st.booleans(), label="poison_dead_queries"):
            q[~case.golden_allowed().any(-1)] = poison  # rows that may attend to nothing
        rows = torch.ones(B, H, T, dtype=torch.bool)
    else:
        b, g, j = (int(x) for x in data.draw(st.sampled_from(masked_somewhere.nonzero().tolist()),
                                              label="poisoned key"))
        k[b, g, j] = poison
        v[b, g, j] = poison
        sees = allowed[b, g, :, :, j]  # (H/G, T): rows that may attend the poisoned key
        rows = torch.ones(B, G, H // G, T, dtype=torch.bool)
        rows[b, g] = ~sees
        rows = rows.reshape(B, H, T)
    out = run_qkv(case, inp, backend, tiles)
    if out is None:
        return
    check("output of rows that may not see the poison", out[rows], gold_out[rows], base_out[rows],
          OUTPUT_FACTOR, where)
    if mode == "dead":
        got = grads(out, wrt, inp["dout"], tiles if backend == "tiled-small" else None)
        for name in wrt:
            check(f"grad {name}", got[name], gold_grads[name], base_grads[name], GRAD_FACTOR, where)


def _torch_autocast_dtype(dt: torch.dtype) -> torch.dtype:
    """The dtype of torch's own SDPA output under CPU autocast to ``dt``."""
    x = torch.randn(1, 1, 2, 4)
    with torch.autocast("cpu", dtype=dt):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x).dtype


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled", "auto"])
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@budget(8)
@given(case=cases(dtypes=("float32",), structured=False))
def test_autocast_matches_torch(backend, low, case):
    """Under CPU autocast, float32 inputs are computed as torch's SDPA computes them: in the
    autocast dtype, which the output has; within the policy of the reference run on inputs
    cast to that dtype."""
    if case.mask is not None and case.mask.kind == "float":
        case = replace(case, mask=replace(case.mask, kind="bool", grad=False))
    dt = getattr(torch, low)
    inp = case.inputs(grad=False)
    with torch.autocast("cpu", dtype=dt):
        out = run_qkv(case, inp, backend)
    if out is None:
        return
    expect = _torch_autocast_dtype(dt)
    assert out.dtype == expect, (
        f"backend={backend}: under autocast({low}) the output is {out.dtype}; torch's SDPA "
        f"gives {expect}")
    low_case = replace(case, dtype=low)
    low_inp = {**inp, "q": inp["q"].to(dt), "k": inp["k"].to(dt), "v": inp["v"].to(dt),
               "dout": inp["dout"].to(dt)}
    gold_out, _ = golden_run(low_case, low_inp)
    base_out = run_qkv(low_case, low_inp, "reference")
    check("output", out, gold_out, base_out, OUTPUT_FACTOR, f"backend={backend} autocast={low}")
