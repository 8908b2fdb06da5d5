"""Issue 26, layout by job: the benchmark harnesses left ``qkv.cli.bench`` for ``qkv.bench``
and ``qkv.cli.bench_decode`` for ``qkv.bench.decode``, and ``qkv.torch_compat`` became a
package. Every name of the previous ``__all__`` lists still resolves where it did, to the same
object as at its new home, and a pickled patched model still names ``qkv.torch_compat``."""

import importlib
import json
import pickle
from pathlib import Path

import pytest
import torch

# ``qkv.cli.bench.__all__`` before the move (commit 03aa0de).
CLI_BENCH_ALL = [
    "add_parser",
    "run_bench_cli",
    "BenchConfig",
    "Spec",
    "bench_config",
    "grid",
    "attention_flops",
    "mask_density",
    "document_lengths",
    "document_ids",
    "skip_reason",
    "mask_mod_for",
    "spec_flops",
    "dense_bytes",
    "available_bytes",
    "measure",
    "run_measurement",
    "worker_main",
    "run_specs",
    "add_ratios",
    "markdown_table",
    "environment",
    "write_json_atomic",
    "linear_attention_flops",
    "num_features",
    "run_name",
    "load_previous",
    "crossovers",
    "crossover_marks",
    "Crossover",
    "ratio_of",
    "out_folder",
    "CASES",
    "IMPLS",
    "DTYPES",
    "MODES",
    "PEER",
    "LINEAR_IMPLS",
    "ALL_IMPLS",
    "PEERS",
]
# ``qkv.cli.bench_decode.__all__`` before the move.
CLI_BENCH_DECODE_ALL = [
    "DECODE_IMPLS",
    "DEFAULT_POSITIONS",
    "GROWTH_TARGET",
    "DecodeConfig",
    "add_parser",
    "decode_config",
    "decode_environment",
    "decode_markdown",
    "decode_ratios",
    "measure_decode",
    "measure_in_child",
    "run_decode",
    "run_decode_cli",
]
DECODE_CLI_ONLY = {"add_parser", "run_decode_cli"}
# ``qkv.torch_compat.__all__`` before it became a package.
TORCH_COMPAT_ALL = ["MultiheadAttention", "patch"]
CLI_ONLY = {"add_parser", "run_bench_cli", "out_folder"}  # the command line's own


@pytest.mark.parametrize("name", CLI_BENCH_ALL)
def test_every_old_cli_bench_name_resolves(name):
    cli = importlib.import_module("qkv.cli.bench")
    assert hasattr(cli, name) and name in cli.__all__
    if name not in CLI_ONLY:  # a re-export of the library's object, not a copy
        assert getattr(cli, name) is getattr(importlib.import_module("qkv.bench"), name)


@pytest.mark.parametrize("name", CLI_BENCH_DECODE_ALL)
def test_every_old_cli_bench_decode_name_resolves(name):
    cli = importlib.import_module("qkv.cli.bench_decode")
    assert hasattr(cli, name) and name in cli.__all__
    if name not in DECODE_CLI_ONLY:  # the library's object, also reached from qkv.bench
        lib = importlib.import_module("qkv.bench.decode")
        bench = importlib.import_module("qkv.bench")
        assert getattr(cli, name) is getattr(lib, name) is getattr(bench, name)
        assert name in lib.__all__ and name in bench.__all__


@pytest.mark.parametrize("name", TORCH_COMPAT_ALL)
def test_every_old_torch_compat_name_resolves(name):
    tc = importlib.import_module("qkv.torch_compat")
    assert callable(getattr(tc, name)) and name in tc.__all__
    assert tc.__all__ == TORCH_COMPAT_ALL


def test_the_cli_keeps_parsing_only():
    """STYLE.md 16: ``qkv.cli.bench`` defines its parser and command and nothing of the
    harness (its other names are the library's)."""
    cli = importlib.import_module("qkv.cli.bench")
    own = {
        n
        for n, v in vars(cli).items()
        if callable(v) and getattr(v, "__module__", None) == cli.__name__
    }
    assert own == {"add_parser", "run_bench_cli", "out_folder", "_plot"}
    decode = importlib.import_module("qkv.cli.bench_decode")
    own = {
        n
        for n, v in vars(decode).items()
        if callable(v) and getattr(v, "__module__", None) == decode.__name__
    }
    assert own == DECODE_CLI_ONLY


def test_the_worker_process_runs_from_its_new_home():
    """``measure`` launches ``python -c "from qkv.bench.runner import worker_main; ..."``."""
    from qkv.bench import BenchConfig, Spec, measure

    result = measure(Spec("none", 16, "fp32", "fwd", "reference"), BenchConfig(min_run_time=0.01))
    assert result["status"] == "ok", result["reason"]
    assert result["time_s"] > 0 and result["backend"] == "reference"


def test_the_decode_child_process_runs_from_its_new_home():
    """``measure_in_child`` launches ``python -c "from qkv.bench.decode import ..."``."""
    from qkv.bench.decode import DecodeConfig, measure_in_child

    config = DecodeConfig(
        positions=(4,), impls=("kv-cache",), tokens_per_block=2, min_run_time=0.01
    )
    result = measure_in_child("kv-cache", 4, config)
    assert result["status"] == "ok", result["reason"]
    assert result["us_per_token"] > 0 and result["positions_timed"] == [4, 5]


def test_a_pickled_patched_model_names_qkv_torch_compat():
    """``torch.save(model)`` of a patched model pickles the class and its no-op forward hook
    by name: the names are the ones they had before the package, and load back."""
    from qkv import torch_compat

    layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    model = torch_compat.patch(torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False))
    data = pickle.dumps(model)
    assert b"qkv.torch_compat.module" not in data and b"qkv.torch_compat" in data
    again = pickle.loads(data)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(again.eval()(x), model.eval()(x))
    assert type(again.layers[0].self_attn) is torch_compat.MultiheadAttention


# Every module's ``__all__`` at 45a788f, before the layout work of issue 26 began (masks and
# the Hugging Face integration became packages, the bench harness and torch_compat moved):
# each name still resolves from the module path it was imported by then.
PUBLIC_NAMES = json.loads(
    (Path(__file__).parent / "data" / "public_names_45a788f.json").read_text(encoding="utf-8")
)


@pytest.mark.parametrize("module", sorted(PUBLIC_NAMES))
def test_every_name_of_the_previous_all_lists_resolves(module):
    mod = importlib.import_module(module)
    missing = [name for name in PUBLIC_NAMES[module] if not hasattr(mod, name)]
    assert not missing, f"{module} no longer has {missing}"
