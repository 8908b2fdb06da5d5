"""Recipes: a task of ``qkv.tasks`` tied to a model of ``qkv.models``, for :func:`train`.

* ``reverse``, ``copy``, ``sort``: :class:`qkv.Seq2SeqTransformer`, teacher-forced; evaluated
  by greedy decoding, exact match of whole sequences; picture: the last layer's
  cross-attention of a test example (``reverse`` shows the anti-diagonal), and beside it the
  viewer page of that example's cross-attention, every layer and head (:func:`qkv.viz.html`).
* ``listops``: :class:`qkv.EncoderClassifier` (CLS pooling, as LRA); test accuracy.
* ``digits``: :class:`qkv.ViT` on the 8x8 digits (patches of 2x2); test accuracy.
* ``pathfinder``: :class:`qkv.EncoderClassifier` over the pixels as LRA reads images: a
  32x32 image is a sequence of 1,024 tokens in raster order (no patches), each pixel's 8-bit
  value its token id (256 ids, LRA's input embedding), learned positions, mean pooling
  (LRA's Pathfinder config pools by ``MEAN``); test accuracy. Picture: the input and, per
  head of the last layer, the attention each pixel receives, as images.

The evaluation runs in batches of :data:`EVAL_BATCH` test examples; ``evaluation_counts``
takes every N-th batch from a rank's own (a data-parallel run sums the counts of its ranks),
so every example is evaluated in the same batch as one process evaluates it.

The attention kind of every model is a recipe option (``attention="exact" | "linear" |
"performer" | "local"``); the models do not change.

Shape alphabet: B batch, S source length, T target length, L sequence length, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import tasks
from ..capture import capture
from ..models import EncoderClassifier, Seq2SeqTransformer, ViT

__all__ = [
    "RECIPES",
    "ClassifierRecipe",
    "PixelRecipe",
    "Seq2SeqRecipe",
    "ViTRecipe",
    "make_recipe",
]

EVAL_BATCH = 256


class _Recipe:
    """Shared parts: model options, the attention kind, description for checkpoints. A
    subclass sets :attr:`MODEL` and :attr:`METRIC` and defines the task's methods."""

    name = "recipe"
    MODEL: ClassVar[dict[str, Any]]  # the model options, before the ones asked for
    METRIC: ClassVar[str]  # the test metric ``_hits`` counts

    def __init__(
        self,
        task: str,
        *,
        attention: str = "exact",
        attention_options: dict | None = None,
        model: dict | None = None,
        data: dict | None = None,
        cache_dir: str | None = None,
    ) -> None:
        self.task, self.attention = task, attention
        self.attention_options = dict(attention_options or {})
        self.model_options = {**self.MODEL, **(model or {})}
        self.data_options = dict(data or {})
        self.cache_dir, self.name = cache_dir, task
        self.train_data = self._load("train")
        self.test_data = self._load("test")

    def _load(self, split: str):
        opts = dict(self.data_options)  # train_size / test_size: take the first N examples
        size = {k: opts.pop(f"{k}_size", None) for k in ("train", "test")}[split]
        return tasks.load(self.task, split=split, size=size, cache_dir=self.cache_dir, **opts)

    def describe(self) -> dict:
        return dict(
            task=self.task,
            attention=self.attention,
            attention_options=self.attention_options,
            model=self.model_options,
            data=self.data_options,
        )

    def train_size(self) -> int:
        return len(self.train_data)

    def evaluate(self, model, device) -> dict[str, float]:
        """Test metrics: means over the test set, and ``test_examples``."""
        counts = self.evaluation_counts(model, device)
        n = counts.pop("test_examples")
        return {**{k: v / n for k, v in counts.items()}, "test_examples": int(n)}

    def evaluation_counts(self, model, device, rank: int = 0, size: int = 1) -> dict[str, float]:
        """Sums over the test batches ``rank, rank + size, ...`` (of :data:`EVAL_BATCH`
        examples): correct predictions per metric, and ``test_examples``."""
        starts = range(rank * EVAL_BATCH, len(self.test_data), size * EVAL_BATCH)
        hits = sum(self._hits(model, device, slice(s, s + EVAL_BATCH)) for s in starts)
        n = sum(min(EVAL_BATCH, len(self.test_data) - s) for s in starts)
        return {self.METRIC: float(hits), "test_examples": float(n)}

    def _kind(self) -> dict[str, Any]:
        return dict(attention=self.attention, attention_options=self.attention_options or None)

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def batch(self, indices: Tensor, device: torch.device) -> dict[str, Tensor]:
        raise NotImplementedError

    def loss(
        self, model: nn.Module, batch: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor | float], int]:
        raise NotImplementedError

    def _hits(self, model: nn.Module, device: torch.device, batch: slice) -> int:
        """Correct predictions on the test examples ``batch``."""
        raise NotImplementedError

    def pictures(self, model: nn.Module, out_dir: Path, device: torch.device) -> list[str]:
        raise NotImplementedError


class Seq2SeqRecipe(_Recipe):
    """``reverse`` / ``copy`` / ``sort`` with an encoder-decoder Transformer."""

    MODEL: ClassVar[dict[str, Any]] = dict(
        embed_dim=64, num_heads=4, num_layers=2, ffn_dim=128, dropout=0.0
    )
    METRIC = "exact_match"

    def build_model(self) -> nn.Module:
        m = self.model_options
        T = self.train_data.tgt.shape[1]
        return Seq2SeqTransformer(
            len(self.train_data.vocab),
            m["embed_dim"],
            m["num_heads"],
            m["num_layers"],
            ffn_dim=m["ffn_dim"],
            dropout=m["dropout"],
            max_len=max(T, self.train_data.src.shape[1]),
            **self._kind(),
        )

    def batch(self, indices: Tensor, device) -> dict[str, Tensor]:
        d = self.train_data
        return {
            k: getattr(d, k)[indices].to(device) for k in ("src", "src_mask", "tgt", "tgt_mask")
        }

    def loss(self, model, batch):
        logits = model(
            batch["src"],
            batch["tgt"][:, :-1],
            src_key_mask=batch["src_mask"],
            tgt_key_mask=batch["tgt_mask"][:, :-1],
        )  # (B, T-1, V)
        labels, real = batch["tgt"][:, 1:], batch["tgt_mask"][:, 1:]  # (B, T-1)
        loss = F.cross_entropy(logits[real], labels[real])
        acc = (logits.argmax(-1)[real] == labels[real]).float().mean()
        return loss, dict(acc=acc), int(real.sum())

    def loss_count(self, batch: dict[str, Tensor]) -> int:
        """The target tokens the loss averages over (a data-parallel run weights each rank's
        loss by them)."""
        return int(batch["tgt_mask"][:, 1:].sum())

    def predict(self, model, src: Tensor, src_mask: Tensor, T: int) -> Tensor:
        """Greedy decoding. Shape: ``(B, S)`` -> ``(B, T)`` (bos, tokens, eos, padding)."""
        v = self.train_data.vocab
        return model.generate(
            src, T - 1, bos=v.bos, eos=v.eos, pad=v.pad, src_key_mask=src_mask
        )  # (B, T)

    def _hits(self, model, device, batch: slice) -> int:
        """Test examples of ``batch`` decoded exactly (every token)."""
        d = self.test_data
        src, mask, tgt = (t[batch].to(device) for t in (d.src, d.src_mask, d.tgt))
        return int((self.predict(model, src, mask, tgt.shape[1]) == tgt).all(-1).sum())

    def pictures(self, model, out_dir: Path, device) -> list[str]:
        from ..viz.heatmap import plot_attention  # matplotlib is optional

        d, v = self.test_data, self.test_data.vocab
        S, T = int(d.src_mask[0].sum()), int(d.tgt_mask[0].sum())
        src, tgt = d.src[:1, :S].to(device), d.tgt[:1, : T - 1].to(device)
        _, maps = model(src, tgt, return_attention=True)
        probs = maps.cross[-1].probs[0]  # (H, T-1, S): the last layer's cross-attention
        path = plot_attention(
            probs,
            Path(out_dir) / "cross_attention.png",
            query_labels=[v.tokens[i] for i in d.tgt[0, : T - 1]],
            key_labels=[v.tokens[i] for i in d.src[0, :S]],
            titles=[f"cross-attention, last layer, head {h + 1}" for h in range(probs.shape[0])],
        )
        return [str(path), str(self._page(model, src, tgt, path.with_suffix(".html")))]

    def _page(self, model, src: Tensor, tgt: Tensor, path: Path) -> Path:
        """The viewer page of the example's cross-attention, every layer and head."""
        from ..viz.html import html

        v = self.test_data.vocab
        cross = [n for n, _ in model.named_modules() if n.rpartition(".")[2] == "cross_attn"]
        with capture(model, layers=cross) as cap:
            model(src, tgt)
        queries, keys = v.decode(tgt[0]), v.decode(src[0])
        return html(
            cap, path, (queries, keys), title=f"{self.task}: cross-attention of {' '.join(keys)}"
        )


class ClassifierRecipe(_Recipe):
    """``listops`` with an encoder classifier (CLS pooling, as LRA)."""

    MODEL: ClassVar[dict[str, Any]] = dict(
        embed_dim=64, num_heads=4, num_layers=2, ffn_dim=128, dropout=0.1
    )
    METRIC = "accuracy"

    def build_model(self) -> nn.Module:
        m, d = self.model_options, self.train_data
        return EncoderClassifier(
            len(d.vocab),
            d.num_classes,
            m["embed_dim"],
            m["num_heads"],
            m["num_layers"],
            pooling="cls",
            ffn_dim=m["ffn_dim"],
            dropout=m["dropout"],
            max_len=d.tokens.shape[1],
            **self._kind(),
        )

    def batch(self, indices: Tensor, device) -> dict[str, Tensor]:
        d = self.train_data
        return {k: getattr(d, k)[indices].to(device) for k in ("tokens", "mask", "labels")}

    def loss(self, model, batch):
        logits = model(batch["tokens"], key_mask=batch["mask"])  # (B, classes)
        loss = F.cross_entropy(logits, batch["labels"])
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return loss, dict(acc=acc), int(batch["mask"].sum())

    def _hits(self, model, device, batch: slice) -> int:
        d = self.test_data
        x, m, y = (t[batch].to(device) for t in (d.tokens, d.mask, d.labels))
        return int((model(x, key_mask=m).argmax(-1) == y).sum())

    def pictures(self, model, out_dir: Path, device) -> list[str]:
        """The last layer's attention on the shortest test example (CLS first), per head."""
        from ..viz.heatmap import plot_attention

        d = self.test_data
        i = int(d.mask.sum(-1).argmin())
        L = int(d.mask[i].sum())
        _, maps = model(d.tokens[i : i + 1, :L].to(device), return_attention=True)
        probs = maps.encoder[-1].probs[0]  # (H, 1 + L, 1 + L): CLS and the tokens
        labels = ["CLS"] + [d.vocab.tokens[t] for t in d.tokens[i, :L]]
        path = plot_attention(
            probs,
            Path(out_dir) / "attention_last_layer.png",
            query_labels=labels,
            key_labels=labels,
            annotate_max=0,
            titles=[
                f"last layer, head {h + 1} (label {int(d.labels[i])})"
                for h in range(probs.shape[0])
            ],
        )
        page = _page(
            model,
            (d.tokens[i : i + 1, :L].to(device),),
            path.with_suffix(".html"),
            labels,
            f"{self.task}: label {int(d.labels[i])}",
        )
        return [str(path), str(page)]


class ViTRecipe(_Recipe):
    """``digits`` with a ViT on 2x2 patches."""

    MODEL: ClassVar[dict[str, Any]] = dict(
        embed_dim=64, num_heads=4, num_layers=3, ffn_dim=128, dropout=0.1, patch_size=2
    )
    METRIC = "accuracy"

    def build_model(self) -> nn.Module:
        m, d = self.model_options, self.train_data
        return ViT(
            d.images.shape[-1],
            m["patch_size"],
            d.num_classes,
            m["embed_dim"],
            m["num_heads"],
            m["num_layers"],
            in_channels=d.images.shape[1],
            ffn_dim=m["ffn_dim"],
            dropout=m["dropout"],
            **self._kind(),
        )

    def batch(self, indices: Tensor, device) -> dict[str, Tensor]:
        d = self.train_data
        return dict(images=d.images[indices].to(device), labels=d.labels[indices].to(device))

    def loss(self, model, batch):
        logits = model(batch["images"])  # (B, classes)
        loss = F.cross_entropy(logits, batch["labels"])
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return loss, dict(acc=acc), batch["images"].shape[0]

    def _hits(self, model, device, batch: slice) -> int:
        d = self.test_data
        return int((model(d.images[batch].to(device)).argmax(-1).cpu() == d.labels[batch]).sum())

    def pictures(self, model, out_dir: Path, device) -> list[str]:
        from ..viz.heatmap import plot_attention

        image = self.test_data.images[:1].to(device)
        _, maps = model(image, return_attention=True)
        probs = maps.encoder[-1].probs[0]  # (H, 1 + P, 1 + P): CLS and the patches
        path = plot_attention(probs, Path(out_dir) / "attention_last_layer.png", annotate_max=0)
        labels = ["CLS"] + [f"patch {p}" for p in range(probs.shape[-1] - 1)]
        page = _page(
            model,
            (image,),
            path.with_suffix(".html"),
            labels,
            f"{self.task}: label {int(self.test_data.labels[0])}",
        )
        return [str(path), str(page)]


class PixelRecipe(ClassifierRecipe):
    """``pathfinder``: an image as a sequence of pixel tokens, as LRA (Tay et al. 2020, sec.
    3.4-3.5): an ``R x R`` image is ``R * R`` tokens in raster order, the token of a pixel its
    8-bit value (0-255). LRA embeds the 8-bit pixel as a token; so do we, rather than a
    linear map of the value, because a table of 256 vectors lets the model give the ink
    levels of paddles and markers their own directions from the first step, and the images
    are stored as exact multiples of 1/255, so no information is lost. No padding, no CLS:
    mean pooling over the ``R * R`` outputs (LRA's ``classifier_pool = "MEAN"``).
    """

    MODEL: ClassVar[dict[str, Any]] = dict(
        embed_dim=32, num_heads=2, num_layers=1, ffn_dim=64, dropout=0.0, pooling="mean"
    )
    LEVELS = 256

    def __init__(self, task: str, **kwargs) -> None:
        super().__init__(task, **kwargs)
        self.train_tokens = pixel_tokens(self.train_data.images)  # (N, R * R) uint8
        self.test_tokens = pixel_tokens(self.test_data.images)  # (N, R * R) uint8

    def _load(self, split: str):
        opts = dict(self.data_options)
        size = {k: opts.pop(f"{k}_size", None) for k in ("train", "test")}[split]
        asked = self.data_options.get("test_size")
        if asked:  # generate the test split at the size taken (images come in pairs)
            opts["test_size"] = asked + asked % 2
        return tasks.load(self.task, split=split, size=size, cache_dir=self.cache_dir, **opts)

    def build_model(self) -> nn.Module:
        m, d = self.model_options, self.train_data
        return EncoderClassifier(
            self.LEVELS,
            d.num_classes,
            m["embed_dim"],
            m["num_heads"],
            m["num_layers"],
            pooling=m["pooling"],
            ffn_dim=m["ffn_dim"],
            dropout=m["dropout"],
            max_len=self.train_tokens.shape[1],
            **self._kind(),
        )

    def batch(self, indices: Tensor, device) -> dict[str, Tensor]:
        return dict(
            tokens=self.train_tokens[indices].to(device).long(),  # (B, R * R)
            labels=self.train_data.labels[indices].to(device),
        )

    def loss(self, model, batch):
        logits = model(batch["tokens"])  # (B, classes)
        loss = F.cross_entropy(logits, batch["labels"])
        acc = (logits.argmax(-1) == batch["labels"]).float().mean()
        return loss, dict(acc=acc), batch["tokens"].numel()

    def loss_count(self, batch: dict[str, Tensor]) -> int:
        return batch["labels"].shape[0]

    def _hits(self, model, device, batch: slice) -> int:
        x = self.test_tokens[batch].to(device).long()  # (B, R * R)
        return int((model(x).argmax(-1).cpu() == self.test_data.labels[batch]).sum())

    def pictures(self, model, out_dir: Path, device) -> list[str]:
        """The first test image and, per head of the last layer, the attention each pixel
        receives (the mean over the queries), drawn as images; the viewer page beside it."""
        try:  # a bare Figure, never pyplot: headless, the caller's backend left alone
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("plotting attention needs matplotlib: pip install 'qkv[viz]'") from e
        image, label = self.test_data.images[0, 0], int(self.test_data.labels[0])
        R = image.shape[-1]
        x = self.test_tokens[:1].to(device).long()  # (1, R * R)
        logits, maps = model(x, return_attention=True)
        probs = maps.encoder[-1].probs[0].float().cpu()  # (H, R * R, R * R)
        received = probs.mean(1).view(-1, R, R)  # (H, R, R)
        H = received.shape[0]
        fig = Figure(figsize=(2.6 * (H + 1), 3.2))
        axes = fig.subplots(1, H + 1, squeeze=False)[0]
        panels = [(image, f"input (label {label}, predicted {int(logits.argmax())})", "gray")]
        panels += [
            (received[h], f"last layer, head {h + 1}:\nattention received", "viridis")
            for h in range(H)
        ]
        for ax, (picture, title, cmap) in zip(axes, panels):
            ax.imshow(picture.numpy(), cmap=cmap)
            ax.set_title(title, fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
        fig.tight_layout()
        path = Path(out_dir) / "attention_last_layer.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        labels = [f"({r},{c})" for r in range(R) for c in range(R)]
        page = _page(model, (x,), path.with_suffix(".html"), labels, f"{self.task}: label {label}")
        return [str(path), str(page)]


def pixel_tokens(images: Tensor) -> Tensor:
    """Images in ``[0, 1]`` as 8-bit pixel tokens in raster order.

    Shape:
        ``(N, 1, R, R)`` float -> ``(N, R * R)`` uint8.
    """
    return (images.flatten(1) * 255).round().clamp(0, 255).to(torch.uint8)  # (N, R * R)


def _page(model: nn.Module, inputs: tuple, path: Path, labels: list[str], title: str) -> Path:
    """The viewer page of one example: every attention layer and head of ``model(*inputs)``."""
    from ..viz.html import html

    with capture(model) as cap:
        model(*inputs)
    return html(cap, path, labels, title=title)


RECIPES = {
    "reverse": Seq2SeqRecipe,
    "copy": Seq2SeqRecipe,
    "sort": Seq2SeqRecipe,
    "listops": ClassifierRecipe,
    "digits": ViTRecipe,
    "pathfinder": PixelRecipe,
}


def make_recipe(task: str, **kwargs) -> _Recipe:
    """The recipe of ``task`` (one of :data:`RECIPES`)."""
    if task not in RECIPES:
        raise ValueError(f"unknown task {task!r}; qkv train knows {sorted(RECIPES)}")
    return RECIPES[task](task, **kwargs)
