"""A visible key holding NaN/inf, against the plain math (issue 38's closing note of
2026-11-27, fifth session): what a kernel gives such a row is not always what the math does.

Measured on torch 2.13's CPU flash kernel (every dtype) and tiled's kernels, with q > 0:

* a row whose every visible score is NaN or ``-inf`` (each key it sees holds a ``-inf``, or a
  NaN, in k) came out 0, as a row with no key does; the plain math gives NaN (0 / 0);
* in bfloat16 and float16, a key whose score is ``+inf`` gave its rows finite values, neither
  NaN nor anything the math gives (from 16 keys on);
* a key whose scores are all ``-inf`` among finite ones weighs 0: the math's row is finite.

So qkv's output of such a row was 0 or garbage, silently, where the plain math is NaN. Now:

* every route, with or without a gradient: NaN wherever the plain math (float64) is NaN;
* every route: a finite row of the plain math is that row, or NaN where the row sees a bad
  key (the routes that flag bad keys from k set those rows NaN, the cheaper rule);
* the fused passes on the CPU (no gradient; no mask, bool key masks of a few rows, range
  masks) give the plain math's rows exactly as it does: a ``-inf`` key's finite rows too
  (not where a kernel keeps the contract itself: tiled's bfloat16 kernel).
"""

from __future__ import annotations

import math

import pytest
import torch
from routes import force_host_reads, force_native_rows

import qkv
from qkv.ops import torch_sdpa

H, D = 2, 8
TOL = {
    torch.float64: {},
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},  # (tests/test_cuda.py's)
}
# where the bad entries go: (tensor, value, which visible keys: "one" or "all")
BAD = {
    "k+inf": ("k", math.inf, "one"),
    "k-inf": ("k", -math.inf, "one"),
    "k-inf-all": ("k", -math.inf, "all"),
    "k-nan": ("k", math.nan, "one"),
    "k-nan-all": ("k", math.nan, "all"),
    "v+inf": ("v", math.inf, "one"),
    "v-nan": ("v", math.nan, "one"),
}
# mask name -> (T, S): T = 3 takes a bool key mask in place, T = 70 its copies
MASKS = {
    "none": (3, 40),
    "keys-bool": (3, 40),
    "keys-bool-long": (70, 40),
    "keys-float": (3, 40),
    "causal": (40, 40),
    "window": (40, 40),
}
EXACT = ("none", "keys-bool", "causal", "window")  # the fused passes' masks


@pytest.fixture(params=["cpu-reads", "no-reads", "no-reads-fused"])
def contract_way(request, monkeypatch):
    """Every way of keeping the contract (tests/routes.py): checked by reads on the host,
    tensor ops only, and the CPU's fused row passes."""
    force_host_reads(monkeypatch, free=request.param == "cpu-reads")
    force_native_rows(monkeypatch, on=request.param == "no-reads-fused")
    return request.param


def _case(mask: str, bad: str, dtype: torch.dtype, seed: int = 0):
    """q > 0 (so an infinite entry gives every row the same infinite score), k, v, the call's
    mask arguments, which pairs a row sees (T, S), and the bad keys (S,)."""
    T, S = MASKS[mask]
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(1, H, T, D, generator=g, dtype=torch.float64) + 0.1
    k, v = torch.randn(2, 1, H, S, D, generator=g, dtype=torch.float64)
    sees = torch.ones(T, S, dtype=torch.bool)
    kwargs: dict = {}
    if mask.startswith("keys"):
        keep = torch.ones(S, dtype=torch.bool)
        keep[S // 2 : S // 2 + 6] = False
        sees = sees & keep
        if mask == "keys-float":
            bias = torch.zeros(S, dtype=torch.float64).masked_fill(~keep, -math.inf)
            kwargs["attn_mask"] = bias.to(dtype)
        else:
            kwargs["attn_mask"] = keep
    elif mask == "causal":
        kwargs["is_causal"] = True
        sees = torch.ones(T, S, dtype=torch.bool).tril()
    elif mask == "window":
        kwargs["mask_mod"] = qkv.masks.sliding_window(5)
        i, j = torch.arange(T)[:, None], torch.arange(S)[None, :]
        sees = (j <= i) & (j >= i - 5)
    which, value, spread = BAD[bad]
    visible = sees.any(0)  # keys some row sees
    if mask in ("causal", "window"):
        keys = torch.arange(S) if spread == "all" else torch.tensor([7])
    else:
        keys = visible.nonzero().flatten() if spread == "all" else visible.nonzero()[3]
    (k if which == "k" else v)[0, 0, keys, 2] = value  # head 0 only
    bad_keys = torch.zeros(S, dtype=torch.bool)
    bad_keys[keys] = True
    return [t.to(dtype) for t in (q, k, v)], kwargs, sees, bad_keys


def _plain(q, k, v, sees):
    """The plain math in float64 over the pairs each row sees; a row that sees no key 0."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    scores = scores.masked_fill(~sees, -math.inf)
    weights = torch.softmax(scores, -1)  # (1, H, T, S): NaN rows where the math is
    terms = weights.unsqueeze(-1) * v.unsqueeze(-3)  # (1, H, T, S, D)
    out = terms.masked_fill(~sees[..., None], 0.0).sum(-2)  # over the keys each row sees
    return torch.where(sees.any(-1)[:, None], out, 0.0)  # a row that sees no key: 0


def _check(got, want, sees, bad_keys, dtype, exact: bool):
    """NaN where the math is; elsewhere the math's row, or (unless ``exact``) NaN on a row that
    sees a bad key."""
    got = got.detach().double()
    nan_want = ~torch.isfinite(want).all(-1)  # (1, H, T): qkv's row not finite is NaN whole
    nan_got = torch.isnan(got).all(-1)
    assert not (nan_want & ~nan_got).any(), "a row the plain math makes NaN is not NaN"
    sees_bad = (sees & bad_keys).any(-1)  # (T,): only head 0 holds the bad keys
    allowed_nan = torch.zeros_like(nan_got)
    if not exact:
        allowed_nan[0, 0] = sees_bad
    finite_want = ~nan_want
    extra = nan_got & finite_want & ~allowed_nan
    assert not extra.any(), f"NaN where the plain math is finite, rows {extra.nonzero().tolist()}"
    keep_rows = finite_want & ~nan_got
    assert torch.isfinite(got[keep_rows]).all()
    torch.testing.assert_close(got[keep_rows], want[keep_rows], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["auto", "torch", "tiled", "reference"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("bad", list(BAD))
def test_a_row_the_plain_math_makes_nan_is_nan_and_a_finite_one_is_the_maths(
    contract_way, bad, mask, backend, dtype
):
    """Inference and a call that wants a gradient, on each way of keeping the contract."""
    (q, k, v), kwargs, sees, bad_keys = _case(mask, bad, dtype)
    want = _plain(q, k, v, sees)
    with torch.no_grad():
        got = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)
    # tiled's bfloat16 kernel keeps the contract itself, by the cheaper rule (auto takes
    # tiled for the window)
    own = dtype == torch.bfloat16 and (backend == "tiled" or (backend, mask) == ("auto", "window"))
    exact = contract_way == "no-reads-fused" and mask in EXACT and not own
    _check(got, want, sees, bad_keys, dtype, exact)
    trained = qkv.scaled_dot_product_attention(
        q.clone().requires_grad_(), k, v, backend=backend, **kwargs
    )
    _check(trained, want, sees, bad_keys, dtype, exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("S", [1, 5, 16, 40, 300])
@pytest.mark.parametrize("way", ["lse", "scan", "gqa"])
def test_a_decoding_step_over_a_cache_of_bad_keys_is_the_plain_maths(monkeypatch, way, dtype, S):
    """One query over S cached keys (the decoding step's lane, ``functional.KeptLane`` and the
    exact kinds' lanes both): a ``+inf`` key (bf16: torch's kernel gave finite rows), every
    key ``-inf`` (0 for the math's NaN), and one ``-inf`` key among finite ones (finite).
    In bf16 the rows are found by the kernel's log-sum-exp (``lse``), or, without torch's
    flash kernel at hand (``scan``) or with grouped key heads (``gqa``), by a scan of the
    keys in the fused pass."""
    if way == "scan":
        monkeypatch.setattr(torch_sdpa, "flash_cpu_available", lambda: False)
    G = 1 if way == "gqa" else H
    for bad in ("k+inf", "k-inf-all", "k-nan-all", "k-inf"):
        g = torch.Generator().manual_seed(1)
        q = (torch.rand(1, H, 1, D, generator=g, dtype=torch.float64) + 0.1).to(dtype)
        k, v = torch.randn(2, 1, G, S, D, generator=g, dtype=torch.float64).to(dtype)
        keys = slice(None) if bad.endswith("all") else slice(S - 1, S)
        k[0, 0, keys, 2] = {"k+inf": math.inf, "k-nan-all": math.nan}.get(bad, -math.inf)
        sees = torch.ones(1, S, dtype=torch.bool)
        want = _plain(q, k.expand(1, H, S, D), v.expand(1, H, S, D), sees)
        for _ in range(3):  # the first call finds the lane, the next ones run it
            with torch.no_grad():
                got = qkv.scaled_dot_product_attention(q, k, v, enable_gqa=way == "gqa")
            _check(got, want, sees, torch.ones(S, dtype=torch.bool), dtype, exact=True)


def test_the_lse_check_sets_nan_exactly_on_rows_whose_output_or_lse_is_not_finite():
    """``nonfinite._restore_output_by_lse`` (CUDA's check of a call without mask, see
    tests/test_cuda.py): NaN on a row whose output or lse is NaN or infinite, every other
    row's bits as they were, a large finite row too; an expanded output is not written."""
    from qkv.ops import nonfinite

    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 3, 5, 8, generator=g).to(torch.bfloat16)
    lse = torch.randn(2, 3, 5, generator=g)
    bad = torch.zeros(2, 3, 5, dtype=torch.bool)
    for idx, value in (((0, 1, 2), math.inf), ((1, 0, 0), math.nan), ((1, 2, 4), -math.inf)):
        lse[idx] = value
        bad[idx] = True
    out[0, 0, 3, 5], out[1, 1, 1, 0] = math.inf, math.nan
    bad[0, 0, 3] = bad[1, 1, 1] = True
    out[0, 2, 0] = 3.0e38  # finite, near bfloat16's largest: its row stays
    before = out.clone()
    got = nonfinite._restore_output_by_lse(out, lse)
    assert torch.equal(got.isnan().all(-1), bad)
    assert torch.equal(got[~bad], before[~bad])
    shared = before[:, :1].expand(2, 3, 5, 8)  # (one row through three heads: not its own)
    again = nonfinite._restore_output_by_lse(shared, lse)
    assert torch.equal(before[:, :1], shared[:, :1])  # (head 0's rows: unwritten)
    want = ~torch.isfinite(shared).all(-1) | ~torch.isfinite(lse)  # (B, H, T)
    assert int(want.sum()) == 6 and torch.equal(again.isnan().all(-1), want)
