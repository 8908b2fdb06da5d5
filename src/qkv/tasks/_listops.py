"""ListOps (Long Range Arena, Tay et al. 2020), generated locally.

A reimplementation of LRA's generator (``lra_benchmarks/data/listops.py``) from its
description in ``TASKS.md``, drawing in the same order: :func:`listops_generate_tree` run on
``random.Random(seed)`` makes the trees the reference makes after ``random.seed(seed)``.

* A node at ``depth < max_depth`` draws ``r = rng.random()``; at ``max_depth`` it takes
  ``r = 1``. ``r > 0.25`` makes a leaf, ``rng.choice(range(10))``, of length 1.
* Otherwise ``n = rng.randint(2, max_args)`` children are generated at ``depth + 1`` first,
  and then the operator is drawn, ``rng.choice(["[MIN", "[MAX", "[MED", "[SM"])``; the node's
  length is 2 + its children's (operator and closing token count one each).
* Trees are drawn from ``depth = 1`` with ``max_depth = max_args = 10`` and kept when
  ``min_length < length < max_length``; repeats are dropped.

Values: ``[MIN``/``[MAX`` as named, ``[MED`` is ``int(np.median(args))`` (an even count
truncates the mean of the middle two), ``[SM`` is the sum modulo 10. The token stream drops
the reference's parentheses and writes ``]`` as ``X``: ``[MAX 2 9 [MIN 4 7 X 0 X`` is 9.

Two differences from the reference script, both about order, not content: it splits a Python
``set`` (whose order changes between runs), we split the first-seen order; and our stream is
laid out valid, test, train, so the evaluation splits do not move when train grows.

Variants: ``full`` is LRA's (``500 < length < 2000``; 96,000 / 2,000 / 2,000 examples; about
8% of sampled trees accepted, about 1 s per 1,000 examples on one core); ``cpu`` is for quick
runs (``100 < length < 500``; 5,000 / 500 / 500; about 5% accepted, about 8 s in all).
Generation shows progress, writes its cache every minute and resumes after an interruption.

Shape alphabet: N examples, L sequence length (``max_length - 1``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import TypedDict, Union

from torch import Tensor

from ._cache import split_slice, stream
from ._checks import check_int, check_split
from ._types import CLS, PAD, ClassificationData, Vocab, pad_rows

MIN, MAX, MED, SM, END = "[MIN", "[MAX", "[MED", "[SM", "X"
OPERATORS = (MIN, MAX, MED, SM)  # the reference's order: rng.choice indexes into it
VALUES = range(10)
VALUE_P = 0.25
MAX_DEPTH = MAX_ARGS = 10

VOCAB = Vocab((PAD, CLS) + tuple(str(d) for d in VALUES) + OPERATORS + (END,))
_ID = {t: i for i, t in enumerate(VOCAB.tokens)}


class _Variant(TypedDict):
    min_length: int
    max_length: int
    sizes: dict[str, int]


VARIANTS: dict[str, _Variant] = {
    "full": {
        "min_length": 500,
        "max_length": 2000,
        "sizes": {"train": 96_000, "valid": 2_000, "test": 2_000},
    },
    "cpu": {
        "min_length": 100,
        "max_length": 500,
        "sizes": {"train": 5_000, "valid": 500, "test": 500},
    },
}

# A leaf is its digit; an operator node is (operator, children).
ListOpsTree = Union[int, "tuple[str, tuple[ListOpsTree, ...]]"]


def listops_generate_tree(
    rng: random.Random, depth: int = 1, *, max_depth: int = MAX_DEPTH, max_args: int = MAX_ARGS
) -> tuple[ListOpsTree, int]:
    """One random ListOps expression, drawn exactly as LRA's ``generate_tree``.

    Args:
        rng: the source of draws; it is called as ``rng.random()``, ``rng.choice(...)`` and
            ``rng.randint(2, max_args)`` in the reference's order (see the module docstring).
        depth: depth of this node; the root is at 1.
        max_depth: nodes at this depth are leaves.
        max_args: most children of an operator node.

    Returns:
        ``(tree, length)``: a leaf is an int 0-9, an operator node ``(operator, children)``;
        ``length`` counts the tokens of its stream.
    """
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        return rng.choice(VALUES), 1
    n = rng.randint(2, max_args)
    children, length = [], 2
    for _ in range(n):
        child, child_length = listops_generate_tree(
            rng, depth + 1, max_depth=max_depth, max_args=max_args
        )
        children.append(child)
        length += child_length
    return (rng.choice(OPERATORS), tuple(children)), length


def listops_parse_and_eval(tokens: str | Sequence[str] | Sequence[int] | Tensor) -> int:
    """Parse a ListOps token stream back into its expression and evaluate it.

    Accepts a whitespace-separated string, a list of tokens, or token ids of the ListOps
    vocabulary (a list or a 1-D tensor, as in ``ClassificationData.tokens``). ``<pad>`` and
    ``<cls>`` are skipped; ``]`` is read as ``X``.

    Example::

        >>> listops_parse_and_eval("[MAX 2 9 [MIN 4 7 X 0 X")
        9

    Raises:
        ValueError: an unknown token, a closing token with nothing open, an operator with no
            arguments or left open, or not exactly one expression.

    Shape:
        tokens ``(L,)``.
    """
    stack: list[tuple[str, list[int]]] = [("", [])]  # the bottom frame holds the result
    for i, tok in enumerate(_as_tokens(tokens)):
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok in (END, "]"):
            if len(stack) == 1:
                raise ValueError(f"token {i}: {tok!r} closes nothing")
            op, args = stack.pop()
            if not args:
                raise ValueError(f"token {i}: {op} has no arguments")
            stack[-1][1].append(_apply(op, args))
        elif len(tok) == 1 and tok.isdigit():
            stack[-1][1].append(int(tok))
        elif tok not in (PAD, CLS):
            raise ValueError(f"token {i}: {tok!r} is not a ListOps token; they are {VOCAB.tokens}")
    if len(stack) > 1:
        raise ValueError(f"{len(stack) - 1} operator(s) left open: {[op for op, _ in stack[1:]]}")
    if len(stack[0][1]) != 1:
        raise ValueError(f"expected one expression, found {len(stack[0][1])} top-level values")
    return stack[0][1][0]


def listops(
    split: str = "train",
    *,
    variant: str = "cpu",
    seed: int = 0,
    size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    valid_size: int | None = None,
    test_size: int | None = None,
    progress: bool = True,
) -> ClassificationData:
    """ListOps: classify a nested MIN/MAX/MED/SM expression by its value (10 classes).

    Args:
        split: ``"train"``, ``"valid"`` or ``"test"``.
        variant: ``"full"`` (LRA's: ``500 < L < 2000``, 96,000 / 2,000 / 2,000) or ``"cpu"``
            (``100 < L < 500``, 5,000 / 500 / 500).
        seed: seeds ``random.Random``; the same seed gives the same tensors.
        size: take the first ``size`` examples of the split (train may grow past its default).
        cache_dir: where the stream is cached (default ``$QKV_CACHE/tasks`` or
            ``~/.cache/qkv/tasks``).
        valid_size: examples in the validation split (default: the variant's).
        test_size: examples in the test split (default: the variant's).
        progress: show progress while generating (a bar on stderr).

    Returns:
        ``ClassificationData``; ``tokens`` carry no ``<cls>``, prepend ``vocab.cls`` in the
        model. The full variant's train split is 96,000 x 1,999 int64 ids, about 1.5 GB.

    Shape:
        tokens ``(N, L)`` with ``L = max_length - 1`` (1999 or 499), mask ``(N, L)``,
        labels ``(N,)``.
    """
    check_split(split)
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {tuple(VARIANTS)}")
    check_int("seed", seed, low=0)
    check_int("size", size, low=1, none_ok=True)
    check_int("valid_size", valid_size, low=0, none_ok=True)
    check_int("test_size", test_size, low=0, none_ok=True)
    spec = VARIANTS[variant]
    lo, hi = spec["min_length"], spec["max_length"]
    sizes = dict(spec["sizes"])
    sizes.update({k: v for k, v in (("valid", valid_size), ("test", test_size)) if v is not None})
    start, stop = split_slice(split, size, sizes)

    def sample(rng: random.Random) -> tuple[bytes, int] | None:
        tree, length = listops_generate_tree(rng)
        if not lo < length < hi:
            return None
        return bytes(_ids(tree, [])), _value(tree)

    def check(flat: Tensor, lengths: Tensor, labels: Tensor) -> str | None:
        if not lengths.numel():
            return None
        if int(flat.min()) < _ID["0"] or int(flat.max()) >= len(VOCAB):
            return "a token id is outside the vocabulary"
        if int(lengths.min()) <= lo or int(lengths.max()) >= hi:
            return f"a length is outside ({lo}, {hi})"
        if int(labels.min()) < 0 or int(labels.max()) > 9:
            return "a label is outside 0-9"
        return None

    s = stream(
        f"listops-{variant}",
        stop,
        seed=seed,
        sample=sample,
        check=check,
        cache_dir=cache_dir,
        progress=progress,
    )
    first = int(s.lengths[:start].sum())
    tokens, mask = pad_rows(s.flat[first:], s.lengths[start:], hi - 1, VOCAB.pad)  # (N, L)
    return ClassificationData(tokens, mask, s.labels[start:], VOCAB, 10, "listops", split)


def _apply(op: str, args: list[int]) -> int:
    if op == MIN:
        return min(args)
    if op == MAX:
        return max(args)
    if op == MED:  # int(np.median(args)): the middle value, or the truncated mean of two
        s, m = sorted(args), len(args) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2
    if op == SM:
        return sum(args) % 10
    raise ValueError(f"{op!r} is not a ListOps operator; they are {OPERATORS}")


def _value(tree: ListOpsTree) -> int:
    """The expression's value, computed on the tree (the parser is the independent twin)."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    return _apply(op, [_value(c) for c in children])


def _tokens(tree: ListOpsTree) -> list[str]:
    """The tree's token stream: ``[MAX 2 9 X``."""
    return VOCAB.decode(_ids(tree, []))


def _ids(tree: ListOpsTree, out: list[int]) -> list[int]:
    if isinstance(tree, int):
        out.append(_ID[str(tree)])
        return out
    op, children = tree
    out.append(_ID[op])
    for c in children:
        _ids(c, out)
    out.append(_ID[END])
    return out


def _as_tokens(tokens: str | Sequence[str] | Sequence[int] | Tensor) -> list[str]:
    if isinstance(tokens, str):
        return tokens.split()
    if isinstance(tokens, Tensor):
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be 1-D, one example; got shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    tokens = list(tokens)
    if tokens and all(isinstance(t, int) for t in tokens):
        if min(tokens) < 0 or max(tokens) >= len(VOCAB):
            raise ValueError(
                f"token ids must lie in [0, {len(VOCAB)}); got {min(tokens)}..{max(tokens)}"
            )
        return VOCAB.decode(tokens)
    return tokens
