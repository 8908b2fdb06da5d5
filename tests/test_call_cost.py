"""Cheap calls (issue 38, item 4): what a call dispatches around torch's kernel, and the
contract on the routes that keep it cheap, against float64 math written here.

* A call without gradient whose rows see every key is checked after its kernel by one fused
  pass over the output and the queries (``ops/nonfinite_rows.py``, C++ on the CPU), not by two
  matrix-vector products and two adds.
* Top-left causal attention with fewer queries than keys runs on the first T keys: keys
  T.. reach no row (a decoding step of one query then sees its one key).
* A key mask (the same keys hidden from every row of a head) zeroes the keys it hides in copies
  of k and v; whatever a shown key holds shows in the output.
* ``dispatch.choose`` keeps its backend choice per call structure, and drops it when the registry or
  ``autotune`` changes.

Each runs with the fused passes and without them (their slow twin: tensor ops), as where no
C++ compiler is found (tests/routes.py, ``force_native_rows``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from routes import force_host_reads, force_native_rows
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv import dispatch
from qkv.ops import AttentionCall, bf16_scores, nonfinite, nonfinite_rows

B, H, D = 2, 3, 8


@pytest.fixture(params=["fused", "tensor-ops"])
def route(request, monkeypatch):
    """Both ways of keeping the contract without host reads (the default on the CPU, and
    CUDA's way)."""
    force_host_reads(monkeypatch, free=False)
    force_native_rows(monkeypatch, on=request.param == "fused")
    return request.param


def _golden(q, k, v, ok):
    """float64 attention under the allowed pairs ``ok`` (broadcastable to (B, H, T, S)); rows
    with no key 0."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    return probs @ v.double()


class Ops(TorchDispatchMode):
    """The ops dispatched under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops(fn) -> list[str]:
    with Ops() as mode:
        fn()
    return mode.ops


# --- causal with fewer queries than keys -------------------------------------------------------


@pytest.mark.parametrize("T", [1, 3, 12])
def test_causal_keys_past_the_queries_reach_no_row(route, T):
    """Top-left causal, T < S = 13: NaN/inf in keys T.. (hidden from every row) change
    nothing; a NaN in key 0 makes every row NaN; a bad query row is NaN, the others exact."""
    S = 13
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T, S, S))
    ok = torch.ones(T, S, dtype=torch.bool).tril()  # row i sees keys 0..i
    want = _golden(q, k, v, ok)
    k[0, 1, T:, 2] = math.nan  # hidden from every row of head (0, 1)
    v[1, 0, S - 1, 0] = math.inf
    v[1, 2, 0, 3] = math.nan  # key 0: every row of head (1, 2) sees it
    q[0, 0, T - 1, 1] = -math.inf
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    hit = torch.zeros(B, H, T, dtype=torch.bool)
    hit[1, 2] = True
    hit[0, 0, T - 1] = True
    assert out[hit].isnan().all()
    torch.testing.assert_close(out[~hit].double(), want[~hit], rtol=1e-5, atol=1e-6)


def test_causal_with_dropout_keeps_every_key_so_draws_match_torch():
    """With dropout the keys are not cut (torch draws per (T, S) element): the same seed gives
    torch's output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, D, generator=g) for n in (2, 9, 9))
    torch.manual_seed(5)
    ours = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.3)
    torch.manual_seed(5)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, dropout_p=0.3
    )
    torch.testing.assert_close(ours, theirs)


# --- key masks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    ["B11S", "BH1S", "1S", "gqa-B11S", "gqa-BH1S", "shared-kv"],
)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_key_masks_hide_keys_whatever_they_hold(route, layout, kind):
    """A key mask of each layout (GQA with one mask per query head, and k/v shared by the
    batch while the mask is not, cannot zero one copy per row: they take the general way): a
    NaN/inf in a hidden key changes nothing, in a shown key makes the rows that see it NaN; a
    row with no key is 0 even for a NaN query."""
    T, S, G = 4, 11, H
    gqa = layout.startswith("gqa")
    Hq = 2 * G if gqa else H
    kb = 1 if layout == "shared-kv" else B
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, Hq, T, D, generator=g)
    k, v = (torch.randn(kb, G, S, D, generator=g) for _ in range(2))
    shown = torch.rand(B, Hq, 1, S, generator=g) < 0.6  # (B, Hq, 1, S)
    if layout in ("B11S", "gqa-B11S", "shared-kv"):
        shown = shown[:, :1]  # (B, 1, 1, S)
    elif layout == "1S":
        shown = shown[0, 0]  # (1, S)
    shown[..., 0] = True
    shown[..., 1] = False
    if shown.dim() == 4:
        shown[-1] = False  # the last batch element: no key at all
    mask = shown if kind == "bool" else torch.zeros(shown.shape).masked_fill(~shown, -math.inf)
    ok = shown.expand(B, Hq, T, S)
    k[..., 1, 2] = math.nan  # key 1: hidden everywhere
    v[..., 0, 0] = math.inf  # key 0: shown wherever a row has keys
    q[0, 0, 1, 3] = math.nan
    q[-1, 0, 2, 3] = math.nan
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    has_key = ok.any(-1)  # (B, Hq, T)
    assert (out[~has_key] == 0).all()
    assert out[has_key].isnan().all()  # key 0 is shown to every row that has keys
    # the same with key 0 finite: exact, and the NaN query rows alone are NaN
    v[..., 0, 0] = 1.0
    kk, vv = (  # (B, Hq, S, D): each query head's keys and values, key 1 (hidden) zeroed
        t.nan_to_num(0.0).repeat_interleave(Hq // G, dim=1).expand(B, Hq, S, D) for t in (k, v)
    )
    want = _golden(q.nan_to_num(0.0), kk, vv, ok)
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    bad_q = torch.zeros(B, Hq, T, dtype=torch.bool)
    bad_q[0, 0, 1] = True
    bad_q[-1, 0, 2] = True
    hit = bad_q & has_key
    assert out[hit].isnan().all()
    assert (out[~has_key] == 0).all()
    torch.testing.assert_close(out[~hit].double(), want[~hit], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [nonfinite.KEYS_IN_PLACE_MAX_T, nonfinite.KEYS_IN_PLACE_MAX_T + 1])
def test_a_key_mask_of_many_rows_takes_its_copies(route, T):
    """Up to ``KEYS_IN_PLACE_MAX_T`` query rows a bool key mask runs on k and v as they are and
    the rows a hidden NaN reached are computed again; past it (a prompt, whose every row a hidden
    NaN reaches) the hidden keys are zeroed in copies. Both give the float64 math's rows."""
    S = 23
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, T, D, generator=g)
    k, v = (torch.randn(1, 2, S, D, generator=g) for _ in range(2))
    shown = torch.ones(1, 1, 1, S, dtype=torch.bool)
    shown[..., 5] = False
    k[..., 5, 1], v[..., 5, 2] = math.nan, math.inf
    with torch.no_grad():
        call = AttentionCall.build(q, k, v, shown)
        guard = nonfinite.prepare(call)
        out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=shown)
    in_place = route == "fused" and T <= nonfinite.KEYS_IN_PLACE_MAX_T
    assert (guard.check == "keys_in_place") == in_place
    kk, vv = (t.nan_to_num(0.0, 0.0, 0.0) for t in (k, v))
    torch.testing.assert_close(out.double(), _golden(q, kk, vv, shown), rtol=1e-5, atol=1e-6)


# --- range masks: bad keys counted in the output's pass --------------------------------------


@pytest.mark.parametrize("mask", ["causal-T>S", "window", "key-lengths"])
def test_range_masks_count_bad_keys_per_row(route, mask):
    """Masks whose rows see a range of keys (causal, windows, key lengths; the fused pass
    counts a row's bad keys from the range, ``key_counts.ranges``): a NaN/inf key reaches
    exactly the rows whose range holds it, a row whose range is empty is 0 even for a NaN
    query, every other row exact."""
    T, S = {"causal-T>S": (9, 6), "window": (14, 6), "key-lengths": (7, 12)}[mask]
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (T, S, S))
    kw: dict = {}
    if mask == "causal-T>S":
        kw = dict(is_causal=True)
    elif mask == "window":  # row i sees keys [i - 1, i]: rows 7.. see none
        kw = dict(mask_mod=qkv.masks.sliding_window(1))
    else:
        kw = dict(mask_mod=qkv.masks.key_lengths(torch.tensor([0, 5])))  # batch 0: no key
    call = AttentionCall.build(q, k, v, **kw)
    ok = qkv.ops.nonfinite.allowed(call)  # (B, H, T, S)
    want = _golden(q, k, v, ok)
    k[0, 1, 4, 0] = math.nan
    v[1, 2, 2, 3] = math.inf
    q[:, 0, 0, 1] = math.nan  # row 0 of head 0: NaN where it has a key, else 0
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, **kw)
    has_key = ok.any(-1)  # (B, H, T)
    hit = torch.zeros(B, H, T, dtype=torch.bool)
    hit[0, 1] = ok[0, 1, :, 4]
    hit[1, 2] |= ok[1, 2, :, 2]
    hit[:, 0, 0] = True
    hit &= has_key
    assert (out[~has_key] == 0).all()
    assert out[hit].isnan().all()
    torch.testing.assert_close(out[~hit].double(), want[~hit], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("mask", ["causal", "causal-gqa", "window", "key-lengths"])
def test_range_masks_run_on_k_and_v_as_they_are(route, mask, dtype):
    """Without gradient the fused route runs a range mask's kernel on k and v as they are
    (``"ranges_in_place"``, no copies): values past position 40 all NaN and a key entry of inf
    at 30 reach the rows that see them (NaN) and, as a NaN through the kernel's blocks, rows
    that do not (computed again from their range in the output's pass): every row before
    them equals float64 math, rows with no key are 0. The rows that see them are the plain
    math's on the fused route, which computes them again (NaN where the inf key's score is
    +inf or a NaN value is seen, finite where its score is -inf: weight 0), and NaN on the
    others (the cheaper rule)."""
    T, S, Hq = 64, 64, H
    kw: dict = dict(is_causal=True)
    if mask == "causal-gqa":
        Hq, kw = 2 * H, dict(is_causal=True, enable_gqa=True)
    elif mask == "window":
        kw = dict(mask_mod=qkv.masks.sliding_window(8))
    elif mask == "key-lengths":
        kw = dict(mask_mod=qkv.masks.key_lengths(torch.tensor([0, 28])))  # batch 0: no key
    g = torch.Generator().manual_seed(13)
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    call = AttentionCall.build(q, k, v, **kw)
    ok = qkv.ops.nonfinite.allowed(call)  # (B, Hq, T, S)
    kk, vv = (t.repeat_interleave(Hq // H, dim=1) for t in (k, v))
    want = _golden(q, kk, vv, ok)
    v[:, :, 40:] = math.nan
    k[:, :, 30, 2] = math.inf
    with torch.no_grad():
        guard = nonfinite.prepare(AttentionCall.build(q, k, v, **kw))
        out = qkv.scaled_dot_product_attention(q, k, v, **kw)
    assert (guard.check == "ranges_in_place") == (route == "fused")
    bad = torch.zeros(S, dtype=torch.bool)
    bad[30], bad[40:] = True, True
    has_key = ok.any(-1)  # (B, Hq, T)
    hit = (ok & bad).any(-1)  # rows that may attend a bad key
    assert (out[~has_key] == 0).all()
    clean = has_key & ~hit
    assert clean.any()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
    torch.testing.assert_close(out[clean].double(), want[clean], rtol=tol, atol=tol)
    own_kernel = (mask, dtype) == ("window", torch.bfloat16) and bf16_scores.available()
    if route != "fused" or own_kernel:
        # (auto takes tiled's bfloat16 kernel for the window where it runs, which keeps the
        # contract itself; without it, as held to AVX2, the fused pass's rows)
        assert out[hit].isnan().all()
        return
    kk, vv = (t.repeat_interleave(Hq // H, dim=1).double() for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2) / math.sqrt(D)).masked_fill(~ok, -math.inf)
    terms = scores.softmax(-1).unsqueeze(-1) * vv.unsqueeze(-3)  # (B, Hq, T, S, D)
    plain = terms.masked_fill(~ok.unsqueeze(-1), 0.0).sum(-2)  # the keys each row sees
    nan = hit & ~torch.isfinite(plain).all(-1)
    assert out[nan].isnan().all()
    finite = hit & ~nan  # rows that see key 30 only, whose scores there are -inf
    torch.testing.assert_close(out[finite].double(), plain[finite], rtol=tol, atol=tol)


def _every_third(score, b, h, q_idx, kv_idx):  # -inf where (q + kv) % 3 == 0
    return torch.where((q_idx + kv_idx) % 3 == 0, float("-inf"), score)


def _nan_at_key_1(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx == 1, float("nan"), score)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("mods", ["score_mod -inf", "score_mod -inf with sinks", "score_mod nan"])
def test_rows_of_a_score_mod_or_sinks_are_not_computed_again_by_the_plain_scores(
    route, backend, dtype, mods
):
    """The output's fused pass computes again, by the plain scaled scores, the rows a kernel
    may have got wrong (all zero, not finite): not in a call whose rows are other math. A
    score_mod that gives every key of a row ``-inf`` leaves that row with no key: 0, as the
    kernel gives (with sinks too: the sink takes all the weight); one that gives NaN makes
    the row NaN. Both were computed again without the score_mod (v's row; a finite row), found
    by the long property profile (T = S = 1, float64, the ``score_mask`` mod)."""
    g = torch.Generator().manual_seed(2)
    T, S = (4, 1) if "-inf" in mods else (2, 3)
    q = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    mod = _every_third if "-inf" in mods else _nan_at_key_1
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64) if "sinks" in mods else None
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (1, 2, T, S)
    qi, ki = torch.arange(T).view(T, 1), torch.arange(S).view(1, S)
    scores = mod(scores, 0, 0, qi, ki)
    if sinks is not None:
        logits = torch.cat([scores, sinks.view(1, 2, 1, 1).expand(1, 2, T, 1)], -1)
        want = torch.softmax(logits, -1)[..., :S] @ v
    else:
        want = torch.softmax(scores, -1).nan_to_num(0.0) @ v  # rows with no key: 0
        if mods == "score_mod nan":
            want = torch.softmax(scores, -1) @ v  # NaN: every row sees key 1
    q, k, v = (t.to(dtype) for t in (q, k, v))
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(
            q,
            k,
            v,
            score_mod=mod,
            sinks=None if sinks is None else sinks.to(dtype),
            backend=backend,
        )
    if mods == "score_mod nan":
        assert out.isnan().all()
        return
    empty = torch.tensor([True, False, False, True])  # rows 0 and 3: key 0 is -inf
    assert (out[..., empty, :] == 0).all()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


# --- the fused passes and their slow twin ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fused_passes_equal_their_tensor_ops_bit_for_bit(dtype):
    """``nonfinite_rows`` against the tensor ops it replaces: the zeroed copy and its bad rows
    (``nan_to_num`` and ``isfinite``), a key mask's copy (``where``), and the output's rows
    set to NaN or 0, through strided and broadcast layouts."""
    if not nonfinite_rows.available():
        pytest.skip("the fused row passes did not build here")
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 3, 40, 8, generator=g).to(dtype)  # a KV cache's buffer
    src = cache[:, :, :17]  # (2, 3, 17, 8): strided heads
    src[0, 1, 4, 2], src[1, 2, 16, 7], src[1, 0, 0, 0] = math.nan, math.inf, -math.inf
    flags = torch.zeros(2, 3, 17)
    copy = nonfinite_rows.copy_rows(src, zero_nonfinite=True, flags=flags)
    assert torch.equal(copy.view(torch.int8), src.nan_to_num(0.0, 0.0, 0.0).view(torch.int8))
    assert torch.equal(flags, (~torch.isfinite(src).all(-1)).float())
    keep = torch.rand(2, 1, 17, generator=g) < 0.5  # (2, 1, 17): per batch element
    kept = nonfinite_rows.copy_rows(src, zero_nonfinite=False, keep=keep)
    want = torch.where(keep.unsqueeze(-1), src, torch.zeros((), dtype=dtype))
    assert torch.equal(kept.view(torch.int8), want.view(torch.int8))

    base = torch.randn(2, 17, 3, 8, generator=g).to(dtype)  # torch's flash output layout
    out = base.transpose(1, 2)  # (2, 3, 17, 8)
    out[0, 0, 3, 1], out[1, 2, 9, 0] = math.inf, math.nan
    query = torch.randn(1, 3, 17, 5, generator=g).to(dtype)  # broadcast over the batch
    query[0, 1, 2, 4] = math.nan
    torch_kernel = dtype.itemsize >= 4  # what torch's kernel leaves of a bad query: a row of
    if torch_kernel:  # NaN, or of 0 (its scores all NaN), and the pass reads no query row
        out[0, 1, 2], out[1, 1, 2] = math.nan, 0.0
    # (a half row may come out finite: the queries are swept)
    out[1, 0, 6] = 0.0  # a row of zeros: computed again too (a kernel's row of NaN scores)
    key, value = torch.randn(2, 1, 3, 11, 8, generator=g).to(dtype)  # broadcast over the batch
    key = key[..., :5]  # (1, 3, 11, 5); value (1, 3, 11, 8)
    before = out.clone()
    assert nonfinite_rows.check_rows(
        out, query, (query, key, value), 0.5, 1, torch_kernel=torch_kernel
    )
    bad_q = ~torch.isfinite(query).all(-1).expand(2, 3, 17)
    again = (~torch.isfinite(before).all(-1) | (before == 0).all(-1)) & ~bad_q  # (2, 3, 17)
    assert again.sum() == 3 and out[bad_q].isnan().all()
    plain = ((query.double() @ key.double().transpose(-1, -2)) * 0.5).softmax(-1) @ value.double()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
    plain = plain.expand(2, 3, 17, 8)
    torch.testing.assert_close(out[again].double(), plain[again], rtol=tol, atol=tol)
    same = ~bad_q & ~again
    assert torch.equal(out[same].view(torch.int8), before[same].view(torch.int8))
    has_key = torch.rand(2, 1, 17, generator=g) < 0.7
    hits = torch.zeros(2, 3, 17)
    hits[1, 1, 1], hits[0, 2, 5] = 3.0, 1.0
    out = before.clone()
    nonfinite_rows.restore_rows(out, flags=hits, has_key=has_key)
    has = has_key.expand(2, 3, 17)
    assert (out[~has] == 0).all() and out[has & (hits > 0)].isnan().all()
    rest = has & (hits == 0)
    assert torch.equal(out[rest].view(torch.int8), before[rest].view(torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flags", [{}, {"is_causal": True}, {"scale": -0.5}], ids=str)
@pytest.mark.parametrize("T", [1, 16])
def test_a_bad_query_row_is_nan_without_a_sweep_of_the_queries(monkeypatch, route, T, flags, dtype):
    """The pass after a kernel whose rows see every key reads no query in float32 and float64,
    or with the kernel's log-sum-exp (half dtypes in 4 dims): a query row with a NaN or an
    inf makes every score of its row NaN or +-inf, so the kernel's row tells (NaN, or 0, which
    is computed again). Each bad query row comes out NaN, on the first call and on its lane's,
    the other rows the float64 math's: an inf entry against keys of both signs (+inf and -inf
    scores), against a key column of zeros (NaN scores), a -inf entry against positive keys
    (every score -inf: a kernel's empty row), and a NaN."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    g = torch.Generator().manual_seed(11)
    S = 2 * T + 3
    q = torch.randn(2, 3, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k[1, 0, :, 2] = 0.0  # (inf * 0: NaN scores)
    k[1, 1, :, 3] = k[1, 1, :, 3].abs() + 0.5  # (-inf * positive: every score -inf)
    ok = torch.ones(T, S, dtype=torch.bool)
    if flags.get("is_causal"):
        ok = ok.tril()
    scale = flags.get("scale", 1 / math.sqrt(D))
    probs = torch.softmax(((q @ k.transpose(-2, -1)) * scale).masked_fill(~ok, -math.inf), -1)
    want = probs @ v
    bad = torch.zeros(2, 3, T, dtype=torch.bool)
    r = T - 1
    q[0, 0, r, 1] = math.inf  # keys of both signs
    q[1, 0, r, 2] = math.inf  # a column of zeros
    q[1, 1, r, 3] = -math.inf  # keys all positive there
    q[0, 2, 0, 4] = math.nan
    bad[0, 0, r] = bad[1, 0, r] = bad[1, 1, r] = bad[0, 2, 0] = True
    q, k, v = (t.to(dtype) for t in (q, k, v))
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
    with torch.no_grad():
        for _ in range(2):  # the full steps, then the lane
            out = qkv.scaled_dot_product_attention(q, k, v, **flags)
            assert out[bad].isnan().all()
            torch.testing.assert_close(out[~bad].double(), want[~bad], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Dv", [5, 16, 24, 67])
@pytest.mark.parametrize("what", ["clean", "inf", "-inf", "nan", "largest finite", "zero row"])
@pytest.mark.parametrize("at", ["first", "last"])
def test_the_output_check_finds_one_wrong_element_anywhere_in_a_row(what, at, Dv, dtype):
    """The check of the output's rows (vectors of 32 bytes and a scalar tail) finds a NaN, an inf
    of either sign, or a row of zeros at a row's first or last element, in rows of any length,
    and takes the largest finite value for what it is: only a wrong row changes, computed again
    by the plain math (a row of -0 too)."""
    if not nonfinite_rows.available():
        pytest.skip("the fused row passes did not build here")
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (7, 5, 5))
    v = torch.randn(1, 2, 5, Dv, generator=g, dtype=torch.float64)
    want = ((q @ k.transpose(-1, -2)) * 0.5).softmax(-1) @ v  # (1, 2, 7, Dv)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = want.to(dtype)
    out[0, 0, 1] = -0.0  # a row of -0, wrong too; the one under test is (0, 1, 4)
    e = 0 if at == "first" else Dv - 1
    if what == "zero row":
        out[0, 1, 4] = 0.0
    elif what != "clean":
        value = torch.finfo(dtype).max if what == "largest finite" else float(what)
        out[0, 1, 4, e] = value
    before = out.clone()
    assert nonfinite_rows.check_rows(out, q, (q, k, v), 0.5, 1)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
    torch.testing.assert_close(out[0, 0, 1].double(), want[0, 0, 1], rtol=tol, atol=tol)
    rows = ((out != before) | (out.isnan() != before.isnan())).any(-1)  # (1, 2, 7): changed
    if what not in ("clean", "largest finite"):  # computed again: the plain math's row
        torch.testing.assert_close(out[0, 1, 4].double(), want[0, 1, 4], rtol=tol, atol=tol)
    rows[0, 0, 1] = False
    expected = torch.zeros_like(rows)
    expected[0, 1, 4] = what not in ("clean", "largest finite")
    assert torch.equal(rows, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("torch_kernel", [False, True], ids=["other kernel", "torch's kernel"])
def test_a_row_that_may_not_tell_has_its_queries_swept(dtype, torch_kernel):
    """Where an output row may be finite and wrong for a bad query row (another kernel's in any
    dtype; a half row without the kernel's lse: a +inf score), the pass still sweeps the
    queries: a finite output row of a bad query row becomes NaN. Only torch's kernel in float32
    and float64 is trusted to leave that row not finite or all zero."""
    if not nonfinite_rows.available():
        pytest.skip("the fused row passes did not build here")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, D, generator=g).to(dtype) for _ in range(3))
    q[0, 1, 3, 0] = math.inf
    out = torch.randn(1, 2, 6, D, generator=g).to(dtype)  # every row finite
    before = out.clone()
    assert nonfinite_rows.check_rows(out, q, (q, k, v), 0.5, 1, torch_kernel=torch_kernel)
    trusted = torch_kernel and dtype.itemsize >= 4
    assert out[0, 1, 3].isnan().all() != trusted
    out[0, 1, 3] = before[0, 1, 3]
    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))


def test_a_registered_kernel_s_finite_row_of_a_bad_query_comes_out_nan(monkeypatch):
    """A backend that is not torch's may give a bad query row a finite row (here: torch's
    output with a bad query's row set to 0.5): the contract's check sweeps the queries after it and
    the row comes out NaN, the others as they were."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")

    class Finite:
        name, priority, traceable = "finite", -1, False

        def supports(self, call: AttentionCall) -> None:
            return None

        def run(self, call: AttentionCall):
            result = dispatch.get_backend("torch").run(call)
            bad = ~call.query.isfinite().all(-1, keepdim=True)  # (B, H, T, 1)
            out = result.out.nan_to_num(0.5, 0.5, 0.5).masked_fill(bad, 0.5)
            return type(result)(out=out, lse=None)

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, D, generator=g) for _ in range(3))
    q[0, 0, 2, 1] = math.nan
    want = qkv.scaled_dot_product_attention(q, k, v, backend="torch")
    dispatch.register_backend(Finite())
    try:
        for _ in range(2):
            with torch.no_grad():
                got = qkv.scaled_dot_product_attention(q, k, v, backend="finite")
            assert got[0, 0, 2].isnan().all()
            torch.testing.assert_close(got, want, equal_nan=True)
    finally:
        dispatch.unregister_backend("finite")


# --- what a decode-size call dispatches --------------------------------------------------------


def _causal_rows(seed: int, dtype: torch.dtype, T: int):
    """q, k, v ``(2, 3, T, D)``, the key ranges of causal rows (row i sees keys ``[0, i]``: lo
    and hi ``(1, 1, T)``) and the float64 math's output (scale 0.3), all in ``dtype``; skips
    where the fused passes did not build."""
    if not nonfinite_rows.available():
        pytest.skip("the fused row passes did not build here")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    lo = torch.zeros(1, 1, T, dtype=torch.int64)
    hi = torch.arange(1, T + 1).view(1, 1, T)
    ok = torch.arange(T) < hi.unsqueeze(-1)  # (1, 1, T, S)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~ok, -math.inf)
    want = scores.softmax(-1) @ v  # (2, 3, T, D)
    q, k, v, want = (t.to(dtype) for t in (q, k, v, want))
    return q, k, v, lo, hi, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["clean", "query", "empty", "reached", "bad key"])
def test_the_output_pass_with_key_ranges_sweeps_clean_heads_and_finds_one_change(case, dtype):
    """The output's pass with key ranges (``"ranges_in_place"``) sweeps a head whose keys,
    query rows and output rows are all clean, and ranges all non-empty, in one pass that
    writes nothing: one change in one head is found all the same, and only its rows change.
    A NaN query row gives a NaN row; a row with an empty range gives 0; an output row a
    hidden NaN reached (finite query, no bad key in range) is computed again, and so are the
    rows whose range holds a bad key (the math's rows: NaN for a NaN score, finite for a key
    whose scores are all -inf). The flags-alone pass sweeps clean spans the same
    way: flags set before stay set, and a bad element flags its row only."""
    T, S = 6, 6
    q, k, v, lo, hi, want = _causal_rows(5, dtype, T)
    out, keys = want.clone(), torch.zeros(2, 3, S)
    changed = torch.zeros(2, 3, T, dtype=torch.bool)  # rows set to NaN or 0
    again = torch.zeros(2, 3, T, dtype=torch.bool)  # rows computed again
    if case == "query":
        q[1, 2, 3, 5] = math.inf
        changed[1, 2, 3] = True
    elif case == "empty":
        hi[0, 0, 4] = 0
        changed[:, :, 4] = True
    elif case == "reached":
        out[0, 1, 2] = math.nan
        again[0, 1, 2] = True
    elif case == "bad key":  # (flagged only: its rows come out as the math's again)
        keys[1, 0, 3] = 1.0
        again[1, 0, 3:] = True
    nonfinite_rows.restore_rows(out, query=q, ranges=(keys, lo, hi), recompute=(k, v, 0.3, 1))
    same = ~changed & ~again
    assert torch.equal(out[same].view(torch.int16), want[same].view(torch.int16))
    if case in ("reached", "bad key"):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[again].double(), want[again].double(), rtol=tol, atol=tol)
    elif case == "empty":
        assert (out[changed] == 0).all()
    elif case != "clean":
        assert out[changed].isnan().all()

    flags = torch.zeros(2, 3, S)
    flags[0, 2, 1] = 1.0  # set before: stays set
    k[1, 1, 4, 0] = math.nan
    nonfinite_rows.flag_rows(k, flags)
    want_flags = torch.zeros(2, 3, S)
    want_flags[0, 2, 1] = want_flags[1, 1, 4] = 1.0
    assert torch.equal(flags, want_flags)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["clean", "empty", "reached", "zero", "lse", "bad key"])
def test_the_output_pass_with_unflagged_key_ranges_finds_the_rows_from_the_rows(case, dtype):
    """Key ranges without flags (``"ranges_in_place"``, no pass before the kernel): the output's
    pass finds the rows a kernel may have got wrong as for a call without mask, and computes
    them again over their range: a row that is not finite, or all zero, or whose lse is not
    finite; without an lse, in bfloat16, every row of a head whose keys hold a NaN/inf (a
    +inf score gives a finite row there). Rows with an empty range are 0; the others stand,
    to the bit."""
    T = 6
    q, k, v, lo, hi, want = _causal_rows(6, dtype, T)
    out = want.clone()
    lse = None
    empty = torch.zeros(2, 3, T, dtype=torch.bool)  # rows set to 0
    again = torch.zeros(2, 3, T, dtype=torch.bool)  # rows computed again
    if case == "empty":
        hi[0, 0, 4] = 0
        empty[:, :, 4] = True
    elif case == "reached":
        out[0, 1, 2] = math.nan
        again[0, 1, 2] = True
    elif case == "zero":  # as a kernel gives a row whose scores are all NaN or -inf
        out[1, 2, 5] = 0.0
        again[1, 2, 5] = True
    elif case == "lse":
        lse = torch.zeros(2, 3, T)
        lse[1, 0, 3] = math.inf
        again[1, 0, 3] = True
    elif case == "bad key":  # a NaN at key 5, which only row 5 sees (its row NaN, as the
        k[0, 2, 5, 1] = math.nan  # kernel's): float32 leaves every row as it is
        want[0, 2, 5] = out[0, 2, 5] = math.nan
        if dtype == torch.bfloat16:
            again[0, 2] = True
    before = out.clone()
    nonfinite_rows.restore_rows(
        out, query=q, ranges=(None, lo, hi), recompute=(k, v, 0.3, 1), lse=lse
    )
    same = ~empty & ~again
    assert torch.equal(out[same].view(torch.int16), before[same].view(torch.int16))
    assert (out[empty] == 0).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out[again].double(), want[again].double(), rtol=tol, atol=tol, equal_nan=True
    )
    if case in ("reached", "zero", "lse"):
        assert not torch.equal(out[again].double(), before[again].double())


def test_a_decode_size_call_dispatches_the_kernel_and_little_else(monkeypatch):
    """T=1, S=128 without gradient, after the structure's first call: a plain call dispatches
    torch's kernel alone, a causal one two views and the kernel (it sees key 0 only), a key
    mask's the kernel with the mask as it is and a view of the mask's keys (no copies of k
    and v: the rows a hidden NaN/inf reaches are computed again in the fused pass); a causal
    call of T = S (rows hide keys from each other) the kernel alone, on k and v as they are
    as well. The checks run in the fused passes. (Before issue 38's work: 9, 31, 40 and 31
    ops; before the passes in place, the key mask's were the copies of k and v, the kernel and
    the empty rows' factor, the causal call's the flags, the copies and the kernel; until the
    sixth session the causal T = S call's flags of its bad keys, a pass over k and v.)"""
    force_host_reads(monkeypatch, free=False)
    force_native_rows(monkeypatch, on=True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 64, generator=g)
    k, v = (torch.randn(1, 8, 128, 64, generator=g) for _ in range(2))
    keep = torch.ones(1, 1, 1, 128, dtype=torch.bool)
    keep[..., -7:] = False
    kernel = "_scaled_dot_product_flash_attention_for_cpu"
    want = {
        "plain": ({}, [kernel]),
        "causal": (dict(is_causal=True), ["slice", "slice", kernel]),
        # torch's own bool mask to -inf (its first three), the kernel, the mask's row of keys
        "key-mask": (
            dict(attn_mask=keep),
            ["scalar_tensor", "scalar_tensor", "where", kernel, "select"],
        ),
        # the kernel on k and v as they are; the rows it may have got wrong found after it
        "causal T=S": (dict(is_causal=True), [kernel]),
    }
    with torch.no_grad():
        for name, (kw, ops) in want.items():
            qq = k if name == "causal T=S" else q  # (1, 8, 128, 64) queries
            qkv.scaled_dot_product_attention(qq, k, v, **kw)  # plans, guards, the library
            got = _ops(lambda kw=kw, qq=qq: qkv.scaled_dot_product_attention(qq, k, v, **kw))
            assert got == ops, name


# --- plans kept per structure ------------------------------------------------------------------


class _Everything:
    """A backend that takes every call, first in the order, and counts its runs."""

    name, priority, traceable = "everything", -1, False

    def __init__(self) -> None:
        self.runs = 0

    def supports(self, call: AttentionCall) -> None:
        return None

    def run(self, call: AttentionCall):
        self.runs += 1
        return dispatch.get_backend("reference").run(call)


def test_a_kept_plan_is_dropped_when_the_registry_or_autotune_changes(monkeypatch):
    """The plan ``choose`` keeps for a structure gives way to a backend registered after it,
    and comes back when it is unregistered or ``autotune`` forgets its choices."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    q, k, v = (torch.randn(1, 2, 5, D) for _ in range(3))
    call = AttentionCall.build(q, k, v)
    assert call.structure is not None
    before = dispatch.choose(call).backend
    assert dispatch.choose(AttentionCall.build(q, k, v)).backend is before  # kept
    extra = _Everything()
    dispatch.register_backend(extra)
    try:
        assert dispatch.choose(AttentionCall.build(q, k, v)).backend is extra
        qkv.scaled_dot_product_attention(q, k, v)
        assert extra.runs == 1
    finally:
        dispatch.unregister_backend(extra.name)
    assert dispatch.choose(AttentionCall.build(q, k, v)).backend is before
    with torch.enable_grad():  # a gradient wanted: a plan of its own
        qg = q.clone().requires_grad_()
        assert dispatch.choose(AttentionCall.build(qg, k, v)).backend is before
    qkv.autotune.forget()
    assert dispatch.choose(AttentionCall.build(q, k, v)).backend is before


# --- the lane: a decoding step's call, its steps kept (functional.py) --------------------------


class _Steps:
    """Counts the calls that take the full steps (``functional._attend``) instead of a lane,
    the test's own: not those ``auto``'s measurement makes, each naming its backend
    (``autotune.time_whole_calls``), which the test's calls do not."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        monkeypatch.setattr(qkv.functional, "_LANES", {})  # no lane from an earlier test
        full = qkv.functional._attend

        def counted(*args, **kwargs):
            self.count += args[6] == "auto"  # (query, key, value, args, trace, mods, backend)
            return full(*args, **kwargs)

        monkeypatch.setattr(qkv.functional, "_attend", counted)


def _full_steps(q, k, v, **kw):
    """The call by the full steps, never a lane."""
    flags = (kw.get("is_causal", False), kw.get("scale"), kw.get("enable_gqa", False))
    args = (kw.get("attn_mask"), 0.0, *flags)
    return qkv.functional._attend(q, k, v, args, False, (None, None, None), "auto")


def _same_bits(a, b) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and (torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))
    )


# (a head dim that gives each case more numbers out than ``EXACT_HALF_OUTPUTS``: a bfloat16
# call with fewer computes in float32 and keeps no lane, as float16)
DL = 32
_LANE_CASES = {
    # name: (q shape, k/v shape, flags)
    "B2-H3-T1-S37-plain": ((2, 3, 1, DL), (2, 3, 37, DL), {}),
    "B2-H3-T1-S37-causal": ((2, 3, 1, DL), (2, 3, 37, DL), dict(is_causal=True)),
    "B2-H3-T4-S37-causal": ((2, 3, 4, DL), (2, 3, 37, DL), dict(is_causal=True)),
    "B2-H3-T5-S5-causal": ((2, 3, 5, DL), (2, 3, 5, DL), dict(is_causal=True)),
    "B2-H3-T9-S5-causal": ((2, 3, 9, DL), (2, 3, 5, DL), dict(is_causal=True)),
    "H3-T7-S7-causal": ((3, 7, DL), (3, 7, DL), dict(is_causal=True)),
    "B2-H4-G2-T1-S19-gqa": ((2, 4, 1, DL), (2, 2, 19, DL), dict(enable_gqa=True)),
    "B1-kv-broadcast-T2-S9": ((3, 2, 2, DL), (1, 2, 9, DL), {}),
    "H3-T1-S9-unbatched": ((3, 1, DL), (3, 9, DL), {}),
    "T3-S9-two-dims-scale-neg": ((3, DL), (9, DL), dict(scale=-0.7)),
    # bool key masks (..., 1, S): keys 1 and S-1 hidden, the last batch element's every key
    "B2-H3-T1-S37-keymask-B11S": ((2, 3, 1, DL), (2, 3, 37, DL), dict(attn_mask=(2, 1, 1, 37))),
    "B2-H3-T3-S37-keymask-BH1S": ((2, 3, 3, DL), (2, 3, 37, DL), dict(attn_mask=(2, 3, 1, 37))),
    "H3-T1-S9-keymask-1S": ((3, 1, DL), (3, 9, DL), dict(attn_mask=(1, 9))),
    "B2-H4-G2-T1-S19-keymask-gqa": (
        (2, 4, 1, DL),
        (2, 2, 19, DL),
        dict(attn_mask=(2, 4, 1, 19), enable_gqa=True),
    ),
}


_BAD = ["finite", "nan-key", "inf-value", "inf-query", "-inf-key-entry", "inf-key-entry"]
_HIDDEN_BAD = ["nan-hidden-key", "inf-hidden-value"]  # (cases with a mask: a key to hide)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    ("case", "bad"),
    [
        (case, bad)
        for case, (_, _, kw) in _LANE_CASES.items()
        for bad in _BAD + (_HIDDEN_BAD if "attn_mask" in kw else [])
    ],
)
def test_a_lane_gives_the_bits_of_the_full_steps(monkeypatch, route, case, bad, dtype):
    """A call of a kind met before takes its lane where one is kept (not float16, which the CPU
    computes in float32, causal calls of 2 to S - 1 rows, run on their first T keys with rows
    hiding keys from each other, or without the fused check: the full steps then; causal
    calls of T >= S check their rows' ranges of keys), and gives the same
    bits as the full steps, NaN rows included, and the float64 math's values where every input
    is finite."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    qs, ks, kw = _LANE_CASES[case]
    kw = dict(kw)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(qs, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(ks, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    shown = None
    if "attn_mask" in kw:
        shown = torch.rand(kw["attn_mask"], generator=g) < 0.7
        shown[..., 0], shown[..., 1], shown[..., -1] = True, False, False
        if shown.dim() == 4:
            shown[-1] = False  # no key at all: rows of 0
        kw["attn_mask"] = shown
    if bad == "nan-key":
        k[..., 0, 1] = float("nan")
    elif bad == "inf-value":
        v[..., -1, 2] = float("inf")
    elif bad == "inf-query":
        q[..., -1, 0] = float("inf")
    elif bad == "-inf-key-entry":  # a score of -inf: weight 0, as in the plain math
        q = q.abs() + 0.1
        k[..., 0, 3] = float("-inf")
    elif bad == "inf-key-entry":  # a score of +inf: NaN (bf16/fp16: torch's row is finite)
        q = q.abs() + 0.1
        k[..., 0, 3] = float("inf")
    elif bad == "nan-hidden-key":  # hidden everywhere: changes nothing
        k[..., 1, 0] = float("nan")
    elif bad == "inf-hidden-value":
        v[..., -1, 4] = float("inf")
    with torch.no_grad():
        full = _full_steps(q, k, v, **kw)
        steps = _Steps(monkeypatch)
        first = qkv.scaled_dot_product_attention(q, k, v, **kw)
        second = qkv.scaled_dot_product_attention(q, k, v, **kw)
    # causal with 1 < T < S: narrowed to T keys, rows hide keys from each other (no lane)
    hides = kw.get("is_causal", False) and 1 < qs[-2] < ks[-2]
    laned = route == "fused" and dtype != torch.float16 and not hides
    assert steps.count == (1 if laned else 2)
    assert _same_bits(first, full) and _same_bits(second, full)
    if bad == "inf-key-entry" and kw.get("scale", 1.0) > 0:  # every row sees key 0, of score
        # +inf: NaN (0 with no key)
        assert (second.isnan().all(-1) | (second == 0).all(-1)).all() and second.isnan().any()
    if bad in ("finite", "nan-hidden-key", "inf-hidden-value"):
        T, S = q.shape[-2], k.shape[-2]
        ok = torch.ones(T, S, dtype=torch.bool)
        if kw.get("is_causal"):
            ok = ok.tril()
        if shown is not None:
            ok = ok & shown
            k, v = k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)  # hidden: any value
        kk, vv = k, v
        if kw.get("enable_gqa"):
            kk, vv = (t.repeat_interleave(q.shape[-3] // t.shape[-3], -3) for t in (k, v))
        scale = kw.get("scale", 1 / math.sqrt(q.shape[-1]))
        scores = (q.double() @ kk.double().transpose(-2, -1)) * scale
        probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
        want = probs @ vv.double()  # rows with no key: 0
        tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2)
        torch.testing.assert_close(second.double(), want, atol=tol, rtol=tol)


def test_a_lane_holds_while_the_keys_grow_within_their_bucket(monkeypatch):
    """A decoding loop's cache grows by one key a step: the steps of S = 129 hold for every S up
    to 256 (``auto``'s choices are kept per power-of-two bucket), so one call of the loop takes
    the full steps and the rest their lane, each equal to torch's kernel, with a padding mask
    too; S = 257 starts lanes of its own."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    force_native_rows(monkeypatch, on=True)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, D, generator=g)
    k, v = (torch.randn(1, 4, 300, D, generator=g) for _ in range(2))
    pads = torch.rand(1, 1, 1, 300, generator=g) < 0.8  # (1, 1, 1, S): a padding mask
    pads[..., 0] = True
    steps = _Steps(monkeypatch)
    with torch.no_grad():
        for S in range(129, 258):
            out = qkv.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S])
            want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S])
            assert torch.equal(out, want), S
            mask = pads[..., :S].clone()  # (a new mask each step, as a model makes)
            out = qkv.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S], attn_mask=mask)
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k[:, :, :S], v[:, :, :S], attn_mask=mask
            )
            assert torch.equal(out, want), S
    assert steps.count == 4


def test_the_layers_of_a_decoding_step_find_their_lane_by_its_exact_sizes(monkeypatch):
    """A model's layers meet the same sizes in a step: the first finds the lane by its kind
    (sizes by bucket) and the others by the exact sizes, so the kind is made once a step, not
    once a layer; each call gives torch's kernel's bits. A lane that gives way (its check
    cannot take the layout) gives way under every exact size it is found by."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    force_native_rows(monkeypatch, on=True)
    g = torch.Generator().manual_seed(4)
    layers = [tuple(torch.randn(1, 4, n, D, generator=g) for n in (1, 200, 200)) for _ in range(3)]
    steps = _Steps(monkeypatch)
    made = []
    kind = qkv.functional._kind
    monkeypatch.setattr(qkv.functional, "_kind", lambda exact: made.append(1) or kind(exact))
    with torch.no_grad():
        for S in range(129, 161):
            for q, k, v in layers:
                out = qkv.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S])
                want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :S], v[:, :, :S])
                assert torch.equal(out, want), S
    assert steps.count == 1
    assert len(made) == 32 + 2  # a step's first layer, and the first step's steps and second
    lanes = {id(lane) for lane in qkv.functional._LANES.values()}
    assert len(lanes) == 1  # one lane, under its kind and the exact sizes
    (lane,) = set(qkv.functional._LANES.values())
    lane.ok = False  # as when its check cannot take a layout
    with torch.no_grad():
        for q, k, v in layers:
            qkv.scaled_dot_product_attention(q, k[:, :, :160], v[:, :, :160])
    assert steps.count == 1 + 3


def test_a_lane_gives_way_to_a_change_of_registry_autotune_or_gradient(monkeypatch):
    """A kept lane is not taken once a backend is registered (the new backend runs the call),
    while ``QKV_AUTOTUNE`` is changed or ``autotune`` forgets its choices (the steps choose
    again), or when a gradient is wanted (the gradient flows as torch's)."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    force_native_rows(monkeypatch, on=True)
    q, k, v = (torch.randn(1, 2, n, D) for n in (1, 6, 6))
    steps = _Steps(monkeypatch)
    call = lambda: qkv.scaled_dot_product_attention(q, k, v)  # noqa: E731
    with torch.no_grad():
        call(), call()
        assert steps.count == 1
        extra = _Everything()
        dispatch.register_backend(extra)
        try:
            call(), call()
            assert extra.runs == 2
        finally:
            dispatch.unregister_backend(extra.name)
        call(), call()
        assert steps.count == 4  # a new lane after the registry's change
        monkeypatch.setenv("QKV_AUTOTUNE", "on")
        call()
        monkeypatch.setenv("QKV_AUTOTUNE", "off")
        call()
        qkv.autotune.forget()
        call()
        assert steps.count == 7
    qg = q.clone().requires_grad_()
    out = qkv.scaled_dot_product_attention(qg, k, v)
    out.sum().backward()
    qt = q.clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(qt, k, v).sum().backward()
    torch.testing.assert_close(qg.grad, qt.grad)
    assert steps.count == 8


def test_a_kind_whose_check_cannot_take_its_layout_runs_its_kernel_once(monkeypatch):
    """Queries whose last dim has a stride (a view of every other column) are not what the
    fused check takes: the kind's lane gives way to the full steps at its first run and for
    good, so each later call runs torch's kernel once, not once in the lane and again."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    force_native_rows(monkeypatch, on=True)
    monkeypatch.setattr(qkv.functional, "_LANES", {})
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 1, 2 * D, generator=g)[..., ::2]  # (1, 2, 1, D), last stride 2
    k, v = (torch.randn(1, 2, 9, D, generator=g) for _ in range(2))
    kernel = "_safe_softmax"  # (torch's math kernel takes such queries: one softmax a call)
    with torch.no_grad():
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        for _ in range(2):  # the steps, then the lane that gives way
            qkv.scaled_dot_product_attention(q, k, v)
        for _ in range(2):
            ops = _ops(lambda: qkv.scaled_dot_product_attention(q, k, v))
            assert ops.count(kernel) == 1, ops
        torch.testing.assert_close(qkv.scaled_dot_product_attention(q, k, v), want)


# --- the fused passes on both ISA classes this CPU can show --------------------------------------

_PASSES_SCRIPT = r"""
import itertools, sys, torch
from qkv.ops import nonfinite_rows as nr
assert nr.available(), nr._build()[1]
g = torch.Generator().manual_seed(0)
got = {"capability": torch.backends.cpu.get_cpu_capability(), "library": nr._build()[0]._name}
for dtype, E in itertools.product(
    (torch.float32, torch.float64, torch.bfloat16, torch.float16), (8, 40)
):  # E = 40: two vectors of 16 lanes and a tail
    q = torch.randn(2, 3, 2, E, generator=g).to(dtype)
    k, v = (torch.randn(2, 3, 11, E, generator=g).to(dtype) for _ in range(2))
    k[0, 1, 4, 2], v[1, 0, 7, 3], v[1, 2, 9, 0] = float("nan"), float("inf"), float("-inf")
    q[0, 2, 1, 5] = float("inf")
    keep = torch.rand(2, 3, 11, generator=g) < 0.6
    keep[..., 0], keep[..., 4], keep[1, 0, 7] = True, False, False
    keep[1, 1] = False  # no key at all
    out = torch.full((2, 3, 2, E), float("nan")).to(dtype)  # every row computed again
    out[0, 0] = 0.25
    assert nr.keymask_rows(out, q, k, v, keep, scale=0.3, group=1)
    flags = torch.zeros(2, 3, 11)
    copied = nr.copy_rows(k, zero_nonfinite=True, flags=flags)
    restored = nr.restore_rows(out.clone(), query=q, check_out=True, flags=flags[..., :2])
    ranged = torch.full((2, 3, 2, E), float("nan")).to(dtype)  # every row computed again
    lo, hi = torch.tensor([[[0, 3]]]), torch.tensor([[[11, 9]]])  # (1, 1, T): keys [lo, hi)
    clean = torch.zeros(2, 3, 11)  # no key flagged bad
    nr.restore_rows(ranged, query=q, ranges=(clean, lo, hi), recompute=(k, v, 0.3, 1))
    lse = torch.zeros(2, 3, 2)
    lse[1, 2, 0] = float("inf")  # as torch's kernel's for a row that met a +inf score
    unflagged = torch.full((2, 3, 2, E), 0.5).to(dtype)  # rows found from the rows and the lse
    unflagged[0, 1, 1], unflagged[1, 0, 0] = float("nan"), 0.0
    nr.restore_rows(unflagged, query=q, ranges=(None, lo, hi), recompute=(k, v, 0.3, 1), lse=lse)
    by_lse = torch.full((2, 3, 2, E), 0.5).to(dtype)
    assert nr.keymask_rows(by_lse, q, k, v, keep, scale=0.3, group=1, lse=lse)
    got[f"{dtype} {E}"] = (out, copied, flags, restored, ranged, unflagged, by_lse)
    got[f"inputs {dtype} {E}"] = (q, k, v, keep)
torch.save(got, sys.argv[1])
"""


def test_the_fused_passes_give_the_same_bits_on_both_isa_classes(tmp_path):
    """The row passes are built for torch's ISA level (``ops/_native_build.py``): under
    ``ATEN_CPU_CAPABILITY=avx2`` (held to AVX2, as on a CPU without AVX-512) they build and give
    the same bits as this CPU's own build: the key mask's and the key ranges' rows computed
    again (float32 rows by vectorized fused multiply-adds whose order no vector width
    changes; head dims of 8 and 40, a tail and two vectors of 16 lanes; a hidden NaN and a
    shown inf, a NaN query row, a row with no key), the same found without flags from the
    rows and a kernel's lse, the zeroed copies with their flags, and the output's pass."""
    if not nonfinite_rows.available():
        pytest.skip(f"the fused row passes did not build here: {nonfinite_rows._build()[1]}")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2: torch cannot be held to it")
    runs = []
    for capability in ("", "avx2"):
        path = tmp_path / f"passes-{capability or 'own'}.pt"
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
        if not capability:
            env.pop("ATEN_CPU_CAPABILITY")
        subprocess.run(
            [sys.executable, "-c", _PASSES_SCRIPT, str(path)], env=env, check=True, timeout=600
        )
        runs.append(torch.load(path))
    own, avx2 = runs
    assert avx2["capability"] == "AVX2" and "_avx2_" in avx2["library"]
    dtypes = ("torch.float32", "torch.float64", "torch.bfloat16", "torch.float16")
    for name in (f"{dtype} {E}" for dtype in dtypes for E in (8, 40)):
        for a, b in zip(own[name], avx2[name]):
            assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()), name
            assert torch.equal(a.nan_to_num(0.0, 7.0, -7.0), b.nan_to_num(0.0, 7.0, -7.0)), name
        out = own[name][0]
        assert (out[1, 1] == 0).all() and out[0, 2, 1].isnan().all(), name  # no key; bad query
        assert (out[0, 0] == 0.25).all(), name  # a finite row stands as it is
        unflagged, by_lse = own[name][5], own[name][6]
        assert (unflagged[0, 0] == 0.5).all() and (by_lse[0, 0] == 0.5).all(), name
        assert (by_lse[1, 1] == 0).all() and by_lse[0, 2, 1].isnan().all(), name
        assert (unflagged[1, 2, 0] != 0.5).any() and (by_lse[1, 2, 0] != 0.5).any(), name
        # batch 0, head 1: its NaN key is hidden, so its rows are the visible keys' attention
        q, k, v, keep = (t[0, 1] for t in own["inputs " + name])  # (T, D), (S, D), (S, D), (S,)
        scores = (q.double() @ k.double().nan_to_num(0.0).T * 0.3).masked_fill(~keep, -math.inf)
        want = torch.softmax(scores, -1) @ v.double().nan_to_num(0.0)  # (T, D)
        tol = 1e-6 if name.split()[0] in ("torch.float32", "torch.float64") else 1e-2
        torch.testing.assert_close(out[0, 1].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_key_masks_pass_reads_the_kernels_lse_instead_of_the_keys(dtype):
    """In half dtypes torch's kernel gives a finite row for a visible key of score +inf, so the
    key mask's pass computes again the rows whose log-sum-exp (the kernel's) is not finite,
    and without one every row of a head whose keys hold a NaN/inf (a scan of k, which cost
    a bf16 step over 4096 keys 1.5x torch's). Here the "kernel's" rows are 0.25: with the lse
    only its non-finite row is computed again; without, the rows of the head with the bad key."""
    if not nonfinite_rows.available():
        pytest.skip(f"the fused row passes did not build here: {nonfinite_rows._build()[1]}")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 3, 8, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 11, 8, generator=g).to(dtype) for _ in range(2))
    k[0, 0, 4, 0] = math.nan  # head 0: a bad key, hidden
    keep = torch.ones(1, 2, 11, dtype=torch.bool)
    keep[..., 4] = False
    scores = (q.double() @ k.double().nan_to_num(0.0).transpose(-1, -2) * 0.3).masked_fill(
        ~keep.unsqueeze(-2), -math.inf
    )
    plain = torch.softmax(scores, -1) @ v.double()  # (1, 2, 3, 8)
    lse = torch.zeros(1, 2, 3)
    lse[0, 1, 2] = math.inf  # as the kernel's for a row that met a +inf score
    with_lse = torch.full((1, 2, 3, 8), 0.25, dtype=dtype)
    assert nonfinite_rows.keymask_rows(with_lse, q, k, v, keep, scale=0.3, group=1, lse=lse)
    again = torch.zeros(1, 2, 3, dtype=torch.bool)
    again[0, 1, 2] = True
    assert (with_lse[~again] == 0.25).all()
    torch.testing.assert_close(with_lse[again].double(), plain[again], atol=1e-2, rtol=1e-2)
    scanned = torch.full((1, 2, 3, 8), 0.25, dtype=dtype)
    assert nonfinite_rows.keymask_rows(scanned, q, k, v, keep, scale=0.3, group=1)
    assert (scanned[0, 1] == 0.25).all()
    torch.testing.assert_close(scanned[0, 0].double(), plain[0, 0], atol=1e-2, rtol=1e-2)


def test_bad_inputs_with_a_key_mask_meet_the_checks_not_the_lane():
    """A key that is not a tensor, or has one dim, with a bool key mask: the lane's kind is not
    formed (it reads the key's length last), so the call's checks say what is wrong."""
    q, v = torch.randn(2, 4, D), torch.randn(2, 4, D)
    mask = torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"key must be a torch\.Tensor, got str"):
        qkv.scaled_dot_product_attention(q, "k", v, attn_mask=mask)
    with pytest.raises(ValueError, match="key must have at least 2 dims"):
        qkv.scaled_dot_product_attention(q, torch.randn(D), v, attn_mask=mask)


@pytest.mark.parametrize("mask", ["key-mask", "causal", "window"])
@pytest.mark.parametrize("extra", ["alibi", "softcap", "sinks"])
def test_passes_in_place_leave_score_mods_and_sinks_to_the_copies(mask, extra):
    """A row computed again in the fused pass has plain scaled scores, so calls with a
    score_mod or sinks keep the zeroed copies' way (found by the property test without
    gradient: a one-row key mask with ALiBi and a hidden NaN key was off by 0.04). With a
    NaN/inf key, the rows that may attend it are NaN and every other row is the float64
    math's."""
    T, S = (1, 9) if mask == "key-mask" else (12, 12)
    g = torch.Generator().manual_seed(17)
    q = torch.randn(1, 2, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    kw: dict = {}
    ok = torch.ones(T, S, dtype=torch.bool)
    if mask == "key-mask":
        shown = torch.ones(1, 1, 1, S, dtype=torch.bool)
        shown[..., 4] = False
        kw["attn_mask"], ok = shown, ok & shown[0, 0]
        hidden = 4
    elif mask == "causal":
        kw["is_causal"], ok, hidden = True, ok.tril(), S - 1
    else:
        kw["mask_mod"], hidden = qkv.masks.sliding_window(2), S - 1
        ok = ok.tril() & ~ok.tril(-3)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (1, 2, T, S)
    sink = None
    if extra == "alibi":
        slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
        kw["score_mod"] = qkv.masks.alibi(slopes)
        i, j = torch.arange(T)[:, None] + (S - T), torch.arange(S)[None]
        scores = scores + slopes[:, None, None] * (j - i).to(torch.float64)
    elif extra == "softcap":
        kw["score_mod"] = qkv.masks.softcap(2.0)
        scores = 2.0 * torch.tanh(scores / 2.0)
    else:
        sink = torch.tensor([0.3, -0.2], dtype=torch.float64)
        kw["sinks"] = sink
    scores = scores.masked_fill(~ok, -math.inf)
    if sink is not None:  # a key with no value joins each row's softmax
        scores = torch.cat([scores, sink[None, :, None, None].expand(1, 2, T, 1)], -1)
    probs = torch.softmax(scores, -1)[..., :S]
    want = probs @ v  # (1, 2, T, D)
    k[..., hidden, 0], v[..., hidden, 1] = math.nan, math.inf
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, **kw)
    sees = ok[:, hidden]  # (T,): the rows that may attend the bad key (causal: the last)
    assert out[..., sees, :].isnan().all()
    torch.testing.assert_close(out[..., ~sees, :], want[..., ~sees, :])


@pytest.mark.parametrize("mask", ["key-mask", "causal"])
def test_a_scale_that_overflows_masked_inference_raises_as_before(mask):
    """A scale that overflows the scores keeps the copies' way (``_recomputable``) and its
    refusal naming the overflow, with a key mask or a range mask, without gradient; a scale
    the dtype holds runs in place."""
    g = torch.Generator().manual_seed(0)
    q = 10 * torch.randn(1, 2, 1 if mask == "key-mask" else 5, 4, generator=g)
    k = 10 * torch.randn(1, 2, 5, 4, generator=g)  # q . k * 1e38: past float32's 3.4e38
    v = torch.randn(1, 2, 5, 4, generator=g)
    kw: dict = dict(is_causal=True)
    if mask == "key-mask":
        shown = torch.ones(1, 1, 1, 5, dtype=torch.bool)
        shown[..., 2] = False
        kw = dict(attn_mask=shown)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"scaled scores overflow: scale=1e\+38"):
            qkv.scaled_dot_product_attention(q, k, v, scale=1e38, **kw)
        guard = nonfinite.prepare(AttentionCall.build(q, k, v, scale=1e38, **kw))
        assert guard.check not in ("keys_in_place", "ranges_in_place")
        guard = nonfinite.prepare(AttentionCall.build(q, k, v, scale=0.5, **kw))
        in_place = "keys_in_place" if mask == "key-mask" else "ranges_in_place"
        assert guard.check == (in_place if nonfinite_rows.available() else guard.check)


# --- a module's decoding step keeps its lane (functional.KeptLane) --------------------------------


def _decode(mha, prompt, xs, cache_len=48):
    """The outputs of ``mha`` decoding ``xs`` one position a step after ``prompt``."""
    cache = mha.new_cache(prompt.shape[0], cache_len, dtype=prompt.dtype)
    mha(prompt, cache=cache)
    return [mha(xs[:, i : i + 1], cache=cache) for i in range(xs.shape[1])], cache


class _UsualCalls:
    """Counts a module's attention calls made the usual way (``functional``'s entry)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        monkeypatch.setattr(qkv.functional, "_LANES", {})  # no lane from an earlier test
        usual = qkv.nn.attention.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.count += 1
            return usual(*args, **kwargs)

        monkeypatch.setattr(qkv.nn.attention, "scaled_dot_product_attention", counted)


@pytest.mark.parametrize("G", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_modules_decoding_step_keeps_its_lane_to_the_usual_ways_bits(
    monkeypatch, route, dtype, G
):
    """``MultiHeadAttention`` decoding a token a step keeps its call's lane
    (``functional.KeptLane``), with grouped-query heads too: over 36 steps (6 to 41 keys:
    buckets 8, 16, 32 and 64) the usual way runs at each bucket's first step only (every step
    without the fused check, which the lane needs), and every step gives the bits of the same
    module without a kept lane, and of torch's kernel on the cache."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    torch.manual_seed(0)
    # (4 heads of 16: more numbers out a step than ``EXACT_HALF_OUTPUTS``, see ``DL``)
    mha = qkv.MultiHeadAttention(64, 4, num_kv_heads=G).to(dtype).eval()
    prompt, xs = torch.randn(2, 5, 64, dtype=dtype), torch.randn(2, 36, 64, dtype=dtype)
    usual = _UsualCalls(monkeypatch)
    with torch.no_grad():
        kept, cache = _decode(mha, prompt, xs)
        assert usual.count == 1 + (4 if route == "fused" else 36)  # the prompt, and the steps
        q = mha._project(xs[:, -1:], xs[:, -1:], xs[:, -1:])[0]  # (2, 4, 1, 16)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, cache.keys, cache.values, enable_gqa=G != 4
        )
        assert _same_bits(kept[-1], mha._output(want.transpose(1, 2).reshape(2, 1, 64)))
        monkeypatch.setattr(qkv.functional.KeptLane, "run", lambda *args: None)
        plain, _ = _decode(mha, prompt, xs)
    assert usual.count == (5 if route == "fused" else 37) + 1 + 36
    assert all(_same_bits(a, b) for a, b in zip(kept, plain))


def test_a_kept_lane_gives_way_to_gradient_capture_autocast_registry_and_dropout(monkeypatch):
    """The kept lane is not taken where the usual way would not take a lane: a gradient
    wanted (it flows), a capture recording the weights (every step recorded), autocast (the
    step in bfloat16), a backend registered (it runs the step), dropout in training. A NaN in a
    cached key every row sees is the lane's check's: the rows NaN, as the usual way gives
    them."""
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    force_native_rows(monkeypatch, on=True)
    torch.manual_seed(1)
    mha = qkv.MultiHeadAttention(16, 2, dropout=0.5).eval()
    prompt, xs = torch.randn(1, 4, 16), torch.randn(1, 3, 16)
    usual = _UsualCalls(monkeypatch)
    cache = mha.new_cache(1, 32)
    step = lambda i: mha(xs[:, i : i + 1], cache=cache)  # noqa: E731
    with torch.no_grad():
        mha(prompt, cache=cache)
        step(0), step(1)
    assert usual.count == 2 and mha._kept_lane.lane is not None
    out = step(2)  # a gradient: the usual way
    assert usual.count == 3 and out.requires_grad
    out.sum().backward()
    assert mha.in_proj_weight.grad is not None
    cache.position = 6
    with torch.no_grad():
        with qkv.capture(mha) as cap:
            step(0), step(1)
        assert usual.count == 5 and len(cap.records) == 2
        assert [r.shape[-1] for r in cap.records] == [7, 8]
        cache.position = 6
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert step(0).dtype == torch.bfloat16
        assert usual.count == 6
        cache.position = 6
        extra = _Everything()
        dispatch.register_backend(extra)
        try:
            step(0)
            assert extra.runs == 1
        finally:
            dispatch.unregister_backend(extra.name)
        cache.position = 6
        step(0), step(1)  # the usual way once (a new registry), then the lane
        assert usual.count == 8
        cache._k[0, 1, 2, 0] = float("nan")  # a key every row sees: head 1's row NaN
        cache.position = 6
        bad = step(0)  # the lane's check finds the row and sets it
        assert usual.count == 8 and mha._kept_lane.lane.ok
        cache.position = 6
        monkeypatch.setattr(qkv.functional.KeptLane, "run", lambda *args: None)
        assert _same_bits(bad, step(0)) and bad.isnan().all() and usual.count == 9
        mha.train()
        torch.manual_seed(5)
        a = step(1)
        cache.position = 7
        torch.manual_seed(5)
        assert _same_bits(a, step(1))  # dropout: the usual way's draws


def test_a_module_with_a_kept_lane_is_copied_and_saved_without_it(tmp_path, monkeypatch):
    """``copy.deepcopy`` and ``torch.save`` of a module that kept its lane copy the module and
    leave the lane behind (the copy keeps its own at its first step), giving the same steps."""
    import copy

    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    force_native_rows(monkeypatch, on=True)
    torch.manual_seed(2)
    mha = qkv.MultiHeadAttention(16, 2).eval()
    prompt, xs = torch.randn(1, 4, 16), torch.randn(1, 5, 16)
    with torch.no_grad():
        want, _ = _decode(mha, prompt, xs)
        assert mha._kept_lane.lane is not None
        twin = copy.deepcopy(mha)
        torch.save(mha, tmp_path / "mha.pt")
        loaded = torch.load(tmp_path / "mha.pt", weights_only=False)
        for other in (twin, loaded):
            assert other._kept_lane is not mha._kept_lane and other._kept_lane.lane is None
            got, _ = _decode(other, prompt, xs)
            assert all(_same_bits(a, b) for a, b in zip(got, want))
            assert other._kept_lane.lane is not None
