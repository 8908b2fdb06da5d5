"""``qkv train`` data-parallel on real processes (gloo, loopback only, every wait bounded):

* two processes end where one process ends with the same global batch, within the tolerance
  stated in ``qkv.training.trainer`` (plain torchrun, the library's ``train``);
* Ctrl-C on one rank stops both after the same step, and the resumed two-process run ends bit
  for bit where the uninterrupted one ends (dropout on every rank: each rank's generator must
  come back); every ``train`` leaves no process group and torch's generator as it was;
* ``qkv train --nproc 2``: Ctrl-C to the launcher reaches both processes (exit 130, one line,
  a checkpoint), ``--resume`` finishes, one result printed, only rank 0's files in ``--out``;
* a rank that hangs makes the other fail after ``--dist-timeout`` with one line; a rank that
  is killed makes ``--nproc`` stop the other and say which rank died;
* bad input (a batch the processes cannot share, ``--nproc 0``, ``--nproc`` under torchrun)
  fails before any process starts, exit 2.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from qkv.cli.main import main
from qkv.training import CHECKPOINT, METRICS, TrainConfig, train
from qkv.training.recipes import make_recipe

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch build has no torch.distributed"
)

LIMIT = 120  # seconds any one command may take before the test fails (and kills it)
TAG = uuid.uuid4().hex  # marks the processes these tests start
SMALL = dict(train_size=256, test_size=64)  # reverse, cut down: evaluation in a second

# The processes' program: runs the jobs given as JSON one after the other, each a train() of
# its own (its own process group), and prints each rank's result of each job as a JSON line.
# "toy" has dropout (so each rank's generator matters); "reverse" is the cut-down task.
WORKER = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    from torch import nn
    from qkv.training import TrainConfig, train
    from qkv.training.recipes import make_recipe

    class Toy:
        name = "toy"
        def __init__(self):
            g = torch.Generator().manual_seed(123)
            self.x = torch.randn(96, 8, generator=g)
            self.y = (self.x[:, 0] > 0).long()
        def describe(self):
            return dict(task="toy")
        def build_model(self):
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
        def train_size(self):
            return len(self.x)
        def batch(self, indices, device):
            return dict(x=self.x[indices], y=self.y[indices])
        def loss(self, model, batch):
            logits = model(batch["x"])
            acc = (logits.argmax(-1) == batch["y"]).float().mean()
            return nn.functional.cross_entropy(logits, batch["y"]), dict(acc=acc), 8
        def evaluate(self, model, device):
            return dict(acc=float((model(self.x).argmax(-1) == self.y).float().mean()))
        def pictures(self, model, out_dir, device):
            return []

    rank = int(os.environ["RANK"])
    for i, job in enumerate(json.loads(sys.argv[1])):
        if job["task"] == "toy":
            recipe = Toy()
            config = TrainConfig(steps=40, batch_size=16, lr=0.05, warmup_steps=3,
                                 schedule="rsqrt", checkpoint_every=2, seed=7)
        else:
            recipe = make_recipe("reverse", data=SMALL, cache_dir=job["cache"])
            recipe.pictures = lambda *args: []
            config = CONFIG
        def on_step(step, job=job):  # Ctrl-C on one rank only
            if step == job.get("sigint_at") and rank == job["sigint_rank"]:
                os.kill(os.getpid(), signal.SIGINT)
        rng = torch.get_rng_state()
        result = train(recipe, config, job["out"], resume=job.get("resume", False),
                       progress=False, on_step=on_step)
        line = json.dumps(dict(job=i, rank=rank, world=int(os.environ["WORLD_SIZE"]),
                               step=result.step, interrupted=result.interrupted,
                               evaluation=result.evaluation, pictures=result.pictures,
                               losses=[h["loss"] for h in result.history],
                               group_left=torch.distributed.is_initialized(),
                               rng_kept=torch.equal(torch.get_rng_state(), rng)))
        os.write(1, (line + "\\n").encode())  # one write: the ranks' lines do not interleave
""")
CONFIG = TrainConfig(
    steps=20, batch_size=16, lr=3e-3, warmup_steps=5, schedule="cosine", checkpoint_every=10, seed=3
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """reverse's data, generated once for every test here."""
    path = tmp_path_factory.mktemp("cache")
    make_recipe("reverse", cache_dir=str(path))
    return path


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory, cache) -> tuple[Path, dict[tuple[int, int], dict]]:
    """One plain ``torchrun --nproc_per_node 2`` of the worker (each start of a process costs
    seconds): reverse, then the toy uninterrupted, interrupted (Ctrl-C on rank 1 after step 6)
    and resumed. Returns the folder of the runs and ``{(job, rank): result}``."""
    root = tmp_path_factory.mktemp("torchrun")
    (root / "worker.py").write_text(
        f"SMALL = {SMALL!r}\nfrom qkv.training import TrainConfig\n"
        f"CONFIG = TrainConfig(**{CONFIG.__dict__!r})\n{WORKER}"
    )
    jobs = [
        dict(task="reverse", out=str(root / "reverse"), cache=str(cache)),
        dict(task="toy", out=str(root / "full")),
        dict(task="toy", out=str(root / "cut"), sigint_at=6, sigint_rank=1),
        dict(task="toy", out=str(root / "cut"), resume=True),
    ]
    proc = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(root / "worker.py"),
            json.dumps(jobs),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return root, {(r["job"], r["rank"]): r for r in found}


def _env(**extra) -> dict:
    """The environment of a command a test starts: no torchrun variables of its own, one
    thread a process, and a tag that finds every process it starts (:func:`_kill`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return dict(env, OMP_NUM_THREADS="1", QKV_TEST_TAG=TAG, **{k: str(v) for k, v in extra.items()})


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        _kill(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill(*procs: subprocess.Popen) -> None:
    """End the processes this test started, by their ids, if still running: ``procs``, and
    the ranks a launcher started (each in a session of its own, so they can outlive it)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for pid in _tagged():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        if proc.stdout is not None and not proc.stdout.closed:
            proc.communicate(timeout=30)
        proc.wait(timeout=30)


def _tagged() -> list[int]:
    """The ids of the processes that carry this session's tag (Linux: /proc)."""
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if f"QKV_TEST_TAG={TAG}".encode() in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def _params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / CHECKPOINT, weights_only=False)["model"]


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + LIMIT
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)


def test_two_processes_end_where_one_process_ends(torchrun, cache, tmp_path):
    """torchrun, 2 ranks, global batch 16 vs one process, batch 16, 20 steps (no dropout):
    losses to 1e-5 relative, parameters to 1e-5, the same evaluation. The attention key
    biases are left out: their exact gradient is 0 (softmax ignores a shift shared by all
    keys), so Adam makes lr-sized steps of rounding noise in any run (one process on 1 and on
    2 threads differs as much) that change no output; the losses show that."""
    root, runs = torchrun
    recipe = make_recipe("reverse", data=SMALL, cache_dir=str(cache))
    recipe.pictures = lambda *args: []
    one = train(recipe, CONFIG, tmp_path / "one", progress=False)
    r0, r1 = runs[0, 0], runs[0, 1]
    assert r0["world"] == 2 and r0["step"] == 20
    assert r0["losses"] == r1["losses"]  # summed over the ranks: the same on both
    assert r0["evaluation"] == r1["evaluation"] == one.evaluation
    losses = torch.tensor(r0["losses"], dtype=torch.float64)
    alone = torch.tensor([h["loss"] for h in one.history], dtype=torch.float64)
    torch.testing.assert_close(losses, alone, rtol=1e-5, atol=0)
    assert not torch.equal(losses, alone)  # two processes did add in another order
    p1, p2 = _params(tmp_path / "one"), _params(root / "reverse")
    E = recipe.model_options["embed_dim"]
    for name in p1:
        a, b = p1[name], p2[name]
        if name.endswith("in_proj_bias"):  # (3E,): q, k, v biases; leave k out
            a, b = torch.cat([a[:E], a[2 * E :]]), torch.cat([b[:E], b[2 * E :]])
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)
    assert json.loads((root / "reverse" / METRICS).read_text())["world_size"] == 2
    assert all(not r["group_left"] and r["rng_kept"] for r in runs.values())


def test_ctrl_c_on_one_rank_stops_both_and_the_resumed_run_is_bit_identical(torchrun):
    """Toy task with dropout, 2 ranks: SIGINT to rank 1 after step 6 stops both ranks after
    step 7 (they agree in step 7's all-reduce) with a checkpoint; resuming on 2 processes ends
    with the uninterrupted run's parameters and losses, bit for bit."""
    root, runs = torchrun
    assert [runs[2, r]["step"] for r in (0, 1)] == [7, 7]
    assert runs[2, 0]["interrupted"] and runs[2, 1]["interrupted"]
    assert runs[3, 0]["step"] == 40 and not runs[3, 0]["interrupted"]
    assert runs[3, 0]["losses"] == runs[1, 0]["losses"] == runs[3, 1]["losses"]
    for name, p in _params(root / "full").items():
        assert torch.equal(p, _params(root / "cut")[name]), name
    ck = torch.load(root / "cut" / CHECKPOINT, weights_only=False)
    assert ck["world_size"] == 2 and len(ck["rank_rng"]) == 2
    assert not torch.equal(ck["rank_rng"][0]["cpu"], ck["rank_rng"][1]["cpu"])  # own streams
    assert sorted(p.name for p in (root / "cut").iterdir()) == [CHECKPOINT, METRICS]


def test_nproc_2_ctrl_c_then_resume_one_result_only_rank_0_writes(tmp_path, cache):
    """``qkv train --nproc 2``: Ctrl-C (SIGINT to the launcher) reaches both processes, exit
    130 with one line and a checkpoint; ``--resume`` finishes: one JSON result, and in --out
    only rank 0's files."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "qkv",
        "train",
        "reverse",
        "--nproc",
        "2",
        "--steps",
        "60",
        "--batch-size",
        "8",
        "--checkpoint-every",
        "2",
        "--quiet",
        "--cache-dir",
        str(cache),
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        _wait_for(out / CHECKPOINT, proc)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=LIMIT)
    finally:
        _kill(proc)
    assert proc.returncode == 130 and stdout == "", stderr
    step = torch.load(out / CHECKPOINT, weights_only=False)["step"]
    assert 2 <= step < 60
    assert stderr == (
        f"qkv train: interrupted at step {step}; checkpoint in "
        f"{out / CHECKPOINT}; continue with the same command and --resume\n"
    )
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT]
    rest = _run(argv + ["--resume"])
    assert rest.returncode == 0, rest.stderr
    printed = json.loads(rest.stdout)  # one JSON document: rank 1 prints nothing
    assert printed["steps"] == 60 and 0.0 <= printed["evaluation"]["exact_match"] <= 1.0
    assert "Traceback" not in rest.stderr and "rank 1" not in rest.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        CHECKPOINT,
        "cross_attention.html",
        "cross_attention.png",
        METRICS,
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    metrics = json.loads((out / METRICS).read_text())
    assert metrics["world_size"] == 2 and metrics["config"]["batch_size"] == 8
    assert [h["step"] for h in metrics["history"]] == list(range(1, 61))
    assert metrics["evaluation"] == printed["evaluation"]
    assert len(torch.load(out / CHECKPOINT, weights_only=False)["rank_rng"]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_hangs_makes_the_other_fail_within_the_timeout(tmp_path, cache):
    """Two ranks started as torchrun starts them, but without its agent to stop them: rank 1
    stops (SIGSTOP) mid-run; rank 0 fails after --dist-timeout (3 s) with one line, exit 2."""
    out, port = tmp_path / "run", _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qkv",
                "train",
                "reverse",
                "--steps",
                "5000",
                "--batch-size",
                "8",
                "--checkpoint-every",
                "1",
                "--quiet",
                "--dist-timeout",
                "3",
                "--cache-dir",
                str(cache),
                "--out",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(
                WORLD_SIZE=2, RANK=rank, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
        )
        for rank in (0, 1)
    ]
    try:
        _wait_for(out / CHECKPOINT, procs[0])
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        stdout, stderr = procs[0].communicate(timeout=60)
        waited = time.monotonic() - t0
    finally:
        _kill(*procs)
    assert procs[0].returncode == 2 and stdout == "", stderr
    assert stderr.count("\n") == 1, stderr
    assert re.match(
        r"qkv train: error: rank 0 of 2, (checkpoint of )?step \d+: another process "
        r"of the run died or did not answer within 3 s \(.+\); the checkpoint of "
        r"step \d+ continues the run with resume=True \(--resume\)$",
        stderr,
    ), stderr
    assert 3 <= waited < 3 + 10


def _children(pid: int) -> dict[int, int]:
    """``{RANK: pid}`` of the processes ``pid`` started (Linux /proc)."""
    found = {}
    for d in Path("/proc").iterdir():
        try:
            if (
                d.name.isdigit()
                and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
            ):
                env = dict(
                    kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv
                )
                found[int(env["RANK"])] = int(d.name)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in /proc")
def test_nproc_reports_a_killed_rank_and_stops_the_other(tmp_path, cache):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qkv",
            "train",
            "reverse",
            "--nproc",
            "2",
            "--steps",
            "5000",
            "--batch-size",
            "8",
            "--checkpoint-every",
            "1",
            "--quiet",
            "--cache-dir",
            str(cache),
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        _wait_for(out / CHECKPOINT, proc)
        ranks = _children(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        _kill(proc)
    assert proc.returncode == 128 + signal.SIGKILL and stdout == "", stderr
    assert stderr.endswith(
        "qkv train: error: rank 1 was killed by SIGKILL; the other processes were stopped\n"
    )
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks.values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "0"], "--nproc must be at least 1, got 0"),
        (
            ["--nproc", "2", "--batch-size", "7"],
            (
                "the batch size is the global batch, shared equally by the 2 processes: 7 is not a "
                "multiple of 2; use 6 or 8"
            ),
        ),
        (["--nproc", "4", "--batch-size", "2"], "2 is not a multiple of 4; use 4"),
        (["--nproc", "2", "--dist-timeout", "0"], "--dist-timeout must be a positive number"),
    ],
    ids=["nproc-0", "batch-7-of-2", "batch-2-of-4", "timeout-0"],
)
def test_bad_input_fails_before_any_process_starts(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert main(["train", "reverse", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv train: error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_under_torchrun_the_batch_and_nproc_are_checked_too(tmp_path, capsys, monkeypatch):
    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    assert main(["train", "reverse", "--batch-size", "5", "--out", str(out)]) == 2
    assert "5 is not a multiple of 2; use 4 or 6" in capsys.readouterr().err
    assert main(["train", "reverse", "--nproc", "2", "--out", str(out)]) == 2
    assert (
        "--nproc 2 starts torchrun itself, but this process already runs under torchrun "
        "(WORLD_SIZE=2): leave --nproc out"
    ) in capsys.readouterr().err
    monkeypatch.delenv("RANK")
    assert main(["train", "reverse", "--out", str(out)]) == 2
    assert "WORLD_SIZE='2' is set but RANK=None is not an int: run under torchrun" in (
        capsys.readouterr().err
    )
    assert not out.exists()


def test_each_process_runs_the_command_as_given_without_nproc():
    import argparse

    from qkv.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    given = [
        "train",
        "listops",
        "--attention",
        "local",
        "--window",
        "8",
        "--steps",
        "7",
        "--batch-size",
        "6",
        "--lr",
        "0.0003",
        "--device",
        "cpu",
        "--seed",
        "5",
        "--checkpoint-every",
        "3",
        "--variant",
        "cpu",
        "--cache-dir",
        "c",
        "--out",
        "o",
        "--resume",
        "--quiet",
        "--nproc",
        "3",
        "--dist-timeout",
        "9.5",
        "--difficulty",
        "hard",
        "--resolution",
        "64",
    ]  # pathfinder's, parsed alike
    args = parser.parse_args(given)
    argv = train_cli.worker_argv(args)
    assert "--nproc" not in argv and argv[:2] == ["train", "listops"]
    again = vars(parser.parse_args(argv))
    assert again == dict(vars(args), nproc=None)
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["train"]._actions}
    assert flags - {"help", "nproc", "task", "func", "preset", "features"} <= {
        k for k, v in vars(args).items() if v is not None
    }  # every option is exercised
