"""Context-parallel modules and models (issue 15): ``context_group=`` on real processes.

``qkv.MultiHeadAttention(context_group=...)``, ``LocalMultiHeadAttention``, ``DecoderLM`` and
``Seq2SeqTransformer`` run with every rank holding a shard of the sequence. One spawn of 3
processes (``run_local``: gloo on loopback, bounded time; a spawn costs seconds per rank here)
runs every case of the tables on the group of all 3, then on a group of 2 made of ranks 1 and
2 (so group ranks differ from global ones); the parent then runs the same module (the same
state dict) on the whole sequence in one process and compares, float64 with assert_close
defaults: the outputs, the gradients of the inputs, and the parameter gradients, whose sum
over the ranks must be the single-process gradient (what an all-reduce with SUM gives).

Cases: T not divisible by the ranks (and a rank with no positions), both layouts, causal,
sliding windows, ALiBi, GQA/MQA, key_mask padding with a fully padded sequence,
cross-attention T != S, traces; then the calls that cannot run context-parallel and their
errors.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.distributed import run_local, segments
from qkv.distributed.layout import assemble
from qkv.models import DecoderLM, EncoderClassifier, Seq2SeqTransformer, ViT

C, H, V = 16, 4, 11
DT = torch.float64

MHA_CASES = {
    "B2-T11": dict(T=11),
    "B2-T11-balanced": dict(T=11, layout="balanced"),
    "B2-T13-causal": dict(T=13, causal=True),
    "B2-T13-causal-balanced": dict(T=13, causal=True, layout="balanced"),
    "B2-T17-window-balanced": dict(T=17, mask="window", layout="balanced"),
    "B2-T17-window-causal": dict(T=17, mask="window", causal=True),
    "B2-T16-local-kind-balanced": dict(T=16, local=2, layout="balanced"),
    "B2-T12-gqa-causal": dict(T=12, G=2, causal=True),
    "B2-T12-mqa-causal-balanced": dict(T=12, G=1, causal=True, layout="balanced"),
    "B2-T11-alibi-causal": dict(T=11, causal=True, score="alibi"),
    "B3-T13-keymask": dict(T=13, B=3, pad="rows"),
    "B3-T13-keymask-causal-balanced": dict(T=13, B=3, pad="rows", causal=True, layout="balanced"),
    "B2-T12-keymask-padded-tail": dict(T=12, pad="tail"),
    "B2-T7-S10-cross-keymask": dict(T=7, S=10, kdim=12, pad="rows"),
    "B2-T9-S14-cross-causal-balanced": dict(T=9, S=14, causal=True, layout="balanced"),
    "unbatched-T9": dict(T=9, B=0),
    "B2-T2-causal-tiny": dict(T=2, causal=True),  # on 3 ranks one holds nothing
    "B3-T10-trace-keymask-balanced": dict(
        T=10, B=3, causal=True, pad="rows", trace=True, layout="balanced"
    ),
}
MODEL_CASES = {
    "lm-B2-T13": dict(model="lm", T=13),
    "lm-B3-T14-keymask-sinusoidal-balanced": dict(
        model="lm", T=14, B=3, pad="rows", positions="sinusoidal", layout="balanced"
    ),
    "lm-B2-T15-local-postnorm-balanced": dict(
        model="lm", T=15, attention="local", norm_first=False, layout="balanced"
    ),
    "lm-B2-T12-gqa": dict(model="lm", T=12, G=2),
    "seq2seq-B3-S11-T8-keymask-balanced": dict(
        model="seq2seq", S=11, T=8, B=3, pad="rows", layout="balanced"
    ),
}
CASES = {**MHA_CASES, **MODEL_CASES}
SEQ_DIM = {
    "x": -2,
    "memory": -2,
    "w": -2,
    "key_mask": -1,
    "tokens": -1,
    "src": -1,
    "tgt": -1,
    "src_key_mask": -1,
    "tgt_key_mask": -1,
}


# --- the same modules, inputs and calls on both sides --------------------------------------


def _build(spec, group=None):
    layout = spec.get("layout", "contiguous")
    common = dict(dtype=DT, context_group=group, context_layout=layout)
    model = spec.get("model")
    if model is None:
        kw = dict(
            num_kv_heads=spec.get("G"), kdim=spec.get("kdim"), vdim=spec.get("kdim"), **common
        )
        if spec.get("local"):
            return qkv.LocalMultiHeadAttention(C, H, window=spec["local"], **kw)
        return qkv.MultiHeadAttention(C, H, **kw)
    options = {"num_kv_heads": spec["G"]} if spec.get("G") else {}
    if spec.get("attention") == "local":
        options["window"] = 3
    kw = dict(
        attention=spec.get("attention", "exact"),
        attention_options=options,
        norm_first=spec.get("norm_first", True),
        positions=spec.get("positions", "learned"),
        max_len=32,
        **common,
    )
    if model == "lm":
        return DecoderLM(V, C, H, 2, **kw)
    return Seq2SeqTransformer(V, C, H, 1, num_decoder_layers=2, **kw)


def _key_mask(B, L, pad):
    """'rows': sequence 0 all real, 1 padded at both ends, 2 (if any) all padding;
    'tail': only the first 4 positions real (the later shards hold padding only)."""
    m = torch.ones(B, L, dtype=torch.bool)
    if pad == "tail":
        m[:, 4:] = False
        return m
    m[1, :1], m[1, -4:] = False, False
    if B > 2:
        m[2] = False
    return m


def _inputs(spec, g):
    B, T, S = spec.get("B", 2), spec["T"], spec.get("S", spec["T"])
    lead = (B,) if B else ()
    model = spec.get("model")
    if model == "lm":
        out = dict(
            tokens=torch.randint(V, (B, T), generator=g),
            w=torch.randn(B, T, V, generator=g, dtype=DT),
        )
        if spec.get("pad"):
            out["key_mask"] = _key_mask(B, T, spec["pad"])
        return out
    if model == "seq2seq":
        return dict(
            src=torch.randint(V, (B, S), generator=g),
            tgt=torch.randint(V, (B, T), generator=g),
            src_key_mask=_key_mask(B, S, spec["pad"]),
            tgt_key_mask=_key_mask(B, T, spec["pad"]).flip(-1),
            w=torch.randn(B, T, V, generator=g, dtype=DT),
        )
    out = dict(
        x=torch.randn(*lead, T, C, generator=g, dtype=DT),
        w=torch.randn(*lead, T, C, generator=g, dtype=DT),
    )
    if "S" in spec:
        out["memory"] = torch.randn(*lead, S, spec.get("kdim", C), generator=g, dtype=DT)
    if spec.get("pad"):
        out["key_mask"] = _key_mask(B, S, spec["pad"])
    return out


def _forward(m, spec, inp):
    """``(output, trace or None)``; the same call on a shard and on the whole sequence."""
    model = spec.get("model")
    if model == "lm":
        return m(inp["tokens"], key_mask=inp.get("key_mask")), None
    if model == "seq2seq":
        return m(
            inp["src"],
            inp["tgt"],
            src_key_mask=inp["src_key_mask"],
            tgt_key_mask=inp["tgt_key_mask"],
        ), None
    mask = {"window": qkv.masks.sliding_window(3, 2)}.get(spec.get("mask"))
    score = qkv.masks.alibi(H) if spec.get("score") == "alibi" else None
    args = (inp["x"], inp["memory"], inp["memory"]) if "memory" in inp else (inp["x"],)
    res = m(
        *args,
        key_mask=inp.get("key_mask"),
        is_causal=spec.get("causal", False),
        mask_mod=mask,
        score_mod=score,
        return_trace=spec.get("trace", False),
    )
    return res if spec.get("trace") else (res, None)


def _run(m, spec, inp):
    """Forward, then backward of ``sum(output * w)``: what a rank reports."""
    inp = dict(inp)
    for k in ("x", "memory"):
        if k in inp:
            inp[k] = inp[k].detach().clone().requires_grad_()
    y, trace = _forward(m, spec, inp)
    (y * inp["w"]).sum().backward()
    return dict(
        y=y.detach(),
        dx=inp["x"].grad if "x" in inp else None,
        dmemory=inp["memory"].grad if "memory" in inp else None,
        grads={n: p.grad for n, p in m.named_parameters()},
        probs=None if trace is None else trace.probs,
    )


def _take(t, runs, dim):
    return torch.cat([t.narrow(dim, a, b - a) for a, b in runs], dim=dim)


def _put(parts, runs_by_rank, dim):
    """The whole tensor from every rank's shard."""
    return assemble(parts, runs_by_rank, dim)


# --- on the ranks ---------------------------------------------------------------------------


def _ranks(rank, world, cases):
    """Every case on the 3 ranks, then on the group of ranks 1 and 2: ``{R: results}``."""
    assert world == 3
    pair = torch.distributed.new_group([1, 2])  # every rank must make it
    out = {3: _cases(rank, 3, torch.distributed.group.WORLD, cases)}
    if rank in (1, 2):
        out[2] = _cases(rank - 1, 2, pair, cases)
        out[2]["refusals"] = _refusals(pair)
        out[2]["copies"] = _copies(pair)
    return out


def _cases(rank, R, group, cases):
    from qkv.distributed import comm_log

    results = {}
    for name, (spec, state, whole) in cases.items():
        m = _build(spec, group)
        m.load_state_dict(state)
        layout = spec.get("layout", "contiguous")
        mine = {
            k: _take(t, segments(t.shape[SEQ_DIM[k]], R, layout)[rank], SEQ_DIM[k])
            for k, t in whole.items()
        }
        with comm_log() as log:
            results[name] = _run(m, spec, mine)
        results[name]["received"] = sorted(log.peers("recv", "forward"))
    return results


def _refusals(group):
    """Each call that cannot run context-parallel: ``(exception type, message)``; and one
    that can (dropout outside training)."""
    x = torch.randn(2, 4, C, dtype=DT)
    tokens = torch.zeros(2, 3, dtype=torch.long)

    def mha(**kw):
        return qkv.MultiHeadAttention(C, H, dtype=DT, context_group=group, **kw)

    def lm(**kw):
        return DecoderLM(V, C, H, 1, dtype=DT, context_group=group, **kw)

    def linear_module():
        m = qkv.LinearMultiHeadAttention(C, H, dtype=DT)
        m.context_group = group  # an attribute like any other
        return m(x)

    def cache():
        m = mha()
        return m(x, cache=m.new_cache(2, 8))

    def lm_cache():
        m = lm()
        return m(tokens, cache=m.new_cache(2, 8))

    tries = {
        "attn_mask": lambda: mha()(x, attn_mask=torch.ones(4, 4, dtype=torch.bool)),
        "cache": cache,
        "dropout": lambda: mha(dropout=0.1).train()(x),
        "backend": lambda: mha(backend="torch")(x),
        "layout": lambda: mha(context_layout="zigzag"),
        "linear-module": linear_module,
        "linear-kind": lambda: lm(attention="linear"),
        "performer-kind": lambda: lm(attention="performer"),
        "classifier": lambda: EncoderClassifier(V, 3, C, H, 1, context_group=group),
        "vit": lambda: ViT(8, 4, 3, C, H, 1, context_group=group),
        "generate": lambda: lm().eval().generate(tokens, 2),
        "lm-cache": lm_cache,
    }
    out = {}
    for name, call in tries.items():
        try:
            call()
            out[name] = ("no error", "")
        except Exception as err:
            out[name] = (type(err).__name__, str(err))
    out["dropout-eval-shape"] = tuple(mha(dropout=0.1).eval()(x).shape)
    return out


def _copies(group):
    """A deep copy of a context-parallel model shares its group and computes the same; one
    pickled and loaded runs on one process (a ProcessGroup cannot be pickled)."""
    import copy
    import io

    torch.manual_seed(0)
    lm = DecoderLM(V, C, H, 1, dtype=DT, context_group=group)
    tokens = torch.randint(V, (2, 3))  # each rank's own 3 positions
    twin = copy.deepcopy(lm)
    buf = io.BytesIO()
    torch.save(lm, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    return dict(
        shared=(
            twin.context_group is group and twin.blocks.layers[0].self_attn.context_group is group
        ),
        same=torch.equal(twin(tokens), lm(tokens)),
        loaded=(loaded.context_group, loaded.blocks.layers[0].self_attn.context_group),
    )


# --- in the parent --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ran():
    """The cases, and ``{R: [results of group rank r]}`` for R = 2 and 3."""
    cases = {}
    for name, spec in CASES.items():
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        torch.manual_seed(sum(map(ord, name)))
        cases[name] = (spec, _build(spec).state_dict(), _inputs(spec, g))
    by_rank = run_local(_ranks, 3, cases, timeout=240)
    return cases, {3: [res[3] for res in by_rank], 2: [res[2] for res in by_rank[1:]]}


_REFERENCES: dict = {}


def _reference(cases, name):
    """The module on the whole sequence in this process (once per case)."""
    if name not in _REFERENCES:
        spec, state, whole = cases[name]
        m = _build(spec)
        m.load_state_dict(state)
        _REFERENCES[name] = _run(m, spec, whole)
    return _REFERENCES[name]


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_one_process(ran, name, R):
    cases, results = ran
    spec = cases[name][0]
    ref = _reference(cases, name)
    got = [results[R][r][name] for r in range(R)]
    layout = spec.get("layout", "contiguous")
    T, S = spec["T"], spec.get("S", spec["T"])
    q_runs, kv_runs = segments(T, R, layout), segments(S, R, layout)
    torch.testing.assert_close(_put([g["y"] for g in got], q_runs, -2), ref["y"])
    if ref["dx"] is not None:
        torch.testing.assert_close(_put([g["dx"] for g in got], q_runs, -2), ref["dx"])
    if ref["dmemory"] is not None:
        torch.testing.assert_close(_put([g["dmemory"] for g in got], kv_runs, -2), ref["dmemory"])
    assert ref["grads"].keys() == got[0]["grads"].keys()
    for n, want in ref["grads"].items():
        parts = [g["grads"][n] for g in got]
        assert all(p is not None for p in parts), n
        torch.testing.assert_close(sum(parts), want, msg=lambda m, n=n: f"gradient of {n}: {m}")
    if ref["probs"] is not None:  # each rank's rows against every key
        for r in range(R):
            torch.testing.assert_close(got[r]["probs"], _take(ref["probs"], q_runs[r], -2))


@pytest.mark.parametrize("R", [2, 3])
def test_fully_padded_sequence_outputs_the_bias(ran, R):
    """A sequence with no real key: every query attends to nothing, so every head outputs 0
    (the mask contract) and the module outputs W^O's bias, on every rank."""
    cases, results = ran
    state = cases["B3-T13-keymask"][1]
    for r in range(R):
        y = results[R][r]["B3-T13-keymask"]["y"]  # (B, T_r, C)
        torch.testing.assert_close(y[2], state["out_proj.bias"].expand_as(y[2]))


@pytest.mark.parametrize("R", [2, 3])
def test_shards_of_padding_only_are_never_sent(ran, R):
    """key_mask becomes a structured mask: a rank whose keys are all padding sends nothing."""
    _, results = ran
    name = "B2-T12-keymask-padded-tail"
    runs = segments(12, R, "contiguous")
    padding_only = {r for r in range(R) if runs[r][0][0] >= 4}
    assert padding_only  # positions 4.. are padding: rank 1 of 2, ranks 1 and 2 of 3
    for r in range(R):
        received = set(results[R][r][name]["received"])
        assert not received & padding_only, (r, received)
    assert results[R][0][name]["received"] == []  # rank 0's keys are the only real ones


REFUSED = {
    "attn_mask": "give the mask as a mask_mod",
    "cache": "decoding with a cache is not context-parallel",
    "dropout": "ring attention has no attention dropout",
    "backend": "backend='torch' cannot run it",
    "layout": "layout must be one of",
    "linear-module": "LinearMultiHeadAttention has no context-parallel path",
    "linear-kind": "attention='linear' does not run context-parallel",
    "performer-kind": "attention='performer' does not run context-parallel",
    "classifier": "EncoderClassifier pools the whole sequence",
    "vit": "ViT pools the whole sequence",
    "generate": "generate decodes one token at a time on one process",
    "lm-cache": "decoding with a cache is not context-parallel",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_with_the_way_around(ran, case):
    _, results = ran
    kind, message = results[2][0]["refusals"][case]  # (on a group of 2 of the 3 ranks)
    assert kind == "ValueError", (kind, message)
    assert REFUSED[case] in message


def test_dropout_outside_training_runs(ran):
    _, results = ran
    # each rank passed its own 4 positions
    assert results[2][0]["refusals"]["dropout-eval-shape"] == (2, 4, C)


def test_deep_copies_share_the_group_and_pickles_drop_it(ran):
    _, results = ran
    for r in range(2):
        copies = results[2][r]["copies"]
        assert copies["shared"] and copies["same"]
        assert copies["loaded"] == (None, None)


def test_constructor_arguments_are_attributes():
    m = qkv.MultiHeadAttention(C, H, context_layout="balanced")
    assert (m.context_group, m.context_layout) == (None, "balanced")
    lm = DecoderLM(V, C, H, 1)
    assert lm.context_group is None
    assert all(layer.self_attn.context_group is None for layer in lm.blocks.layers)
