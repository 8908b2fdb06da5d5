"""transformers' deformable models on qkv's kernel (issue 40, item 2, Hugging Face).

After ``qkv.integrations.transformers.register()`` the ``MultiScaleDeformableAttention`` class of
Deformable DETR, Grounding DINO and the other models that copy it runs
``qkv.deformable_attention`` (``qkv::deformable_attention``, the C++ kernel on CPU) instead of
its ``grid_sample`` loop. Tiny builds (a ResNet backbone of 8 channels, one encoder and one
decoder layer, four feature levels, 2 points) equal transformers' own forward in float64
(Deformable DETR's self-attention on ``attn_implementation`` qkv too, against eager),
outputs and gradients for every parameter and the pixels, and the op is counted to have run
once per deformable layer, forward and backward, with no ``grid_sampler`` left. ``unregister``
of the last name gives transformers back as it was (checked in a fresh interpreter).

Shape alphabet: B batch, C model dim.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path

import fresh
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

import qkv.integrations.transformers as qkv_hf  # noqa: E402
from qkv.integrations.transformers import deformable  # noqa: E402

NAME = "qkv_deformable_tests"  # its own name: unregistered at the end, other modules' stay
MODELS = ["deformable_detr", "grounding_dino"]
# Deformable DETR's decoder self-attention goes through the AttentionInterface (Grounding
# DINO's attentions do not), so its qkv run takes attn_implementation=NAME as well
ROUTED_ATTENTION = {"deformable_detr"}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    qkv_hf.register(NAME)
    yield
    qkv_hf.unregister(NAME)


def _backbone():
    return transformers.ResNetConfig(
        num_channels=3,
        embeddings_size=8,
        hidden_sizes=[8, 8, 8, 8],
        depths=[1, 1, 1, 1],
        out_features=["stage2", "stage3", "stage4"],
    )


def tiny(model_type: str):
    """A tiny model (C=32: the input projections' GroupNorm takes 32 groups), its inputs, and
    the deformable layers it holds."""
    common = dict(
        backbone_config=_backbone(),
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_queries=5,
        num_feature_levels=4,
        encoder_n_points=2,
        decoder_n_points=2,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, 3, 32, 40, generator=g, dtype=torch.float64)  # (B, 3, H, W)
    torch.manual_seed(0)  # the model's initialisation
    if model_type == "deformable_detr":
        model = transformers.DeformableDetrModel(transformers.DeformableDetrConfig(**common))
        inputs = {"pixel_values": pixels}
    else:
        text = transformers.BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
        config = transformers.GroundingDinoConfig(**common, text_config=text, max_text_len=16)
        model = transformers.GroundingDinoModel(config)
        ids = torch.randint(3, 50, (2, 7), generator=g)
        inputs = {"pixel_values": pixels, "input_ids": ids}
    model = model.double().eval()
    with torch.no_grad():  # transformers zeroes the offsets' weights: every point would sit on
        for p in model.parameters():  # its reference ray; redraw so they spread over the maps
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model, inputs


def deformable_class(model):
    classes = {type(m) for m in model.modules() if type(m).__name__ == deformable.CLASS_NAME}
    assert len(classes) == 1, classes
    return classes.pop()


class Ops(TorchDispatchMode):
    """Counts the ops run under it by name."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def outputs_and_grads(model, inputs):
    """The model's last hidden state and the gradients of a fixed projection of it for every
    parameter and the pixels, and the ops counted on the way."""
    model.zero_grad(set_to_none=True)
    pixels = inputs["pixel_values"].clone().requires_grad_()
    with Ops() as ops:
        out = model(**{**inputs, "pixel_values": pixels}).last_hidden_state  # (B, queries, C)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, pixels.grad, ops.count


@pytest.mark.parametrize("model_type", MODELS)
def test_tiny_model_equals_eager_forward_and_backward_in_float64(model_type, monkeypatch):
    model, inputs = tiny(model_type)
    cls = deformable_class(model)
    layers = sum(type(m) is cls for m in model.modules())
    assert layers == 2  # one in the encoder, one in the decoder
    assert cls.forward is deformable.forward
    if model_type in ROUTED_ATTENTION:  # its other attentions on qkv too
        model.set_attn_implementation(NAME)
    got, got_grads, got_pixels, got_ops = outputs_and_grads(model, inputs)
    # qkv's op ran once per layer forward and once backward; no grid_sample was left
    assert got_ops["qkv.deformable_attention"] == layers
    assert got_ops["qkv.deformable_attention_backward"] == layers
    assert got_ops["aten.grid_sampler_2d"] == 0
    monkeypatch.setattr(cls, "forward", deformable.ORIGINAL_FORWARDS[cls])  # transformers' own
    if model_type in ROUTED_ATTENTION:
        model.set_attn_implementation("eager")
    want, want_grads, want_pixels, want_ops = outputs_and_grads(model, inputs)
    assert want_ops["qkv.deformable_attention"] == 0
    assert want_ops["aten.grid_sampler_2d"] == 4 * layers  # one per level
    torch.testing.assert_close(got, want)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], msg=name)
    torch.testing.assert_close(got_pixels, want_pixels)


def test_every_copy_of_the_class_in_transformers_is_routed():
    """Every modeling module of the installed transformers that holds the class with
    transformers' arguments has qkv's forward after register (the ones imported now)."""
    import importlib

    found = []
    for path in Path(transformers.__file__).parent.glob("models/*/modeling_*.py"):
        if "class MultiScaleDeformableAttention(" not in path.read_text():
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        found.append(module.__name__)
        assert module.MultiScaleDeformableAttention.forward is deformable.forward, module
    assert {f"transformers.models.{m}.modeling_{m}" for m in MODELS} <= set(found)


def test_unregister_gives_transformers_back_as_it_was():
    """In a fresh interpreter: a model imported before register and one imported after are
    both routed; unregister restores their forwards, transformers' two interfaces, the own
    attention tables and sys.meta_path."""
    script = textwrap.dedent(
        """
        import sys
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        import transformers.models.deformable_detr.modeling_deformable_detr as detr
        import transformers.models.git.modeling_git as git
        import qkv.integrations.transformers as h
        from qkv.integrations.transformers import deformable

        before = (
            detr.MultiScaleDeformableAttention.forward,
            dict(AttentionInterface._global_mapping),
            dict(AttentionMaskInterface._global_mapping),
            {k: dict(v) for k, v in vars(git).items() if k.endswith("_ATTENTION_CLASSES")},
            list(sys.meta_path),
        )
        h.register()
        h.register("qkv_tiled", backend="tiled")
        import transformers.models.rt_detr.modeling_rt_detr as rt  # imported after register
        rt_own = deformable.ORIGINAL_FORWARDS[rt.MultiScaleDeformableAttention]
        assert detr.MultiScaleDeformableAttention.forward is deformable.forward
        assert rt.MultiScaleDeformableAttention.forward is deformable.forward
        h.unregister()
        assert detr.MultiScaleDeformableAttention.forward is deformable.forward  # one name left
        assert h.registered() == ["qkv_tiled"]
        h.unregister("qkv_tiled")
        after = (
            detr.MultiScaleDeformableAttention.forward,
            dict(AttentionInterface._global_mapping),
            dict(AttentionMaskInterface._global_mapping),
            {k: dict(v) for k, v in vars(git).items() if k.endswith("_ATTENTION_CLASSES")},
            list(sys.meta_path),
        )
        assert after == before, (before, after)
        assert rt.MultiScaleDeformableAttention.forward is rt_own
        assert deformable.ORIGINAL_FORWARDS == {} and not deformable.routed()
        print("restored")
        """
    )
    done = fresh.run(script, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "restored"


def test_unregister_of_a_name_never_registered_says_which_are():
    with pytest.raises(ValueError, match=r"'nope' was not registered.*qkv_deformable_tests"):
        qkv_hf.unregister("nope")
