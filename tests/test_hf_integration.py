"""attn_implementation="qkv" in Hugging Face transformers models, against their own eager attention.

Models are built from small configs with random weights (nothing is downloaded). Outputs and
gradients are compared in float64 with assert_close defaults where transformers' eager path is
finite; where it is not (float64 eager rounds its -1.8e308 mask to -inf in a float32 softmax,
so rows with no real key are NaN), float32 runs are held to the tolerance policy against
transformers' sdpa in float64.
"""

from __future__ import annotations

import importlib
import inspect

import fresh
import pytest
import torch

transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
import qkv.integrations.transformers as qkv_hf  # noqa: E402

qkv_hf.register()
qkv_hf.register("qkv_tiled", backend="tiled")
qkv_hf.register("qkv_reference", backend="reference")  # plain float64 math: the golden

V = 97  # vocabulary


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def _mistral():
    cfg = transformers.MistralConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=4,
    )
    return transformers.MistralForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _qwen3():
    cfg = transformers.Qwen3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    return transformers.Qwen3ForCausalLM(cfg)


def _gemma3():
    cfg = transformers.Gemma3TextConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
    )
    return transformers.Gemma3ForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    return transformers.BertModel(cfg, add_pooling_layer=False)


def _bart():
    cfg = transformers.BartConfig(
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return transformers.BartForConditionalGeneration(cfg)


def _t5():
    cfg = transformers.T5Config(
        vocab_size=V,
        d_model=64,
        d_kv=16,
        d_ff=96,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _vit():
    cfg = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
    )
    return transformers.ViTModel(cfg, add_pooling_layer=False)


MODELS = {
    "llama": _llama,
    "gpt2": _gpt2,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "bert": _bert,
    "bart": _bart,
    "t5": _t5,
    "vit": _vit,
}
CAUSAL_LMS = ("llama", "gpt2", "mistral", "qwen2", "qwen3", "gemma3")
SEQ2SEQ = ("bart", "t5")


def _model(name: str, dtype=torch.float64):
    torch.manual_seed(0)
    return MODELS[name]().to(dtype).eval()


def _inputs(name: str, *, left: bool, B: int = 3, T: int = 11, dtype=torch.float64):
    """A batch with padding: row 0 full, row 1 missing 4 tokens, row 2 missing 7 (left or
    right). Returns ``(kwargs, real)`` with real ``(B, T)`` marking positions to compare."""
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(B, 3, 32, 32, generator=g, dtype=dtype)}, None
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in ((1, 4), (2, 7)):
        if left:
            mask[b, :n] = 0
        else:
            mask[b, T - n :] = 0
    kw = {"input_ids": ids, "attention_mask": mask}
    real = mask.bool()
    if name in SEQ2SEQ:
        dec = torch.randint(3, V, (B, 6), generator=g)
        kw.update(decoder_input_ids=dec)
        real = torch.ones(B, 6, dtype=torch.bool)
    return kw, real


def _last_hidden(model, name: str, impl: str, kw: dict, **extra):
    model.set_attn_implementation(impl)
    out = model(**kw, output_hidden_states=True, **extra)
    if name in SEQ2SEQ:
        return out.decoder_hidden_states[-1], out
    if name in ("bert", "vit"):
        return out.last_hidden_state, out
    return out.hidden_states[-1], out


def _grads(model, name: str, impl: str, kw: dict, real):
    model.zero_grad()
    h, _ = _last_hidden(model, name, impl, kw)
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(2), dtype=h.dtype)
    keep = torch.ones(h.shape[:2], dtype=torch.bool) if real is None else real
    (h * w)[keep].sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# transformers' eager attention takes its softmax in float32 whatever the model's dtype, so
# in float64 it agrees with exact attention to float32's tolerance only.
EAGER_TOL = dict(rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hidden_states_and_gradients_equal_exact_attention_in_float64(name, left):
    """Against transformers' sdpa (torch's exact float64 kernels): assert_close defaults, on
    every real position and for the gradient of every parameter; and, without padding,
    against eager to the float32 tolerance its softmax has."""
    model = _model(name)
    kw, real = _inputs(name, left=left)
    keep = (slice(None),) if real is None else (real,)
    ours, _ = _last_hidden(model, name, "qkv", kw)
    exact, _ = _last_hidden(model, name, "sdpa", kw)
    torch.testing.assert_close(ours[keep], exact[keep])
    assert ours.isfinite().all()
    if "attention_mask" in kw:  # eager's float32 softmax: rows with no real key are NaN
        kw = dict(kw, attention_mask=torch.ones_like(kw["attention_mask"]))
    ours, _ = _last_hidden(model, name, "qkv", kw)
    eager, _ = _last_hidden(model, name, "eager", kw)
    torch.testing.assert_close(ours, eager, **EAGER_TOL)
    g_ours, g_exact = _grads(model, name, "qkv", kw, real), _grads(model, name, "sdpa", kw, real)
    assert g_ours.keys() == g_exact.keys() and len(g_ours) > 10
    for n in g_exact:
        torch.testing.assert_close(g_ours[n], g_exact[n], msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("impl", ["qkv", "qkv_tiled"])
@pytest.mark.parametrize("name", CAUSAL_LMS + ("bert",) + SEQ2SEQ)
def test_left_padding_float32_within_the_tolerance_policy(name, impl):
    """Left padding under a causal mask leaves the first rows of a padded sequence nothing
    to attend. golden: transformers' sdpa in float64; baseline: eager in float32."""
    kw, real = _inputs(name, left=True)
    golden, _ = _last_hidden(_model(name), name, "sdpa", kw)
    model = _model(name, torch.float32)
    kw32, _ = _inputs(name, left=True, dtype=torch.float32)
    ours, _ = _last_hidden(model, name, impl, kw32)
    base, _ = _last_hidden(model, name, "eager", kw32)
    assert ours.isfinite().all()
    err = (ours.double() - golden)[real].abs().max()
    bound = 2 * (base.double() - golden)[real].abs().max() + 1e-5
    assert err <= bound, f"{name}: |qkv - sdpa64| = {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", list(MODELS))
def test_attention_weights_equal_eager(name):
    """In float32, where eager is finite: every row of a real query (padded query rows have
    no real key under a sliding window; there eager averages, qkv gives 0)."""
    model = _model(name, torch.float32)
    kw, real = _inputs(name, left=False, dtype=torch.float32)
    _, ours = _last_hidden(model, name, "qkv", kw, output_attentions=True)
    _, eager = _last_hidden(model, name, "eager", kw, output_attentions=True)
    kinds = (
        ["attentions"]
        if name not in SEQ2SEQ
        else ["encoder_attentions", "decoder_attentions", "cross_attentions"]
    )
    for kind in kinds:
        a, e = getattr(ours, kind), getattr(eager, kind)
        assert len(a) == len(e) == 2 and all(t is not None for t in a), kind
        for layer, (x, y) in enumerate(zip(a, e)):
            rows = real if (real is not None and kind in ("attentions",)) else None
            if rows is not None:  # the real query rows
                x_rows, y_rows = x.transpose(1, 2)[rows], y.transpose(1, 2)[rows]
            else:
                x_rows, y_rows = x, y
            torch.testing.assert_close(
                x_rows, y_rows, **EAGER_TOL, msg=lambda m, k=kind, i=layer: f"{k}[{i}]: {m}"
            )


def test_weights_only_when_asked():
    model = _model("llama")
    kw, _ = _inputs("llama", left=False)
    model.set_attn_implementation("qkv")
    assert model(**kw).attentions is None
    out = model.generate(
        **kw,
        max_new_tokens=2,
        do_sample=False,
        pad_token_id=0,
        output_attentions=True,
        return_dict_in_generate=True,
    )
    prefill, step = out.attentions  # per step, per layer
    assert len(prefill) == 2 and prefill[0].shape == (3, 4, 11, 11)
    assert step[1].shape == (3, 4, 1, 12)
    torch.testing.assert_close(step[1].sum(-1), torch.ones(3, 4, 1, dtype=torch.float64))


@pytest.mark.parametrize("name", CAUSAL_LMS + SEQ2SEQ)
def test_generate_gives_eagers_tokens(name):
    model = _model(name, torch.float32)
    kw, _ = _inputs(name, left=True, dtype=torch.float32)
    kw.pop("decoder_input_ids", None)
    tokens = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(
            **kw, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
        )
    assert tokens["qkv"].shape[-1] >= 8
    torch.testing.assert_close(tokens["qkv"], tokens["eager"], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "bert", "bart"])
def test_a_fully_padded_sequence_is_finite(name):
    """A sequence with no real token (every key padding): eager's float32 gives uniform
    weights; qkv's mask contract gives 0 weights and no NaN, forward and backward."""
    model = _model(name, torch.float32).train(False)
    kw, _ = _inputs(name, left=False, dtype=torch.float32)
    kw["attention_mask"][2] = 0
    model.set_attn_implementation("qkv")
    h, out = _last_hidden(model, name, "qkv", kw, output_attentions=True)
    assert h.isfinite().all()
    h.sum().backward()
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    weights = out.attentions if name != "bart" else out.encoder_attentions
    assert (weights[0][2] == 0).all()


class _Spy:
    """Records the keyword arguments of every qkv attention call the integration makes."""

    def __init__(self, monkeypatch):
        self.calls = []
        from qkv.integrations.transformers import attention as hf_attention

        real = hf_attention.scaled_dot_product_attention

        def spy(*args, **kwargs):
            self.calls.append(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(hf_attention, "scaled_dot_product_attention", spy)


def test_sliding_window_is_a_window_mask_not_a_dense_one(monkeypatch):
    """Mistral's window of 4 keys: qkv gets a window mask_mod (tiled skips blocks by it) and
    a (B, 1, 1, S) padding mask, never a (T, S) tensor; also while decoding from a cache."""
    model = _model("mistral", torch.float32)
    kw, _ = _inputs("mistral", left=True, dtype=torch.float32)
    spy = _Spy(monkeypatch)
    model.set_attn_implementation("qkv")
    model.generate(**kw, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(spy.calls) == 2 * 3  # 2 layers x (prefill + 2 decode steps)
    for call in spy.calls:
        mod = call["mask_mod"]
        assert (mod.left, mod.right) == (3, 0), mod
        keep = call["attn_mask"]  # padding, when the keys in the window have some
        assert keep is None or keep.shape == (3, 1, 1, keep.shape[-1])
    assert spy.calls[0]["attn_mask"] is not None


def test_plain_causal_stays_on_torchs_causal_kernel(monkeypatch):
    model = _model("llama", torch.float32)
    spy = _Spy(monkeypatch)
    model.set_attn_implementation("qkv")
    model(torch.randint(3, V, (2, 9)))
    assert [(c["is_causal"], c["mask_mod"], c["attn_mask"]) for c in spy.calls] == [
        (True, None, None)
    ] * 2


def test_dropout_is_passed_in_training_only(monkeypatch):
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.25,
    )
    model = transformers.LlamaModel(cfg)
    model.set_attn_implementation("qkv")
    spy = _Spy(monkeypatch)
    ids = torch.randint(3, V, (2, 9))
    model.train()(ids)
    model.eval()(ids)
    assert [c["dropout_p"] for c in spy.calls] == [0.25, 0.0]
    torch.manual_seed(5)
    a = model.train()(ids).last_hidden_state
    torch.manual_seed(5)
    b = model(ids).last_hidden_state
    assert torch.equal(a, b) and not torch.allclose(a, model.eval()(ids).last_hidden_state)


def test_from_config_and_unknown_features():
    model = transformers.LlamaForCausalLM._from_config(_llama().config, attn_implementation="qkv")
    assert model.config._attn_implementation == "qkv"
    q = torch.randn(1, 2, 3, 8)
    # never dropped: dense attention is wrong there (tests/test_hf_sparse_selection.py)
    with pytest.raises(ValueError, match="block_indices= needs the key block size"):
        qkv_hf.attention_forward(
            model.model.layers[0].self_attn,
            q,
            q,
            q,
            None,
            block_indices=torch.zeros(1, 2, 3, 1, dtype=torch.long),
        )
    with pytest.raises(ValueError, match=r"indices= must be \(B, T, k\)"):
        qkv_hf.attention_forward(
            model.model.layers[0].self_attn,
            q,
            q,
            q,
            None,
            indices=torch.zeros(1, 2, 3, 1, dtype=torch.long),
        )
    with pytest.raises(TypeError, match="attention_mask of type"):
        qkv_hf.attention_forward(model.model.layers[0].self_attn, q, q, q, "causal")


@pytest.mark.parametrize("offsets", [(0, 0), (5, 0), (7, 3)], ids=lambda o: f"q{o[0]}-kv{o[1]}")
@pytest.mark.parametrize("fn", ["causal", "window4", "window4_bidirectional", "chunked3"])
def test_every_mask_function_equals_transformers_dense_mask(fn, offsets):
    """The structure qkv reads off transformers' mask functions allows exactly the pairs
    transformers' own dense sdpa mask allows, at any cache offsets."""
    from transformers import masking_utils as mu

    if fn == "window4_bidirectional" and not hasattr(
        mu, "sliding_window_bidirectional_mask_function"
    ):
        pytest.skip(f"transformers {transformers.__version__} has no bidirectional sliding window")
    fns = {
        "causal": lambda: mu.causal_mask_function,
        "window4": lambda: mu.sliding_window_causal_mask_function(4),
        "window4_bidirectional": lambda: mu.sliding_window_bidirectional_mask_function(4),
        "chunked3": lambda: mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)),
    }
    T, S = 6, 13
    q_off, kv_off = offsets
    pad = torch.ones(2, kv_off + S, dtype=torch.bool)
    pad[1, kv_off : kv_off + 2] = False
    args = dict(
        batch_size=2, kv_length=S, kv_offset=kv_off, mask_function=fns[fn](), attention_mask=pad
    )
    if "cache_position" in inspect.signature(mu.sdpa_mask).parameters:  # transformers < 5.4
        args.update(cache_position=torch.arange(q_off, q_off + T))
    else:
        args.update(q_length=T, q_offset=q_off)
    want = mu.sdpa_mask(**args, allow_is_causal_skip=False)  # (B, 1, T, S)
    hf = qkv_hf.build_mask(**args)
    keep, mask_mod, causal = qkv_hf.masks._mask_args(None, hf, T, S, None, None)
    got = torch.ones(2, 1, T, S, dtype=torch.bool) & keep
    if causal:
        got &= qkv.masks.to_dense(qkv.masks.causal(), 2, 1, T, S)
    if mask_mod is not None:
        got &= qkv.masks.to_dense(mask_mod, 2, 1, T, S)
    assert torch.equal(got, want)


def test_gemma2_softcap_and_alternating_windows_equal_eager():
    """Gemma 2: logit softcapping (a score_mod) and sliding-window layers between global ones.
    transformers has no sdpa path for it: qkv's reference backend (plain float64 math) is the
    golden, and eager agrees to its float32 softmax's error (relative to the largest value)."""
    cfg = transformers.Gemma2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        query_pre_attn_scalar=16,
    )
    torch.manual_seed(0)
    model = transformers.Gemma2Model(cfg).double().eval()
    ids = torch.randint(3, V, (2, 13), generator=torch.Generator().manual_seed(3))
    out, grads = {}, {}
    for impl in ("qkv", "qkv_reference", "eager"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out[impl] = model(ids, output_attentions=True)
        out[impl].last_hidden_state.square().sum().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(
        out["qkv"].last_hidden_state, out["eager"].last_hidden_state, **EAGER_TOL
    )
    for ours, eager in zip(out["qkv"].attentions, out["eager"].attentions):
        torch.testing.assert_close(ours, eager, **EAGER_TOL)
    assert (out["qkv"].attentions[0][..., 12, :8] == 0).all()  # outside the window of 4
    scale = max(g.abs().max().item() for g in grads["eager"].values())  # of the whole model
    for n in grads["eager"]:
        torch.testing.assert_close(grads["qkv"][n], grads["qkv_reference"][n])
        torch.testing.assert_close(
            grads["qkv"][n], grads["eager"][n], rtol=1.3e-6, atol=1e-6 * scale
        )


@pytest.mark.parametrize("version", ["4.57.1", "5.2.0", "6.0.0"])
def test_register_refuses_transformers_outside_the_tested_range(monkeypatch, version):
    # the module object register() imports: transformers swaps its entry in sys.modules
    # once a model is built, so not necessarily the one importorskip returned
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", version)
    with pytest.raises(ImportError, match=rf"supports transformers >=5\.3,<6, found {version}"):
        qkv_hf.register()


def test_whisper_equals_eager():
    """Whisper (audio encoder, text decoder with cross-attention): decoder hidden states and
    every gradient in float64, and generate()'s tokens in float32, against eager."""
    cfg = transformers.WhisperConfig(
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 8, 32, generator=g, dtype=torch.float64)  # (B, mels, 2 * 16 frames)
    dec = torch.randint(3, V, (2, 6), generator=g)
    out, grads = {}, {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        res = model(input_features=feats, decoder_input_ids=dec, output_hidden_states=True)
        h = res.decoder_hidden_states[-1]
        (
            h * torch.randn(h.shape, generator=torch.Generator().manual_seed(2), dtype=h.dtype)
        ).sum().backward()
        out[impl] = h.detach()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out["qkv"], out["eager"], **EAGER_TOL)
    assert grads["qkv"].keys() == grads["eager"].keys()
    for name in grads["eager"]:
        torch.testing.assert_close(
            grads["qkv"][name],
            grads["eager"][name],
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m, n=name: f"{n}: {m}",
        )
    model.float()
    tokens = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(
            input_features=feats.float(), max_new_tokens=6, min_new_tokens=6, do_sample=False
        )
    assert torch.equal(tokens["qkv"], tokens["eager"])


def test_models_with_their_own_attention_tables_say_why_not():
    """git, sam and the like pick attention classes from their own tables; with "qkv" they
    raised KeyError: 'qkv'. Now one error names the model and the way out, in modules imported
    before register() and in those imported after (through the finder register() adds)."""

    from transformers.models.git import modeling_git

    assert "qkv" in modeling_git.GIT_SELF_ATTENTION_CLASSES
    cfg = transformers.GitConfig(
        vision_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=48,
            image_size=32,
            patch_size=8,
        ),
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    with pytest.raises(
        NotImplementedError,
        match=r"git picks its attention classes from its "
        r"own table GIT_SELF_ATTENTION_CLASSES",
    ):
        transformers.GitModel._from_config(cfg, attn_implementation="qkv")
    code = (
        "import sys, qkv.integrations.transformers as h; h.register(); "
        "assert 'transformers.models.superglue.modeling_superglue' not in sys.modules; "
        "from transformers.models.superglue import modeling_superglue as m\n"
        "try:\n    m.SUPERGLUE_SELF_ATTENTION_CLASSES['qkv'](None)\n"
        "except NotImplementedError as e:\n    print(e)"
    )
    done = fresh.run(code, timeout=300)  # a fresh interpreter: superglue never imported
    assert done.returncode == 0, done.stderr[-2000:]
    assert "superglue picks its attention classes from its own table" in done.stdout


def test_every_keyword_transformers_passes_is_implemented_ignored_as_eager_or_refused():
    """Scans every modeling file of the installed transformers for the keywords its attention
    calls pass. Dropping one that changes the result gave MiniMax-M3 dense attention; each
    must be implemented, ignored as transformers' eager attention ignores it, or refused."""
    import pathlib
    import re

    root = pathlib.Path(transformers.__file__).parent / "models"
    seen: dict[str, str] = {}
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text()
        for match in re.finditer(r"attention_interface\(", text):
            depth, end = 1, match.end()
            while depth and end < len(text):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            for word in re.findall(r"\b([a-z_][a-z_0-9]*)\s*=(?!=)", text[match.end() : end - 1]):
                seen.setdefault(word, path.parent.name)
    known = (
        qkv_hf.KEYWORDS_IMPLEMENTED
        | qkv_hf.KEYWORDS_IGNORED_AS_EAGER
        | set(qkv_hf.attention._REFUSED)
    )
    assert len(seen) > 10
    unknown = {w: model for w, model in seen.items() if w not in known}
    assert not unknown, f"keywords passed to the attention function with no decision: {unknown}"
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    for word in qkv_hf.attention._REFUSED:
        with pytest.raises(NotImplementedError, match=word):
            qkv_hf.attention_forward(module, q, q, q, None, **{word: torch.zeros(1)})
