"""qkv.capture: the weights of every qkv attention call inside a model, by site, layer and head.

Captured weights equal the modules' own traces and plain float64 math; bounded captures equal
the same slice of an unbounded one; decoding gives one record per step, each the matching row
of the full forward; hooks, the recorder and grad mode are left as they were (after errors
too); nothing kept holds a gradient or the calls' inputs; save/load round-trips through
``torch.load(weights_only=True)``; bad requests say the numbers.
"""

import contextlib
import gc
import math
import os
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn

import qkv
from qkv import recording
from qkv.capture import CapturedAttention

BACKENDS = ["tiled", "torch", "reference"]
F64 = dict(dtype=torch.float64)


class Stack(nn.Module):
    """Residual blocks of qkv.MultiHeadAttention: the smallest multi-layer qkv model."""

    def __init__(self, layers=3, C=16, H=4, backend="auto", **kw):
        super().__init__()
        self.blocks = nn.ModuleList(
            qkv.MultiHeadAttention(C, H, backend=backend, **kw) for _ in range(layers)
        )

    def forward(self, x, *, is_causal=True, return_trace=False):
        traces = []
        for blk in self.blocks:
            y = blk(x, is_causal=is_causal, return_trace=return_trace)
            if return_trace:
                y, trace = y
                traces.append(trace)
            x = x + y  # (B, T, C)
        return (x, traces) if return_trace else x


def lm(backend="auto", layers=3, **kw):
    model = qkv.DecoderLM(23, 16, 4, layers, max_len=64, **kw).eval()
    return _set_backend(model, backend)


def _set_backend(model, backend):
    for m in model.modules():
        if isinstance(m, qkv.MultiHeadAttention):
            m.backend = backend
    return model


def _hook_counts(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def probs64(q, k, *, causal):
    """softmax(q k^T / sqrt(D)) in float64, top-left causal when asked: the golden weights."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        T, S = scores.shape[-2:]
        keep = torch.ones(T, S, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1)


# --- the weights are right -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_stack_capture_equals_module_traces_and_float64(backend):
    model = Stack(backend=backend, **F64)
    x = torch.randn(2, 13, 16, **F64)
    with qkv.capture(model) as cap:
        y = model(x)
    y_own, traces = model(x, return_trace=True)
    assert torch.equal(y, y_own)
    assert cap.sites == ["blocks.0", "blocks.1", "blocks.2"]
    assert [(r.name, r.layer, r.call) for r in cap] == [(f"blocks.{i}", i, 0) for i in range(3)]
    for rec, trace in zip(cap, traces):
        assert rec.backend == backend and rec.shape == (2, 4, 13, 13)
        torch.testing.assert_close(rec.probs, trace.probs, rtol=0, atol=0)
        torch.testing.assert_close(rec.lse, trace.lse.to(rec.lse.dtype))
        torch.testing.assert_close(rec.probs, probs64(trace.q, trace.k, causal=True))
        assert rec.scores is None  # kept only when asked
        assert rec.rows.tolist() == list(range(13)) and rec.heads.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_capture_within_policy_of_float64(backend):
    """float32 weights no further from float64 math than twice the float32 reference's."""
    model = Stack(backend=backend)
    x = torch.randn(2, 33, 16)
    with qkv.capture(model) as cap:
        model(x)
    _, traces = _set_backend(model, "reference")(x, return_trace=True)
    for rec, trace in zip(cap, traces):
        golden = probs64(trace.q, trace.k, causal=True)
        baseline = (trace.probs.double() - golden).abs().max()
        assert (rec.probs.double() - golden).abs().max() <= 2 * baseline + 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_selected_layers_heads_rows_equal_slice_of_full(backend):
    model = lm(backend)
    x = torch.randint(0, 23, (3, 17))
    with qkv.capture(model) as full:
        model(x)
    with qkv.capture(
        model,
        layers=[2, "blocks.layers.0"],
        heads=[3, 1],
        rows=range(5, 9),
        batch=[2, 0],
        scores=True,
    ) as part:
        model(x)
    assert [r.layer for r in part] == [0, 2]  # call order; layer 1 not recorded
    for rec in part:
        whole = full.layer(rec.layer)[0]
        want = whole.probs[[2, 0]][:, [3, 1]][:, :, 5:9]
        torch.testing.assert_close(rec.probs, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(rec.lse, whole.lse[[2, 0]][:, [3, 1]][:, :, 5:9])
        assert rec.scores.shape == rec.probs.shape
        assert torch.isneginf(rec.scores[:, :, 0, 6:]).all()  # causal: row 5 sees keys 0..5
        assert (rec.batch.tolist(), rec.heads.tolist(), rec.rows.tolist()) == (
            [2, 0],
            [3, 1],
            [5, 6, 7, 8],
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_vit_capture_equals_return_attention(backend):
    model = _set_backend(qkv.ViT(16, 4, 5, 16, 4, 2).eval(), backend)
    images = torch.randn(2, 3, 16, 16)
    _, maps = model(images, return_attention=True)
    with qkv.capture(model, heads=2, rows=[0]) as cap:  # what the CLS token looks at
        model(images)
    assert cap.sites == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    for rec, trace in zip(cap, maps.encoder):
        assert rec.probs.shape == (2, 1, 1, 17)
        torch.testing.assert_close(rec.probs, trace.probs[:, [2]][:, :, [0]], rtol=0, atol=1e-6)


def test_seq2seq_sites_in_call_order_and_cross_attention():
    model = qkv.Seq2SeqTransformer(23, 16, 4, 2, max_len=64).eval()
    src, tgt = torch.randint(0, 23, (2, 11)), torch.randint(0, 23, (2, 7))
    src_mask = torch.ones(2, 11, dtype=torch.bool)
    src_mask[1, 8:] = False
    with qkv.capture(model) as cap:
        model(src, tgt, src_key_mask=src_mask)
    assert cap.sites == [
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
        "decoder.layers.0.self_attn",
        "decoder.layers.0.cross_attn",
        "decoder.layers.1.self_attn",
        "decoder.layers.1.cross_attn",
    ]
    _, maps = model(src, tgt, src_key_mask=src_mask, return_attention=True)
    own = maps.encoder + [t for pair in zip(maps.decoder, maps.cross) for t in pair]
    for rec, trace in zip(cap, own):
        torch.testing.assert_close(rec.probs, trace.probs, rtol=0, atol=0)
    cross = cap["decoder.layers.1.cross_attn"][0]
    assert cross.shape == (2, 4, 7, 11)
    assert (cross.probs[1, :, :, 8:] == 0).all()  # padded source keys get no weight
    by_prefix = qkv.capture(model, layers=["decoder.layers.1"])
    with by_prefix as part:
        model(src, tgt, src_key_mask=src_mask)
    assert [r.name for r in part] == ["decoder.layers.1.self_attn", "decoder.layers.1.cross_attn"]


def test_linear_attention_and_single_head_calls_are_recorded():
    model = lm(attention="linear", layers=2)
    with qkv.capture(model, rows=[-1]) as cap:
        model(torch.randint(0, 23, (1, 9)))
    assert [r.backend for r in cap] == ["linear", "linear"]
    assert cap.records[0].probs.shape == (1, 4, 1, 9)
    torch.testing.assert_close(cap.records[0].probs.sum(-1), torch.ones(1, 4, 1))

    sa = qkv.SelfAttention(8, 4)  # calls attention with (B, T, d): a 3-D trace, no head dim
    x = torch.randn(3, 5, 8)
    with qkv.capture(sa, heads=[1], rows=[0, 4]) as cap:  # dims read as trace.select reads them
        sa(x)
    _, trace = sa(x, return_trace=True)
    assert cap.sites == [""] and cap.records[0].shape == (1, 3, 5, 5)
    torch.testing.assert_close(
        cap.records[0].probs[0], trace.probs[[1]][:, [0, 4]], rtol=0, atol=1e-6
    )


class FiveDims(nn.Module):
    """Calls attention with (B, X, H, T, D), as torch accepts."""

    def forward(self, q):
        return qkv.scaled_dot_product_attention(q, q, q)


def test_calls_with_more_leading_dims_fold_them_into_batch():
    q = torch.randn(2, 3, 4, 6, 8)
    model = FiveDims()
    with qkv.capture(model, heads=[1], rows=[2], batch=[5]) as cap:
        model(q)
    _, trace = qkv.scaled_dot_product_attention(q, q, q, return_trace=True)
    rec = cap.records[0]
    assert rec.shape == (6, 4, 6, 6)
    torch.testing.assert_close(rec.probs, trace.probs.reshape(6, 4, 6, 6)[[5]][:, [1]][:, :, [2]])


# --- decoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_generate_records_one_call_per_step_equal_to_the_full_forward(backend):
    model = lm(backend, **F64)
    prompt = torch.randint(0, 23, (2, 5))
    forwards = []
    handle = model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        with qkv.capture(model, heads=[0, 2], rows=[-1]) as cap:
            tokens = model.generate(prompt, 6)
    finally:
        handle.remove()
    assert len(cap) == 3 * len(forwards) and len(forwards) == 6  # prefill + 5 steps
    _, maps = model(tokens[:, :-1], return_attention=True)  # the full causal forward
    for layer in range(3):
        recs = cap.layer(layer)
        assert [r.call for r in recs] == list(range(6))
        for step, rec in enumerate(recs):
            T = 5 if step == 0 else 1
            pos = 4 + step  # the query position of the call's last row
            assert rec.shape == (2, 4, T, pos + 1) and rec.rows.tolist() == [T - 1]
            want = maps.decoder[layer].probs[:, [0, 2], pos : pos + 1, : pos + 1]
            torch.testing.assert_close(rec.probs, want)


def test_decode_steps_keep_the_rows_they_have():
    model = lm()
    with qkv.capture(model, layers=[0], rows=range(3, 6)) as cap:
        model.generate(torch.randint(0, 23, (1, 4)), 3)
    assert [r.rows.tolist() for r in cap] == [[3], [], []]  # steps have only row 0
    assert [tuple(r.probs.shape) for r in cap] == [(1, 4, 1, 4), (1, 4, 0, 5), (1, 4, 0, 6)]


# --- cost, memory and gradients ---------------------------------------------------------------


def test_unwanted_layers_run_without_a_trace(monkeypatch):
    seen = []
    run = qkv.dispatch.run_with_lse
    monkeypatch.setattr(
        qkv.dispatch,
        "run_with_lse",
        lambda call, b: seen.append(call.return_trace) or run(call, b),
    )
    model = lm("tiled")
    x = torch.randint(0, 23, (1, 8))
    model(x)
    assert seen == [False] * 3
    seen.clear()
    with qkv.capture(model, layers=[1]):
        model(x)
    assert seen == [False, True, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_unchanged_and_nothing_kept_holds_a_graph(backend):
    model = lm(backend).train()
    x = torch.randint(0, 23, (2, 12))

    def grads():
        model.zero_grad()
        out = model(x)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    out0, g0 = grads()
    with qkv.capture(model) as full:
        out1, g1 = grads()
    with qkv.capture(model, heads=[1], rows=[3]) as part:
        out2, g2 = grads()
    for out, g in ((out1, g1), (out2, g2)):
        assert torch.equal(out, out0)
        assert all(torch.equal(a, b) for a, b in zip(g, g0))
    for rec in list(full) + list(part):
        for t in (rec.probs, rec.lse):
            assert not t.requires_grad and t.grad_fn is None
    assert torch.is_grad_enabled()


def test_dropout_draws_as_without_capture():
    model = lm("reference", dropout=0.0)
    for m in model.modules():
        if isinstance(m, qkv.MultiHeadAttention):
            m.dropout = 0.3
    model.train()
    x = torch.randint(0, 23, (2, 10))
    torch.manual_seed(5)
    want = model(x)
    torch.manual_seed(5)
    with qkv.capture(model, rows=[0]) as cap:
        got = model(x)
    assert torch.equal(got, want) and len(cap) == 3


class Projector(nn.Module):
    """Makes its q/k/v inside forward and keeps weak references to them."""

    def __init__(self, backend):
        super().__init__()
        self.lin, self.backend, self.refs = nn.Linear(8, 24), backend, []

    def forward(self, x):
        q, k, v = self.lin(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)  # (B, 2, T, 4) x3
        self.refs = [weakref.ref(t) for t in (q, k, v)]
        return qkv.scaled_dot_product_attention(q, k, v, backend=self.backend).sum()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "all"])
def test_capture_keeps_no_inputs_alive(backend, bounded):
    model = Projector(backend)
    with torch.no_grad(), qkv.capture(model, rows=[1, 2] if bounded else None) as cap:
        model(torch.randn(2, 40, 8))
    gc.collect()
    assert [r() for r in model.refs] == [None] * 3  # the lazy trace's q/k/v were let go
    rec = cap.records[0]
    for t in (rec.probs, rec.lse):  # no view of a larger buffer
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert rec.probs.shape == ((2, 2, 2, 40) if bounded else (2, 2, 40, 40))


# --- state: hooks, recorder, threads ----------------------------------------------------------


def test_hooks_and_recorder_removed_after_exit_and_after_an_error():
    model = lm()
    user = model.blocks.layers[0].register_forward_hook(lambda *a: None)  # the user's stays
    before = _hook_counts(model)
    with qkv.capture(model):
        assert _hook_counts(model) != before and recording._ACTIVE.get() is not None
        model(torch.randint(0, 23, (1, 4)))
    assert _hook_counts(model) == before and recording._ACTIVE.get() is None

    def fail(module, args):
        raise RuntimeError("boom")

    bad = model.blocks.layers[1].ffn.register_forward_pre_hook(fail)
    before = _hook_counts(model)
    with pytest.raises(RuntimeError, match="boom"), qkv.capture(model, layers=[5]) as cap:
        model(torch.randint(0, 23, (1, 4)))  # no "layer 5" error on top of the real one
    assert _hook_counts(model) == before and recording._ACTIVE.get() is None
    assert len(cap.sites) == 2 and torch.is_grad_enabled()
    bad.remove(), user.remove()


def test_an_exception_inside_a_module_leaves_the_site_stack_right():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.attn = nn.Identity(), qkv.MultiHeadAttention(8, 2)

        def forward(self, x):
            with contextlib.suppress(TypeError):
                self.inner(x, "an argument Identity refuses")
            return qkv.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])

    model = Flaky()
    with qkv.capture(model) as cap:
        model(torch.randn(1, 3, 8))
    assert cap.sites == [""]  # attributed to Flaky, not to the inner module that raised


def test_calls_outside_the_model_or_after_exit_are_not_recorded():
    model, other = lm(), lm()
    x = torch.randint(0, 23, (1, 6))
    q = torch.randn(1, 2, 5, 4)
    with qkv.capture(model) as cap:
        other(x)
        qkv.scaled_dot_product_attention(q, q, q)
        model(x)
        worker = threading.Thread(target=model, args=(x,))  # another thread: its own business
        worker.start(), worker.join()
    assert len(cap) == 3
    model(x)
    assert len(cap) == 3


def test_nested_captures_of_different_models_both_record():
    model = lm()
    with qkv.capture(model, layers=[0]) as outer, qkv.capture(model.blocks.layers[2]) as inner:
        model(torch.randint(0, 23, (1, 5)))
    assert [r.name for r in outer] == ["blocks.layers.0.self_attn"]
    assert [r.name for r in inner] == ["self_attn"]
    torch.testing.assert_close(inner.records[0].probs.sum(-1), torch.ones(1, 4, 5))


def test_autocast_records_each_call_once():
    model = lm()
    with (
        torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16),
        qkv.capture(model) as cap,
    ):
        model(torch.randint(0, 23, (1, 7)))
    assert len(cap) == 3 and cap.records[0].probs.dtype == torch.bfloat16


# --- save and load ----------------------------------------------------------------------------


def test_save_load_round_trip_with_weights_only(tmp_path):
    model = lm()
    with qkv.capture(model, heads=[0, 3], rows=range(2, 4), scores=True) as cap:
        model.generate(torch.randint(0, 23, (2, 6)), 2)
    path = tmp_path / "attn.pt"
    cap.save(path)
    assert os.listdir(tmp_path) == ["attn.pt"]  # no temporary file left
    raw = torch.load(path, weights_only=True)  # plain tensors, lists and dicts
    assert raw["format"] == "qkv.capture" and len(raw["records"]) == len(cap)
    back = qkv.load_capture(str(path))
    assert back.sites == cap.sites and back.settings == cap.settings
    assert back.settings["rows"] == "range(2, 4)"
    for a, b in zip(cap, back):
        assert isinstance(b, CapturedAttention)
        assert (a.name, a.layer, a.call, a.shape, a.backend) == (
            b.name,
            b.layer,
            b.call,
            b.shape,
            b.backend,
        )
        for field in ("probs", "lse", "scores", "batch", "heads", "rows"):
            assert torch.equal(getattr(a, field), getattr(b, field))
    assert repr(back) == repr(cap)


def test_interrupted_save_leaves_the_old_file(tmp_path, monkeypatch):
    model = lm()
    with qkv.capture(model, rows=[0]) as cap:
        model(torch.randint(0, 23, (1, 4)))
    path = tmp_path / "attn.pt"
    cap.save(path)
    old = path.read_bytes()

    def interrupted(obj, f, *a, **kw):
        f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cap.save(path)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["attn.pt"]


def test_save_follows_the_umask(tmp_path):
    cap = qkv.Captured()
    old = os.umask(0o027)
    try:
        cap.save(tmp_path / "a.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o640


def test_load_refuses_other_files(tmp_path):
    torch.save({"state": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a qkv capture"):
        qkv.load_capture(tmp_path / "other.pt")


# --- errors and empty captures ----------------------------------------------------------------


def test_layer_beyond_the_sites_raises_at_exit_with_the_names():
    model = lm()
    with (
        pytest.raises(
            ValueError,
            match=r"layers \[20\] asked for, but attention was called "
            r"from 3 sites \(layers 0..2\).*'blocks.layers.0.self_attn'",
        ),
        qkv.capture(model, layers=[1, 20]),
    ):
        model(torch.randint(0, 23, (1, 4)))
    assert _hook_counts(model) == _hook_counts(lm())


def test_bad_requests_say_the_numbers():
    model = lm()
    x = torch.randint(0, 23, (1, 4))
    with pytest.raises(
        ValueError,
        match=r"no submodule named 'blocks.layer.1'; did you mean "
        r"'blocks.layers.1'",
    ):
        qkv.capture(model, layers="blocks.layer.1")
    with (
        pytest.raises(
            ValueError,
            match=r"heads \[4\] asked for, but the attention call of "
            r"'blocks.layers.0.self_attn' \(layer 0\) has heads "
            r"0..3 \(4 in all\)",
        ),
        qkv.capture(model, heads=[0, 4]),
    ):
        model(x)
    with (
        pytest.raises(
            ValueError,
            match=r"rows=\[9\] matched no query row: the recorded "
            r"calls had at most T=4",
        ),
        qkv.capture(model, rows=[9]),
    ):
        model(x)
    with pytest.raises(ValueError, match="ints >= 0"):
        qkv.capture(model, layers=[-1])
    with pytest.raises(TypeError, match="sorted"):
        qkv.capture(model, heads={0, 1})
    with pytest.raises(ValueError, match="keeps nothing"):
        qkv.capture(model, rows=[])
    with pytest.raises(TypeError, match=r"torch.nn.Module"):
        qkv.capture(lambda x: x)


@pytest.mark.filterwarnings("ignore:qkv.capture of DecoderLM")  # empty captures, on purpose
def test_nested_capture_of_one_model_and_reentry_refused():
    model = lm()
    session = qkv.capture(model)
    with (
        session,
        pytest.raises(ValueError, match=r"already inside a qkv.capture"),
        qkv.capture(model),
    ):
        pass
    with pytest.raises(RuntimeError, match="entered once"), session:
        pass
    with qkv.capture(model):  # free again after exit
        pass


def test_empty_capture_warns_and_says_so_on_access():
    model = nn.Sequential(nn.Linear(4, 4))
    q = torch.randn(1, 1, 3, 4)
    with (
        pytest.warns(
            UserWarning,
            match=r"no qkv attention call ran inside the model.*"
            r"1 qkv attention calls ran outside",
        ),
        qkv.capture(model) as cap,
    ):
        model(torch.randn(2, 4))
        qkv.scaled_dot_product_attention(q, q, q)
    assert len(cap) == 0 and list(cap) == []
    with pytest.raises(IndexError, match=r"recorded nothing.*torch_compat.patch"):
        cap.layer(0)
    with pytest.raises(KeyError, match="recorded nothing"):
        cap["0"]
    assert "nothing recorded" in repr(cap)


def test_lookup_errors_name_the_sites():
    model = lm()
    with qkv.capture(model, layers=[1]) as cap:
        model(torch.randint(0, 23, (1, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(cap.layer(1)) == 1 and len(cap["blocks.layers.1.self_attn"]) == 1
    with pytest.raises(
        IndexError,
        match=r"layer 0 called attention but was not recorded "
        r"\(layers=\[1\]\)",
    ):
        cap.layer(0)
    with pytest.raises(IndexError, match="3 sites that did"):
        cap.layer(7)
    with pytest.raises(TypeError, match=r"cap.layer\(i\)"):
        cap[0]
    assert "layer  0  blocks.layers.0.self_attn: not recorded" in repr(cap)
    assert "layer  1  blocks.layers.1.self_attn: 1 call, probs (1, 4, 4, 4)" in repr(cap)


# --- models that reach qkv from elsewhere -----------------------------------------------------


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's own
def test_torch_encoder_patched_by_torch_compat():
    import qkv.torch_compat

    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = qkv.torch_compat.patch(
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    ).eval()
    x = torch.randn(2, 9, 16)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True  # torch's polarity: True = padding
    with torch.no_grad(), qkv.capture(model, heads=[1, 3]) as cap:
        y = model(x, src_key_padding_mask=pad)
    assert cap.sites == ["layers.0.self_attn", "layers.1.self_attn"]
    attn = model.layers[0].self_attn
    h = model.layers[0].norm1(x) if model.layers[0].norm_first else x
    _, weights = attn(h, h, h, key_padding_mask=pad, average_attn_weights=False)
    torch.testing.assert_close(cap.records[0].probs[0], weights[0, [1, 3]], rtol=0, atol=1e-6)
    assert (cap.records[1].probs[1, :, :, 6:] == 0).all()  # padded keys get no weight
    assert y.shape == x.shape


def test_hugging_face_model_with_attn_implementation_qkv():
    transformers = pytest.importorskip("transformers")
    import qkv.integrations.transformers as qkv_hf

    qkv_hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("qkv")
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        own = model(input_ids=ids, output_attentions=True).attentions
        with qkv.capture(model, rows=[-1]) as cap:
            model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert cap.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert [r.call for r in cap.layer(1)] == [0, 1, 2]  # prefill, then one call per new token
    for layer in range(2):
        torch.testing.assert_close(
            cap.layer(layer)[0].probs, own[layer][:, :, -1:], rtol=0, atol=1e-6
        )
