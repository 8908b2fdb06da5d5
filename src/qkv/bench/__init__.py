"""The benchmark behind ``qkv bench``: the tiled backend against torch's SDPA with dense masks, in
time and memory.

Four cases -- no mask, causal, a sliding window of 256 keys, packed documents of 512 to 2048
tokens -- at lengths T, in float32 and bfloat16, forward (no_grad) and forward+backward, for
four implementations:

* ``tiled``: ``qkv.scaled_dot_product_attention(backend="tiled")`` with the structured mask as
  ``mask_mod`` (``is_causal=True`` for causal, nothing for none);
* ``auto``: the same call with ``backend="auto"`` (the dispatcher's choice is recorded);
* ``torch-dense``: ``torch.nn.functional.scaled_dot_product_attention`` called directly, with
  the structured mask as a dense bool ``attn_mask`` from ``qkv.masks.to_dense`` -- the peer
  every ratio is taken against;
* ``reference``: ``backend="reference"``, the plain (T, S) twin.

Each measurement runs in a fresh process so that its peak memory is its own: peak extra
memory = peak resident memory over the warm-up call minus the resident memory before the mask
was built (so a dense mask counts; q, k, v do not). Time = median of ``torch.utils.benchmark``
``blocked_autorange`` with all of torch's threads. FLOPs are counted once, the same for every
implementation: ``4*B*H*T*S*D`` forward over the pairs the mask allows (halved when causal), 3.5x
that for forward+backward (STYLE.md 15), so GFLOP/s compares useful work.

Linear attention (``--impls linear performer torch``; cases none and causal only, others are
skipped with the reason recorded):

* ``linear``: ``qkv.linear_attention`` with the elu feature map (``is_causal=True`` for causal);
* ``performer``: the same with ``feature_map=qkv.Favor(D, seed=0)`` (M = D ln D features);
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` called natively, no mask
  (``is_causal=True`` for causal): SDPA's best call, a flash kernel with O(T) memory -- the
  peer the linear ratios are taken against. Like torch-dense it is skipped beyond
  ``DENSE_MAX_T`` unless ``--all`` (its time grows as T^2: tens of seconds a call at 64k).

Linear records count the linear form's own FLOPs (:func:`linear_attention_flops`), so their
GFLOP/s says how well that kernel uses the CPU; it does not compare with the exact rows'
GFLOP/s (another function, far less work): compare time. A run with any linear impl writes
``linear.json``/``linear.png`` instead of ``tiled.json``/``tiled.png``.

The harness, by job: :mod:`qkv.bench.specs` (the grid, the cases' masks and FLOPs, what is
skipped), :mod:`qkv.bench.runner` (one measurement in a fresh process, a run of many),
:mod:`qkv.bench.report` (ratios, the Markdown table, crossovers, the environment, the
JSON).
``qkv bench`` (``qkv.cli.bench``) parses its arguments and calls these.

:mod:`qkv.bench.decode` is the benchmark behind ``qkv bench-decode`` (``qkv.cli.bench_decode``):
the time to generate one token at a given position, for a recurrent linear-attention state
and for a KV-cached softmax decoder; its names are re-exported here.

Shape alphabet: B batch, H heads, T query length, S key length (= T here), D head dim,
M features, Dv value dim.
"""

from __future__ import annotations

from .decode import (
    DECODE_IMPLS,
    DEFAULT_POSITIONS,
    GROWTH_TARGET,
    DecodeConfig,
    decode_config,
    decode_environment,
    decode_markdown,
    decode_ratios,
    measure_decode,
    measure_in_child,
    run_decode,
)
from .report import (
    Crossover,
    add_ratios,
    crossover_marks,
    crossovers,
    environment,
    load_previous,
    markdown_table,
    ratio_of,
    write_json_atomic,
)
from .runner import measure, run_measurement, run_specs, worker_main
from .specs import (
    ALL_IMPLS,
    CASES,
    DTYPES,
    IMPLS,
    LINEAR_IMPLS,
    MODES,
    PEER,
    PEERS,
    BenchConfig,
    Spec,
    attention_flops,
    available_bytes,
    bench_config,
    dense_bytes,
    document_ids,
    document_lengths,
    grid,
    linear_attention_flops,
    mask_density,
    mask_mod_for,
    num_features,
    run_name,
    skip_reason,
    spec_flops,
)

__all__ = [
    "ALL_IMPLS",
    "CASES",
    "DECODE_IMPLS",
    "DEFAULT_POSITIONS",
    "DTYPES",
    "GROWTH_TARGET",
    "IMPLS",
    "LINEAR_IMPLS",
    "MODES",
    "PEER",
    "PEERS",
    "BenchConfig",
    "Crossover",
    "DecodeConfig",
    "Spec",
    "add_ratios",
    "attention_flops",
    "available_bytes",
    "bench_config",
    "crossover_marks",
    "crossovers",
    "decode_config",
    "decode_environment",
    "decode_markdown",
    "decode_ratios",
    "dense_bytes",
    "document_ids",
    "document_lengths",
    "environment",
    "grid",
    "linear_attention_flops",
    "load_previous",
    "markdown_table",
    "mask_density",
    "mask_mod_for",
    "measure",
    "measure_decode",
    "measure_in_child",
    "num_features",
    "ratio_of",
    "run_decode",
    "run_measurement",
    "run_name",
    "run_specs",
    "skip_reason",
    "spec_flops",
    "worker_main",
    "write_json_atomic",
]
