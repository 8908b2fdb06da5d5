"""`qkv bench`: records and plot of a tiny run, one-line errors, the FLOP count, skips."""

import json

import fresh
import pytest
import torch

import qkv
from qkv import masks
from qkv.bench import (
    BenchConfig,
    Spec,
    attention_flops,
    document_lengths,
    mask_density,
    measure,
    run_specs,
)
from qkv.cli import main

# tiled once it is registered (the impl under test), reference before that
IMPL = "tiled" if "tiled" in qkv.backend_names() else "reference"


def test_tiny_run_writes_records_and_png(tmp_path, capsys):
    code = main(
        [
            "bench",
            "--cases",
            "window",
            "--lengths",
            "64",
            "--dtypes",
            "fp32",
            "--modes",
            "fwd",
            "--impls",
            IMPL,
            "torch-dense",
            "--min-run-time",
            "0.01",
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads((tmp_path / "tiled.json").read_text())
    assert {"device", "dtypes", "torch", "qkv", "python", "cpu", "threads"} <= data.keys()
    records = data["records"]
    assert [(r["case"], r["T"], r["dtype"], r["mode"], r["impl"]) for r in records] == [
        ("window", 64, "fp32", "fwd", IMPL),
        ("window", 64, "fp32", "fwd", "torch-dense"),
    ]
    for r in records:
        assert r["status"] == "ok", r["reason"]
        assert r["time_s"] > 0 and r["peak_extra_mib"] >= 0 and r["gflop_per_s"] > 0
    assert records[0]["ratio_vs_torch_dense"] == pytest.approx(
        records[0]["time_s"] / records[1]["time_s"]
    )
    assert (tmp_path / "tiled.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename
    assert "| 64 | window | fp32 | fwd |" in out  # the Markdown table
    assert sum(line.startswith("[") for line in err.splitlines()) == 2  # one per measurement


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--cases", "diagonal"],
            "unknown case 'diagonal'; choose from none, causal, window, document",
        ),
        (["--lengths", "0"], "T=0 is out of range"),
        (["--impls", "flash"], "unknown impl 'flash'"),
        (["--min-run-time", "-1"], "--min-run-time: expected a float > 0"),
    ],
    ids=["case", "length", "impl", "min-run-time"],
)
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


def test_hopeless_runs_are_skipped_with_their_reason(tmp_path, monkeypatch):
    # the length rules, whatever this machine has free (with ~2 GiB free, the memory rule
    # would name the first run instead)
    monkeypatch.setattr("qkv.bench.runner.available_bytes", lambda: 1 << 40)
    config = BenchConfig(min_run_time=0.01)
    specs = [
        Spec("window", 8192, "fp32", "fwd", "reference"),
        Spec("document", 32768, "bf16", "fwdbwd", "torch-dense"),
    ]
    records = run_specs(specs, config, tmp_path / "tiled.json")  # no process is started
    assert [r["status"] for r in records] == ["skipped", "skipped"]
    assert "T=8192 > 4096" in records[0]["reason"] and "--all" in records[0]["reason"]
    assert "T=32768 > 16384" in records[1]["reason"]
    assert json.loads((tmp_path / "tiled.json").read_text())["records"] == records


def test_a_measurement_past_its_timeout_is_recorded():
    result = measure(Spec("none", 64, "fp32", "fwd", "reference"), BenchConfig(timeout=0.01))
    assert result["status"] == "timeout" and "0.01 s" in result["reason"]


# ---- linear attention in `qkv bench`, `qkv bench-decode`, benchmarks/bench_linear.py -----------

import importlib.util  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

from qkv.bench import (  # noqa: E402
    ALL_IMPLS,
    IMPLS,
    add_ratios,
    bench_config,
    crossovers,
    decode_config,
    decode_ratios,
    environment,
    linear_attention_flops,
    load_previous,
    markdown_table,
    run_name,
    spec_flops,
)


def _rec(impl, T, time_s, case="causal", mode="fwd", status="ok", peak=1.0):
    return dict(
        case=case,
        T=T,
        dtype="fp32",
        mode=mode,
        impl=impl,
        status=status,
        reason="",
        time_s=time_s if status == "ok" else None,
        peak_extra_mib=peak,
        gflop_per_s=1.0,
    )


def test_linear_impls_are_opt_in_and_name_their_files():
    assert bench_config().impls == IMPLS  # the default run is unchanged
    assert bench_config(impls=["linear", "performer", "torch"]).impls == ALL_IMPLS[4:]
    assert run_name(IMPLS) == "tiled" and run_name(["linear", "torch"]) == "linear"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--impls", "linear", "--resume"], "--resume continues the run"),
        (["bench-decode", "--positions", "0"], "P=0 is out of range"),
        (["bench-decode", "--impls", "rnn"], "unknown decoder 'rnn'; choose from recurrent"),
        (["bench-decode", "--tokens-per-block", "0"], "--tokens-per-block: expected an int > 0"),
    ],
    ids=["resume-without-out", "position", "decoder", "tokens-per-block"],
)
def test_new_options_fail_in_one_line(capsys, argv, message):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and message in err


def test_linear_impls_skip_other_cases_and_torch_skips_long_T(tmp_path):
    specs = [
        Spec("window", 256, "fp32", "fwd", "linear"),
        Spec("document", 256, "fp32", "fwd", "performer"),
        Spec("window", 256, "fp32", "fwdbwd", "torch"),
        Spec("causal", 32768, "fp32", "fwd", "torch"),
    ]
    records = run_specs(specs, BenchConfig(min_run_time=0.01), tmp_path / "linear.json")
    assert [r["status"] for r in records] == ["skipped"] * 4  # no process was started
    assert "linear takes no window mask" in records[0]["reason"]
    assert "performer takes no document mask" in records[1]["reason"]
    assert "torch is SDPA's native call" in records[2]["reason"]
    assert "T=32768 > 16384" in records[3]["reason"] and "--all" in records[3]["reason"]


def test_linear_flop_count():
    # non-causal: phi(K)^T V 2*S*M*Dv + readout 2*T*(M*Dv + M); B=2, H=3, T=S=10, M=D=Dv=4
    assert linear_attention_flops(2, 3, 10, 10, 4, M=4) == 6 * (2 * 10 * 16 + 2 * 10 * 20)
    # causal, T=128 = 2 chunks of 64 in one block: intra (L, L) scores and @V, chunk sums,
    # the (2, 2) carry, the readout
    n, L, M = 2, 64, 4
    causal = (
        2 * n * L * L * (M + M)
        + 2 * n * L * M * M
        + 2 * n * n * (M * M + M)
        + 2 * n * L * (M * M + M)
    )
    assert linear_attention_flops(1, 1, 128, 128, 4, M=4, causal=True) == causal
    assert linear_attention_flops(1, 1, 128, 128, 4, M=4, causal=True, backward=True) == 3 * causal
    assert linear_attention_flops(1, 1, 10, 10, 4, M=8, favor=True) == (
        linear_attention_flops(1, 1, 10, 10, 4, M=8) + 2 * 20 * 4 * 8
    )  # + the projections
    # at T=16k the causal form does ~1/60 of causal exact attention's work
    lin, exact = (spec_flops(Spec("causal", 16384, "fp32", "fwd", i)) for i in ("linear", "torch"))
    assert 40 < exact / lin < 80


def test_linear_ratios_are_against_torch():
    records = [
        _rec("linear", 1024, 0.01),
        _rec("torch", 1024, 0.04),
        _rec("tiled", 1024, 0.02),
        _rec("torch-dense", 1024, 0.01),
    ]
    add_ratios(records)
    assert records[0]["ratio_vs_torch"] == pytest.approx(0.25)
    assert records[2]["ratio_vs_torch_dense"] == pytest.approx(2.0)
    assert "ratio_vs_torch_dense" not in records[0] and "ratio_vs_torch" not in records[2]
    assert "| vs peer |" in markdown_table(records).splitlines()[0]
    assert "| vs torch |" in markdown_table(records[:2]).splitlines()[0]


@pytest.mark.parametrize(
    "ratios, T, below",
    [
        ({256: 2.0, 512: 1.5, 1024: 0.5, 2048: 0.25}, 1024, 512),
        ({256: 0.9, 512: 1.1, 1024: 0.5, 2048: 0.4}, 1024, 512),  # an early noisy win: no
        ({256: 0.5, 512: 0.4}, 256, None),  # faster everywhere
        ({256: 2.0, 512: 0.9, 1024: 1.0}, None, None),  # not faster at the longest: none
    ],
    ids=["crosses", "noisy-early-win", "always-faster", "never"],
)
def test_crossover(ratios, T, below):
    records = [r for t, x in ratios.items() for r in (_rec("linear", t, x), _rec("torch", t, 1.0))]
    records.append(_rec("torch", 4096, None, status="skipped"))  # only pairs count
    (c,) = crossovers(records)
    assert (c.case, c.mode, c.T, c.below) == ("causal", "fwd", T, below)
    assert c.lengths == tuple(ratios)
    if below is not None:  # ratio 1 on the log-log line between below and T
        lo, hi = math.log(ratios[below]), math.log(ratios[T])
        assert c.estimate == pytest.approx(below * (T / below) ** (lo / (lo - hi)))
        assert below < c.estimate < T and f"from T={T} on" in str(c)


def test_resume_keeps_measured_records_and_refuses_another_machine(tmp_path):
    config = bench_config(impls=["linear"], min_run_time=0.01)
    old = dict(_rec("linear", 64, 0.001, case="none"), ratio_vs_torch=0.5)
    records = run_specs(
        [Spec("none", 64, "fp32", "fwd", "linear")],
        config,
        tmp_path / "linear.json",
        previous=[old],
    )  # no process is started
    assert records[0]["resumed"] and records[0]["time_s"] == 0.001
    assert "ratio_vs_torch" not in records[0]  # stale: its peer is not in this run
    env = environment(config)
    assert load_previous(tmp_path / "linear.json", env) == records
    assert load_previous(tmp_path / "missing.json", env) == []
    with pytest.raises(ValueError, match=r"this run has '0.0'; its times would not compare"):
        load_previous(tmp_path / "linear.json", dict(env, torch="0.0"))


def test_decode_run_writes_its_json(tmp_path, capsys, monkeypatch):
    # each measurement's process forked by tests/fresh.py (torch imported once for the six):
    # the real child process is started by test_cli_global_state's bench-decode and
    # test_layout_names; here the records, ratios and table are checked
    monkeypatch.setattr("qkv.bench.decode.subprocess", fresh.as_subprocess_module())
    code = main(
        [
            "bench-decode",
            "--positions",
            "64",
            "128",
            "--min-run-time",
            "0.01",
            "--tokens-per-block",
            "2",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads((tmp_path / "decode.json").read_text())
    assert {
        "device",
        "cpu",
        "threads",
        "torch",
        "qkv",
        "config",
        "records",
        "ratios",
    } <= data.keys()
    assert [(r["impl"], r["position"]) for r in data["records"]] == [
        (i, P) for P in (64, 128) for i in ("recurrent", "recurrent-performer", "kv-cache")
    ]
    for r in data["records"]:
        assert r["status"] == "ok", r["reason"]
        assert r["us_per_token"] > 0 and r["blocks"] >= 5
        assert r["positions_timed"] == [r["position"], r["position"] + 1]
    assert data["records"][1]["features"] == 266  # FAVOR+: M = round(64 ln 64)
    ratios = data["ratios"]
    assert [(g["impl"], g["from"], g["to"]) for g in ratios["growth"]] == [
        ("recurrent", 64, 128),
        ("recurrent-performer", 64, 128),
        ("kv-cache", 64, 128),
    ]
    assert len(ratios["vs_kv_cache"]) == 4 and isinstance(ratios["target"]["met"], bool)
    assert "| 64 |" in out and "| 128 |" in out and "Target" in out


def test_decode_ratios_and_target():
    us = {
        ("recurrent", 1024): 50.0,
        ("recurrent", 16384): 65.0,
        ("kv-cache", 1024): 100.0,
        ("kv-cache", 16384): 1600.0,
    }
    records = [dict(impl=i, position=P, status="ok", us_per_token=t) for (i, P), t in us.items()]
    ratios = decode_ratios(records)
    assert ratios["growth"][0] == {"impl": "recurrent", "from": 1024, "to": 16384, "ratio": 1.3}
    assert ratios["target"]["met"] is False  # 1.3 > 1.2
    assert [v["ratio"] for v in ratios["vs_kv_cache"]] == [0.5, 65 / 1600]
    assert decode_ratios(records[:1])["target"]["met"] is None
    assert decode_config().positions == (1024, 16384)


def test_bench_linear_markdown_states_crossover_and_targets():
    path = Path(__file__).parents[1] / "benchmarks" / "bench_linear.py"
    spec = importlib.util.spec_from_file_location("bench_linear", path)
    bench_linear = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_linear)
    records = [
        _rec("linear", 1024, 0.02),
        _rec("torch", 1024, 0.01),
        _rec("linear", 16384, 0.05),
        _rec("torch", 16384, 1.0),
    ]
    decode = dict(
        config=dict(tokens_per_block=16),
        records=[],
        ratios=dict(
            growth=[],
            vs_kv_cache=[],
            target=dict(met=False, value=1.3, goal="<= 1.2", positions=[1024, 16384]),
        ),
    )
    text = bench_linear.markdown_section(dict(records=records, command="cmd"), decode)
    assert "Command (grid): `cmd`" in text
    assert "0.050 (20.0x faster)" in text and "| met |" in text  # causal 16k: <= 0.1
    assert "x1.300 | <= 1.2 | **not met** |" in text
    assert "causal, fp32 forward: linear is faster than torch from T=16384 on" in text
    assert [s.T for s in bench_linear.grid_specs([1024, 32768])].count(32768) == 4  # fwd only


def test_tiny_linear_run_writes_linear_json_with_ratios_against_torch(
    tmp_path, capsys, monkeypatch
):
    # the workers forked by tests/fresh.py; test_tiny_run_writes_records_and_png starts them
    # as real processes
    monkeypatch.setattr("qkv.bench.runner.subprocess", fresh.as_subprocess_module())
    code = main(
        [
            "bench",
            "--cases",
            "causal",
            "--lengths",
            "64",
            "--dtypes",
            "fp32",
            "--modes",
            "fwd",
            "--impls",
            "linear",
            "performer",
            "torch",
            "--min-run-time",
            "0.01",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads((tmp_path / "linear.json").read_text())
    assert data["benchmark"] == "linear" and data["config"]["performer_features"] == 266
    lin, perf, ref = data["records"]
    for r in data["records"]:
        assert r["status"] == "ok", r["reason"]
    assert lin["ratio_vs_torch"] == pytest.approx(lin["time_s"] / ref["time_s"])
    assert perf["ratio_vs_torch"] == pytest.approx(perf["time_s"] / ref["time_s"])
    assert [r["flops"] for r in (lin, perf, ref)] == [  # each counts its own work
        spec_flops(Spec("causal", 64, "fp32", "fwd", i)) for i in ("linear", "performer", "torch")
    ]
    assert (lin["features"], perf["features"]) == (64, 266)
    assert (tmp_path / "linear.png").exists() and not (tmp_path / "tiled.json").exists()
    assert "| vs torch |" in out


@pytest.mark.parametrize("command", ["bench", "bench-decode"])
def test_out_under_a_file_is_one_line_and_an_interrupted_run_leaves_no_folder(
    tmp_path, capsys, monkeypatch, command
):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    assert main([command, "--out", str(notes / "run")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"qkv {command}: error: cannot use {notes / 'run'} as the "
        f"output folder: {notes} is a file, not a folder; choose "
        f"another output folder\n"
    )

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C before the first measurement was written

    monkeypatch.setattr("qkv.cli.bench.run_specs", interrupted)
    monkeypatch.setattr("qkv.cli.bench_decode.run_decode", interrupted)
    assert main([command, "--out", str(tmp_path / "new" / "run")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [notes]
