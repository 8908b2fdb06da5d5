"""scikit-learn's bundled 8x8 handwritten digits (1,797 images), for a small ViT.

The images ship inside scikit-learn, so nothing is downloaded and nothing is cached here.
scikit-learn is imported only when this task is loaded (``pip install 'qkv[train]'``).

Shape alphabet: N images.
"""

from __future__ import annotations

import random

import torch

from ._checks import check_int, check_split
from ._types import ImageData


def digits(
    split: str = "train",
    *,
    seed: int = 0,
    size: int | None = None,
    valid_fraction: float = 0.1,
    test_fraction: float = 0.2,
) -> ImageData:
    """The 8x8 digits with a seeded split stratified by class.

    Each class's images are shuffled with ``random.Random(seed)``; its first
    ``round(valid_fraction * n)`` go to valid, the next ``round(test_fraction * n)`` to test and
    the rest to train, and each split is shuffled. Pixels 0-16 are scaled to ``[0, 1]``.

    Args:
        split: ``"train"``, ``"valid"`` or ``"test"`` (about 70 / 10 / 20 % by default).
        seed: seeds the split and the order within it.
        size: take the first ``size`` images of the split.
        valid_fraction: share of each class in valid.
        test_fraction: share of each class in test.

    Returns:
        ``ImageData`` with 10 classes.

    Raises:
        ImportError: scikit-learn is not installed.

    Shape:
        images ``(N, 1, 8, 8)`` float32, labels ``(N,)`` int64.
    """
    check_split(split)
    check_int("seed", seed, low=0)
    check_int("size", size, low=1, none_ok=True)
    for name, f in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not isinstance(f, (int, float)) or not 0 <= f < 1:
            raise ValueError(f"{name} must be in [0, 1); got {f!r}")
    if valid_fraction + test_fraction >= 1:
        raise ValueError(
            f"valid_fraction + test_fraction = {valid_fraction + test_fraction} "
            "leaves no training images; keep the sum under 1"
        )
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            "the digits task reads scikit-learn's bundled images; install it "
            "with pip install 'qkv[train]' (or pip install scikit-learn)"
        ) from e
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N,1,8,8)
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)  # (N,)

    rng = random.Random(seed)
    parts: dict[str, list[int]] = {"train": [], "valid": [], "test": []}
    for c in range(10):
        idx = torch.nonzero(labels == c).flatten().tolist()
        rng.shuffle(idx)
        n_valid, n_test = round(valid_fraction * len(idx)), round(test_fraction * len(idx))
        parts["valid"] += idx[:n_valid]
        parts["test"] += idx[n_valid : n_valid + n_test]
        parts["train"] += idx[n_valid + n_test :]
    for name in ("train", "valid", "test"):
        rng.shuffle(parts[name])
    if size is not None and size > len(parts[split]):
        raise ValueError(f"size={size} is more than the {split} split holds ({len(parts[split])})")
    rows = torch.tensor(parts[split][:size], dtype=torch.int64)  # (N,)
    return ImageData(images[rows], labels[rows], 10, "digits", split)
