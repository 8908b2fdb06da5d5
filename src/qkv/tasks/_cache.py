"""A seeded stream of unique examples, cached on disk and resumable.

A task is a sampler ``sample(rng) -> (example, label) | None`` (None: rejected) run on
``random.Random(seed)``. Accepted examples are de-duplicated in first-seen order, so the
stream is a fixed sequence for a seed and every split is a slice of it. The cache file keeps
the examples so far and the generator's state after the last one: a larger request, or a run
interrupted part-way, continues where the file stops and gives the same examples as an
uninterrupted run.

Files are written atomically (a temporary file in the same folder, then ``os.replace``) and
read with ``torch.load(weights_only=True)``; a file that fails to load or to validate is
regenerated with a warning, never trusted.

Shape alphabet: N examples, F total symbols of all examples.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .._files import write_atomic
from .._progress import Progress

FORMAT = 1  # bump when a sampler, a vocabulary or this file's layout changes
CHECKPOINT_S = 60.0  # a long generation writes what it has this often

Sampler = Callable[[random.Random], "tuple[bytes, int] | None"]
Check = Callable[[Tensor, Tensor, Tensor], "str | None"]


def default_cache_dir() -> Path:
    """``$QKV_CACHE/tasks`` when ``QKV_CACHE`` is set, else ``~/.cache/qkv/tasks``."""
    root = os.environ.get("QKV_CACHE")
    return Path(root) / "tasks" if root else Path.home() / ".cache" / "qkv" / "tasks"


@dataclass(frozen=True, eq=False)
class Stream:
    """The first N examples of a stream, concatenated.

    Shape:
        flat ``(F,)`` uint8, lengths ``(N,)`` int64, labels ``(N,)`` int64.
    """

    flat: Tensor
    lengths: Tensor
    labels: Tensor


def stream(
    key: str,
    n: int,
    *,
    seed: int,
    sample: Sampler,
    check: Check,
    cache_dir: str | os.PathLike | None,
    progress: bool,
) -> Stream:
    """The first ``n`` examples of the stream ``key`` for ``seed``, generating what the cache
    lacks. ``check(flat, lengths, labels)`` returns why a cached file is wrong, or None."""
    path = Path(cache_dir if cache_dir is not None else default_cache_dir())
    path = path / f"{key}-seed{seed}-v{FORMAT}.pt"
    state = _read(path, key, seed, check)
    if state is None or state["lengths"].numel() < n:
        gen = _Generator(key, seed, state)
        gen.run(n, sample, path, progress)
        state = gen.state()
    used = int(state["lengths"][:n].sum())
    return Stream(state["flat"][:used], state["lengths"][:n], state["labels"][:n])


def _read(path: Path, key: str, seed: int, check: Check) -> dict | None:
    if not path.exists():
        return None
    try:
        data = torch.load(path, weights_only=True)
        why = _why_invalid(data, key, seed) or check(data["flat"], data["lengths"], data["labels"])
    except Exception as e:
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0][:200] if lines else ''}"
    if why is None:
        return data
    warnings.warn(
        f"qkv.tasks: cache file {path} is unusable ({why}); regenerating it", stacklevel=4
    )
    return None


def _why_invalid(data: object, key: str, seed: int) -> str | None:
    if not isinstance(data, dict):
        return f"holds a {type(data).__name__}, not a dict"
    if (data.get("format"), data.get("key"), data.get("seed")) != (FORMAT, key, seed):
        return "written for another format, task or seed"
    flat, lengths, labels = data.get("flat"), data.get("lengths"), data.get("labels")
    rng, sampled = data.get("rng_state"), data.get("sampled")
    if not (
        isinstance(flat, Tensor)
        and isinstance(lengths, Tensor)
        and isinstance(labels, Tensor)
        and isinstance(rng, Tensor)
    ):
        return "a field is missing"
    if (flat.dtype, lengths.dtype, labels.dtype, rng.dtype) != (
        torch.uint8,
        torch.int64,
        torch.int64,
        torch.int64,
    ):
        return "a field has the wrong dtype"
    if flat.ndim != 1 or lengths.ndim != 1 or labels.shape != lengths.shape or rng.shape != (625,):
        return "a field has the wrong shape"
    if (lengths < 1).any() or int(lengths.sum()) != flat.numel():
        return f"lengths add up to {int(lengths.sum())}, not the {flat.numel()} symbols stored"
    if not isinstance(sampled, int) or sampled < lengths.numel():
        return "the count of samples drawn is wrong"
    return None


class _Generator:
    """Examples so far, the seen set and the RNG, continued from a cached state or a seed."""

    def __init__(self, key: str, seed: int, state: dict | None) -> None:
        self.key, self.seed = key, seed
        self.rng = random.Random(seed)
        self.flat, self.ends, self.labels = bytearray(), [], []
        self.sampled, self.seen = 0, set()
        if state is not None:
            self.rng.setstate((3, tuple(state["rng_state"].tolist()), None))
            self.flat += _to_bytes(state["flat"])
            self.ends = state["lengths"].cumsum(0).tolist()
            self.labels = state["labels"].tolist()
            self.sampled = state["sampled"]
            starts = [0] + self.ends[:-1]
            self.seen = {bytes(self.flat[a:b]) for a, b in zip(starts, self.ends)}
        self.saved_rng, self.saved_sampled = self.rng.getstate(), self.sampled

    def run(self, n: int, sample: Sampler, path: Path, progress: bool) -> None:
        bar = Progress(n, start=len(self.ends), desc=self.key, unit="ex") if progress else None
        last_write = time.monotonic()
        try:
            while len(self.ends) < n:
                out = sample(self.rng)
                self.sampled += 1
                if out is None or out[0] in self.seen:
                    continue
                example, label = out
                self.seen.add(example)
                self.flat += example
                self.ends.append(len(self.flat))
                self.labels.append(label)
                self.saved_rng, self.saved_sampled = self.rng.getstate(), self.sampled
                if bar is not None:
                    bar.update(len(self.ends), sampled=self.sampled)
                if time.monotonic() - last_write > CHECKPOINT_S:
                    self.write(path)
                    last_write = time.monotonic()
        finally:  # an interrupted run keeps what it made: the next one resumes from here
            if bar is not None:
                bar.__exit__(None, None, None)
            self.write(path)

    def state(self) -> dict:
        # An interrupt can land between the appends of one example: keep whole examples only.
        n = min(len(self.ends), len(self.labels))
        ends = torch.tensor(self.ends[:n], dtype=torch.int64)  # (N,)
        lengths = torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int64))  # (N,)
        version, words, gauss = self.saved_rng
        assert version == 3 and gauss is None, "only the Mersenne Twister state is stored"
        used = self.ends[n - 1] if n else 0
        flat = (
            torch.frombuffer(self.flat, dtype=torch.uint8, count=used).clone()
            if used
            else torch.zeros(0, dtype=torch.uint8)
        )  # (F,)
        return {
            "format": FORMAT,
            "key": self.key,
            "seed": self.seed,
            "flat": flat,
            "lengths": lengths,
            "labels": torch.tensor(self.labels[:n], dtype=torch.int64),
            "rng_state": torch.tensor(words, dtype=torch.int64),
            "sampled": self.saved_sampled,
        }

    def write(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # atomic, and with the mode open() gives under the umask (mkstemp's is 0600)
            write_atomic(path, lambda f: torch.save(self.state(), f))
        except OSError as e:
            warnings.warn(
                f"qkv.tasks: cannot write the cache file {path} ({e}); the data is "
                "generated but not kept",
                stacklevel=4,
            )


def _to_bytes(t: Tensor) -> bytes:
    try:
        return t.numpy().tobytes()
    except (ImportError, RuntimeError):  # torch without numpy
        return bytes(t.tolist())


def split_slice(split: str, size: int | None, sizes: dict[str, int]) -> tuple[int, int]:
    """Where ``split`` lies in a stream laid out as valid, test, train.

    The evaluation splits come first so that they stay the same whatever the size of train;
    ``size`` takes the first ``size`` examples of the split (train may grow past its default).
    """
    start = {"valid": 0, "test": sizes["valid"], "train": sizes["valid"] + sizes["test"]}[split]
    n = sizes[split] if size is None else size
    if split != "train" and n > sizes[split]:
        raise ValueError(
            f"size={n} is more than the {split} split holds ({sizes[split]}); pass "
            f"{split}_size={n} to enlarge it (this moves the splits after it)"
        )
    return start, start + n
