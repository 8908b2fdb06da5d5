"""``qkv.masks`` is a package with one file per job; no name changed on the way (issue 26).

Every name of the single-file module's ``__all__``, and every other name that qkv's modules
or the tests take from ``qkv.masks``, still resolves from ``qkv.masks``, as the same object
the job's file defines.
"""

from pathlib import Path

import fresh
import pytest

import qkv
import qkv.masks

# ``__all__`` of src/qkv/masks.py before the split, in its order.
OLD_ALL = [
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
    "apply_mask_",
    "causal_bool",
    "merge_causal",
    "merge_key_mask",
]
# Names outside ``__all__`` that src/ or tests/ import or read from qkv.masks.
USED_ELSEWHERE = [
    "EMPTY",
    "PARTIAL",
    "FULL",
    "Grid",
    "block_states",
    "offset_mask",
    "offset_score",
    "_Alibi",
    "_Combined",
    "_Document",
    "_KeysBefore",
    "_Softcap",
    "_Window",
    "_blocks_take_offsets",
    "_captured_tensors",
]
# Names added to ``__all__`` since the split (issue 40: NATTEN's neighborhoods, PTv3's
# serialization).
ADDED = ["neighborhood", "tile_layout", "TileLayout", "serialize"]
JOBS = ["vocabulary", "blocks", "structure", "evaluation", "dense", "grids", "points"]


def test_all_is_unchanged():
    """The old names, in their order, and only the names added since."""
    assert [n for n in qkv.masks.__all__ if n not in ADDED] == OLD_ALL
    assert set(qkv.masks.__all__) - set(OLD_ALL) == set(ADDED)


@pytest.mark.parametrize("name", OLD_ALL + ADDED + USED_ELSEWHERE)
def test_name_resolves(name):
    assert getattr(qkv.masks, name) is not None
    exec(f"from qkv.masks import {name}", {})


@pytest.mark.parametrize(
    "name, job",
    [
        ("causal", "vocabulary"),
        ("MaskMod", "vocabulary"),
        ("_Window", "vocabulary"),
        ("alibi", "vocabulary"),
        ("block_summary", "blocks"),
        ("Grid", "blocks"),
        ("FULL", "blocks"),
        ("structure_key", "structure"),
        ("_blocks_take_offsets", "structure"),
        ("offset_mask", "structure"),
        ("per_element", "evaluation"),
        ("_captured_tensors", "evaluation"),
        ("index_grid", "evaluation"),
        ("to_dense", "dense"),
        ("causal_bool", "dense"),
        ("apply_mask_", "dense"),
        ("neighborhood", "grids"),
        ("tile_layout", "grids"),
        ("serialize", "points"),
    ],
)
def test_name_is_the_jobs_object(name, job):
    module = getattr(qkv.masks, job)
    assert getattr(qkv.masks, name) is getattr(module, name)


def test_each_file_says_its_job():
    for job in JOBS:
        doc = getattr(qkv.masks, job).__doc__
        assert doc and doc.strip(), f"qkv/masks/{job}.py has no module docstring"
    assert "True = may attend" in qkv.masks.__doc__  # the contract stays on the package


def test_each_file_imports_on_its_own():
    """Each job's file loads with only its own imports run (neither ``qkv/__init__`` nor
    ``qkv/masks/__init__``): the calls back up the package are imported inside functions."""
    pkg = Path(qkv.masks.__file__).parent
    code = f"""
import importlib, sys, types
for job in {JOBS!r}:
    for name in [n for n in sys.modules if n == "qkv" or n.startswith("qkv.")]:
        del sys.modules[name]
    for name, path in (("qkv", {str(pkg.parent)!r}), ("qkv.masks", {str(pkg)!r})):
        stub = types.ModuleType(name)
        stub.__path__ = [path]
        sys.modules[name] = stub
    importlib.import_module("qkv.masks." + job)
print("ok")
"""
    out = fresh.run(code)  # a fresh interpreter: this one imported the package
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
