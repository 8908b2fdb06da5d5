"""The architecture sweep of issue 30: every model type of the installed transformers on
attn_implementation="qkv", against "eager", built tiny with random weights.

Each type in ``CONFIG_MAPPING`` is built from its default config rebuilt with small sizes (the
common size attributes, sub-configs too, and the sparse-attention, MLA and MoE sizes), as its
base model (``AutoModel``, else the model class its modeling file declares for the config).
It is fed what its forward takes: token ids, or images, or mel features, or raw audio. With
the same weights, eager and qkv then run, in float32:

- ``left`` / ``right``: a batch padded on that side (token models): the first output equal at
  real positions, max |diff| <= 1e-4;
- ``weights``: ``output_attentions=True``, every attention map equal at real query rows;
- ``backward``: a fixed random projection of that output at real positions, every parameter's
  gradient equal within 2e-4 + 2e-3 * max|eager's| + 1e-6 * the largest gradient of the
  model (absolute floors: key biases have a true gradient of ~0, and float32 rounding at the
  largest gradients reaches the others);
- ``generate``: for types with a causal-LM head, 6 greedy tokens from an unpadded batch.

Each type is classified ``pass``, ``diff`` (qkv runs, a check differs: which and by how much),
``sdpa-equal`` (every difference from eager is one transformers' sdpa shares: qkv equals sdpa),
``not-dispatched`` (its attention never reached qkv: it does not use the AttentionInterface),
``known-diff`` (a difference whose cause is known and not qkv's, listed in ``KNOWN``),
``fail`` (eager runs, qkv raises), ``refused`` (qkv raised a NotImplementedError naming what
it does not do) or ``skipped`` (the tiny model cannot be built, or eager itself fails, or its
input kind is not generated here: the reason is kept; not qkv's to answer). The random draws
some models make in their forward (vits' durations, vit_mae's patch masks) are seeded alike.

Usage:
    python benchmarks/hf_sweep.py [--out benchmarks/results/hf_sweep.json] [--only llama gpt2]

With ``--only``, the types named are rerun and their entries in ``--out`` replaced; the rest
of the recorded sweep stays.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import signal
import sys
import time
from pathlib import Path

import torch

SHRINK = dict(
    hidden_size=32,
    d_model=32,
    n_embd=32,
    embed_dim=32,
    num_hidden_layers=2,
    num_layers=2,
    n_layer=2,
    encoder_layers=1,
    decoder_layers=1,
    num_attention_heads=4,
    n_head=4,
    num_key_value_heads=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    intermediate_size=48,
    ffn_dim=48,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    d_ff=48,
    head_dim=8,
    vocab_size=97,
    max_position_embeddings=64,
    # MLA (DeepSeek-V2/V3 and kin), DSA indexers, MoE
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
    qk_head_dim=12,
    index_topk=6,
    index_head_dim=8,
    index_n_heads=2,
    index_block_size=4,
    index_topk_blocks=2,
    n_routed_experts=4,
    num_local_experts=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_intermediate_size=16,
    dense_intermediate_size=32,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    attn_layer_period=2,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    shared_experts_intermediate_size=16,
    # vision, and the adapters between towers (their widths follow the hidden sizes above)
    image_size=32,
    patch_size=8,
    adapter_in_dim=32,
    adapter_out_dim=32,
    adapter_input_size=32,
    # audio: whisper-like encoders take 2 * max_source_positions feature frames
    max_source_positions=32,
    max_target_positions=64,
)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
# Types whose default config hides the path that matters: built with these on top.
OVERRIDES = {
    # a sparse layer (blocks of 4 keys, 2 kept per query) beside a full one
    "minimax_m3_vl_text": dict(
        layer_types=["minimax_m3_sparse", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        rotary_dim=4,
    ),
}
T = 10  # tokens per row; row 1 has 3 pads
# Differences whose cause is known and not qkv's to change, by type and check.
KNOWN = {
    # The sink applied as a scale on the output: eager returns the softmax before it; qkv's
    # weights are those that multiply V (sink share excluded), gpt-oss's convention, which
    # deepseek_v4, hy_v4, inkling2 and openai_privacy_filter's eager share.
    "granite_swa": {"weights": "eager returns the weights before the sink's scaling"},
    "granitemoe_swa": {"weights": "eager returns the weights before the sink's scaling"},
    # Appends a CLS token after the ids, so the sweep cannot tell the real rows of its output:
    # with left padding its differences are the padded query rows that see no key (eager: a
    # uniform average, qkv: 0, the mask contract); with right padding it passes.
    "videoprism_text_model": dict.fromkeys(
        ("left", "weights", "backward"), "left-padded rows that see no key (appended CLS)"
    ),
    # Eager and sdpa differ on this model already (outputs 7e-4, gradients; qkv equals sdpa
    # there); sdpa returns no weights, and qkv's differ from eager's by 2e-4 downstream of it.
    "embedding_gemma2": {"weights": "eager differs from sdpa upstream (qkv equals sdpa)"},
}


def _shrunk(cfg) -> dict:
    """The config's attributes to change: ints in SHRINK, token ids, sub-configs recursively.
    Read from ``to_dict()``: some configs refuse ``getattr`` of a per-layer attribute."""
    import transformers

    try:
        have = cfg.to_dict()
    except Exception:
        have = dict(vars(cfg))
    new = {
        key: value
        for key, value in {**SHRINK, **TOKEN_IDS}.items()
        if isinstance(have.get(key), int) and not isinstance(have.get(key), bool)
    }
    if "head_dim" in have and have["head_dim"] is None and "hidden_size" in new:
        new["head_dim"] = SHRINK["head_dim"]  # models that read it though the default lacks it
    if "kv_lora_rank" in new:  # MLA: the rope part is the head_dim, as many kv heads as heads
        new["head_dim"] = new["qk_rope_head_dim"]
        if "num_key_value_heads" in new and "num_attention_heads" in new:
            new["num_key_value_heads"] = new["num_attention_heads"]
    for key, value in have.items():
        sub = getattr(cfg, key, None) if isinstance(value, dict) else None
        if isinstance(sub, transformers.PretrainedConfig):
            new[key] = {**value, **_shrunk(sub)}
    layers = new.get("num_hidden_layers", have.get("num_hidden_layers"))
    kinds_key = next(
        (k for k in ("layer_types", "block_types") if isinstance(have.get(k), list)), None
    )
    if kinds_key and isinstance(layers, int):
        # Hybrid models (linear attention, mamba, recurrent or conv layers beside attention
        # ones): the first layers may hold no attention at all, so the tiny model keeps one
        # layer of each kind, in the order the kinds first appear.
        kinds = list(dict.fromkeys(map(str, have[kinds_key])))
        if len(kinds) > 1 and set(kinds) - set(map(str, have[kinds_key][:layers])):
            layers = max(layers, len(kinds))
            new["num_hidden_layers"] = layers
            picked = [have[kinds_key][list(map(str, have[kinds_key])).index(k)] for k in kinds]
            new[kinds_key] = (picked * layers)[:layers]
        else:
            new[kinds_key] = have[kinds_key][:layers]
    if isinstance(have.get("mlp_layer_types"), list) and isinstance(layers, int):
        new["mlp_layer_types"] = (have["mlp_layer_types"] * layers)[:layers]
    new.update(OVERRIDES.get(cfg.model_type, {}))
    return new


def tiny_config(model_type: str):
    """The default config of ``model_type`` rebuilt small (kwargs at construction, so what a
    config derives from its sizes follows); set attribute by attribute when that fails."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    new = _shrunk(cfg)
    try:
        return AutoConfig.for_model(model_type, **new)
    except Exception:
        return _set_small(cfg, new)


def _set_small(cfg, new: dict):
    """``new`` set attribute by attribute, into the sub-configs too."""
    for key, value in new.items():
        try:
            if isinstance(value, dict):
                sub = getattr(cfg, key, None)
                if sub is not None and hasattr(sub, "to_dict"):
                    _set_small(sub, {k: v for k, v in value.items() if k in _shrunk(sub)})
                    _set_small(sub, _shrunk(sub))
            else:
                setattr(cfg, key, value)
        except Exception:
            pass
    return cfg


def model_class(cfg):
    """``AutoModel``'s class for the config, else the base model its modeling file declares."""
    from transformers import AutoModel, PreTrainedModel

    mapping = AutoModel._model_mapping
    if type(cfg) in mapping:
        return mapping[type(cfg)]
    module = importlib.import_module(type(cfg).__module__.replace(".configuration_", ".modeling_"))
    found = [
        c
        for c in vars(module).values()
        if isinstance(c, type)
        and issubclass(c, PreTrainedModel)
        and getattr(c, "config_class", None) is type(cfg)
        and not c.__name__.endswith("PreTrainedModel")
    ]
    if not found:
        raise LookupError(f"no model class for {type(cfg).__name__} in {module.__name__}")
    plain = [c for c in found if c.__name__.endswith("Model")]
    return sorted(plain or found, key=lambda c: len(c.__name__))[0]


def causal_lm_class(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(cfg), None)


def _vocab(cfg) -> int | None:
    """The token vocabulary's size: the config's, else its text config's."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        v = getattr(c, "vocab_size", None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 3:
            return v
    return None


def _image(cfg, gen) -> torch.Tensor | str:
    """A batch of 2 random images of the config's (or its vision config's) size."""
    vision = getattr(cfg, "vision_config", None) or cfg
    size = getattr(vision, "image_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(vision, "num_channels", 3)
    if not isinstance(size, int) or not isinstance(channels, int):
        return "no integer image_size/num_channels to draw an image from"
    return torch.randn(2, channels, size, size, generator=gen)


def inputs(model, cfg, side: str, pixels: bool = False) -> tuple[dict, torch.Tensor | None] | str:
    """``(kwargs, real)`` for the model's forward, ``real`` the (B, T) bool of real tokens
    (None: no padding), or a reason string when the sweep does not generate its input kind.
    ``pixels``: images beside the token ids (CLIP-like models take both)."""
    params = inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(1)
    vocab = _vocab(cfg)
    if "input_ids" in params and vocab:
        extra = {}
        if pixels:
            image = _image(cfg, gen)
            if isinstance(image, str):
                return image
            extra["pixel_values"] = image
        ids = torch.randint(3, min(90, vocab), (2, T), generator=gen)
        pad = torch.ones(2, T, dtype=torch.long)
        if side == "left":
            pad[1, :3] = 0
        elif side == "right":
            pad[1, -3:] = 0
        kw = {"input_ids": ids, "attention_mask": pad, **extra}
        if "decoder_input_ids" in params:
            kw["decoder_input_ids"] = ids[:, :6]
            return kw, None  # the decoder's rows are all real; the encoder is padded
        return kw, pad.bool()
    if side != "none":
        return "padding applies to token ids only"
    kw = {}
    if "decoder_input_ids" in params and vocab:
        kw["decoder_input_ids"] = torch.randint(3, min(90, vocab), (2, 4), generator=gen)
    if "pixel_values" in params:
        image = _image(cfg, gen)
        return image if isinstance(image, str) else ({**kw, "pixel_values": image}, None)
    if "input_features" in params and isinstance(getattr(cfg, "num_mel_bins", None), int):
        frames = 2 * getattr(cfg, "max_source_positions", 32)
        return {
            **kw,
            "input_features": torch.randn(2, cfg.num_mel_bins, frames, generator=gen),
        }, None
    if "input_values" in params:
        return {**kw, "input_values": torch.randn(2, 1600, generator=gen)}, None
    return "its forward takes no token ids, pixel_values, input_features or input_values"


def _first(res) -> torch.Tensor:
    for name in ("last_hidden_state", "logits", "encoder_last_hidden_state"):
        value = getattr(res, name, None)
        if isinstance(value, torch.Tensor):
            return value
    value = res[0] if isinstance(res, (tuple, list)) or hasattr(res, "to_tuple") else res
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"first output is a {type(value).__name__}")
    return value


def _maps(res) -> list[torch.Tensor]:
    maps = []
    for name in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"):
        value = getattr(res, name, None)
        if isinstance(value, (tuple, list)):
            maps += [a for a in value if isinstance(a, torch.Tensor)]
    return maps


_CALLS = [0]  # qkv attention calls so far (a "pass" where qkv never ran would mean nothing)


@contextlib.contextmanager
def counting_qkv_calls():
    """Counts the calls transformers makes into qkv's attention while inside."""
    from qkv.integrations.transformers import attention as hf_attention

    real = hf_attention.scaled_dot_product_attention

    def counted(*args, **kwargs):
        _CALLS[0] += 1
        return real(*args, **kwargs)

    hf_attention.scaled_dot_product_attention = counted
    try:
        yield
    finally:
        hf_attention.scaled_dot_product_attention = real


def _run(model, impl: str, kw: dict, real, *, weights: bool, backward: bool) -> dict:
    model.set_attn_implementation(impl)
    before = _CALLS[0]
    model.zero_grad(set_to_none=True)
    if "use_cache" in inspect.signature(model.forward).parameters:
        kw = {**kw, "use_cache": False}  # the forward checks need no cache (some fail with one)
    torch.manual_seed(0)  # random draws in a forward (vits, vit_mae) alike for both
    with torch.set_grad_enabled(backward):
        res = model(**kw, output_attentions=True) if weights else model(**kw)
        out = _first(res).float()
        if backward:  # a fixed random projection: a sum of squares of a LayerNorm's output
            # is nearly constant, and its gradients would be rounding noise
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
            part = real if real is not None and out.shape[:2] == real.shape else ...
            (out[part] * w[part]).sum().backward()
    grads = (
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if backward
        else {}
    )
    return {
        "out": out.detach(),
        "maps": [a.detach().float() for a in _maps(res)] if weights else [],
        "grads": grads,
        "qkv_calls": _CALLS[0] - before,
    }


def _rows(x: torch.Tensor, real) -> torch.Tensor:
    """x at real positions when its leading dims are (B, T) of the padded ids."""
    if real is not None and x.dim() >= 2 and x.shape[:2] == real.shape:
        return x[real]
    return x


def _gap(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y|, where a NaN of one must be a NaN of the other (a tiny model built from a
    default config may compute NaN itself, eager too: that is not a difference)."""
    nan = x.isnan()
    if not torch.equal(nan, y.isnan()):
        return float("inf")
    return (x - y)[~nan].abs().max().item() if (~nan).any() else 0.0


def compare(eager: dict, mine: dict, real, check: str) -> tuple[float, str] | None:
    """``None`` when qkv equals eager on ``check``, else ``(size, what)``."""
    a, b = mine["out"], eager["out"]
    if a.shape != b.shape:
        return float("inf"), f"output shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    if check in ("left", "right", "none"):
        d = _gap(_rows(a, real), _rows(b, real))
        return None if d <= 1e-4 else (d, "output")
    if check == "weights":
        if len(mine["maps"]) != len(eager["maps"]):
            return float("inf"), f"{len(mine['maps'])} attention maps vs {len(eager['maps'])}"
        worst = 0.0
        for x, y in zip(mine["maps"], eager["maps"]):
            if x.shape != y.shape:
                return float("inf"), f"map shapes {tuple(x.shape)} vs {tuple(y.shape)}"
            if x.dim() == 4 and real is not None and x.shape[0] == 2 and x.shape[2] == T:
                x_real, y_real = x.transpose(1, 2)[real], y.transpose(1, 2)[real]  # real query rows
            else:
                x_real, y_real = x, y
            worst = max(worst, _gap(x_real, y_real))
        return None if worst <= 1e-4 else (worst, "weights")
    if check == "backward":
        if mine["grads"].keys() != eager["grads"].keys():
            return float("inf"), "different parameters got gradients"
        top = max(
            (g.abs().max().item() for g in eager["grads"].values() if g.numel()), default=0.0
        )  # float32 rounding at the largest gradients reaches the rest
        for name, g in eager["grads"].items():
            d = _gap(mine["grads"][name], g)
            if d > 2e-4 + 2e-3 * g.abs().max().item() + 1e-6 * top:
                return d, f"gradient of {name}"
        return None
    raise ValueError(check)


def _what(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def one(model_type: str, checks=("left", "right", "weights", "backward", "generate")) -> dict:
    """The sweep for one model type (see the module's docstring)."""
    with counting_qkv_calls():
        return _one(model_type, checks)


def _one(model_type: str, checks) -> dict:
    try:
        cfg = tiny_config(model_type)
        cls = model_class(cfg)
        torch.manual_seed(0)
        model = cls(cfg).eval()
    except Exception as e:
        return {"status": "skipped", "reason": f"build: {_what(e)}"}
    done, diffs = [], {}
    tokens = not isinstance(inputs(model, cfg, "left"), str)
    plan = (
        [("left", "left"), ("right", "right"), ("weights", "left"), ("backward", "left")]
        if tokens
        else [("none", "none"), ("weights", "none"), ("backward", "none")]
    )
    # CLIP-like models take images beside the ids: tried when eager fails on ids alone
    pixels, may_add_pixels = (
        False,
        tokens and "pixel_values" in inspect.signature(model.forward).parameters,
    )
    for check, side in plan:
        if check not in checks and not (check == "none" and "left" in checks):
            continue
        while True:
            got = inputs(model, cfg, side, pixels)
            if isinstance(got, str):
                return {"status": "skipped", "reason": f"input: {got}"}
            kw, real = got
            runs = _both(model, kw, real, check)
            if isinstance(runs, str) and not done and may_add_pixels and not pixels:
                pixels = True
                continue
            break
        if isinstance(runs, dict) and "status" in runs:
            return {**runs, "done": done}
        if isinstance(runs, str):
            if done:  # eager cannot do this check (no weights, no backward): skip it
                continue
            return {"status": "skipped", "reason": f"eager ({check}): {runs}"}
        if check == "weights" and not runs["eager"]["maps"]:
            continue  # the model reports no attention maps
        if not done and not runs["qkv"]["qkv_calls"]:
            return _not_dispatched(cls, cfg)
        bad = compare(runs["eager"], runs["qkv"], real, check)
        if bad is not None:
            diffs[check] = {
                "max_diff": bad[0],
                "what": bad[1],
                "sdpa_equal": _sdpa_equal(model, kw, real, check, runs),
            }
        done.append(check)
    if "generate" in checks and "input_ids" in inspect.signature(model.forward).parameters:
        lm = causal_lm_class(cfg)
        if lm is not None:
            result = _generate(lm, cfg)
            if isinstance(result, dict):
                if result.get("fail"):
                    return {"status": "fail", "reason": result["fail"], "done": done}
                diffs["generate"] = result
                done.append("generate")
            elif result is True:
                done.append("generate")
    known = KNOWN.get(model_type, {})
    for check, why in known.items():
        if check in diffs:
            diffs[check]["known"] = why
    if diffs and all(d.get("sdpa_equal") or d.get("known") for d in diffs.values()):
        if any(d.get("known") for d in diffs.values()):
            return {"status": "known-diff", "diffs": diffs, "done": done}
        return {"status": "sdpa-equal", "diffs": diffs, "done": done}
    if diffs:
        return {"status": "diff", "diffs": diffs, "done": done}
    return {"status": "pass", "done": done}


def _not_dispatched(cls, cfg) -> dict:
    """The model ran with "qkv" but never called qkv's attention: built with "qkv" from the
    start, it is refused (its own attention tables) or it does not use the interface."""
    try:
        cls._from_config(cfg, attn_implementation="qkv")
    except NotImplementedError as e:
        return {"status": "refused", "reason": f"build: {_what(e)}"}
    except Exception as e:
        return {"status": "not-dispatched", "reason": f"built with 'qkv': {_what(e)}"}
    return {
        "status": "not-dispatched",
        "reason": "its attention does not go through transformers' AttentionInterface",
    }


def _both(model, kw, real, check) -> dict | str:
    """Eager's and qkv's runs, or eager's error (a str), or a ``status`` dict when qkv raised."""
    runs = {}
    for impl in ("eager", "qkv"):
        try:
            runs[impl] = _run(
                model, impl, kw, real, weights=check == "weights", backward=check == "backward"
            )
        except Exception as e:
            if impl == "eager":
                return _what(e)
            status = "refused" if isinstance(e, NotImplementedError) else "fail"
            return {"status": status, "reason": f"{check}: {_what(e)}"}
    return runs


def _sdpa_equal(model, kw, real, check, runs) -> bool:
    """Where qkv differs from eager: does it equal transformers' sdpa, which differs from eager
    the same way? (Eager and sdpa disagree in transformers itself on some models, on padded
    rows that see no key; issue 30 keeps those as sdpa-equal.)"""
    try:
        sdpa = _run(
            model, "sdpa", kw, real, weights=check == "weights", backward=check == "backward"
        )
    except Exception:
        return False
    return (
        compare(sdpa, runs["qkv"], real, check) is None
        and compare(runs["eager"], sdpa, real, check) is not None
    )


def _generate(lm, cfg):
    """True when qkv's greedy tokens equal eager's; a dict when not; None when eager cannot."""
    try:
        torch.manual_seed(0)
        model = lm(cfg).eval()
        ids = torch.randint(
            3, min(90, cfg.vocab_size), (2, 8), generator=torch.Generator().manual_seed(2)
        )
        tokens = {}
        for impl in ("eager", "qkv"):
            model.set_attn_implementation(impl)
            try:
                with torch.no_grad():
                    tokens[impl] = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=6,
                        do_sample=False,
                        pad_token_id=0,
                    )
            except Exception as e:
                if impl == "eager":
                    return None
                return {"fail": f"generate: {_what(e)}"}
    except Exception:
        return None
    if torch.equal(tokens["eager"], tokens["qkv"]):
        return True
    return {
        "what": "tokens",
        "eager": tokens["eager"][:, 8:].tolist(),
        "qkv": tokens["qkv"][:, 8:].tolist(),
    }


def _release() -> None:
    """Give the last model's memory back (a long sweep otherwise creeps up to the cap)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _Timeout(BaseException):  # not an Exception: the checks' handlers must not take it
    pass


def _alarm(signum, frame):
    raise _Timeout("took over 60 s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "hf_sweep.json"
    )
    parser.add_argument("--only", nargs="*")
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=12.0,
        help="address-space cap: a model whose default config is too big to "
        "build tiny fails its allocation (skipped) instead of waking the "
        "OOM killer (default 12)",
    )
    args = parser.parse_args(argv)
    import resource

    cap = int(args.memory_gib * 2**30)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard < 0 else min(cap, hard), hard))
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import qkv.integrations.transformers as qkv_hf

    qkv_hf.register()
    transformers.logging.set_verbosity_error()
    types = args.only or sorted(CONFIG_MAPPING.keys())
    results, started, counts = {}, time.time(), {}
    if args.only and args.out.exists():  # a partial rerun updates the recorded sweep
        results = json.loads(args.out.read_text())["results"]
    signal.signal(signal.SIGALRM, _alarm)
    for i, model_type in enumerate(types):
        signal.alarm(60)
        t0 = time.time()
        try:
            results[model_type] = one(model_type)
        except _Timeout as e:
            results[model_type] = {"status": "skipped", "reason": str(e)}
        except Exception as e:
            results[model_type] = {"status": "skipped", "reason": _what(e)}
        finally:
            signal.alarm(0)
            _release()
        results[model_type]["seconds"] = round(time.time() - t0, 1)
        print(
            f"[{i + 1}/{len(types)}] {model_type}: {results[model_type]['status']} "
            f"{results[model_type].get('done', '')}",
            file=sys.stderr,
            flush=True,
        )
        counts = {}
        for r in results.values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "counts": counts,
                    "results": results,
                },
                indent=1,
            )
        )
    print(json.dumps(counts), f"({time.time() - started:.0f} s)")
    for name, r in results.items():
        if r["status"] in ("fail", "diff", "refused"):
            print(f"{r['status']:7} {name}: {r.get('reason', r.get('diffs'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
