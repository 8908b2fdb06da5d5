"""A first sweep of transformers' architectures on attn_implementation="qkv" (issue 30).

Every model type in the installed transformers' ``CONFIG_MAPPING`` is built tiny from its
default config (the common size attributes shrunk, sub-configs too) as its base ``AutoModel``,
and run on a left-padded batch of token ids with ``attn_implementation="eager"`` and then
``"qkv"``, in float32, same weights. Each type is classified:

- ``skipped``: the tiny model cannot be built, takes no token ids, or eager itself fails (the
  reason is kept): not qkv's to answer;
- ``pass``: qkv's last hidden state equals eager's at real positions (max |diff| <= 1e-4);
- ``diff``: qkv runs but differs;
- ``fail``: eager runs and qkv raises (the error is kept).

This is the crude half of the issue's sweep: text input only, forward only, no weights,
backward or generate. Its failures are where to look next.

Usage:
    python benchmarks/hf_sweep.py [--out benchmarks/results/hf_sweep.json] [--only llama gpt2]
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import torch

SHRINK = dict(hidden_size=32, d_model=32, n_embd=32, num_hidden_layers=2, num_layers=2, n_layer=2,
              encoder_layers=1, decoder_layers=1, num_attention_heads=4, n_head=4,
              num_key_value_heads=2, encoder_attention_heads=4, decoder_attention_heads=4,
              intermediate_size=48, ffn_dim=48, encoder_ffn_dim=48, decoder_ffn_dim=48, d_ff=48,
              head_dim=8, vocab_size=97, max_position_embeddings=64)


def shrink(cfg):
    import transformers
    for key, value in SHRINK.items():
        old = getattr(cfg, key, None)
        if isinstance(old, int) and not isinstance(old, bool):
            try:
                setattr(cfg, key, value)
            except Exception:  # noqa: BLE001 (a per-layer attribute some configs refuse)
                pass
    for name in ("text_config", "decoder_config", "encoder_config", "vision_config"):
        sub = getattr(cfg, name, None)
        if isinstance(sub, transformers.PretrainedConfig):
            shrink(sub)
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(getattr(cfg, "layer_types", None), list) and isinstance(layers, int):
        cfg.layer_types = cfg.layer_types[:layers]
    return cfg


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("took over 60 s")


def one(model_type: str) -> dict:
    import transformers
    from transformers import AutoConfig, AutoModel
    try:
        cfg = shrink(AutoConfig.for_model(model_type))
        torch.manual_seed(0)
        model = AutoModel.from_config(cfg).eval()
    except Exception as e:  # noqa: BLE001
        return {"status": "skipped", "reason": f"build: {type(e).__name__}: {str(e)[:160]}"}
    ids = torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, :3] = 0
    out = {}
    for impl in ("eager", "qkv"):
        try:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                res = model(input_ids=ids, attention_mask=pad)
            h = res.last_hidden_state if hasattr(res, "last_hidden_state") else res[0]
            out[impl] = h.float()
        except Exception as e:  # noqa: BLE001
            what = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if impl == "eager":
                return {"status": "skipped", "reason": f"eager: {what}"}
            return {"status": "fail", "reason": what}
    a, b = out["qkv"], out["eager"]
    if a.shape != b.shape:
        return {"status": "diff", "reason": f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"}
    real = pad.bool() if a.dim() >= 2 and a.shape[:2] == pad.shape else torch.ones(a.shape[:1], dtype=torch.bool)
    diff = (a[real] - b[real]).abs().max().item() if a.numel() else 0.0
    return {"status": "pass" if diff <= 1e-4 else "diff", "max_diff": diff}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "hf_sweep.json")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args(argv)
    import transformers
    import qkv.integrations.transformers as qkv_hf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    qkv_hf.register()
    transformers.logging.set_verbosity_error()
    types = args.only or sorted(CONFIG_MAPPING.keys())
    results, started = {}, time.time()
    signal.signal(signal.SIGALRM, _alarm)
    for i, model_type in enumerate(types):
        signal.alarm(60)
        try:
            results[model_type] = one(model_type)
        except _Timeout as e:
            results[model_type] = {"status": "skipped", "reason": str(e)}
        except Exception as e:  # noqa: BLE001
            results[model_type] = {"status": "skipped", "reason": f"{type(e).__name__}: {e}"[:200]}
        finally:
            signal.alarm(0)
        print(f"[{i + 1}/{len(types)}] {model_type}: {results[model_type]['status']}",
              file=sys.stderr, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        counts = {}
        for r in results.values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        args.out.write_text(json.dumps({"transformers": transformers.__version__,
                                        "torch": torch.__version__, "counts": counts,
                                        "results": results}, indent=1))
    print(json.dumps(counts), f"({time.time() - started:.0f} s)")
    for name, r in results.items():
        if r["status"] in ("fail", "diff"):
            print(f"{r['status']:5} {name}: {r.get('reason', r.get('max_diff'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
