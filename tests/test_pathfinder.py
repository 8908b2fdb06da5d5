"""qkv.tasks.pathfinder: determinism, disjoint balanced splits, the label check, the cache."""

from __future__ import annotations

import random

import pytest
import torch

from qkv import tasks
from qkv.tasks import _pathfinder as pf
from qkv.tasks import pathfinder, pathfinder_connected

np = pytest.importorskip("numpy")
SMALL = {"valid_size": 8, "test_size": 8, "progress": False}


@pytest.fixture(autouse=True)
def _no_home_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "default-cache"))


def _draws(resolution: int, difficulty: str, n: int, seed: int = 0):
    """``n`` verified drawings with their geometry: (pixels, markers, label, scene)."""
    spec = pf._spec(resolution, difficulty)
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pixels, markers, _ = pf._draw(np, g, spec, i % 2)
        out.append((pixels, markers, i % 2))
    return spec, out


# ---------------------------------------------------------------- the flood fill


def _grid(rows: list[str]):
    return np.array([[c == "#" for c in r] for r in rows], dtype=np.float32)


@pytest.mark.parametrize(
    "rows, reach, joined",
    [
        (["#....", "###..", "..###"], 1.0, True),  # a 4-connected path
        (["#....", ".#...", "..#.#"], 1.5, False),  # diagonal steps join, the gap at col 3 not
        (["#....", ".#...", "..#.#"], 2.0, True),  # ...unless reach bridges one pixel
        (["#....", ".#...", "..#.#"], 1.0, False),  # 4-connectivity: diagonal pixels don't touch
        (["#.#.#", ".....", "#.#.#"], 1.5, False),
        (["#..#.", ".....", "...##"], 3.2, True),  # a 3 px jump then a 2.0 one
    ],
    ids=["path", "diagonal-8", "gap-2", "diagonal-4", "dots", "jumps"],
)
def test_connected_on_hand_drawn_arrays(rows, reach, joined):
    image = _grid(rows)
    b = (len(rows) - 1, len(rows[0]) - 1)
    assert pathfinder_connected(image, (0, 0), b, reach=reach) is joined
    assert pathfinder_connected(torch.from_numpy(image)[None], b, (0, 0), reach=reach) is joined


def test_connected_needs_ink_at_both_points_and_a_threshold():
    image = _grid(["##.", "...", "..."])
    assert not pathfinder_connected(image, (0, 0), (2, 2), reach=5)  # (2, 2) is not ink
    faint = image * 0.05
    assert not pathfinder_connected(faint, (0, 0), (0, 1))
    assert pathfinder_connected(faint, (0, 0), (0, 1), threshold=0.04)
    with pytest.raises(ValueError, match="reach must be >= 1"):
        pathfinder_connected(image, (0, 0), (0, 1), reach=0.5)
    with pytest.raises(ValueError, match=r"\(R, W\)"):
        pathfinder_connected(np.zeros((2, 3, 3)), (0, 0), (0, 1))


# ---------------------------------------------------------------- the generator


@pytest.mark.parametrize("difficulty", ["easy", "intermediate", "hard"])
def test_target_contours_have_the_difficultys_length_and_paddle_gaps(difficulty):
    spec = pf._spec(32, difficulty)
    assert spec["contour_length"] == {"easy": 6, "intermediate": 9, "hard": 14}[difficulty]
    g = np.random.default_rng(3)
    for _ in range(3):
        scene = pf._Scene(np, spec, 1)
        while (placed := pf._targets(np, g, scene)) is None:
            scene = pf._Scene(np, spec, 1)
        counts = np.bincount(scene.owner, minlength=2)
        assert counts[0] == counts[1] == spec["contour_length"]
        # consecutive paddles: the gap is 2 * margin on a straight run, less on a turn
        for t in (0, 1):
            segs = scene.segs[scene.owner == t]
            gaps = np.hypot(*(segs[1:, :2] - segs[:-1, 2:]).T)
            assert (gaps <= 2 + 1e-9).all() and (gaps > 2 * np.cos(np.pi / 4) - 1e-9).all()
            lengths = np.hypot(*(segs[:, 2:] - segs[:, :2]).T)
            assert np.allclose(lengths, spec["paddle_length"])
        origins, ends = placed  # the marker places: a contour's first and last points
        assert np.allclose(origins, [scene.segs[scene.owner == t][0, :2] for t in (0, 1)])
        assert np.allclose(ends, [scene.segs[scene.owner == t][-1, 2:] for t in (0, 1)])


def test_the_flood_fill_agrees_with_every_generated_label():
    data = pathfinder("valid", **SMALL, cache_dir=None)
    reach = pf.PRESETS[32]["reach"]
    spec, draws = _draws(32, "easy", 12, seed=7)
    for pixels, markers, label in draws:
        assert pathfinder_connected(pixels / 255, *markers, reach=reach) is bool(label)
    # and on the stored images: the markers are the two full discs' centres
    for image, label in zip(data.images, data.labels):
        centres = _disc_centres(image[0].numpy(), spec["marker_radius"])
        assert pathfinder_connected(image, *centres, reach=reach) is bool(label)


def _disc_centres(image, radius):
    """The two pixels whose neighbourhood is brightest: the marker discs (strokes are dimmer
    and thinner)."""
    r = int(radius)
    padded = np.pad(image, r)
    side = image.shape[0]
    total = sum(
        padded[r + dy : r + dy + side, r + dx : r + dx + side]
        for dy in range(-r, r + 1)
        for dx in range(-r, r + 1)
    )
    first = np.unravel_index(np.argmax(total), total.shape)
    yy, xx = np.mgrid[:side, :side]
    total[(yy - first[0]) ** 2 + (xx - first[1]) ** 2 <= (2 * radius + 1) ** 2] = -1
    return first, np.unravel_index(np.argmax(total), total.shape)


@pytest.mark.parametrize("resolution", [32, 64])
def test_shapes_dtypes_and_balance(tmp_path, resolution):
    d = pathfinder("test", resolution=resolution, cache_dir=tmp_path, grid=False, **SMALL)
    assert d.images.shape == (8, 1, resolution, resolution) and d.images.dtype == torch.float32
    assert d.labels.dtype == torch.int64 and d.num_classes == 2 and d.task == "pathfinder"
    assert d.images.min() >= 0 and d.images.max() == 1  # the markers are full white
    assert int(d.labels.sum()) == 4
    for k in range(0, 8, 2):  # every pair holds one image of each label
        assert d.labels[k] + d.labels[k + 1] == 1


def test_deterministic_seeded_disjoint_and_balanced_splits(tmp_path):
    kw = dict(cache_dir=tmp_path, grid=False, **SMALL)
    parts = {s: pathfinder(s, size=8, **kw) for s in ("train", "valid", "test")}
    for p in parts.values():
        assert int(p.labels.sum()) == len(p) // 2
    again = pathfinder("valid", cache_dir=tmp_path / "again", grid=False, **SMALL)
    other = pathfinder("valid", seed=1, cache_dir=tmp_path, grid=False, **SMALL)
    assert torch.equal(again.images, parts["valid"].images)
    assert torch.equal(again.labels, parts["valid"].labels)
    assert not torch.equal(other.images, again.images)
    seen = [tuple(x.flatten().tolist()) for p in parts.values() for x in p.images]
    assert len(set(seen)) == len(seen)  # no image in two splits, nor twice in one
    prefix = pathfinder("valid", size=4, **kw)
    assert torch.equal(prefix.images, parts["valid"].images[:4])


def test_load_names_it_and_checks_its_options(tmp_path):
    d = tasks.load(
        "pathfinder",
        split="valid",
        size=2,
        cache_dir=tmp_path,
        valid_size=2,
        test_size=2,
        progress=False,
        grid=False,
    )
    assert len(d) == 2
    with pytest.raises(ValueError, match="one of \\(32, 64, 128\\)"):
        pathfinder(resolution=48, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="'easy', 'intermediate', 'hard'"):
        pathfinder(difficulty="medium", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"valid_size=7 is odd.*pass 8"):
        pathfinder(valid_size=7, cache_dir=tmp_path)


# ---------------------------------------------------------------- the cache and the grid


def test_cache_round_trip_and_a_damaged_file_regenerated(tmp_path):
    kw = dict(split="valid", cache_dir=tmp_path, grid=False, **SMALL)
    a = pathfinder(**kw)
    (path,) = tmp_path.glob("pathfinder32-easy-seed0-v*.pt")
    stamp = path.stat().st_mtime_ns
    b = pathfinder(**kw)
    assert torch.equal(a.images, b.images) and path.stat().st_mtime_ns == stamp
    state = torch.load(path, weights_only=True)
    state["lengths"][0] -= 1
    state["lengths"][1] += 1
    torch.save(state, path)
    with pytest.warns(UserWarning, match="not a pair of 32x32 images.*regenerating"):
        c = pathfinder(**kw)
    assert torch.equal(a.images, c.images) and torch.equal(a.labels, c.labels)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.warns(UserWarning, match="unusable"):
        assert torch.equal(pathfinder(**kw).images, a.images)


def test_the_png_grid_is_written_beside_the_cache(tmp_path):
    d = pathfinder("test", cache_dir=tmp_path, **SMALL)
    png = tmp_path / "pathfinder32-easy-seed0-test.png"
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert width > 8 * 96 and height > 96 and len(d) == 8
    pil = pytest.importorskip("PIL.Image")
    with pil.open(png) as im:
        pixels = np.asarray(im.convert("RGB"))
    assert pixels.shape == (height, width, 3)
    assert (pixels == pf._GREEN).all(-1).any() and (pixels == pf._RED).all(-1).any()


def test_a_pair_depends_on_its_seed_only():
    a, b = pf._pair(123, 32, "easy"), pf._pair(123, 32, "easy")
    assert a == b and len(a[0]) == 2 * 32 * 32
    sampler = pf._Sampler(32, "easy", workers=1)
    rng = random.Random(5)
    seed = random.Random(5).getrandbits(64)
    assert sampler(rng) == pf._pair(seed, 32, "easy")
