"""What ``import qkv`` costs and reaches (issue 25).

``import qkv`` used to pull in ``torch._dynamo`` (through ``torch.nn.attention.bias``, for one
isinstance check): 1.1 s beyond ``import torch``, and ``qkv --help`` took 2.5 s. The
documented submodules raised AttributeError until imported by hand. Each check runs in a
fresh interpreter (tests/fresh.py: torch imported, qkv not), since this test process has
imported everything already.
"""

from __future__ import annotations

import textwrap

import fresh
import pytest


def _run(code: str) -> str:
    done = fresh.run(textwrap.dedent(code))  # the return code is asserted, with the stderr
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_qkv_loads_no_compiler_plotting_or_hub_library():
    out = _run("""
        import sys, qkv
        print(sorted(m for m in ("torch._dynamo", "matplotlib", "transformers", "triton",
                                 "sklearn", "torch.nn.attention.bias") if m in sys.modules))
    """)
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "path",
    [
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
    ],
)
def test_documented_submodules_are_reached_after_import_qkv_alone(path):
    out = _run(f"""
        import qkv
        obj = qkv
        for part in {path!r}.split("."):
            obj = getattr(obj, part)
        print(callable(obj))
    """)
    assert out.strip() == "True"


def test_import_qkv_loads_no_benchmark_or_training_module():
    """``qkv.bench`` (and the training loop it uses) load on first access, not at ``import
    qkv``; ``dir(qkv)`` lists it."""
    out = _run("""
        import sys, qkv
        print(sorted(m for m in sys.modules if m.startswith(("qkv.bench", "qkv.training"))))
        print("bench" in dir(qkv))
        qkv.bench
        print("qkv.bench.decode" in sys.modules)
    """)
    assert out.split("\n")[:3] == ["[]", "True", "True"]


def test_unknown_attribute_still_raises_attribute_error():
    out = _run("""
        import qkv
        try:
            qkv.no_such_thing
        except AttributeError as e:
            print(e)
    """)
    assert "no attribute 'no_such_thing'" in out


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
