"""Sequence-to-sequence toys on digits: ``reverse``, ``copy`` and ``sort``.

The three share one stream of inputs for a seed (a length drawn uniformly from
``[min_len, max_len]``, then that many uniform digits, with Python's ``random.Random(seed)``;
repeats dropped), so they differ only in the target. Splits are disjoint slices of the stream:
valid, then test, then train. A trained ``reverse`` model's cross-attention is an
anti-diagonal; ``copy`` with ``max_len=128`` is the sanity task of "Transformers are RNNs"
(Katharopoulos et al. 2020) in its encoder-decoder form.

The defaults (lengths 4-10, 10,000 / 1,000 / 1,000 examples) are small enough for an
encoder-decoder with C=64 and two layers each to learn ``reverse`` on two CPU cores in a minute
(``torch.nn.Transformer``, batch 64, AdamW 3e-3: 99.8% exact-match greedy decodes on valid).

Shape alphabet: N examples, S source length (``max_len``), T target length (``S + 2``).
"""

from __future__ import annotations

import os
import random

import torch
from torch import Tensor

from ._cache import split_slice, stream
from ._checks import check_int, check_split
from ._types import BOS, EOS, PAD, SEP, Seq2SeqData, Vocab, pad_rows

VOCAB = Vocab((PAD, BOS, EOS, SEP) + tuple(str(d) for d in range(10)))
DIGIT0 = VOCAB.encode(["0"])[0]  # digit d has id DIGIT0 + d
SIZES = {"train": 10_000, "valid": 1_000, "test": 1_000}


def reverse(
    split: str = "train",
    *,
    seed: int = 0,
    size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    min_len: int = 4,
    max_len: int = 10,
    valid_size: int = SIZES["valid"],
    test_size: int = SIZES["test"],
) -> Seq2SeqData:
    """Digits in, the same digits reversed out.

    Args:
        split: ``"train"``, ``"valid"`` or ``"test"``.
        seed: seeds the stream of inputs; the same seed gives the same tensors.
        size: take the first ``size`` examples of the split (default 10,000 / 1,000 / 1,000).
        cache_dir: where the stream is cached (default ``$QKV_CACHE/tasks`` or
            ``~/.cache/qkv/tasks``).
        min_len: shortest input, at least 1.
        max_len: longest input; ``S = max_len``.
        valid_size: examples in the validation split (it comes first in the stream).
        test_size: examples in the test split (it follows validation).

    Returns:
        ``Seq2SeqData`` with ``tgt = <bos> reversed(src) <eos>``.

    Shape:
        src ``(N, S)``, src_mask ``(N, S)``, tgt ``(N, S + 2)``, tgt_mask ``(N, S + 2)``.
    """
    return _load("reverse", split, seed, size, cache_dir, min_len, max_len, valid_size, test_size)


def copy(
    split: str = "train",
    *,
    seed: int = 0,
    size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    min_len: int = 4,
    max_len: int = 10,
    valid_size: int = SIZES["valid"],
    test_size: int = SIZES["test"],
) -> Seq2SeqData:
    """Digits in, the same digits out (``tgt = <bos> src <eos>``).

    For the decoder-only form, join ``src <sep> src`` with ``vocab.sep``. Arguments and
    shapes as in :func:`reverse`.
    """
    return _load("copy", split, seed, size, cache_dir, min_len, max_len, valid_size, test_size)


def sort(
    split: str = "train",
    *,
    seed: int = 0,
    size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    min_len: int = 4,
    max_len: int = 10,
    valid_size: int = SIZES["valid"],
    test_size: int = SIZES["test"],
) -> Seq2SeqData:
    """Digits in, the same digits in ascending order out (``tgt = <bos> sorted(src) <eos>``).

    Arguments and shapes as in :func:`reverse`.
    """
    return _load("sort", split, seed, size, cache_dir, min_len, max_len, valid_size, test_size)


def _load(
    task: str,
    split: str,
    seed: int,
    size: int | None,
    cache_dir,
    min_len: int,
    max_len: int,
    valid_size: int,
    test_size: int,
) -> Seq2SeqData:
    check_split(split)
    check_int("seed", seed, low=0)
    check_int("size", size, low=1, none_ok=True)
    check_int("min_len", min_len, low=1)
    check_int("max_len", max_len, low=min_len)
    check_int("valid_size", valid_size, low=0)
    check_int("test_size", test_size, low=0)
    start, stop = split_slice(split, size, {**SIZES, "valid": valid_size, "test": test_size})
    distinct = sum(10**n for n in range(min_len, max_len + 1))
    if stop > distinct:
        raise ValueError(
            f"{stop} distinct inputs are needed but lengths {min_len}-{max_len} "
            f"give only {distinct}; raise max_len or ask for fewer examples"
        )

    def sample(rng: random.Random) -> tuple[bytes, int]:
        n = rng.randint(min_len, max_len)
        return bytes(rng.choices(range(10), k=n)), 0

    def check(flat: Tensor, lengths: Tensor, labels: Tensor) -> str | None:
        if not lengths.numel():
            return None
        if int(flat.max()) > 9:
            return "a symbol is not a digit"
        if int(lengths.min()) < min_len or int(lengths.max()) > max_len:
            return f"a length is outside {min_len}-{max_len}"
        return None

    key = f"digits-seq-len{min_len}-{max_len}"
    s = stream(
        key, stop, seed=seed, sample=sample, check=check, cache_dir=cache_dir, progress=False
    )
    first = int(s.lengths[:start].sum())
    src, src_mask = pad_rows(s.flat[first:] + DIGIT0, s.lengths[start:], max_len, VOCAB.pad)
    y = _target(task, src, src_mask, s.lengths[start:])  # (N, S)
    tgt, tgt_mask = _frame(y, s.lengths[start:])  # (N, S + 2)
    return Seq2SeqData(src, src_mask, tgt, tgt_mask, VOCAB, task, split)


def _target(task: str, src: Tensor, src_mask: Tensor, lengths: Tensor) -> Tensor:
    """The output digits of ``task``, left-aligned and padded like ``src``.

    Shape:
        src ``(N, S)``, src_mask ``(N, S)``, lengths ``(N,)`` -> ``(N, S)``.
    """
    if task == "copy":
        return src
    if task == "reverse":
        idx = (lengths[:, None] - 1 - torch.arange(src.shape[1])).clamp(min=0)  # (N, S)
        return src.gather(1, idx).masked_fill(~src_mask, VOCAB.pad)  # (N, S)
    big = torch.iinfo(torch.int64).max  # padding sorts last, then is written back as padding
    return src.masked_fill(~src_mask, big).sort(dim=1).values.masked_fill(~src_mask, VOCAB.pad)


def _frame(y: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``<bos> y <eos>`` then padding.

    Shape:
        y ``(N, S)``, lengths ``(N,)`` -> tgt ``(N, S + 2)`` and tgt_mask ``(N, S + 2)``.
    """
    N, S = y.shape
    tgt = torch.full((N, S + 2), VOCAB.pad, dtype=torch.int64)  # (N, S + 2)
    tgt[:, 0] = VOCAB.bos
    tgt[:, 1 : S + 1] = y
    tgt[torch.arange(N), lengths + 1] = VOCAB.eos
    tgt_mask = torch.arange(S + 2) < (lengths + 2)[:, None]  # (N, S + 2)
    return tgt, tgt_mask
