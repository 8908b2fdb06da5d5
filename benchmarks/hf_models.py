"""transformers models with attn_implementation="qkv" against their own "sdpa" and "eager".

A Mistral-style decoder (GQA, sliding window) and a Llama-style one (plain causal) built from
small configs with random weights, one forward pass in inference, float32 on CPU; then the
same forward with output_attentions=True, which "sdpa" cannot give (it warns and returns
None), so qkv is compared with eager there.

    .venv/bin/python benchmarks/hf_models.py --lengths 1024 4096 --out out/bench/hf_models.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import torch.utils.benchmark as tb
import transformers

import qkv.integrations.transformers as qkv_hf


def _model(kind: str, T: int):
    common = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=T,
    )
    torch.manual_seed(0)
    if kind == "mistral-window256":
        return transformers.MistralModel(transformers.MistralConfig(**common, sliding_window=256))
    return transformers.LlamaModel(transformers.LlamaConfig(**common))


def _time(model, impl: str, ids, **kw) -> float:
    model.set_attn_implementation(impl)
    with torch.inference_mode():
        model(ids[:, :16], **kw)  # warm up
        t = tb.Timer("model(ids, **kw)", globals=dict(model=model, ids=ids, kw=kw))
        return t.blocked_autorange(min_run_time=2.0).median


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--out", type=Path, default=Path("out/bench/hf_models.json"))
    args = p.parse_args(argv)
    qkv_hf.register()
    rows = []
    for kind in ("mistral-window256", "llama-causal"):
        for T in args.lengths:
            model = _model(kind, T).eval()
            ids = torch.randint(0, 1000, (1, T), generator=torch.Generator().manual_seed(1))
            row = {"model": kind, "T": T}
            for impl in ("sdpa", "eager", "qkv"):
                row[f"{impl}_s"] = _time(model, impl, ids)
            for impl in ("eager", "qkv"):
                row[f"{impl}_weights_s"] = _time(model, impl, ids, output_attentions=True)
            row["qkv_vs_sdpa"] = row["sdpa_s"] / row["qkv_s"]
            row["qkv_vs_eager_weights"] = row["eager_weights_s"] / row["qkv_weights_s"]
            print(
                f"{kind:18s} T={T:5d}  sdpa {row['sdpa_s'] * 1e3:8.1f} ms  eager "
                f"{row['eager_s'] * 1e3:8.1f} ms  qkv {row['qkv_s'] * 1e3:8.1f} ms "
                f"(x{row['qkv_vs_sdpa']:.2f} vs sdpa) | with weights: eager "
                f"{row['eager_weights_s'] * 1e3:8.1f} ms  qkv {row['qkv_weights_s'] * 1e3:8.1f} ms "
                f"(x{row['qkv_vs_eager_weights']:.2f} vs eager)",
                flush=True,
            )
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "device": "cpu",
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
