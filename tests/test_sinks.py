"""Attention sinks (gpt-oss; issue 30, item 3): one logit per query head joins every row's
softmax as a key with no value. Checked against plain float64 math written here (softmax over
the scores with the sink as one more column), on every backend that takes them, forward,
weights and gradients (the sink's too), and against transformers' eager gpt-oss."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M

B, H, G, T, D = 2, 4, 2, 29, 8

CASES = {
    "none": lambda: ({}, torch.ones(T, T, dtype=torch.bool)),
    "causal": lambda: (dict(is_causal=True), torch.ones(T, T).tril().bool()),
    "window": lambda: (
        dict(mask_mod=M.sliding_window(5)),
        M.to_dense(M.sliding_window(5), 1, 1, T, T)[0, 0],
    ),
    "empty-rows": lambda: (dict(attn_mask=_lengths()), _lengths()),  # batch 0 sees no key
    "alibi": lambda: (dict(is_causal=True, score_mod=M.alibi(H)), torch.ones(T, T).tril().bool()),
}


def _lengths() -> torch.Tensor:
    return (torch.arange(T) < torch.tensor([0, 9]).view(B, 1, 1, 1)).expand(B, 1, T, T)


def _plain(q, k, v, sinks, keep, case):
    """softmax([q k^T * scale (+ bias), sink]) without the sink's column, times v."""
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    s = q @ k.transpose(-2, -1) / D**0.5  # (B, H, T, T)
    if case == "alibi":
        pos = torch.arange(T)
        s = s + M.alibi_slopes(H).double().view(1, H, 1, 1) * (pos.view(1, -1) - pos.view(-1, 1))
    s = s.masked_fill(~keep, float("-inf"))
    sink = sinks.view(1, H, 1) if sinks.dim() == 1 else sinks  # per head, or per row
    p = torch.softmax(torch.cat([s, sink.expand(B, H, T).unsqueeze(-1)], -1), -1)
    return p[..., :-1] @ v, p[..., :-1]


@pytest.mark.parametrize("per", ["head", "row"])
@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_sinks_equal_plain_math_in_float64(case, backend, per):
    """Per head ``(H,)`` (gpt-oss) and per query row ``(B, H, T)`` (inkling2's sinks come from
    a projection of each token)."""
    kw, keep = CASES[case]()
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, T, D, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(B, G, T, D, dtype=torch.float64, generator=gen, requires_grad=True)
        for _ in range(2)
    )
    shape = (H,) if per == "head" else (B, H, T)
    sinks = torch.randn(shape, dtype=torch.float64, generator=gen, requires_grad=True)
    want, want_p = _plain(q, k, v, sinks, keep, case)
    out, trace = qkv.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, sinks=sinks, backend=backend, return_trace=True, **kw
    )
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(trace.probs, want_p)  # the real keys' share only
    got_g = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    want_g = torch.autograd.grad(want.square().sum(), (q, k, v, sinks))
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)
    if case == "empty-rows":  # batch 0: no key at all, output and gradients 0
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.equal(got_g[0][0], torch.zeros_like(got_g[0][0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_sinks_hold_the_tolerance_policy_against_float64(dtype):
    from qkv.testing import assert_tolerance

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, 200, 32, generator=gen).to(dtype) for _ in range(3))
    sinks = torch.randn(H, generator=gen)
    kw = dict(mask_mod=M.sliding_window(40), sinks=sinks)
    got = qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **kw)
    golden = qkv.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), backend="reference", **{**kw, "sinks": sinks.double()}
    )
    baseline = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **kw)
    assert_tolerance(got, golden, baseline)


def test_sinks_are_checked_and_torch_says_it_has_none():
    q = torch.randn(1, H, 4, D)
    with pytest.raises(ValueError, match=r"4 heads, got shape \(3,\)"):
        qkv.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be a tensor"):
        qkv.scaled_dot_product_attention(q, q, q, sinks=[0.0] * H)
    with pytest.raises(qkv.BackendUnsupportedError, match="no attention sinks"):
        qkv.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(H), backend="torch")


def test_sinks_compile_as_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    q = torch.randn(B, H, T, D, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)

    def attend(q, sinks):
        return qkv.scaled_dot_product_attention(q, q, q, is_causal=True, sinks=sinks)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(attend, backend=counter, fullgraph=True)(q, sinks)
    want = attend(q, sinks)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        torch.autograd.grad(got.sum(), sinks), torch.autograd.grad(want.sum(), sinks)
    )
    assert counter.frame_count == 1


def test_gpt_oss_equals_transformers_eager():
    """gpt-oss built tiny (a sliding-window layer, then a full one): logits at real positions,
    the weights, and the gradients of every layer's sinks."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no gpt-oss")
    import qkv.integrations.transformers as qkv_hf

    qkv_hf.register()
    cfg = transformers.GptOssConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # zeros at init: make them matter
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :3] = 0
    real = pad.bool()
    got = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=pad, output_attentions=True)
        out.logits[real].square().sum().backward()
        got[impl] = (
            out.logits[real].detach(),
            [a[0].detach() for a in out.attentions],
            [layer.self_attn.sinks.grad.clone() for layer in model.model.layers],
        )
    torch.testing.assert_close(got["qkv"][0], got["eager"][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(got["qkv"][1], got["eager"][1]):  # batch 0: no padded rows
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(got["qkv"][2], got["eager"][2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_sinks_keep_the_tiled_custom_op_under_compile():
    """A sliding window with sinks (gpt-oss's windowed layers) compiles to the tiled op, not a
    dense mask; output and every gradient, the sinks' included, equal eager."""
    q, k, v = (torch.randn(B, H, 96, D, requires_grad=True) for _ in range(3))
    sinks = torch.randn(H, requires_grad=True)

    def attend(q, k, v, sinks):
        return qkv.scaled_dot_product_attention(q, k, v, mask_mod=M.sliding_window(20), sinks=sinks)

    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    got = torch.compile(attend, backend=keep, fullgraph=True)(q, k, v, sinks)
    want = attend(q, k, v, sinks)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        torch.autograd.grad(got.square().sum(), (q, k, v, sinks)),
        torch.autograd.grad(want.square().sum(), (q, k, v, sinks)),
    )
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert "qkv.tiled_forward" in ops and len(graphs) == 1


# --- a -inf sink on rows that may attend to nothing (issue 41, item 1) ------------------------


def _plain_empty_safe(q, k, v, sinks, keep):
    """softmax([scores, sink]) without the sink's column, times v, in float64 written out: the
    row max taken over the allowed scores and the sink, 0 where both are -inf, so a row with
    no key and a -inf sink has all weights 0 (output 0, gradients 0) as the contract says."""
    Hq = q.shape[1]
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, T, S)
    s = s.masked_fill(~keep, float("-inf"))
    sink = sinks.view(1, Hq, 1, 1).expand(*s.shape[:-1], 1)  # (B, H, T, 1)
    z = torch.cat([s, sink], -1)  # (B, H, T, S + 1)
    top = z.amax(-1, keepdim=True).detach()
    e = torch.exp(z - torch.where(torch.isneginf(top), 0.0, top))  # e^-inf = 0, no NaN
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, 1.0)  # (B, H, T, S + 1)
    return p[..., :-1] @ v  # (B, H, T, Dv)


_EMPTY_ROW_CASES = {
    # the repro: row 0 may attend to nothing, one head, its sink -inf
    "H1-T3-S3-row0-sink-ninf": (1, 3, 3, [float("-inf")], "row0"),
    # per-head sinks: only the -inf head's empty rows are the corner
    "H2-T3-S3-row0-sinks-ninf-0.5": (2, 3, 3, [float("-inf"), 0.5], "row0"),
    # bottom-right causal with T > S: rows 0 and 1 see no key
    "H2-T5-S3-bottom-right-sinks-ninf-0.5": (2, 5, 3, [float("-inf"), 0.5], "bottom_right"),
}
_LOW = {torch.float64: None, torch.float32: 1, torch.bfloat16: 1, torch.float16: 1}


def _compiled_tiled(q, k, v, **kw):
    torch._dynamo.reset()

    def attend(q, k, v, sinks):
        return qkv.scaled_dot_product_attention(q, k, v, sinks=sinks, backend="tiled", **kw)

    return torch.compile(attend, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("dtype", list(_LOW), ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("backend", ["tiled", "auto", "reference", "tiled-compiled"])
@pytest.mark.parametrize("case", list(_EMPTY_ROW_CASES))
def test_minus_inf_sink_on_a_row_with_no_key_outputs_zero(case, backend, dtype):
    """A row that may attend to nothing, whose sink is -inf: output exactly 0, the sink's
    gradient 0 from that row, nothing NaN (tiled gave NaN: logaddexp(-inf, -inf) = -inf, then
    exp(-inf - -inf)). Compared with plain float64 math written above; lower dtypes within
    the tolerance policy, the baseline that math in the dtype."""
    from qkv.testing import GRAD_FACTOR, assert_tolerance

    Hq, Tq, Sk, sink_values, shape = _EMPTY_ROW_CASES[case]
    if shape == "row0":
        keep = torch.ones(Tq, Sk, dtype=torch.bool)
        keep[0] = False
        kw = dict(attn_mask=keep)
    else:
        keep = torch.arange(Sk).view(1, -1) <= torch.arange(Tq).view(-1, 1) + (Sk - Tq)
        kw = dict(mask_mod=M.causal(align="bottom_right"))
    empty = ~keep.any(-1)  # (T,)
    gen = torch.Generator().manual_seed(41)
    q64 = torch.randn(2, Hq, Tq, 4, dtype=torch.float64, generator=gen)
    k64, v64 = (torch.randn(2, Hq, Sk, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    dout64 = torch.randn(2, Hq, Tq, 4, dtype=torch.float64, generator=gen)
    sinks64 = torch.tensor(sink_values, dtype=torch.float64)
    # the golden is the math on the inputs as the dtype holds them (DESIGN.md's policy), not
    # on values the kernel never saw: else the inputs' rounding, shared by kernel and baseline,
    # decides which is nearer by luck (an H100's float16 case failed on it)
    q64, k64, v64, dout64, sinks64 = (
        t.to(dtype).to(torch.float64) for t in (q64, k64, v64, dout64, sinks64)
    )

    def leaves(dt):
        return [t.to(dt).requires_grad_(True) for t in (q64, k64, v64, sinks64)]

    def grads_of(out, ins, dt):
        return torch.autograd.grad(out, ins, dout64.to(dt))

    ins = leaves(dtype)
    if backend == "tiled-compiled":
        out = _compiled_tiled(*ins[:3], **kw)(*ins)
    else:
        out = qkv.scaled_dot_product_attention(*ins[:3], sinks=ins[3], backend=backend, **kw)
    got = grads_of(out, ins, dtype)
    gold_ins = leaves(torch.float64)
    gold = _plain_empty_safe(*gold_ins, keep)
    gold_g = grads_of(gold, gold_ins, torch.float64)

    assert not out.isnan().any() and not any(g.isnan().any() for g in got)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.equal(got[0][:, :, empty], torch.zeros_like(got[0][:, :, empty]))  # dq
    if dtype == torch.float64:
        torch.testing.assert_close(out, gold)
        for a, b in zip(got, gold_g):
            torch.testing.assert_close(a, b)
        return
    base_ins = leaves(dtype)
    base = _plain_empty_safe(*base_ins, keep)
    base_g = grads_of(base, base_ins, dtype)
    assert_tolerance(out, gold, base)
    for name, a, g, b in zip(("q", "k", "v", "sinks"), got, gold_g, base_g):
        assert_tolerance(a, g, b, factor=GRAD_FACTOR, name=f"grad {name}")


# --- the trace's lse with sinks, and sinks under compile (issue 41, item 6) -------------------


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_the_trace_lse_includes_the_sink_and_is_the_sink_on_a_row_with_no_key(backend):
    """AttentionTrace's lse is logaddexp(lse of the scores, sink): the sink itself on a row
    that may attend to nothing (-inf only for a -inf sink), and the weights of a row sum to
    1 - exp(sink - lse). Float64 math written here."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 3, 4, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[1] = False  # row 1 may attend to nothing
    sinks = torch.tensor([float("-inf"), 0.5, -30.0], dtype=torch.float64)
    _, trace = qkv.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, sinks=sinks, backend=backend, return_trace=True
    )
    s = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(~keep, float("-inf"))  # (1, 3, 4, 4)
    col = sinks.view(1, 3, 1, 1).expand(1, 3, 4, 1)
    want = torch.logsumexp(torch.cat([s, col], -1), -1)  # (1, 3, 4); -inf, 0.5, -30 on row 1
    torch.testing.assert_close(trace.lse, want)
    assert trace.lse[0, :, 1].tolist() == [float("-inf"), 0.5, -30.0]
    share = torch.exp(sinks.view(1, 3, 1) - want).nan_to_num(0.0)  # the sink's weight
    torch.testing.assert_close(trace.probs.sum(-1)[:, :, [0, 2, 3]], (1 - share)[:, :, [0, 2, 3]])
    assert torch.equal(trace.probs[0, :, 1], torch.zeros(3, 4, dtype=torch.float64))


_COMPILED_SINK_MASKS = {
    "none": dict,
    "causal": lambda: dict(is_causal=True),
    "window": lambda: dict(mask_mod=M.sliding_window(20)),
    "document": lambda: dict(mask_mod=M.document(torch.arange(96) // 30)),
    "causal-alibi": lambda: dict(is_causal=True, score_mod=M.alibi(H)),
    "causal-softcap": lambda: dict(is_causal=True, score_mod=M.softcap(3.0)),
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", list(_COMPILED_SINK_MASKS))
def test_sinks_under_compile_hold_no_T_by_S_tensor(name, grad):
    """O(T + S) memory with sinks under compile: the call stays in the tiled op, and no value
    in the graph has T * S elements (softcap with sinks ran the dense math, a (B, H, T, S)
    score matrix, before the op carried softcap)."""
    Tn = 96
    q, k, v = (torch.randn(1, H, Tn, 16, requires_grad=grad) for _ in range(3))
    sinks = torch.randn(H, requires_grad=grad)
    kw = _COMPILED_SINK_MASKS[name]()

    def attend(q, k, v, sinks):
        return qkv.scaled_dot_product_attention(q, k, v, sinks=sinks, **kw)

    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    got = torch.compile(attend, backend=keep, fullgraph=True)(q, k, v, sinks)
    torch.testing.assert_close(got, attend(q, k, v, sinks))
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    assert "qkv.tiled_forward" in {str(n.target) for n in nodes if n.op == "call_function"}
    sizes = [
        n.meta["example_value"].numel() for n in nodes if _is_tensor(n.meta.get("example_value"))
    ]
    assert max(sizes) < Tn * Tn, f"a value of {max(sizes)} elements in the graph"


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)
