"""Masks: one contract for every backend.

A boolean mask means True = may attend. A float mask is added to the scores. Both broadcast
to the scores' shape ``(*batch, T, S)`` as in PyTorch.

Structured masks (``mask_mod``) and score changes (``score_mod``) in FlexAttention's
vocabulary: ``causal``, ``sliding_window``, ``prefix_lm``, ``document``, ``key_lengths``,
``and_masks``/``or_masks``, ``alibi``, ``softcap``, ``neighborhood`` (NATTEN's, on 1D-3D token
grids, with ``tile_layout``), ``serialize`` (point clouds along a space-filling curve, PTv3's
patches as documents), with ``to_dense`` (the dense twin of a mask) and
``block_summary`` (what a tiled backend skips).

One file per job; every name is used from here, ``qkv.masks.causal``:

- ``vocabulary``: ``MaskMod``, ``ScoreMod`` and the ready-made masks and score mods.
- ``grids``: token grids: ``neighborhood`` (NATTEN's windows) and ``tile_layout``.
- ``points``: point clouds: ``serialize`` (z-order and Hilbert curves, PTv3's serialization).
- ``blocks``: ``Grid``, ``EMPTY``/``PARTIAL``/``FULL``, ``block_states``, ``block_summary``.
- ``structure``: a bound mask for a piece of its call (``offset_mask``), and the keys under
  which the tiled backend reuses block plans (``shift_invariant``, ``structure_key``).
- ``evaluation``: calling a mod on index tensors (``index_grid``, ``evaluate_mask``,
  ``per_element``) and finding the tensors a score_mod reads (``score_mod_gradient_inputs``).
- ``dense``: bool and float mask tensors (``causal_bool``, ``apply_mask_``, ``to_dense``).

Imports inside the package run evaluation <- blocks <- vocabulary <- grids <- points,
structure, dense; the two calls back up (``_captured_tensors`` to the mod classes,
``block_summary`` to ``as_mask_mod``) import inside the function.

Shape alphabet: T query length, S key length.
"""

from __future__ import annotations

from .blocks import EMPTY as EMPTY
from .blocks import FULL as FULL
from .blocks import PARTIAL as PARTIAL
from .blocks import BlockSummary, block_summary
from .blocks import Grid as Grid
from .blocks import block_states as block_states
from .dense import apply_mask_, causal_bool, merge_causal, merge_key_mask, to_dense
from .evaluation import _captured_tensors as _captured_tensors
from .evaluation import (
    evaluate_mask,
    evaluate_score,
    index_grid,
    per_element,
    score_mod_gradient_inputs,
)
from .grids import TileLayout, neighborhood, tile_layout
from .grids import _Neighborhood as _Neighborhood
from .points import serialize
from .structure import _blocks_take_offsets as _blocks_take_offsets
from .structure import offset_mask as offset_mask
from .structure import offset_score as offset_score
from .structure import shift_invariant, structure_key
from .vocabulary import (
    MaskMod,
    ScoreMod,
    alibi,
    alibi_slopes,
    and_masks,
    as_mask_mod,
    as_score_mod,
    causal,
    document,
    key_lengths,
    or_masks,
    prefix_lm,
    sliding_window,
    softcap,
)
from .vocabulary import _Alibi as _Alibi
from .vocabulary import _Combined as _Combined
from .vocabulary import _Document as _Document
from .vocabulary import _KeysBefore as _KeysBefore
from .vocabulary import _Softcap as _Softcap
from .vocabulary import _Window as _Window

__all__ = [  # noqa: RUF022 (grouped as the docs present them; test_masks_package keeps the order)
    # structured masks and score changes (the public vocabulary)
    "MaskMod",
    "ScoreMod",
    "causal",
    "sliding_window",
    "prefix_lm",
    "document",
    "key_lengths",
    "and_masks",
    "or_masks",
    "alibi",
    "alibi_slopes",
    "softcap",
    "neighborhood",
    "tile_layout",
    "TileLayout",
    "serialize",
    "to_dense",
    "block_summary",
    "BlockSummary",
    "as_mask_mod",
    "as_score_mod",
    "evaluate_mask",
    "evaluate_score",
    "index_grid",
    "per_element",
    "score_mod_gradient_inputs",
    "shift_invariant",
    "structure_key",
    # dense masks
    "apply_mask_",
    "causal_bool",
    "merge_causal",
    "merge_key_mask",
]
