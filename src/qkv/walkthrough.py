"""The seeds' walkthrough: one attention computation, every intermediate, in float64.

Seed 004's seven steps (SEEDS.md 5c) -- prepare inputs, initialise weights, derive Q, K, V,
scores, softmax, multiply scores with values, sum weighted values -- for a seed's worked example
(:func:`example_problem`) or matrices from a JSON file (:func:`load_problem`). The numbers come
from the library: :func:`single_head` runs ``qkv.SelfAttention``, :func:`multi_head` runs
``qkv.scaled_dot_product_attention`` per head on contiguous column chunks, then W^O. Each returns
a :class:`Walk` holding every intermediate; ``qkv explain`` prints it.

Shape alphabet: H heads, T tokens (queries and keys alike), C model dim (d_model), D query/key
dim (d_k), Dv value dim (d_v), O output dim of W^O.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .examples import get_example
from .functional import scaled_dot_product_attention
from .nn import SelfAttention

__all__ = [
    "MULTI_STEPS",
    "SINGLE_STEPS",
    "Problem",
    "Walk",
    "example_problem",
    "load_problem",
    "multi_head",
    "parse_scale",
    "single_head",
]

# The steps' names, as SEEDS.md 5c gives them (one head) and with the multi-head steps added.
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


# ---- building the problem ---------------------------------------------------------------------


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


# ---- computing --------------------------------------------------------------------------------


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
    """The scale in words, ``dim`` named ``dim_name``: for the printout and the tutorial note."""
    if scale is None:
        return f"1/sqrt({dim_name}) = 1/sqrt({dim}) = {1 / math.sqrt(dim):.6g}"
    return "1 (none: no scaling)" if scale == 1.0 else f"{scale:g}"
