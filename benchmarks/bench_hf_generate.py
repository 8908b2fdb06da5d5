"""Greedy ``generate()`` of a Hugging Face Llama on the CPU: ``attn_implementation="qkv"``
against ``"sdpa"``, the same weights, interleaved (issue 38, item 4).

A decoding step's attention is one call per layer of one query over the cache; this times the
whole model around it (projections, MLP, norms, sampling), so it says what qkv's per-call cost
is worth in a generation loop. The model is built from a config with random weights (no
download): ``--layers`` layers of ``--hidden`` channels, ``--heads`` heads (``--kv-heads``
key/value heads), a prompt of ``--prompt`` tokens, ``--new`` tokens generated, batch
``--batch`` (with ``--pad``, the first row's prompt left-padded by a quarter: a key mask);
``--window N`` builds a Mistral whose layers attend a sliding window of N keys instead.
Rounds alternate the two implementations; the ratio is the median over rounds of qkv's time
over sdpa's in the same round. The generated tokens are checked equal (float32) first.

Usage:
    PYTHONPATH=src python benchmarks/bench_hf_generate.py [--dtype float32 bfloat16]
        [--threads 1] [--rounds 7] [--pad]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(args, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    make, extra = (LlamaConfig, LlamaForCausalLM), {}
    if args.window:  # a sliding window over the cache: Mistral's
        make, extra = (MistralConfig, MistralForCausalLM), {"sliding_window": args.window}
    config = make[0](
        vocab_size=1000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new + 8,
        **extra,
    )
    torch.manual_seed(0)
    model = make[1](config).to(dtype).eval()
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pad", action="store_true")
    p.add_argument("--window", type=int, default=0, help="a Mistral with this sliding window")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()

    import qkv.integrations.transformers as qkv_hf

    qkv_hf.register()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} thread(s); "
        f"{f'Mistral (window {args.window})' if args.window else 'Llama'} "
        f"{args.layers} layers x {args.hidden}, "
        f"{args.heads} heads ({args.kv_heads} kv), prompt {args.prompt}, {args.new} new, "
        f"batch {args.batch}{' padded' if args.pad else ''}"
    )
    for name in args.dtype:
        dtype = getattr(torch, name)
        model = build(args, dtype)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 1000, (args.batch, args.prompt), generator=g)
        mask = torch.ones_like(ids)
        if args.pad:
            mask[0, : args.prompt // 4] = 0
        kw = dict(
            attention_mask=mask,
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            pad_token_id=0,
        )

        def run(impl: str, model=model, ids=ids, kw=kw):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                return model.generate(ids, **kw)

        tokens = {impl: run(impl) for impl in ("sdpa", "qkv")}  # (warm: builds, measures)
        if dtype == torch.float32 and not torch.equal(tokens["sdpa"], tokens["qkv"]):
            print(f"  {name}: the generated tokens differ from sdpa's")
        times: dict[str, list[float]] = {"sdpa": [], "qkv": []}
        ratios = []
        for r in range(args.rounds):
            order = ("sdpa", "qkv") if r % 2 == 0 else ("qkv", "sdpa")
            got = {}
            for impl in order:
                t0 = time.perf_counter()
                run(impl)
                got[impl] = time.perf_counter() - t0
                times[impl].append(got[impl])
            ratios.append(got["qkv"] / got["sdpa"])
        s, q = statistics.median(times["sdpa"]), statistics.median(times["qkv"])
        per = 1e3 / args.new
        print(
            f"| {name} | sdpa {s * per:.2f} ms/token | qkv {q * per:.2f} ms/token | "
            f"{statistics.median(ratios):.3f}x |"
        )


if __name__ == "__main__":
    main()
