"""qkv.viz heatmaps: one panel per head, labelled axes, weights in the cells, a real PNG."""

import fresh
import pytest
import torch

import qkv
from qkv.viz import heatmap_axes, heatmap_figure, plot_attention

pytest.importorskip("matplotlib")


def probs(H, T, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(H, T, S, generator=g, dtype=torch.float64), dim=-1)


def tick_labels(axis_ticks):
    return [t.get_text() for t in axis_ticks]


def test_one_panel_per_head_and_one_colorbar():
    p = probs(3, 4, 5)
    fig = heatmap_figure(p, query_labels=list("abcd"), key_labels=list("vwxyz"))
    panels = heatmap_axes(fig)
    assert len(panels) == 3
    assert len(fig.axes) == 4  # plus the shared colorbar, which has no image
    assert [ax.get_title() for ax in panels] == ["head 1", "head 2", "head 3"]
    for h, ax in enumerate(panels):
        assert tick_labels(ax.get_xticklabels()) == list("vwxyz")  # keys across
        assert tick_labels(ax.get_yticklabels()) == list("abcd")  # queries down
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("key", "query")
        torch.testing.assert_close(torch.as_tensor(ax.images[0].get_array().data), p[h])
        texts = [t.get_text() for t in ax.texts]
        assert texts == [f"{w:.2f}" for w in p[h].flatten().tolist()]  # row by row


def test_two_dim_weights_give_one_panel_and_custom_titles():
    fig = heatmap_figure(probs(1, 3, 3)[0], titles=["seed 004"])
    (ax,) = heatmap_axes(fig)
    assert ax.get_title() == "seed 004"
    assert tick_labels(ax.get_xticklabels()) == ["1", "2", "3"]


def test_many_heads_wrap_into_rows_of_four():
    fig = heatmap_figure(probs(6, 2, 2))
    panels = heatmap_axes(fig)
    assert len(panels) == 6 and len(fig.axes) == 7  # spare grid slots are removed
    rows = sorted({round(ax.get_position().y0, 3) for ax in panels})
    assert len(rows) == 2


def test_cells_are_annotated_only_up_to_annotate_max():
    assert len(heatmap_axes(heatmap_figure(probs(1, 12, 12)))[0].texts) == 144
    assert len(heatmap_axes(heatmap_figure(probs(1, 13, 4)))[0].texts) == 0
    assert len(heatmap_axes(heatmap_figure(probs(1, 3, 3), annotate_max=2))[0].texts) == 0


def test_takes_a_trace():
    q, k, v = (torch.randn(2, 5, 4, dtype=torch.float64) for _ in range(3))
    _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
    panels = heatmap_axes(heatmap_figure(trace))
    assert len(panels) == 2
    torch.testing.assert_close(
        torch.as_tensor(panels[1].images[0].get_array().data), trace.probs[1]
    )


def test_plot_attention_writes_a_png(tmp_path):
    from matplotlib.image import imread

    path = plot_attention(
        probs(2, 3, 3),
        tmp_path / "deep" / "er" / "attn.png",
        query_labels=["x1", "x2", "x3"],
        key_labels=["x1", "x2", "x3"],
    )
    assert path == tmp_path / "deep" / "er" / "attn.png"
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    img = imread(path)
    h, w, channels = img.shape
    assert 250 < h < 1500 and 2 * h < w < 4 * h and channels in (3, 4)  # two panels in a row
    assert img[..., :3].std() > 0.05  # not a blank canvas


@pytest.mark.parametrize(
    "bad, kw, err, match",
    [
        (
            torch.rand(1, 2, 3, 3),
            {},
            ValueError,
            r"\(H, T, S\) or \(T, S\).*got shape \(1, 2, 3, 3\)",
        ),
        (
            torch.rand(2, 3, 3),
            dict(query_labels=["a"]),
            ValueError,
            r"query_labels has 1 entries, need 3",
        ),
        (
            torch.rand(2, 3, 4),
            dict(key_labels=list("abc")),
            ValueError,
            r"key_labels has 3 entries, need 4",
        ),
        (torch.rand(2, 3, 3), dict(titles=["one"]), ValueError, r"titles has 1 entries, need 2"),
        (
            [[0.5, 0.5]],
            {},
            TypeError,
            r"probs must be a torch.Tensor or an AttentionTrace, got list",
        ),
    ],
)
def test_bad_arguments(bad, kw, err, match):
    with pytest.raises(err, match=match):
        heatmap_figure(bad, **kw)


def test_viz_imports_matplotlib_lazily_and_never_pyplot(tmp_path):
    """Importing qkv.viz needs no matplotlib; plotting is headless and leaves pyplot alone."""
    code = (
        "import sys, torch, qkv.viz\n"
        "print('matplotlib' in sys.modules)\n"
        f"qkv.viz.plot_attention(torch.eye(2), {str(tmp_path / 'a.png')!r})\n"
        "print('matplotlib.pyplot' in sys.modules)\n"
    )
    env_free = fresh.run(code, check=True, env={"PATH": "/usr/bin:/bin", "MPLBACKEND": ""})
    assert env_free.stdout.split() == ["False", "False"]
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_long_maps_keep_a_bounded_panel_size():
    """A 600-token map gets the 12-inch panel of a 100-token one, not one 72 inches wide."""
    sizes = {}
    for n in (100, 600):
        fig = heatmap_figure(torch.softmax(torch.randn(2, n, n), -1), annotate_max=0)
        sizes[n] = tuple(fig.get_size_inches())
    assert sizes[600] == sizes[100]
    assert sizes[600][0] < 2 * 13.0 + 1.2 + 1e-6  # two panels of at most 12 + 1 inches
