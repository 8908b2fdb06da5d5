#!/usr/bin/env bash
# `make gpu-check` (issue 39): everything a lent GPU should run, in one call of about 9 minutes.
#
#   1. the CUDA tests (tests/test_cuda.py) and the core files with CUDA as torch's default
#      device (QKV_TEST_DEVICE=cuda), the two at once on the machine's cores;
#   2. benchmarks/gpu_api.py: the public API (auto and each backend by name) against compiled
#      Flex, SDPA-cuDNN and SDPA-flash, within a time budget;
#   3. benchmarks/gpu_deformable.py: multi-scale deformable attention's Triton kernels against
#      the grid_sample fallback at BEVFormer's sizes (issue 40), within a budget of its own
#      (QKV_GPU_DEFORM_S, default 60 s; 0 skips it);
#   4. benchmarks/gpu_profile.py: where a call's time goes (host time per call, the kernels it
#      launches) beside cuDNN and flash, within QKV_GPU_PROFILE_S (default 90 s; 0 skips it).
#
# QKV_GPU_BENCH_S=0 skips step 2. QKV_GPU_PACK=1 packs every file written into OUTDIR/gpu_check.tgz
# at the end, and leaves only it there (a lent machine returns at most 8 files; this writes 10). Each test stops after QKV_GPU_TEST_TIMEOUT seconds (default
# 60; pytest-timeout), so one hung test cannot take the whole budget and says where it hung.
#
# Writes into OUTDIR (first argument; default benchmarks/results): gpu_api.json, gpu_api.md,
# gpu_deformable.json, gpu_deformable.md, gpu_profile.json, gpu_profile.md, tests_cuda.log,
# tests_core.log, failures.log, environment.txt. Uses the python that holds
# torch (PYTHON, default: .venv's if there is one, else python3) with this checkout's src/ first.
#
#   bash benchmarks/gpu_check.sh "$OUT"        # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run DIR  # here, without a GPU: collects the tests and
#                                               # runs the benchmark on CPU at tiny sizes
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUTDIR=${1:-benchmarks/results}
mkdir -p "$OUTDIR"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
TEST_BUDGET=${QKV_GPU_TEST_S:-170}   # seconds for the tests (both runs at once)
BENCH_BUDGET=${QKV_GPU_BENCH_S:-200} # seconds after which the benchmark takes no new row
DEFORM_BUDGET=${QKV_GPU_DEFORM_S:-60} # the same for the deformable benchmark; 0: not run
PROFILE_BUDGET=${QKV_GPU_PROFILE_S:-90} # seconds for gpu_profile.py; 0: not run
PER_TEST=()
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout "${QKV_GPU_TEST_TIMEOUT:-60}")
CORE_TESTS=(tests/test_tiled.py tests/test_mask_contract.py tests/test_trust_kernels.py
            tests/test_masks.py tests/test_vs_torch.py tests/test_sinks.py tests/test_gradients.py
            tests/test_dispatch.py)
[ -f tests/test_host_reads.py ] && CORE_TESTS+=(tests/test_host_reads.py)
# QKV_GPU_CORE_TESTS="tests/a.py tests/b.py" runs those instead (a short lease's second call)
if [ -n "${QKV_GPU_CORE_TESTS:-}" ]; then read -r -a CORE_TESTS <<< "$QKV_GPU_CORE_TESTS"; fi

{
    date -u +%FT%TZ
    git rev-parse HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
        --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PYTHON" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", "cudnn",
          torch.backends.cudnn.version())
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton:", e)
import qkv; print("qkv from", qkv.__file__)
EOF
} > "$OUTDIR/environment.txt" 2>&1
cat "$OUTDIR/environment.txt"

FAILLOG="$OUTDIR/failures.log"
: > "$FAILLOG"
if [ "$DRY" = 1 ]; then
    "$PYTHON" -m pytest -q --co tests/test_cuda.py > "$OUTDIR/tests_cuda.log" 2>&1
    QKV_TEST_DEVICE=cpu "$PYTHON" -m pytest -q --co "${CORE_TESTS[@]}" \
        > "$OUTDIR/tests_core.log" 2>&1
    tail -n 2 "$OUTDIR/tests_cuda.log" "$OUTDIR/tests_core.log"
    "$PYTHON" benchmarks/gpu_api.py --dry-run --out "$OUTDIR/gpu_api.json" \
        > "$OUTDIR/gpu_api.md"
    status=$?
    cat "$OUTDIR/gpu_api.md"
    "$PYTHON" benchmarks/gpu_deformable.py --dry-run --out "$OUTDIR/gpu_deformable.json" \
        > "$OUTDIR/gpu_deformable.md" || status=1
    cat "$OUTDIR/gpu_deformable.md"
    "$PYTHON" benchmarks/gpu_profile.py --dry-run --out "$OUTDIR/gpu_profile.json" \
        > "$OUTDIR/gpu_profile.md" || status=1
    head -n 12 "$OUTDIR/gpu_profile.md"
    exit $status
fi

echo "== tests (at most ${TEST_BUDGET}s)"
t0=$(date +%s)
QKV_TEST_FAILLOG="$FAILLOG" timeout "$TEST_BUDGET" "$PYTHON" -m pytest -q -n 6 -p no:randomly \
    -p no:cacheprovider --durations=10 "${PER_TEST[@]}" tests/test_cuda.py > "$OUTDIR/tests_cuda.log" 2>&1 &
cuda_pid=$!
QKV_TEST_DEVICE=cuda QKV_TEST_FAILLOG="$FAILLOG" timeout "$TEST_BUDGET" "$PYTHON" -m pytest -q \
    -n 8 -p no:randomly -p no:cacheprovider --durations=10 "${PER_TEST[@]}" "${CORE_TESTS[@]}" > "$OUTDIR/tests_core.log" 2>&1 &
core_pid=$!
wait $cuda_pid; echo "tests/test_cuda.py exit $? ($(tail -n 1 "$OUTDIR/tests_cuda.log"))"
wait $core_pid; echo "core files on cuda exit $? ($(tail -n 1 "$OUTDIR/tests_core.log"))"
echo "tests took $(( $(date +%s) - t0 ))s; failures: $(grep -c '^tests/' "$FAILLOG")"
grep '^tests/' "$FAILLOG" | cut -c1-160 | head -n 30

status=0
if [ "$BENCH_BUDGET" != 0 ]; then
    echo "== benchmark (no new row after ${BENCH_BUDGET}s)"
    timeout $(( BENCH_BUDGET + 120 )) "$PYTHON" benchmarks/gpu_api.py --budget-s "$BENCH_BUDGET" \
        --out "$OUTDIR/gpu_api.json" > "$OUTDIR/gpu_api.md"
    status=$?
    cat "$OUTDIR/gpu_api.md"
fi

if [ "$DEFORM_BUDGET" != 0 ]; then
    # one configuration (dtype, queries) takes about 5-20 s, the first one compiling the kernels
    echo "== deformable attention (no new configuration after ${DEFORM_BUDGET}s)"
    timeout $(( DEFORM_BUDGET + 60 )) "$PYTHON" benchmarks/gpu_deformable.py \
        --budget-s "$DEFORM_BUDGET" --out "$OUTDIR/gpu_deformable.json" \
        > "$OUTDIR/gpu_deformable.md" || status=1
    cat "$OUTDIR/gpu_deformable.md"
fi
if [ "$PROFILE_BUDGET" != 0 ]; then
    echo "== where a call's time goes (at most ${PROFILE_BUDGET}s)"
    timeout "$PROFILE_BUDGET" "$PYTHON" benchmarks/gpu_profile.py \
        --out "$OUTDIR/gpu_profile.json" > "$OUTDIR/gpu_profile.md" || status=1
    cat "$OUTDIR/gpu_profile.md"
fi
if [ "${QKV_GPU_PACK:-0}" = 1 ]; then
    files=$(cd "$OUTDIR" && ls -A | grep -v '^gpu_check.tgz$')
    (cd "$OUTDIR" && tar czf gpu_check.tgz $files && rm -f $files)
    echo "packed into $OUTDIR/gpu_check.tgz: $(echo $files)"
fi
exit $status
