"""The fused bfloat16 kernel's lane (``ops/tiled/backend.KernelLane``; issue 38): a bfloat16
call with one sliding window, causal or document mask_mod that the tiled backend ran by the
fused kernel keeps its kind's lane, and later calls of the kind run the kernel on the kept key
ranges (and ids) without the steps around it. Each such call gives the bits of the full steps,
NaN/inf rows included; the lane follows the switches and the measured way, takes only its key
count and window offset or its document ids as they were, and keeps nothing of the calls that
time a kind's ways.

Where the kernel does not run (no AVX512-BF16 or AMX, or a float32 half route), no lane is
kept and every call takes the steps: the tests say so rather than skip.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import autotune, dispatch, masks
from qkv.ops import AttentionCall, reference
from qkv.ops.tiled import backend as tiled_backend
from qkv.ops.tiled import route

D = 16


class _Steps:
    """Counts the calls that take the full steps (``functional._attend``), of any backend."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        monkeypatch.setattr(qkv.functional, "_LANES", {})  # no lane from an earlier test
        full = qkv.functional._attend

        def counted(*args, **kwargs):
            self.count += 1
            return full(*args, **kwargs)

        monkeypatch.setattr(qkv.functional, "_attend", counted)


_ATTEND = qkv.functional._attend  # (the steps, not counted by _Steps)


def _full_steps(q, k, v, backend="tiled", **kw):
    """The call by the full steps, never a lane."""
    flags = (kw.get("is_causal", False), kw.get("scale"), kw.get("enable_gqa", False))
    args = (None, 0.0, *flags)
    mods = (kw.get("mask_mod"), None, None)
    return _ATTEND(q, k, v, args, False, mods, backend)


def _strides(t: torch.Tensor) -> list[int]:
    """The strides that place entries (not those of dims of one)."""
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1]


def _same_bits(a, b) -> bool:
    return (
        a.shape == b.shape
        and _strides(a) == _strides(b)
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


# packed documents per batch element (75 positions; calls take the first 70 or 40)
_IDS = torch.tensor([[0] * 30 + [1] * 25 + [2] * 20, [4] * 12 + [5] * 40 + [6] * 23])
_APART = torch.tensor([0] * 20 + [1] * 20 + [0] * 30)  # id 0 in two runs: rows compare ids

# name: (B, H, Hk, T, S, keyword arguments, heads laid out as a module's (B, L, H, D))
_CASES = {
    "window": (2, 3, 3, 70, 70, dict(mask_mod=masks.sliding_window(12)), False),
    "band and causal": (
        2,
        3,
        3,
        70,
        70,
        dict(mask_mod=masks.sliding_window(9, 5), is_causal=True),
        False,
    ),
    "bottom-right window T < S": (
        1,
        2,
        2,
        40,
        75,
        dict(mask_mod=masks.sliding_window(10, align="bottom_right")),
        False,
    ),
    "causal mask_mod, scale": (1, 2, 2, 66, 66, dict(mask_mod=masks.causal(), scale=-0.3), False),
    "gqa 4/2": (2, 4, 2, 70, 70, dict(mask_mod=masks.sliding_window(20), enable_gqa=True), False),
    "a module's heads": (2, 3, 3, 70, 70, dict(mask_mod=masks.sliding_window(7, 7)), True),
    "documents per element": (
        2,
        3,
        3,
        70,
        70,
        dict(mask_mod=masks.document(_IDS[:, :70])),
        False,
    ),
    "shared documents, causal": (
        2,
        2,
        2,
        70,
        70,
        dict(mask_mod=masks.document(_IDS[1, :70]), is_causal=True),
        False,
    ),
    "documents of runs apart": (1, 2, 2, 70, 70, dict(mask_mod=masks.document(_APART)), False),
    "causal documents (and_masks)": (
        2,
        3,
        3,
        70,
        70,
        dict(mask_mod=masks.and_masks(masks.document(_IDS[:, :70]), masks.causal())),
        False,
    ),
    "a band within bottom-right documents": (
        1,
        2,
        2,
        40,
        75,
        dict(
            mask_mod=masks.and_masks(
                masks.sliding_window(6, 3, align="bottom_right"),
                masks.document(_IDS[1, 35:], _IDS[1]),
            )
        ),
        False,
    ),
    "cross documents, gqa": (
        1,
        4,
        2,
        40,
        75,
        dict(mask_mod=masks.document(_IDS[1, 35:], _IDS[1]), enable_gqa=True),
        False,
    ),
}
_BAD = ["finite", "nan-key", "inf-value", "nan-query"]


def _inputs(case: str, bad: str = "finite", seed: int = 0):
    B, H, Hk, T, S, kw, module = _CASES[case]
    g = torch.Generator().manual_seed(seed)

    def draw(heads: int, L: int) -> torch.Tensor:
        if module:  # (B, L, H, D) memory seen as (B, H, L, D)
            return torch.randn(B, L, heads, D, generator=g).to(torch.bfloat16).transpose(1, 2)
        return torch.randn(B, heads, L, D, generator=g).to(torch.bfloat16)

    q, k, v = draw(H, T), draw(Hk, S), draw(Hk, S)
    if bad == "nan-key":  # the rows whose keys hold key 30: NaN
        k[0, 0, 30, 3] = float("nan")
    elif bad == "inf-value":
        v[-1, -1, S - 2, 0] = float("inf")
    elif bad == "nan-query":
        q[0, -1, T // 2, 1] = float("nan")
    return q, k, v, dict(kw)


def _laned() -> bool:
    """Whether the fused kernel runs here (so a window's kind keeps its lane)."""
    return reference.bf16_kernel_here()


@pytest.mark.parametrize("bad", _BAD)
@pytest.mark.parametrize("case", list(_CASES))
def test_a_lane_gives_the_bits_of_the_full_steps(monkeypatch, case, bad):
    """The second call of a kind takes the lane where the kernel runs here (one call by the
    steps, else two) and gives the steps' bits and strides, NaN rows included; the finite
    calls meet the tolerance policy against the float64 reference."""
    q, k, v, kw = _inputs(case, bad)
    with torch.no_grad():
        full = _full_steps(q, k, v, **kw)
        steps = _Steps(monkeypatch)
        first = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        second = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        base = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    assert steps.count == (2 if _laned() else 3)  # (the reference's call: the steps)
    assert _same_bits(first, full) and _same_bits(second, full)
    if bad != "finite":
        assert second.isnan().any() and not second.isnan().all()
        return
    golden = qkv.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), **kw)
    err = (second.double() - golden).abs().max()
    assert err <= 2 * (base.double() - golden).abs().max() + 1e-5


def test_auto_keeps_the_lane_of_the_kernel_it_took(monkeypatch):
    """``auto`` (measuring off: the static order) sends a bfloat16 window to the tiled backend;
    its second call takes the lane, to the steps' bits."""
    q, k, v, kw = _inputs("window")
    with torch.no_grad():
        full = _full_steps(q, k, v, backend="auto", **kw)
        steps = _Steps(monkeypatch)
        outs = [qkv.scaled_dot_product_attention(q, k, v, **kw) for _ in range(3)]
    plan = dispatch.choose(AttentionCall.build(q, k, v, **kw), "auto")
    laned = _laned() and type(plan.backend) is tiled_backend.TiledBackend
    assert steps.count == (1 if laned else 3)
    assert all(_same_bits(o, full) for o in outs)


def test_the_lane_follows_the_switches(monkeypatch, ways):
    """A kept lane gives way to the plan forced by ``QKV_BF16_RANGES`` and to the float32 half
    route forced by ``QKV_CPU_HALF_GEMM`` (the steps then run the call their way), and is
    taken again at once when they are unset."""
    if not _laned():
        pytest.skip("the fused bfloat16 kernel does not run on this CPU: no lane to follow")
    q, k, v, kw = _inputs("window")
    with torch.no_grad():
        steps = _Steps(monkeypatch)
        kept = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        assert steps.count == 1 and ways == {"kernel": 2, "plan": 0}
        monkeypatch.setenv(route.SWITCH, "plan")
        planned = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        assert steps.count == 2 and ways == {"kernel": 2, "plan": 1}
        assert _same_bits(planned, _full_steps(q, k, v, **kw))
        monkeypatch.delenv(route.SWITCH)
        monkeypatch.setenv("QKV_CPU_HALF_GEMM", "float32")
        widened = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        assert steps.count == 3 and ways["kernel"] == 2  # (the float32 GEMMs' way)
        assert _same_bits(widened, _full_steps(q, k, v, **kw))
        monkeypatch.delenv("QKV_CPU_HALF_GEMM")
        counted = steps.count
        again = [qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw) for _ in "ab"]
    assert steps.count == counted  # the exact sizes' lane again
    assert all(_same_bits(o, kept) for o in again) and ways["kernel"] == 4


def test_the_lane_takes_only_its_key_count_and_window_offset(monkeypatch):
    """A bottom-right window's offset moves with the key count: a call of another count in the
    same power-of-two bucket takes the steps (and keeps its own lane), each giving the steps'
    bits; the first count's lane is then still found by its exact sizes."""
    if not _laned():
        pytest.skip("the fused bfloat16 kernel does not run on this CPU: no lane")
    q, k, v, kw = _inputs("bottom-right window T < S")  # S = 75
    short_k, short_v = k[:, :, :70], v[:, :, :70]  # (in the bucket (64, 128] too)
    with torch.no_grad():
        steps = _Steps(monkeypatch)
        outs = []
        for kk, vv in [(k, v), (k, v), (short_k, short_v), (short_k, short_v), (k, v)]:
            outs.append(qkv.scaled_dot_product_attention(q, kk, vv, backend="tiled", **kw))
    assert steps.count == 2
    assert _same_bits(outs[0], _full_steps(q, k, v, **kw)) and _same_bits(outs[1], outs[0])
    assert _same_bits(outs[2], _full_steps(q, short_k, short_v, **kw))
    assert _same_bits(outs[3], outs[2]) and _same_bits(outs[4], outs[0])


def test_a_window_fixed_at_another_offset_takes_the_steps(monkeypatch):
    """transformers' windows carry their cache's offset (``_FixedWindow``: one kind for every
    offset): a call of the same sizes at another offset takes the steps, each offset's calls
    giving the steps' bits."""
    from qkv.integrations.transformers.masks import _FixedWindow

    if not _laned():
        pytest.skip("the fused bfloat16 kernel does not run on this CPU: no lane")
    q, k, v, _ = _inputs("bottom-right window T < S")
    near, far = _FixedWindow(12, 0, 3), _FixedWindow(12, 0, 30)
    with torch.no_grad():
        steps = _Steps(monkeypatch)
        outs = [
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=m)
            for m in (near, near, far, far)
        ]
    assert steps.count == 2  # the first of each offset (its lane then kept for its sizes)
    assert _same_bits(outs[0], _full_steps(q, k, v, mask_mod=near)) and _same_bits(*outs[:2])
    assert _same_bits(outs[2], _full_steps(q, k, v, mask_mod=far)) and _same_bits(*outs[2:])
    assert not _same_bits(outs[0], outs[2])


@pytest.mark.parametrize("layout", ["strided last dim", "keys broadcast over the batch"])
def test_a_lane_takes_strided_and_broadcast_inputs_to_the_steps_bits(monkeypatch, layout):
    """Queries whose last dim has a step of 2 (copied by the kernel's wrapper, in the lane as
    in the steps), and keys and values expanded over the batch (a stride of 0): the lane's
    calls give the steps' bits."""
    q, k, v, kw = _inputs("documents per element")
    if layout == "strided last dim":
        q = torch.stack([q, torch.zeros_like(q)], -1).flatten(-2)[..., ::2]  # (B, H, T, D)
        assert q.stride(-1) == 2
    else:
        k, v = k[:1].expand_as(k), v[:1].expand_as(v)  # (B, H, S, D), batch stride 0
    with torch.no_grad():
        full = _full_steps(q, k, v, **kw)
        steps = _Steps(monkeypatch)
        outs = [qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw) for _ in "ab"]
    assert steps.count == (1 if _laned() else 2)
    assert all(_same_bits(o, full) for o in outs)


def test_a_documents_lane_takes_its_ids_as_they_were(monkeypatch):
    """A documents' lane is its ids': a new mask of the same ids tensor takes the lane; ids
    changed in place, other ids of equal values, int32 ids (copied by ``document`` at each
    call) and ids made under ``inference_mode`` (no version counter) take the steps. Every
    call gives the full steps' bits for its ids."""
    if not _laned():
        pytest.skip("the fused bfloat16 kernel does not run on this CPU: no lane")
    q, k, v, _ = _inputs("documents per element")
    ids = _IDS[:, :70].clone()
    with torch.inference_mode():
        frozen = _IDS[:, :70].clone()

    def call(i: torch.Tensor) -> torch.Tensor:
        return qkv.scaled_dot_product_attention(
            q, k, v, backend="tiled", mask_mod=masks.document(i)
        )

    with torch.no_grad():
        steps = _Steps(monkeypatch)
        first, again = call(ids), call(ids)
        assert steps.count == 1 and _same_bits(again, first)
        assert _same_bits(first, _full_steps(q, k, v, mask_mod=masks.document(ids)))
        ids[1, 30:] = 9  # changed in place: the steps, then its lane
        moved, moved_again = call(ids), call(ids)
        assert steps.count == 2 and _same_bits(moved, moved_again)
        assert _same_bits(moved, _full_steps(q, k, v, mask_mod=masks.document(ids)))
        assert not _same_bits(moved, first)
        twin = ids.clone()  # equal values, other memory: the steps
        assert _same_bits(call(twin), moved) and steps.count == 3
        small = ids.int()  # copied at each call: the steps each time
        assert _same_bits(call(small), moved) and _same_bits(call(small), moved)
        assert steps.count == 5
        assert _same_bits(call(frozen), call(frozen)) and steps.count == 7
        assert _same_bits(call(frozen), first)


def test_a_documents_lane_keeps_its_ids_alive(monkeypatch):
    """The lane holds the ids tensors whose identity it checks, even where the call's mask is
    a copy of the caller's (a ``bind`` that copies, as a mask may): freed, their memory could
    be given to other ids of the same shape and version, which the lane would take for them
    (``_identity``). The caller's ids live as long as the lane; a call of other ids takes the
    steps and gives their bits."""
    import weakref

    from qkv.masks.vocabulary import _Document

    if not _laned():
        pytest.skip("the fused bfloat16 kernel does not run on this CPU: no lane")

    def copying_bind(self, B, H, T, S):
        return _Document(self.q_ids.clone(), self.kv_ids.clone())

    monkeypatch.setattr(_Document, "bind", copying_bind)
    q, k, v, _ = _inputs("documents per element")
    ids = _IDS[:, :70].clone()
    alive = weakref.ref(ids)
    with torch.no_grad():
        steps = _Steps(monkeypatch)
        for _ in range(2):
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=masks.document(ids))
        del ids
        assert steps.count == 1 and alive() is not None
        other = torch.zeros(2, 70, dtype=torch.int64)  # one document per element
        out = qkv.scaled_dot_product_attention(
            q, k, v, backend="tiled", mask_mod=masks.document(other)
        )
    assert steps.count == 2
    assert _same_bits(out, _full_steps(q, k, v, mask_mod=masks.document(other)))


@pytest.mark.parametrize("case", ["window", "documents per element"])
def test_a_lane_kept_under_inference_mode_serves_calls_outside_it(monkeypatch, case):
    """A lane kept by a call under ``inference_mode`` (its ranges then inference tensors)
    takes the kind's later calls under ``no_grad`` and in plain mode without a gradient, and
    the other way round, each to the steps' bits."""
    q, k, v, kw = _inputs(case)
    full = _full_steps(q, k, v, **kw)
    steps = _Steps(monkeypatch)
    with torch.inference_mode():
        first = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    with torch.no_grad():
        second = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    third = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    with torch.inference_mode():
        fourth = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    assert steps.count == (1 if _laned() else 4)
    assert all(_same_bits(o, full) for o in (first, second, third, fourth))


def test_no_lane_for_a_gradient_a_trace_or_a_mask(monkeypatch):
    """Calls the lane does not take run the steps each time: a query that wants a gradient, a
    trace, a window with a bool attn_mask, and masks of no lane's kind (a window and key
    lengths, two windows, two documents)."""
    q, k, v, kw = _inputs("window")
    keep = torch.ones(2, 1, 1, 70, dtype=torch.bool)
    keep[1, ..., 60:] = False
    both = masks.and_masks(masks.sliding_window(12), masks.key_lengths(50))
    windows = masks.and_masks(masks.sliding_window(12), masks.sliding_window(3, 3))
    docs = masks.and_masks(masks.document(_IDS[:, :70]), masks.document(_IDS[:, 5:]))
    steps = _Steps(monkeypatch)
    for _ in range(2):
        qkv.scaled_dot_product_attention(q.requires_grad_(), k, v, backend="tiled", **kw)
    q = q.detach()
    with torch.no_grad():
        for _ in range(2):
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", return_trace=True, **kw)
            qkv.scaled_dot_product_attention(q, k, v, keep, backend="tiled", **kw)
            for mod in (both, windows, docs):
                qkv.scaled_dot_product_attention(q, k, v, backend="tiled", mask_mod=mod)
    assert steps.count == 12


@pytest.mark.parametrize("faster", ["kernel", "plan"])
def test_timing_a_kinds_ways_keeps_no_lane_and_times_each(
    monkeypatch, tmp_path, timed_ways, faster
):
    """Measuring on, with a fake clock on which ``faster`` costs 1 and the other way 3: the
    first call times both ways, each run its own way (none by a lane kept meanwhile), and takes
    the faster. Later calls run it: the kernel by its lane, or the plan by the steps. A kind
    measured again afresh (``qkv tune``) while its lane is kept times the plan by the plan."""
    if not _laned():
        pytest.skip("the fused bfloat16 kernel does not run on this CPU: one way only")
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(route.SWITCH, raising=False)
    tiled = dispatch.get_backend("tiled")
    monkeypatch.setattr(dispatch, "_measurable", lambda call: [tiled])  # (its ways alone)
    autotune.forget()
    costs, runs = timed_ways.costs, timed_ways.runs
    costs.update({faster: 1.0, ("plan" if faster == "kernel" else "kernel"): 3.0})
    q, k, v, kw = _inputs("window")
    kw["scale"] = D**-0.5  # (as the timed calls pass it: the same kind as theirs)
    call = AttentionCall.build(q, k, v, **kw)
    try:
        with torch.no_grad():
            steps = _Steps(monkeypatch)
            first = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
            assert runs["kernel"] >= 3 and runs["plan"] >= 3  # an untimed run, two timed
            assert route.choice(call).route == faster
            # none kept of the timed calls (the plan's would say the kind has no lane)
            assert all(lane.ok for lane in qkv.functional._LANES.values()) == (faster == "kernel")
            counted, before = steps.count, dict(runs)
            again = [qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw) for _ in "ab"]
            other = "plan" if faster == "kernel" else "kernel"
            assert runs[faster] == before[faster] + 2 and runs[other] == before[other]
            assert steps.count == counted + (0 if faster == "kernel" else 2)
            assert all(_same_bits(o, first) for o in again)
            if faster == "plan":
                return
            costs.update(kernel=5.0, plan=2.0)
            before = dict(runs)
            route.tune(call, tiled_backend._held)  # (whole calls, as ``qkv tune`` times them)
            assert runs["plan"] >= before["plan"] + 3  # timed by the plan, not the lane
            assert route.choice(call).route == "plan"
            before = dict(runs)
            out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
            assert runs == {"kernel": before["kernel"], "plan": before["plan"] + 1}
            assert _same_bits(out, _full_steps(q, k, v, **kw))
    finally:
        autotune.forget()
