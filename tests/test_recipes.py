"""The recipes behind ``qkv train`` on their real tasks: ``reverse`` provably learns, and
``listops`` draws the attention of a test example."""

import json

import torch

from qkv.training import TrainConfig, train
from qkv.training.recipes import make_recipe


def test_reverse_loss_drops_by_a_factor_of_four(tmp_path):
    recipe = make_recipe(
        "reverse", data=dict(train_size=2000, test_size=64), cache_dir=str(tmp_path / "cache")
    )
    config = TrainConfig(
        steps=150,
        batch_size=32,
        lr=3e-3,
        warmup_steps=20,
        schedule="cosine",
        seed=0,
        checkpoint_every=1000,
    )
    res = train(recipe, config, tmp_path / "run", progress=False)
    first = sum(h["loss"] for h in res.history[:5]) / 5
    last = sum(h["loss"] for h in res.history[-5:]) / 5
    assert last < first / 4, (first, last)
    assert res.history[-1]["acc"] > 0.6  # teacher-forced token accuracy (chance is ~0.1)


def test_listops_saves_the_last_layers_attention_of_the_shortest_test_example(tmp_path):
    recipe = make_recipe(
        "listops",
        attention="local",
        attention_options=dict(window=8),
        model=dict(embed_dim=32, num_heads=2, num_layers=1, ffn_dim=32),
        data=dict(train_size=32, test_size=8),
        cache_dir=str(tmp_path / "c"),
    )
    res = train(
        recipe,
        TrainConfig(steps=2, batch_size=8, lr=1e-3, seed=0),
        tmp_path / "run",
        progress=False,
    )
    assert [p.rsplit("/", 1)[-1] for p in res.pictures] == [
        "attention_last_layer.png",
        "attention_last_layer.html",
    ]
    with open(res.pictures[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "run" / "attention_last_layer.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and '"CLS"' in page and "https://" not in page
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0.0 <= metrics["evaluation"]["accuracy"] <= 1.0
    assert metrics["evaluation"]["test_examples"] == 8
    # the picture's example: the shortest one, drawn from the model's own trace
    d = recipe.test_data
    i = int(d.mask.sum(-1).argmin())
    L = int(d.mask[i].sum())
    model = recipe.build_model()
    _, maps = model(d.tokens[i : i + 1, :L], return_attention=True)
    probs = maps.encoder[-1].probs[0]  # (H, 1 + L, 1 + L)
    assert probs.shape == (2, L + 1, L + 1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, L + 1))
    far = torch.ones(L + 1, L + 1, dtype=torch.bool).triu(9) | torch.ones(
        L + 1, L + 1, dtype=torch.bool
    ).tril(-9)
    assert (probs[:, far] == 0).all()  # the local window of 8 each side


def test_digits_saves_its_picture_and_the_viewer_page_of_the_same_image(tmp_path):
    recipe = make_recipe(
        "digits",
        model=dict(embed_dim=16, num_heads=2, num_layers=2, ffn_dim=16, patch_size=2),
        cache_dir=str(tmp_path / "c"),
    )
    res = train(
        recipe,
        TrainConfig(steps=2, batch_size=8, lr=1e-3, seed=0),
        tmp_path / "run",
        progress=False,
    )
    assert [p.rsplit("/", 1)[-1] for p in res.pictures] == [
        "attention_last_layer.png",
        "attention_last_layer.html",
    ]
    page = (tmp_path / "run" / "attention_last_layer.html").read_text()
    meta = json.loads(page.split('id="qkv-meta">', 1)[1].split("</script>", 1)[0])
    P = (recipe.test_data.images.shape[-1] // 2) ** 2  # 2 x 2 patches
    assert meta["tokens"] == [["CLS"] + [f"patch {p}" for p in range(P)]]
    assert [e["label"] for e in meta["entries"]] == [
        f"layer {i} · encoder.layers.{i}.self_attn" for i in range(2)
    ]
    assert all(len(e["heads"]) == 2 and e["T"] == e["S"] == P + 1 for e in meta["entries"])
