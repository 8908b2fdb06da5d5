"""qkv.analysis.compare: two captures of one architecture, every head's signed difference and
the heads ranked by how much they changed.

Closed form: hand-made captures of causal uniform heads where one head becomes "attend to
yourself" (its mean and max |d| worked out below) and one moves a little; the changed head
ranks first, the unchanged ones last with 0. Then a real model's captures (the difference is
the subtraction, batch= picks one element), and every mismatch refused by a ValueError that
names it.
"""

import pytest
import torch

import qkv
from qkv.analysis import Comparison, compare
from qkv.capture import Captured, CapturedAttention

F64 = dict(dtype=torch.float64)
T = 4


def uniform_causal() -> torch.Tensor:
    """Row q attends 1/(q+1) to keys 0..q. Shape: (T, T)."""
    return torch.ones(T, T, **F64).tril() / torch.arange(1, T + 1, **F64)[:, None]


def captured(layers: list[torch.Tensor], *, rows=None, batch=(0,), name="blocks.{}") -> Captured:
    """A Captured whose record l holds ``layers[l]`` ``(nb, nh, nr, S)`` as its weights."""
    records = []
    for layer, p in enumerate(layers):
        nb, nh, nr, S = p.shape
        kept_rows = torch.arange(nr) if rows is None else torch.tensor(rows)
        records.append(
            CapturedAttention(
                name.format(layer),
                layer,
                0,
                p,
                torch.zeros(nb, nh, nr, **F64),
                None,
                torch.tensor(batch),
                torch.arange(nh),
                kept_rows,
                (len(batch), nh, S, S),
                "hand",
            )
        )
    return Captured(records, [name.format(i) for i in range(len(layers))], {"model": "hand"})


def before_after() -> tuple[Captured, Captured]:
    """2 layers x 3 heads of uniform causal weights; after: head (1, 2) attends to itself,
    head (0, 1) moves 0.1 of row 1 from key 1 to key 0."""
    before = [uniform_causal().expand(1, 3, T, T).clone() for _ in range(2)]
    after = [p.clone() for p in before]
    after[1][0, 2] = torch.eye(T, **F64)
    after[0][0, 1, 1, :2] = torch.tensor([0.6, 0.4], **F64)
    return captured(after), captured(before)


def test_the_changed_head_ranks_first_with_its_worked_out_numbers():
    """Head (1, 2): d = I - U. Row q of |d| sums to (1 - 1/(q+1)) + q/(q+1) = 2q/(q+1):
    0, 1, 4/3, 3/2, so mean |d| = (23/6) / 16 = 23/96 and max |d| = 1 - 1/4 = 3/4 (row 3's
    diagonal). Head (0, 1): |d| = 0.1 twice, mean 0.2 / 16 = 1/80, max 0.1."""
    after, before = before_after()
    cmp = compare(after, before)
    assert isinstance(cmp, Comparison) and len(cmp) == 6
    assert cmp.keys == ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2))
    assert cmp[1, 2] == pytest.approx({"mean": 23 / 96, "max": 3 / 4}, rel=1e-15)
    assert cmp[0, 1] == pytest.approx({"mean": 1 / 80, "max": 0.1}, rel=1e-12)
    unchanged = [(0, 0), (0, 2), (1, 0), (1, 1)]
    assert cmp.ranked("mean") == [(1, 2), (0, 1), *unchanged]  # ties keep layer, head order
    assert cmp.ranked("max") == [(1, 2), (0, 1), *unchanged]
    assert cmp.top() == [(1, 2)] and cmp.top(2, by="max") == [(1, 2), (0, 1)]
    assert all(cmp[k] == {"mean": 0.0, "max": 0.0} for k in unchanged)
    torch.testing.assert_close(cmp.diff(1, 2), (torch.eye(T, **F64) - uniform_causal())[None])
    assert cmp.diff(1, 2).dtype == torch.float64  # float64 in, float64 out
    rows = cmp.to_rows()
    assert rows[0] == {
        "layer": 1,
        "head": 2,
        "site": "blocks.1",
        "mean": pytest.approx(23 / 96),
        "max": 0.75,
    }
    text = str(cmp).splitlines()
    assert text[0].split() == ["layer", "head", "mean", "|d|", "max", "|d|"]
    assert text[1].split() == ["1", "2", "0.2396", "0.7500"]
    # a - b and b - a: the same magnitudes, opposite signs
    back = compare(before, after)
    assert torch.equal(back.mean, cmp.mean) and torch.equal(back.max, cmp.max)
    torch.testing.assert_close(back.diff(1, 2), -cmp.diff(1, 2))


def test_two_inputs_of_a_model_and_one_batch_element():
    torch.manual_seed(0)
    model = qkv.DecoderLM(20, 16, 2, 2, max_len=16).eval()
    x = torch.randint(1, 20, (2, 9))
    caps = []
    for ids in (x, x.flip(1)):
        with torch.no_grad(), qkv.capture(model) as cap:
            model(ids)
        caps.append(cap)
    a, b = caps
    cmp = compare(a, b)
    for ra, rb in zip(a, b):
        d = ra.probs.float() - rb.probs.float()  # (2, H, T, T): float32 weights, float32 d
        for hi in range(2):
            assert torch.equal(cmp.diff(ra.layer, hi), d[:, hi])
            assert cmp[ra.layer, hi]["mean"] == float(d[:, hi].abs().double().mean())
            assert cmp[ra.layer, hi]["max"] == float(d[:, hi].abs().max())
    one = compare(a, b, batch=1)
    assert torch.equal(one.diff(0, 1), cmp.diff(0, 1)[1:])
    assert one.differences[0].batch.tolist() == [1]
    assert compare(a, a).mean.abs().sum() == 0


def test_mismatched_captures_are_refused_by_name():
    after, before = before_after()
    other_layers = captured([uniform_causal().expand(1, 3, T, T).clone()])
    with pytest.raises(
        ValueError,
        match=r"record different layers \(call 0\): a has 2 "
        r"\(layer 0 blocks.0, layer 1 blocks.1\), b has 1",
    ):
        compare(after, other_layers)
    renamed = captured([r.probs for r in before], name="encoder.{}")
    with pytest.raises(ValueError, match="record different layers"):
        compare(after, renamed)
    short = captured([uniform_causal()[:3, :3].expand(1, 3, 3, 3).clone()] * 2)
    with pytest.raises(
        ValueError,
        match=r"layer 0 \('blocks.0'\): a's call is \(B, H, T, S\) "
        r"\(1, 3, 4, 4\) and b's \(1, 3, 3, 3\); compare "
        r"captures of the same architecture and input length",
    ):
        compare(after, short)
    two_heads = captured([r.probs[:, :2] for r in before])
    with pytest.raises(ValueError, match=r"\(1, 3, 4, 4\) and b's \(1, 2, 4, 4\)"):
        compare(after, two_heads)
    rows = captured([r.probs[:, :, 1:3] for r in before], rows=[1, 2])
    with pytest.raises(
        ValueError,
        match=r"a kept rows \[0, 1, 2, 3\] and b \[1, 2\]; capture "
        r"both with the same rows=",
    ):
        compare(after, rows)
    other_batch = captured([r.probs for r in before], batch=(1,))
    with pytest.raises(ValueError, match=r"a kept batch \[0\] and b \[1\]"):
        compare(after, other_batch)
    with pytest.raises(
        ValueError,
        match=r"batch=3 was not kept by the captures \(kept batch "
        r"elements \[0\]\)",
    ):
        compare(after, before, batch=3)
    with pytest.raises(ValueError, match=r"capture a holds no call 1 \(its calls: \[0\]\)"):
        compare(after, before, call=1)
    with pytest.raises(TypeError, match=r"compare takes two qkv.Captured, got Tensor for b"):
        compare(after, torch.zeros(1))
    with pytest.raises(ValueError, match="by must be 'mean' or 'max'"):
        compare(after, before).ranked("median")
    with pytest.raises(KeyError, match=r"no head \(2, 0\)"):
        compare(after, before)[2, 0]


def test_the_page_of_a_comparison_shows_its_numbers(tmp_path):
    """qkv.viz.html(a, against=compare(a, b, batch=...)) holds the comparison's numbers, and the
    same Changes as html(a, against=b) (the same arithmetic on the batch element shown)."""
    import json
    import re

    torch.manual_seed(0)
    model = qkv.DecoderLM(20, 16, 2, 2, max_len=16).eval()
    x = torch.randint(1, 20, (2, 7))
    caps = []
    for ids in (x, x.flip(1)):
        with torch.no_grad(), qkv.capture(model) as cap:
            model(ids)
        caps.append(cap)
    a, b = caps

    def changes(path, **kw):
        qkv.viz.html(a, path, **kw)
        text = path.read_text()
        meta = json.loads(re.search(r'id="qkv-meta">(.*?)</script>', text, re.S).group(1))
        return [
            (meta["entries"][c["entry"]]["layer"], c["head"], c["mean"], c["max"])
            for c in meta["changes"]
        ]

    cmp = compare(a, b, batch=0)
    want = [(lay, h, cmp[lay, h]["mean"], cmp[lay, h]["max"]) for lay, h in cmp.ranked()]
    assert changes(tmp_path / "c.html", against=cmp) == want
    assert changes(tmp_path / "b.html", against=b) == want
    assert (
        changes(tmp_path / "1.html", against=compare(a, b, batch=1), batch=1)[0][:2]
        == compare(a, b, batch=1).top()[0]
    )
    with pytest.raises(
        ValueError,
        match=r"the comparison covers batch elements \[0, 1\] and the "
        r"page shows batch element 0: compare\(a, b, batch=0\)",
    ):
        qkv.viz.html(a, tmp_path / "x.html", against=compare(a, b))
