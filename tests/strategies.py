"""Hypothesis strategies for attention calls, and their two readings: qkv's and reference64's.

A drawn :class:`Case` is a *description* of one call (sizes, dtype, layouts, mask, mask_mod,
score_mod, scale, flags, a seed for the numbers). ``case.inputs()`` makes the tensors qkv is
called with; ``case.golden_mask()`` and ``case.golden_score_mod()`` read the same description
independently of qkv (tests/reference64.py), so a wrong mask in qkv shows up as a difference.
Every part has a readable ``repr`` so a falsifying example can be pasted back as an
``@example(Case(...))``.

Shape alphabet: B batch, H query heads, G key/value heads, T query length, S key length,
D head dim, Dv value head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st
from reference64 import (
    alibi64,
    causal_allowed,
    document_allowed,
    elementwise_mask,
    elementwise_score,
    key_lengths_allowed,
    neighborhood_allowed,
    softcap64,
    tile_order,
    window_allowed,
)
from torch import Tensor

import qkv

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Layouts of a (B, X, L, E) input: every one holds the same logical values.
LAYOUTS = (
    "contiguous",
    "transposed",
    "strided",
    "column_major",
    "offset",
    "expand_batch",
    "expand_heads",
)
COPYING_FREE_LAYOUTS = ("contiguous", "transposed", "strided", "column_major", "offset")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_input(
    shape: tuple, layout: str, dtype: torch.dtype, seed: int, requires_grad: bool = False
) -> Tensor:
    """A ``shape = (B, X, L, E)`` tensor of standard-normal values stored in ``layout``, a view
    of a leaf (that requires grad when asked, as a user's parameter would):

    * ``contiguous``; ``transposed``: made as (B, L, X, E) then ``.transpose(1, 2)``;
    * ``strided``: every other element of a (B, X, L, 2E) tensor (``[..., ::2]``);
    * ``column_major``: made as (B, X, E, L) then ``.transpose(-1, -2)``;
    * ``offset``: a slice ``[:, :, 1:L+1]`` of a (B, X, L+2, E) tensor (storage offset);
    * ``expand_batch`` / ``expand_heads``: a (1, X, L, E) / (B, 1, L, E) tensor expanded
      (stride 0), so every batch element / head holds the same numbers.
    """
    B, X, L, E = shape
    g = _gen(seed)

    def leaf(*s):
        t = torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)
        return t.requires_grad_(requires_grad)

    if layout == "contiguous":
        return leaf(B, X, L, E)
    if layout == "transposed":
        return leaf(B, L, X, E).transpose(1, 2)
    if layout == "strided":
        return leaf(B, X, L, 2 * E)[..., ::2]
    if layout == "column_major":
        return leaf(B, X, E, L).transpose(-1, -2)
    if layout == "offset":
        return leaf(B, X, L + 2, E)[:, :, 1 : L + 1]
    if layout == "expand_batch":
        return leaf(1, X, L, E).expand(B, X, L, E)
    if layout == "expand_heads":
        return leaf(B, 1, L, E).expand(B, X, L, E)
    raise ValueError(layout)


# --- attn_mask --------------------------------------------------------------------------------

MASK_SHAPES = ("TS", "1TS", "B11S", "HTS", "BHTS", "B1TS", "S", "1S", "T1", "scalar")


def mask_shape(name: str, B: int, H: int, T: int, S: int) -> tuple:
    return {
        "TS": (T, S),
        "1TS": (1, T, S),
        "B11S": (B, 1, 1, S),
        "HTS": (H, T, S),
        "BHTS": (B, H, T, S),
        "B1TS": (B, 1, T, S),
        "S": (S,),
        "1S": (1, S),
        "T1": (T, 1),
        "scalar": (),
    }[name]


@dataclass(frozen=True)
class MaskSpec:
    """A dense ``attn_mask``: ``kind`` "bool" (True = may attend) or "float" (added; ``-inf``
    where not kept), of broadcast shape ``shape``, keeping each entry with probability
    ``p_keep``; rows ``dead_rows`` (of the mask's own T dim) keep nothing. ``dtype`` is the
    float mask's dtype ("same" = the inputs'). ``grad``: a float mask that requires grad.
    ``padding`` "right" or "left": each row keeps one range of keys instead, of a random
    length, at the start or the end (a padded batch's key mask: the tiled backend runs each
    batch element on its own keys)."""

    kind: str = "bool"
    shape: str = "TS"
    p_keep: float = 0.7
    dead_rows: tuple = ()
    dtype: str = "same"
    grad: bool = False
    seed: int = 0
    padding: str = ""

    def make(self, B: int, H: int, T: int, S: int, dtype: torch.dtype) -> Tensor:
        shape = mask_shape(self.shape, B, H, T, S)
        g = _gen(self.seed + 1)
        keep = torch.rand(shape, generator=g, dtype=torch.float64) < self.p_keep
        if self.padding and shape:
            n = torch.randint(0, shape[-1] + 1, shape[:-1] + (1,), generator=g)
            j = torch.arange(shape[-1])
            keep = j < n if self.padding == "right" else j >= shape[-1] - n
        if self.dead_rows and len(shape) >= 2 and shape[-2] == T:
            rows = [r for r in self.dead_rows if r < T]
            keep[..., rows, :] = False
        if self.kind == "bool":
            return keep
        mdt = dtype if self.dtype == "same" else DTYPES[self.dtype]
        values = torch.randn(shape, generator=g, dtype=torch.float64) * 1.5
        out = values.masked_fill(~keep, float("-inf")).to(mdt)
        return out.requires_grad_(self.grad)


# --- mask_mod descriptions ---------------------------------------------------------------------


class ModSpec:
    """A mask_mod description: ``build(ctx)`` gives what qkv is called with, ``dense(ctx)`` the
    ``(B, H, T, S)`` bool mask it stands for, computed without qkv."""

    def build(self, ctx: Ctx):
        raise NotImplementedError

    def dense(self, ctx: Ctx) -> Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Ctx:
    B: int
    H: int
    T: int
    S: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Causal(ModSpec):
    align: str = "top_left"

    def build(self, ctx):
        return qkv.masks.causal(align=self.align)

    def dense(self, ctx):
        off = 0 if self.align == "top_left" else ctx.S - ctx.T
        return causal_allowed(ctx.B, ctx.H, ctx.T, ctx.S, offset=off)


@dataclass(frozen=True)
class Window(ModSpec):
    left: int = 2
    right: int = 0
    align: str = "top_left"

    def build(self, ctx):
        return qkv.masks.sliding_window(self.left, self.right, align=self.align)

    def dense(self, ctx):
        off = 0 if self.align == "top_left" else ctx.S - ctx.T
        return window_allowed(ctx.B, ctx.H, ctx.T, ctx.S, self.left, self.right, offset=off)


@dataclass(frozen=True)
class Document(ModSpec):
    """Ids from ``seed``: ``n_docs`` documents, sorted runs or shuffled; ``per_batch`` (B, L)
    or shared (L,) ids; ``kv_ids`` given separately unless ``shared`` (needs T == S)."""

    n_docs: int = 2
    sorted: bool = True
    per_batch: bool = False
    shared: bool = False
    seed: int = 0

    def _ids(self, ctx, L, salt):
        g = _gen(self.seed * 7 + salt)
        rows = ctx.B if self.per_batch else 1
        ids = torch.randint(0, self.n_docs, (rows, L), generator=g)
        return ids.sort(dim=-1).values if self.sorted else ids  # (B or 1, L)

    def ids(self, ctx):
        q = self._ids(ctx, ctx.T, 1)
        kv = q if self.shared and ctx.T == ctx.S else self._ids(ctx, ctx.S, 2)
        return q, kv

    def build(self, ctx):
        q, kv = self.ids(ctx)
        if kv is q:
            return qkv.masks.document(q if self.per_batch else q[0])
        return qkv.masks.document(q if self.per_batch else q[0], kv if self.per_batch else kv[0])

    def dense(self, ctx):
        q, kv = self.ids(ctx)
        return document_allowed(ctx.B, ctx.H, q, kv)


@dataclass(frozen=True)
class KeyLengths(ModSpec):
    """``lengths``: an int, or one per batch element (a tuple, cycled to B)."""

    lengths: object = 1

    def values(self, ctx):
        if isinstance(self.lengths, int):
            return self.lengths
        return [self.lengths[i % len(self.lengths)] for i in range(ctx.B)]

    def build(self, ctx):
        n = self.values(ctx)
        return qkv.masks.key_lengths(n if isinstance(n, int) else torch.tensor(n, dtype=torch.long))

    def dense(self, ctx):
        return key_lengths_allowed(ctx.B, ctx.H, ctx.T, ctx.S, self.values(ctx))


@dataclass(frozen=True)
class PrefixLM(KeyLengths):
    """``prefix_lm(lengths)``: the first keys seen by every row, the rest top-left causal."""

    def build(self, ctx):
        n = self.values(ctx)
        return qkv.masks.prefix_lm(n if isinstance(n, int) else torch.tensor(n, dtype=torch.long))

    def dense(self, ctx):
        causal = causal_allowed(ctx.B, ctx.H, ctx.T, ctx.S, offset=0)
        return causal | super().dense(ctx)


@dataclass(frozen=True)
class Neighborhood(ModSpec):
    """NATTEN's neighborhood on a token grid of ``shape`` (T = S = prod(shape)), per-dim
    ``kernel``, ``dilation`` and ``causal``; ``tile``: tokens laid out tile by tile (None:
    row-major). The dense mask is reference64's loops, the layout its own tile order."""

    shape: tuple = (2, 3)
    kernel: tuple = (1, 3)
    dilation: tuple = (1, 1)
    causal: tuple = (False, False)
    tile: tuple | None = None

    def build(self, ctx):
        layout = None if self.tile is None else qkv.masks.tile_layout(self.shape, self.tile)
        return qkv.masks.neighborhood(
            self.kernel, self.shape, self.dilation, self.causal, layout=layout
        )

    def dense(self, ctx):
        perm = None if self.tile is None else tile_order(self.shape, self.tile)
        allowed = neighborhood_allowed(self.shape, self.kernel, self.dilation, self.causal, perm)
        return allowed.expand(ctx.B, ctx.H, ctx.T, ctx.S)


# Plain functions written FlexAttention style (elementwise, 0-d indices); qkv calls them on
# broadcast index grids, reference64 one element at a time through vmap.
MASK_FUNCTIONS: dict[str, Callable] = {
    "band2": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= 2,
    "checker": lambda b, h, q_idx, kv_idx: (q_idx + kv_idx + h) % 2 == 0,
    "per_batch_causal": lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + b,
    "head1_blind": lambda b, h, q_idx, kv_idx: h != 1,
    "every_third_key": lambda b, h, q_idx, kv_idx: kv_idx % 3 != 2,
}


@dataclass(frozen=True)
class MaskFn(ModSpec):
    name: str = "band2"

    def build(self, ctx):
        return MASK_FUNCTIONS[self.name]

    def dense(self, ctx):
        return elementwise_mask(MASK_FUNCTIONS[self.name], ctx.B, ctx.H, ctx.T, ctx.S)


@dataclass(frozen=True)
class Combine(ModSpec):
    op: str = "and"
    mods: tuple = ()

    def build(self, ctx):
        parts = [m.build(ctx) for m in self.mods]
        return (qkv.masks.and_masks if self.op == "and" else qkv.masks.or_masks)(*parts)

    def dense(self, ctx):
        out = self.mods[0].dense(ctx)
        for m in self.mods[1:]:
            out = (out & m.dense(ctx)) if self.op == "and" else (out | m.dense(ctx))
        return out


# --- score_mod descriptions --------------------------------------------------------------------


class ScoreSpec:
    """A score_mod description. ``tensors(ctx)`` makes the tensors it captures (in the inputs'
    dtype, maybe requiring grad); ``build(tensors)`` the score_mod qkv is called with;
    ``golden(scores, tensors64)`` the same change on float64 scores, without qkv."""

    def tensors(self, ctx) -> dict[str, Tensor]:
        return {}

    def build(self, tensors: dict[str, Tensor], ctx: Ctx):
        raise NotImplementedError

    def golden(self, scores: Tensor, tensors: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Alibi(ScoreSpec):
    per_head: bool = True
    seed: int = 0

    def tensors(self, ctx):
        n = ctx.H if self.per_head else 1
        return {"slopes": torch.rand(n, generator=_gen(self.seed + 3)) + 0.05}  # float32 (n,)

    def build(self, tensors, ctx):
        return qkv.masks.alibi(tensors["slopes"])

    def golden(self, scores, tensors):
        return alibi64(scores, tensors["slopes"])


@dataclass(frozen=True)
class Softcap(ScoreSpec):
    cap: float = 2.0

    def build(self, tensors, ctx):
        return qkv.masks.softcap(self.cap)

    def golden(self, scores, tensors):
        return softcap64(scores, self.cap)


def _halve(score, b, h, q_idx, kv_idx):
    return score * 0.5


def _rel_bias(bias: Tensor, S: int):
    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S]

    return rel_bias


def _chained(bias: Tensor):
    def per_query_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b][q_idx]

    return per_query_bias


def _score_mask(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx + kv_idx) % 3 == 0, float("-inf"), score)


@dataclass(frozen=True)
class ScoreFn(ScoreSpec):
    """Plain functions: ``halve`` (s * 0.5), ``rel_bias`` (``s + bias[h, q - kv + S]``, bias
    (H, T + S) captured, maybe requiring grad), ``chained`` (``s + bias[b][q_idx]``, bias (B, T)),
    ``score_mask`` (``-inf`` where ``(q + kv) % 3 == 0``)."""

    name: str = "halve"
    grad: bool = False
    seed: int = 0

    def tensors(self, ctx):
        g = _gen(self.seed + 5)
        if self.name == "rel_bias":
            shape = (ctx.H, ctx.T + ctx.S)
        elif self.name == "chained":
            shape = (ctx.B, ctx.T)
        else:
            return {}
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(ctx.dtype)
        return {"bias": t.requires_grad_(self.grad)}

    def _fn(self, tensors, S):
        if self.name == "halve":
            return _halve
        if self.name == "rel_bias":
            return _rel_bias(tensors["bias"], S)
        if self.name == "chained":
            return _chained(tensors["bias"])
        if self.name == "score_mask":
            return _score_mask
        raise ValueError(self.name)

    def build(self, tensors, ctx):
        return self._fn(tensors, ctx.S)

    def golden(self, scores, tensors):
        return elementwise_score(self._fn(tensors, scores.shape[-1]), scores)


# --- the call ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One attention call: q ``(B, H, T, D)``, k/v ``(B, G, S, D/Dv)`` (G = H unless gqa)."""

    B: int = 1
    H: int = 1
    G: int = 1
    T: int = 4
    S: int = 4
    D: int = 4
    Dv: int = 4
    dtype: str = "float32"
    layouts: tuple = ("contiguous", "contiguous", "contiguous")
    gqa: bool = False
    scale: float | None = None
    is_causal: bool = False
    mask: MaskSpec | None = None
    mask_mod: ModSpec | None = None
    score_mod: ScoreSpec | None = None
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def ctx(self) -> Ctx:
        return Ctx(self.B, self.H, self.T, self.S, self.torch_dtype)

    def inputs(self, grad: bool = True) -> dict:
        """The tensors of the call: q, k, v in their layouts (views of leaves that require
        grad when ``grad``), the attn_mask, the score_mod's tensors and an upstream gradient."""
        dt = self.torch_dtype
        shapes = (
            (self.B, self.H, self.T, self.D),
            (self.B, self.G, self.S, self.D),
            (self.B, self.G, self.S, self.Dv),
        )
        qkv_ = []
        for i, (shape, layout) in enumerate(zip(shapes, self.layouts)):
            qkv_.append(make_input(shape, layout, dt, self.seed * 3 + i, grad))
        mask = None if self.mask is None else self.mask.make(self.B, self.H, self.T, self.S, dt)
        score_tensors = {} if self.score_mod is None else self.score_mod.tensors(self.ctx)
        dout = torch.randn(
            self.B, self.H, self.T, self.Dv, generator=_gen(self.seed + 11), dtype=torch.float64
        ).to(dt)
        return {
            "q": qkv_[0],
            "k": qkv_[1],
            "v": qkv_[2],
            "mask": mask,
            "score_tensors": score_tensors,
            "dout": dout,
        }

    def qkv_kwargs(self, inp: dict) -> dict:
        """Keyword arguments of ``qkv.scaled_dot_product_attention`` besides q, k, v."""
        kw = dict(
            attn_mask=inp["mask"], is_causal=self.is_causal, scale=self.scale, enable_gqa=self.gqa
        )
        if self.mask_mod is not None:
            kw["mask_mod"] = self.mask_mod.build(self.ctx)
        if self.score_mod is not None:
            kw["score_mod"] = self.score_mod.build(inp["score_tensors"], self.ctx)
        return kw

    def golden_allowed(self) -> Tensor:
        """The dense bool mask of is_causal, a bool attn_mask and the mask_mod, without qkv.

        Shape:
            ``(B, H, T, S)``, bool.
        """
        B, H, T, S = self.B, self.H, self.T, self.S
        allowed = torch.ones(B, H, T, S, dtype=torch.bool)
        if self.is_causal:
            allowed &= causal_allowed(B, H, T, S)
        if self.mask is not None and self.mask.kind == "bool":
            allowed &= self.mask.make(B, H, T, S, self.torch_dtype).expand(B, H, T, S)
        if self.mask_mod is not None:
            allowed &= self.mask_mod.dense(self.ctx)
        if self.mask is not None and self.mask.kind == "float":
            m = self.mask.make(B, H, T, S, self.torch_dtype).detach()
            allowed &= (m != float("-inf")).expand(B, H, T, S)
        return allowed

    def golden_score_mod(self, tensors64: dict) -> Callable | None:
        if self.score_mod is None:
            return None
        spec = self.score_mod
        return lambda scores: spec.golden(scores, tensors64)


# --- strategies -------------------------------------------------------------------------------

small_len = st.sampled_from([1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 24, 31, 33, 40])


@st.composite
def mask_specs(draw, B: int, H: int, T: int, S: int, dtype: str) -> MaskSpec:
    kind = draw(st.sampled_from(["bool", "float"]))
    shape = draw(
        st.sampled_from(
            ["TS", "1TS", "B11S", "HTS", "BHTS", "TS", "B1TS", "S", "1S", "T1", "scalar"]
        )
    )
    p_keep = draw(st.sampled_from([0.7, 0.3, 1.0, 0.9, 0.0]))
    dead = draw(st.lists(st.integers(0, max(T - 1, 0)), max_size=2, unique=True)) if T else []
    mdtype = "same"
    if kind == "float" and dtype != "float32":
        mdtype = draw(st.sampled_from(["same", "float32"]))
    grad = kind == "float" and draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    padding = draw(st.sampled_from(["", "", "right", "left"]))
    return MaskSpec(kind, shape, p_keep, tuple(dead), mdtype, grad, seed, padding)


@st.composite
def leaf_mods(draw, T: int, S: int) -> ModSpec:
    kinds = ["causal", "window", "document", "key_lengths", "prefix_lm", "fn"]
    which = draw(st.sampled_from(kinds + (["neighborhood"] if T == S > 0 else [])))
    if which == "neighborhood":
        return draw(neighborhoods(T))
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    if which == "causal":
        return Causal(align)
    if which == "window":
        return Window(draw(st.integers(0, 6)), draw(st.integers(0, 3)), align)
    if which == "document":
        return Document(
            draw(st.integers(1, 4)),
            draw(st.booleans()),
            draw(st.booleans()),
            draw(st.booleans()) and T == S,
            draw(st.integers(0, 2**16)),
        )
    if which in ("key_lengths", "prefix_lm"):
        one = st.integers(0, S + 1)
        n = draw(one | st.tuples(one, one, one))
        return KeyLengths(n) if which == "key_lengths" else PrefixLM(n)
    return MaskFn(draw(st.sampled_from(sorted(MASK_FUNCTIONS))))


def _grids(N: int) -> list[tuple]:
    """Grids of N tokens in 1 to 3 dims (every factorisation, dims of 1 included)."""
    two = [(a, N // a) for a in range(1, N + 1) if N % a == 0]
    three = [(a, b, bc // b) for a, bc in two for b in range(1, bc + 1) if bc % b == 0]
    return [(N,), *two, *three]


@st.composite
def neighborhoods(draw, N: int) -> Neighborhood:
    """A neighborhood on a grid of ``N`` tokens: per dim a dilation (1, or 2 where the dim
    holds 2), a kernel from 1 to what the dim holds, causal or not; row-major or tiled."""
    shape = draw(st.sampled_from(_grids(N)))
    dilation = tuple(draw(st.sampled_from([1, 2] if n >= 2 else [1])) for n in shape)
    kernel = tuple(draw(st.integers(1, n // d)) for n, d in zip(shape, dilation))
    causal = tuple(draw(st.integers(0, 3)) == 3 for _ in shape)
    tile = None
    if draw(st.booleans()):
        tile = tuple(draw(st.integers(1, n)) for n in shape)
    return Neighborhood(shape, kernel, dilation, causal, tile)


@st.composite
def mod_specs(draw, T: int, S: int) -> ModSpec:
    first = draw(leaf_mods(T, S))
    if draw(st.integers(0, 3)) < 3:
        return first
    return Combine(draw(st.sampled_from(["and", "or"])), (first, draw(leaf_mods(T, S))))


@st.composite
def score_specs(draw) -> ScoreSpec:
    which = draw(
        st.sampled_from(["alibi", "softcap", "halve", "rel_bias", "chained", "score_mask"])
    )
    if which == "alibi":
        return Alibi(draw(st.booleans()), draw(st.integers(0, 2**16)))
    if which == "softcap":
        return Softcap(draw(st.sampled_from([2.0, 0.5, 20.0])))
    return ScoreFn(which, draw(st.booleans()), draw(st.integers(0, 2**16)))


@st.composite
def cases(draw, *, dtypes=tuple(DTYPES), layouts=LAYOUTS, structured=True, need_mask=False) -> Case:
    """Calls of awkward shapes, layouts, dtypes, masks and score changes.

    ``structured=False`` draws no mask_mod/score_mod (every backend takes the call);
    ``need_mask`` always draws some mask (attn_mask, is_causal or mask_mod).
    """
    dtype = draw(st.sampled_from(list(dtypes)))
    B = draw(st.sampled_from([1, 2, 3, 1, 2, 0]))
    gqa = draw(st.integers(0, 3)) == 3  # (== 3, not == 0: examples shrink towards the plain call)
    if gqa:
        H, G = draw(st.sampled_from([(2, 1), (3, 1), (4, 2), (2, 2), (6, 2), (3, 3)]))
    else:
        H = draw(st.sampled_from([1, 2, 3]))
        G = H
    T = draw(st.just(0) | small_len) if draw(st.integers(0, 15)) == 15 else draw(small_len)
    S = draw(st.just(0) | small_len) if draw(st.integers(0, 15)) == 15 else draw(small_len)
    D = draw(st.sampled_from([4, 1, 3, 8, 16]))
    Dv = D if draw(st.booleans()) else draw(st.sampled_from([1, 5, 8]))
    lay = tuple(draw(st.sampled_from(list(layouts))) for _ in range(3))
    scale = draw(st.sampled_from([None, None, 0.3, 1.0, 0.0, -0.5, 50.0]))
    is_causal = draw(st.integers(0, 3)) == 3
    mask = draw(mask_specs(B, H, T, S, dtype)) if draw(st.booleans()) else None
    mask_mod = score_mod = None
    if structured:
        if draw(st.booleans()):
            mask_mod = draw(mod_specs(T, S))
        if draw(st.integers(0, 2)) == 2:
            score_mod = draw(score_specs())
    if need_mask and mask is None and mask_mod is None and not is_causal:
        mask = draw(mask_specs(B, H, T, S, dtype))
    return Case(
        B,
        H,
        G,
        T,
        S,
        D,
        Dv,
        dtype,
        lay,
        gqa,
        scale,
        is_causal,
        mask,
        mask_mod,
        score_mod,
        draw(st.integers(0, 2**16)),
    )


FLOAT_MASK_SHAPES = ("BHTS", "B1TS", "HTS", "1TS", "TS", "B11S", "S", "1S", "T1", "scalar")


@st.composite
def learned_bias_cases(draw) -> Case:
    """Calls whose float ``attn_mask`` is a learned bias (requires grad) of any broadcast
    shape, with B > 1 and H > 1 most of the time: AlphaFold's pair bias, relative-position
    tables. ``cases()`` draws this corner about once in 250 calls (float, grad, (B, H, T, S),
    B > 1 and H > 1 together), so a full-rank bias gradient summed over every dim went unseen.
    """
    base = draw(cases(structured=True))
    B = draw(st.sampled_from([2, 3, 2, 1]))
    H, G = draw(st.sampled_from([(2, 2), (3, 3), (4, 2), (2, 1), (1, 1)]))
    shape = draw(st.sampled_from(FLOAT_MASK_SHAPES))
    p_keep = draw(st.sampled_from([1.0, 0.8, 0.5]))
    mdtype = "same"
    if base.dtype != "float32":
        mdtype = draw(st.sampled_from(["same", "float32"]))
    mask = MaskSpec("float", shape, p_keep, (), mdtype, True, draw(st.integers(0, 2**16)))
    T = base.T or 1
    S = base.S or 1
    return Case(
        B,
        H,
        G,
        T,
        S,
        base.D,
        base.Dv,
        base.dtype,
        base.layouts,
        G != H,
        base.scale,
        base.is_causal,
        mask,
        base.mask_mod,
        base.score_mod,
        base.seed,
    )


@st.composite
def padded_cases(draw, **kw) -> Case:
    """:func:`cases` made a padded batch: B of 2 to 4, each element's keys one range (key
    lengths per element, or a bool ``(B, 1, 1, S)`` key mask padded right or left), with
    causal, a window or nothing besides, sometimes documents (per element or shared), and
    ALiBi or no score_mod; the rest of the call as drawn. The tiled backend runs each
    element on its own keys there (``batch_pieces``), which :func:`cases` draws a few times
    in a run."""
    base = draw(cases(**kw))
    B = draw(st.sampled_from([2, 3, 4]))
    T, S = base.T or 1, base.S or 1
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    mods: list[ModSpec] = []
    shape = draw(st.sampled_from(["none", "causal", "window"]))
    if shape == "causal":
        mods.append(Causal(align))
    elif shape == "window":
        mods.append(Window(draw(st.integers(0, 6)), draw(st.integers(0, 3)), align))
    mask = None
    if draw(st.booleans()):
        lengths = tuple(draw(st.integers(0, S + 1)) for _ in range(B))
        mods.append(KeyLengths(lengths))
    if draw(st.integers(0, 2)) == 2:  # packed rows: documents per element (or shared)
        n_docs, ordered, per_batch = (
            draw(st.integers(1, 4)),
            draw(st.booleans()),
            draw(st.booleans()),
        )
        mods.append(Document(n_docs, ordered, per_batch, T == S and draw(st.booleans()), base.seed))
    if not mods or draw(st.booleans()):
        padding = draw(st.sampled_from(["right", "left"]))
        mask = MaskSpec("bool", "B11S", 1.0, (), "same", False, base.seed, padding)
    mod = None if not mods else mods[0] if len(mods) == 1 else Combine("and", tuple(mods))
    score = Alibi(draw(st.booleans()), base.seed) if draw(st.booleans()) else None
    is_causal = not mods and draw(st.booleans())
    return replace(
        base, B=B, T=T, S=S, mask=mask, mask_mod=mod, score_mod=score, is_causal=is_causal
    )


@st.composite
def neighborhood_cases(draw, **kw) -> Case:
    """:func:`cases` made self-attention over a token grid (T = S = N, from the sizes the
    suite draws, 1 to 40) with a neighborhood as mask_mod, alone or combined with another
    leaf mask; the rest of the call (dtype, layouts, is_causal, score_mod, GQA, scale) as
    drawn. No dense attn_mask: its dead rows were drawn for another T."""
    base = draw(cases(**kw))
    N = draw(small_len)
    mod: ModSpec = draw(neighborhoods(N))
    if draw(st.integers(0, 3)) == 3:
        mod = Combine(draw(st.sampled_from(["and", "or"])), (mod, draw(leaf_mods(N, N))))
    return replace(base, T=N, S=N, mask=None, mask_mod=mod)


# --- sinks and selections at their edges (issue 41) --------------------------------------------

# Sink logits the way a hostile caller gives them: -inf (a head that never uses its sink),
# large negative (underflows against any score), 0, large positive (takes the whole row).
SINK_VALUES = (float("-inf"), -1e4, -30.0, 0.0, 30.0, 1e4)
_ROW_SHAPES = ("TS", "1TS", "HTS", "BHTS", "B1TS", "T1")  # mask shapes with a T dim


@st.composite
def cases_with_empty_rows(draw, **kw) -> Case:
    """:func:`cases` whose bool/float attn_mask leaves some query rows with no key at all
    (and, unless every row is drawn, others with keys): a mask of a shape with a T dim."""
    base = draw(cases(**kw))
    T = max(base.T, 1)
    dead = draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=3, unique=True))
    old = base.mask or MaskSpec()
    shape = draw(st.sampled_from(_ROW_SHAPES))
    mask = MaskSpec(
        old.kind,
        shape,
        draw(st.sampled_from([1.0, 0.7])),
        tuple(dead),
        old.dtype,
        old.grad,
        old.seed,
    )
    return replace(base, T=T, mask=mask)


@dataclass(frozen=True)
class Selection:
    """A sparse selection as transformers' indexers pass it: ``indices`` ``(B, T, k)`` key
    positions (``block_size`` 0) or ``block_indices`` ``(B, H_idx, T, k)`` block positions
    of blocks of ``block_size`` keys; -1 an empty slot; ``values`` may leave ``[-1, n)``."""

    B: int
    H: int
    H_idx: int
    T: int
    S: int
    block_size: int
    values: tuple

    @property
    def n(self) -> int:
        """Key positions, or blocks: ``ceil(S / block_size)``."""
        return self.S if not self.block_size else -(-self.S // self.block_size)

    def tensor(self) -> Tensor:
        shape = (self.B, self.T, -1) if not self.block_size else (self.B, self.H_idx, self.T, -1)
        return torch.tensor(self.values, dtype=torch.int32).view(shape)

    def bad(self) -> list[int]:
        return [x for x in self.values if x < -1 or x >= self.n]

    def kept(self) -> Tensor:
        """The keys each (b, h, t) keeps, by plain loops.

        Shape:
            ``(B, H, T, S)`` bool (indices: ``(B, 1, T, S)``).
        """
        sel = self.tensor()
        if not self.block_size:
            out = torch.zeros(self.B, 1, self.T, self.S, dtype=torch.bool)
            for b in range(self.B):
                for t in range(self.T):
                    for j in sel[b, t].tolist():
                        if j >= 0:
                            out[b, 0, t, j] = True
            return out
        out = torch.zeros(self.B, self.H, self.T, self.S, dtype=torch.bool)
        per = self.H // self.H_idx
        for b in range(self.B):
            for h in range(self.H):
                for t in range(self.T):
                    for blk in sel[b, h // per, t].tolist():
                        if blk >= 0:
                            lo = blk * self.block_size
                            out[b, h, t, lo : min(lo + self.block_size, self.S)] = True
        return out


@st.composite
def selections(draw) -> Selection:
    """Selections of awkward sizes, mostly in range, often with one position out of it
    (just past either end, or far)."""
    B, T, S = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    k = draw(st.integers(1, 3))
    size = draw(st.sampled_from([0, 0, 1, 2, 4, 5]))
    H_idx, per = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    n = S if not size else -(-S // size)
    count = B * T * k * (1 if not size else H_idx)
    values = draw(st.lists(st.integers(-1, n - 1), min_size=count, max_size=count))
    if draw(st.booleans()):
        bad = draw(st.sampled_from([n, n + 1, -2, -100, 10 * n + 7]))
        values[draw(st.integers(0, count - 1))] = bad
    return Selection(B, H_idx * per, H_idx, T, S, size, tuple(values))


# --- in-place writes into the Hugging Face mask tensor (issue 41) ----------------------------

MASK_WRITES = ("setitem-min", "setitem-zero", "masked_fill_", "zero_", "fill_", "add_", "view")


@dataclass(frozen=True)
class MaskWrites:
    """A transformers mask ``(B, 1, T, T)`` (causal, or a sliding window of ``window``; batch
    element ``b`` left-padded by ``pads[b]``) and in-place writes into it, in order: ``(kind,
    row, col)`` (``row``/``col`` -1: all)."""

    B: int
    T: int
    window: int
    pads: tuple
    writes: tuple

    def build_args(self) -> dict:
        from transformers import masking_utils as mu

        pad = torch.ones(self.B, self.T, dtype=torch.bool)
        for b, n in enumerate(self.pads):
            pad[b, :n] = False
        fn = mu.causal_mask_function
        if self.window:
            fn = mu.and_masks(fn, mu.sliding_window_overlay(self.window))
        return dict(
            batch_size=self.B,
            q_length=self.T,
            kv_length=self.T,
            q_offset=0,
            kv_offset=0,
            mask_function=fn,
            attention_mask=pad,
            dtype=torch.float32,
            device="cpu",
        )

    def apply(self, m: Tensor) -> None:
        """The writes, on a mask ``m`` that is transformers' eager tensor or qkv's."""
        low = torch.finfo(m.dtype).min
        for kind, row, col in self.writes:
            r = slice(None) if row < 0 else row
            c = slice(None) if col < 0 else col
            if kind == "setitem-min":
                m[:, :, r, c] = low
            elif kind == "setitem-zero":
                m[:, :, r, c] = 0.0
            elif kind == "masked_fill_":
                m.masked_fill_(torch.arange(self.T) == max(col, 0), low)
            elif kind == "zero_":
                m.zero_()
            elif kind == "fill_":
                m.fill_(low)
            elif kind == "add_":
                m.add_(0.5)
            elif kind == "view":  # through a view of the values
                m[0, 0, r].fill_(0.0)


@st.composite
def mask_writes(draw) -> MaskWrites:
    B, T = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    pads = tuple(draw(st.integers(0, T - 1)) for _ in range(B))
    n = draw(st.integers(1, 3))
    spot = st.integers(-1, T - 1)
    writes = tuple((draw(st.sampled_from(MASK_WRITES)), draw(spot), draw(spot)) for _ in range(n))
    return MaskWrites(B, T, draw(st.sampled_from([0, 2])), pads, writes)
