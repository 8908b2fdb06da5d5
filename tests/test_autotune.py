"""auto chooses by measurement (issue 38, item 2): with a fake clock, two fake backends.

``Slow`` comes first in the static order and takes twice ``Fast``'s (fake) time: measured, auto
takes ``Fast``; the choice holds for the process, goes to disk, and is read back by a fresh
process (``autotune.forget``) without measuring again; ``QKV_AUTOTUNE=off`` gives the static
order; a backend that compiles on first use is measured only by ``tune``; ``explain`` says
which and why.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

import qkv
from qkv import autotune, dispatch
from qkv.ops import AttentionCall


class Clock:
    now = 0.0


class Fake:
    """A backend whose every run advances the fake clock by ``cost`` and counts itself."""

    def __init__(self, name, priority, cost, prefers=True):
        self.name, self.priority, self.cost, self.prefers = name, priority, cost, prefers
        self.runs = 0
        self.static = True  # whether the static order may take it (``in_static_order``)

    def supports(self, call):
        return None if call.dtype == torch.float32 and call.T == 33 else "a test backend"

    def auto_prefers(self, call):
        return self.prefers

    def in_static_order(self, call):
        return self.static

    def run(self, call):
        self.runs += 1
        Clock.now += self.cost
        return dispatch.get_backend("reference").run(call)


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_clock", lambda: Clock.now)
    autotune.forget()
    # the fakes and the reference alone: the real backends would time 0 on the fake clock
    monkeypatch.setattr(dispatch, "_REGISTRY", {"reference": dispatch.get_backend("reference")})
    monkeypatch.setattr(dispatch, "_ORDER", list(dispatch._REGISTRY.values()))
    made = [Fake("slow", -2, 2.0), Fake("fast", -1, 1.0)]
    for b in made:
        dispatch.register_backend(b)
    yield made
    autotune.forget()


def _qkv(T=33):
    return [torch.randn(1, 2, T, 8) for _ in range(3)]


def _backend_of_a_call() -> str:
    """Which backend ran a call (q wants a gradient: with none, auto forms a trace's weights
    in one pass of the plain math instead of asking a backend)."""
    q, k, v = _qkv()
    _, trace = qkv.scaled_dot_product_attention(q.requires_grad_(), k, v, return_trace=True)
    return trace.backend


def test_auto_takes_the_backend_measured_fastest_and_keeps_it(fakes, tmp_path):
    slow, fast = fakes
    assert _backend_of_a_call() == "fast"
    assert slow.runs >= 2 and fast.runs >= 3  # one untimed run each, then timed runs
    runs = (slow.runs, fast.runs)
    fast.cost = 5.0  # slower now: the choice holds for the process all the same
    assert _backend_of_a_call() == "fast" and slow.runs == runs[0] and fast.runs == runs[1] + 1
    q, k, v = _qkv()
    call = AttentionCall.build(q.requires_grad_(), k, v)
    why = dispatch.explain(call)
    assert why.startswith("fast: fastest measured") and "slow 2e+03 ms" in why
    (stored,) = tmp_path.glob("autotune-*.json")
    data = json.loads(stored.read_text())
    assert data["machine"] == autotune.machine_key()
    (kind,) = data["choices"]
    assert kind == autotune.call_kind(call) and data["choices"][kind]["backend"] == "fast"


def _named_calls(monkeypatch) -> list[str]:
    """The backends named by the full steps' calls from here on (``functional._attend``)."""
    names: list[str] = []
    full = qkv.functional._attend

    def counted(*args, **kwargs):
        names.append(args[6])  # (query, key, value, args, trace, mods, backend)
        return full(*args, **kwargs)

    monkeypatch.setattr(qkv.functional, "_attend", counted)
    return names


def test_auto_times_whole_calls_what_a_caller_pays(fakes, monkeypatch, tmp_path):
    """Each candidate is timed as a whole call of ``qkv.scaled_dot_product_attention`` with
    that backend named, the checks and the contract's steps around its ``run`` included: a
    backend whose run is faster but whose whole call is slower loses."""
    del fakes  # (slow costs 2 a run, fast 1)
    assert autotune._WHOLE_CALL[0] is qkv.functional._whole_call  # registered on import
    names = _named_calls(monkeypatch)
    assert _backend_of_a_call() == "fast"  # its run costs 1, slow's 2
    assert names.count("fast") >= 3 and names.count("slow") >= 2  # untimed, then timed runs
    autotune.forget()
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "again"))  # nothing kept: measured again
    around = {"fast": 5.0, "slow": 0.0}  # fast's steps around its run cost 5 more
    real = qkv.functional._whole_call

    def whole(call, name):
        Clock.now += around[name]
        return real(call, name)

    monkeypatch.setattr(autotune, "_WHOLE_CALL", [whole])
    assert _backend_of_a_call() == "slow"


def test_candidates_are_timed_in_turn_run_by_run(fakes, monkeypatch):
    """One untimed run each, then the candidates in turn, run by run (a burst of load falls
    on all of them), at least three timed runs each (with two, a shared machine's scatter
    once chose a backend 13% slower), stopping past the budget (here at once: the fake runs
    take seconds)."""
    del fakes
    names = _named_calls(monkeypatch)
    _backend_of_a_call()
    timed = [n for n in names if n != "auto"]
    a, b = timed[:2]
    # fast, after slow in the static order, wins the first round: a second round confirms it
    assert a != b and timed == [a, b] * 4 + [a, b] * 4 and autotune._MIN_RUNS == 3


def test_a_call_with_dropout_is_timed_by_its_backends_run(fakes, monkeypatch):
    """Dropout draws from the global generator: the whole call's checks would not change its
    draws, so such a call is timed by the backends' ``run`` alone, as before."""
    names = _named_calls(monkeypatch)
    q, k, v = _qkv()
    _, trace = qkv.scaled_dot_product_attention(
        q.requires_grad_(), k, v, dropout_p=0.25, return_trace=True
    )
    assert trace.backend in ("fast", "slow") and names == ["auto"]


def test_a_causal_inference_call_is_measured_on_the_keys_its_rows_see(fakes, monkeypatch):
    """Top-left causal attention with fewer queries than keys, without gradient, runs on the
    first T keys (the others reach no row): auto times the backends on that call, as it runs,
    and explain answers for the call as given. Timed on all S keys, a backend whose cost grows
    with S (torch's one-query kernel) lost to one that runs the T keys anyway."""
    sizes = []
    for fake in fakes:
        real = fake.run
        monkeypatch.setattr(fake, "run", lambda call, _r=real: sizes.append(call.S) or _r(call))
    q, k, v = _qkv(33)
    k, v = (torch.cat([t, torch.randn(1, 2, 40, 8)], dim=-2) for t in (k, v))  # S = 73
    with torch.no_grad():
        out = qkv.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert sizes and set(sizes) == {33}
    want = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference")
    assert torch.allclose(out, want, atol=1e-6)
    call = AttentionCall.build(q, k, v, is_causal=True)
    assert dispatch.explain(call).startswith("fast: fastest measured")
    narrowed = AttentionCall.build(q, k[..., :33, :], v[..., :33, :], is_causal=True)
    assert autotune.stored_choice(narrowed) is not None and autotune.stored_choice(call) is None


def test_choices_measured_with_other_kernel_sources_are_not_read(tmp_path):
    """The cache file's name holds a digest of qkv's kernel sources: after a kernel changes
    (a source tree at another commit, the same version number), the choices its old self
    measured are in another file and are measured again."""
    from qkv import _measured

    root = tmp_path / "ops"
    (root / "tiled").mkdir(parents=True)
    (root / "tiled" / "k.cpp").write_text("int f() { return 1; }\n")
    (root / "a.py").write_text("x = 1\n")
    (root / "notes.txt").write_text("not a source")
    before = _measured.sources_digest(root)
    (root / "notes.txt").write_text("other words")
    assert _measured.sources_digest(root) == before
    (root / "tiled" / "k.cpp").write_text("int f() { return 2; }\n")
    changed = _measured.sources_digest(root)
    (root / "tiled" / "k.cpp").rename(root / "k.cpp")  # the same bytes under another name
    assert len({before, changed, _measured.sources_digest(root)}) == 3
    assert _measured.kernels_digest() == _measured.sources_digest(
        Path(_measured.__file__).parent / "ops"
    )
    assert autotune.machine_key().endswith(f"kernels {_measured.kernels_digest()}")


@pytest.mark.parametrize(("slow_cost", "taken"), [(1.04, "slow"), (1.06, "fast")])
def test_a_near_tie_goes_to_the_static_order(fakes, slow_cost, taken):
    """A backend later in the static order is taken only when it is measured faster by more
    than 5% (a few runs on a shared machine scatter by about as much); the reason says which
    rule chose."""
    slow, _ = fakes
    slow.cost = slow_cost
    assert _backend_of_a_call() == taken
    q, k, v = _qkv()
    why = dispatch.explain(AttentionCall.build(q.requires_grad_(), k, v))
    rule = "fastest measured" if taken == "fast" else "first in the static order"
    assert why.startswith(f"{taken}: {rule}"), why


def test_a_fresh_process_reads_the_disk_and_measures_nothing(fakes):
    slow, fast = fakes
    _backend_of_a_call()
    autotune.forget()  # as a new process: memory empty, the file stays
    before = (slow.runs, fast.runs)
    assert _backend_of_a_call() == "fast"
    assert (slow.runs, fast.runs) == (before[0], before[1] + 1)
    q, k, v = _qkv()
    assert "; disk)" in dispatch.explain(AttentionCall.build(q.requires_grad_(), k, v))


def test_off_gives_the_static_order(fakes, monkeypatch):
    slow, fast = fakes
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    assert _backend_of_a_call() == "slow" and fast.runs == 0 and slow.runs == 1
    assert "QKV_AUTOTUNE=off" in dispatch.explain(AttentionCall.build(*_qkv()))
    monkeypatch.setenv("QKV_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="QKV_AUTOTUNE='sometimes'"):
        qkv.scaled_dot_product_attention(*_qkv())


def test_explain_takes_the_call_s_tensors_and_arguments(fakes, monkeypatch):
    """``explain(q, k, v, **kwargs)`` answers as for the call built of them (the kind measured
    for a causal call, not for a plain one); wrong arguments raise naming the two forms."""
    q, k, v = _qkv()
    qkv.scaled_dot_product_attention(q, k, v, is_causal=True)  # the causal kind measured
    causal = dispatch.explain(q, k, v, is_causal=True)
    assert causal == dispatch.explain(AttentionCall.build(q, k, v, is_causal=True))
    assert causal.startswith("fast: fastest measured")
    assert "not measured" in dispatch.explain(q, k, v)  # (the plain kind: not measured yet)
    with pytest.raises(TypeError, match="query, key and value tensors"):
        dispatch.explain(q, k)
    with pytest.raises(TypeError, match="no further arguments"):
        dispatch.explain(AttentionCall.build(q, k, v), is_causal=True)
    with pytest.raises(ValueError):  # (the call's own checks)
        dispatch.explain(q, k[..., :3], v)


def test_kinds_are_kept_apart_and_other_calls_keep_their_backend(fakes):
    qkv.scaled_dot_product_attention(*_qkv())
    call = AttentionCall.build(*_qkv(), is_causal=True)
    assert autotune.call_kind(call) != autotune.call_kind(AttentionCall.build(*_qkv()))
    plain = AttentionCall.build(*_qkv(T=17))  # the fakes decline: one backend, no measuring
    assert dispatch.select(plain).name == "reference"
    assert "not measured" in dispatch.explain(plain)


def test_combined_masks_of_other_parts_are_other_kinds(fakes, monkeypatch):
    """A prefix LM (an ``or``) and a window within documents (an ``and``) are both
    ``_Combined``; a choice measured for one does not decide the other (measured: torch's
    kernel runs the first 1.4x faster than the tiled loop on an AMX Xeon, the tiled loop the
    second 4-8x faster than torch). Windows of other widths' buckets are other kinds too."""
    from qkv import masks

    slow, fast = fakes
    ids = torch.zeros(33, dtype=torch.long)
    prefix = masks.prefix_lm(4)
    within = masks.and_masks(masks.document(ids), masks.sliding_window(4))
    kinds = {
        autotune.call_kind(AttentionCall.build(*_qkv(), mask_mod=m))
        for m in (
            prefix,
            within,
            masks.or_masks(masks.causal(), masks.key_lengths(4)),  # a prefix LM's parts
            masks.and_masks(masks.document(ids), masks.sliding_window(100)),
            masks.sliding_window(4),
            masks.sliding_window(100),
            masks.sliding_window(4, 4),
        )
    }
    assert len(kinds) == 6  # the two prefix LMs share one kind; the rest differ
    q, k, v = _qkv()
    qkv.scaled_dot_product_attention(q, k, v, mask_mod=prefix)
    assert dispatch.explain(AttentionCall.build(q, k, v, mask_mod=prefix)).startswith("fast")
    fast.cost = 3.0  # slower than slow now: the window within documents is measured afresh
    runs = slow.runs
    qkv.scaled_dot_product_attention(q, k, v, mask_mod=within)
    assert slow.runs > runs
    assert dispatch.explain(AttentionCall.build(q, k, v, mask_mod=within)).startswith("slow")


def test_a_backend_that_compiles_is_measured_by_tune_only(fakes):
    _, fast = fakes
    fast.prefers = False  # as flex off CUDA: its first call compiles
    assert _backend_of_a_call() == "slow" and fast.runs == 0
    q, k, v = _qkv()
    choice = dispatch.tune(AttentionCall.build(q.requires_grad_(), k, v))
    assert choice.backend == "fast" and set(choice.times) >= {"slow", "fast"}
    assert _backend_of_a_call() == "fast"


@pytest.mark.parametrize(
    ("slow_cost", "measuring", "taken"),
    [(2.0, "on", "fast"), (1.04, "on", "slow"), (2.0, "off", "slow")],
)
def test_a_backend_out_of_the_static_order_is_taken_only_as_measured_fastest(
    fakes, monkeypatch, slow_cost, measuring, taken
):
    """As torch's SDPA for a structured mask (run dense, every pair visited): first by
    priority, but never the static order's choice, and a near tie goes to the backend the
    static order may take."""
    slow, fast = fakes
    fast.priority, fast.static, slow.cost = -3, False, slow_cost
    dispatch.register_backend(fast, replace=True)  # re-sorted: fast first by priority
    assert dispatch.backend_names()[0] == "fast"
    monkeypatch.setenv("QKV_AUTOTUNE", measuring)
    assert _backend_of_a_call() == taken
    q, k, v = _qkv()
    why = dispatch.explain(AttentionCall.build(q.requires_grad_(), k, v))
    assert why.startswith(f"{taken}: "), why
    if measuring == "off":
        assert fast.runs == 0 and "static order" in why


def test_measuring_leaves_the_callers_tensors_alone(fakes):
    """Forward and backward are timed on detached copies: no gradient reaches the caller's
    leaves from the measurement, and the result is the chosen backend's."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = qkv.scaled_dot_product_attention(q, k, v)
    assert q.grad is None and k.grad is None
    out.sum().backward()
    want = qkv.scaled_dot_product_attention(*(t.detach() for t in (q, k, v)), backend="reference")
    torch.testing.assert_close(out.detach(), want)
    assert q.grad is not None


def test_qkv_tune_keeps_its_choices_for_later_processes(tmp_path, monkeypatch, capsys):
    """``qkv tune`` times the backends of each configuration (real clock) and writes the
    winner where a later process's auto reads it; the CPU's half-GEMM routes too, one line
    each."""
    from qkv.cli import main
    from qkv.ops import cpu_isa

    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    monkeypatch.delenv("QKV_CPU_HALF_GEMM", raising=False)
    autotune.forget()
    try:
        argv = ["tune", "--lengths", "40", "--dtypes", "float32", "--cases", "causal"]
        assert main([*argv, "--dim", "24", "--out", str(tmp_path / "rows.json")]) == 0
        printed = capsys.readouterr().out
        (row,) = json.loads((tmp_path / "rows.json").read_text())
        assert row["backend"] in ("torch", "tiled") and set(row["times"]) == {"torch", "tiled"}
        assert f"-> {row['backend']}" in printed
        for name in ("bfloat16", "float16", "bfloat16, one row", "float16, one row"):
            line = rf"half GEMM {name} +-> (native|float32): faster measured on this machine"
            assert re.search(line, printed), printed
        autotune.forget()  # a later process
        q, k, v = (torch.randn(1, 8, 40, 24) for _ in range(3))
        call = AttentionCall.build(q, k, v, is_causal=True)
        assert dispatch.select(call).name == row["backend"]
        assert "; disk)" in dispatch.explain(call)
        assert cpu_isa.half_gemm_choice(torch.bfloat16).source == "disk"
    finally:
        autotune.forget()


def test_the_environment_read_on_every_call_follows_every_change(monkeypatch):
    """``_measured.env`` (the settings read on every call, without os.environ's encoding each
    time) gives what ``os.environ.get`` gives, through setenv, delenv, a direct assignment, a
    value outside ASCII and a name never set."""
    from qkv import _measured

    name = "QKV_TEST_ENV_READ"
    monkeypatch.delenv(name, raising=False)
    assert _measured.env(name) is None
    for value in ("on", "off", "", " Off ", "é-ü"):
        monkeypatch.setenv(name, value)
        assert _measured.env(name) == os.environ.get(name) == value
    os.environ[name] = "direct"
    assert _measured.env(name) == "direct"
    monkeypatch.delenv(name)
    assert _measured.env(name) is None
    assert _measured.env("QKV_TEST_NEVER_SET_ANYWHERE") is None
    monkeypatch.setenv("QKV_AUTOTUNE", "off")
    assert not _measured.enabled()
    monkeypatch.setenv("QKV_AUTOTUNE", "on")
    assert _measured.enabled()


def test_a_choice_against_the_static_order_is_timed_again(fakes, monkeypatch, tmp_path):
    """A backend later in the static order that wins one round is timed again against the
    static order's first (a burst of load on a shared machine can fall on one backend's few
    runs): where the second round shows the first as fast, the first is kept; where it
    confirms the win, the later backend is taken. Each keeps its fastest run of both."""
    slow, fast = fakes
    runs = {"n": 0}
    real = Fake.run

    def bursty(self, call):  # slow's runs in the first round cost 3, later ones 0.9
        if self is slow:
            runs["n"] += 1
            self.cost = 3.0 if runs["n"] <= 4 else 0.9
        return real(self, call)

    monkeypatch.setattr(Fake, "run", bursty)
    assert _backend_of_a_call() == "slow"
    q, k, v = _qkv()
    why = dispatch.explain(AttentionCall.build(q.requires_grad_(), k, v))
    assert why.startswith("slow: fastest measured") and "slow 900 ms" in why, why
    assert runs["n"] > 4  # (timed in the second round)
    autotune.forget()
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "again"))  # (nothing kept on disk)
    runs["n"] = -(10**6)  # slow costs 3 in every round: fast's win is confirmed
    assert _backend_of_a_call() == "fast"
    assert slow.runs > 0 and fast.runs > 0
