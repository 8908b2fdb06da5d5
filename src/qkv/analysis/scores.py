"""Head scores: the head taxonomies of interpretability notebooks, as one table.

For each recorded (layer, head) of a capture, with ``p[q, k]`` its weights at query position
``q`` (means over the kept batch elements and the query rows each score uses):

==================  =====================================  ==================================
score               per query row                           rows used
==================  =====================================  ==================================
``previous_token``  ``p[q, q - 1]``                          ``q >= 1``
``self``            ``p[q, q]``                              all
``first_token``     ``p[q, 0]`` (the attention sink)         ``q >= 1`` (row 0 has only key 0)
``local``           ``sum p[q, k]`` over ``|k - q| <= w``    all
``entropy``         ``-sum p log p`` (nats)                  all
``induction``       ``p[q, q - period + 1]``: the token     ``q`` in a repeat after the first
                    after this token's last occurrence      (needs ``induction=``)
==================  =====================================  ==================================

The induction score is TransformerLens's: measured on a random sequence repeated
(:func:`induction_input`), an induction head at a token of the second copy attends to the
token that followed the same token in the first copy.

Rows that are padding (``key_mask``) or attend to nothing are left out of every score. On a
bounded capture (``rows=``, ``heads=``, ``batch=``) the scores use the rows and heads kept,
and :meth:`HeadScores.rows_used` says which rows each score of each layer used; a score with
no row is NaN.

Shape alphabet: B batch, H heads, T query length, S key length; nb, nh, nr kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..capture import Captured

__all__ = ["HeadScores", "InductionInput", "head_scores", "induction_input"]

SCORES = ("previous_token", "self", "first_token", "local", "entropy", "induction")


@dataclass(frozen=True)
class InductionInput:
    """A random sequence repeated: what the induction score is measured on.

    Attributes:
        tokens: ``(B, T)`` int64; ``tokens[:, start:start + period]`` repeated ``repeats``
            times, after an optional first token (``bos``).
        period: Length of the repeated sequence.
        start: Position of the first repeat (1 with a ``bos``, else 0).
        repeats: How many copies.
    """

    tokens: Tensor
    period: int
    start: int
    repeats: int


def induction_input(
    vocab_size: int,
    period: int,
    *,
    batch: int = 1,
    repeats: int = 2,
    bos: int | None = None,
    seed: int = 0,
    device=None,
) -> InductionInput:
    """A random token sequence of length ``period``, repeated ``repeats`` times.

    Tokens are drawn without repetition inside a period when the vocabulary allows (so each
    token of a later copy has exactly one earlier occurrence per copy), uniformly from
    ``0..vocab_size-1`` without ``bos``.

    Args:
        vocab_size: The model's vocabulary size.
        period: Length of the random sequence.
        batch: Number of sequences (each its own draw).
        repeats: Copies, at least 2.
        bos: A token to put first (e.g. a BOS/CLS id), or None.
        seed: Seed of the draw (the global RNG is left alone).

    Shape:
        ``tokens`` ``(batch, [1 +] repeats * period)``.

    Example:
        >>> ind = qkv.analysis.induction_input(100, 16, batch=4)
        >>> with qkv.capture(model) as cap:
        ...     model(ind.tokens)
        >>> qkv.analysis.head_scores(cap, induction=ind).sorted_by("induction")
    """
    for name, n, low in (
        ("vocab_size", vocab_size, 2),
        ("period", period, 2),
        ("batch", batch, 1),
        ("repeats", repeats, 2),
    ):
        if isinstance(n, bool) or not isinstance(n, int) or n < low:
            raise ValueError(f"{name} must be an int >= {low}, got {n!r}")
    if bos is not None and not 0 <= bos < vocab_size:
        raise ValueError(f"bos must be a token id in 0..{vocab_size - 1}, got {bos!r}")
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([t for t in range(vocab_size) if t != bos])  # (V',)
    if period <= len(pool):
        idx = torch.stack([torch.randperm(len(pool), generator=g)[:period] for _ in range(batch)])
    else:
        idx = torch.randint(len(pool), (batch, period), generator=g)  # (batch, period)
    tokens = pool[idx].repeat(1, repeats)  # (batch, repeats * period)
    if bos is not None:
        tokens = torch.cat([torch.full((batch, 1), bos), tokens], 1)  # (batch, 1 + ...)
    return InductionInput(tokens.to(device), period, int(bos is not None), repeats)


@dataclass(frozen=True, repr=False)
class HeadScores:
    """Scores of each recorded (layer, head): a small table.

    Attributes:
        names: The scores (columns), in order.
        keys: ``(layer, head)`` of each row of the table.
        sites: The site (module name) of each row.
        values: ``values[n, k]``: score ``names[k]`` of head ``keys[n]``, float64; NaN where
            the score used no row (or ``induction`` without ``induction=``).
        rows: ``(layer, score) -> `` the query rows that score used in that layer (int64).
        skipped: ``layer -> `` why that layer was left out (a call with S != T).
        window: The ``local`` score's half width.

    Shape:
        values ``(N, K)``: N heads, K scores.
    """

    names: tuple[str, ...]
    keys: tuple[tuple[int, int], ...]
    sites: tuple[str, ...]
    values: Tensor
    rows: dict[tuple[int, str], Tensor]
    skipped: dict[int, str]
    window: int

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, key):
        """``table[layer, head]`` -> ``{score: value}``; ``table[score]`` -> ``{(layer, head):
        value}``."""
        if isinstance(key, str):
            k = self._column(key)
            return dict(zip(self.keys, self.values[:, k].tolist()))
        if key not in self.keys:
            raise KeyError(
                f"no head {key!r} in this table; it has {len(self.keys)} heads, "
                f"e.g. {list(self.keys[:4])}"
            )
        return dict(zip(self.names, self.values[self.keys.index(key)].tolist()))

    def score(self, name: str) -> Tensor:
        """One score of every head, in table order. Shape: ``(N,)``."""
        return self.values[:, self._column(name)]

    def rows_used(self, layer: int, name: str) -> Tensor:
        """The query rows that score ``name`` used in ``layer``."""
        self._column(name)
        if (layer, name) not in self.rows:
            raise KeyError(
                f"layer {layer} is not in this table (layers: "
                f"{sorted({lay for lay, _ in self.keys})})"
            )
        return self.rows[layer, name]

    def sorted_by(self, name: str, *, descending: bool = True) -> HeadScores:
        """The table with its heads ordered by one score (NaN last)."""
        col = self.score(name)
        filled = col.nan_to_num(float("-inf") if descending else float("inf"))
        order = torch.argsort(filled, descending=descending, stable=True).tolist()
        return HeadScores(
            self.names,
            tuple(self.keys[i] for i in order),
            tuple(self.sites[i] for i in order),
            self.values[order],
            self.rows,
            self.skipped,
            self.window,
        )

    def top(self, name: str, k: int = 1) -> list[tuple[int, int]]:
        """The ``k`` heads ``(layer, head)`` with the highest score ``name``."""
        return list(self.sorted_by(name).keys[:k])

    def to_rows(self) -> list[dict]:
        """One dict per head: ``layer``, ``head``, ``site``, then each score."""
        return [
            {"layer": lay, "head": h, "site": s, **dict(zip(self.names, v))}
            for (lay, h), s, v in zip(self.keys, self.sites, self.values.tolist())
        ]

    def _column(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"no score {name!r}; the scores are {', '.join(self.names)}")
        return self.names.index(name)

    def __repr__(self) -> str:
        return f"HeadScores({len(self.keys)} heads x {len(self.names)} scores)\n{self}"

    def __str__(self) -> str:
        head = f"{'layer':>5} {'head':>4}  " + " ".join(f"{n:>14}" for n in self.names)
        lines = [head]
        for (lay, h), v in zip(self.keys, self.values.tolist()):
            lines.append(f"{lay:>5} {h:>4}  " + " ".join(f"{x:>14.4f}" for x in v))
        layers = sorted({lay for lay, _ in self.keys})
        for lay in layers:
            used = ", ".join(f"{n} {_span(self.rows[lay, n])}" for n in self.names)
            lines.append(f"  layer {lay} rows: {used}")
        lines += [f"  layer {lay} skipped: {why}" for lay, why in sorted(self.skipped.items())]
        return "\n".join(lines)


def head_scores(
    capture: Captured,
    *,
    induction: InductionInput | int | None = None,
    window: int = 3,
    key_mask: Tensor | None = None,
    call: int = 0,
) -> HeadScores:
    """Score every recorded head of a capture (see the module docstring for each score).

    Args:
        capture: A :class:`qkv.Captured`; bounded ones (``rows=``, ``heads=``, ``batch=``)
            are scored on what they kept.
        induction: The :class:`InductionInput` the captured forward ran on (or its period,
            the first repeat at position 0), for the ``induction`` score; None leaves that
            score NaN.
        window: Half width of the ``local`` score: keys with ``|k - q| <= window``.
        key_mask: ``(B, T)`` bool of the model's batch, True = a real token; padded query
            rows are left out.
        call: Which call of each site (0: the first forward).

    Returns:
        A :class:`HeadScores`, one row per recorded (layer, head), by layer then head.

    Shape:
        Each record's ``probs`` ``(nb, nh, nr, S)``; only calls with T == S (self-attention
        over one sequence) are scored, the others listed in ``skipped``.
    """
    if not isinstance(capture, Captured):
        raise TypeError(f"head_scores takes a qkv.Captured, got {type(capture).__name__}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    period, start, repeats = _induction(induction)
    keys, sites, values, rows, skipped = [], [], [], {}, {}
    for rec in capture.records:
        if rec.call != call:
            continue
        B, _, T, S = rec.shape
        if T != S:
            skipped[rec.layer] = (
                f"{rec.name!r} has T={T} queries and S={S} keys (the scores "
                f"are about positions in one sequence)"
            )
            continue
        real = _real_rows(key_mask, rec, B, T).to(rec.probs.device)  # (nb, nr)
        per_score, used = _record_scores(
            rec.probs.double(), rec.rows, real, window, period, start, repeats
        )  # (nh, K), {name: rows}
        for i, h in enumerate(rec.heads.tolist()):
            keys.append((rec.layer, h))
            sites.append(rec.name)
            values.append(per_score[i])
        rows.update({(rec.layer, n): r for n, r in used.items()})
    if not keys:
        raise ValueError(
            f"nothing to score: the capture holds {len(capture.records)} records"
            f", none a call {call} with T == S" + (f" ({skipped})" if skipped else "")
        )
    order = sorted(range(len(keys)), key=lambda n: keys[n])
    return HeadScores(
        SCORES,
        tuple(keys[n] for n in order),
        tuple(sites[n] for n in order),
        torch.stack([values[n] for n in order]),
        rows,
        skipped,
        window,
    )


def _induction(induction) -> tuple[int | None, int, int]:
    """``(period, start, repeats)`` of the repeated input, or ``(None, 0, 0)``."""
    if induction is None:
        return None, 0, 0
    if isinstance(induction, InductionInput):
        return induction.period, induction.start, induction.repeats
    if isinstance(induction, int) and not isinstance(induction, bool) and induction >= 1:
        return induction, 0, 1 << 30  # every row from the second copy on
    raise TypeError(
        f"induction must be an InductionInput (qkv.analysis.induction_input) or "
        f"the period of the repeated input (an int >= 1), got {induction!r}"
    )


def _real_rows(key_mask: Tensor | None, rec, B: int, T: int) -> Tensor:
    """Which kept (batch element, row) pairs are real tokens. Shape: ``(nb, nr)`` bool."""
    if key_mask is None:
        return torch.ones(len(rec.batch), len(rec.rows), dtype=torch.bool)
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        raise TypeError("key_mask must be a bool tensor (B, T), True = a real token")
    if tuple(key_mask.shape) != (B, T):
        raise ValueError(
            f"key_mask must be the model's (B, T) = ({B}, {T}) for layer "
            f"{rec.layer}, got {tuple(key_mask.shape)}"
        )
    return key_mask.cpu()[rec.batch][:, rec.rows]  # (nb, nr)


def _record_scores(
    p: Tensor, q: Tensor, real: Tensor, window: int, period: int | None, start: int, repeats: int
) -> tuple[Tensor, dict[str, Tensor]]:
    """The scores of one record's heads and the rows each used.

    Shape:
        p ``(nb, nh, nr, S)``, q ``(nr,)`` query positions, real ``(nb, nr)`` ->
        ``(nh, K)``, ``{score: (rows used,)}``.
    """
    S = p.shape[-1]
    k = torch.arange(S, device=p.device)  # (S,)
    gather = lambda idx: p.gather(-1, idx.clamp(0, S - 1).expand(*p.shape[:-1], 1))[..., 0]  # noqa: E731
    q1 = q.view(-1, 1)  # (nr, 1)
    per_row = {  # (nb, nh, nr) each, and which rows it applies to (nr,)
        "previous_token": (gather(q1 - 1), q >= 1),
        "self": (gather(q1), torch.ones_like(q, dtype=torch.bool)),
        "first_token": (p[..., 0], q >= 1),
        "local": ((p * ((k - q1).abs() <= window)).sum(-1), torch.ones_like(q, dtype=torch.bool)),
        "entropy": (-(p * p.clamp_min(1e-300).log()).sum(-1), torch.ones_like(q, dtype=torch.bool)),
    }
    if period is not None:
        rows = (q >= start + period) & (q < start + repeats * period)
        per_row["induction"] = (gather(q1 - period + 1), rows)
    else:
        per_row["induction"] = (p[..., 0], torch.zeros_like(q, dtype=torch.bool))
    attends = p.sum(-1) > 0  # (nb, nh, nr): rows that attend to nothing are left out
    out, used = [], {}
    for name in SCORES:
        value, rows = per_row[name]
        w = (attends & real[:, None, :] & rows).double()  # (nb, nh, nr)
        total = w.sum((0, 2))  # (nh,)
        out.append(
            torch.where(total > 0, (value * w).sum((0, 2)) / total.clamp_min(1), float("nan"))
        )
        used[name] = q[(w.sum((0, 1)) > 0)]
    return torch.stack(out, -1), used  # (nh, K)


def _span(rows: Tensor) -> str:
    """Rows as text: ``1..63`` when contiguous, else the list (shortened)."""
    r = rows.tolist()
    if not r:
        return "none"
    if r == list(range(r[0], r[-1] + 1)):
        return f"{r[0]}..{r[-1]}" if len(r) > 1 else str(r[0])
    return str(r) if len(r) <= 8 else f"[{', '.join(map(str, r[:6]))}, ... {len(r)} rows]"
