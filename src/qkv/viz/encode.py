"""How :func:`qkv.viz.html` stores one head's weights in the page: every weight as float32
or float16 within the head's budget, else block maxima, each row's support and its top k;
signed differences likewise ("s4", "s2", "sb"). The page's payload format and precision are
told in :mod:`qkv.viz.html`'s docstring.

Shape alphabet: S key length, nr kept query rows, gr x gc blocks of ``block x block`` cells.
"""

from __future__ import annotations

import base64
import math
import sys

import torch
from torch import Tensor

_HEAD_CELLS = 1 << 20  # per-head budget: 2 MiB of float16
_GRID_SHARE = 4  # "top" mode: block maxima take at most C / 4 cells (a quarter of the bytes)
_K_MAX = 128
_VALUE_SLACK = 1e-3  # weights may exceed 1 by a half-precision rounding


def _check_weights(w: Tensor, where: str) -> None:
    lo, hi = (float(x) for x in torch.aminmax(w))  # NaN anywhere makes both NaN
    if math.isnan(lo) or math.isnan(hi):
        raise ValueError(
            f"{where}: the weights hold NaN; pass attention probabilities (trace.probs)"
        )
    if lo < 0 or hi > 1 + _VALUE_SLACK:
        raise ValueError(
            f"{where}: weights must lie in [0, 1], got min {lo:.4g} and max "
            f"{hi:.4g}; pass attention probabilities (trace.probs, not scores)"
        )


def _bytes(t: Tensor) -> bytes:
    """The little-endian bytes of a CPU tensor (torch's own storage; numpy is not needed)."""
    t = t.contiguous()
    buf = bytearray(t.numel() * t.element_size())
    if buf:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(t.view(torch.uint8).reshape(-1))
    if sys.byteorder == "big":  # pragma: no cover - torch ships for little-endian hosts
        size = t.element_size()
        for i in range(0, len(buf), size):
            buf[i : i + size] = buf[i : i + size][::-1]
    return bytes(buf)


def _encode_head(w: Tensor, budget: int, where: str) -> tuple[dict, str]:
    """One head's metadata and base64 payload. ``w`` (nr, S)."""
    nr, S = w.shape
    if nr * S <= budget:
        w32 = w.to(device="cpu", dtype=torch.float32)  # (nr, S)
        _check_weights(w32, where)
        mode = "f4" if nr * S <= budget // 16 else "f2"
        data = w32 if mode == "f4" else w32.half()
        return {"mode": mode, "vmax": float(w32.max())}, base64.b64encode(_bytes(data)).decode()
    return _encode_top(w, budget, where)


def _encode_signed(d: Tensor, budget: int, where: str) -> tuple[dict, str]:
    """One head of signed differences ``d`` (nr, S): every cell as float32 ("s4") or float16
    ("s2") within the budget, else the cell of largest ``|d|`` of each ``b x b`` block ("sb",
    float16, ``b`` the smallest power of two leaving at most ``budget`` blocks)."""
    nr, S = d.shape
    d = d.to(device="cpu", dtype=torch.float32)  # (nr, S)
    if not bool(torch.isfinite(d).all()):
        raise ValueError(f"{where}: the differences hold NaN or infinity")
    vmax = float(d.abs().max())
    if nr * S <= budget:
        mode = "s4" if nr * S <= budget // 16 else "s2"
        data = d if mode == "s4" else d.half()
        return {"mode": mode, "vmax": vmax}, base64.b64encode(_bytes(data)).decode()
    block = 1
    while math.ceil(nr / block) * math.ceil(S / block) > budget:
        block *= 2
    gr, gc = math.ceil(nr / block), math.ceil(S / block)
    grid = torch.empty(gr, gc)  # (gr, gc) the signed cell of largest |d| in each block
    for g0 in range(0, gr, max(1, 2048 // block)):
        rows = d[g0 * block : (g0 + max(1, 2048 // block)) * block]  # (n, S)
        n = math.ceil(rows.shape[0] / block)
        padded = torch.nn.functional.pad(rows, (0, gc * block - S, 0, n * block - rows.shape[0]))
        blocks = padded.view(n, block, gc, block).permute(0, 2, 1, 3).reshape(n, gc, -1)
        pick = blocks.abs().argmax(-1, keepdim=True)  # (n, gc, 1)
        grid[g0 : g0 + n] = blocks.gather(-1, pick)[..., 0]
    info = {"mode": "sb", "vmax": vmax, "block": block, "gr": gr, "gc": gc}
    return info, base64.b64encode(_bytes(grid.half())).decode()


def _encode_top(w: Tensor, budget: int, where: str) -> tuple[dict, str]:
    """A head too large for its budget: block maxima, each row's support and top k."""
    nr, S = w.shape
    block = 1
    while math.ceil(nr / block) * math.ceil(S / block) > budget // _GRID_SHARE:
        block *= 2
    gr, gc = math.ceil(nr / block), math.ceil(S / block)
    ib = 2 if S <= 1 << 16 else 4
    k = min(_K_MAX, S, (2 * budget - 2 * gr * gc - 2 * ib * nr) // (nr * (2 + ib)))
    itype = torch.int32 if ib == 4 else torch.int16  # uint16 bits held in int16
    grid = torch.zeros(gr, gc)  # (gr, gc) block maxima
    idx = torch.zeros(nr, max(k, 0), dtype=itype)  # (nr, k)
    val = torch.zeros(nr, max(k, 0), dtype=torch.float16)  # (nr, k)
    span = torch.zeros(nr, 2, dtype=itype)  # (nr, 2) first and last key of nonzero weight
    full = S // block * block
    step = block * max(1, 2048 // block)  # rows per chunk: a float32 chunk of S columns
    for r0 in range(0, nr, step):
        chunk = w[r0 : r0 + step].to(device="cpu", dtype=torch.float32)  # (n, S)
        _check_weights(chunk, where)
        n = chunk.shape[0]
        maxima = [chunk[:, :full].reshape(n, full // block, block).amax(2)]  # (n, S // block)
        if full < S:
            maxima.append(chunk[:, full:].amax(1, keepdim=True))  # (n, 1)
        by_block = torch.cat(maxima, 1)  # (n, gc): each row's max over each block of keys
        padded = torch.cat([by_block, by_block.new_zeros((-n) % block, gc)])  # (n', gc)
        grid[r0 // block : r0 // block + padded.shape[0] // block] = padded.view(
            -1, block, gc
        ).amax(1)  # (n' / block, gc)
        span[r0 : r0 + n] = _support(chunk, by_block, block).to(itype)
        if k > 0:
            top_v, top_i = chunk.topk(k, dim=1)  # (n, k)
            top_i, order = top_i.sort(dim=1)  # ascending key index, for a binary search
            val[r0 : r0 + n] = top_v.gather(1, order).half()
            idx[r0 : r0 + n] = top_i.to(itype)
    payload = _bytes(idx) + _bytes(span) + _bytes(val) + _bytes(grid.half())
    info = {
        "mode": "top",
        "vmax": float(grid.max()),
        "block": block,
        "gr": gr,
        "gc": gc,
        "k": max(k, 0),
        "ib": ib,
    }
    return info, base64.b64encode(payload).decode()


def _support(chunk: Tensor, by_block: Tensor, block: int) -> Tensor:
    """First and last key of nonzero weight of each row, found from the blocks that hold
    one (a full scan of ``(n, S)`` for them costs ~0.3 s a chunk); ``(1, 0)`` for a row of
    zeros. ``chunk`` (n, S), ``by_block`` (n, gc) -> (n, 2)."""
    _, S = chunk.shape
    nonzero = (by_block > 0).to(torch.uint8)  # (n, gc)
    first_b = nonzero.argmax(1)  # (n,) argmax gives the first of equal maxima
    last_b = nonzero.shape[1] - 1 - nonzero.flip(1).argmax(1)  # (n,)
    offsets = torch.arange(block)

    def inside(b: Tensor, last: bool) -> Tensor:
        cols = b[:, None] * block + offsets  # (n, block)
        hit = ((chunk.gather(1, cols.clamp(max=S - 1)) > 0) & (cols < S)).to(torch.uint8)
        return cols[:, 0] + (block - 1 - hit.flip(1).argmax(1) if last else hit.argmax(1))

    out = torch.stack([inside(first_b, False), inside(last_b, True)], 1)  # (n, 2)
    empty = nonzero.amax(1) == 0
    out[empty] = torch.tensor([1, 0])
    return out


def _runs(rows: list[int]) -> list[list[int]]:
    """Consecutive rows as ``[first, count]`` runs."""
    runs: list[list[int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return runs
