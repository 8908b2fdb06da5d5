"""The training loop: resume equals an uninterrupted run to the bit, Ctrl-C leaves a usable
checkpoint, checkpoints are written atomically, and runs are refused rather than overwritten."""

import json
import os
import signal
import stat

import pytest
import torch
from torch import nn

from qkv.training import CHECKPOINT, METRICS, TrainConfig, batch_indices, save_atomic, train


class Toy:
    """Classify 8-dim points by the sign of their first coordinate; dropout in the model, so
    resuming must restore the RNG too."""

    name = "toy"

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def describe(self) -> dict:
        return dict(task="toy", n=len(self.x))

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))

    def train_size(self) -> int:
        return len(self.x)

    def batch(self, indices, device):
        return dict(x=self.x[indices].to(device), y=self.y[indices].to(device))

    def loss(self, model, batch):
        logits = model(batch["x"])
        acc = (logits.argmax(-1) == batch["y"]).float().mean()
        return nn.functional.cross_entropy(logits, batch["y"]), dict(acc=acc), len(batch["y"])

    def evaluate(self, model, device):
        return dict(acc=float((model(self.x).argmax(-1) == self.y).float().mean()))

    def pictures(self, model, out_dir, device):
        return []


CONFIG = TrainConfig(
    steps=12, batch_size=16, lr=0.05, warmup_steps=3, schedule="rsqrt", checkpoint_every=5, seed=7
)


def _params(path):
    return torch.load(path / CHECKPOINT, weights_only=False)["model"]


def test_resume_equals_uninterrupted_to_the_bit(tmp_path):
    full = train(Toy(), CONFIG, tmp_path / "full", progress=False)
    half = TrainConfig(**CONFIG.__dict__)
    first = train(
        Toy(),
        half,
        tmp_path / "cut",
        progress=False,
        on_step=lambda s: s == 6 and os.kill(os.getpid(), signal.SIGINT),
    )
    assert first.interrupted and first.step == 6
    assert torch.load(tmp_path / "cut" / CHECKPOINT, weights_only=False)["step"] == 6
    rest = train(Toy(), half, tmp_path / "cut", resume=True, progress=False)
    assert rest.step == 12 and not rest.interrupted
    assert rest.final_loss == full.final_loss  # bit for bit
    for name, p in _params(tmp_path / "full").items():
        assert torch.equal(p, _params(tmp_path / "cut")[name]), name
    assert [h["loss"] for h in rest.history] == [h["loss"] for h in full.history]
    metrics = json.loads((tmp_path / "cut" / METRICS).read_text())
    assert metrics["step"] == 12 and metrics["final_loss"] == full.final_loss
    assert 0.5 < metrics["evaluation"]["acc"] <= 1.0


def test_training_learns_the_toy_task(tmp_path):
    res = train(
        Toy(), TrainConfig(steps=60, batch_size=32, lr=0.03, seed=0), tmp_path, progress=False
    )
    first = sum(h["loss"] for h in res.history[:5]) / 5
    last = sum(h["loss"] for h in res.history[-5:]) / 5
    assert last < 0.5 * first
    assert res.evaluation["acc"] > 0.9


def test_killed_checkpoint_write_leaves_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / CHECKPOINT
    save_atomic(dict(step=1), path)

    def dies_half_way(obj, f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # the process is killed mid-write

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_atomic(dict(step=2), path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == dict(step=1)
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # no temporary file left


def test_existing_run_is_refused_and_a_different_config_cannot_resume(tmp_path):
    train(Toy(), CONFIG, tmp_path, progress=False)
    with pytest.raises(FileExistsError, match="pass resume=True"):
        train(Toy(), CONFIG, tmp_path, progress=False)
    other = TrainConfig(**{**CONFIG.__dict__, "lr": 0.01})
    with pytest.raises(ValueError, match="config differs"):
        train(Toy(), other, tmp_path, resume=True, progress=False)
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(Toy(), CONFIG, tmp_path / "empty", resume=True, progress=False)


def test_batch_order_depends_on_seed_and_step_only():
    a = [batch_indices(10, 4, 3, s) for s in range(4)]
    assert [len(i) for i in a] == [4, 4, 4, 4]
    assert sorted(torch.cat(a[:2]).tolist()) == sorted(set(torch.cat(a[:2]).tolist()))  # no repeats
    assert torch.equal(a[3], batch_indices(10, 4, 3, 3))
    assert not torch.equal(batch_indices(10, 4, 4, 0), a[0])


def test_learning_rate_schedules():
    c = TrainConfig(steps=10, warmup_steps=4, schedule="rsqrt")
    assert [c.lr_factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert c.lr_factor(15) == pytest.approx((4 / 16) ** 0.5)
    cos = TrainConfig(steps=10, warmup_steps=0, schedule="cosine")
    assert cos.lr_factor(4) == pytest.approx(
        0.5 * (1 + torch.cos(torch.tensor(torch.pi * 0.5)).item())
    )
    assert cos.lr_factor(9) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(steps=0), "steps must be a positive int"),
        (dict(lr=-1.0), "lr must be a positive number"),
        (dict(schedule="linear"), "schedule must be one of"),
        (dict(grad_clip=0.0), "grad_clip must be > 0"),
    ],
)
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**bad)


@pytest.mark.parametrize(
    "umask, mode", [(0o027, 0o640), (0o002, 0o664)], ids=["umask-027", "umask-002"]
)
def test_checkpoint_and_metrics_get_the_umasks_permissions(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        train(Toy(), CONFIG, tmp_path / "run", progress=False)
    finally:
        os.umask(old)
    for name in (CHECKPOINT, METRICS):
        assert stat.S_IMODE((tmp_path / "run" / name).stat().st_mode) == mode, name


class BrokenPicture(Toy):
    def pictures(self, model, out_dir, device):
        raise RuntimeError("the picture failed")


def test_the_results_are_written_before_the_pictures(tmp_path):
    with pytest.raises(RuntimeError, match="the picture failed"):
        train(BrokenPicture(), CONFIG, tmp_path, progress=False)
    metrics = json.loads((tmp_path / METRICS).read_text())
    assert metrics["step"] == 12 and metrics["pictures"] == []
    assert 0.5 < metrics["evaluation"]["acc"] <= 1.0


def test_train_leaves_torch_settings_as_it_found_them(tmp_path):
    torch.manual_seed(99)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    train(Toy(), CONFIG, tmp_path, progress=False)  # seeds torch with CONFIG.seed = 7
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32


def test_a_metric_may_be_called_force():
    """Progress.update's own ``force`` is positional: a field named ``force`` is shown like
    any other (it used to be taken for the flag, and dropped)."""
    import io

    from qkv._progress import Progress

    stream = io.StringIO()
    Progress(10, stream=stream, every=0.0).update(3, loss=0.5, force=0.25)
    assert "loss=0.5 force=0.25" in stream.getvalue()


def test_file_mode_without_proc(monkeypatch):
    from qkv.training import files

    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/self/status")  # macOS, BSD: the umask is set and reset

    monkeypatch.setattr(files, "open", no_proc, raising=False)
    old = os.umask(0o027)
    try:
        assert files.file_mode() == 0o640
        assert os.umask(0o027) == 0o027  # put back as it was
    finally:
        os.umask(old)
