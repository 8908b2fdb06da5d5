"""qkv.torch_compat: the drop-in equals torch.nn.MultiheadAttention (float64: outputs, weights,
gradients of every parameter) on every layout, mask kind and flag; rows with nothing to attend
give 0 where torch gives NaN; patch() takes effect inside torch's Transformer layers, their
fused inference kernel and nested tensors included; from_torch refuses batch_first=False.

Cases marked "ported" carry facts and inputs over from PyTorch's own tests
(test/nn/test_multihead_attention.py, test/test_transformers.py).

Shape alphabet: B batch, H heads, T query length, S key length, E embed_dim.
"""

import copy
import itertools
import math
import warnings

import pytest
import torch
from torch import nn

import qkv
import qkv.torch_compat as tc

DT = torch.float64
E, H = 8, 2

CONFIGS = {  # module keyword arguments; "self" calls with query is key is value
    "self": {},
    "cross": {},
    "kvdim": dict(kdim=6, vdim=5),
    "nobias": dict(bias=False),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn": dict(add_zero_attn=True),
    "bias_kv+zero_attn+kvdim": dict(add_bias_kv=True, add_zero_attn=True, kdim=6, vdim=5),
}
MASKS = [
    "none",
    "bool_am2",
    "bool_am3",
    "float_am2",
    "float_am3",
    "bool_kpm",
    "float_kpm",
    "bool_am2+kpm",
    "float_am3+kpm",
    "mixed_am2+kpm",
]
LAYOUTS = ["batch_first", "seq_first", "unbatched"]


def _pair(batch_first=False, **kw):
    """torch's module and the drop-in with the same parameters (biases made nonzero)."""
    torch.manual_seed(1)
    theirs = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=DT, **kw)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "bias" in name:
                p.normal_()
    ours = tc.MultiheadAttention(E, H, batch_first=batch_first, dtype=DT, **kw)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _inputs(layout, config, m, B=3, T=4):
    """query, key, value as leaves in the module's layout (one tensor for "self")."""
    B = 1 if layout == "unbatched" else B
    S = T if config == "self" else 5
    move = {
        "batch_first": lambda t: t,
        "seq_first": lambda t: t.transpose(0, 1),
        "unbatched": lambda t: t[0],
    }[layout]

    def leaf(*shape):
        return move(torch.randn(*shape, dtype=DT)).detach().requires_grad_()

    q = leaf(B, T, E)
    if config == "self":
        return q, q, q
    return q, leaf(B, S, m.kdim), leaf(B, S, m.vdim)


def _masks(kind, B, T, S, unbatched):
    """torch's masks (True = NOT allowed, float added); key 0 stays visible to every query."""
    g = torch.Generator().manual_seed(2)
    hidden2 = torch.rand(T, S, generator=g) < 0.4  # (T, S)
    hidden3 = torch.rand(B * H, T, S, generator=g) < 0.4  # (B*H, T, S)
    hidden2[:, 0] = hidden3[..., 0] = False
    padding = torch.arange(S) >= torch.tensor([S - 2, S, 1])[:B, None]  # (B, S)

    def additive(hidden):
        return torch.randn(hidden.shape, generator=g, dtype=DT).masked_fill(hidden, -math.inf)

    am = {"am2": hidden2, "am3": hidden3}
    kw = {}
    for part in kind.split("+"):
        if part.endswith(("am2", "am3")):
            mask = am[part[-3:]]
            kw["attn_mask"] = mask if part.startswith(("bool", "mixed")) else additive(mask)
        if part.endswith("kpm"):
            float_kpm = kind.startswith(("float", "mixed"))
            kw["key_padding_mask"] = additive(padding) if float_kpm else padding
    if unbatched and "key_padding_mask" in kw:
        kw["key_padding_mask"] = kw["key_padding_mask"][0]  # (S,)
    return kw


def _call(m, *args, **kw):
    """The module's result and the warnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = m(*args, **kw)
    return res, [str(w.message) for w in seen]


def _grads(out, module, inputs, cot):
    """Gradients of ``(out * cot).sum()`` for every parameter (by name) and input."""
    names, params = zip(*module.named_parameters())
    leaves = list(dict.fromkeys(inputs))  # "self": one tensor
    grads = torch.autograd.grad(out, params + tuple(leaves), cot)
    return dict(zip(names, grads)), grads[len(params) :]


GRID = [
    pytest.param(
        layout,
        config,
        mask,
        id=f"{'T4' if layout == 'unbatched' else 'B3-T4'}-"
        f"{'S4' if config == 'self' else 'S5'}-{layout}-{config}-{mask}",
    )
    for layout, config, mask in itertools.product(LAYOUTS, CONFIGS, MASKS)
]


@pytest.mark.parametrize("layout,config,masks", GRID)
def test_same_outputs_weights_and_gradients_as_torch(layout, config, masks):
    theirs, ours = _pair(batch_first=layout == "batch_first", **CONFIGS[config])
    q, k, v = _inputs(layout, config, theirs)
    unbatched = layout == "unbatched"
    B = 1 if unbatched else q.shape[0 if layout == "batch_first" else 1]
    T, S = q.shape[-2 if layout != "seq_first" else 0], k.shape[-2 if layout != "seq_first" else 0]
    kw = _masks(masks, B, T, S, unbatched)
    for need_weights, average in ((True, True), (True, False), (False, True)):
        (want, w_want), warned_t = _call(
            theirs, q, k, v, need_weights=need_weights, average_attn_weights=average, **kw
        )
        (got, w_got), warned_o = _call(
            ours, q, k, v, need_weights=need_weights, average_attn_weights=average, **kw
        )
        torch.testing.assert_close(got, want)
        assert warned_o == warned_t  # the mixed-mask deprecation warning, as torch gives it
        if need_weights:
            torch.testing.assert_close(w_got, w_want)
        else:
            assert w_got is None and w_want is None
    cot = torch.randn_like(want)
    g_theirs, gin_theirs = _grads(want, theirs, (q, k, v), cot)
    g_ours, gin_ours = _grads(got, ours, (q, k, v), cot)
    for name, g in g_theirs.items():
        torch.testing.assert_close(g_ours[name], g, msg=name)
    for a, b in zip(gin_ours, gin_theirs):
        torch.testing.assert_close(a, b)


def test_weights_of_a_closed_form_case():
    # One head, identity projections: q = [[0, sqrt(2)]], keys = values = I give scores
    # [0, 1] and weights [1, e] / (1 + e) (STYLE 7's closed form), in torch's weights layout.
    m = tc.MultiheadAttention(2, 1, bias=False, batch_first=True, dtype=DT)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.eye(2).repeat(3, 1))
        m.out_proj.weight.copy_(torch.eye(2))
    q = torch.tensor([[[0.0, 2**0.5]]], dtype=DT)  # (B=1, T=1, E=2)
    kv = torch.eye(2, dtype=DT)[None]  # (1, S=2, 2)
    out, w = m(q, kv, kv)
    e = math.e
    want = torch.tensor([[[1 / (1 + e), e / (1 + e)]]], dtype=DT)
    torch.testing.assert_close(w, want)
    torch.testing.assert_close(out, want)


def test_weights_come_from_a_fast_backend_trace(monkeypatch):
    backends = []
    inner = tc.module.scaled_dot_product_attention  # what the drop-in calls

    def spy(*args, **kwargs):
        res = inner(*args, **kwargs)
        backends.append(res[1].backend if kwargs["return_trace"] else None)
        return res

    monkeypatch.setattr(tc.module, "scaled_dot_product_attention", spy)
    theirs, ours = _pair(batch_first=True)
    x = torch.randn(2, 6, E, dtype=DT)
    kpm = torch.tensor([[False] * 6, [False] * 2 + [True] * 4])
    got = ours(x, x, x, key_padding_mask=kpm)
    assert backends == ["torch"]  # the kernel's log-sum-exp, not the plain-math backend
    ours.backend = "reference"  # the slow twin, by name
    torch.testing.assert_close(ours(x, x, x, key_padding_mask=kpm), got)
    assert backends[-1] == "reference"
    torch.testing.assert_close(got, theirs(x, x, x, key_padding_mask=kpm))


def test_constructor_parameters_and_state_dict_as_torch():
    for kw in CONFIGS.values():
        torch.manual_seed(3)
        theirs = nn.MultiheadAttention(E, H, **kw)
        torch.manual_seed(3)
        ours = tc.MultiheadAttention(E, H, **kw)
        assert isinstance(ours, nn.MultiheadAttention)
        assert list(ours.state_dict()) == list(theirs.state_dict())
        for (name, a), b in zip(theirs.state_dict().items(), ours.state_dict().values()):
            assert torch.equal(a, b), name
        assert ours._qkv_same_embed_dim == theirs._qkv_same_embed_dim


def test_state_dict_round_trip_both_ways():
    kw = dict(kdim=6, vdim=5, add_bias_kv=True)
    theirs, _ours = _pair(**kw)
    ours2 = tc.MultiheadAttention(E, H, dtype=DT, **kw)
    ours2.load_state_dict(theirs.state_dict())  # torch -> qkv
    back = nn.MultiheadAttention(E, H, dtype=DT, **kw)
    back.load_state_dict(ours2.state_dict())  # qkv -> torch
    q, k, v = _inputs("seq_first", "kvdim", theirs)
    torch.testing.assert_close(ours2(q, k, v)[0], theirs(q, k, v)[0])
    torch.testing.assert_close(back(q, k, v)[0], theirs(q, k, v)[0], rtol=0, atol=0)


# --- is_causal: torch's rule ----------------------------------------------------------------

CAUSAL_CASES = {
    # name: (attn_mask, key_padding_mask?, need_weights, what torch uses)
    "causal_mask-no_weights": ("causal", False, False, "causal"),
    "noncausal_mask-no_weights": ("random", False, False, "causal"),  # the hint wins
    "noncausal_mask-weights": ("random", False, True, "mask"),
    "noncausal_mask-kpm": ("random", True, False, "mask"),
}


@pytest.mark.parametrize("layout", ["batch_first", "seq_first", "unbatched"])
@pytest.mark.parametrize("case", list(CAUSAL_CASES))
def test_is_causal_follows_torch(case, layout):
    mask_kind, with_kpm, need_weights, used = CAUSAL_CASES[case]
    theirs, ours = _pair(batch_first=layout == "batch_first")
    q, k, v = _inputs(layout, "self", theirs, T=5)
    T = 5
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # torch: True = hidden
    mask = causal if mask_kind == "causal" else torch.rand(T, T) < 0.5
    mask[:, 0] = False
    kpm_shape = (T,) if layout == "unbatched" else (3, T)
    kpm = torch.zeros(kpm_shape, dtype=torch.bool) if with_kpm else None
    kw = dict(attn_mask=mask, key_padding_mask=kpm, need_weights=need_weights, is_causal=True)
    want, w_want = theirs(q, k, v, **kw)
    got, w_got = ours(q, k, v, **kw)
    torch.testing.assert_close(got, want)
    if need_weights:
        torch.testing.assert_close(w_got, w_want)
    explicit = dict(kw, attn_mask=causal if used == "causal" else mask, is_causal=False)
    torch.testing.assert_close(got, ours(q, k, v, **explicit)[0])  # the rule, stated


def test_is_causal_without_attn_mask_raises_as_torch():
    theirs, ours = _pair()
    x = torch.randn(4, 2, E, dtype=DT)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        theirs(x, x, x, is_causal=True)
    with pytest.raises(RuntimeError, match=r"Need attn_mask.*generate_square_subsequent_mask") as e:
        ours(x, x, x, is_causal=True)
    assert isinstance(e.value, ValueError)


# --- rows with nothing to attend: 0, not NaN --------------------------------------------------


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("layout", ["batch_first", "seq_first"])
def test_fully_masked_rows_give_zero_heads_where_torch_gives_nan(layout, kind):
    theirs, ours = _pair(batch_first=layout == "batch_first")
    q, k, v = _inputs(layout, "cross", theirs)  # B=3, T=4, S=5
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1] = True  # batch element 1: every key is padding
    hidden = torch.zeros(4, 5, dtype=torch.bool)
    hidden[2] = True  # query 2: every key hidden, in every batch element
    if kind == "float":
        padding, hidden = (
            torch.zeros(t.shape, dtype=DT).masked_fill(t, -math.inf) for t in (padding, hidden)
        )
    kw = dict(key_padding_mask=padding, attn_mask=hidden, average_attn_weights=False)
    want, w_want = theirs(q, k, v, **kw)
    got, w_got = ours(q, k, v, **kw)
    bf = layout == "batch_first"
    empty = torch.zeros(3, 4, dtype=torch.bool)  # (B, T): rows with nothing to attend
    empty[1], empty[:, 2] = True, True
    empty_out = empty if bf else empty.T  # the output's (B, T) or (T, B)
    assert want[empty_out].isnan().all() and not got.isnan().any()
    torch.testing.assert_close(got[~empty_out], want[~empty_out])
    torch.testing.assert_close(got[empty_out], ours.out_proj.bias.expand(int(empty.sum()), E))
    assert (w_got.transpose(1, 2)[empty] == 0).all()  # (B, T, H, S) rows picked by (B, T)
    torch.testing.assert_close(w_got.transpose(1, 2)[~empty], w_want.transpose(1, 2)[~empty])
    got.sum().backward()
    for t in (q, k, v, *ours.parameters()):
        assert torch.isfinite(t.grad).all()
    q_grad = q.grad if bf else q.grad.transpose(0, 1)
    assert (q_grad[empty] == 0).all()


# --- dropout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["batch_first", "seq_first"])
def test_dropout_draws_as_torch_in_training_and_is_off_in_eval(layout):
    theirs, ours = _pair(batch_first=layout == "batch_first", dropout=0.3)
    q, k, v = _inputs(layout, "cross", theirs)
    for need_weights in (False, True):
        torch.manual_seed(5)
        want, _ = theirs(q, k, v, need_weights=need_weights)
        torch.manual_seed(5)
        got, w = ours(q, k, v, need_weights=need_weights)
        torch.testing.assert_close(got, want)  # the same dropout mask, from the same seed
    assert w.shape == (3, 4, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, dtype=DT))  # before dropout
    theirs.eval(), ours.eval()
    want, w_want = theirs(q, k, v)
    torch.testing.assert_close(ours(q, k, v)[0], want)
    torch.testing.assert_close(ours(q, k, v)[1], w_want)


# --- ported from PyTorch's test/nn/test_multihead_attention.py -------------------------------

HELPER_CASES = {  # ported: _multihead_attn_test_helper's cases (static k/v: no module form)
    "no_masking": {},
    "kpm": dict(kpm=True),
    "bias_kv": dict(add_bias_kv=True),
    "zero_attn": dict(add_zero_attn=True),
    "bias_kv-zero_attn-kpm": dict(kpm=True, add_bias_kv=True, add_zero_attn=True),
    "same_embed_dim-zero_attn-kpm": dict(kpm=True, add_zero_attn=True, same_embed_dim=True),
}


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("average", [True, False], ids=["average", "per_head"])
@pytest.mark.parametrize("case", list(HELPER_CASES))
def test_ported_multihead_attn_test_helper(case, average):
    # One decoder state (T=1) attends to random sources with a float (1, S) attn_mask of
    # 0/-inf, random batch, length, head dim, even head count and key/value dim.
    opts = dict(HELPER_CASES[case])
    kpm_on, same = opts.pop("kpm", False), opts.pop("same_embed_dim", False)
    rng = torch.Generator().manual_seed(7)
    for _ in range(10):
        B, S, D = (
            int(torch.randint(lo, hi, (), generator=rng)) for lo, hi in ((2, 11), (2, 11), (3, 11))
        )
        heads = 2 * int(torch.randint(1, 3, (), generator=rng))
        C = D * heads
        kv_dim = C if same else int(torch.randint(5, 21, (), generator=rng))
        torch.manual_seed(int(torch.randint(0, 2**31, (), generator=rng)))
        theirs = nn.MultiheadAttention(C, heads, kdim=kv_dim, vdim=kv_dim, dtype=DT, **opts)
        ours = tc.MultiheadAttention(C, heads, kdim=kv_dim, vdim=kv_dim, dtype=DT, **opts)
        ours.load_state_dict(theirs.state_dict())
        q = torch.rand(1, B, C, dtype=DT, generator=rng)  # (T=1, B, C)
        kv = torch.rand(S, B, kv_dim, dtype=DT, generator=rng)  # (S, B, kv_dim)
        keep = torch.randint(0, 2, (1, S), generator=rng)
        am = torch.zeros(1, S, dtype=DT).masked_fill(keep == 0, -math.inf)  # (T, S)
        kpm = (torch.randint(0, 2, (1, S), generator=rng) == 1).expand(B, S) if kpm_on else None
        want, w_want = theirs(
            q, kv, kv, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average
        )
        got, w_got = ours(
            q, kv, kv, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average
        )
        assert not got.isnan().any() and not w_got.isnan().any()
        ok = ~want.isnan().any(-1)  # (T, B): torch's rows with something to attend
        torch.testing.assert_close(got[ok], want[ok])
        w_ok = ok.T if average else ok.T[:, None].expand(B, heads, 1)
        torch.testing.assert_close(w_got[w_ok], w_want[w_ok])


def test_ported_3d_attn_mask_equals_per_batch_2d_masks():
    # test_multihead_attn_3d_attn_mask: a (B*H, T, S) mask repeated over heads gives each
    # batch element the output of its own (T, S) mask.
    B, T, S, heads = 8, 2, 3, 4
    m = tc.MultiheadAttention(E, heads, dtype=DT)
    query, key = torch.rand(B, T, E, dtype=DT), torch.rand(B, S, E, dtype=DT)
    keep = torch.randint(0, 2, (B, T, S))
    keep[..., 0] = 1
    mask = torch.zeros(B, T, S, dtype=DT).masked_fill(keep == 0, -math.inf)  # (B, T, S)
    out3 = m(
        query.transpose(0, 1),
        key.transpose(0, 1),
        key.transpose(0, 1),
        attn_mask=mask.repeat_interleave(heads, 0),
    )[0]  # (T, B, E)
    for i in range(B):
        out2 = m(query[i, :, None], key[i, :, None], key[i, :, None], attn_mask=mask[i])[0]
        torch.testing.assert_close(out3[:, i : i + 1], out2)


INVALID = {  # ported: _test_multihead_attn_invalid_shape_impl, plus the rest of torch's checks
    "3d_query-2d_key": (
        (4, 4, 4),
        (4, 4),
        (4, 4, 4),
        {},
        AssertionError,
        "expected `key` and `value` to be 3-D but found 2-D and 3-D",
    ),
    "3d_query-2d_value": (
        (4, 4, 4),
        (4, 4, 4),
        (4, 4),
        {},
        AssertionError,
        "expected `key` and `value` to be 3-D but found 3-D and 2-D",
    ),
    "3d_query-1d_kpm": (
        (4, 4, 4),
        (4, 4, 4),
        (4, 4, 4),
        dict(key_padding_mask=torch.tensor([False, False, True, True])),
        AssertionError,
        "expected `key_padding_mask` to be `None` or 2-D",
    ),
    "3d_query-1d_attn_mask": (
        (4, 4, 4),
        (4, 4, 4),
        (4, 4, 4),
        dict(attn_mask=torch.tensor([False, False, True, True])),
        AssertionError,
        "expected `attn_mask` to be `None`, 2-D or 3-D",
    ),
    "2d_query-3d_key": (
        (4, 4),
        (4, 4, 4),
        (4, 4),
        {},
        AssertionError,
        "expected `key` and `value` to be 2-D but found 3-D and 2-D",
    ),
    "2d_query-2d_kpm": (
        (4, 4),
        (4, 4),
        (4, 4),
        dict(key_padding_mask=torch.tensor([[False, False, True, True] * 2])),
        AssertionError,
        "expected `key_padding_mask` to be `None` or 1-D",
    ),
    "2d_query-bad_3d_attn_mask": (
        (4, 4),
        (4, 4),
        (4, 4),
        dict(attn_mask=torch.zeros(5, 4, 4, dtype=torch.bool)),
        AssertionError,
        r"Expected `attn_mask` shape to be \(4, 4, 4\)",
    ),
    "4d_query": (
        (1, 4, 4, 4),
        (4, 4, 4),
        (4, 4, 4),
        {},
        AssertionError,
        "query should be unbatched 2D or batched 3D tensor but received 4-D",
    ),
    "int_kpm": (
        (4, 4, 4),
        (4, 4, 4),
        (4, 4, 4),
        dict(key_padding_mask=torch.zeros(4, 4, dtype=torch.int64)),
        AssertionError,
        "only bool and floating types of key_padding_mask",
    ),
    "bad_2d_attn_mask": (
        (4, 4, 4),
        (5, 4, 4),
        (5, 4, 4),
        dict(attn_mask=torch.zeros(4, 4, dtype=torch.bool)),
        RuntimeError,
        r"2D attn_mask is .*, but should be \(4, 5\)",
    ),
    "bad_3d_attn_mask": (
        (4, 4, 4),
        (4, 4, 4),
        (4, 4, 4),
        dict(attn_mask=torch.zeros(4, 4, 4, dtype=torch.bool)),
        RuntimeError,
        r"3D attn_mask is .*, but should be \(16, 4, 4\)",
    ),
    "embed_dim": (
        (4, 4, 3),
        (4, 4, 3),
        (4, 4, 3),
        {},
        AssertionError,
        "was expecting embedding dimension of 4, but got 3",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_ported_invalid_inputs_raise_as_torch(case):
    qs, ks, vs, kw, torch_type, msg = INVALID[case]
    args = [torch.randn(s) for s in (qs, ks, vs)]
    with pytest.raises(torch_type, match=msg):
        nn.MultiheadAttention(4, 4)(*args, **kw)
    with pytest.raises(torch_type, match=msg) as e:
        tc.MultiheadAttention(4, 4)(*args, **kw)
    assert isinstance(e.value, ValueError)


def test_wrong_key_channels_name_the_fix():
    m = tc.MultiheadAttention(E, H, kdim=6, vdim=5)
    with pytest.raises(ValueError, match="key must have kdim=6 channels"):
        m(torch.randn(4, 2, E), torch.randn(5, 2, 7), torch.randn(5, 2, 5))
    with pytest.raises(TypeError, match=r"key must be a torch.Tensor"):
        m(torch.randn(4, 2, E), None, torch.randn(5, 2, 5))


# --- nested tensors ---------------------------------------------------------------------------


def _nested(lengths, C=E, layout=torch.strided):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "nested tensors are in prototype stage"
        return torch.nested.as_nested_tensor(
            [torch.randn(n, C, dtype=DT) for n in lengths], layout=layout
        )


@pytest.mark.parametrize("average", [True, False], ids=["average", "per_head"])
def test_nested_input_as_on_torch_fast_path(average):
    theirs, ours = _pair(batch_first=True)
    theirs.eval(), ours.eval()
    x = _nested([5, 3, 1])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, w_want = theirs(x, x, x, average_attn_weights=average)  # torch's native kernel
        got, w_got = ours(x, x, x, average_attn_weights=average)
    assert got.is_nested
    for a, b in zip(got.unbind(), want.unbind()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(w_got, w_want)  # padded, 0 on padded rows and keys


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_nested_input_with_gradients_equals_each_sequence_alone(layout):
    _, ours = _pair(batch_first=True)
    x = _nested([5, 3], layout=layout).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = ours(x, x, x, need_weights=False)
    for seq, o in zip(x.unbind(), out.unbind()):
        alone, _ = ours(seq[None], seq[None], seq[None])
        torch.testing.assert_close(o, alone[0])
    out.to_padded_tensor(0.0).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())


def test_nested_input_refuses_masks():
    _, ours = _pair(batch_first=True)
    x = _nested([2, 3])
    with pytest.raises(ValueError, match="nested tensors carry their own padding"):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="all three nested"):
        ours(x, torch.randn(2, 3, E, dtype=DT), x)


# --- patch() -----------------------------------------------------------------------------------


@pytest.fixture
def qkv_calls(monkeypatch):
    """Counts the attention calls the drop-in makes into qkv."""
    calls = []
    inner = tc.module.scaled_dot_product_attention  # what the drop-in calls

    def spy(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return inner(*args, **kwargs)

    monkeypatch.setattr(tc.module, "scaled_dot_product_attention", spy)
    return calls


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of torch's fused encoder-layer and MHA inference kernels."""
    calls = []
    for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention"):
        inner = getattr(torch, name)

        def spy(*args, _inner=inner, _name=name, **kwargs):
            calls.append(_name)
            return _inner(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    return calls


def _encoder(batch_first=True, layers=2, **kw):
    torch.manual_seed(4)
    layer = nn.TransformerEncoderLayer(
        E, H, 16, dropout=0.0, batch_first=batch_first, dtype=DT, **kw
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "enable_nested_tensor is True, but ..."
        return nn.TransformerEncoder(layer, layers)


ENCODER_CALLS = {
    "kpm": dict(
        src_key_padding_mask=torch.tensor(
            [[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4]
        )
    ),
    "causal_mask": dict(
        mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=DT), is_causal=True
    ),
    "bool_mask": dict(mask=torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) < 0.3),
    "none": {},
}


@pytest.mark.parametrize("call", list(ENCODER_CALLS))
def test_patched_encoder_runs_qkv_in_eval_no_grad(call, qkv_calls, fused_calls):
    model = _encoder().eval()
    x = torch.randn(3, 5, E, dtype=DT)
    kw = ENCODER_CALLS[call]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(x, **kw)
        assert fused_calls and not qkv_calls  # torch's fused kernel ran before patching
        fused_calls.clear()
        assert tc.patch(model) is model
        got = model(x, **kw)
    assert not fused_calls and len(qkv_calls) == 2  # one qkv call per layer, no fused kernel
    torch.testing.assert_close(got, want)


def test_layer_patched_before_building_the_encoder_still_runs_qkv(qkv_calls, fused_calls):
    # TransformerEncoder deep-copies its layer and, in eval without grad, hands the layers
    # nested tensors: the copies keep the hook and take them.
    torch.manual_seed(4)
    layer = tc.patch(nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True, dtype=DT))
    model = nn.TransformerEncoder(layer, 3, enable_nested_tensor=True).eval()
    reference = copy.deepcopy(model)
    for m in reference.modules():  # the same model computed by torch alone
        if isinstance(m, tc.MultiheadAttention):
            m.__class__ = nn.MultiheadAttention
            m._forward_pre_hooks.clear()
    x = torch.randn(3, 5, E, dtype=DT)
    kpm = ENCODER_CALLS["kpm"]["src_key_padding_mask"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model(x, src_key_padding_mask=kpm)
        assert len(qkv_calls) == 3 and not fused_calls
        want = reference(x, src_key_padding_mask=kpm)
    assert fused_calls
    torch.testing.assert_close(got, want)


def test_patched_encoder_in_training_same_outputs_and_gradients(qkv_calls):
    model = _encoder(batch_first=False)
    patched = tc.patch(copy.deepcopy(model))
    x = torch.randn(5, 3, E, dtype=DT)  # (T, B, E)
    kpm = ENCODER_CALLS["kpm"]["src_key_padding_mask"]
    want, got = model(x, src_key_padding_mask=kpm), patched(x, src_key_padding_mask=kpm)
    assert len(qkv_calls) == 2
    torch.testing.assert_close(got, want)
    cot = torch.randn_like(want)
    want.backward(cot)
    got.backward(cot)
    for (name, p), q in zip(model.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_patched_encoder_has_no_nan_for_a_fully_padded_sequence():
    model = _encoder()
    patched = tc.patch(copy.deepcopy(model))
    x = torch.randn(2, 4, E, dtype=DT)
    kpm = torch.tensor([[False] * 4, [True] * 4])  # sequence 1 is all padding
    want = model(x, src_key_padding_mask=kpm)  # torch's layers ask for no weights: its SDPA
    got = patched(x, src_key_padding_mask=kpm)  # path, 0 or NaN by version and kernel
    assert torch.isfinite(got).all()
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite])
    got.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in patched.parameters())


@pytest.mark.parametrize("mode", ["train", "eval-no_grad"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_patched_decoder_layer_same_outputs(batch_first, mode, qkv_calls):
    torch.manual_seed(5)
    layer = nn.TransformerDecoderLayer(E, H, 16, dropout=0.0, batch_first=batch_first, dtype=DT)
    patched = tc.patch(copy.deepcopy(layer))
    tgt, memory = torch.randn(3, 4, E, dtype=DT), torch.randn(3, 6, E, dtype=DT)
    if not batch_first:
        tgt, memory = tgt.transpose(0, 1), memory.transpose(0, 1)
    kw = dict(
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(4, dtype=DT),
        tgt_is_causal=True,
        memory_key_padding_mask=torch.arange(6) >= torch.tensor([6, 4, 1])[:, None],
    )
    for m in (layer, patched):
        m.train(mode == "train")
    with torch.set_grad_enabled(mode == "train"):
        want, got = layer(tgt, memory, **kw), patched(tgt, memory, **kw)
    assert len(qkv_calls) == 2  # self-attention and cross-attention
    torch.testing.assert_close(got, want)


def test_patched_transformer_same_outputs_in_train_and_eval(qkv_calls, fused_calls):
    torch.manual_seed(6)
    model = nn.Transformer(
        E,
        H,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=16,
        dropout=0.0,
        batch_first=True,
        dtype=DT,
    )
    patched = tc.patch(copy.deepcopy(model))
    src, tgt = torch.randn(2, 6, E, dtype=DT), torch.randn(2, 4, E, dtype=DT)
    kw = dict(
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(4, dtype=DT),
        tgt_is_causal=True,
        src_key_padding_mask=torch.tensor([[False] * 6, [False] * 4 + [True] * 2]),
    )
    kw["memory_key_padding_mask"] = kw["src_key_padding_mask"]
    torch.testing.assert_close(patched(src, tgt, **kw), model(src, tgt, **kw))
    assert len(qkv_calls) == 2 + 2 * 2  # encoder self; decoder self and cross
    model.eval(), patched.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(src, tgt, **kw)
        fused_calls.clear()
        got = patched(src, tgt, **kw)
    assert not fused_calls
    torch.testing.assert_close(got, want)


def test_ported_transformerencoder_square_input():
    # test_transformerencoder_square_input: batch size == sequence length == 2, parameters
    # cos(0..n-1), a bool src_mask; torch's recorded output, in every mode, after patching.
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(
            d_model=4, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
        ),
        num_layers=2,
        enable_nested_tensor=False,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.cos(torch.arange(p.numel()).float().view(p.shape)))
    tc.patch(model)
    x = torch.arange(0, 16).reshape(2, 2, 4).float()
    src_mask = torch.tensor([[0, 1], [0, 0]]).bool()
    want = torch.tensor(
        [
            [
                [2.420306205749512, 0.017629241570830, -0.607857942581177, -0.085519507527351],
                [2.420306205749512, 0.017629241570830, -0.607857942581177, -0.085519507527351],
            ],
            [
                [2.419836044311523, 0.017548924311996, -0.608187675476074, -0.085347734391689],
                [2.419836044311523, 0.017548924311996, -0.608187675476074, -0.085347734391689],
            ],
        ]
    )
    for training, no_grad in itertools.product((True, False), (True, False)):
        model.train(training)
        with torch.set_grad_enabled(not no_grad):
            torch.testing.assert_close(model(x, mask=src_mask), want)


def test_patch_keeps_parameters_and_an_optimizer_built_before():
    torch.manual_seed(7)
    shared = nn.MultiheadAttention(E, H, batch_first=True, dtype=DT)
    model = nn.ModuleDict(
        dict(
            a=shared,
            b=shared,
            layer=nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True, dtype=DT),
        )
    )
    params = list(model.parameters())
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert tc.patch(model) is model
    assert model.a is model.b is shared and type(shared) is tc.MultiheadAttention
    assert type(model.layer.self_attn) is tc.MultiheadAttention
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert list(model.state_dict()) == keys
    x = torch.randn(2, 3, E, dtype=DT)
    before = shared.in_proj_weight.detach().clone()
    out_before = model.a(x, x, x)[0].detach()
    model.a(x, x, x)[0].sum().backward()
    opt.step()
    assert not torch.equal(shared.in_proj_weight, before)  # the optimizer moved it ...
    assert not torch.equal(model.a(x, x, x)[0], out_before)  # ... and the module uses it


def test_patch_of_a_module_returns_it_and_twice_changes_nothing():
    m = nn.MultiheadAttention(E, H)
    hook = m.register_forward_hook(lambda *a: None)
    assert tc.patch(m) is m and type(m) is tc.MultiheadAttention
    assert tc.patch(m) is m and len(m._forward_pre_hooks) == 1  # one marker hook, not two
    assert hook.id in m._forward_hooks  # the user's hooks stay
    x = torch.randn(3, 2, E)
    assert m(x, x, x)[1].shape == (2, 3, 3)


def test_patch_refusals():
    class Mine(nn.MultiheadAttention):
        pass

    with pytest.raises(TypeError, match=r"inner \(.*Mine\) subclass it"):
        tc.patch(nn.ModuleDict(dict(inner=Mine(E, H))))
    with pytest.raises(ValueError, match=r"found no torch.nn.MultiheadAttention in Linear"):
        tc.patch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"needs a torch.nn.Module"):
        tc.patch("model")


def test_capture_sees_the_weights_inside_patched_layers():
    # torch's layers call self_attn with need_weights=False; qkv.capture takes the weights
    # from the same fast call.
    model = tc.patch(_encoder())
    x = torch.randn(2, 5, E, dtype=DT)
    with qkv.capture(model) as cap:
        model(x)
    probs = cap.layer(1)[0].probs
    assert probs.shape == (2, H, 5, 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, H, 5, dtype=DT))


# --- from_torch: batch_first=False is refused ---------------------------------------------------


def test_from_torch_refuses_batch_first_false_and_names_both_fixes():
    tm = nn.MultiheadAttention(16, 4)
    with pytest.raises(
        ValueError,
        match=r"batch_first=False and takes \(T, B, 16\).*"
        r"qkv.torch_compat.MultiheadAttention.*"
        r"from_torch\(m, batch_first=True\)",
    ):
        qkv.MultiHeadAttention.from_torch(tm)
    with pytest.raises(ValueError, match=r"never \(T, B, 16\)"):
        qkv.MultiHeadAttention.from_torch(
            nn.MultiheadAttention(16, 4, batch_first=True), batch_first=False
        )
    ours = qkv.MultiHeadAttention.from_torch(tm, batch_first=True)
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(
        ours(x), tm(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))[0].transpose(0, 1)
    )
    dropin = tc.MultiheadAttention(16, 4, batch_first=True)  # a drop-in converts too
    torch.testing.assert_close(qkv.MultiHeadAttention.from_torch(dropin)(x), dropin(x, x, x)[0])
