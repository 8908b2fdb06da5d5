"""qkv.tasks: determinism, disjoint splits, the conventions, the ListOps grammar, the cache."""

from __future__ import annotations

import os
import random
import stat
import sys

import fresh
import pytest
import torch

from qkv import tasks
from qkv.tasks import _cache, _listops
from qkv.tasks import listops_generate_tree as generate_tree
from qkv.tasks import listops_parse_and_eval as parse_and_eval

SEQ = ("reverse", "copy", "sort")
SMALL = {"valid_size": 40, "test_size": 40}  # keeps a ListOps stream to a few seconds


@pytest.fixture(autouse=True)
def _no_home_cache(tmp_path, monkeypatch):
    """No test writes to the user's cache, even one that forgets cache_dir."""
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "default-cache"))


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(r[m].tolist()) for r, m in zip(ids, mask)]


def _equal(a, b) -> bool:
    fields = [f for f in vars(a) if isinstance(getattr(a, f), torch.Tensor)]
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in fields)


# ---------------------------------------------------------------- the entry point


def test_tasks_are_named():
    assert tasks.TASKS == ("reverse", "copy", "sort", "listops", "digits", "pathfinder")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda d: tasks.load("reversed", cache_dir=d), "unknown task 'reversed'.*'reverse'"),
        (lambda d: tasks.load("reverse", cache_dir=d, max_length=9), "unknown option.*'max_len'"),
        (lambda d: tasks.load("listops", cache_dir=d, min_len=3), "options are.*'variant'"),
        (lambda d: tasks.load("copy", split="validation", cache_dir=d), "'train', 'valid', 'test'"),
        (lambda d: tasks.load("listops", variant="big", cache_dir=d), "'full', 'cpu'"),
        (lambda d: tasks.load("sort", seed=-1, cache_dir=d), "seed must be an int >= 0"),
        (lambda d: tasks.load("sort", min_len=5, max_len=4, cache_dir=d), "max_len must be"),
        (lambda d: tasks.load("copy", split="test", size=2000, cache_dir=d), "test_size=2000"),
        (lambda d: tasks.load("copy", min_len=1, max_len=1, size=20, cache_dir=d), "only 10"),
        (lambda d: tasks.load("digits", test_fraction=0.95), "test_fraction"),
    ],
    ids=[
        "task",
        "seq-option",
        "listops-option",
        "split",
        "variant",
        "seed",
        "lengths",
        "size",
        "too-few-inputs",
        "fraction",
    ],
)
def test_bad_arguments_name_the_valid_ones(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(tmp_path)


def test_vocab_conventions():
    v = tasks.load("reverse", size=1, cache_dir=None).vocab
    assert v.pad == 0 and v.tokens[v.bos] == "<bos>" and v.tokens[v.eos] == "<eos>"
    assert v.decode(v.encode(["3", "<sep>", "9"])) == ["3", "<sep>", "9"]
    assert not hasattr(v, "cls")
    lv = _listops.VOCAB
    assert len(lv) == 17 and lv.pad == 0 and lv.tokens[lv.cls] == "<cls>"  # 15 tokens + 2
    assert not hasattr(lv, "bos")
    with pytest.raises(ValueError, match=r"'\('"):
        lv.encode(["("])


# ---------------------------------------------------------------- reverse, copy, sort


@pytest.mark.parametrize("task", SEQ)
def test_seq2seq_targets_and_masks(tmp_path, task):
    d = tasks.load(task, split="valid", size=200, cache_dir=tmp_path)
    S = 10
    assert d.src.shape == (200, S) and d.tgt.shape == (200, S + 2)
    assert d.src.dtype == d.tgt.dtype == torch.int64 and d.src_mask.dtype == torch.bool
    assert torch.equal(d.src_mask, d.src != d.vocab.pad)
    assert torch.equal(d.tgt_mask, d.tgt != d.vocab.pad)
    lengths = d.src_mask.sum(1)
    assert lengths.min() >= 4 and lengths.max() <= 10
    assert torch.equal(d.tgt_mask.sum(1), lengths + 2)
    want = {"reverse": lambda x: x[::-1], "copy": lambda x: x, "sort": sorted}[task]
    for src, tgt in zip(_rows(d.src, d.src_mask), _rows(d.tgt, d.tgt_mask)):
        assert list(tgt) == [d.vocab.bos, *want(list(src)), d.vocab.eos]


@pytest.mark.parametrize("task", SEQ)
def test_seq2seq_deterministic_and_seeded(tmp_path, task):
    a = tasks.load(task, seed=1, size=300, cache_dir=tmp_path / "a", **SMALL)
    b = tasks.load(task, seed=1, size=300, cache_dir=tmp_path / "b", **SMALL)
    c = tasks.load(task, seed=2, size=300, cache_dir=tmp_path / "a", **SMALL)
    assert _equal(a, b)
    assert not torch.equal(a.src, c.src)


def test_seq2seq_splits_are_disjoint_and_shared_across_tasks(tmp_path):
    rows = {}
    for split in ("train", "valid", "test"):
        d = tasks.reverse(split, size=40, cache_dir=tmp_path, **SMALL)
        rows[split] = set(_rows(d.src, d.src_mask))
    assert all(len(r) == 40 for r in rows.values())
    assert not (
        rows["train"] & rows["valid"]
        or rows["train"] & rows["test"]
        or rows["valid"] & rows["test"]
    )
    assert torch.equal(
        tasks.sort("test", cache_dir=tmp_path, **SMALL).src,
        tasks.copy("test", cache_dir=tmp_path, **SMALL).src,
    )


def test_a_size_is_a_prefix_and_train_does_not_move_the_evaluation_splits(tmp_path):
    small = tasks.copy("train", size=30, cache_dir=tmp_path, **SMALL)
    large = tasks.copy("train", size=90, cache_dir=tmp_path / "fresh", **SMALL)
    assert torch.equal(small.src, large.src[:30]) and torch.equal(small.tgt, large.tgt[:30])
    test = tasks.copy("test", cache_dir=tmp_path, **SMALL)
    assert torch.equal(test.src, tasks.copy("test", cache_dir=tmp_path / "fresh", **SMALL).src)


def test_longer_inputs_for_the_transformers_are_rnns_copy_task(tmp_path):
    d = tasks.copy(size=5, min_len=100, max_len=128, cache_dir=tmp_path, **SMALL)
    assert d.src.shape == (5, 128) and d.tgt.shape == (5, 130)
    assert torch.equal(d.tgt[:, 1:129][d.src_mask], d.src[d.src_mask])


# ---------------------------------------------------------------- ListOps: semantics


@pytest.mark.parametrize(
    "expr, value",
    [
        ("[MED 1 2 3 4 ]", 2),  # int(np.median) truncates the mean 2.5
        ("[MED 2 3 X", 2),
        ("[MED 1 9 X", 5),
        ("[MED 7 1 4 X", 4),
        ("[SM 5 7 ]", 2),
        ("[SM 9 9 9 X", 7),
        ("[MIN 3 1 8 X", 1),
        ("[MAX 2 9 [MIN 4 7 X 0 X", 9),
        ("[SM [MAX 9 8 X [MIN 3 5 X X", 2),
        ("<cls> [MIN 6 [MED 8 9 X X <pad> <pad>", 6),
        ("4", 4),
    ],
    ids=lambda v: str(v).replace(" ", "_"),
)
def test_listops_operators_closed_form(expr, value):
    assert parse_and_eval(expr) == value
    assert parse_and_eval(expr.split()) == value
    ids = _listops.VOCAB.encode(expr.replace("]", "X").split())
    assert parse_and_eval(torch.tensor(ids)) == value


@pytest.mark.parametrize(
    "expr, match",
    [
        ("[MAX 1 2", "left open"),
        ("X", "closes nothing"),
        ("[MIN X", "no arguments"),
        ("1 2", "found 2 top-level"),
        ("[FIRST 1 X", "not a ListOps token"),
        ("", "found 0"),
    ],
)
def test_listops_parser_rejects_malformed_streams(expr, match):
    with pytest.raises(ValueError, match=match):
        parse_and_eval(expr)


class ScriptedRng:
    """Answers the generator's draws from a script and records what was asked."""

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def random(self):
        self.calls.append("random")
        return self.script.pop(0)

    def randint(self, a, b):
        self.calls.append(f"randint({a},{b})")
        return self.script.pop(0)

    def choice(self, seq):
        self.calls.append("choice(ops)" if seq == _listops.OPERATORS else f"choice({seq})")
        return seq[self.script.pop(0)]


def test_listops_generator_draws_in_the_reference_order():
    # root: r = 0.25 is not > 0.25, so an operator; 2 children, drawn before the operator
    rng = ScriptedRng([0.25, 2, 0.9, 7, 0.2500001, 3, 3])
    tree, length = generate_tree(rng)
    assert rng.calls == [
        "random",
        "randint(2,10)",
        "random",
        "choice(range(0, 10))",
        "random",
        "choice(range(0, 10))",
        "choice(ops)",
    ]
    assert tree == ("[SM", (7, 3)) and length == 4 and not rng.script


def test_listops_generator_makes_leaves_at_max_depth_without_drawing_r():
    rng = ScriptedRng([0.0, 2, 5, 6, 1])  # root operator at depth 9, children at depth 10
    tree, length = generate_tree(rng, depth=9)
    assert rng.calls == [
        "random",
        "randint(2,10)",
        "choice(range(0, 10))",
        "choice(range(0, 10))",
        "choice(ops)",
    ]
    assert tree == ("[MAX", (5, 6)) and length == 4


@pytest.mark.parametrize("seed", range(5))
def test_listops_root_is_a_leaf_exactly_when_r_is_over_a_quarter(seed):
    for i in range(200):
        rng = random.Random(seed * 1000 + i)
        r = random.Random(seed * 1000 + i).random()
        tree, length = generate_tree(rng)
        assert isinstance(tree, int) == (r > 0.25)
        assert length == len(_listops._tokens(tree))
        assert parse_and_eval(_listops._tokens(tree)) == _listops._value(tree)
        assert all(1 < len(node[1]) <= 10 for node in _nodes(tree))


def _nodes(tree):
    if isinstance(tree, int):
        return []
    return [tree] + [n for c in tree[1] for n in _nodes(c)]


# ---------------------------------------------------------------- ListOps: the data


def test_listops_cpu_examples_parse_back_to_their_labels(tmp_path):
    d = tasks.load("listops", split="train", size=60, cache_dir=tmp_path, **SMALL)
    assert d.tokens.shape == (60, 499) and d.labels.shape == (60,) and d.num_classes == 10
    assert torch.equal(d.mask, d.tokens != d.vocab.pad)
    lengths = d.mask.sum(1)
    assert lengths.min() > 100 and lengths.max() < 500
    assert not (d.tokens == d.vocab.cls).any()  # the model prepends <cls>
    for row, label in zip(d.tokens, d.labels):
        assert parse_and_eval(row) == int(label)
    assert len(set(_rows(d.tokens, d.mask))) == 60  # de-duplicated


def test_listops_full_variant_length_bounds(tmp_path):
    d = tasks.listops(
        "valid",
        variant="full",
        size=3,
        valid_size=3,
        test_size=0,
        cache_dir=tmp_path,
        progress=False,
    )
    lengths = d.mask.sum(1)
    assert d.tokens.shape == (3, 1999) and lengths.min() > 500 and lengths.max() < 2000
    assert [parse_and_eval(row) for row in d.tokens] == d.labels.tolist()


def test_listops_is_deterministic_and_splits_are_disjoint(tmp_path):
    kw = dict(size=20, progress=False, **SMALL)
    a = {s: tasks.listops(s, seed=3, cache_dir=tmp_path / "a", **kw) for s in ("train", "test")}
    b = tasks.listops("train", seed=3, cache_dir=tmp_path / "b", **kw)
    c = tasks.listops("train", seed=4, cache_dir=tmp_path / "a", **kw)
    assert _equal(a["train"], b) and not torch.equal(a["train"].tokens, c.tokens)
    assert not set(_rows(a["train"].tokens, a["train"].mask)) & set(
        _rows(a["test"].tokens, a["test"].mask)
    )


def test_listops_progress_on_stderr_with_qkvs_one_bar(tmp_path, monkeypatch, capsys):
    """Generation shows qkv's one progress bar (the trainer's), with or without tqdm."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    tasks.listops("valid", size=5, valid_size=5, test_size=0, cache_dir=tmp_path)
    err = capsys.readouterr().err
    assert "listops-cpu [########################] 5/5 sampled=" in err and "ex/s" in err
    tasks.listops(
        "valid", size=5, valid_size=5, test_size=0, cache_dir=tmp_path / "quiet", progress=False
    )
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- the cache


def _only_file(d):
    (path,) = [p for p in d.iterdir() if p.suffix == ".pt"]
    return path


def test_cache_hit_reads_the_file_and_returns_the_same_data(tmp_path):
    a = tasks.load("listops", size=10, cache_dir=tmp_path, progress=False, **SMALL)
    path = _only_file(tmp_path)
    stamp = path.stat().st_mtime_ns
    b = tasks.load("listops", size=10, cache_dir=tmp_path, progress=False, **SMALL)
    assert _equal(a, b) and path.stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "lengths", "labels"])
def test_a_damaged_cache_file_is_regenerated(tmp_path, damage):
    kw = dict(split="valid", size=12, cache_dir=tmp_path, progress=False, **SMALL)
    a = tasks.load("listops", **kw)
    path = _only_file(tmp_path)
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a torch file" * 10)
    else:
        state = torch.load(path, weights_only=True)
        if damage == "lengths":
            state["lengths"][0] += 1
        else:
            state["labels"][0] = 11
        torch.save(state, path)
    with pytest.warns(UserWarning, match="unusable.*regenerating"):
        b = tasks.load("listops", **kw)
    assert _equal(a, b)
    assert torch.load(path, weights_only=True)["lengths"].numel() == 12


def test_growing_and_interrupted_streams_resume_to_the_same_examples(tmp_path):
    def sampler(fail_at=None):
        count = {"n": 0}

        def sample(rng):
            count["n"] += 1
            if count["n"] == fail_at:
                raise KeyboardInterrupt
            x = rng.randint(0, 99)
            return (bytes([x]), x % 7) if x % 3 else None  # some rejected, some repeated

        return sample

    def run(d, n, fail_at=None):
        return _cache.stream(
            "toy",
            n,
            seed=5,
            sample=sampler(fail_at),
            check=lambda *a: None,
            cache_dir=d,
            progress=False,
        )

    whole = run(tmp_path / "whole", 40)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed", 40, fail_at=25)
    part = torch.load(tmp_path / "resumed" / "toy-seed5-v1.pt", weights_only=True)
    assert 0 < part["lengths"].numel() < 40
    resumed = run(tmp_path / "resumed", 40)
    run(tmp_path / "grown", 10)
    grown = run(tmp_path / "grown", 40)
    for s in (resumed, grown):
        assert torch.equal(s.flat, whole.flat) and torch.equal(s.labels, whole.labels)
    assert len(set(whole.flat.tolist())) == 40  # repeats dropped


def test_default_cache_dir_follows_qkv_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    assert tasks.default_cache_dir() == tmp_path / "tasks"
    tasks.load("sort", size=3)
    assert _only_file(tmp_path / "tasks").name.startswith("digits-seq-len4-10-seed0")
    monkeypatch.delenv("QKV_CACHE")
    assert str(tasks.default_cache_dir()).endswith("/.cache/qkv/tasks")


# ---------------------------------------------------------------- digits


def test_digits_stratified_deterministic_split():
    pytest.importorskip("sklearn", reason="digits needs scikit-learn: pip install 'qkv[train]'")
    parts = {s: tasks.load("digits", split=s) for s in ("train", "valid", "test")}
    assert sum(len(p) for p in parts.values()) == 1797
    for p in parts.values():
        assert p.images.shape[1:] == (1, 8, 8) and p.images.dtype == torch.float32
        assert p.images.min() >= 0 and p.images.max() <= 1 and p.num_classes == 10
        assert set(p.labels.tolist()) == set(range(10))
    assert abs(len(parts["test"]) - 0.2 * 1797) < 10 and abs(len(parts["valid"]) - 180) < 10
    everything = sorted(
        tuple(x.flatten().tolist()) + (int(y),)
        for p in parts.values()
        for x, y in zip(p.images, p.labels)
    )
    from sklearn.datasets import load_digits

    bunch = load_digits()
    original = sorted(
        tuple((torch.tensor(x, dtype=torch.float32) / 16).flatten().tolist()) + (int(y),)
        for x, y in zip(bunch.images, bunch.target)
    )
    assert everything == original  # the splits partition the dataset
    again, other = tasks.digits("test"), tasks.digits("test", seed=1)
    assert _equal(parts["test"], again) and not torch.equal(again.labels, other.labels)
    assert torch.equal(tasks.digits("train", size=7).images, parts["train"].images[:7])


def test_digits_without_scikit_learn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"qkv\[train\]"):
        tasks.digits()


def test_import_qkv_tasks_needs_only_torch():
    # torch itself imports tqdm when it is installed (torch.hub): count only what qkv adds
    code = (
        "import sys, torch; before = set(sys.modules); import qkv.tasks; "
        "print([m for m in ('sklearn', 'tqdm') if m in sys.modules and m not in before])"
    )
    out = fresh.run(code, check=True)  # a fresh interpreter: this one imported everything
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_cache_files_follow_the_umask(tmp_path, umask):
    """Issue 25: cache files came out 0600 whatever the umask (mkstemp's mode). They get what
    open() would give, 0666 & ~umask, and no temporary file is left beside them."""
    before = os.umask(umask)
    try:
        tasks.load("reverse", size=20, cache_dir=tmp_path)
    finally:
        os.umask(before)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(not p.name.endswith(".tmp") for p in files)
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p
