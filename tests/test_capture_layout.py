"""Issue 26, layout by job: ``qkv.capture`` became a package (session, selection, captured).
``qkv.capture`` is still the function, ``from qkv.capture import ...`` still gives the same
objects, and files written before the split load: a ``cap.save`` file (plain tensors, lists
and dicts) and a pickle of the objects (``torch.save(cap)``), which names the classes by path.

The two files in ``tests/data`` were written by the single-module layout at commit d03a362."""

import importlib
import pickle
import pickletools
from pathlib import Path

import torch

import qkv
from qkv.capture import Captured, CapturedAttention, capture, load_capture

DATA = Path(__file__).parent / "data"


def test_qkv_capture_is_the_function_and_the_module_path_still_imports():
    assert qkv.capture is capture and callable(qkv.capture)
    assert qkv.Captured is Captured and qkv.load_capture is load_capture
    # the module, by its path (``import qkv.capture as m`` gives the function: the attribute
    # wins, as it did when the module was one file)
    module = importlib.import_module("qkv.capture")
    assert module.__name__ == "qkv.capture" and module.__file__.endswith("__init__.py")
    assert module.capture is capture and module.CapturedAttention is CapturedAttention


def test_classes_keep_their_old_pickle_names():
    for obj in (Captured, CapturedAttention, capture, load_capture):
        assert obj.__module__ == "qkv.capture", obj
    record = CapturedAttention(
        "a", 0, 0, torch.ones(1, 1, 1, 1), torch.zeros(1, 1, 1), None,
        torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), (1, 1, 1, 1), "reference",
    )  # fmt: skip
    names = {
        arg
        for op, arg, _pos in pickletools.genops(pickle.dumps(Captured([record]), protocol=2))
        if op.name == "GLOBAL" and arg.startswith("qkv")
    }
    assert names == {"qkv.capture Captured", "qkv.capture CapturedAttention"}


def _check(cap: Captured) -> None:
    assert isinstance(cap, Captured) and cap.sites == ["blocks.0.attn", "blocks.1.attn"]
    (rec,) = cap.layer(1)
    assert isinstance(rec, CapturedAttention) and rec is cap["blocks.1.attn"][0]
    assert rec.probs.tolist() == [[[[0.25, 0.75]]]] and rec.lse.tolist() == [[[0.5]]]
    assert (rec.heads.tolist(), rec.rows.tolist(), rec.shape) == ([3], [2], (1, 4, 3, 2))
    assert cap.settings["heads"] == "[3]" and "1 records from 1 of 2 sites" in repr(cap)


def test_a_capture_saved_before_the_split_loads():
    _check(load_capture(DATA / "captured_save_d03a362.pt"))


def test_a_capture_pickled_before_the_split_loads():
    _check(torch.load(DATA / "captured_pickle_d03a362.pt", weights_only=False))
