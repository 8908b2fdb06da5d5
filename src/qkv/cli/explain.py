"""``qkv explain``: one attention computation, step by step, with exact numbers.

Walks seed 004's seven steps (SEEDS.md 5c) -- prepare inputs, initialise weights, derive
Q, K, V, scores, softmax, multiply scores with values, sum weighted values -- for a seed's
worked example or your own matrices (``--input FILE.json``), in float64. The numbers come from
the library: ``qkv.SelfAttention`` for one head, ``qkv.scaled_dot_product_attention`` per head
with ``--heads``. Says where the tutorial rounded and draws the weights with ``--plot``.

Shape alphabet: H heads, T tokens (queries and keys alike), C model dim (d_model), D query/key
dim (d_k), Dv value dim (d_v), O output dim of W^O.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..examples import EXAMPLES, get_example
from ..functional import scaled_dot_product_attention
from ..nn import SelfAttention
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

SINGLE_STEPS = (
    "prepare inputs",
    "initialise weights",
    "derive Q, K, V",
    "scores",
    "softmax",
    "multiply scores with values",
    "sum weighted values",
)
MULTI_STEPS = (
    "prepare inputs",
    "initialise weights",
    "derive Q, K, V",
    "split into heads",
    "scores",
    "softmax",
    "multiply scores with values",
    "sum weighted values",
    "concat heads",
    "multiply by W^O",
)
_MATRICES = ("x", "w_q", "w_k", "w_v", "w_o")
_KEYS = (*_MATRICES, "tokens", "scale")
_WIDTH = 100  # tables are printed side by side while they fit in this many columns


@dataclass(frozen=True)
class Problem:
    """One attention computation to explain: inputs, weights, scale, and what to compare.

    Attributes:
        scale: Factor on the scores; None means ``1/sqrt(d_k)`` (per head ``1/sqrt(head_dim)``).
        scale_source: Where the scale came from, for the printout.
        tutorial: The tutorial's rounded ``"probs"``/``"outputs"`` to compare with, or empty.
        tutorial_skipped: Why the tutorial's numbers are not compared (empty if they are).

    Shape:
        x ``(T, C)``; w_q, w_k ``(C, D)``; w_v ``(C, Dv)``; w_o ``(Dv, O)`` or None (identity).
    """

    title: str
    x: Tensor
    w_q: Tensor
    w_k: Tensor
    w_v: Tensor
    w_o: Tensor | None
    tokens: list[str]
    scale: float | None
    scale_source: str
    tutorial: dict = field(default_factory=dict)
    tutorial_skipped: str = ""
    note: str = ""


@dataclass(frozen=True)
class Walk:
    """Every intermediate of the computation, as the library computed it.

    Attributes:
        scale: The factor used on each head's scores.

    Shape:
        q, k ``(H, T, D/H)``; v ``(H, T, Dv/H)``; scores, probs ``(H, T, T)``; weighted
        ``(H, T, T, Dv/H)`` (weight_ij * v_j); heads ``(H, T, Dv/H)``; concat ``(T, Dv)``;
        out ``(T, O)``. One head: H = 1 and out = concat = heads[0].
    """

    q: Tensor
    k: Tensor
    v: Tensor
    scores: Tensor
    probs: Tensor
    weighted: Tensor
    heads: Tensor
    concat: Tensor
    out: Tensor
    scale: float


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


# ---- building the problem ---------------------------------------------------------------


def parse_scale(value: str | float | int, what: str = "--scale") -> float | None:
    """``"none"`` -> 1.0, ``"1/sqrt(d_k)"`` or ``"sqrt"`` -> None, a number -> itself."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text == "none":
            return 1.0
        if text in ("sqrt", "1/sqrt(d_k)", "1/sqrt(dk)"):
            return None
        try:
            number = float(text)
        except ValueError:
            number = None
    else:
        number = None
    if number is None or not math.isfinite(number):
        raise ValueError(
            f"{what} must be none, 1/sqrt(d_k) (or sqrt) or a finite number, got {value!r}"
        )
    return number


def example_problem(name: str, scale: str | None = None) -> Problem:
    """The worked example ``name`` (see ``qkv.examples``), with ``scale`` overriding its own."""
    ex = get_example(name)
    t = ex.tensors(torch.float64)
    used = ex.scale if scale is None else parse_scale(scale)
    tutorial, skipped = ex.tutorial, ""
    if ex.tutorial and used != ex.scale:  # rounded numbers of another scale: nothing to compare
        tutorial = {}
        skipped = (
            f"the tutorial's numbers use scale "
            f"{_scale_text(ex.scale, 'd_k', len(ex.w_k[0]))}; run without --scale to "
            f"compare them"
        )
    return Problem(
        title=ex.title,
        x=t["x"],
        w_q=t["w_q"],
        w_k=t["w_k"],
        w_v=t["w_v"],
        w_o=None,
        tokens=[f"x{i + 1}" for i in range(len(ex.x))],
        scale=used,
        scale_source="the example's own" if scale is None else "--scale",
        tutorial=tutorial,
        tutorial_skipped=skipped,
        note=ex.note,
    )


def load_problem(path: str, scale: str | None = None) -> Problem:
    """The problem in the JSON file at ``path``; ValueError naming what is wrong otherwise."""
    data = _read_json(path)
    missing = [k for k in _MATRICES[:4] if k not in data]
    if missing:
        raise ValueError(
            f"{path}: missing key {', '.join(map(repr, missing))}; need "
            f'"x", "w_q", "w_k", "w_v" (optional "w_o", "tokens", "scale")'
        )
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"{path}: unknown key {', '.join(map(repr, unknown))}; allowed keys: {', '.join(_KEYS)}"
        )
    m = {k: _matrix(data[k], k, path) for k in _MATRICES if k in data}
    _check_shapes(m, path)
    tokens = _tokens(data.get("tokens"), m["x"].shape[0], path)
    if scale is not None:
        used, source = parse_scale(scale), "--scale"
    elif "scale" in data:
        used, source = parse_scale(data["scale"], f'{path}: "scale"'), f'"scale" in {path}'
    else:
        used, source = None, "the default"
    return Problem(
        title=f"your input {path}",
        x=m["x"],
        w_q=m["w_q"],
        w_k=m["w_k"],
        w_v=m["w_v"],
        w_o=m.get("w_o"),
        tokens=tokens,
        scale=used,
        scale_source=source,
    )


def _read_json(path: str) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: expected a JSON object with keys x, w_q, w_k, w_v, got {_json_type(data)}"
        )
    return data


def _matrix(value: object, name: str, path: str) -> Tensor:
    """A non-empty rectangular list of lists of finite numbers, as float64 ``(R, K)``."""
    if not isinstance(value, list) or not value or not all(isinstance(r, list) for r in value):
        raise ValueError(
            f'{path}: "{name}" must be a non-empty list of rows (lists of '
            f"numbers), got {_json_type(value)}"
        )
    width = len(value[0])
    for i, row in enumerate(value):
        if len(row) != width or not row:
            raise ValueError(
                f'{path}: "{name}" is ragged: row {i} has {len(row)} numbers, '
                f"row 0 has {width}; every row needs the same length (> 0)"
            )
        for j, x in enumerate(row):
            if not _finite_number(x):
                raise ValueError(
                    f'{path}: "{name}"[{i}][{j}] is {json.dumps(x)}, not a finite number'
                )
    return torch.tensor(value, dtype=torch.float64)  # (R, K)


def _finite_number(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int past float's range
        return False


def _check_shapes(m: dict[str, Tensor], path: str) -> None:
    C = m["x"].shape[1]
    for name, dims in (
        ("w_q", "(d_model, d_k)"),
        ("w_k", "(d_model, d_k)"),
        ("w_v", "(d_model, d_v)"),
    ):
        if m[name].shape[0] != C:
            raise ValueError(
                f'{path}: "{name}" is {_shape(m[name])} but x has d_model = {C} '
                f"columns; {name} must be {dims} = ({C}, ...)"
            )
    if m["w_k"].shape != m["w_q"].shape:
        raise ValueError(
            f'{path}: "w_k" is {_shape(m["w_k"])} but "w_q" is '
            f"{_shape(m['w_q'])}; queries and keys need one d_k"
        )
    d_v = m["w_v"].shape[1]
    if "w_o" in m and m["w_o"].shape[0] != d_v:
        raise ValueError(
            f'{path}: "w_o" is {_shape(m["w_o"])} but d_v = {d_v}; w_o must be '
            f"(d_v, d_out) = ({d_v}, ...)"
        )


def _tokens(value: object, T: int, path: str) -> list[str]:
    if value is None:
        return [f"x{i + 1}" for i in range(T)]
    if (
        not isinstance(value, list)
        or len(value) != T
        or not all(isinstance(t, str) and t and not any(c.isspace() for c in t) for t in value)
    ):
        raise ValueError(
            f'{path}: "tokens" must be a list of T = {T} non-empty strings '
            f"without spaces (one per row of x), got {json.dumps(value)}"
        )
    return value


def _json_type(value: object) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _shape(t: Tensor) -> str:
    return f"({t.shape[0]}, {t.shape[1]})"


# ---- computing ----------------------------------------------------------------------------


def single_head(p: Problem) -> Walk:
    """One head, as ``qkv.SelfAttention`` computes it."""
    module = SelfAttention.from_weights(p.w_q, p.w_k, p.w_v, scale=p.scale)
    with torch.no_grad():  # numbers to print, not to train
        out, tr = module(p.x, return_trace=True)  # (T, Dv)
    q, k, v, scores, probs, heads = (
        t.unsqueeze(0) for t in (tr.q, tr.k, tr.v, tr.scores, tr.probs, out)
    )  # (1, T, *)
    weighted = probs.unsqueeze(-1) * v.unsqueeze(1)  # (1, T, T, Dv)
    return Walk(q, k, v, scores, probs, weighted, heads, out, out, _scale_value(p.scale, q))


def multi_head(p: Problem, heads: int) -> Walk:
    """``heads`` heads on contiguous column chunks of Q, K, V, concatenated, times W^O."""
    d_k, d_v = p.w_q.shape[1], p.w_v.shape[1]
    _check_heads(heads, d_k, d_v)
    with torch.no_grad():  # numbers to print, not to train
        _, tr = SelfAttention.from_weights(p.w_q, p.w_k, p.w_v)(p.x, return_trace=True)
    q, k, v = (_split(t, heads) for t in (tr.q, tr.k, tr.v))  # (H, T, D/H) x2, (H, T, Dv/H)
    out_h, trace = scaled_dot_product_attention(
        q, k, v, scale=p.scale, return_trace=True
    )  # (H, T, Dv/H)
    weighted = trace.probs.unsqueeze(-1) * v.unsqueeze(1)  # (H, T, T, Dv/H)
    T = p.x.shape[0]
    concat = out_h.transpose(0, 1).reshape(T, d_v)  # (T, Dv)
    out = concat @ _w_o(p)  # (T, O)
    return Walk(
        q, k, v, trace.scores, trace.probs, weighted, out_h, concat, out, _scale_value(p.scale, q)
    )


def _check_heads(heads: int, d_k: int, d_v: int) -> None:
    if heads < 1 or d_k % heads or d_v % heads:
        valid = [n for n in range(1, math.gcd(d_k, d_v) + 1) if d_k % n == 0 and d_v % n == 0]
        raise ValueError(
            f"--heads {heads} must divide d_k = {d_k} and d_v = {d_v} (each "
            f"head takes d_k / N query/key and d_v / N value columns); valid N: "
            f"{', '.join(map(str, valid))}"
        )


def _split(t: Tensor, heads: int) -> Tensor:
    """Columns in ``heads`` contiguous chunks, one per head (seed 000: q^1 -> q^{1,1}, q^{1,2})."""
    T, D = t.shape
    return t.reshape(T, heads, D // heads).transpose(0, 1)  # (H, T, D/H)


def _w_o(p: Problem) -> Tensor:
    d_v = p.w_v.shape[1]
    return torch.eye(d_v, dtype=torch.float64) if p.w_o is None else p.w_o  # (Dv, O)


def _scale_value(scale: float | None, q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _scale_text(scale: float | None, dim_name: str, dim: int) -> str:
    if scale is None:
        return f"1/sqrt({dim_name}) = 1/sqrt({dim}) = {1 / math.sqrt(dim):.6g}"
    return "1 (none: no scaling)" if scale == 1.0 else f"{scale:g}"


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
