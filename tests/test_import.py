"""What ``import qkv`` costs and reaches (issue 25).

``import qkv`` used to pull in ``torch._dynamo`` (through ``torch.nn.attention.bias``, for one
isinstance check): 1.1 s beyond ``import torch``, and ``qkv --help`` took 2.5 s. The
documented submodules raised AttributeError until imported by hand. Each check runs in a
process that has not imported qkv, since this test process has imported everything already:
one interpreter imports torch alone (most of the start-up time) and forks a child per check,
which imports qkv afresh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Runs each snippet of argv[1] (a JSON {name: code}) in a child forked after `import torch`
# (qkv not imported): prints {name: [exit code, stdout, stderr]} as JSON.
_FORKER = textwrap.dedent("""
    import io, json, os, sys, traceback
    import torch

    results = {}
    for name, code in json.loads(sys.argv[1]).items():
        out_r, out_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its stdout and stderr go back through the pipe
            os.close(out_r)
            sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
            status = 0
            try:
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
            except BaseException:
                traceback.print_exc()
                status = 1
            with os.fdopen(out_w, "w") as f:
                json.dump([status, sys.stdout.getvalue(), sys.stderr.getvalue()], f)
            os._exit(0)
        os.close(out_w)
        with os.fdopen(out_r) as f:
            results[name] = json.loads(f.read() or '[-1, "", "the child died"]')
        os.waitpid(pid, 0)
    print(json.dumps(results))
""")

SUBMODULES = [
    "viz.html",
    "torch_compat.MultiheadAttention",
    "torch_compat.patch",
    "testing.assert_tolerance",
    "distributed.ring_attention",
    "integrations.transformers.register",
    "masks.sliding_window",
    "bench.run_specs",
    "bench.run_decode",
    "bench.decode.measure_decode",
    "walkthrough.example_problem",
    "sources.load_run",
]

SNIPPETS = {
    "no-compiler": """
        import sys, qkv
        print(sorted(m for m in ("torch._dynamo", "matplotlib", "transformers", "triton",
                                 "sklearn", "torch.nn.attention.bias") if m in sys.modules))
    """,
    **{
        path: f"""
        import qkv
        obj = qkv
        for part in {path!r}.split("."):
            obj = getattr(obj, part)
        print(callable(obj))
    """
        for path in SUBMODULES
    },
    "no-bench": """
        import sys, qkv
        print(sorted(m for m in sys.modules if m.startswith(("qkv.bench", "qkv.training"))))
        print("bench" in dir(qkv))
        qkv.bench
        print("qkv.bench.decode" in sys.modules)
    """,
    "unknown-attribute": """
        import qkv
        try:
            qkv.no_such_thing
        except AttributeError as e:
            print(e)
    """,
}


@pytest.fixture(scope="module")
def fresh() -> dict[str, list]:
    """Every snippet's [exit code, stdout, stderr], each from a process without qkv."""
    codes = {name: textwrap.dedent(code) for name, code in SNIPPETS.items()}
    done = subprocess.run(
        [sys.executable, "-c", _FORKER, json.dumps(codes)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _run(fresh: dict[str, list], name: str) -> str:
    status, out, err = fresh[name]
    assert status == 0, err[-3000:]  # the snippet's exit status, with its stderr
    return out


def test_import_qkv_loads_no_compiler_plotting_or_hub_library(fresh):
    assert _run(fresh, "no-compiler").strip() == "[]"


@pytest.mark.parametrize("path", SUBMODULES)
def test_documented_submodules_are_reached_after_import_qkv_alone(fresh, path):
    assert _run(fresh, path).strip() == "True"


def test_import_qkv_loads_no_benchmark_or_training_module(fresh):
    """``qkv.bench`` (and the training loop it uses) load on first access, not at ``import
    qkv``; ``dir(qkv)`` lists it."""
    assert _run(fresh, "no-bench").split("\n")[:3] == ["[]", "True", "True"]


def test_unknown_attribute_still_raises_attribute_error(fresh):
    assert "no attribute 'no_such_thing'" in _run(fresh, "unknown-attribute")


def test_torch_causal_bias_is_still_understood():
    """The check for torch's CausalBias no longer imports its module; a caller holding one has
    imported it, and gets the same answer as torch's own causal_lower_right."""
    import torch
    from torch.nn.attention.bias import causal_lower_right

    import qkv

    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out = qkv.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 5))
    want = qkv.scaled_dot_product_attention(q, k, v, mask_mod=qkv.masks.causal("bottom_right"))
    torch.testing.assert_close(out, want)
