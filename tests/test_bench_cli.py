"""`qkv bench`: records and plot of a tiny run, one-line errors, the FLOP count, skips."""
import json

import pytest
import torch

import qkv
from qkv import masks
from qkv.cli import main
from qkv.cli.bench import (BenchConfig, Spec, attention_flops, document_lengths, mask_density,
                           measure, run_specs)

# tiled once it is registered (the impl under test), reference before that
IMPL = "tiled" if "tiled" in qkv.backend_names() else "reference"


def test_tiny_run_writes_records_and_png(tmp_path, capsys):
    code = main(["bench", "--cases", "window", "--lengths", "64", "--dtypes", "fp32",
                 "--modes", "fwd", "--impls", IMPL, "torch-dense", "--min-run-time", "0.01",
                 "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads((tmp_path / "tiled.json").read_text())
    assert {"device", "dtypes", "torch", "qkv", "python", "cpu", "threads"} <= data.keys()
    records = data["records"]
    assert [(r["case"], r["T"], r["dtype"], r["mode"], r["impl"]) for r in records] == [
        ("window", 64, "fp32", "fwd", IMPL), ("window", 64, "fp32", "fwd", "torch-dense")]
    for r in records:
        assert r["status"] == "ok", r["reason"]
        assert r["time_s"] > 0 and r["peak_extra_mib"] >= 0 and r["gflop_per_s"] > 0
    assert records[0]["ratio_vs_torch_dense"] == pytest.approx(
        records[0]["time_s"] / records[1]["time_s"])
    assert (tmp_path / "tiled.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename
    assert "| 64 | window | fp32 | fwd |" in out  # the Markdown table
    assert sum(line.startswith("[") for line in err.splitlines()) == 2  # one per measurement


@pytest.mark.parametrize("argv, message", [
    (["--cases", "diagonal"],
     "unknown case 'diagonal'; choose from none, causal, window, document"),
    (["--lengths", "0"], "T=0 is out of range"),
    (["--impls", "flash"], "unknown impl 'flash'"),
    (["--min-run-time", "-1"], "--min-run-time: expected a float > 0"),
], ids=["case", "length", "impl", "min-run-time"])
def test_bad_option_exits_2_with_one_line(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("qkv bench: error: ") and message in err


def test_flop_count():
    # 4*B*H*T*S*D forward: 4 * 1 * 8 * 1024 * 1024 * 64 = 2**31
    assert attention_flops(1, 8, 1024, 1024, 64) == 2**31
    assert attention_flops(1, 8, 1024, 1024, 64, density=0.5) == 2**30  # causal: halved
    assert attention_flops(1, 8, 1024, 1024, 64, backward=True) == 3.5 * 2**31  # + 2.5x
    # B=2, H=4, T=10, S=20, D=8: 4*2*4*10*20*8 = 51200; a quarter of the pairs, fwd+bwd x3.5
    assert attention_flops(2, 4, 10, 20, 8, density=0.25, backward=True) == 44800


@pytest.mark.parametrize("case, T", [("window", 5), ("window", 600), ("document", 3000)])
def test_density_counts_the_allowed_pairs(case, T):
    mod = masks.sliding_window(256) if case == "window" else None
    if case == "document":
        lengths = torch.tensor(document_lengths(T))
        mod = masks.document(torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None])
    dense = masks.to_dense(mod, 1, 1, T, T)
    assert mask_density(case, T) == pytest.approx(dense.float().mean().item())
    assert mask_density("causal", T) == 0.5 and mask_density("none", T) == 1.0


def test_document_lengths_are_seeded_and_cover_T():
    lengths = document_lengths(10_000)
    assert lengths == document_lengths(10_000) and sum(lengths) == 10_000
    assert all(512 <= n <= 2048 for n in lengths[:-1])


def test_hopeless_runs_are_skipped_with_their_reason(tmp_path):
    config = BenchConfig(min_run_time=0.01)
    specs = [Spec("window", 8192, "fp32", "fwd", "reference"),
             Spec("document", 32768, "bf16", "fwdbwd", "torch-dense")]
    records = run_specs(specs, config, tmp_path / "tiled.json")  # no process is started
    assert [r["status"] for r in records] == ["skipped", "skipped"]
    assert "T=8192 > 4096" in records[0]["reason"] and "--all" in records[0]["reason"]
    assert "T=32768 > 16384" in records[1]["reason"]
    assert json.loads((tmp_path / "tiled.json").read_text())["records"] == records


def test_a_measurement_past_its_timeout_is_recorded():
    result = measure(Spec("none", 64, "fp32", "fwd", "reference"), BenchConfig(timeout=0.01))
    assert result["status"] == "timeout" and "0.01 s" in result["reason"]
