"""bfloat16 inference of ranges of keys takes the fused kernel or the tiled plan, by measurement
(``qkv.ops.tiled.route``; issue 38): each way forced by ``QKV_BF16_RANGES`` meets the tolerance
policy against the float64 reference and keeps the NaN/inf contract; the measurement, with a
fake clock, takes the faster way, keeps it and reads it back from disk; measuring off, the
kernel. The kernel way needs a CPU where the kernel runs (``bf16_scores.available`` and the
native half route): elsewhere those cases are skipped, and the plan way is what runs anyway.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import autotune, dispatch, masks
from qkv.ops import AttentionCall, reference
from qkv.ops.tiled import route

B, H, T, D = 3, 2, 70, 16
LENGTHS = torch.tensor([70, 41, 9])
IDS = torch.tensor([[0] * 30 + [1] * 40, [0] * 10 + [1] * 25 + [2] * 35, [5] * 70])


def _mods() -> dict:
    return {
        "causal+lengths": dict(is_causal=True, mask_mod=masks.key_lengths(LENGTHS)),
        "window+lengths": dict(
            mask_mod=masks.and_masks(masks.sliding_window(12), masks.key_lengths(LENGTHS))
        ),
        "documents per element": dict(mask_mod=masks.document(IDS)),
        "causal documents": dict(mask_mod=masks.document(IDS), is_causal=True),
        "prefix_lm": dict(mask_mod=masks.prefix_lm(20)),
        "window within documents": dict(
            mask_mod=masks.and_masks(masks.document(IDS[1]), masks.sliding_window(8))
        ),
    }


def _inputs(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(3)]


def _kernel_here(kw: dict) -> bool:
    return reference.bf16_fusable(AttentionCall.build(*_inputs(), **kw))


@pytest.mark.parametrize("name", list(_mods()))
@pytest.mark.parametrize("way", ["kernel", "plan"])
def test_each_way_meets_the_tolerance_policy(monkeypatch, ways, way, name):
    kw = _mods()[name]
    if way == "kernel" and not _kernel_here(kw):
        pytest.skip("the fused bfloat16 kernel does not run on this CPU")
    monkeypatch.setenv(route.SWITCH, way)
    q, k, v = _inputs()
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
        base = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    golden = qkv.scaled_dot_product_attention(
        *(t.double() for t in (q, k, v)), backend="reference", **kw
    )
    assert ways[way] >= 1 and ways["kernel" if way == "plan" else "plan"] == 0
    err = (out.double() - golden).abs().max()
    assert err <= 2 * (base.double() - golden).abs().max() + 1e-5, (way, name, err)


@pytest.mark.parametrize("way", ["kernel", "plan"])
def test_each_way_keeps_the_nan_contract(monkeypatch, way):
    """A NaN key at 50 of element 0 under causal with key lengths: rows 50 on are NaN, and
    rows 0-49 stay within the tolerance policy of the clean inputs' float64 reference, as do
    the other elements, whose padding key 30 of element 2 (beyond its 9 keys) holds inf.
    (The kernel's rows are the clean call's to the bit; the plan's guarded run may round
    them otherwise, within the policy.)"""
    kw = _mods()["causal+lengths"]
    if way == "kernel" and not _kernel_here(kw):
        pytest.skip("the fused bfloat16 kernel does not run on this CPU")
    monkeypatch.setenv(route.SWITCH, way)
    q, k, v = _inputs(1)
    clean = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    base = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw).double()
    golden = qkv.scaled_dot_product_attention(
        *(t.double() for t in (q, k, v)), backend="reference", **kw
    )
    k[0, :, 50, 3] = float("nan")
    v[2, :, 30, 0] = float("inf")
    out = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw).double()
    assert out[0, :, 50:].isnan().all()
    unhit = torch.ones(B, H, T, 1, dtype=torch.bool)
    unhit[0, :, 50:] = False
    bound = 2 * (base - golden).abs().masked_select(unhit).max() + 1e-5
    assert (out - golden).abs().masked_select(unhit).max() <= bound
    if way == "kernel":
        assert torch.equal(out.masked_select(unhit), clean.double().masked_select(unhit))


def test_a_switch_of_another_value_is_refused(monkeypatch):
    """Read where a call could take the kernel: a call there raises; elsewhere the switch
    decides nothing (the plan is the one way) and the route still refuses the value."""
    monkeypatch.setenv(route.SWITCH, "fastest")
    match = "QKV_BF16_RANGES must be 'kernel' or 'plan'"
    with pytest.raises(ValueError, match=match):
        route.RANGES.forced()
    kw = _mods()["prefix_lm"]
    if _kernel_here(kw):
        with pytest.raises(ValueError, match=match):
            qkv.scaled_dot_product_attention(*_inputs(), backend="tiled", **kw)


def _measuring_on(monkeypatch, tmp_path, name: str) -> dict:
    """Measuring on, kept in ``tmp_path``, no way forced, nothing kept from before; the
    keyword arguments of mask ``name`` (skipped where the kernel does not run: one way
    only). The ways' fake clock is the ``timed_ways`` fixture's."""
    kw = _mods()[name]
    if not _kernel_here(kw):
        pytest.skip("the fused bfloat16 kernel does not run on this CPU: one way only")
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(route.SWITCH, raising=False)
    autotune.forget()
    return kw


@pytest.mark.parametrize("faster", ["kernel", "plan"])
def test_the_way_measured_faster_is_taken_kept_and_read_back(
    monkeypatch, tmp_path, timed_ways, faster
):
    """With a fake clock on which the ``faster`` way costs 1 and the other 3: the first call of
    a kind measures both and takes the faster; later calls of the kind run it alone; a fresh
    process (``autotune.forget``) reads it from disk without measuring; another kind is
    measured afresh."""
    kw = _measuring_on(monkeypatch, tmp_path, "causal+lengths")
    costs, runs = timed_ways.costs, timed_ways.runs
    costs.update({faster: 1.0, ("plan" if faster == "kernel" else "kernel"): 3.0})
    q, k, v = _inputs()
    call = AttentionCall.build(q, k, v, **kw)
    try:
        with torch.no_grad():
            first = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
            assert runs["kernel"] >= 3 and runs["plan"] >= 3  # an untimed run, two timed
            choice = route.RANGES.choice(autotune.call_kind(call), measure=False)
            assert choice.route == faster and choice.source == "measured"
            assert choice.times[faster] == 1.0
            before = dict(runs)
            again = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
            other = "plan" if faster == "kernel" else "kernel"
            assert runs[faster] == before[faster] + 1 and runs[other] == before[other]
            assert torch.equal(first, again)
            autotune.forget()  # as a new process: the disk's verdict, nothing measured
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
            assert runs[other] == before[other]
            disk = route.RANGES.choice(autotune.call_kind(call), measure=False)
            assert (disk.route, disk.source) == (faster, "disk")
            prefix = _mods()["prefix_lm"]  # another kind: measured
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **prefix)
            assert runs[other] > before[other]
    finally:
        autotune.forget()


def test_measuring_off_takes_the_kernel(monkeypatch, ways):
    kw = _mods()["documents per element"]
    if not _kernel_here(kw):
        pytest.skip("the fused bfloat16 kernel does not run on this CPU")
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    monkeypatch.delenv(route.SWITCH, raising=False)
    with torch.no_grad():
        qkv.scaled_dot_product_attention(*_inputs(), backend="tiled", **kw)
    assert ways == {"kernel": 1, "plan": 0}


def test_explain_names_the_way_and_why(monkeypatch):
    """``dispatch.explain`` and ``dispatch.way`` name the tiled backend's way for a bfloat16
    call of ranges and why (forced, or the kernel with measuring off); no way for a float32
    call, one that wants a gradient, or where the kernel does not run (one way only)."""
    kw = _mods()["window+lengths"]
    q, k, v = _inputs()
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    monkeypatch.delenv(route.SWITCH, raising=False)
    with torch.no_grad():
        call = AttentionCall.build(q, k, v, **kw)
        wide = AttentionCall.build(q.float(), k.float(), v.float(), **kw)
        assert dispatch.way(wide, "tiled") is None
        assert "'s way" not in dispatch.explain(wide)
        if not _kernel_here(kw):
            assert dispatch.way(call, "tiled") is None
            return
        off = dispatch.way(call, "tiled")
        assert off == (
            "bf16 ranges -> kernel: the fused kernel, the way without a measurement; "
            "measuring is off, QKV_AUTOTUNE=off"
        )
        assert dispatch.explain(call).endswith(f"; tiled's way: {off}")
        monkeypatch.setenv(route.SWITCH, "plan")
        forced = "bf16 ranges -> plan: forced by QKV_BF16_RANGES=plan"
        assert dispatch.way(call, "tiled") == forced
        assert dispatch.explain(call).endswith(f"; tiled's way: {forced}")
    grad = AttentionCall.build(q.requires_grad_(), k, v, **kw)
    assert dispatch.way(grad, "tiled") is None  # (a gradient: the plan, the one way)


def test_tune_measures_the_way_again(monkeypatch, tmp_path, timed_ways):
    """A kind measured with the kernel faster is measured afresh by ``dispatch.tune`` (what
    ``qkv tune`` runs) once the plan has become faster: the plan is kept, in this process and
    on disk, and the next call runs it; ``explain`` says so."""
    kw = _measuring_on(monkeypatch, tmp_path, "documents per element")
    tiled = dispatch.get_backend("tiled")
    monkeypatch.setattr(dispatch, "_measurable", lambda call: [tiled])  # (its way alone)
    costs, runs = timed_ways.costs, timed_ways.runs
    q, k, v = _inputs()
    call = AttentionCall.build(q, k, v, **kw)
    try:
        with torch.no_grad():
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
            assert route.choice(call).route == "kernel"
            costs.update(kernel=5.0, plan=2.0)
            assert dispatch.tune(call) is None  # (one backend: no choice of backend)
            now = route.choice(call)
            assert (now.route, now.source, now.times) == ("plan", "measured", costs)
            assert "tiled's way: bf16 ranges -> plan: faster measured" in dispatch.explain(call)
            before = dict(runs)
            qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
            assert runs == {"kernel": before["kernel"], "plan": before["plan"] + 1}
            autotune.forget()  # as a new process: the disk holds the fresh verdict
            assert (route.choice(call).route, route.choice(call).source) == ("plan", "disk")
    finally:
        autotune.forget()


def test_tune_rows_name_the_way(monkeypatch, capsys):
    """``qkv tune``'s rows carry the way of the backend they keep (printed after the times):
    a bfloat16 window's on a CPU where the kernel runs, none for float32."""
    from qkv.bench.tune import tune_grid
    from qkv.cli.tune import _print_row

    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    monkeypatch.setenv(route.SWITCH, "plan")
    kept = autotune.Choice("tiled", "measured", {"tiled": 1e-3, "torch": 2e-3})
    monkeypatch.setattr(dispatch, "tune", lambda call: kept)  # (nothing timed here)
    rows = list(
        tune_grid(
            dtypes=("float32", "bfloat16"),
            lengths=(64,),
            cases=("window",),
            H=2,
            D=16,
            progress=_print_row,
        )
    )
    assert [r["backend"] for r in rows] == ["tiled", "tiled"] and rows[0]["way"] is None
    window = dict(mask_mod=masks.sliding_window(256))
    if not reference.bf16_fusable(AttentionCall.build(*_inputs(), **window)):
        assert rows[1]["way"] is None
        return
    assert rows[1]["way"] == "bf16 ranges -> plan: forced by QKV_BF16_RANGES=plan"
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].endswith("(tiled 1 ms, torch 2 ms); its way: " + rows[1]["way"])
    assert printed[0].endswith("(tiled 1 ms, torch 2 ms)")
