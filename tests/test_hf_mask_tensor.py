"""The mask qkv hands Hugging Face models is a tensor where model code reads it (issue 30, item
1; and, for issue 24, ``generate()`` with a static cache, whose precomputed mask transformers
treats as a 4-D tensor).

``build_mask`` returns an ``HFMaskTensor``: shape ``(B, 1, T, S)`` and dtype as transformers'
eager mask, its values formed only when model code reads them. qkv's attention function reads
the description instead. Compared with transformers' own ``eager_mask`` and eager attention,
models built tiny from configs (nothing downloaded).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

transformers = pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

import qkv.integrations.transformers as qkv_hf  # noqa: E402

qkv_hf.register()
V = 97


def _args(dtype=torch.float32):
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :3] = False  # left padding
    return dict(
        batch_size=2,
        q_length=9,
        kv_length=9,
        q_offset=0,
        kv_offset=0,
        mask_function=mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(4)),
        attention_mask=pad,
        dtype=dtype,
        device="cpu",
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_mask_reads_as_transformers_eager_mask(dtype):
    args = _args(dtype)
    mask = qkv_hf.build_mask(**args)
    want = mu.eager_mask(**args)  # (B, 1, T, S): 0 or the dtype's minimum
    assert isinstance(mask, torch.Tensor) and mask._dense is None
    assert mask.shape == want.shape == (2, 1, 9, 9) and mask.dtype == want.dtype == dtype
    assert mask.ndim == 4 and mask.device == want.device
    assert mask._dense is None  # metadata formed nothing
    got = mask[:, :, :, :9]
    assert type(got) is torch.Tensor and torch.equal(got, want)
    scores = torch.randn(2, 4, 9, 9, dtype=dtype)
    torch.testing.assert_close(scores + mask, scores + want)
    assert torch.equal(mask.contiguous(), want) and torch.equal(
        mask.to(torch.float64), want.to(torch.float64)
    )


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_qkv_attention_never_forms_the_dense_mask(monkeypatch):
    formed = []
    real = qkv_hf.HFMaskTensor.dense
    monkeypatch.setattr(qkv_hf.HFMaskTensor, "dense", lambda self: formed.append(1) or real(self))
    model = _llama()
    model.set_attn_implementation("qkv")
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, :4] = 0
    with torch.no_grad():
        model(input_ids=ids, attention_mask=pad)
    assert formed == []


def _doge():
    cfg = transformers.DogeConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.DogeForCausalLM(cfg)


def _bigbird_pegasus():
    cfg = transformers.BigBirdPegasusConfig(
        vocab_size=V,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        attention_type="original_full",
    )
    return transformers.BigBirdPegasusForCausalLM(cfg)


@pytest.mark.parametrize("build", [_doge, _bigbird_pegasus], ids=["doge", "bigbird_pegasus"])
def test_models_that_read_the_mask_as_a_tensor_equal_eager(build):
    """doge reads ``attention_mask.dtype``; bigbird_pegasus adds the mask to its scores (both
    raised on the mask description). Real positions equal eager's; the left-padded query rows,
    which may attend to no key, are 0 in qkv (the mask contract) and a uniform average in
    eager, so they are left out, as the next layers leave them out."""
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :3] = 0
    out = {}
    for impl in ("eager", "qkv"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model(input_ids=ids, attention_mask=pad).logits
    real = pad.bool()
    torch.testing.assert_close(out["qkv"][real], out["eager"][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_generate_with_a_static_cache_equals_eager_attention(compiled):
    """transformers precomputes a 4-D mask for a static cache and hands it to the forward as a
    tensor. Compiled with fullgraph=True, the forward traces twice in all (prefill and every
    step after), as with transformers' own attention."""
    torch.manual_seed(0)
    model = _llama()
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(2))
    pad = torch.ones(2, 7, dtype=torch.long)
    pad[1, :2] = 0
    kw = dict(
        attention_mask=pad,
        max_new_tokens=6,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    with torch.no_grad():
        want = model.generate(ids, **kw)
        model.set_attn_implementation("qkv")
        if compiled:
            from torch._dynamo.testing import CompileCounterWithBackend

            torch._dynamo.reset()
            counter = CompileCounterWithBackend("aot_eager")
            model.forward = torch.compile(model.forward, backend=counter, fullgraph=True)
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)
    if compiled:
        assert counter.frame_count == 2


@pytest.mark.parametrize("padded", [False, True])
def test_a_one_key_mask_is_broadcast_over_the_keys_as_eager_does(padded):
    """BERT without ``is_decoder`` under ``generate()``: its cache grows, but transformers
    builds the mask for one key. Eager and sdpa broadcast it over every key; qkv raised."""
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = BertLMHeadModel(cfg).eval()
    ids = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    pad = torch.ones_like(ids)
    if padded:
        pad[1, :2] = 0
    tokens = {}
    with torch.no_grad():
        for impl in ("eager", "qkv"):
            model.set_attn_implementation(impl)
            tokens[impl] = model.generate(
                ids, attention_mask=pad, max_new_tokens=5, do_sample=False, pad_token_id=0
            )
    assert torch.equal(tokens["qkv"], tokens["eager"])
    T, S = 1, 9
    one_key = qkv_hf.HFMask(mu.bidirectional_mask_function, 1, 1, 8, 0, None)
    q = torch.randn(1, 2, T, 8)
    with pytest.raises(ValueError, match="built the mask for T=1, S=3"):
        qkv_hf.attention_forward(
            torch.nn.Module(),
            q,
            torch.randn(1, 2, S, 8),
            torch.randn(1, 2, S, 8),
            qkv_hf.HFMask(mu.bidirectional_mask_function, 1, 3, 0, 0, None),
        )
    out, _ = qkv_hf.attention_forward(
        torch.nn.Module(), q, q.expand(1, 2, S, 8), q.expand(1, 2, S, 8), one_key
    )
    torch.testing.assert_close(out, q.transpose(1, 2))  # every key equal: output = the value


@pytest.mark.parametrize("build", [_doge, _bigbird_pegasus], ids=["doge", "bigbird_pegasus"])
def test_models_that_read_the_mask_compile_as_one_graph(build):
    """Under torch.compile the mask is the same tensor subclass (it raised there when it was
    the bare description: 'HFMask' object is not subscriptable)."""
    torch.manual_seed(0)
    model = build().eval()
    model.set_attn_implementation("qkv")
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :3] = 0
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=pad, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        got = compiled(input_ids=ids, attention_mask=pad, use_cache=False).logits
    assert counter.frame_count == 1
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_a_padded_llama_exports_and_equals_eager(strict):
    """torch.export gets the description (non-strict export cannot make the subclass from
    its fake tensors); the exported program equals the eager model at real positions."""
    model = _llama()
    model.set_attn_implementation("qkv")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, pad):
            return self.model(input_ids=ids, attention_mask=pad, use_cache=False).logits

    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, :3] = 0
    with torch.no_grad():
        program = torch.export.export(Logits(), (ids, pad), strict=strict)
        got, want = program.module()(ids, pad), Logits()(ids, pad)
    torch.testing.assert_close(got[pad.bool()], want[pad.bool()])


# --- writes into the mask (issue 41, item 2) ---------------------------------------------------


def _write(kind: str):
    """A forward pre-hook of layer 0 that writes into the mask the layer is handed, and notes
    (for the eager run) which query rows are left with a key."""
    seen = {}

    def hook(mod, args, kwargs):
        m = kwargs["attention_mask"]
        low = torch.finfo(m.dtype).min
        if kind == "setitem":  # key 0 hidden from every query
            m[..., 0] = low
        elif kind == "masked_fill_":  # key 1 hidden from every query
            m.masked_fill_(torch.arange(m.shape[-1]) == 1, low)
        elif kind == "zero_":  # every key visible to every query, the future included
            m.zero_()
        elif kind == "view":  # through a view: batch 0 sees every key
            m[0].fill_(0.0)
        elif kind == "data":  # through .data, which keeps no version count
            m.data[:, :, :, 2] = low
        seen["keyed"] = (m > low).any(-1)[:, 0]  # (B, T): rows with a key left

    return hook, seen


_WRITES = [
    pytest.param(kind, padded, mode, id=f"{kind}-{'left-padded' if padded else 'unpadded'}-{mode}")
    for kind in ("setitem", "masked_fill_", "zero_", "view", "data")
    for padded in (False, True)
    for mode in ("no_grad", "inference_mode", "compiled")
    if mode != "compiled" or kind in ("setitem", "masked_fill_")  # each compile costs seconds
]


@pytest.mark.parametrize("kind, padded, mode", _WRITES)
def test_writes_into_the_mask_reach_qkv_attention_as_eager(kind, padded, mode):
    """Model code that writes into the mask (here a pre-hook of layer 0; transformers hands
    the same mask to layer 1, so the write reaches it too) changes qkv's result as it changes
    eager's: qkv reads the written values (it read the description and ignored them). Rows
    the write leaves with no key are 0 in qkv and a uniform average in eager (the mask
    contract), so those are left out, as padded rows are."""
    model = _llama()
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 10, dtype=torch.long)
    if padded:
        pad[1, :3] = 0
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    out = {}
    for impl in ("eager", "qkv", "qkv-unwritten"):
        model.set_attn_implementation(impl.split("-")[0])
        hook, seen = _write(kind)
        handle = None
        if impl != "qkv-unwritten":
            handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        run = model
        if mode == "compiled" and impl == "qkv":
            torch._dynamo.reset()
            run = torch.compile(model, fullgraph=True, backend="aot_eager")
        with ctx():
            out[impl] = run(input_ids=ids, attention_mask=pad, use_cache=False).logits.clone()
        if handle is not None:
            handle.remove()
        if impl == "eager":
            keep = pad.bool() & seen["keyed"]  # (B, T)
    assert keep.sum() >= 15  # the comparison covers most rows
    torch.testing.assert_close(out["qkv"][keep], out["eager"][keep], atol=1e-5, rtol=1e-5)
    moved = (out["qkv"][keep] - out["qkv-unwritten"][keep]).abs().max()
    assert moved > 1e-3  # the write mattered: the test is not vacuous


def test_a_mask_only_read_keeps_the_description_and_a_write_drops_it():
    """Reading the values (slicing, arithmetic) leaves qkv on the description; any in-place
    write, through the mask or a view of it, switches it to the values."""
    from qkv.integrations.transformers.masks import _mask_args

    mask = qkv_hf.build_mask(**_args())
    assert not mask.written()
    _ = mask[:, :, :4] + 1.0  # a read forms the values
    assert mask._dense is not None and not mask.written()
    keep, _, _ = _mask_args(None, mask, 9, 9, None, None)
    assert keep.dtype == torch.bool and keep.shape == (2, 1, 1, 9)  # the description's padding
    mask[1].zero_()  # through a view (mask[1] is the values' view)
    assert mask.written()
    got, mod, causal = _mask_args(None, mask, 9, 9, None, None)
    assert mod is None and not causal and got.shape == (2, 1, 9, 9)
    want = mu.eager_mask(**_args())
    want[1] = 0.0
    want = want.masked_fill(want == torch.finfo(torch.float32).min, float("-inf"))
    assert torch.equal(got, want)
