"""Pathfinder and Path-X (Long Range Arena, Tay et al. 2020), generated locally.

Are the two marker circles joined by one contour of dashes? LRA built its Pathfinder data
with the "snakes" generator of Linsley et al. 2018 / Kim et al. 2020
(github.com/drewlinsley/pathfinder, ``snakes2.py``), whose Python-2 code needs OpenCV and
``scipy.misc.imresize``. This is a port of its algorithm to numpy, written afresh:

* A contour is a chain of *paddles*: line segments of ``paddle_length`` px, ``thickness``
  wide, with a gap of ``2 * margin`` between consecutive paddles (the next paddle starts
  ``margin`` past a pivot that lies ``margin`` past the last one's end). Each paddle turns
  from the last by an angle drawn with weight ``cos(continuity * turn) ** 2``, so turns stay
  under ``90 / continuity`` degrees.
* Two target contours of ``contour_length`` paddles start ``seed_distance`` apart near the
  centre (at least ``2 * seed_distance`` from the border) and grow in turn. One marker
  circle sits on the start of one of them; the other sits on the end of the same contour
  (label 1) or of the other one (label 0), so both labels show two contours and two markers.
* Distractor contours of ``contour_length // 3`` paddles, ``distractor_paddles //
  (contour_length // 3)`` of them, are seeded anywhere free; the first that finds no room
  in 5 tries ends them (the reference, too, stops when the image is full).
* A new paddle keeps ``clearance`` px (centre line to centre line) from every other
  contour and from the four marker places, and ``2 * margin + thickness`` from its own
  contour's earlier paddles but the last. The reference keeps ``2 * margin`` from everything;
  we keep contours further apart so that whether the markers are joined can be read off the
  pixels (below). Paddles are drawn as anti-aliased capsules (exact box-filter coverage
  across the stroke), markers as anti-aliased discs; strokes are scaled by ``contrast``.

Every image is checked by :func:`pathfinder_connected`, an independent flood fill over the
drawn pixels: ink is a pixel ``>= INK``, two ink pixels are linked when they lie within
``reach`` px (more than a paddle gap, less than the clearance between contours), and the
fill starts at one marker's centre pixel. A sample whose drawn connectivity disagrees with
its intended label is redrawn: measured, about 1 in 30-100 images at 32 px (a clearance of
4 px is a little under the 4.6 that would make a merge impossible; more does not leave room
for hard's contours) and none seen at 64 and 128. Target contours that run out of room take
paddles back (``BACKTRACKS``) before the image starts over.

Parameters: LRA's TFDS builder (``lra_benchmarks/data/pathfinder.py``) lists the settings
it gave ``snakes2`` per resolution; difficulties are its splits ``curv_baseline``,
``curv_contour_length_9`` and ``_14`` (6, 9 and 14 paddles). Path-X is resolution 128.
Strokes at 32 px are ``paddle_contrast 0.75 * snake_contrast 2``; the reference's PNGs were
rescaled to their maximum, ours are clipped to ``[0, 1]`` with markers at 1.

Data: images come in label-balanced pairs (one of each label, in a random order), so every
even-sized prefix of a split holds exactly as many 1s as 0s. The stream is laid out valid,
test, train like ListOps' and cached the same way (atomically, resumable, with progress);
a PNG grid of the split's first samples and labels is written beside the cache file.

Shape alphabet: N images, R resolution (height = width).
"""

from __future__ import annotations

import math
import os
import random
import struct
import zlib
from pathlib import Path
from typing import IO, TYPE_CHECKING

import torch
from torch import Tensor

from ._cache import default_cache_dir, split_slice, stream
from ._checks import check_int, check_split
from ._types import ImageData

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np

DIFFICULTIES = {"easy": 6, "intermediate": 9, "hard": 14}  # paddles per target contour
INK = 0.1  # a pixel at least this bright is ink for the connectivity check
PADDING = 1  # px kept free at the border (LRA: args.padding = 1)
CANDIDATES = 16  # turning angles tried per paddle
DISTRACTOR_TRIES = 5  # reference: max_distractor_contour_retrial = 4 retries
SEEDS = 64  # places tried at once for a distractor's first paddle
TARGET_TRIES = 200
BACKTRACKS = 30  # paddles a target contour may take back per image

# LRA's builder per resolution; paddle_length 5 where it keeps snakes2's default. clearance
# and reach are ours (see the module docstring): reach > 2 * margin + 2 * 0.71 (a paddle gap
# plus a pixel's diagonal half on each side), clearance ~ reach + 2 * ink radius (the ink
# radius is 0.68, 0.88 and 1.14 px at 32, 64 and 128), a little under it at 32 for room.
PRESETS: dict[int, dict] = {
    32: {
        "paddle_length": 2,
        "thickness": 0.5,
        "margins": (1,),
        "continuity": 1.0,
        "marker_radius": 1.5,
        "seed_distance": 7,
        "contrast": 1.5,
        "distractor_paddles": 20,
        "clearance": 4.0,
        "reach": 3.2,
    },
    64: {
        "paddle_length": 5,
        "thickness": 1.0,
        "margins": (1,),
        "continuity": 1.8,
        "marker_radius": 2.5,
        "seed_distance": 12,
        "contrast": 0.8,
        "distractor_paddles": 22,
        "clearance": 5.0,
        "reach": 3.5,
    },
    128: {
        "paddle_length": 5,
        "thickness": 1.5,
        "margins": (2, 3),
        "continuity": 1.8,
        "marker_radius": 3.0,
        "seed_distance": 20,
        "contrast": 0.9,
        "distractor_paddles": 35,
        "clearance": 9.5,
        "reach": 7.5,
    },
}
SIZES = {"train": 10_000, "valid": 1_000, "test": 1_000}
GRID = 64  # samples in the PNG grid


def _np():
    try:
        import numpy
    except ImportError as e:
        raise ImportError(
            "the pathfinder task draws with numpy; install it with pip install numpy"
        ) from e
    return numpy


def pathfinder(
    split: str = "train",
    *,
    seed: int = 0,
    size: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    resolution: int = 32,
    difficulty: str = "easy",
    valid_size: int | None = None,
    test_size: int | None = None,
    progress: bool = True,
    grid: bool = True,
    workers: int | None = None,
) -> ImageData:
    """Pathfinder: are the two markers joined by one contour? (2 classes; 1 = joined.)

    Args:
        split: ``"train"``, ``"valid"`` or ``"test"``; the splits are disjoint.
        seed: seeds the stream; the same seed gives the same tensors.
        size: take the first ``size`` images of the split (train may grow past its default
            of 10,000; LRA used 160,000 / 20,000 / 20,000).
        cache_dir: where the stream and the PNG grid go (default ``$QKV_CACHE/tasks`` or
            ``~/.cache/qkv/tasks``).
        resolution: 32, 64 or 128 (128 is LRA's Path-X).
        difficulty: ``"easy"``, ``"intermediate"`` or ``"hard"``: target contours of 6, 9 or
            14 paddles (LRA's Pathfinder and Path-X use ``"hard"``).
        valid_size: images in the validation split (even; default 1,000).
        test_size: images in the test split (even; default 1,000).
        progress: show progress while generating (a bar on stderr).
        grid: write ``pathfinder{R}-{difficulty}-seed{seed}-{split}.png`` beside the cache
            file: the split's first 64 images, framed green (label 1) or red (label 0) with
            the label written under each.
        workers: processes that draw (default: up to 4 of the CPUs). The images depend on
            the seed only, not on this. A pool starts only after 32 pairs were drawn here.

    Returns:
        ``ImageData`` with 2 classes; every even-sized prefix of a split is label-balanced.

    Raises:
        ValueError: an unknown resolution, difficulty or split, or an odd split size.
        ImportError: numpy is not installed.

    Shape:
        images ``(N, 1, R, R)`` float32 in ``[0, 1]`` (stored as multiples of 1/255),
        labels ``(N,)`` int64.
    """
    check_split(split)
    if resolution not in PRESETS:
        raise ValueError(f"resolution={resolution!r} is not one of {tuple(PRESETS)}")
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r} is not one of {tuple(DIFFICULTIES)}")
    check_int("seed", seed, low=0)
    check_int("size", size, low=1, none_ok=True)
    check_int("workers", workers, low=1, none_ok=True)
    sizes = dict(SIZES)
    for name, value in (("valid", valid_size), ("test", test_size)):
        check_int(f"{name}_size", value, low=0, none_ok=True)
        if value is not None:
            if value % 2:
                raise ValueError(
                    f"{name}_size={value} is odd; images come in label-balanced "
                    f"pairs, pass {value + 1}"
                )
            sizes[name] = value
    _np()
    start, stop = split_slice(split, size, sizes)  # in images; start is even
    side = resolution
    pair_bytes = 2 * side * side

    sample = _Sampler(resolution, difficulty, workers)

    def check(flat: Tensor, lengths: Tensor, labels: Tensor) -> str | None:
        if lengths.numel() and bool((lengths != pair_bytes).any()):
            return f"an example is not a pair of {side}x{side} images"
        if labels.numel() and not bool(((labels == 0) | (labels == 1)).all()):
            return "a label is not 0 or 1"
        return None

    key = f"pathfinder{side}-{difficulty}"
    try:
        s = stream(
            key,
            (stop + 1) // 2,
            seed=seed,
            sample=sample,
            check=check,
            cache_dir=cache_dir,
            progress=progress,
        )
    finally:
        sample.close()
    pixels = s.flat.view(-1, 1, side, side)[start:stop]  # (N, 1, R, R) uint8
    labels = torch.stack([s.labels, 1 - s.labels], dim=1).flatten()[start:stop]  # (N,)
    if grid:
        folder = Path(cache_dir if cache_dir is not None else default_cache_dir())
        _write_grid(folder / f"{key}-seed{seed}-{split}.png", pixels[:GRID], labels[:GRID])
    return ImageData(pixels.float() / 255.0, labels, 2, "pathfinder", split)


def pathfinder_connected(
    image: Tensor | np.ndarray,
    a: tuple[float, float],
    b: tuple[float, float],
    *,
    reach: float = 1.5,
    threshold: float = INK,
) -> bool:
    """Whether the drawn pixels join point ``a`` to point ``b``: a flood fill.

    Ink is every pixel ``>= threshold``; two ink pixels are linked when their centres lie at
    most ``reach`` px apart (1: 4-connectivity, 1.5: 8-connectivity, so diagonal neighbours
    touch; 3.2: a one- or two-pixel gap is bridged). The fill starts at the pixel nearest
    ``a`` and says whether it reaches the pixel nearest ``b``; a point on no ink is joined
    to nothing. The generator uses ``reach`` of its resolution (``PRESETS``).

    Args:
        image: a grey image, values in ``[0, 1]``.
        a: ``(row, column)`` of the first marker's centre.
        b: ``(row, column)`` of the second marker's centre.
        reach: the largest distance between linked ink pixels, in px (>= 1).
        threshold: the least value that is ink.

    Shape:
        image ``(R, W)`` or ``(1, R, W)``.
    """
    np = _np()
    img = image.detach().cpu().numpy() if isinstance(image, Tensor) else np.asarray(image)
    if img.ndim == 3 and img.shape[0] == 1:
        img = img[0]
    if img.ndim != 2:
        raise ValueError(f"image must be (R, W) or (1, R, W); got shape {tuple(img.shape)}")
    if reach < 1:
        raise ValueError(f"reach must be >= 1 px (4-connectivity); got {reach}")
    return _connected(np, img >= threshold, a, b, reach)


# ------------------------------------------------------------------ the generator


def _pair(seed: int, resolution: int, difficulty: str) -> tuple[bytes, int]:
    """One image of each label from ``seed``, in a random order, and the first one's label."""
    np = _np()
    g = np.random.default_rng(seed)
    spec = _spec(resolution, difficulty)
    first = int(g.integers(2))
    images = [_draw(np, g, spec, label)[0] for label in (first, 1 - first)]
    return images[0].tobytes() + images[1].tobytes(), first


class _Sampler:
    """The stream's sampler: one 64-bit seed from the stream's RNG per pair, so a pair depends
    on nothing else. After ``IN_PROCESS`` pairs, the next ``AHEAD`` seeds are read off a copy
    of the RNG and drawn by a process pool, and each call takes its pair from there."""

    IN_PROCESS, AHEAD = 32, 512

    def __init__(self, resolution: int, difficulty: str, workers: int | None) -> None:
        self.args = (resolution, difficulty)
        self.workers = workers if workers is not None else min(4, os.cpu_count() or 1)
        self.calls = 0
        self.ready: dict[int, tuple[bytes, int]] = {}
        self.pool: ProcessPoolExecutor | None = None

    def __call__(self, rng: random.Random) -> tuple[bytes, int]:
        state = rng.getstate()
        seed = rng.getrandbits(64)
        self.calls += 1
        if (
            seed not in self.ready
            and self.workers > 1
            and self.calls > self.IN_PROCESS
            and hasattr(os, "fork")
        ):
            ahead = random.Random()
            ahead.setstate(state)
            seeds = [ahead.getrandbits(64) for _ in range(self.AHEAD)]
            self.ready = dict(zip(seeds, self._map(seeds)))
        if seed in self.ready:
            return self.ready.pop(seed)
        return _pair(seed, *self.args)

    def _map(self, seeds: list[int]) -> list:
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # fork: spawn would re-run the caller's script in each worker (a script without
            # an ``if __name__ == "__main__"`` guard fails); workers run numpy only
            self.pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("fork"))
        n = len(seeds)
        return list(
            self.pool.map(
                _pair,
                seeds,
                [self.args[0]] * n,
                [self.args[1]] * n,
                chunksize=max(1, n // (4 * self.workers)),
            )
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


def _spec(resolution: int, difficulty: str) -> dict:
    spec = dict(PRESETS[resolution], resolution=resolution)
    spec["contour_length"] = cl = DIFFICULTIES[difficulty]
    spec["distractor_length"] = cl // 3
    spec["distractors"] = spec["distractor_paddles"] // (cl // 3)
    return spec


class _Scene:
    """The paddles of one image so far: segments ``(S, 4)`` as ``y0, x0, y1, x1``, the
    contour each belongs to, and the marker places ``(y, x, contour)`` to keep clear."""

    def __init__(self, np, spec: dict, margin: int) -> None:
        self.np, self.spec, self.margin = np, spec, margin
        self.segs = np.zeros((0, 4))
        self.owner = np.zeros(0, dtype=np.int64)
        self.points = np.zeros((0, 3))
        self.self_clearance = 2 * margin + spec["thickness"]
        # a marker is a disc: keep its edge as far from a stroke's edge as strokes keep apart
        self.point_extra = spec["marker_radius"] - spec["thickness"] / 2
        lo, hi = PADDING, spec["resolution"] - 1 - PADDING
        self.lo, self.hi = lo, hi

    def free(self, cand, contour: int, skip: int = -1):
        """Which candidate segments ``(K, 4)`` of ``contour`` keep their distances; ``skip``
        is the index of the segment they follow (their predecessor is allowed close)."""
        np = self.np
        ok = ((cand >= self.lo) & (cand <= self.hi)).all(axis=1)  # (K,)
        if len(self.segs):
            need = np.where(
                self.owner == contour, self.self_clearance**2, self.spec["clearance"] ** 2
            )  # (S,)
            if skip >= 0:
                need[skip] = 0.0
            ok &= (_seg_seg2(np, cand, self.segs) >= need).all(axis=1)  # (K, S) -> (K,)
        others = self.points[self.points[:, 2] != contour]  # (P', 3)
        if len(others):
            d2 = _point_seg2(
                np,
                others[None, :, 0],
                others[None, :, 1],
                cand[:, None, 0],
                cand[:, None, 1],
                cand[:, None, 2],
                cand[:, None, 3],
            )  # (K, P')
            ok &= (d2 >= (self.spec["clearance"] + self.point_extra) ** 2).all(axis=1)
        return ok

    def remove(self, i: int) -> None:
        keep = self.np.arange(len(self.segs)) != i
        self.segs, self.owner = self.segs[keep], self.owner[keep]

    def add(self, seg, contour: int) -> int:
        self.segs = self.np.concatenate([self.segs, seg[None]])
        self.owner = self.np.append(self.owner, contour)
        return len(self.segs) - 1

    def truncate(self, n: int) -> None:
        self.segs, self.owner = self.segs[:n], self.owner[:n]


def _paddles(np, origins, angles, start: float, stop: float):
    """Segments along ``angles`` from ``origins + start * u`` to ``origins + stop * u``."""
    u = np.stack([np.sin(angles), np.cos(angles)], axis=-1)  # (K, 2) as (dy, dx)
    return np.concatenate([origins + start * u, origins + stop * u], axis=-1)  # (K, 4)


def _extend(np, g, scene: _Scene, contour: int, last: int, angle: float):
    """Add one paddle after segment ``last`` of ``contour``; its index and angle, or None.

    The pivot lies ``margin`` past the last paddle's end; the new paddle runs from
    ``margin`` to ``margin + paddle_length`` past the pivot, turned by ``t`` drawn with
    weight ``cos(continuity * t) ** 2`` among the turns that keep their distances.
    """
    spec, m = scene.spec, scene.margin
    c, length = spec["continuity"], spec["paddle_length"]
    end = scene.segs[last, 2:]
    pivot = end + m * np.array([math.sin(angle), math.cos(angle)])
    turns = g.uniform(-math.pi / (2 * c), math.pi / (2 * c), CANDIDATES)  # (K,)
    cand = _paddles(np, pivot[None], angle + turns, m, m + length)  # (K, 4)
    weight = np.cos(c * turns) ** 2 * scene.free(cand, contour, skip=last)  # (K,)
    total = weight.sum()
    if total <= 0:
        return None
    k = int(np.searchsorted(np.cumsum(weight), g.random() * total, side="right"))
    k = min(k, CANDIDATES - 1)
    return scene.add(cand[k], contour), float(angle + turns[k])


def _targets(np, g, scene: _Scene):
    """Two target contours grown in turn from seeds ``seed_distance`` apart; their
    ``(origins (2, 2), terminals (2, 2))``, or None when they ran out of room.

    A contour that finds no room takes its last paddle back and tries again, up to
    ``BACKTRACKS`` times per image (the reference starts the image over instead).
    """
    spec = scene.spec
    side, sd, length = spec["resolution"], spec["seed_distance"], spec["paddle_length"]
    keep = (spec["clearance"] + scene.point_extra) ** 2
    tail_a = g.uniform(2 * sd, side - 1 - 2 * sd, 2)  # (2,)
    seg_a = _paddles(np, tail_a[None], g.uniform(-math.pi, math.pi, 1), 0, length)  # (1, 4)
    if not scene.free(seg_a, 0)[0]:
        return None
    scene.add(seg_a[0], 0)
    scene.points = np.array([[*tail_a, 0]])
    ways = g.uniform(-math.pi, math.pi, CANDIDATES)  # (K,)
    tails_b = tail_a + sd * np.stack([np.sin(ways), np.cos(ways)], axis=-1)  # (K, 2)
    segs_b = _paddles(np, tails_b, g.uniform(-math.pi, math.pi, CANDIDATES), 0, length)
    ok = scene.free(segs_b, 1)  # (K,) ...and A's first paddle keeps clear of B's marker
    ok &= _point_seg2(np, tails_b[:, 0], tails_b[:, 1], *seg_a[0]) >= keep
    if not ok.any():
        return None
    k = int(np.argmax(ok))
    scene.add(segs_b[k], 1)
    scene.points = np.array([[*tail_a, 0], [*tails_b[k], 1]])
    chains = [[(0, _angle(seg_a[0]))], [(1, _angle(segs_b[k]))]]  # (index, angle) per paddle
    backtracks = BACKTRACKS
    while min(len(c) for c in chains) < spec["contour_length"]:
        t = 0 if len(chains[0]) <= len(chains[1]) else 1  # in turn, A first
        step = _extend(np, g, scene, t, *chains[t][-1])
        if step is not None:
            chains[t].append(step)
            continue
        if backtracks == 0 or len(chains[t]) == 1:
            return None
        backtracks -= 1
        gone = chains[t].pop()[0]
        scene.remove(gone)
        chains = [[(i - (i > gone), a) for i, a in c] for c in chains]
    ends = scene.segs[[chains[0][-1][0], chains[1][-1][0]], 2:]  # (2, 2)
    # the terminal marker places, known only now, keep clear of the other contour too
    for t in (0, 1):
        o = scene.segs[scene.owner == 1 - t]  # (S', 4)
        if (
            _point_seg2(np, ends[t, 0], ends[t, 1], o[:, 0], o[:, 1], o[:, 2], o[:, 3]) < keep
        ).any():
            return None
    scene.points = np.concatenate([scene.points, np.array([[*ends[0], 0], [*ends[1], 1]])])
    return scene.points[:2, :2], ends


def _angle(seg) -> float:
    return math.atan2(seg[2] - seg[0], seg[3] - seg[1])


def _distractors(np, g, scene: _Scene) -> None:
    """Short contours seeded anywhere free, ``SEEDS`` places tried at once. One that cannot
    grow to full length is taken back and tried elsewhere, up to ``DISTRACTOR_TRIES`` times;
    the first that never fits ends the image's distractors (the reference likewise stops
    when the image is full)."""
    spec = scene.spec
    for i in range(spec["distractors"]):
        contour = 2 + i
        for _ in range(DISTRACTOR_TRIES):
            n = len(scene.segs)
            tails = g.uniform(scene.lo, scene.hi, (SEEDS, 2))
            cand = _paddles(
                np, tails, g.uniform(-math.pi, math.pi, SEEDS), 0, spec["paddle_length"]
            )  # (SEEDS, 4)
            ok = scene.free(cand, contour)
            if not ok.any():
                return
            k = int(np.argmax(ok))
            step = scene.add(cand[k], contour), _angle(cand[k])
            for _ in range(spec["distractor_length"] - 1):
                step = _extend(np, g, scene, contour, *step)
                if step is None:
                    break
            else:
                break
            scene.truncate(n)  # too short: take it back and try elsewhere
        else:
            return


def _draw(np, g, spec: dict, label: int):
    """One verified image: ``(pixels (R, R) uint8, markers (2, 2), redraws)``."""
    redraws = 0
    while True:
        margin = int(g.choice(spec["margins"]))
        placed = None
        for _ in range(TARGET_TRIES):
            scene = _Scene(np, spec, margin)
            placed = _targets(np, g, scene)
            if placed is not None:
                break
        if placed is None:
            raise RuntimeError(f"no room for two target contours at {spec}")  # not seen
        origins, ends = placed
        _distractors(np, g, scene)
        first = int(g.integers(2))
        markers = np.stack([origins[first], ends[first if label else 1 - first]])  # (2, 2)
        pixels = _render(np, spec, scene.segs, markers)  # (R, R) uint8
        ink = pixels >= math.ceil(INK * 255)
        if _connected(np, ink, markers[0], markers[1], spec["reach"]) == bool(label):
            return pixels, markers, redraws
        redraws += 1


def _render(np, spec: dict, segs, markers):
    """Anti-aliased strokes and marker discs, as uint8.

    A pixel's stroke coverage is the length of ``[d - w/2, d + w/2]`` inside ``[-1/2, 1/2]``
    for its distance ``d`` to the nearest paddle (exact box filtering across a straight
    stroke); a disc's is ``clip(radius + 1/2 - d)``.

    Shape:
        segs ``(S, 4)``, markers ``(2, 2)`` -> ``(R, R)`` uint8.
    """
    side, w = spec["resolution"], spec["thickness"]
    axis = np.arange(side, dtype=np.float64)
    pix = np.stack(np.meshgrid(axis, axis, indexing="ij"), axis=-1).reshape(-1, 1, 2)  # (R*R,1,2)
    d = np.sqrt(
        _point_seg2(
            np, pix[..., 0], pix[..., 1], segs[:, 0], segs[:, 1], segs[:, 2], segs[:, 3]
        ).min(axis=1)
    )  # (R*R,)
    stroke = np.clip(np.minimum(d + w / 2, 0.5) - np.maximum(d - w / 2, -0.5), 0, 1)
    dm = np.sqrt(((pix - markers[None]) ** 2).sum(-1)).min(axis=1)  # (R*R,)
    disc = np.clip(spec["marker_radius"] + 0.5 - dm, 0, 1)
    value = np.clip(np.maximum(spec["contrast"] * stroke, disc), 0, 1)
    return np.rint(value * 255).astype(np.uint8).reshape(side, side)


def _point_seg2(np, py, px, ay, ax, by, bx):
    """Squared distance from points ``(py, px)`` to segments ``a -> b``, broadcast; in
    components, not stacked pairs: these arrays are small and numpy's cost is per call."""
    aby, abx, apy, apx = by - ay, bx - ax, py - ay, px - ax
    t = (apy * aby + apx * abx) / np.maximum(aby * aby + abx * abx, 1e-12)
    t = np.minimum(np.maximum(t, 0.0), 1.0)
    ey, ex = apy - t * aby, apx - t * abx
    return ey * ey + ex * ex


def _seg_seg2(np, s, o):
    """Squared distance between every segment of ``s`` and of ``o``; exact unless they
    cross, and a crossing gives at most ``(paddle_length / 2) ** 2``, under every clearance.

    Shape:
        s ``(K, 4)``, o ``(S, 4)`` -> ``(K, S)``.
    """
    ends = s.reshape(-1, 2, 1, 2)  # (K, 2, 1, yx): s's ends against o
    d1 = _point_seg2(np, ends[..., 0], ends[..., 1], o[:, 0], o[:, 1], o[:, 2], o[:, 3])
    oends = o.reshape(1, -1, 2, 2)  # (1, S, 2, yx): o's ends against s
    k = s[:, None, None, :]  # (K, 1, 1, 4)
    d2 = _point_seg2(
        np, oends[..., 0], oends[..., 1], k[..., 0], k[..., 1], k[..., 2], k[..., 3]
    )  # (K, S, 2)
    return np.minimum(d1.min(axis=1), d2.min(axis=2))


def _connected(np, ink, a, b, reach: float) -> bool:
    """Grow the ink component of pixel ``a`` by ``reach`` at a time until it stops."""
    side_h, side_w = ink.shape
    pa = (round(float(a[0])), round(float(a[1])))
    pb = (round(float(b[0])), round(float(b[1])))
    for p in (pa, pb):
        if not (0 <= p[0] < side_h and 0 <= p[1] < side_w) or not ink[p]:
            return False
    r = math.floor(reach)
    offsets = [
        (dy, dx)
        for dy in range(-r, r + 1)
        for dx in range(-r, r + 1)
        if (dy or dx) and dy * dy + dx * dx <= reach * reach
    ]
    padded = np.zeros((side_h + 2 * r, side_w + 2 * r), dtype=bool)
    reached = np.zeros_like(ink)
    reached[pa] = True
    count = 1
    while not reached[pb]:
        padded[r : r + side_h, r : r + side_w] = reached
        grown = reached.copy()
        for dy, dx in offsets:
            grown |= padded[r + dy : r + dy + side_h, r + dx : r + dx + side_w]
        grown &= ink
        new = int(grown.sum())
        if new == count:
            return False
        reached, count = grown, new
    return True


# ------------------------------------------------------------------ the PNG grid

_DIGITS = {
    0: ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    1: ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
}
_GREEN, _RED = (40, 200, 60), (220, 50, 40)


def _write_grid(path: Path, pixels: Tensor, labels: Tensor, columns: int = 8) -> None:
    """Images framed in their label's colour, the label written under each, as a PNG."""
    from .._files import write_atomic

    n, _, side, _ = pixels.shape
    if n == 0:
        return
    zoom = max(1, 96 // side)
    cell = side * zoom
    frame, strip, gap = 2, 7 * 2 + 4, 4
    cw, ch = cell + 2 * frame + gap, cell + 2 * frame + strip + gap
    rows = (n + columns - 1) // columns
    canvas = torch.full((rows * ch + gap, columns * cw + gap, 3), 255, dtype=torch.uint8)
    for i in range(n):
        y, x = gap + (i // columns) * ch, gap + (i % columns) * cw
        label = int(labels[i])
        colour = torch.tensor(_GREEN if label else _RED, dtype=torch.uint8)
        canvas[y : y + cell + 2 * frame, x : x + cell + 2 * frame] = colour
        big = pixels[i, 0].repeat_interleave(zoom, 0).repeat_interleave(zoom, 1)  # (cell, cell)
        canvas[y + frame : y + frame + cell, x + frame : x + frame + cell] = big[..., None]
        glyph = torch.tensor([[c == "1" for c in row] for row in _DIGITS[label]])  # (7, 5)
        glyph = glyph.repeat_interleave(2, 0).repeat_interleave(2, 1)  # (14, 10)
        gy, gx = y + cell + 2 * frame + 2, x + (cell + 2 * frame - 10) // 2
        canvas[gy : gy + 14, gx : gx + 10][glyph] = colour
    path.parent.mkdir(parents=True, exist_ok=True)
    png = _png(canvas)

    def write(f: IO[bytes]) -> None:
        f.write(png)

    write_atomic(path, write)


def _png(rgb: Tensor) -> bytes:
    """An 8-bit RGB PNG (no filter, zlib), enough for a picture of samples.

    Shape:
        rgb ``(H, W, 3)`` uint8.
    """
    h, w, _ = rgb.shape
    rows = torch.cat([torch.zeros(h, 1, dtype=torch.uint8), rgb.reshape(h, w * 3)], dim=1)
    raw = bytes(rows.flatten().tolist())

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
