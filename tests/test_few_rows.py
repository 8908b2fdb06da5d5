"""float32 attention of a few query rows in one C++ call (``qkv.ops.few_rows``, issue 38).

The kernel is held to the float64 reference by the tolerance policy (its float32 twin the
plain math in float32) on what users pass: grouped and broadcast heads, a module's strided
heads, causal rows, bool key masks, odd sizes, scales of every sign. The NaN/inf contract it
keeps itself is checked to the bit against the same call without the bad entries. It is a
route of the tiled backend (``QKV_FEW_ROWS=off`` turns it off, ``routes.force_few_rows``):
calls run both ways agree, and the lane that later calls of a kind take (``functional._Lane``)
gives the bits of the first call's steps.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference64 import attention64
from routes import force_few_rows

import qkv
from qkv import functional
from qkv.ops import AttentionCall, few_rows
from qkv.testing import assert_tolerance


@pytest.fixture(autouse=True)
def _kernel_or_skip(monkeypatch):
    force_few_rows(monkeypatch, True)


def _inputs(B, H, G, T, S, D, Dv, *, seed=0, strided=False, amp=1.0, kv_batch=None, dtype=None):
    """q (B, H, T, D), k (B?, G, S, D), v (B?, G, S, Dv) float32; ``strided``: views of
    (B, L, heads, E) memory, as a module's heads; ``kv_batch`` 1: keys shared by the batch
    (a stride of 0 where expanded)."""
    g = torch.Generator().manual_seed(seed)
    Bk = B if kv_batch is None else kv_batch

    def draw(b, h, n, e, scale=1.0):
        if strided:
            return (torch.randn(b, n, h, e, generator=g) * scale).transpose(1, 2)
        return torch.randn(b, h, n, e, generator=g) * scale

    q = draw(B, H, T, D, amp)
    k = draw(Bk, G, S, D, amp)
    v = draw(Bk, G, S, Dv)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if kv_batch == 1 and B > 1:
        k, v = k.expand(B, G, S, D), v.expand(B, G, S, Dv)
    return q, k, v


def _allowed(B, T, S, causal, keep):
    ok = torch.ones(B, 1, T, S, dtype=torch.bool)
    if causal:
        ok = ok & torch.ones(T, S, dtype=torch.bool).tril()
    if keep is not None:
        ok = ok & keep.expand(B, 1, 1, S)
    return ok


def _plain(q, k, v, scale, allowed):
    """The plain math in the inputs' dtype: the policy's baseline."""
    H, G = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def _call(q, k, v, mask=None, *, causal=False, scale=None, gqa=None, dropout=0.0, mask_mod=None):
    """The checked call of these arguments (grouped heads where k has fewer)."""
    gqa = k.shape[-3] != q.shape[-3] if gqa is None else gqa
    return AttentionCall.build(
        q, k, v, mask, dropout, causal, scale, gqa, False, mask_mod, None, None
    )


def _check(q, k, v, *, causal=False, keep=None, scale=None):
    """The kernel's output and lse against float64 by the policy; returns the output."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    call = _call(q, k, v, keep, causal=causal, scale=scale)
    assert few_rows.usable(call)
    out, lse = few_rows.attend(call)
    s = call.scale
    allowed = _allowed(B, T, S, causal, keep)
    gold = attention64(q.double(), k.double(), v.double(), scale=s, allowed=allowed)
    assert_tolerance(out, gold, _plain(q, k, v, s, allowed), name="out")
    kk = k.double().repeat_interleave(H // k.shape[1], 1)
    sc = (q.double() @ kk.transpose(-2, -1)) * s
    lse64 = torch.logsumexp(sc.masked_fill(~allowed, float("-inf")), -1)
    none = ~allowed.expand(B, H, T, S).any(-1)
    assert torch.equal(lse.isneginf(), none)
    assert torch.allclose(lse[~none].double(), lse64[~none], rtol=1e-6, atol=1e-5)
    assert (out[none] == 0).all()
    return out


SHAPES = [  # B, H, G, T, S, D, Dv
    (1, 8, 8, 1, 128, 64, 64),  # a decoding step
    (2, 4, 2, 3, 37, 5, 7),  # grouped heads, odd dims
    (1, 2, 1, 4, 3, 80, 33),  # more rows than keys
    (3, 1, 1, 2, 1, 1, 1),  # one key, one dim
    (1, 3, 3, 1, 1000, 17, 130),  # long keys, values wider than four vectors
]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-G{}-T{}-S{}-D{}-Dv{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "keymask"])
def test_kernel_meets_the_policy(shape, causal, masked, dtype):
    B, H, G, T, S, D, Dv = shape
    q, k, v = _inputs(B, H, G, T, S, D, Dv, seed=sum(shape), dtype=dtype)
    keep = None
    if masked:
        keep = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(1)) > 0.3
        keep[0, ..., :] = False  # the first batch element's rows have no key: 0
    _check(q, k, v, causal=causal, keep=keep)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [0.0, -0.7, 3.0, 1e-30])
def test_scales_of_every_sign(scale, dtype):
    q, k, v = _inputs(2, 2, 2, 3, 50, 16, 16, seed=5, amp=2.0, dtype=dtype)
    _check(q, k, v, scale=scale, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_heads_and_keys_shared_by_the_batch(dtype):
    """A module's heads (views of (B, L, H, D) memory) and keys expanded over the batch
    (a batch stride of 0) are read as they lie."""
    q, k, v = _inputs(3, 4, 2, 2, 40, 24, 24, seed=3, strided=True, kv_batch=1, dtype=dtype)
    assert k.stride(0) == 0 and not q.is_contiguous()
    _check(q, k, v)


def test_output_is_a_view_of_rows_by_position():
    """(B, H, T, Dv) over (B, T, H, Dv) memory: a module's merge of its heads is a view."""
    q, k, v = _inputs(2, 4, 4, 3, 20, 8, 8)
    out, _ = few_rows.attend(_call(q, k, v), lse=False)
    assert out.transpose(1, 2).is_contiguous()


def _attend(q, k, v, **kw):
    return qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_bad_key_reaches_only_the_rows_that_attend_it(where, bad, dtype):
    """Causal rows: key 2 is seen by rows 2 and 3 only. With q > 0, an entry of k of -inf
    gives the key a score of -inf: it weighs 0 there, as in the plain math (those rows are
    the call's with the key hidden); any other bad entry makes those rows NaN. Rows 0 and 1
    keep the clean call's bits, and a key the mask hides has no effect at all."""
    q, k, v = _inputs(1, 2, 2, 4, 4, 8, 8, seed=9, dtype=dtype)
    q = q.abs() + 0.1
    clean = _attend(q, k, v, is_causal=True)
    t = (k if where == "k" else v).clone()
    t[:, :, 2, 3] = bad
    kk, vv = (t, v) if where == "k" else (k, t)
    out = _attend(q, kk, vv, is_causal=True)
    keep = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    keep[..., 2] = False
    if where == "k" and bad == -float("inf"):
        assert torch.equal(
            out[:, :, 2:], _attend(q, k, v, attn_mask=keep, is_causal=True)[:, :, 2:]
        )
    else:
        assert out[:, :, 2:].isnan().all()
    assert torch.equal(out[:, :, :2], clean[:, :, :2])
    hidden = _attend(q, kk, vv, attn_mask=keep)
    assert torch.equal(hidden, _attend(q, k, v, attn_mask=keep))


def test_a_row_whose_every_score_is_minus_inf_is_nan():
    """The plain math's softmax of scores all -inf is NaN (a row with no key is 0)."""
    q, k, v = _inputs(1, 1, 1, 1, 5, 4, 4, seed=10)
    q = q.abs() + 0.1
    k = k.clone()
    k[..., 0] = -float("inf")
    assert _attend(q, k, v).isnan().all()


def test_a_bad_query_row_is_nan_unless_it_has_no_key():
    q, k, v = _inputs(2, 1, 1, 2, 6, 4, 4, seed=11)
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[1] = False  # batch element 1: no key
    clean = _attend(q, k, v, attn_mask=keep)
    q = q.clone()
    q[:, 0, 1, 0] = float("inf")
    out = _attend(q, k, v, attn_mask=keep)
    assert out[0, 0, 1].isnan().all() and torch.equal(out[0, 0, 0], clean[0, 0, 0])
    assert (out[1] == 0).all()


def test_the_route_off_gives_the_same_answers(monkeypatch):
    """``QKV_FEW_ROWS=off``: the tiled passes run the call (within the policy of each other)."""
    q, k, v = _inputs(2, 4, 2, 3, 70, 32, 32, seed=2)
    keep = torch.rand(2, 1, 1, 70, generator=torch.Generator().manual_seed(4)) > 0.5
    call = _call(q, k, v, keep, causal=True)
    on = _attend(q, k, v, attn_mask=keep, is_causal=True, enable_gqa=True)
    force_few_rows(monkeypatch, False)
    assert not few_rows.usable(call)

    def hidden():
        raise AssertionError("the kernel was asked for with QKV_FEW_ROWS=off")

    monkeypatch.setattr(few_rows, "_build", hidden)
    for _ in range(2):  # (the second call of the kind: the lane the first call kept declines)
        off = _attend(q, k, v, attn_mask=keep, is_causal=True, enable_gqa=True)
    allowed = _allowed(2, 3, 70, True, keep)
    gold = attention64(q.double(), k.double(), v.double(), allowed=allowed)
    base = _plain(q, k, v, 1 / math.sqrt(32), allowed)
    assert_tolerance(on, gold, base, name="on")
    assert_tolerance(off, gold, base, name="off")


def test_calls_it_does_not_take():
    q, k, v = _inputs(1, 2, 2, 5, 10, 8, 8)  # five rows
    assert not few_rows.usable(_call(q, k, v))
    q1 = q[:, :, :1]
    assert few_rows.usable(_call(q1, k, v))
    assert not few_rows.usable(_call(q1, k, v, torch.zeros(1, 1, 1, 10)))  # a float mask
    mask = torch.ones(1, 2, 1, 10, dtype=torch.bool)  # a mask per head
    assert not few_rows.usable(_call(q1, k, v, mask))
    assert not few_rows.usable(_call(q1, k, v, dropout=0.1))
    assert not few_rows.usable(_call(q1.double(), k.double(), v.double()))
    qg = q1.clone().requires_grad_()
    assert not few_rows.usable(_call(qg, k, v))
    with torch.no_grad():
        assert few_rows.usable(_call(qg, k, v))


@pytest.mark.parametrize("grown", ["views", "concatenated"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "keymask"])
def test_the_lane_gives_the_steps_bits(masked, grown):
    """The first call of a kind takes the steps (the tiled backend runs the kernel); later
    calls, as the cache grows by a key, its lane (the kernel alone, ``few_rows.Runner``):
    the same bits as the kernel run on each call. A cache grown in place gives views of one
    memory; one grown by concatenation (Hugging Face's) new tensors whose strides change with
    the key count, as do a fresh mask's."""
    functional._LANES.clear()
    q, k, v = _inputs(2, 4, 2, 1, 100, 16, 16, seed=7)
    with torch.no_grad():
        for S in (97, 98, 99, 100):
            keep = None
            if masked:
                keep = torch.ones(2, 1, 1, S, dtype=torch.bool)
                keep[1, ..., :5] = False
            ks, vs = k[:, :, :S], v[:, :, :S]
            if grown == "concatenated":
                ks, vs = (
                    torch.cat([ks[:, :, :-1], ks[:, :, -1:]], 2),
                    torch.cat([vs[:, :, :-1], vs[:, :, -1:]], 2),
                )
                assert ks.stride(1) == S * 16
            out = _attend(q, ks, vs, attn_mask=keep, enable_gqa=True)
            assert torch.equal(out, few_rows.attend(_call(q, ks, vs, keep))[0])
    lanes = [lane for lane in functional._LANES.values() if lane.ok]
    assert lanes and all(lane.rows is not None for lane in lanes)


def test_a_module_decodes_by_the_kernel():
    """A MultiHeadAttention decoding step of one token through tiled runs the kernel by its
    kept lane; the steps' outputs match one causal call over the whole sequence."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, backend="tiled").eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        whole = mha(x, is_causal=True)
        cache = mha.new_cache(2, 8)
        steps = torch.cat([mha(x[:, i : i + 1], cache=cache) for i in range(6)], 1)
    assert mha._kept_lane.lane is not None and mha._kept_lane.lane.rows is not None
    torch.testing.assert_close(steps, whole, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 3),
    G=st.integers(1, 3),
    group=st.integers(1, 3),
    T=st.integers(1, few_rows.MAX_ROWS),
    S=st.integers(1, 70),
    D=st.integers(1, 40),
    Dv=st.integers(1, 70),
    causal=st.booleans(),
    masked=st.booleans(),
    strided=st.booleans(),
    amp=st.sampled_from([0.1, 1.0, 4.0]),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(DTYPES),
)
def test_property_against_float64(
    B, G, group, T, S, D, Dv, causal, masked, strided, amp, seed, dtype
):
    """Drawn sizes, layouts, masks and dtypes: the kernel meets the policy, rows without a key
    are 0."""
    q, k, v = _inputs(
        B, G * group, G, T, S, D, Dv, seed=seed, strided=strided, amp=amp, dtype=dtype
    )
    keep = None
    if masked:
        keep = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(seed)) > 0.4
    _check(q, k, v, causal=causal, keep=keep)


_ODD_SIZES = """
import torch
from qkv.ops import AttentionCall, few_rows
SIZES = [(1, 1, 1, 4, 1, 1, 1), (2, 6, 3, 4, 2, 1, 129), (1, 1, 1, 1, 4099, 3, 2)]
for B, H, G, T, S, D, Dv in SIZES:
    for causal in (False, True):
        q, k, v = torch.randn(B, H, T, D), torch.randn(B, G, S, D), torch.randn(B, G, S, Dv)
        gqa = G != H
        call = AttentionCall.build(q, k, v, None, 0.0, causal, None, gqa, False, None, None, None)
        out, lse = few_rows.attend(call)
        assert out.isfinite().all() and lse.isfinite().all()
print("ok")
"""


def test_odd_sizes_do_not_crash_the_process():
    """Sizes at the kernel's edges (one key, one dim, a partial last vector, more rows than
    keys) run in a subprocess: a stray read or write would kill it, not the suite."""
    run = subprocess.run(
        [sys.executable, "-c", _ODD_SIZES], check=False, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.parametrize("backend", ["tiled", "torch"])
def test_threads_sharing_a_lane_get_their_own_answers(backend):
    """Two threads run calls of one kind at once, so both take its lane (tiled's kernel, or
    torch's kernel and the contract's fused pass): each thread packs its own arguments, and
    every answer is its own call's, to the bit."""
    import threading

    functional._LANES.clear()
    g = torch.Generator().manual_seed(12)
    calls = [tuple(torch.randn(1, 8, n, 64, generator=g) for n in (1, 200, 200)) for _ in range(4)]
    with torch.no_grad():
        want = [_attend_by(backend, *c) for c in calls]
    bad: list[int] = []

    def work(i: int) -> None:
        with torch.no_grad():
            for _ in range(300):
                j = (i + _) % len(calls)
                if not torch.equal(_attend_by(backend, *calls[j]), want[j]):
                    bad.append(j)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns between any two bytecodes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not bad


def _attend_by(backend, q, k, v):
    return qkv.scaled_dot_product_attention(q, k, v, backend=backend)


def test_each_thread_packs_its_own_arguments():
    """A lane's packed arguments are per thread: another thread's call writes its pointers
    into its own array, never into the one this thread's call is about to pass (ctypes lets
    go of the GIL for the call)."""
    import threading

    runner = few_rows.Runner()
    q, k, v = _inputs(1, 2, 2, 1, 30, 8, 8)
    runner(q, k, v, None, False, 0.5)
    mine = runner._state.args
    theirs = []
    q2, k2, v2 = _inputs(1, 2, 2, 1, 30, 8, 8, seed=1)

    def other() -> None:
        runner(q2, k2, v2, None, False, 0.5)
        theirs.append(runner._state.args)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert theirs and theirs[0] is not mine
    assert mine[0] == q.data_ptr() and theirs[0][0] == q2.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "keymask"])
def test_half_is_the_float32_result_rounded_once(masked, dtype):
    """Half inputs are widened exactly as they are read and the arithmetic is float32's: the
    output is the float32 kernel's on the widened inputs, rounded once, to the bit."""
    q, k, v = _inputs(2, 4, 2, 3, 77, 40, 24, seed=21, dtype=dtype, strided=True)
    keep = None
    if masked:
        keep = torch.rand(2, 1, 1, 77, generator=torch.Generator().manual_seed(2)) > 0.3
    half, lse = few_rows.attend(_call(q, k, v, keep, causal=True))
    wide, wide_lse = few_rows.attend(_call(q.float(), k.float(), v.float(), keep, causal=True))
    assert half.dtype == dtype
    assert torch.equal(half, wide.to(dtype))
    assert torch.equal(lse, wide_lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inputs_whose_last_dim_has_a_stride(dtype):
    """A transposed query, values expanded along their last dim (a stride of 0), 3-d inputs:
    copied or viewed as needed, the same answers."""
    g = torch.Generator().manual_seed(30)
    q = torch.randn(2, 3, 16, 2, generator=g).to(dtype).transpose(-1, -2)  # (2, 3, 2, 16)
    k = torch.randn(2, 3, 9, 16, generator=g).to(dtype)
    v = torch.randn(2, 3, 9, 1, generator=g).to(dtype).expand(2, 3, 9, 5)
    assert q.stride(-1) != 1 and v.stride(-1) == 0
    out = _check(q, k, v)
    flat = few_rows.attend(_call(q.reshape(6, 2, 16), k.reshape(6, 9, 16), v.reshape(6, 9, 5)))
    assert torch.equal(flat[0], out.reshape(6, 2, 5))


def test_a_query_broadcast_over_a_batch_of_keys():
    """q with a batch of 1 against keys of a batch of 3 (and heads broadcast: one key head for
    all, without GQA): torch's broadcasting, the same answers as the plain math."""
    g = torch.Generator().manual_seed(40)
    q = torch.randn(1, 4, 2, 8, generator=g)
    k, v = torch.randn(3, 1, 11, 8, generator=g), torch.randn(3, 1, 11, 6, generator=g)
    call = _call(q, k, v, gqa=False)
    assert few_rows.usable(call)
    out, _ = few_rows.attend(call)
    assert out.shape == (3, 4, 2, 6)
    qq = q.expand(3, 4, 2, 8).double()
    kk, vv = k.expand(3, 4, 11, 8).double(), v.expand(3, 4, 11, 6).double()
    gold = attention64(qq, kk, vv)
    allowed = torch.ones(3, 1, 2, 11, dtype=torch.bool)
    assert_tolerance(out, gold, _plain(qq.float(), kk.float(), vv.float(), 8**-0.5, allowed))
    for _ in range(3):  # the steps, then the lane (which declines this layout: the steps)
        assert torch.equal(_attend(q, k, v), out)


RANGES = {  # name -> (mask_mod, is_causal)
    "causal-bottom-right": (qkv.masks.causal(align="bottom_right"), False),
    "window": (qkv.masks.sliding_window(5, align="bottom_right"), False),
    "window-both-sides": (qkv.masks.sliding_window(3, 2), False),
    "window-and-causal": (qkv.masks.sliding_window(6), True),
    "key-lengths": (qkv.masks.key_lengths(torch.tensor([9, 0, 20])), False),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "keymask"])
@pytest.mark.parametrize("T", [1, 3, 4])
@pytest.mark.parametrize("name", list(RANGES))
def test_rows_that_attend_ranges_of_keys(name, T, masked, dtype):
    """A mask_mod of ranges (a decoding step's bottom-right causal mask over its cache, a
    sliding window, key lengths; with a bool key mask too): each row attends its range, held
    to float64 by the policy; a row whose range is empty, or whose keys the mask all hides,
    is 0 (key length 0)."""
    mask_mod, causal = RANGES[name]
    B, H, G, S = 3, 4, 2, 20
    q, k, v = _inputs(B, H, G, T, S, 12, 10, seed=T + len(name), dtype=dtype)
    keep = None
    if masked:
        keep = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(3)) > 0.3
    call = _call(q, k, v, keep, causal=causal, mask_mod=mask_mod)
    assert few_rows.usable(call)
    out, lse = few_rows.attend(call)
    allowed = call.mask().expand(B, 1, T, S)  # (the masks of this test: one for all heads)
    gold = attention64(q.double(), k.double(), v.double(), allowed=allowed)
    assert_tolerance(out, gold, _plain(q, k, v, 12**-0.5, allowed), name="out")
    none = ~allowed.expand(B, H, T, S).any(-1)
    assert (out[none] == 0).all() and lse[none].isneginf().all()
    got = _attend(q, k, v, attn_mask=keep, is_causal=causal, mask_mod=mask_mod, enable_gqa=True)
    assert torch.equal(got, out)


def test_masks_that_are_not_ranges_are_left_to_the_other_ways():
    q, k, v = _inputs(1, 2, 2, 2, 10, 8, 8)
    doc = qkv.masks.document(torch.tensor([[0, 1]]), torch.tensor([[0] * 5 + [1] * 5]))
    assert not few_rows.usable(_call(q, k, v, mask_mod=doc))
    assert not few_rows.usable(_call(q, k, v, mask_mod=lambda b, h, i, j: (i + j) % 2 == 0))
    assert few_rows.usable(_call(q, k, v, mask_mod=qkv.masks.sliding_window(2)))


@pytest.mark.parametrize("causal", [False, True], ids=["window", "window-and-causal"])
@pytest.mark.parametrize("moving", [False, True], ids=["aligned", "offset-per-call"])
def test_a_window_keeps_a_lane_as_the_cache_grows(moving, causal):
    """Calls with one sliding window (a decoding step over a windowed cache) keep the
    kernel's lane too, the rows' ranges made per call: each call's bits are the kernel's on
    that call, whether the window is aligned by the sizes (bottom-right) or carries an offset
    of its own that moves with the cache (transformers' windows, made anew each step)."""
    pytest.importorskip("transformers")
    from qkv.integrations.transformers.masks import _FixedWindow

    functional._LANES.clear()
    q, k, v = _inputs(2, 4, 2, 2, 100, 16, 16, seed=8)
    keep = torch.ones(2, 1, 1, 100, dtype=torch.bool)
    keep[0, ..., 90:93] = False
    with torch.no_grad():
        for S in (70, 71, 72, 90, 100):
            if moving:  # a query at position S - 2 + i sees keys [pos - 6, pos]
                mod = _FixedWindow(6, 0, S - 2)
            else:
                mod = qkv.masks.sliding_window(6, align="bottom_right")
            ks, vs, m = k[:, :, :S], v[:, :, :S], keep[..., :S]
            out = _attend(q, ks, vs, attn_mask=m, mask_mod=mod, is_causal=causal, enable_gqa=True)
            call = _call(q, ks, vs, m, mask_mod=mod, causal=causal)
            assert torch.equal(out, few_rows.attend(call)[0])
    lanes = [lane for lane in functional._LANES.values() if lane.ok]
    assert lanes and all(lane.rows is not None for lane in lanes)
    assert few_rows.window_kind(mod) is not None
    assert few_rows.window_kind(qkv.masks.document(torch.zeros(1, 2, dtype=torch.int64))) is None
