"""Modules: SelfAttention in the seeds' terms, MultiHeadAttention equal to torch's module,
GQA equal to repeated K/V heads, traces consistent with outputs, AdditiveAttention."""

import copy
import itertools

import pytest
import torch
from torch import nn

import qkv
from qkv.examples import EXAMPLES


def _copy_grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


# --- SelfAttention -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_self_attention_from_weights_gives_seed_numbers(name):
    ex = EXAMPLES[name]
    t = ex.tensors()
    sa = qkv.SelfAttention.from_weights(t["w_q"], t["w_k"], t["w_v"], scale=ex.scale)
    out, trace = sa(t["x"], return_trace=True)
    torch.testing.assert_close(
        out, torch.tensor(ex.expected["outputs"], dtype=torch.float64), rtol=0, atol=5e-7
    )
    torch.testing.assert_close(trace.q, t["x"] @ t["w_q"])
    assert trace.probs.shape == (3, 3) if name.startswith("seed004") else (2, 2)


def test_self_attention_dv_differs_and_batched():
    sa = qkv.SelfAttention(6, 4, 5, dtype=torch.float64)
    x = torch.randn(2, 7, 6, dtype=torch.float64)
    out = sa(x)
    assert out.shape == (2, 7, 5)
    want = torch.softmax((x @ sa.W_Q) @ (x @ sa.W_K).transpose(1, 2) / 2.0, -1) @ (x @ sa.W_V)
    torch.testing.assert_close(out, want)
    keep = torch.tensor([[True] * 7, [True] * 3 + [False] * 4])
    out_masked = sa(x, key_mask=keep)
    q1, k1, v1 = x[1] @ sa.W_Q, x[1, :3] @ sa.W_K, x[1, :3] @ sa.W_V  # batch 1 sees 3 keys
    torch.testing.assert_close(out_masked[1], torch.softmax(q1 @ k1.T / 2.0, -1) @ v1)


def test_self_attention_from_weights_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"w_q and w_k of one shape \(C, d_k\)"):
        qkv.SelfAttention.from_weights(torch.ones(4, 3), torch.ones(4, 2), torch.ones(4, 3))


# --- MultiHeadAttention vs torch.nn.MultiheadAttention --------------------------------------

GRID = [
    pytest.param(*c, id="-".join(map(str, c)))
    for c in itertools.product(
        ["self", "cross"],  # self-attention (fused projection) or S != T
        ["bias", "nobias"],
        ["kvdim", "samedim"],  # kdim/vdim differ from embed_dim
        ["batch_first", "seq_first"],
        ["nomask", "attn_mask", "key_mask", "both"],
    )
    if not (c[0] == "self" and c[2] == "kvdim")
]


def _torch_mha(bias, kvdim, batch_first):
    kw = dict(kdim=12, vdim=10) if kvdim == "kvdim" else {}
    return nn.MultiheadAttention(
        16,
        4,
        bias=bias == "bias",
        batch_first=batch_first == "batch_first",
        dtype=torch.float64,
        **kw,
    )


@pytest.mark.parametrize("mode,bias,kvdim,layout,masks", GRID)
def test_from_torch_same_outputs_and_gradients(mode, bias, kvdim, layout, masks):
    tm = _torch_mha(bias, kvdim, layout)
    if bias == "bias":  # torch initialises biases to 0: make them count
        with torch.no_grad():
            tm.in_proj_bias.normal_()
            tm.out_proj.bias.normal_()
    ours = qkv.MultiHeadAttention.from_torch(tm, batch_first=True)  # fed (B, T, C) below
    B, T = 3, 7
    S = T if mode == "self" else 9
    q = torch.randn(B, T, 16, dtype=torch.float64)
    k = q if mode == "self" else torch.randn(B, S, tm.kdim, dtype=torch.float64)
    v = q if mode == "self" else torch.randn(B, S, tm.vdim, dtype=torch.float64)
    hidden = torch.rand(T, S) < 0.3  # torch: True = hidden
    hidden[:, 0] = False
    padding = torch.arange(S) >= torch.tensor([S, S - 2, 1])[:, None]  # torch: True = padding
    tkw, okw = {}, {}
    if masks in ("attn_mask", "both"):
        tkw["attn_mask"], okw["attn_mask"] = hidden, ~hidden
    if masks in ("key_mask", "both"):
        tkw["key_padding_mask"], okw["key_mask"] = padding, ~padding
    tin = [t.transpose(0, 1) if layout == "seq_first" else t for t in (q, k, v)]
    want, _ = tm(*tin, need_weights=False, **tkw)
    want = want.transpose(0, 1) if layout == "seq_first" else want
    got = ours(q, k if mode == "cross" else None, v if mode == "cross" else None, **okw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    cot = torch.randn_like(got)
    want.backward(cot)
    got.backward(cot)
    theirs = _copy_grads(tm)
    for name, g in _copy_grads(ours).items():
        torch.testing.assert_close(g, theirs[name], rtol=0, atol=1e-12, msg=name)


def test_from_torch_attention_weights_match_torch_average():
    tm = nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64)
    ours = qkv.MultiHeadAttention.from_torch(tm)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    _, w_avg = tm(x, x, x, need_weights=True, average_attn_weights=True)
    _, w_heads = tm(x, x, x, need_weights=True, average_attn_weights=False)
    _, trace = ours(x, return_trace=True)
    torch.testing.assert_close(trace.probs, w_heads)
    torch.testing.assert_close(trace.probs.mean(1), w_avg)


def test_fully_padded_row_gives_zero_where_torch_gives_nan():
    tm = nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    ours = qkv.MultiHeadAttention.from_torch(tm)
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    padding = torch.tensor([[False] * 4, [True] * 4])  # batch 1: every key is padding
    theirs, _ = tm(x, x, x, key_padding_mask=padding)
    assert theirs[1].isnan().all()
    out = ours(x, key_mask=~padding)
    torch.testing.assert_close(out[0], theirs[0])
    torch.testing.assert_close(out[1], tm.out_proj.bias.expand(4, 8))  # 0 heads, then + bias
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and bool((x.grad[1] == 0).all())


def test_to_torch_round_trip():
    ours = qkv.MultiHeadAttention(16, 4, kdim=12, vdim=10, dtype=torch.float64)
    q = torch.randn(2, 5, 16, dtype=torch.float64)
    k, v = torch.randn(2, 6, 12, dtype=torch.float64), torch.randn(2, 6, 10, dtype=torch.float64)
    tm = ours.to_torch()
    torch.testing.assert_close(
        tm(q, k, v, need_weights=False)[0], ours(q, k, v), rtol=0, atol=1e-12
    )
    back = qkv.MultiHeadAttention.from_torch(tm)
    torch.testing.assert_close(back(q, k, v), ours(q, k, v), rtol=0, atol=0)


def test_from_torch_refuses_bias_kv_and_zero_attn():
    for kw in (dict(add_bias_kv=True), dict(add_zero_attn=True)):
        with pytest.raises(ValueError, match="does not take add_bias_kv=True or add_zero_attn"):
            qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, **kw))
    with pytest.raises(TypeError, match=r"needs a torch.nn.MultiheadAttention"):
        qkv.MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_to_torch_refuses_gqa():
    with pytest.raises(ValueError, match="no grouped key/value heads"):
        qkv.MultiHeadAttention(16, 4, num_kv_heads=2).to_torch()


# --- GQA, traces, masks, config errors -------------------------------------------------------


@pytest.mark.parametrize("G", [1, 2, 4])
def test_gqa_equals_repeated_kv_heads(G):
    gqa = qkv.MultiHeadAttention(16, 4, num_kv_heads=G, dtype=torch.float64)
    full = qkv.MultiHeadAttention(16, 4, dtype=torch.float64)
    D, rep = 4, 4 // G
    with torch.no_grad():  # full's K/V heads: each of gqa's G heads repeated H/G times
        gqa.in_proj_bias.normal_()
        w_q, w_k, w_v = gqa.in_proj_weight.split([16, G * D, G * D])
        b_q, b_k, b_v = gqa.in_proj_bias.split([16, G * D, G * D])

        def expand(w):
            return w.reshape(G, D, *w.shape[1:]).repeat_interleave(rep, 0).reshape(16, *w.shape[1:])

        full.in_proj_weight.copy_(torch.cat([w_q, expand(w_k), expand(w_v)]))
        full.in_proj_bias.copy_(torch.cat([b_q, expand(b_k), expand(b_v)]))
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(gqa(x, is_causal=True), full(x, is_causal=True), rtol=0, atol=1e-12)
    assert gqa.W_K.shape == (16, G * D)


def test_trace_consistent_with_output():
    mha = qkv.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out, tr = mha(x, key_mask=keep, return_trace=True)
    assert tr.probs.shape == (2, 4, 6, 6) and tr.heads.shape == (2, 4, 6, 4)
    assert tr.k.shape == (2, 2, 6, 4)
    v = tr.v.repeat_interleave(2, 1)  # (B, H, S, D)
    torch.testing.assert_close(tr.probs @ v, tr.heads)
    concat = tr.heads.transpose(1, 2).reshape(2, 6, 16)  # (B, T, H*D)
    torch.testing.assert_close(concat @ mha.W_O + mha.out_proj.bias, out)
    torch.testing.assert_close(
        x @ mha.W_Q + mha.in_proj_bias[:16], tr.q.transpose(1, 2).reshape(2, 6, 16)
    )
    assert bool((tr.probs[1, ..., 4:] == 0).all())


def test_unbatched_input():
    mha = qkv.MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    out, tr = mha(x, return_trace=True)
    assert out.shape == (5, 8) and tr.probs.shape == (2, 5, 5)
    torch.testing.assert_close(out, mha(x[None])[0])


def test_dropout_only_in_training():
    mha = qkv.MultiHeadAttention(8, 2, dropout=0.5, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x))
    mha.train()
    assert (mha(x) - mha(x)).abs().max() > 0


@pytest.mark.parametrize(
    "kw,pattern",
    [
        (
            dict(embed_dim=10, num_heads=3),
            r"embed_dim=10 is not a multiple of num_heads=3.*\[1, 2, 5, 10\]",
        ),
        (
            dict(embed_dim=16, num_heads=4, num_kv_heads=3),
            r"num_heads must be a multiple of num_kv_heads",
        ),
        (dict(embed_dim=16, num_heads=0), r"num_heads must be a positive int, got 0"),
        (dict(embed_dim=16, num_heads=4, dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_config_errors(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        qkv.MultiHeadAttention(**kw)


def test_forward_errors():
    mha = qkv.MultiHeadAttention(8, 2)
    with pytest.raises(
        ValueError, match=r"query must be \(B, L, 8\) or unbatched \(L, 8\), got shape \(2, 5, 7\)"
    ):
        mha(torch.randn(2, 5, 7))
    with pytest.raises(TypeError, match=r"key_mask must be a bool tensor.*pass ~key_padding_mask"):
        mha(torch.randn(2, 5, 8), key_mask=torch.ones(2, 5))
    with pytest.raises(
        ValueError, match=r"key_mask must have shape \(B, S\) = \(2, 5\), got \(2, 4\)"
    ):
        mha(torch.randn(2, 5, 8), key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must share the batch size"):
        mha(torch.randn(2, 5, 8), torch.randn(3, 5, 8))


DTYPE_MODULES = {
    "SelfAttention": lambda: qkv.SelfAttention(8, 4),
    "MultiHeadAttention": lambda: qkv.MultiHeadAttention(8, 2),
    "AdditiveAttention": lambda: qkv.AdditiveAttention(8, 5),
}


@pytest.mark.parametrize("name", list(DTYPE_MODULES))
def test_wrong_input_dtype_named_with_the_fix(name):
    """Token ids or float64 data into float32 weights: qkv's message, not torch's "mat1 and
    mat2 must have the same dtype" (issue 12, item 16a)."""
    module = DTYPE_MODULES[name]()
    tokens = torch.randint(0, 100, (2, 5))  # (B, T): ids not yet embedded
    with pytest.raises(
        TypeError,
        match=r"query has dtype torch.int64 but the module's weights "
        r"are torch.float32: .*embed token ids first",
    ):
        module(tokens)
    with pytest.raises(TypeError, match=r"query has dtype torch.int64.*nn.Embedding"):
        module(torch.zeros(2, 5, 8, dtype=torch.long))
    x64 = torch.randn(2, 5, 8, dtype=torch.float64)
    with pytest.raises(
        TypeError,
        match=r"query has dtype torch.float64 but the module's weights "
        r"are torch.float32: cast the input with "
        r"query.to\(torch.float32\), or the module with "
        r"module.to\(torch.float64\)",
    ):
        module(x64)
    torch.testing.assert_close(
        module.to(torch.float64)(x64), module.float()(x64.float()).double(), rtol=1e-5, atol=1e-6
    )  # either fix works


@pytest.mark.parametrize("kvdim", [8, 6], ids=["fused", "kdim-vdim"])
def test_wrong_key_dtype_named(kvdim):
    mha = qkv.MultiHeadAttention(8, 2, kdim=kvdim, vdim=kvdim)
    x, kv = torch.randn(2, 5, 8), torch.randn(2, 4, kvdim)
    with pytest.raises(
        TypeError, match=r"^key has dtype torch.float16 but the module's weights are torch.float32"
    ):
        mha(x, kv.half(), kv)
    with pytest.raises(TypeError, match=r"^value has dtype torch.float64"):
        mha(x, kv, kv.double())


def test_autocast_input_dtypes_are_left_to_autocast():
    """Under torch.autocast the projections cast input and weights themselves: no refusal,
    and the result is as close to float32's as a bfloat16 copy of the module is."""
    mha = qkv.MultiHeadAttention(16, 2)
    x = torch.randn(2, 5, 16)
    exact = mha(x)
    low = qkv.MultiHeadAttention(16, 2, dtype=torch.bfloat16)
    low.load_state_dict(mha.state_dict())
    low_err = (low(x.bfloat16()).float() - exact).abs().max()
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        amp = mha(x)
        mixed = mha(x.bfloat16())  # bfloat16 input, float32 weights: autocast's business
    assert amp.dtype == mixed.dtype == torch.bfloat16
    assert (amp.float() - exact).abs().max() <= 2 * low_err
    assert (mixed.float() - exact).abs().max() <= 2 * low_err


# --- AdditiveAttention ------------------------------------------------------------------------


def test_additive_matches_formula_and_masks():
    add = qkv.AdditiveAttention(6, 5, key_dim=4, dtype=torch.float64)
    q = torch.randn(2, 3, 6, dtype=torch.float64)
    k = torch.randn(2, 4, 4, dtype=torch.float64)
    v = torch.randn(2, 4, 7, dtype=torch.float64)
    out, tr = add(q, k, v, return_trace=True)
    Wq, Wk, w = add.W_q.weight, add.W_k.weight, add.v.weight[0]
    scores = torch.stack(
        [
            torch.stack(
                [
                    torch.stack([w @ torch.tanh(Wq @ q[b, i] + Wk @ k[b, j]) for j in range(4)])
                    for i in range(3)
                ]
            )
            for b in range(2)
        ]
    )  # (B, T, S), one score at a time
    torch.testing.assert_close(tr.scores, scores)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    keep = torch.tensor([[True, True, False, False], [False] * 4])
    out, tr = add(q, k, v, key_mask=keep, return_trace=True)
    torch.testing.assert_close(out[0], torch.softmax(scores[0, :, :2], -1) @ v[0, :2])
    assert bool((out[1] == 0).all()) and not out.isnan().any()


def test_additive_causal_and_gradients_of_empty_rows():
    add = qkv.AdditiveAttention(4, 8, dtype=torch.float64)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(5, 5, dtype=torch.bool)
    keep[2, :3] = False  # with causal, row 2 has nothing left
    out, tr = add(x, attn_mask=keep, is_causal=True, return_trace=True)
    assert bool((tr.probs.triu(1) == 0).all())
    assert bool((out[2] == 0).all())
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.autograd.gradcheck(lambda x: add(x, is_causal=True), (x,))


def test_fused_in_projection_equals_separate_projections():
    """Self-attention takes one fused matmul; the same input passed as a separate tensor goes
    through three projections. Both must agree."""
    mha = qkv.MultiHeadAttention(16, 4, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    fused = mha(x)
    separate = mha(x, x.clone(), x.clone())
    torch.testing.assert_close(fused, separate, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padded"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train-dropout"])
@pytest.mark.parametrize("G", [4, 2], ids=["mha", "gqa"])
def test_a_decoding_step_takes_its_short_way_to_the_general_ways_bits(dtype, padded, training, G):
    """A decoding step whose only input is the new positions (B, T, C) skips the general
    checks it passes (``MultiHeadAttention._decode_step``): steps of one and of three new
    positions, a cache with padding from its prompt, dropout in training (the same draws),
    give the general way's bits and leave the cache as it leaves it. The short way is taken
    (counted), and not by a subclass with attention of its own, nor by calls it does not
    take (key_mask, unbatched, another dtype), which meet the general way's checks."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=G, dropout=0.25 if training else 0.0)
    mha = mha.to(dtype)
    mha.train(training)
    prompt = torch.randn(2, 5, 32, dtype=dtype)
    real = torch.tensor([[True] * 5, [False, False, True, True, True]]) if padded else None
    steps = [torch.randn(2, n, 32, dtype=dtype) for n in (1, 3, 1)]
    caches = []
    general = qkv.MultiHeadAttention._decode_step
    for short in (True, False):
        cache = mha.new_cache(2, 16)
        mha(prompt, key_mask=real, cache=cache)
        taken = []

        def counted(self, query, cache, short=short, taken=taken):
            taken.append(1)
            return general(self, query, cache) if short else None

        outs = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(qkv.MultiHeadAttention, "_decode_step", counted)
            for i, x in enumerate(steps):
                torch.manual_seed(i)
                outs.append(mha(x, cache=cache))
        assert len(taken) == len(steps)
        caches.append((cache, outs))
    (short_cache, short_outs), (cache, outs) = caches
    for a, b in zip(short_outs, outs):
        assert torch.equal(
            a.view(torch.int16 if dtype != torch.float32 else torch.int32),
            b.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )
    assert short_cache.position == cache.position == 10
    assert torch.equal(short_cache.keys, cache.keys) and torch.equal(
        short_cache.values, cache.values
    )

    local = qkv.LocalMultiHeadAttention(32, 4, window=2).to(dtype).eval()
    assert local._decode_step(steps[0], local.new_cache(2, 16)) is None
    assert mha._decode_step(steps[0][0], mha.new_cache(2, 16)) is None  # unbatched
    assert mha._decode_step(steps[0].double(), mha.new_cache(2, 16)) is None
    with pytest.raises(ValueError, match="key_mask must have shape"):
        mha(steps[0], key_mask=torch.ones(2, 2, dtype=torch.bool), cache=mha.new_cache(2, 16))


@pytest.mark.parametrize("name", ["in_proj_weight", "in_proj_bias"])
@pytest.mark.parametrize("G", [4, 2])
def test_parametrized_and_functional_call_weights_reach_every_way(G, name):
    """A fused in-projection weight or bias that is no parameter of the module (a
    parametrization: weight norm, ``torch.nn.utils.parametrize``) is read as the module's
    attribute: the short ways read ``_parameters`` directly, which raised KeyError for such a
    weight, in a forward and in a decoding step (and would have dropped such a bias).
    ``torch.func.functional_call``'s weights are the ones used."""
    from torch.func import functional_call
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 4, num_kv_heads=G, dtype=torch.float64).eval()
    doubled = copy.deepcopy(mha)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        doubled.in_proj_bias.copy_(mha.in_proj_bias)
        getattr(doubled, name).mul_(2)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    want = doubled(x, is_causal=True)
    assert not torch.allclose(want, mha(x, is_causal=True))

    class Twice(nn.Module):
        def forward(self, w):
            return 2 * w

    parametrize.register_parametrization(mha, name, Twice())
    torch.testing.assert_close(mha(x, is_causal=True), want, rtol=0, atol=1e-12)
    cache = mha.new_cache(2, 8)
    with torch.no_grad():
        steps = torch.cat([mha(x[:, i : i + 1], cache=cache) for i in range(5)], 1)
    torch.testing.assert_close(steps, want, rtol=0, atol=1e-12)

    plain = copy.deepcopy(doubled)
    halves = {name: p / 2 for name, p in plain.named_parameters()}
    with torch.no_grad():
        for p in doubled.parameters():
            p.div_(2)
    torch.testing.assert_close(functional_call(plain, halves, (x,)), doubled(x), rtol=0, atol=0)


@pytest.mark.parametrize("where", ["own", "own-pre", "global", "global-pre"])
def test_out_proj_hooks_run_in_a_forward_and_a_decoding_step(where):
    """out_proj is multiplied without its module call only while calling it would run its
    forward alone: a hook of its own or a global one (forward or pre-forward) runs, in float32,
    in a forward and in each decoding step."""
    from torch.nn.modules import module as registry

    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 3, 16)
    seen = []
    hook = {
        "own": lambda: mha.out_proj.register_forward_hook(lambda m, i, o: seen.append(m)),
        "own-pre": lambda: mha.out_proj.register_forward_pre_hook(lambda m, i: seen.append(m)),
        "global": lambda: registry.register_module_forward_hook(lambda m, i, o: seen.append(m)),
        "global-pre": lambda: registry.register_module_forward_pre_hook(
            lambda m, i: seen.append(m)
        ),
    }[where]()
    try:
        with torch.no_grad():
            mha(x)
            cache = mha.new_cache(1, 8)
            for i in range(3):
                mha(x[:, i : i + 1], cache=cache)
    finally:
        hook.remove()
    assert sum(m is mha.out_proj for m in seen) == 4
    seen.clear()
    with torch.no_grad():
        mha(x)
    assert seen == []


def test_a_cache_trained_through_starts_each_sequence_afresh():
    """Decoding with a gradient (the module's weights want one, no ``no_grad``) makes the
    cache's buffers part of the sequence's graph: gradients reach every position's
    projections, to the values of the same sequence run at once. ``reset`` ends the
    sequence: the next one's backward runs (it raised "backward through the graph a second
    time" into the last one's) and gives the gradients of a fresh cache."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 2)
    xs = [torch.randn(1, n, 16) for n in (3, 1, 2)]

    def sequence(cache, x, y):
        mha.zero_grad()
        mha(x, cache=cache)
        mha(y, cache=cache).sum().backward()
        return [p.grad.clone() for p in mha.parameters()]

    def at_once(x, y):  # the two steps as one causal call over the positions
        mha.zero_grad()
        mha(torch.cat([x, y], 1), is_causal=True)[:, x.shape[1] :].sum().backward()
        return [p.grad.clone() for p in mha.parameters()]

    cache = mha.new_cache(1, 8)
    first = sequence(cache, xs[0], xs[1])
    for a, b in zip(first, at_once(xs[0], xs[1])):
        torch.testing.assert_close(a, b)
    assert cache._k.grad_fn is not None  # (the sequence's graph)
    cache.reset()
    assert cache._k.grad_fn is None and cache._v.grad_fn is None
    again = sequence(cache, xs[2], xs[1])
    for a, b in zip(again, sequence(mha.new_cache(1, 8), xs[2], xs[1])):
        torch.testing.assert_close(a, b)
