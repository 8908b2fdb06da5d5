"""What a task's split looks like: a vocabulary and three shapes of data.

Shape alphabet: N examples, S source length, T target length, L sequence length.
Masks follow the library's convention: True marks a real token, False padding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

PAD, BOS, EOS, SEP, CLS = "<pad>", "<bos>", "<eos>", "<sep>", "<cls>"
SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Vocab:
    """A task's tokens; a token's id is its index in ``tokens``.

    The special tokens a task uses are named by attribute: ``vocab.pad`` is the id of
    ``"<pad>"`` (always 0), and ``vocab.bos``, ``vocab.eos``, ``vocab.sep``, ``vocab.cls``
    exist when the task has them (``hasattr(vocab, "bos")`` tells).

    Example::

        >>> v = Vocab(("<pad>", "<bos>", "<eos>", "0", "1"))
        >>> v.encode(["1", "0"]), v.bos, len(v)
        ([4, 3], 1, 5)
    """

    tokens: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if not self.tokens or self.tokens[0] != PAD:
            raise ValueError(f"a vocabulary starts with {PAD!r} (id 0); got {self.tokens[:1]}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"vocabulary tokens repeat: {self.tokens}")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def pad(self) -> int:
        """Id of ``<pad>`` (0)."""
        return 0

    @property
    def bos(self) -> int:
        """Id of ``<bos>``; ``AttributeError`` when the task has none."""
        return self._special(BOS)

    @property
    def eos(self) -> int:
        """Id of ``<eos>``; ``AttributeError`` when the task has none."""
        return self._special(EOS)

    @property
    def sep(self) -> int:
        """Id of ``<sep>``; ``AttributeError`` when the task has none."""
        return self._special(SEP)

    @property
    def cls(self) -> int:
        """Id of ``<cls>``; ``AttributeError`` when the task has none."""
        return self._special(CLS)

    def _special(self, token: str) -> int:
        if token not in self.tokens:
            raise AttributeError(f"this vocabulary has no {token}; its tokens are {self.tokens}")
        return self.tokens.index(token)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of ``tokens``; a token not in the vocabulary raises ``ValueError``."""
        index = {t: i for i, t in enumerate(self.tokens)}
        try:
            return [index[t] for t in tokens]
        except KeyError as e:
            raise ValueError(
                f"token {e.args[0]!r} is not in the vocabulary {self.tokens}"
            ) from None

    def decode(self, ids: Iterable[int] | Tensor, *, skip_special: bool = False) -> list[str]:
        """Tokens of ``ids`` (a list or a 1-D tensor); ``skip_special`` drops ``<...>`` tokens.

        Shape:
            ids ``(L,)`` -> a list of ``L`` tokens (fewer with ``skip_special``).
        """
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        out = [self.tokens[i] for i in ids]
        return [t for t in out if not _is_special(t)] if skip_special else out


def _is_special(token: str) -> bool:
    return token.startswith("<") and token.endswith(">")


@dataclass(frozen=True, eq=False)  # tensors have no single truth value
class Seq2SeqData:
    """One split of a sequence-to-sequence task, padded to fixed widths.

    ``tgt`` is ``<bos> y <eos>`` then padding, so a decoder is teacher-forced with
    ``tgt[:, :-1]`` as input and ``tgt[:, 1:]`` as labels (loss where ``tgt_mask[:, 1:]``).

    Shape:
        src ``(N, S)`` int64 (digits, no specials), src_mask ``(N, S)`` bool,
        tgt ``(N, T)`` int64 with ``T = S + 2``, tgt_mask ``(N, T)`` bool.
    """

    src: Tensor
    src_mask: Tensor
    tgt: Tensor
    tgt_mask: Tensor
    vocab: Vocab
    task: str
    split: str

    def __len__(self) -> int:
        return self.src.shape[0]


@dataclass(frozen=True, eq=False)
class ClassificationData:
    """One split of a sequence classification task, padded to a fixed width.

    No ``<cls>`` is prepended: a model that classifies from one prepends ``vocab.cls``
    itself (as LRA's models do), extending the mask with a True column.

    Shape:
        tokens ``(N, L)`` int64, mask ``(N, L)`` bool, labels ``(N,)`` int64 in
        ``[0, num_classes)``.
    """

    tokens: Tensor
    mask: Tensor
    labels: Tensor
    vocab: Vocab
    num_classes: int
    task: str
    split: str

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True, eq=False)
class ImageData:
    """One split of an image classification task.

    Shape:
        images ``(N, 1, H, W)`` float32 in ``[0, 1]``, labels ``(N,)`` int64 in
        ``[0, num_classes)``.
    """

    images: Tensor
    labels: Tensor
    num_classes: int
    task: str
    split: str

    def __len__(self) -> int:
        return self.images.shape[0]


def pad_rows(flat: Tensor, lengths: Tensor, width: int, pad: int) -> tuple[Tensor, Tensor]:
    """Lay concatenated rows out as a padded matrix.

    Shape:
        flat ``(sum(lengths),)``, lengths ``(N,)`` -> ids ``(N, width)`` int64 and
        mask ``(N, width)`` bool.
    """
    mask = torch.arange(width) < lengths[:, None]  # (N, width)
    ids = torch.full(mask.shape, pad, dtype=torch.int64)  # (N, width)
    if lengths.numel():
        # pad_sequence is ~10x faster than ids[mask] = flat at ListOps' 96,000 x 1,999
        rows = flat.split(lengths.tolist())
        padded = pad_sequence(rows, batch_first=True, padding_value=pad)  # (N, max(lengths))
        ids[:, : padded.shape[1]] = padded
    return ids, mask
