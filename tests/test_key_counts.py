"""ops/key_counts.py (how many keys, and how many marked keys, each query row may attend)
against its slow twin: the whole (T, S) grid of allowed pairs (``nonfinite.allowed``),
counted in float64."""

from __future__ import annotations

import pytest
import torch

from qkv import masks
from qkv.ops import AttentionCall
from qkv.ops.key_counts import covers_every_key, key_counts, ranges, sees_own_position
from qkv.ops.nonfinite import allowed

B, H, D = 2, 3, 4


def _ids(T: int, g: torch.Generator, runs: bool) -> torch.Tensor:
    """Document ids (B, T): contiguous runs, or ids scattered over positions (interleaved)."""
    if runs:
        return torch.sort(torch.randint(0, 4, (B, T), generator=g), -1).values
    return torch.randint(0, 4, (B, T), generator=g) * 7 - 3  # negative and sparse ids too


def _case(name: str, T: int, S: int, g: torch.Generator) -> dict:
    if name == "none":
        return {}
    if name == "causal":
        return {"is_causal": True}
    if name == "window":
        return {"mask_mod": masks.sliding_window(3, 2)}
    if name == "window-bottom-right":
        return {"mask_mod": masks.sliding_window(4, align="bottom_right")}
    if name == "lengths":
        return {"mask_mod": masks.key_lengths(torch.tensor([0, S - 3]))}
    if name == "lengths-int":
        return {"mask_mod": masks.key_lengths(S // 2)}
    if name == "window-and-lengths":
        lengths = masks.key_lengths(torch.tensor([S, 2]))
        return {"mask_mod": masks.and_masks(masks.sliding_window(5, 1), lengths)}
    if name in ("document-runs", "document-scattered"):
        ids = _ids(max(T, S), g, name.endswith("runs"))
        return {"mask_mod": masks.document(ids[:, :T], ids[:, :S])}
    if name == "document-shared":
        ids = _ids(max(T, S), g, False)[:1]
        return {"mask_mod": masks.document(ids[0, :T], ids[0, :S])}
    if name == "document-causal":
        ids = _ids(max(T, S), g, False)
        return {"mask_mod": masks.document(ids[:, :T], ids[:, :S]), "is_causal": True}
    if name == "document-window-lengths":
        ids = _ids(max(T, S), g, True)
        lengths = masks.key_lengths(torch.tensor([S - 1, 3]))
        window = masks.sliding_window(2, 3)
        return {
            "mask_mod": masks.and_masks(masks.document(ids[:, :T], ids[:, :S]), window, lengths)
        }
    if name == "bool-mask":
        return {"attn_mask": torch.rand(B, 1, T, S, generator=g) < 0.4}
    if name == "bool-key-padding":
        return {"attn_mask": torch.rand(B, 1, 1, S, generator=g) < 0.6}
    if name == "float-mask-per-head":
        bias = torch.randn(H, T, S, generator=g)
        return {
            "attn_mask": bias.masked_fill(torch.rand(H, T, S, generator=g) < 0.5, float("-inf"))
        }
    if name == "bool-mask-and-causal":
        return {"attn_mask": torch.rand(T, S, generator=g) < 0.7, "is_causal": True}
    if name == "or-masks":
        return {"mask_mod": masks.or_masks(masks.sliding_window(1), masks.key_lengths(2))}
    if name == "plain-function":
        return {"mask_mod": lambda b, h, q, kv: (q + kv + h) % 3 != 0}
    if name == "prefix-lm":
        return {"mask_mod": masks.prefix_lm(3)}
    if name == "prefix-lm-tensor-and-window":  # a prefix per element (one below 0), and a band
        prefix = masks.prefix_lm(torch.tensor([-2, S // 2 + 1]))
        return {"mask_mod": masks.and_masks(prefix, masks.sliding_window(4))}
    if name == "or-from-key-zero":  # bottom-right causal, or lengths per element, or 2 keys
        either = masks.or_masks(
            masks.causal("bottom_right"), masks.key_lengths(torch.tensor([1, 0]))
        )
        return {"mask_mod": masks.or_masks(either, masks.key_lengths(2)), "is_causal": True}
    raise ValueError(name)


CASES = [
    "none",
    "causal",
    "window",
    "window-bottom-right",
    "lengths",
    "lengths-int",
    "window-and-lengths",
    "document-runs",
    "document-scattered",
    "document-shared",
    "document-causal",
    "document-window-lengths",
    "bool-mask",
    "bool-key-padding",
    "float-mask-per-head",
    "bool-mask-and-causal",
    "or-masks",
    "plain-function",
    "prefix-lm",
    "prefix-lm-tensor-and-window",
    "or-from-key-zero",
]


@pytest.mark.parametrize(
    "T, S", [pytest.param(T, S, id=f"T{T}-S{S}") for T, S in ((1, 1), (7, 7), (5, 11), (13, 6))]
)
@pytest.mark.parametrize("case", CASES)
def test_counts_equal_the_grid_of_allowed_pairs(case, T, S):
    g = torch.Generator().manual_seed(T * 100 + S)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, H, S, D, generator=g)
    call = AttentionCall.build(q, k, k, **_case(case, T, S, g))
    marked = torch.rand(B, H, S, generator=g) < 0.3
    grid = allowed(call).double()  # (B, H, T, S)
    want_marked = grid @ marked.double().unsqueeze(-1)  # (B, H, T, 1)
    want_keys = grid.sum(-1)  # (B, H, T)
    n_marked, n_keys = key_counts(call, marked)
    assert torch.equal(n_marked.double(), want_marked.squeeze(-1)), case
    assert torch.equal(n_keys.double(), want_keys), case
    if covers_every_key(call):  # told from integers: it must be right when it says so
        assert bool(grid.all())
    if sees_own_position(call):  # the same
        assert bool(grid.diagonal(dim1=-2, dim2=-1).all())


def test_a_document_ids_change_in_place_is_seen():
    """The keys sorted by id are remembered by the ids' identity and version: a change in
    place gives new counts."""
    T = S = 8
    ids = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]]).expand(B, T).clone()
    q = torch.zeros(B, H, T, D)
    marked = torch.zeros(B, H, S, dtype=torch.bool)
    marked[..., 0] = True
    call = AttentionCall.build(q, q, q, mask_mod=masks.document(ids))
    assert key_counts(call, marked)[0][0, 0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    ids[:, 4:] = 0  # rows 4..7 join document 0
    assert key_counts(call, marked)[0][0, 0].tolist() == [1, 1, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "T, S", [pytest.param(T, S, id=f"T{T}-S{S}") for T, S in ((1, 1), (7, 7), (5, 11), (13, 6))]
)
@pytest.mark.parametrize(
    "case", ["prefix-lm", "prefix-lm-tensor-and-window", "or-from-key-zero", "or-masks"]
)
def test_or_masks_of_ranges_from_key_zero_are_ranges(case, T, S):
    """``prefix_lm`` (causal or the prefix's keys) and other ``or_masks`` whose parts all start
    at key 0 give each row one range ``[lo, hi)``, which is what the kernels of ranges take
    (the bfloat16 kernel, the few-rows kernel, the output's pass of the NaN/inf contract); an
    ``or`` of a band and lengths is no range, and says so (None)."""
    g = torch.Generator().manual_seed(T * 100 + S)
    q = torch.randn(B, H, T, D, generator=g)
    call = AttentionCall.build(
        q, q[:, :, :1].expand(B, H, S, D), q[:, :, :1].expand(B, H, S, D), **_case(case, T, S, g)
    )
    got = ranges(call)
    if case == "or-masks":
        assert got is None
        return
    assert got is not None and got[2] is None
    lo, hi = (t.expand(B, 1, T) for t in got[:2])
    keys = torch.arange(S)
    as_grid = (keys >= lo.unsqueeze(-1)) & (keys < hi.unsqueeze(-1))  # (B, 1, T, S)
    assert torch.equal(as_grid.expand(B, H, T, S), allowed(call).expand(B, H, T, S))
