"""Sparse key selection from transformers' indexers (issue 30, item 0): DeepSeek sparse
attention passes ``indices=`` (top-k keys per query) and MiniMax-M3 ``block_indices=`` (top-k
key blocks per query and indexer head). qkv once dropped ``block_indices`` and computed dense
attention; now it masks the unselected keys as transformers' eager attention does. Checked
against plain index arithmetic, and against eager on the models built tiny."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from qkv.integrations import transformers as qkv_hf
from qkv.integrations.transformers import attention as hf_attention

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def _registered():
    qkv_hf.register()
    transformers.logging.set_verbosity_error()


def _module(block_size=None):
    module = torch.nn.Module()
    if block_size is not None:
        module.indexer = torch.nn.Module()
        module.indexer.block_size = block_size
    return module


def test_indices_keep_exactly_the_listed_keys_for_every_head():
    B, H, T, S, k = 2, 3, 5, 9, 3
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(S, generator=gen)[:k] for _ in range(B * T)]).view(B, T, k)
    idx[0, 1, 2] = -1  # an empty slot keeps nothing
    q = torch.randn(B, H, T, 4, generator=gen)
    keep = hf_attention._selected_keys(_module(), q, S, {"indices": idx.int()})
    assert keep.shape == (B, 1, T, S)
    for b in range(B):
        for t in range(T):
            want = {int(i) for i in idx[b, t] if i >= 0}
            assert set(torch.nonzero(keep[b, 0, t]).flatten().tolist()) == want


def test_block_indices_keep_whole_blocks_per_indexer_head_group():
    B, H, H_idx, T, S, size = 1, 4, 2, 3, 10, 4  # blocks [0-3], [4-7], [8-9]
    blocks = torch.tensor(
        [[[[0, -1], [2, 1], [-1, -1]], [[1, 2], [0, -1], [2, -1]]]]
    )  # (B, H_idx, T, k)
    q = torch.randn(B, H, T, 4)
    keep = hf_attention._selected_keys(_module(size), q, S, {"block_indices": blocks})
    assert keep.shape == (B, H, T, S)
    keys = {0: range(4), 1: range(4, 8), 2: range(8, 10)}
    for h in range(H):
        g = h // (H // H_idx)  # heads 0,1 -> indexer head 0; heads 2,3 -> 1
        for t in range(T):
            want = {j for blk in blocks[0, g, t].tolist() if blk >= 0 for j in keys[blk]}
            assert set(torch.nonzero(keep[0, h, t]).flatten().tolist()) == want


def test_a_selection_composes_with_the_mask_and_a_row_left_with_no_key_gives_zero():
    torch.manual_seed(0)
    B, H, T, D = 1, 2, 4, 8
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    idx = torch.tensor([[[0, 3], [1, 3], [0, 1], [2, 3]]])  # (B, T, k)
    out, _ = qkv_hf.attention_forward(_module(), q, k, v, None, is_causal=True, indices=idx)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        allowed[t, idx[0, t]] = True
    allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    s = (q @ k.transpose(-1, -2)) / D**0.5
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    want = (p @ v).transpose(1, 2)
    torch.testing.assert_close(out, want)  # every row here keeps a causal key


def test_both_selections_at_once_or_no_block_size_are_refused_by_name():
    q = torch.randn(1, 2, 3, 4)
    idx = torch.zeros(1, 3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="both indices= and block_indices="):
        qkv_hf.attention_forward(
            _module(2), q, q, q, None, indices=idx, block_indices=idx.view(1, 1, 3, 1)
        )
    with pytest.raises(ValueError, match="block size"):
        qkv_hf.attention_forward(_module(), q, q, q, None, block_indices=idx.view(1, 1, 3, 1))


def _deepseek_v32():
    return transformers.AutoConfig.for_model(
        "deepseek_v32",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        v_head_dim=8,
        qk_nope_head_dim=8,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        index_topk=6,
        index_head_dim=8,
        index_n_heads=2,
        head_dim=4,
        qk_head_dim=12,
        first_k_dense_replace=1,
        pad_token_id=0,
        max_position_embeddings=64,
        layer_types=["indexed_attention"] * 2,
    )


def _minimax_m3():
    # A sparse layer (blocks of 4 keys, 2 kept per query: the local one and the best other)
    # beside a full one; default configs have no sparse layer, so a default build hides it.
    return transformers.AutoConfig.for_model(
        "minimax_m3_vl_text",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        dense_intermediate_size=32,
        shared_intermediate_size=16,
        rotary_dim=4,
        index_n_heads=2,
        index_head_dim=8,
        index_block_size=4,
        index_topk_blocks=2,
        index_local_blocks=1,
        layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        pad_token_id=0,
    )


MODELS = {"deepseek_v32": _deepseek_v32, "minimax_m3_vl_text": _minimax_m3}


def _run(model, ids, pad, impl):
    model.set_attn_implementation(impl)
    model.zero_grad()
    res = model(input_ids=ids, attention_mask=pad, output_attentions=True)
    res.logits[pad.bool()].square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return res.logits.detach(), [a.detach() for a in res.attentions], grads


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_sparse_models_equal_eager_logits_weights_and_gradients(name, side, monkeypatch):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[name]()).eval()
    T = 24
    ids = torch.randint(3, 90, (2, T), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, T, dtype=torch.long)
    pad[1, :5] = 0 if side == "left" else 1
    pad[1, -5:] = 0 if side == "right" else 1
    real = pad.bool()
    eager, mine = _run(model, ids, pad, "eager"), _run(model, ids, pad, "qkv")
    torch.testing.assert_close(mine[0][real], eager[0][real], atol=1e-5, rtol=1e-4)
    assert len(mine[1]) == len(eager[1]) == 2
    for a, b in zip(mine[1], eager[1]):  # (B, H, T, S): compare real query rows
        torch.testing.assert_close(
            a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=1e-5, rtol=1e-4
        )
    assert mine[2].keys() == eager[2].keys()
    for n in eager[2]:  # an absolute floor: some true gradients are ~0
        torch.testing.assert_close(mine[2][n], eager[2][n], atol=1e-4, rtol=1e-3, msg=n)
    # The selection matters here: without it the same model gives other logits.
    monkeypatch.setattr(hf_attention, "_selected_keys", lambda *a, **k: None)
    dense = _run(model, ids, pad, "qkv")[0]
    assert (dense[real] - eager[0][real]).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(MODELS))
def test_sparse_models_generate_eagers_tokens(name):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[name]()).eval()
    ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(2))
    tokens = {}
    with torch.no_grad():
        for impl in ("eager", "qkv"):
            model.set_attn_implementation(impl)
            tokens[impl] = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens["qkv"], tokens["eager"])


def test_qkv_sdpa_is_used_for_the_selected_keys(monkeypatch):
    """The selection reaches qkv's attention as a mask, not through an eager fallback."""
    seen = []
    real = hf_attention.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_deepseek_v32()).eval()
    model.set_attn_implementation("qkv")
    with torch.no_grad():
        model(input_ids=torch.randint(3, 90, (1, 12)))
    assert len(seen) == 2 and all(m is not None and m.dtype == torch.bool for m in seen)


@pytest.mark.parametrize("name", list(MODELS))
def test_sparse_models_compile_as_one_graph(name):
    """deepseek_v32 slices the mask (``attention_mask[:, 0]``) for its indexer: under compile
    that needs the mask tensor subclass, which it now is."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[name]()).eval()
    model.set_attn_implementation("qkv")
    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(1))
    pad = torch.ones_like(ids)
    pad[1, :5] = 0
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=pad, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend=counter)
        got = compiled(input_ids=ids, attention_mask=pad, use_cache=False).logits
    assert counter.frame_count == 1
    torch.testing.assert_close(got[pad.bool()], want[pad.bool()])


# --- selections out of range (issue 41, item 3) -----------------------------------------------


@pytest.mark.parametrize("bad", [4, 5, -2, -100], ids=lambda b: f"S4-key{b}")
def test_an_index_outside_the_keys_is_refused_with_its_value_and_S(bad):
    """Any index outside [-1, S) raises, naming indices=, the value and S (4, -2 and -100
    were taken as empty slots, 5 raised torch's scatter message about a size of 5)."""
    q = torch.randn(1, 2, 3, 4)
    idx = torch.tensor([[[0, 1], [2, bad], [3, -1]]])  # (B, T, k)
    with pytest.raises(ValueError, match=rf"indices= holds key {bad}, outside \[-1, 4\).*S=4"):
        qkv_hf.attention_forward(_module(), q, q[:, :, :1].expand(1, 2, 4, 4), q, None, indices=idx)


@pytest.mark.parametrize("bad", [3, 7, -2], ids=lambda b: f"S10-size4-block{b}")
def test_a_block_outside_the_blocks_is_refused_with_its_value_and_S(bad):
    """S = 10 keys in blocks of 4 make blocks 0, 1, 2: block 3 (or 7, or -2) is refused."""
    q, kv = torch.randn(1, 4, 3, 4), torch.randn(1, 4, 10, 4)
    blocks = torch.tensor([[[[0], [bad], [-1]], [[1], [2], [-1]]]])  # (B, H_idx, T, k)
    with pytest.raises(
        ValueError, match=rf"block_indices= holds block {bad}, outside \[-1, 3\): S=10 keys"
    ):
        qkv_hf.attention_forward(_module(4), q, kv, kv, None, block_indices=blocks)


@pytest.mark.parametrize("size", [0, -4, 2.0], ids=["size0", "size-4", "size-float"])
def test_a_block_size_that_is_not_positive_is_reported_as_it_is(size):
    """``module.indexer.block_size = 0`` was reported as "has neither" attribute."""
    q = torch.randn(1, 2, 3, 4)
    blocks = torch.zeros(1, 1, 3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"module.indexer.block_size is {size!r}"):
        qkv_hf.attention_forward(_module(size), q, q, q, None, block_indices=blocks)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_an_index_outside_the_keys_is_refused_in_a_compiled_graph(backend):
    """Under torch.compile the check runs in the graph (the ``qkv::selection_slots`` op), at
    run time: a good selection gives eager's mask, a bad one the same ValueError. (The whole
    attention function is compiled in test_sparse_models_compile_as_one_graph.)"""
    q = torch.randn(1, 2, 3, 4)

    def kept(idx):
        return hf_attention._selected_keys(_module(), q, 5, {"indices": idx})

    good = torch.tensor([[[0, 4], [2, -1], [3, 1]]])
    torch._dynamo.reset()
    compiled = torch.compile(kept, fullgraph=True, backend=backend)
    assert torch.equal(compiled(good), kept(good))
    with pytest.raises(ValueError, match=r"indices= holds key 5, outside \[-1, 5\).*S=5"):
        compiled(torch.tensor([[[0, 4], [2, 5], [3, 1]]]))


def test_an_index_outside_the_keys_is_refused_by_an_exported_program():
    """torch.export keeps standard operators: there an assert in the graph raises (without
    the value, which it cannot read), never a silently dropped index."""

    class Kept(torch.nn.Module):
        def forward(self, q, idx):
            return hf_attention._selected_keys(_module(), q, 5, {"indices": idx})

    q = torch.randn(1, 2, 3, 4)
    good = torch.tensor([[[0, 4], [2, -1], [3, 1]]])
    program = torch.export.export(Kept(), (q, good))
    assert torch.equal(program.module()(q, good), Kept()(q, good))
    for bad in (5, -2):
        with pytest.raises(RuntimeError, match=r"indices= holds a key, outside \[-1, 5\).*S=5"):
            program.module()(q, torch.tensor([[[0, 4], [2, bad], [3, 1]]]))
