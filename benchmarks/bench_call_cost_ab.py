"""Per-call cost of two versions of qkv against torch, interleaved in one process (issue 38).

On a shared machine the load changes between processes, so a before/after comparison made
by running ``bench_call_cost.py`` twice compares two loads. Here the older version is
imported beside the tree's own: ``git archive REV src/qkv`` unpacked as a package
``qkv_base`` in a temporary folder (its ``torch.library`` namespace renamed from ``qkv`` to
``qkvbase``, so that both register their ops), and every round times torch, the old and the
new version in turn (the order rotating by round). Ratios are medians over rounds of each
version's time over torch's in the same round.

Cases: ``short`` (T=1, S=128, B=1, H=8, D=64: plain, causal, a bool key mask (B, 1, 1, S);
``short-bf16`` the same in bfloat16; ``long-cache`` one query over S=4096 keys, plain and
with a bool key mask, float32 and bfloat16),
``step`` (a KV-cache decode step of ``MultiHeadAttention``, C=512, 8 heads, position 128,
against the same step by hand in torch, as in ``bench_call_cost.py``), ``step-gqa`` (the same
with 2 key/value heads, torch's SDPA by hand with ``enable_gqa``), ``step-bf16`` (the MHA
step in bfloat16, module and torch's weights alike), ``step-padded`` (the MHA step over a
cache whose prompt had 8 positions of padding, torch's SDPA by hand with their mask),
``long`` (T=1024:
plain and causal, float32 and bfloat16), ``structured`` (T=1024; ``structured-256`` at
T=256: ``sliding_window(256)``, documents and causal documents, float32 and bfloat16, against
compiled FlexAttention),
``padded`` (B=4, T=1024, keys per element 1024/750/450/150: causal, a window or nothing with
key lengths, causal with a bool key mask; against compiled FlexAttention),
``train`` (inputs requiring a gradient: the forward alone and with the backward, B=8,
T=S=128 and B=1, T=1, S=128). All but ``train`` without gradient; ``--threads`` sets
torch's threads (1 by default; 0 keeps torch's own).

Usage:
    PYTHONPATH=src python benchmarks/bench_call_cost_ab.py --rev 9723628 [--cases short step long]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import qkv

B, H, D, C, S, CAP, POS = 1, 8, 64, 512, 128, 256, 128


def import_base(rev: str, into: Path):
    """qkv as of git revision ``rev``, imported as the package ``qkv_base``."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    tar = subprocess.check_output(["git", "-C", str(root), "archive", rev, "src/qkv"])
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    pkg = into / "qkv_base"
    (into / "src" / "qkv").rename(pkg)
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        if "qkv::" in text or "torch.ops.qkv." in text:
            text = text.replace("qkv::", "qkvbase::").replace(
                "torch.ops.qkv.", "torch.ops.qkvbase."
            )
            path.write_text(text)
    sys.path.insert(0, str(into))
    return importlib.import_module("qkv_base")


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def compare(name: str, fns: dict, rounds: int, n: int) -> None:
    """Print torch's median µs and each version's, with the median per-round ratio."""
    names = list(fns)
    for fn in fns.values():
        for _ in range(3 if n == 1 else 50):  # plans, caches, the C++ libraries
            fn()
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            times[k].append(timed(fns[k], n))
    cells = [f"torch {statistics.median(times['torch']) * 1e6:.1f} µs"]
    for k in names[1:]:
        ratio = statistics.median(a / b for a, b in zip(times[k], times["torch"]))
        cells.append(f"{k} {statistics.median(times[k]) * 1e6:.1f} µs ({ratio:.2f}x)")
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def long_cache_cases(base, rounds: int) -> None:
    """One query over a cache of 4096 keys (B=1, H=8, D=64), float32 and bfloat16."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = (torch.randn(B, H, 4096, D, generator=g) for _ in range(2))
    keep = torch.ones(B, 1, 1, 4096, dtype=torch.bool)  # a padded batch's step: 7 keys hidden
    keep[..., -7:] = False
    for dtype, dname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        t = tuple(x.to(dtype) for x in (q, k, v))
        for case, kw in (("plain", {}), ("key mask", dict(attn_mask=keep))):
            fns = {
                "torch": lambda t=t, kw=kw: F.scaled_dot_product_attention(*t, **kw),
                "before": lambda t=t, kw=kw: base.scaled_dot_product_attention(*t, **kw),
                "after": lambda t=t, kw=kw: qkv.scaled_dot_product_attention(*t, **kw),
            }
            compare(f"T=1, S=4096, {case}, {dname}", fns, rounds, 20)


def short_cases(base, rounds: int, dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(2))
    name = "" if dtype == torch.float32 else f", {str(dtype).removeprefix('torch.')}"
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
    keep[..., -7:] = False
    for case, kw in (
        ("plain", {}),
        ("causal", dict(is_causal=True)),
        ("key mask", dict(attn_mask=keep)),
    ):
        fns = {
            "torch": lambda kw=kw: F.scaled_dot_product_attention(q, k, v, **kw),
            "before": lambda kw=kw: base.scaled_dot_product_attention(q, k, v, **kw),
            "after": lambda kw=kw: qkv.scaled_dot_product_attention(q, k, v, **kw),
        }
        compare(f"T=1, S=128, {case}{name}", fns, rounds, 200)


def step_case(
    base, rounds: int, G: int = H, dtype: torch.dtype = torch.float32, padded: bool = False
) -> None:
    """The decode step of ``MultiHeadAttention`` with G key/value heads, in ``dtype``;
    ``padded``: the prompt's first 8 positions are padding (a key mask: the cache is padded,
    torch's step by hand passes the same keys' mask)."""
    steps = {}
    real = torch.arange(POS) >= 8 if padded else torch.ones(POS, dtype=torch.bool)  # (POS,)
    for name, lib in (("before", base), ("after", qkv)):
        torch.manual_seed(0)
        mha = lib.MultiHeadAttention(C, H, num_kv_heads=G).eval().to(dtype)
        cache = mha.new_cache(B, CAP)
        prompt = torch.randn(B, POS, C, generator=torch.Generator().manual_seed(1)).to(dtype)
        mha(prompt, cache=cache, key_mask=real.expand(B, POS) if padded else None)
        steps[name] = (mha, cache)
    keep = torch.ones(B, 1, 1, CAP, dtype=torch.bool)  # (B, 1, 1, CAP): torch's mask by hand
    keep[..., :POS] = real
    x = torch.randn(B, 1, C).to(dtype)
    mha = steps["after"][0]
    # torch's step has weights of its own, as each version's module has (sharing the "after"
    # module's, the step run right after it may find them in cache)
    w_in, b_in = (t.detach().clone() for t in (mha.in_proj_weight, mha.in_proj_bias))
    w_out, b_out = (t.detach().clone() for t in (mha.out_proj.weight, mha.out_proj.bias))
    keys, values = torch.zeros(B, G, CAP, D, dtype=dtype), torch.zeros(B, G, CAP, D, dtype=dtype)

    def by_hand():
        p = POS
        t = F.linear(x, w_in, b_in).view(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)  # (3, B, H, 1, D)
        keys[:, :, p : p + 1], values[:, :, p : p + 1] = t[1], t[2]
        mask = keep[..., : p + 1] if padded else None
        out = F.scaled_dot_product_attention(
            t[0], keys[:, :, : p + 1], values[:, :, : p + 1], attn_mask=mask
        )
        return F.linear(out.transpose(1, 2).reshape(B, 1, C), w_out, b_out)  # (B, 1, C)

    def by_hand_gqa():
        p = POS
        q, k, v = F.linear(x, w_in, b_in).split([H * D, G * D, G * D], -1)  # (B, 1, HD | GD)
        q = q.view(B, 1, H, D).transpose(1, 2)  # (B, H, 1, D)
        k, v = k.view(B, 1, G, D).transpose(1, 2), v.view(B, 1, G, D).transpose(1, 2)
        keys[:, :, p : p + 1], values[:, :, p : p + 1] = k, v  # (B, G, 1, D) each
        out = F.scaled_dot_product_attention(
            q, keys[:, :, : p + 1], values[:, :, : p + 1], enable_gqa=True
        )  # (B, H, 1, D)
        return F.linear(out.transpose(1, 2).reshape(B, 1, C), w_out, b_out)  # (B, 1, C)

    def step(name):
        mha, cache = steps[name]

        def run():
            cache.position = POS  # rewound: every step at position 128
            return mha(x, cache=cache)

        return run

    name = "MHA decode step" if G == H else f"GQA decode step (G={G})"
    name += ", padded cache" if padded else ""
    compare(
        name if dtype == torch.float32 else f"{name}, {str(dtype).removeprefix('torch.')}",
        {
            "torch": by_hand if G == H else by_hand_gqa,
            "before": step("before"),
            "after": step("after"),
        },
        rounds,
        200,
    )


def long_cases(base, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, H, 1024, D, generator=g) for _ in range(3)]
    for dtype, dname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        t = tuple(x.to(dtype) for x in inputs)
        for case, kw in (("plain", {}), ("causal", dict(is_causal=True))):
            fns = {
                "torch": lambda kw=kw, t=t: F.scaled_dot_product_attention(*t, **kw),
                "before": lambda kw=kw, t=t: base.scaled_dot_product_attention(*t, **kw),
                "after": lambda kw=kw, t=t: qkv.scaled_dot_product_attention(*t, **kw),
            }
            compare(f"T=1024, {case}, {dname}", fns, rounds, 1)


def structured_cases(base, rounds: int, T: int = 1024) -> None:
    """T=1024 (B=1, H=8, D=64) with ``sliding_window(256)``, documents and causal documents,
    float32 and bfloat16, against compiled FlexAttention with the same block mask (built once,
    untimed): issue 38's peer for these masks. A case's "torch" column is Flex's. ``T``:
    another length (``structured-256``: where a call's Python is a larger share)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from qkv.bench import document_ids

    W = 256
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, H, T, D, generator=g) for _ in range(3)]
    ids = document_ids(T)[0]  # (T,)

    def window(b, h, qi, ki):
        return (ki <= qi) & (ki >= qi - W)

    def document(b, h, qi, ki):
        return ids[qi] == ids[ki]

    def causal_document(b, h, qi, ki):
        return (ids[qi] == ids[ki]) & (ki <= qi)

    flex = torch.compile(flex_attention, dynamic=False)
    for dtype, dname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        t = tuple(x.to(dtype) for x in inputs)
        for case, fmask, mods in (
            ("window", window, (qkv.masks.sliding_window(W), base.masks.sliding_window(W))),
            ("document", document, (qkv.masks.document(ids[None]), base.masks.document(ids[None]))),
            (
                "causal document",
                causal_document,
                tuple(
                    m.masks.and_masks(m.masks.document(ids[None]), m.masks.causal())
                    for m in (qkv, base)
                ),
            ),
        ):
            block_mask = create_block_mask(fmask, None, None, T, T, device="cpu")
            fns = {
                "torch": lambda t=t, bm=block_mask: flex(*t, block_mask=bm),
                "before": lambda t=t, m=mods[1]: base.scaled_dot_product_attention(*t, mask_mod=m),
                "after": lambda t=t, m=mods[0]: qkv.scaled_dot_product_attention(*t, mask_mod=m),
            }
            compare(f"T={T}, {case}, {dname} (against compiled Flex)", fns, rounds, 1)


def padded_cases(base, rounds: int) -> None:
    """A padded batch (B=4, H=8, T=1024, D=64, keys 1024/750/450/150 per element), float32 and
    bfloat16, against compiled FlexAttention with the same block mask (built once, untimed):
    causal with ``key_lengths``, ``sliding_window(256)`` with ``key_lengths``, ``key_lengths``
    alone (an encoder's batch), and causal with a bool key mask ``(B, 1, 1, S)`` (what the
    transformers integration passes for padding). A case's "torch" column is Flex's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    Bp, T, W = 4, 1024, 256
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(Bp, H, T, D, generator=g) for _ in range(3)]
    lens = torch.tensor([1024, 750, 450, 150])
    keep = (torch.arange(T) < lens[:, None])[:, None, None, :]  # (B, 1, 1, S)

    def causal_lengths(b, h, qi, ki):
        return (ki <= qi) & (ki < lens[b])

    def window_lengths(b, h, qi, ki):
        return (ki <= qi) & (ki >= qi - W) & (ki < lens[b])

    def lengths(b, h, qi, ki):
        return ki < lens[b]

    flex = torch.compile(flex_attention, dynamic=False)
    for dtype, dname in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        t = tuple(x.to(dtype) for x in inputs)
        for case, fmask, kws in (
            (
                "causal + key lengths",
                causal_lengths,
                tuple(
                    dict(is_causal=True, mask_mod=m.masks.key_lengths(lens)) for m in (qkv, base)
                ),
            ),
            (
                "window + key lengths",
                window_lengths,
                tuple(
                    dict(
                        mask_mod=m.masks.and_masks(
                            m.masks.sliding_window(W), m.masks.key_lengths(lens)
                        )
                    )
                    for m in (qkv, base)
                ),
            ),
            (
                "key lengths",
                lengths,
                tuple(dict(mask_mod=m.masks.key_lengths(lens)) for m in (qkv, base)),
            ),
            ("causal + bool key mask", causal_lengths, (dict(attn_mask=keep, is_causal=True),) * 2),
        ):
            block_mask = create_block_mask(fmask, Bp, None, T, T, device="cpu")
            fns = {
                "torch": lambda t=t, bm=block_mask: flex(*t, block_mask=bm),
                "before": lambda t=t, kw=kws[1]: base.scaled_dot_product_attention(*t, **kw),
                "after": lambda t=t, kw=kws[0]: qkv.scaled_dot_product_attention(*t, **kw),
            }
            compare(f"B=4, T=1024, {case}, {dname} (against compiled Flex)", fns, rounds, 1)


def train_cases(base, rounds: int) -> None:
    """Calls that want a gradient (inputs requiring it, grad mode on): the forward alone and
    the forward and backward, at a training batch's size (B=8, H=8, T=S=128, D=64, float32
    and bfloat16) and at one query over 128 keys (a decoding step run without no_grad)."""
    g = torch.Generator().manual_seed(0)
    for (b, t, s), dtype in (
        ((8, 128, 128), torch.float32),
        ((8, 128, 128), torch.bfloat16),
        ((1, 1, 128), torch.float32),
    ):
        q = torch.randn(b, H, t, D, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(b, H, s, D, generator=g).to(dtype).requires_grad_() for _ in "kv")
        dout = torch.randn(b, H, t, D, generator=g).to(dtype)
        for backward in (False, True):

            def make(fn, backward=backward, q=q, k=k, v=v, dout=dout):
                def run():
                    out = fn(q, k, v)
                    if backward:
                        out.backward(dout)
                    return out

                return run

            fns = {
                "torch": make(F.scaled_dot_product_attention),
                "before": make(base.scaled_dot_product_attention),
                "after": make(qkv.scaled_dot_product_attention),
            }
            what = "forward and backward" if backward else "forward"
            dname = str(dtype).removeprefix("torch.")
            with torch.enable_grad():
                compare(
                    f"B={b}, T={t}, S={s}, {what}, {dname}, with gradient",
                    fns,
                    rounds,
                    max(1, 2000 // (b * t * s // 64 + 1)),
                )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", required=True, help="the git revision to compare against")
    p.add_argument("--cases", nargs="+", default=["short", "step", "long"])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=1, help="torch's threads (0: its own)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # compiled Flex recompiles per block mask and dtype: past dynamo's default limit of 8 (the
    # padded and structured cases together) it ran eagerly, 10x slower, and flattered qkv
    torch._dynamo.config.recompile_limit = 64
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        base = import_base(args.rev, Path(tmp))
        print(
            f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} thread(s); before = {args.rev}"
        )
        for case in args.cases:
            cases = {
                "short": short_cases,
                "short-bf16": lambda base, rounds: short_cases(base, rounds, torch.bfloat16),
                "long-cache": long_cache_cases,
                "step": step_case,
                "step-gqa": lambda base, rounds: step_case(base, rounds, G=2),
                "step-bf16": lambda base, rounds: step_case(base, rounds, dtype=torch.bfloat16),
                "step-padded": lambda base, rounds: step_case(base, rounds, padded=True),
                "long": long_cases,
                "structured": structured_cases,
                "structured-256": lambda base, rounds: structured_cases(base, rounds, T=256),
                "padded": padded_cases,
                "train": train_cases,
            }
            cases[case](base, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
