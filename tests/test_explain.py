"""`qkv explain`: the seeds' seven steps with exact numbers, multi-head walks, input errors."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
import qkv.viz
from qkv.cli import main
from qkv.cli.explain import MULTI_STEPS, SINGLE_STEPS, example_problem, load_problem, multi_head
from qkv.examples import EXAMPLES

F64 = torch.float64


def explain(capsys, *argv):
    """Run `qkv explain argv`; its stdout, which must come with exit code 0 and no stderr."""
    assert main(["explain", *argv]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def table(text, title, nrows, ncols, after=""):
    """The numbers of the printed table called ``title`` (the first after ``after``).

    Tables may stand side by side: the title is found at the start of a block (column 0 or after
    the gap between blocks) and the rows are read from that column on.
    """
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    for i in range(start, len(lines)):
        line = lines[i]
        c = line.find(title)
        rest = line[c + len(title) :]
        if c >= 0 and (c == 0 or line[:c].endswith("    ")) and (not rest or rest[:2] == "  "):
            rows = [lines[i + 2 + r][c:].split()[1 : 1 + ncols] for r in range(nrows)]
            return torch.tensor([[float(x) for x in row] for row in rows], dtype=F64)
    raise AssertionError(f"no table {title!r} after {after!r}")


def steps(text):
    return re.findall(r"^Step (\d+)/(\d+): (.*)$", text, flags=re.M)


def plain_attention(x, w_q, w_k, w_v, scale):
    """Independent twin: softmax(Q K^T * scale) V in plain torch."""
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    probs = torch.softmax(q @ k.T * scale, dim=-1)
    return probs, probs @ v


def seed_tensors(name):
    t = EXAMPLES[name].tensors(F64)
    return t["x"], t["w_q"], t["w_k"], t["w_v"]


SEED004 = EXAMPLES["seed004"].expected
SEED004_SCALED = EXAMPLES["seed004-scaled"].expected["outputs"]


# ---- the seven steps, single head ---------------------------------------------------------


def test_seed004_seven_steps_in_order(capsys):
    text = explain(capsys)  # seed004 is the default
    assert steps(text) == [(str(i + 1), "7", s) for i, s in enumerate(SINGLE_STEPS)]
    assert SINGLE_STEPS == (
        "prepare inputs",
        "initialise weights",
        "derive Q, K, V",
        "scores",
        "softmax",
        "multiply scores with values",
        "sum weighted values",
    )
    assert "Seed 004" in text and "scale: 1 (none: no scaling), the example's own" in text


def test_seed004_exact_numbers(capsys):
    text = explain(capsys, "--example", "seed004")
    q = table(text, "Q = x W_Q", 3, 3, after="Step 3/7")
    assert q.tolist() == [[1, 0, 2], [2, 2, 2], [2, 1, 3]]
    assert table(text, "V = x W_V", 3, 3).tolist() == [[1, 2, 3], [2, 8, 0], [2, 6, 3]]
    assert table(text, "scores", 3, 3, after="Step 4/7").tolist() == SEED004["scores"]
    want = {"weights": SEED004["probs"], "outputs": SEED004["outputs"]}
    for name, after in (("weights", "Step 5/7"), ("outputs", "Step 7/7")):
        got = table(text, name, 3, 3, after=after)
        torch.testing.assert_close(
            got, torch.tensor(want[name], dtype=F64), rtol=6e-6, atol=5e-7, msg=name
        )
    assert "0.0633789" in text and "6.03366e-06" in text  # 6 significant digits by default
    assert re.search(r"x1\s+1\.93662\s+6\.68311\s+1\.59507$", text, flags=re.M)


def test_digits_sets_printed_precision(capsys):
    text = explain(capsys, "--digits", "8")
    assert re.search(r"x1\s+1\.936621\d\s+6\.683105\d\s+1\.595068\d$", text, flags=re.M)
    got = table(text, "weights", 3, 3, after="Step 5/7")
    torch.testing.assert_close(got, torch.tensor(SEED004["probs"], dtype=F64), rtol=0, atol=5e-7)
    assert "0.0633789 " not in text  # not the 6-digit rendering
    assert "0.063378938" in text


def test_seed004_weighted_values_per_query_key_pair(capsys):
    """Step 6 shows weight_ij * v_j, one row per key j; step 7's outputs are their sums."""
    text = explain(capsys)
    x, w_q, w_k, w_v = seed_tensors("seed004")
    probs, _ = plain_attention(x, w_q, w_k, w_v, 1.0)
    v = x @ w_v
    for i in range(3):
        got = table(text, f"query x{i + 1}: weight * v", 3, 3, after="Step 6/7")
        torch.testing.assert_close(got, probs[i, :, None] * v, rtol=6e-6, atol=1e-12)
    assert got[1, 0] == pytest.approx(1.76107, abs=5e-6)  # 0.8805369 * 2


def test_seed004_says_where_the_tutorial_rounded(capsys):
    text = explain(capsys)
    tail = text[text.index("Where the tutorial rounded") :]
    rounded = table(tail, "tutorial's softmax (rounded)", 3, 3)
    assert rounded.tolist() == [[0, 0.5, 0.5], [0, 1, 0], [0, 0.9, 0.1]]
    torch.testing.assert_close(
        table(tail, "exact softmax", 3, 3),
        torch.tensor(SEED004["probs"], dtype=F64),
        rtol=6e-6,
        atol=5e-7,
    )
    assert table(tail, "tutorial's outputs (rounded)", 3, 3).tolist() == [
        [2, 7, 1.5],
        [2, 8, 0],
        [2, 7.8, 0.3],
    ]
    diffs = re.findall(r"largest difference: (\S+) \(row (\w+), column (\w+)\)", tail)
    assert diffs == [("0.0633789", "x1", "x1"), ("0.316895", "x1", "1")]  # 7 - 6.683105
    assert "note: the seed rounds the softmax" in tail


def test_seed000_numbers_and_rounding(capsys):
    text = explain(capsys, "--example", "seed000")
    assert steps(text) == [(str(i + 1), "7", s) for i, s in enumerate(SINGLE_STEPS)]
    assert "scale: 1/sqrt(d_k) = 1/sqrt(2) = 0.707107, the example's own" in text
    assert table(text, "Q = x W_Q", 2, 2).tolist() == [[1, 2], [1, 1]]
    torch.testing.assert_close(
        table(text, "scores", 2, 2, after="Step 4/7"),
        torch.tensor([[1, 2], [1, 1]], dtype=F64) / math.sqrt(2),
        rtol=6e-6,
        atol=0,
    )
    assert re.search(r"^x1\s+0\.330238\s+0\.669762$", text, flags=re.M)
    tail = text[text.index("Where the tutorial rounded") :]
    assert table(tail, "tutorial's outputs (rounded)", 2, 2).tolist() == [[0.33, 0.67], [0.5, 0.5]]
    assert "largest difference: 0.000238451 (row x1, column 1)" in tail
    assert "rounds b_1 to (0.33, 0.67)" in tail


# ---- --scale -----------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["1/sqrt(d_k)", "sqrt", str(1 / math.sqrt(3))])
def test_scale_sqrt_dk_on_seed004(capsys, spelling):
    text = explain(capsys, "--scale", spelling)
    scores = table(text, "scores", 3, 3, after="Step 4/7")
    torch.testing.assert_close(
        scores, torch.tensor(SEED004["scores"], dtype=F64) / math.sqrt(3), rtol=6e-6, atol=0
    )
    torch.testing.assert_close(
        table(text, "outputs", 3, 3, after="Step 7/7"),
        torch.tensor(SEED004_SCALED, dtype=F64),
        rtol=6e-6,
        atol=5e-7,
    )
    assert re.search(r"^x1\s+1\.86387\s+6\.31937\s+1\.70419$", text, flags=re.M)
    assert "--scale" in text.splitlines()[2]
    assert "run without --scale to compare them" in text  # the tutorial's numbers use scale 1


def test_scale_number_and_none(capsys):
    text = explain(capsys, "--scale", "0.5")
    assert "scale: 0.5, --scale" in text
    assert table(text, "scores", 3, 3, after="Step 4/7").tolist() == [
        [1, 2, 2],
        [2, 8, 6],
        [2, 6, 5],
    ]
    text = explain(capsys, "--example", "seed000", "--scale", "none")
    assert "scale: 1 (none: no scaling), --scale" in text
    assert table(text, "scores", 2, 2, after="Step 4/7").tolist() == [[1, 2], [1, 1]]
    text = explain(capsys, "--example", "seed004", "--scale", "none")  # its own: still compared
    assert "tutorial's softmax (rounded)" in text


# ---- --heads -----------------------------------------------------------------------------


def _head_reference(name, heads, scale):
    """Per-head weights and outputs in plain torch, heads on contiguous column chunks."""
    x, w_q, w_k, w_v = seed_tensors(name)
    d = w_q.shape[1] // heads
    cols = [slice(h * d, (h + 1) * d) for h in range(heads)]
    pairs = [plain_attention(x, w_q[:, c], w_k[:, c], w_v[:, c], scale) for c in cols]
    return [p for p, _ in pairs], [o for _, o in pairs]


def test_heads_3_on_seed004(capsys):
    text = explain(capsys, "--heads", "3")
    assert steps(text) == [(str(i + 1), "10", s) for i, s in enumerate(MULTI_STEPS)]
    assert "scale per head: 1 (none: no scaling), the example's own" in text
    assert table(text, "head 2: Q_2", 3, 1).tolist() == [[0], [2], [1]]  # column 1 of Q
    probs, outs = _head_reference("seed004", 3, 1.0)
    for h in range(3):
        got = table(text, f"head {h + 1}: weights", 3, 3, after="Step 6/10")
        torch.testing.assert_close(got, probs[h], rtol=6e-6, atol=1e-12)
        got = table(text, f"head {h + 1}: output", 3, 1, after="Step 8/10")
        torch.testing.assert_close(got, outs[h], rtol=6e-6, atol=1e-12)
    torch.testing.assert_close(
        table(text, "outputs", 3, 3, after="Step 10/10"),
        torch.cat(outs, dim=1),
        rtol=6e-6,
        atol=1e-12,
    )
    assert table(text, "head 2: scores", 3, 3).tolist() == [[0, 0, 0], [2, 8, 6], [1, 4, 3]]
    assert "Where the tutorial rounded" not in text


def test_heads_2_on_seed000_closed_form(capsys):
    """head_dim = 1, scale 1/sqrt(1): head 1 scores [[1,0],[1,0]], head 2 [[0,2],[0,1]]."""
    text = explain(capsys, "--example", "seed000", "--heads", "2")
    assert "scale per head: 1/sqrt(head_dim) = 1/sqrt(1) = 1" in text
    assert table(text, "head 1: Q_1", 2, 1).tolist() == [[1], [1]]  # q^{1,1}, q^{2,1}
    assert table(text, "head 2: Q_2", 2, 1).tolist() == [[2], [1]]  # q^{1,2}, q^{2,2}
    e = math.e
    want = torch.tensor([[e / (1 + e), e**2 / (1 + e**2)], [e / (1 + e), e / (1 + e)]], dtype=F64)
    torch.testing.assert_close(
        table(text, "concat", 2, 2, after="Step 9/10"), want, rtol=6e-6, atol=0
    )
    torch.testing.assert_close(
        table(text, "outputs", 2, 2, after="Step 10/10"), want, rtol=6e-6, atol=0
    )


def _mha_like(x, w_q, w_k, w_v, w_o, heads):
    """qkv.MultiHeadAttention loaded with the explain problem's weights."""
    C = x.shape[1]
    m = qkv.MultiHeadAttention(C, heads, bias=False, dtype=F64)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([w_q.T, w_k.T, w_v.T]))
        m.out_proj.weight.copy_(w_o.T)
        out, trace = m(x, return_trace=True)
    torch.testing.assert_close(m.W_Q, w_q, rtol=0, atol=0)  # loaded the seeds' way round
    return out, trace


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_multi_head_matches_multiheadattention(tmp_path, capsys, heads):
    """d_model == d_k == d_v: explain's walk is qkv.MultiHeadAttention's computation."""
    g = torch.Generator().manual_seed(heads)
    x, w_q, w_k, w_v, w_o = (
        torch.randn(*s, generator=g, dtype=F64) for s in ((5, 4), (4, 4), (4, 4), (4, 4), (4, 4))
    )
    path = tmp_path / "in.json"
    path.write_text(
        json.dumps(
            {
                "x": x.tolist(),
                "w_q": w_q.tolist(),
                "w_k": w_k.tolist(),
                "w_v": w_v.tolist(),
                "w_o": w_o.tolist(),
            }
        )
    )
    walk = multi_head(load_problem(str(path)), heads)
    out, trace = _mha_like(x, w_q, w_k, w_v, w_o, heads)
    torch.testing.assert_close(walk.probs, trace.probs)  # (H, T, S)
    torch.testing.assert_close(walk.heads, trace.heads)  # (H, T, D)
    torch.testing.assert_close(walk.out, out)
    text = explain(capsys, "--input", str(path), "--heads", str(heads))
    torch.testing.assert_close(
        table(text, "outputs", 5, 4, after="Step 10/10"), out, rtol=6e-6, atol=1e-6
    )
    torch.testing.assert_close(
        table(text, "head 1: weights", 5, 5, after="Step 6/10"),
        trace.probs[0],
        rtol=6e-6,
        atol=1e-9,
    )


def test_multi_head_matches_multiheadattention_seed000():
    x, w_q, w_k, w_v = seed_tensors("seed000")
    walk = multi_head(example_problem("seed000"), 2)
    out, trace = _mha_like(x, w_q, w_k, w_v, torch.eye(2, dtype=F64), 2)
    torch.testing.assert_close(walk.probs, trace.probs)
    torch.testing.assert_close(walk.heads, trace.heads)
    torch.testing.assert_close(walk.out, out)


# ---- --input -----------------------------------------------------------------------------


def write_json(tmp_path, data, name="in.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


GOOD = {
    "x": [[1, 0], [0, 1], [1, 1]],
    "w_q": [[1, 0], [0, 1]],
    "w_k": [[1, 0], [0, 1]],
    "w_v": [[1, 2, 0], [0, 1, 3]],
}


def test_input_file_with_tokens_scale_and_w_o(tmp_path, capsys):
    data = dict(GOOD, tokens=["I", "love", "cats"], scale="none", w_o=[[1], [1], [1]])
    path = write_json(tmp_path, data)
    text = explain(capsys, "--input", path)
    assert f'scale: 1 (none: no scaling), "scale" in {path}' in text
    assert re.search(r"^\s+I\s+love\s+cats$", text, flags=re.M)  # key labels
    x, w_q, w_k, w_v = (torch.tensor(GOOD[k], dtype=F64) for k in ("x", "w_q", "w_k", "w_v"))
    probs, outs = plain_attention(x, w_q, w_k, w_v, 1.0)
    torch.testing.assert_close(
        table(text, "weights", 3, 3, after="Step 5/7"), probs, rtol=6e-6, atol=0
    )
    torch.testing.assert_close(
        table(text, "outputs", 3, 3, after="Step 7/7"), outs, rtol=6e-6, atol=0
    )
    assert "Where the tutorial rounded" not in text
    text = explain(capsys, "--input", path, "--heads", "1", "--scale", "2")
    assert "scale per head: 2, --scale" in text
    probs, outs = plain_attention(x, w_q, w_k, w_v, 2.0)
    torch.testing.assert_close(
        table(text, "outputs", 3, 1, after="Step 10/10"),
        outs.sum(1, keepdim=True),
        rtol=6e-6,
        atol=0,
    )  # W^O sums


def test_input_file_default_scale_is_1_over_sqrt_dk(tmp_path, capsys):
    text = explain(capsys, "--input", write_json(tmp_path, GOOD))
    assert "scale: 1/sqrt(d_k) = 1/sqrt(2) = 0.707107, the default" in text
    assert re.search(r"^x1\s+0\.707107\s+0\s+0\.707107$", text, flags=re.M)  # scores row 1


def _error(capsys, argv, quiet=True):
    rc = main(["explain", *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == "" or not quiet  # input errors stop before the walk is printed
    assert err.count("\n") == 1 and err.startswith("qkv explain: error: "), err
    return err


BAD_FILES = {
    "invalid-json": ('{"x": [[1, 2]', r"in\.json is not valid JSON: Expecting .* line 1"),
    "not-an-object": ("[1, 2]", r"expected a JSON object .* got a list"),
    "missing-key": ({k: v for k, v in GOOD.items() if k != "w_v"}, r"missing key 'w_v'"),
    "unknown-key": (dict(GOOD, w_0=[[1]]), r"unknown key 'w_0'; allowed keys: x, w_q"),
    "not-a-matrix": (dict(GOOD, x=5), r'"x" must be a non-empty list of rows .* got a number'),
    "empty": (dict(GOOD, x=[]), r'"x" must be a non-empty list of rows'),
    "string-cell": (
        dict(GOOD, w_q=[[1, "a"], [0, 1]]),
        r'"w_q"\[0\]\[1\] is "a", not a finite number',
    ),
    "bool-cell": (dict(GOOD, x=[[1, 0], [0, True], [1, 1]]), r'"x"\[1\]\[1\] is true'),
    "null-cell": (dict(GOOD, w_k=[[1, None], [0, 1]]), r'"w_k"\[0\]\[1\] is null'),
    "nan-cell": (
        '{"x": [[NaN, 1]], "w_q": [[1], [1]], "w_k": [[1], [1]], "w_v": [[1], [1]]}',
        r'"x"\[0\]\[0\] is NaN, not a finite number',
    ),
    "huge-int": (
        '{"x": [[1%s]], "w_q": [[1]], "w_k": [[1]], "w_v": [[1]]}' % ("0" * 400),
        r'"x"\[0\]\[0\] is 10+, not a finite number',
    ),
    "ragged": (
        dict(GOOD, x=[[1, 0], [0], [1, 1]]),
        r'"x" is ragged: row 1 has 1 numbers, row 0 has 2',
    ),
    "w_q-rows": (
        dict(GOOD, w_q=[[1, 0], [0, 1], [1, 1]]),
        (
            r'"w_q" is \(3, 2\) but x has d_model = 2 columns; w_q must be '
            r"\(d_model, d_k\)"
        ),
    ),
    "w_v-rows": (dict(GOOD, w_v=[[1, 2, 0]]), r'"w_v" is \(1, 3\) but x has d_model = 2'),
    "w_k-vs-w_q": (dict(GOOD, w_k=[[1], [0]]), r'"w_k" is \(2, 1\) but "w_q" is \(2, 2\)'),
    "w_o-rows": (
        dict(GOOD, w_o=[[1, 0], [0, 1]]),
        r'"w_o" is \(2, 2\) but d_v = 3; w_o must be \(d_v, d_out\)',
    ),
    "tokens-count": (
        dict(GOOD, tokens=["a", "b"]),
        r'"tokens" must be a list of T = 3 non-empty strings',
    ),
    "tokens-type": (dict(GOOD, tokens=[1, 2, 3]), r'"tokens" must be a list of T = 3'),
    "scale-in-file": (
        dict(GOOD, scale="big"),
        (
            r'"scale" must be none, 1/sqrt\(d_k\) \(or sqrt\) or a finite number, '
            r"got 'big'"
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_input_file_one_line_exit_2(tmp_path, capsys, case):
    data, pattern = BAD_FILES[case]
    err = _error(capsys, ["--input", write_json(tmp_path, data)])
    assert re.search(pattern, err), err


def test_missing_file(tmp_path, capsys):
    err = _error(capsys, ["--input", str(tmp_path / "nope.json")])
    assert re.search(r"cannot read .*nope\.json: No such file or directory", err)


BAD_ARGS = {
    "scale-word": (["--scale", "huge"], r"--scale must be none, 1/sqrt\(d_k\) .* got 'huge'"),
    "scale-inf": (["--scale", "inf"], r"--scale must be .* finite number, got 'inf'"),
    "heads-not-divisor": (
        ["--heads", "2"],
        (
            r"--heads 2 must divide d_k = 3 and d_v = 3 .* "
            r"valid N: 1, 3$"
        ),
    ),
    "heads-seed000": (
        ["--example", "seed000", "--heads", "3"],
        r"--heads 3 must divide d_k = 2 and d_v = 2 .* valid N: 1, 2$",
    ),
    "heads-zero": (["--heads", "0"], r"--heads 0 must divide .* valid N: 1, 3"),
    "digits": (["--digits", "0"], r"--digits must be between 1 and 17, got 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_arguments_one_line_exit_2(capsys, case):
    argv, pattern = BAD_ARGS[case]
    err = _error(capsys, argv)
    assert re.search(pattern, err.strip()), err


def test_heads_error_names_d_v_when_only_d_v_fails(tmp_path, capsys):
    path = write_json(tmp_path, GOOD)  # d_k = 2, d_v = 3
    err = _error(capsys, ["--input", path, "--heads", "2"])
    assert "d_k = 2 and d_v = 3" in err and "valid N: 1" in err


def test_input_and_example_are_exclusive(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["explain", "--example", "seed000", "--input", write_json(tmp_path, GOOD)])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_bad_file_in_a_real_process_has_no_traceback(tmp_path):
    path = write_json(tmp_path, dict(GOOD, x=[[1, 0], [0]]))
    script = Path(sys.executable).with_name("qkv")  # the installed console script
    cmd = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "import sys; from qkv.cli import main; sys.exit(main())"]
    )
    run = subprocess.run(
        [*cmd, "explain", "--input", path], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("qkv explain: error: ") and run.stderr.count("\n") == 1
    assert "ragged" in run.stderr


# ---- --plot ------------------------------------------------------------------------------


def test_plot_writes_one_panel_per_head(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    seen = []
    real = qkv.viz.plot_attention

    def spy(probs, path, **kw):
        seen.append((tuple(probs.shape), kw["titles"], kw["query_labels"]))
        return real(probs, path, **kw)

    monkeypatch.setattr(qkv.viz, "plot_attention", spy)
    one = tmp_path / "new" / "one.png"
    text = explain(capsys, "--plot", str(one))
    assert f"wrote {one}: attention weights, 1 panel" in text
    three = tmp_path / "three.png"
    text = explain(capsys, "--heads", "3", "--plot", str(three))
    assert f"wrote {three}: attention weights, 3 panels" in text
    assert seen == [
        ((1, 3, 3), ["head 1"], ["x1", "x2", "x3"]),
        ((3, 3, 3), ["head 1", "head 2", "head 3"], ["x1", "x2", "x3"]),
    ]
    h1, w1 = imread(one).shape[:2]
    h3, w3 = imread(three).shape[:2]
    assert 200 < h1 < 2000 and h3 == h1  # one row of panels either way
    assert w3 > 2 * w1  # three panels side by side


def test_plot_adds_png_suffix(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    text = explain(capsys, "--plot", str(tmp_path / "weights"))
    assert (tmp_path / "weights.png").is_file()
    assert f"wrote {tmp_path / 'weights.png'}" in text


def test_plot_where_it_cannot_write_is_one_line_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "file.txt").write_text("")
    target = tmp_path / "file.txt" / "a.png"  # its parent is a file
    err = _error(capsys, ["--plot", str(target)], quiet=False)
    assert f"cannot write {target}" in err
