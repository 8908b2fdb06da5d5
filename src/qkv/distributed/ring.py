"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each of the R ranks holds the queries, keys and values of some positions (a *shard*, see
``layout.py``). The output of a query needs every key, so the key/value shards travel: at
step t = 1 .. R-1, rank r sends its own shard to rank ``r + t`` and receives the shard of rank
``r - t`` (mod R), while it computes on the shard that arrived at the step before. Each shard it
computes on gives a partial output normalised over those keys and their log-sum-exp; partials
merge by log-sum-exp, exactly as the tiled backend's chunks do (``ops/tiled/``), so the
result is the single-process one up to summation order.

Skipping: the mask is known on every rank, so before any message every rank works out, from
the bounds of the mask (``MaskMod.blocks`` on one block of queries against one-key blocks),
which keys of rank s the queries of rank r may attend at all. Rank s sends r only that span
of its keys and values, and nothing when it is empty: with a sliding window of W and shards
longer than W, a rank sends W keys to its next neighbour and nothing else, O(W), not O(T).
Inside a pair the tiled backend skips blocks as usual. For a plain-function mask_mod nothing
is known without evaluating it, so whole shards are sent.

Backward (a custom autograd.Function): a second pass of the ring from the saved output and
log-sum-exp, FlashAttention's decomposition: rank r receives the shard of ``r - t`` again,
computes the gradient of its queries and that shard's keys and values, and sends the key and
value gradients (float32) back to their owner.

Shape alphabet: B batch, H query heads, G key/value heads, T query length and S key length of
the whole sequence, T_r / S_r of this rank's shard, D head dim, Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import lazy_trace
from ..masks import (
    EMPTY,
    Grid,
    MaskMod,
    ScoreMod,
    _blocks_take_offsets,
    and_masks,
    as_mask_mod,
    as_score_mod,
    block_states,
    causal,
    offset_mask,
    offset_score,
    score_mod_gradient_inputs,
)
from ..ops import AttentionCall
from ..ops.base import refuse_second_derivative
from ..ops.call import _check_scale
from ..ops.tiled import merge_by_lse, piece_backward, piece_forward
from ..trace import AttentionTrace
from . import comm
from .layout import Segment, assemble, check_layout, group_info, segments_from_lengths

__all__ = ["ring_attention"]


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group=None,
    is_causal: bool = False,
    mask_mod=None,
    score_mod=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    layout: str = "contiguous",
    return_trace: bool = False,
    timeout: float | None = None,
) -> Tensor | tuple[Tensor, AttentionTrace]:
    """Exact attention of a sequence sharded over the ranks of ``group`` (context parallel).

    Every rank calls it with its own shard of queries, keys and values (same B, heads, head
    dims and dtype on all ranks); it returns this rank's shard of the output, equal to the
    matching rows of ``qkv.scaled_dot_product_attention`` on the whole sequence (by the
    tolerance policy), forward and backward. ``is_causal``, ``mask_mod`` and ``score_mod``
    speak of positions in the *whole* sequence, as in a single-process call (document ids are
    given for the whole sequence, ``(B, T)``, on every rank).

    * **Shards**: ``layout="contiguous"``: rank r holds one run of positions, in rank order,
      of any lengths (T need not divide by R; a rank may hold none). ``"balanced"``: the
      layout of :func:`qkv.distributed.shard` with ``layout="balanced"`` (chunks r and
      2R-1-r of 2R), which evens out a causal mask's work over the ranks.
    * **Skipping**: a rank receives only the span of another rank's keys and values that its
      queries may attend, and nothing when the mask leaves none (sliding windows, documents,
      causal): a window of W costs W keys per rank; see :func:`comm_log`.
    * **Mask contract** as everywhere in qkv: a query that may attend to nothing outputs 0.
    * **Trace**: ``return_trace=True`` gathers the keys (not the values) from every rank and
      returns an :class:`AttentionTrace` of this rank's query rows against the whole key
      sequence, its weights recomputed lazily from the log-sum-exp (``trace.select`` for a
      few rows). Every rank must pass the same ``return_trace``.
    * Every rank must make the call (and, when gradients flow, the backward) with the same
      arguments, as with any collective. ``timeout`` (seconds) bounds every wait: a rank
      that died makes the others raise :class:`qkv.distributed.PeerError` instead of hanging.

    Not here: dense ``attn_mask`` (give a ``mask_mod``), dropout, NaN/inf in the inputs
    (refused with a ValueError on every rank).

    Backends: gloo with CPU tensors, NCCL with CUDA tensors. Each rank computes its pairs
    with the tiled backend's kernels.

    Args:
        query, key, value: This rank's shards.
        group: The process group (None: the default one).
        is_causal: Top-left causal over the whole sequence.
        mask_mod, score_mod: As in :func:`qkv.scaled_dot_product_attention`, over positions of
            the whole sequence.
        scale: Factor on the scores; None means ``1 / sqrt(D)``.
        enable_gqa: G key/value heads shared by H / G query heads each.
        layout: ``"contiguous"`` or ``"balanced"``.
        return_trace: Also return the trace of this rank's rows.
        timeout: Seconds any one wait may take; None uses the process group's timeout.

    Returns:
        This rank's output shard, or ``(output, trace)``.

    Shape:
        query ``(B, H, T_r, D)``, key ``(B, G, S_r, D)``, value ``(B, G, S_r, Dv)`` ->
        ``(B, H, T_r, Dv)``.

    Example:
        >>> from qkv.distributed import ring_attention, shard, unshard
        >>> q, k, v = (shard(t, layout="balanced") for t in (q, k, v))   # (B, H, T_r, D)
        >>> out = ring_attention(q, k, v, is_causal=True, layout="balanced")
        >>> full = unshard(out, layout="balanced")                          # (B, H, T, Dv)
    """
    from ..functional import _amp_cast, _autocast_dtype

    amp = _autocast_dtype(query)
    if amp is not None:  # as qkv.scaled_dot_product_attention: attention in the autocast dtype
        query, key, value = (_amp_cast(t, amp) for t in (query, key, value))
        with torch.autocast(query.device.type, enabled=False):
            return ring_attention(
                query,
                key,
                value,
                group=group,
                is_causal=is_causal,
                mask_mod=mask_mod,
                score_mod=score_mod,
                scale=scale,
                enable_gqa=enable_gqa,
                layout=layout,
                return_trace=return_trace,
                timeout=timeout,
            )
    ring = _Ring.build(
        query,
        key,
        value,
        group,
        bool(is_causal),
        mask_mod,
        score_mod,
        scale,
        bool(enable_gqa),
        check_layout(layout),
        timeout,
    )
    grads: tuple[Tensor, ...] = ()
    if ring.score is not None:  # tensors a score_mod reads that want gradients
        grads = score_mod_gradient_inputs(ring.score, dtype=_acc(query.dtype), device=query.device)
    out, lse = _RingAttention.apply(ring, query, key, value, *grads)
    if not return_trace:
        return out
    with torch.no_grad():
        return out, ring.trace(query, key, lse)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Piece:
    """Queries ``q_rows`` of this rank against keys ``kv_rows`` of a message (or of its own
    shard), at whole-sequence positions ``q_start`` and ``kv_start``."""

    q_rows: slice
    kv_rows: slice
    q_start: int
    kv_start: int


@dataclass
class _Link:
    """What rank s sends rank r: the rows ``rows`` (``[lo, hi)`` of s's local keys and
    values, in message order) that r's queries may attend, and r's pieces on them. A rank's
    link to itself is its whole shard."""

    rows: list[tuple[int, int]]
    pieces: list[_Piece]

    @property
    def length(self) -> int:
        return sum(hi - lo for lo, hi in self.rows)

    def message(self, mine: Tensor) -> Tensor:
        """These rows of ``mine`` as one tensor (``mine`` itself when it is all of it)."""
        if len(self.rows) == 1 and self.rows[0] == (0, mine.shape[2]):
            return mine
        return torch.cat([mine[:, :, lo:hi] for lo, hi in self.rows], dim=2)

    def add_into(self, total: Tensor, grads: Tensor) -> None:
        """Add a message-shaped gradient ``grads`` into ``total`` at these rows."""
        at = 0
        for lo, hi in self.rows:
            total[:, :, lo:hi] += grads[:, :, at : at + hi - lo]
            at += hi - lo


@dataclass
class _Ring:
    """One call's plan: sizes, masks bound to the whole sequence, the shards of every rank and
    which pairs of shards the mask leaves empty."""

    group: object
    rank: int
    R: int
    B: int
    H: int
    G: int
    D: int
    Dv: int
    dtype: torch.dtype
    scale: float
    gqa: bool
    mask: MaskMod | None
    score: ScoreMod | None
    q_segs: list[list[Segment]]  # per rank: runs of query positions
    kv_segs: list[list[Segment]]  # per rank: runs of key positions
    links: list[list[_Link | None]]  # [r][s]: what s sends r (None: nothing, the mask is empty)
    timeout: float | None

    @classmethod
    def build(cls, q, k, v, group, is_causal, mask_mod, score_mod, scale, gqa, layout, timeout):
        rank, R = group_info(group)
        _check_local(q, k, v, gqa)
        B, H, T_r, D = q.shape
        G, S_r, Dv = k.shape[1], k.shape[2], v.shape[3]
        bad = (
            not all(bool(torch.isfinite(t).all()) for t in (q, k, v))
            if q.device.type != "meta"
            else False
        )
        mine = torch.tensor(
            [T_r, S_r, B, H, G, D, Dv, _DTYPES.index(q.dtype), int(bad)],
            dtype=torch.int64,
            device=q.device,
        )
        every = [torch.empty_like(mine) for _ in range(R)]
        comm.wait(
            lambda: torch.distributed.all_gather(every, mine, group=group, async_op=True),
            timeout,
            "ring_attention's exchange of shard sizes",
        )
        info = torch.stack(every).cpu().tolist()  # (R, 9)
        _check_agree(info, rank)
        T, S = sum(i[0] for i in info), sum(i[1] for i in info)
        q_segs = segments_from_lengths([i[0] for i in info], layout, "query")
        kv_segs = segments_from_lengths([i[1] for i in info], layout, "key")
        mods = [as_mask_mod(mask_mod)] if mask_mod is not None else []
        if is_causal:
            mods.append(causal())
        mask = None if not mods else (mods[0] if len(mods) == 1 else and_masks(*mods))
        mask = None if mask is None else mask.bind(B, H, T, S)
        score = None if score_mod is None else as_score_mod(score_mod).bind(B, H, T, S)
        scale = _check_scale(scale, D)
        links = [
            [_link(q_segs[r], kv_segs[s], mask, B, H, whole=r == s) for s in range(R)]
            for r in range(R)
        ]
        return cls(
            group,
            rank,
            R,
            B,
            H,
            G,
            D,
            Dv,
            q.dtype,
            scale,
            gqa,
            mask,
            score,
            q_segs,
            kv_segs,
            links,
            timeout,
        )

    def needs(self, r: int, s: int) -> bool:
        """Whether rank r computes on (so receives) keys of rank s."""
        return self.links[r][s] is not None

    def link(self, r: int, s: int) -> _Link:
        """What rank s sends rank r, where r needs it (:meth:`needs`)."""
        link = self.links[r][s]
        assert link is not None, f"rank {r} needs nothing of rank {s}"
        return link

    def call(self, q: Tensor, k: Tensor, v: Tensor, piece: _Piece) -> AttentionCall:
        """The attention call of one piece, its masks moved to the piece's positions."""
        mask = None if self.mask is None else offset_mask(self.mask, piece.q_start, piece.kv_start)
        score = (
            None if self.score is None else offset_score(self.score, piece.q_start, piece.kv_start)
        )
        return AttentionCall.build(
            q[:, :, piece.q_rows],
            k[:, :, piece.kv_rows],
            v[:, :, piece.kv_rows],
            scale=self.scale,
            enable_gqa=self.gqa,
            mask_mod=_Fixed(mask) if mask else None,
            score_mod=_FixedScore(score) if score else None,
        )

    # --- messages -------------------------------------------------------------------------
    def post(
        self, step: int, mine: tuple[Tensor, Tensor], phase: str, tag: int
    ) -> tuple[comm.Pending, tuple[Tensor, Tensor] | None]:
        """Step ``step`` of the ring: send ``mine`` (this rank's keys and values) to rank
        ``rank + step`` if it needs them, receive rank ``rank - step``'s if this rank does."""
        dst, src = (self.rank + step) % self.R, (self.rank - step) % self.R
        out_link, in_link = self.links[dst][self.rank], self.links[self.rank][src]
        sends = [] if out_link is None else [(out_link.message(t), dst) for t in mine]
        buf = None
        if in_link is not None:
            k, v = mine
            buf = (
                k.new_empty(self.kv_shape(in_link.length, k.shape[-1])),
                v.new_empty(self.kv_shape(in_link.length, v.shape[-1])),
            )
        recvs = [] if buf is None else [(t, src) for t in buf]
        return comm.exchange(
            self.group, sends, recvs, tag=tag, phase=phase, step=step, timeout=self.timeout
        ), buf

    def kv_shape(self, length: int, width: int | None = None) -> tuple[int, ...]:
        return (self.B, self.G, length, self.D + self.Dv if width is None else width)

    # --- forward ----------------------------------------------------------------------------
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's output (accumulation dtype) and log-sum-exp."""
        acc = _acc(q.dtype)
        out = torch.zeros(q.shape[:3] + (self.Dv,), dtype=acc, device=q.device)  # (B, H, T_r, Dv)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)  # (B, H, T_r)
        mine = (k.contiguous(), v.contiguous())  # messages need contiguous tensors

        def absorb(kv: tuple[Tensor, Tensor], s: int) -> None:
            kk, vv = kv
            for piece in self.link(self.rank, s).pieces:
                o, o_lse = piece_forward(self.call(q, kk, vv, piece))  # (B, H, n, Dv), (B, H, n)
                rows = piece.q_rows
                out[:, :, rows], lse[:, :, rows] = merge_by_lse(
                    out[:, :, rows], lse[:, :, rows], o, o_lse
                )

        self.ring_pass(mine, absorb, "forward")
        return out, lse

    def ring_pass(self, mine: tuple[Tensor, Tensor], visit, phase: str, after=None) -> None:
        """Visit this rank's own shard, then each step's arriving shard, the next step's
        messages in flight meanwhile. ``after(step, src)`` runs after a step's visit."""
        pending = self.post(1, mine, phase, tag=1) if self.R > 1 else None
        if self.needs(self.rank, self.rank):
            visit(mine, self.rank)
        for step in range(1, self.R):
            assert pending is not None  # posted for every step < R
            work, buf = pending
            work.wait()
            pending = self.post(step + 1, mine, phase, tag=step + 1) if step + 1 < self.R else None
            src = (self.rank - step) % self.R
            if buf is not None:
                visit(buf, src)
            if after is not None:
                after(step, src)

    # --- backward ---------------------------------------------------------------------------
    def backward(self, q, k, v, out, lse, dout, n_score: int):
        """Gradients of this rank's queries, keys and values (and the score_mod's tensors)."""
        acc = _acc(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        d_mine = torch.zeros(self.kv_shape(k.shape[2]), dtype=acc, device=q.device)
        dts: list[Tensor] = []
        mine = (k.contiguous(), v.contiguous())
        grads_out: dict[int, Tensor] = {}  # src -> key/value gradients of src's shard, to send

        def visit(kv: tuple[Tensor, Tensor], s: int) -> None:
            kk, vv = kv
            d_kv = (
                d_mine
                if s == self.rank
                else torch.zeros(self.kv_shape(kk.shape[2]), dtype=acc, device=q.device)
            )  # dk and dv, one message
            for piece in self.link(self.rank, s).pieces:
                rows = piece.q_rows
                g_q, g_k, g_v, g_t = piece_backward(
                    self.call(q, kk, vv, piece), out[:, :, rows], lse[:, :, rows], dout[:, :, rows]
                )
                dq[:, :, rows] += g_q
                d_kv[:, :, piece.kv_rows, : self.D] += g_k
                d_kv[:, :, piece.kv_rows, self.D :] += g_v
                for i, g in enumerate(g_t):
                    if i < len(dts):
                        dts[i] += g
                    else:
                        dts.append(g.clone())
            if s != self.rank:
                grads_out[s] = d_kv

        # each step's exchange, and the link and buffer of the gradients it receives (if any)
        in_flight: list[tuple[comm.Pending, tuple[_Link, Tensor] | None]] = []

        def settle() -> None:
            for work, back in in_flight:
                work.wait()
                if back is not None:
                    link, buf = back
                    link.add_into(d_mine, buf)
            in_flight.clear()

        def send_grads(step: int, src: int) -> None:
            settle()  # at most one step of gradients in flight
            dst = (self.rank + step) % self.R
            sends = [(grads_out.pop(src), src)] if src in grads_out else []
            link = self.links[dst][self.rank]  # what this rank sent dst: its gradients come back
            back = None if link is None else (link, d_mine.new_empty(self.kv_shape(link.length)))
            recvs = [(back[1], dst)] if back is not None else []
            work = comm.exchange(
                self.group,
                sends,
                recvs,
                tag=self.R + step,
                phase="gradients",
                step=step,
                timeout=self.timeout,
            )
            in_flight.append((work, back))

        self.ring_pass(mine, visit, "backward", after=send_grads)
        settle()
        dk, dv = d_mine[..., : self.D], d_mine[..., self.D :]
        d_score: list[Tensor | None] = list(dts)
        if len(dts) < n_score:  # a score_mod tensor no piece of this rank read
            d_score += [None] * (n_score - len(dts))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_score

    # --- trace --------------------------------------------------------------------------------
    def trace(self, q: Tensor, k: Tensor, lse: Tensor) -> AttentionTrace:
        """This rank's rows against every key: the keys gathered, the weights lazily from lse."""
        keys = self.gather_keys(k)  # (B, G, S, D)
        rows = torch.cat(
            [torch.arange(a, b, device="cpu") for a, b in self.q_segs[self.rank]]
            or [torch.zeros(0, dtype=torch.long, device="cpu")]
        )  # (T_r,) positions
        value = keys.new_zeros(()).expand(
            self.B, self.G, keys.shape[2], self.Dv
        )  # no values needed
        call = AttentionCall.build(
            q.detach(),
            keys,
            value,
            scale=self.scale,
            enable_gqa=self.gqa,
            return_trace=True,
            mask_mod=None if self.mask is None else _AtRows(self.mask, rows),
            score_mod=None if self.score is None else _AtRowsScore(self.score, rows),
        )
        return lazy_trace.trace_from_lse(call, lse, "ring")

    def gather_keys(self, k: Tensor) -> Tensor:
        """Every rank's keys in position order (an all-gather, shards padded to the longest)."""
        lengths = [sum(b - a for a, b in segs) for segs in self.kv_segs]
        longest = max(lengths)
        padded = torch.zeros(self.B, self.G, longest, self.D, dtype=k.dtype, device=k.device)
        padded[:, :, : k.shape[2]] = k.detach()
        parts = [torch.empty_like(padded) for _ in range(self.R)]
        comm.wait(
            lambda: torch.distributed.all_gather(parts, padded, group=self.group, async_op=True),
            self.timeout,
            "ring_attention's gathering of keys for the trace",
        )
        return assemble(parts, self.kv_segs, dim=2)


class _RingAttention(torch.autograd.Function):
    """Forward: the ring pass; backward: a second ring pass from the saved output and lse."""

    @staticmethod
    def forward(ctx, ring: _Ring, q: Tensor, k: Tensor, v: Tensor, *score_tensors: Tensor):
        out_acc, lse = ring.forward(q, k, v)
        out = out_acc.to(q.dtype)
        ctx.ring, ctx.n_score = ring, len(score_tensors)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse):
        refuse_second_derivative(
            "ring_attention",
            "its passes build no graph; take it on one process (qkv's tiled"
            " or reference backend has one)",
        )
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dts = ctx.ring.backward(q, k, v, out, lse, dout.contiguous(), ctx.n_score)
        return (None, dq, dk, dv, *dts)


def _link(
    q_segs: list[Segment], kv_segs: list[Segment], mask, B: int, H: int, *, whole: bool
) -> _Link | None:
    """What a rank with keys ``kv_segs`` sends one with queries ``q_segs``: for each run of
    keys, the span of keys some query may attend (all of it, ``whole``, for a rank's own
    shard), and the pieces (query run x key span) the mask does not leave empty. None when
    every piece is empty."""
    spans = []  # (q run, its local offset, key run index, [lo, hi) positions it may attend)
    q_at = 0
    for qa, qb in q_segs:
        for j, (ka, kb) in enumerate(kv_segs):
            if qb > qa and kb > ka:
                keys = _keys_attended(mask, qa, qb, ka, kb, B, H)
                if keys is not None:
                    spans.append(((qa, qb), q_at, j, keys))
        q_at += qb - qa
    if not spans:
        return None
    starts = [sum(b - a for a, b in kv_segs[:j]) for j in range(len(kv_segs))]  # local offsets
    if whole:
        hull = {j: seg for j, seg in enumerate(kv_segs)}
    else:  # per key run, the hull of the spans its pieces need
        hull = {}
        for _, _, j, (lo, hi) in spans:
            old = hull.get(j, (lo, hi))
            hull[j] = (min(old[0], lo), max(old[1], hi))
    rows, message_at, at = [], {}, 0
    for j in sorted(hull):
        lo, hi = hull[j]
        ka = kv_segs[j][0]
        rows.append((starts[j] + lo - ka, starts[j] + hi - ka))  # local rows of the sender
        message_at[j] = at - lo  # message row of position p: message_at[j] + p
        at += hi - lo
    pieces = [
        _Piece(slice(q_at, q_at + qb - qa), slice(message_at[j] + lo, message_at[j] + hi), qa, lo)
        for (qa, qb), q_at, j, (lo, hi) in spans
    ]
    return _Link(rows, pieces)


def _keys_attended(
    mask, qa: int, qb: int, ka: int, kb: int, B: int, H: int
) -> tuple[int, int] | None:
    """The span ``[lo, hi)`` of keys in ``[ka, kb)`` that some query in ``[qa, qb)`` may
    attend, from the bounds of qkv's own masks (one query block, one-key blocks); None when
    there is none. The whole run for any other mask (nothing is known without evaluating)."""
    if mask is None or not _blocks_take_offsets(mask):
        return ka, kb
    grid = Grid(B, H, qb - qa, kb - ka, qb - qa, 1, torch.device("cpu"), qa, ka)
    state = block_states(mask, grid)  # (B?, H?, 1, kb - ka)
    live = (state != EMPTY).flatten(0, 2).any(0).nonzero().flatten()  # keys some query may see
    if live.numel() == 0:
        return None
    return ka + int(live[0]), ka + int(live[-1]) + 1


class _Fixed(MaskMod):
    """A mask already bound to the whole sequence: binding it to a piece's sizes keeps it."""

    def __init__(self, inner: MaskMod) -> None:
        self.inner = inner

    def bind(self, B, H, T, S):
        return self

    def __call__(self, b, h, q_idx, kv_idx):
        return self.inner(b, h, q_idx, kv_idx)

    def tensors(self):
        return self.inner.tensors()

    def blocks(self, grid):
        return self.inner.blocks(grid)

    def __repr__(self):
        return repr(self.inner)


class _FixedScore(ScoreMod):
    def __init__(self, inner: ScoreMod) -> None:
        self.inner, self.additive = inner, inner.additive

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.inner(score, b, h, q_idx, kv_idx)

    def tensors(self):
        return self.inner.tensors()

    def __repr__(self):
        return repr(self.inner)


class _AtRows(MaskMod):
    """A bound mask for query rows at the given positions (a rank's shard in the trace)."""

    def __init__(self, inner: MaskMod, rows: Tensor) -> None:
        self.inner, self.rows = inner, rows

    def bind(self, B, H, T, S):
        return self

    def __call__(self, b, h, q_idx, kv_idx):
        return self.inner(b, h, self.rows.to(q_idx.device)[q_idx], kv_idx)

    def tensors(self):
        return self.inner.tensors()


class _AtRowsScore(ScoreMod):
    def __init__(self, inner: ScoreMod, rows: Tensor) -> None:
        self.inner, self.rows, self.additive = inner, rows, inner.additive

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.inner(score, b, h, self.rows.to(q_idx.device)[q_idx], kv_idx)

    def tensors(self):
        return self.inner.tensors()


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_local(q, k, v, gqa: bool) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"ring_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"ring_attention: {name} must be 4-D (B, heads, L, dim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"ring_attention: {name} must be float16/bfloat16/float32/float64, got {t.dtype}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"ring_attention: query, key and value must share a dtype, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"ring_attention: query, key and value must be on one device, got "
            f"{q.device}, {k.device}, {v.device}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"ring_attention: shapes do not fit: query {tuple(q.shape)}, key {tuple(k.shape)}, "
            f"value {tuple(v.shape)}; want (B, H, T_r, D), (B, G, S_r, D), (B, G, S_r, Dv)"
        )
    H, G = q.shape[1], k.shape[1]
    if (H != G and not gqa) or (gqa and H % G):
        raise ValueError(
            f"ring_attention: {H} query heads and {G} key/value heads; "
            + (
                "pass enable_gqa=True to share them"
                if not gqa or H % G == 0
                else "H must be a multiple of G"
            )
        )


_INFO = ("query length", "key length", "B", "H", "G", "D", "Dv", "dtype")


def _check_agree(info: list[list[int]], rank: int) -> None:
    """Every rank sees every rank's sizes, so all raise the same error together."""
    for j, name in enumerate(_INFO[2:], start=2):
        values = [i[j] for i in info]
        if len(set(values)) > 1:
            shown = [_DTYPES[x] for x in values] if name == "dtype" else values
            raise ValueError(
                f"ring_attention: the ranks disagree on {name}: {shown} (rank by "
                f"rank); every rank must pass shards of one shape and dtype"
            )
    bad = [r for r, i in enumerate(info) if i[8]]
    if bad:
        raise ValueError(
            f"ring_attention: ranks {bad} hold NaN or inf in their query, key or value shards; "
            f"ring attention needs finite inputs (qkv.scaled_dot_product_attention handles "
            f"them on one process)"
        )
