"""Models: shapes, padding that never leaks, cached decoding equal to the full causal forward,
generation (greedy = argmax of repeated full forwards; seeded sampling), ViT patches, errors.

Every equivalence runs in float64 with torch.testing.assert_close defaults, for every attention
kind (exact, linear, performer, local) and for pre- and post-norm.
"""

import math

import pytest
import torch

from qkv import MultiHeadTrace
from qkv.models import (
    DecoderLM,
    EncoderClassifier,
    EncoderLayer,
    PatchEmbedding,
    Seq2SeqTransformer,
    SinusoidalPositions,
    ViT,
    attention_kinds,
    kinds,
    make_attention,
    register_attention,
)

F64 = dict(dtype=torch.float64)
OPTIONS = {"exact": {}, "linear": {}, "performer": {"num_features": 16}, "local": {"window": 3}}
KINDS = list(OPTIONS)
V, C, H, L = 11, 16, 2, 2  # vocabulary, model dim, heads, layers


def kind_kw(kind: str) -> dict:
    return dict(attention=kind, attention_options=OPTIONS[kind])


def lm(kind="exact", **kw) -> DecoderLM:
    return DecoderLM(V, C, H, L, **{**kind_kw(kind), **kw}, **F64).eval()


def seq2seq(kind="exact", **kw) -> Seq2SeqTransformer:
    return Seq2SeqTransformer(V, C, H, L, **{**kind_kw(kind), **kw}, **F64).eval()


def tokens(B: int, T: int) -> torch.Tensor:
    return torch.randint(1, V, (B, T))


def right_padded(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T) < torch.tensor(lengths)[:, None]  # (B, T): True = a real token


def scramble(x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """x with every padded token replaced by another."""
    return torch.where(key_mask, x, (x + 1 + torch.randint(0, V - 2, x.shape)) % V)


def test_kinds_are_the_four_and_all_are_checked_here():
    assert attention_kinds() == ("exact", "linear", "performer", "local") == tuple(KINDS)


# --- shapes -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_model_shapes(kind):
    x, y = tokens(2, 7), tokens(2, 5)
    assert lm(kind)(x).shape == (2, 7, V)
    assert seq2seq(kind, num_decoder_layers=1)(x, y).shape == (2, 5, V)
    for pooling in ("cls", "mean"):
        clf = EncoderClassifier(V, 3, C, H, L, pooling=pooling, **kind_kw(kind), **F64)
        assert clf(x).shape == (2, 3)
    vit = ViT(8, 4, 5, C, H, L, in_channels=3, **kind_kw(kind), **F64)
    assert vit(torch.randn(2, 3, 8, 8, **F64)).shape == (2, 5)


@pytest.mark.parametrize("patch", [2, 4])
def test_vit_on_8x8_images(patch):
    vit = ViT(8, patch, 4, C, H, L, in_channels=1, **F64)
    assert vit.num_patches == (8 // patch) ** 2
    images = torch.randn(3, 1, 8, 8, **F64)
    logits, maps = vit(images, return_attention=True)
    assert logits.shape == (3, 4)
    P = vit.num_patches
    assert [t.probs.shape for t in maps.encoder] == [(3, H, P + 1, P + 1)] * L
    assert maps.decoder == [] and maps.cross == []


def test_patch_embedding_is_a_linear_map_of_each_patch_in_raster_order():
    pe = PatchEmbedding((4, 6), 2, 3, 5, **F64)
    img = torch.randn(2, 3, 4, 6, **F64)
    out = pe(img)  # (B, P, C)
    assert out.shape == (2, 6, 5) and pe.grid == (2, 3)
    w, b = pe.proj.weight.flatten(1), pe.proj.bias  # (C, 3 * 2 * 2)
    for r in range(2):
        for c in range(3):
            patch = img[:, :, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].flatten(1)  # (B, 12)
            torch.testing.assert_close(out[:, 3 * r + c], patch @ w.T + b)


def test_sinusoidal_positions_closed_form():
    pe = SinusoidalPositions(6, **F64)(0, 3)  # (3, 6)
    for p in range(3):
        for i in range(3):
            f = p / 10000 ** (2 * i / 6)
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(f), abs=1e-15)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(f), abs=1e-15)
    torch.testing.assert_close(SinusoidalPositions(6, **F64)(1, 2), pe[1:])


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_encoder_layer_norm_order(norm_first):
    layer = EncoderLayer(C, H, norm_first=norm_first, **F64)
    x = torch.randn(2, 5, C, **F64)
    attn, ffn, n1, n2 = layer.self_attn, layer.ffn, layer.norm1, layer.norm2
    if norm_first:
        h = x + attn(n1(x))
        want = h + ffn(n2(h))
    else:
        h = n1(x + attn(x))
        want = n2(h + ffn(h))
    torch.testing.assert_close(layer(x), want)


# --- padding never leaks ------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("kind", KINDS)
def test_classifier_padding_never_leaks(kind, pooling):
    clf = EncoderClassifier(V, 3, C, H, L, pooling=pooling, **kind_kw(kind), **F64).eval()
    x, key_mask = tokens(3, 9), right_padded([9, 4, 6], 9)
    out, out2 = (clf(t, key_mask=key_mask) for t in (x, scramble(x, key_mask)))
    torch.testing.assert_close(out, out2)
    # and the padding did matter to the unmasked model: the test can see a leak
    assert not torch.allclose(clf(x), clf(scramble(x, key_mask)))


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("kind", KINDS)
def test_seq2seq_padding_never_leaks(kind, norm_first):
    model = seq2seq(
        kind, norm_first=norm_first, cross_attention=kind, cross_attention_options=OPTIONS[kind]
    )
    src, src_mask = tokens(2, 8), right_padded([8, 5], 8)
    tgt, tgt_mask = tokens(2, 6), right_padded([4, 6], 6)
    out = model(src, tgt, src_key_mask=src_mask, tgt_key_mask=tgt_mask)
    out2 = model(
        scramble(src, src_mask),
        scramble(tgt, tgt_mask),
        src_key_mask=src_mask,
        tgt_key_mask=tgt_mask,
    )
    torch.testing.assert_close(out[tgt_mask], out2[tgt_mask])


@pytest.mark.parametrize("kind", KINDS)
def test_lm_left_padding_never_leaks(kind):
    model = lm(kind)
    x, key_mask = tokens(2, 8), ~right_padded([3, 0], 8)  # row 0: 3 pads on the left
    out, out2 = (model(t, key_mask=key_mask) for t in (x, scramble(x, key_mask)))
    torch.testing.assert_close(out[key_mask], out2[key_mask])


# --- cached decoding equals the full causal forward ---------------------------------------


def _feed(run, x, key_mask, prompt):
    """Logits of x fed as a prompt of ``prompt`` tokens, then one token at a time."""
    ends = [prompt] + list(range(prompt + 1, x.shape[1] + 1))
    outs, start = [], 0
    for end in ends:
        outs.append(run(x[:, start:end], None if key_mask is None else key_mask[:, start:end]))
        start = end
    return torch.cat(outs, 1)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("kind", KINDS)
def test_lm_cached_decoding_equals_full_forward(kind, norm_first):
    model = lm(kind, norm_first=norm_first)
    x, key_mask = tokens(2, 12), ~right_padded([2, 0], 12)  # row 0 left-padded
    full = model(x, key_mask=key_mask)  # (B, T, V)
    cache = model.new_cache(2, 12)
    dec = _feed(lambda t, km: model(t, key_mask=km, cache=cache), x, key_mask, prompt=5)
    torch.testing.assert_close(dec, full)
    assert cache.position == 12


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("kind", KINDS)
def test_seq2seq_cached_decoding_equals_full_forward(kind, norm_first):
    model = seq2seq(kind, norm_first=norm_first)  # cross-attention: exact (the default)
    src, src_mask, tgt = tokens(2, 9), right_padded([9, 6], 9), tokens(2, 10)
    full = model(src, tgt, src_key_mask=src_mask)
    memory = model.encode(src, src_key_mask=src_mask)
    cache = model.new_cache(2, 10)
    dec = _feed(
        lambda t, km: model.decode(t, memory, src_key_mask=src_mask, cache=cache),
        tgt,
        None,
        prompt=1,
    )
    torch.testing.assert_close(dec, full)


@pytest.mark.parametrize("cross", ["linear", "performer"])
def test_seq2seq_decoding_with_linear_cross_attention(cross):
    model = seq2seq("linear", cross_attention=cross, cross_attention_options=OPTIONS[cross])
    src, src_mask, tgt = tokens(2, 9), right_padded([9, 6], 9), tokens(2, 7)
    memory = model.encode(src, src_key_mask=src_mask)
    cache = model.new_cache(2, 7)
    dec = _feed(
        lambda t, km: model.decode(t, memory, src_key_mask=src_mask, cache=cache),
        tgt,
        None,
        prompt=3,
    )
    torch.testing.assert_close(dec, model(src, tgt, src_key_mask=src_mask))


def test_sinusoidal_positions_decode_like_the_full_forward():
    model = lm(positions="sinusoidal")
    x = tokens(2, 9)
    cache = model.new_cache(2, 9)
    dec = _feed(lambda t, km: model(t, cache=cache), x, None, prompt=4)
    torch.testing.assert_close(dec, model(x))


# --- generation ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_lm_greedy_generate_is_argmax_of_repeated_full_forwards(kind):
    model, prompt = lm(kind), tokens(3, 4)
    out = model.generate(prompt, 6)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("kind", KINDS)
def test_seq2seq_greedy_generate_is_argmax_of_repeated_full_forwards(kind):
    model = seq2seq(kind)
    src, src_mask = tokens(2, 7), right_padded([7, 4], 7)
    out = model.generate(src, 5, bos=1, src_key_mask=src_mask)
    seq = torch.ones(2, 1, dtype=torch.long)
    for _ in range(5):
        logits = model(src, seq, src_key_mask=src_mask)[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_generate_with_left_padded_prompts_equals_full_forwards():
    model = lm()
    prompt, key_mask = tokens(2, 5), ~right_padded([2, 0], 5)
    out = model.generate(prompt, 4, key_mask=key_mask)
    seq, mask = prompt, key_mask
    for _ in range(4):
        seq = torch.cat([seq, model(seq, key_mask=mask)[:, -1].argmax(-1, keepdim=True)], 1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1)
    assert torch.equal(out, seq)


def test_sampling_is_seeded_reproducible_and_leaves_the_global_rng_alone():
    model, prompt = lm(), tokens(3, 3)
    state = torch.get_rng_state()
    a = model.generate(prompt, 12, greedy=False, temperature=2.0, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    b = model.generate(prompt, 12, greedy=False, temperature=2.0, seed=7)
    c = model.generate(prompt, 12, greedy=False, temperature=2.0, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[:, :3], prompt)


def test_top_k_one_is_greedy_and_top_k_restricts_the_choice():
    model, prompt = lm(), tokens(2, 3)
    greedy = model.generate(prompt, 8)
    assert torch.equal(model.generate(prompt, 8, greedy=False, top_k=1, seed=3), greedy)
    out = model.generate(prompt, 1, greedy=False, top_k=2, temperature=5.0, seed=0)
    top2 = model(prompt)[:, -1].topk(2).indices  # (B, 2)
    assert (out[:, -1:] == top2).any(-1).all()


def test_generate_stops_each_sequence_at_eos_and_pads_after_it():
    model, prompt = lm(), tokens(3, 4)
    free = model.generate(prompt, 8)[:, 4:]  # (B, N) without eos
    eos, pad = int(free[0, 2]), 0
    out = model.generate(prompt, 8, eos=eos, pad=pad)[:, 4:]
    for row, new in zip(free, out):
        hits = (row == eos).nonzero()
        want = row.clone()
        if len(hits):
            want[int(hits[0]) + 1 :] = pad
        assert torch.equal(new, want)


def test_generate_past_capacity_raises_the_cache_error():
    model, prompt = lm(), tokens(2, 4)
    with pytest.raises(ValueError, match="KVCache is full: it holds 6 of 6 positions"):
        model.generate(prompt, 5, capacity=6)
    cache = model.new_cache(2, 3)
    with pytest.raises(ValueError, match="KVCache is full"):
        model(prompt, cache=cache)
    s2s = seq2seq()
    with pytest.raises(ValueError, match="KVCache is full"):
        s2s.generate(tokens(2, 3), 5, bos=1, capacity=3)


def test_generate_past_learned_positions_raises_before_decoding():
    model = lm(max_len=8)
    with pytest.raises(ValueError, match=r"needs 9 positions .* max_len=8"):
        model.generate(tokens(1, 5), 5)
    assert model.generate(tokens(1, 5), 4).shape == (1, 9)  # the 4th new token is never fed


# --- attention maps -----------------------------------------------------------------------


def test_attention_maps_are_returned_per_layer_and_never_stored():
    model = seq2seq(num_decoder_layers=3)
    src, tgt = tokens(2, 6), tokens(2, 4)
    src_mask = right_padded([6, 3], 6)
    logits, maps = model(src, tgt, src_key_mask=src_mask, return_attention=True)
    torch.testing.assert_close(logits, model(src, tgt, src_key_mask=src_mask))
    assert (len(maps.encoder), len(maps.decoder), len(maps.cross)) == (L, 3, 3)
    assert all(isinstance(t, MultiHeadTrace) for t in maps.encoder + maps.decoder + maps.cross)
    assert maps.encoder[0].probs.shape == (2, H, 6, 6)
    assert maps.decoder[0].probs.shape == (2, H, 4, 4)
    assert maps.cross[0].probs.shape == (2, H, 4, 6)
    assert torch.all(maps.decoder[1].probs.triu(1) == 0)  # causal
    assert torch.all(maps.cross[2].probs[1, :, :, 3:] == 0)  # padded source keys get 0
    torch.testing.assert_close(maps.cross[0].probs.sum(-1), torch.ones(2, H, 4, **F64))
    for m in model.modules():
        assert not any(isinstance(v, MultiHeadTrace) for v in vars(m).values())


def test_lm_and_classifier_attention_maps():
    _, maps = lm()(tokens(2, 5), return_attention=True)
    assert len(maps.decoder) == L and maps.encoder == [] and maps.cross == []
    clf = EncoderClassifier(V, 3, C, H, L, pooling="cls", **F64)
    _, maps = clf(tokens(2, 5), return_attention=True)
    assert maps.encoder[0].probs.shape == (2, H, 6, 6)  # CLS first


@pytest.mark.parametrize("kind", KINDS)
def test_models_train(kind):
    model = lm(kind, dropout=0.1).train()
    x = tokens(2, 9)
    loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


# --- the kind registry and errors ---------------------------------------------------------


def test_unknown_kind_lists_the_kinds():
    with pytest.raises(
        ValueError,
        match="unknown attention kind 'flash'; the kinds are "
        "'exact', 'linear', 'performer', 'local'",
    ):
        lm("exact", attention="flash")


def test_kind_option_errors():
    with pytest.raises(ValueError, match="attention='local' needs a window"):
        make_attention("local", C, H)
    with pytest.raises(TypeError, match="do not fit attention='linear'"):
        make_attention("linear", C, H, options={"window": 3})
    with pytest.raises(TypeError, match="builds its own FAVOR"):
        make_attention("performer", C, H, options={"feature_map": "elu"})
    with pytest.raises(TypeError, match="must not hold 'dtype'"):
        make_attention("exact", C, H, options={"dtype": torch.float64})
    with pytest.raises(ValueError, match="not a multiple of num_heads=3"):
        make_attention("performer", C, 3)


def test_a_registered_kind_needs_no_model_change(monkeypatch):
    monkeypatch.setattr(kinds, "_KINDS", dict(kinds._KINDS))
    built = []

    def mqa(embed_dim, num_heads, **kw):
        built.append(embed_dim)
        return make_attention("exact", embed_dim, num_heads, options={"num_kv_heads": 1}, **kw)

    register_attention("mqa", mqa)
    assert "mqa" in attention_kinds()
    model = lm(attention="mqa")
    assert len(built) == L and model.blocks.layers[0].self_attn.num_kv_heads == 1
    x = tokens(2, 6)
    cache = model.new_cache(2, 6)
    torch.testing.assert_close(_feed(lambda t, km: model(t, cache=cache), x, None, 2), model(x))
    with pytest.raises(ValueError, match="registered already"):
        register_attention("exact", mqa)


def test_model_argument_errors():
    with pytest.raises(ValueError, match=r"image size 8x8 is not divisible by patch_size=3"):
        ViT(8, 3, 2, C, H, L)
    vit = ViT((8, 4), 2, 2, C, H, L, in_channels=1)
    with pytest.raises(
        ValueError,
        match=r"images must be \(B, in_channels, height, width\) = "
        r"\(B, 1, 8, 4\)",
    ):
        vit(torch.randn(2, 1, 4, 8))
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        EncoderClassifier(V, 2, C, H, L, pooling="max")
    with pytest.raises(ValueError, match="unknown positions 'rope'"):
        lm(positions="rope")
    with pytest.raises(ValueError, match="embed_dim must be even"):
        DecoderLM(V, 5, 1, 1, positions="sinusoidal")
    with pytest.raises(ValueError, match="num_layers >= 1"):
        DecoderLM(V, C, H, 0)
    model = lm()
    with pytest.raises(TypeError, match="must be a bool tensor, True marking a real token"):
        model(tokens(2, 3), key_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="must have the shape of tokens"):
        model(tokens(2, 3), key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"integer token ids \(B, T\)"):
        model(torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"cache must be this stack's new_cache\(\) \(2 layers\)"):
        model(tokens(2, 3), cache=DecoderLM(V, C, H, 3).new_cache(2, 4))


def test_generate_argument_errors():
    model, prompt = lm(), tokens(2, 3)
    with pytest.raises(ValueError, match="pass greedy=False to sample"):
        model.generate(prompt, 2, temperature=0.5)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        model.generate(prompt, 2, greedy=False, temperature=0.0)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        model.generate(prompt, 2, greedy=False, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        model.generate(prompt, 0)
    with pytest.raises(ValueError, match=r"eos must be a token id in \[0, 11\)"):
        model.generate(prompt, 2, eos=11)
    with pytest.raises(ValueError, match="bos must be a token id"):
        seq2seq().generate(prompt, 2, bos=-1)
