"""``qkv explain``: one attention computation, step by step, with exact numbers.

Prints seed 004's seven steps (SEEDS.md 5c) -- prepare inputs, initialise weights, derive
Q, K, V, scores, softmax, multiply scores with values, sum weighted values -- for a seed's
worked example or your own matrices (``--input FILE.json``), in float64. The argument parsing
and printing only: the problem and every intermediate come from the library
:mod:`qkv.walkthrough` (``qkv.SelfAttention`` for one head, ``qkv.scaled_dot_product_attention``
per head with ``--heads``), whose names this module held before and re-exports. Says where the
tutorial rounded and draws the weights with ``--plot``.

Shape alphabet: H heads, T tokens (queries and keys alike), C model dim (d_model), D query/key
dim (d_k), Dv value dim (d_v), O output dim of W^O.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from ..examples import EXAMPLES
from ..walkthrough import (
    MULTI_STEPS,
    SINGLE_STEPS,
    Problem,
    Walk,
    _scale_text,
    _shape,
    _w_o,
    example_problem,
    load_problem,
    multi_head,
    parse_scale,
    single_head,
)
from .tables import format_matrix

__all__ = [
    "MULTI_STEPS",
    "SINGLE_STEPS",
    "Problem",
    "Walk",
    "add_parser",
    "example_problem",
    "load_problem",
    "multi_head",
    "parse_scale",
    "run_explain",
    "single_head",
]

_WIDTH = 100  # tables are printed side by side while they fit in this many columns


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="walk one attention computation step by step, with exact numbers",
        description="Walk seed 004's seven steps (SEEDS.md 5c) for a worked example or your "
        "own matrices, in float64, with the numbers from qkv.SelfAttention (or, with --heads, "
        "qkv.scaled_dot_product_attention per head). Says where the tutorial rounded.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--example",
        choices=sorted(EXAMPLES),
        default="seed004",
        help="worked example to explain (default: seed004)",
    )
    src.add_argument(
        "--input",
        metavar="FILE.json",
        help='your own matrices: keys "x" (T x d_model), "w_q", "w_k" '
        '(d_model x d_k), "w_v" (d_model x d_v); optional "w_o" (d_v x d_out), '
        '"tokens", "scale"',
    )
    p.add_argument(
        "--scale",
        help="none (no scaling), 1/sqrt(d_k) (or sqrt) or a number "
        "(default: the example's or file's own; a file without one: 1/sqrt(d_k))",
    )
    p.add_argument(
        "--heads",
        type=int,
        metavar="N",
        help="walk multi-head attention with N heads (contiguous column chunks)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="write attention-weight heatmaps here")
    p.add_argument("--digits", type=int, default=6, help="significant digits printed (default: 6)")
    p.set_defaults(func=run_explain)


def run_explain(args: argparse.Namespace) -> int:
    """Print the walk (and write the plot) that ``args`` ask for; 0 on success."""
    if not 1 <= args.digits <= 17:
        raise ValueError(f"--digits must be between 1 and 17, got {args.digits}")
    if args.input is not None:
        problem = load_problem(args.input, args.scale)
    else:
        problem = example_problem(args.example, args.scale)
    out = _Printer(args.digits)
    if args.heads is None:
        walk = single_head(problem)
        _print_single(out, problem, walk)
    else:
        walk = multi_head(problem, args.heads)
        _print_multi(out, problem, walk)
    if args.plot:
        _plot(walk.probs, args.plot, problem.tokens)
    return 0


# ---- printing -----------------------------------------------------------------------------


class _Printer:
    """Numbered step headers and aligned tables, ``digits`` significant digits."""

    def __init__(self, digits: int) -> None:
        self.digits = digits
        self.steps: tuple[str, ...] = ()
        self.done = 0
        self.fresh = True  # nothing shown since the last step header

    def start(self, steps: tuple[str, ...]) -> None:
        self.steps, self.done = steps, 0

    def step(self, detail: str) -> None:
        self.done += 1
        print(f"\nStep {self.done}/{len(self.steps)}: {self.steps[self.done - 1]}")
        print(detail)
        self.fresh = True

    def table(
        self, title: str, m: Tensor, rows: list[str] | None = None, cols: list[str] | None = None
    ) -> str:
        return format_matrix(title, m, rows, cols, digits=self.digits)

    def show(self, *tables: str) -> None:
        """Print tables side by side, a blank line from what this step showed before."""
        print(("" if self.fresh else "\n") + _beside(list(tables)))
        self.fresh = False


def _beside(blocks: list[str], gap: int = 4) -> str:
    """Text blocks side by side, wrapping to a new row of blocks past ``_WIDTH`` columns."""
    rows: list[list[str]] = [[]]
    used = 0
    for b in blocks:
        w = max(len(line) for line in b.splitlines())
        if rows[-1] and used + gap + w > _WIDTH:
            rows.append([])
            used = 0
        used += w + (gap if rows[-1] else 0)
        rows[-1].append(b)
    return "\n\n".join(_join(r, gap) for r in rows)


def _join(blocks: list[str], gap: int) -> str:
    split = [b.splitlines() for b in blocks]
    widths = [max(len(line) for line in s) for s in split]
    lines = []
    for i in range(max(len(s) for s in split)):
        parts = [(s[i] if i < len(s) else "").ljust(w) for s, w in zip(split, widths, strict=True)]
        lines.append((" " * gap).join(parts).rstrip())
    return "\n".join(lines)


def _print_intro(p: Problem, how: str) -> None:
    T, C = p.x.shape
    print(f"qkv explain: {p.title}")
    print(
        f"T = {T} tokens ({', '.join(p.tokens)}), d_model = {C}, d_k = {p.w_q.shape[1]}, "
        f"d_v = {p.w_v.shape[1]}; float64; {how}"
    )


def _print_inputs(out: _Printer, p: Problem, with_w_o: bool) -> None:
    """Steps 1 to 2: the inputs and the weights."""
    T, C = p.x.shape
    out.step(f"x holds one row per token: (T, d_model) = ({T}, {C})")
    out.show(out.table("x", p.x, p.tokens))
    out.step("the projections, used as Q = x W_Q (rows: input features)")
    tables = [
        out.table(f"W_{n} {_shape(w)}", w) for n, w in (("Q", p.w_q), ("K", p.w_k), ("V", p.w_v))
    ]
    if with_w_o:
        tables.append(
            out.table(f"W^O {_shape(_w_o(p))}" + (" (identity)" if p.w_o is None else ""), _w_o(p))
        )
    out.show(*tables)


def _print_qkv(out: _Printer, p: Problem, w: Walk) -> None:
    q, k, v = (t.transpose(0, 1).flatten(1) for t in (w.q, w.k, w.v))  # (T, D), (T, D), (T, Dv)
    out.step("each token's query, key and value: its row of x times W_Q, W_K, W_V")
    out.show(
        out.table("Q = x W_Q", q, p.tokens),
        out.table("K = x W_K", k, p.tokens),
        out.table("V = x W_V", v, p.tokens),
    )


def _print_single(out: _Printer, p: Problem, w: Walk) -> None:
    _print_intro(p, "computed by qkv.SelfAttention")
    scale = _scale_text(p.scale, "d_k", p.w_q.shape[1])
    print(f"scale: {scale}, {p.scale_source}")
    out.start(SINGLE_STEPS)
    _print_inputs(out, p, with_w_o=False)
    _print_qkv(out, p, w)
    toks = p.tokens
    out.step(f"scores = Q K^T * scale, scale = {scale}: row i = query i against every key")
    out.show(out.table("scores", w.scores[0], toks, toks))
    out.step("weights = softmax over each row of the scores (over the keys); rows sum to 1")
    out.show(out.table("weights", w.probs[0], toks, toks))
    out.step("weight_ij * v_j: one table per query i, one row per key j")
    out.show(
        *(out.table(f"query {t}: weight * v", w.weighted[0, i], toks) for i, t in enumerate(toks))
    )
    out.step("output_i = sum_j weight_ij * v_j, the column sums of each table above = weights V")
    out.show(out.table("outputs", w.out, toks))
    _print_tutorial(out, p, w)


def _print_tutorial(out: _Printer, p: Problem, w: Walk) -> None:
    if not (p.tutorial or p.tutorial_skipped):
        return
    print("\nWhere the tutorial rounded")
    out.fresh = True
    if p.tutorial_skipped:
        print(p.tutorial_skipped)
        return
    exact = {"scores": w.scores[0], "probs": w.probs[0], "outputs": w.out}
    names = {"scores": "scores", "probs": "softmax", "outputs": "outputs"}
    for key, rounded in p.tutorial.items():
        r = torch.tensor(rounded, dtype=torch.float64)  # (T, T) or (T, Dv)
        diff = (exact[key] - r).abs()  # (T, T) or (T, Dv)
        i, j = divmod(int(diff.argmax()), diff.shape[1])
        cols = p.tokens if key != "outputs" else None
        out.show(
            out.table(f"exact {names[key]}", exact[key], p.tokens, cols),
            out.table(f"tutorial's {names[key]} (rounded)", r, p.tokens, cols),
        )
        print(
            f"largest difference: {float(diff.max()):.{out.digits}g} (row {p.tokens[i]}, "
            f"column {cols[j] if cols else j})"
        )
    if p.note:
        print(f"\nnote: {p.note}")


def _print_multi(out: _Printer, p: Problem, w: Walk) -> None:
    H = w.q.shape[0]
    _print_intro(p, f"{H} heads, computed by qkv.scaled_dot_product_attention on (H, T, head_dim)")
    scale = _scale_text(p.scale, "head_dim", w.q.shape[-1])
    print(f"scale per head: {scale}, {p.scale_source}")
    out.start(MULTI_STEPS)
    _print_inputs(out, p, with_w_o=True)
    _print_qkv(out, p, w)
    _print_heads(out, p, w, scale)
    out.step("the head outputs side by side, head 1's columns first: (T, d_v)")
    out.show(out.table("concat", w.concat, p.tokens))
    out.step("output = concat W^O" + (' (W^O = identity: no "w_o" given)' if p.w_o is None else ""))
    out.show(out.table("outputs", w.out, p.tokens))


def _print_heads(out: _Printer, p: Problem, w: Walk, scale: str) -> None:
    """Steps 4 to 8 of the multi-head walk: split, then each head's attention."""
    hk, hv = w.q.shape[-1], w.v.shape[-1]
    toks, names = p.tokens, [f"head {h + 1}" for h in range(w.q.shape[0])]
    out.step(
        f"head h takes columns h*{hk}:(h+1)*{hk} of Q and K and h*{hv}:(h+1)*{hv} of V, in order"
    )
    for h, n in enumerate(names):
        out.show(
            out.table(f"{n}: Q_{h + 1}", w.q[h], toks, _cols(h, hk)),
            out.table(f"{n}: K_{h + 1}", w.k[h], toks, _cols(h, hk)),
            out.table(f"{n}: V_{h + 1}", w.v[h], toks, _cols(h, hv)),
        )
    out.step(f"per head, scores = Q_h K_h^T * scale, scale = {scale}")
    out.show(*(out.table(f"{n}: scores", w.scores[h], toks, toks) for h, n in enumerate(names)))
    out.step("per head, weights = softmax over each row of the scores")
    out.show(*(out.table(f"{n}: weights", w.probs[h], toks, toks) for h, n in enumerate(names)))
    out.step("per head, weight_ij * v_j: one table per query i, one row per key j")
    for h, n in enumerate(names):
        out.show(
            *(
                out.table(f"{n}, query {t}: weight * v", w.weighted[h, i], toks, _cols(h, hv))
                for i, t in enumerate(toks)
            )
        )
    out.step("per head, output_i = sum_j weight_ij * v_j = weights_h V_h")
    out.show(
        *(out.table(f"{n}: output", w.heads[h], toks, _cols(h, hv)) for h, n in enumerate(names))
    )


def _cols(h: int, width: int) -> list[str]:
    """Labels of head ``h``'s columns in the unsplit matrix."""
    return [str(c) for c in range(h * width, (h + 1) * width)]


def _plot(probs: Tensor, path: str, tokens: list[str]) -> None:
    from ..viz import plot_attention  # matplotlib is optional: import only when plotting

    titles = [f"head {h + 1}" for h in range(probs.shape[0])]
    try:
        written = plot_attention(probs, path, query_labels=tokens, key_labels=tokens, titles=titles)
    except ImportError as e:
        raise ValueError(str(e)) from None
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
    n = len(titles)
    print(f"\nwrote {written}: attention weights, {n} panel{'s' if n > 1 else ''}")
