#!/usr/bin/env bash
# GPU check of the float32-attention fix (input_precision="ieee", no TF32) and of Philox's torch path,
# on a CUDA machine, in under 4 minutes (each step in its own time box):
#
#   bash bench/gpu_check_ieee.sh [OUT_DIR]        # OUT_DIR default: $OUT, else /tmp/gpu-check-ieee
#
# 1. fp32-attention: every float32 case of tests/test_kernel_paged.py and tests/test_kernel_sparse.py
#    (the `dtype0` parametrisations, float32 in every list, and the unparametrised tests: the H200's
#    31 failures after commit 9d376fc were all among them), compiled Triton against the float32 reference;
# 2. bf16-mma: tests/test_attention_bf16_mma.py (the 16-bit path keeps its tensor-core MMA);
# 3. philox: tests/test_kernel_philox.py (Triton's tl.randint / tl.rand against the torch Philox);
# 4. philox-timing: bench/test_philox.py (pytest-benchmark medians of the torch Philox path vs torch's
#    generator; the GPU day measured ~1.2 ms vs ~50 µs at every size).
# Prints one line per step and the summary; each step's full output is in OUT_DIR/<step>.log.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/gpu-check-ieee}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python}
unset TRITON_INTERPRET REMASK_TRITON     # compiled Triton on CUDA

"$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"
print("device", torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)' \
    | tee "$OUT_DIR/env.log" || exit 1

WORKERS=()
if "$PY" -c 'import xdist' 2>/dev/null; then WORKERS=(-n "${WORKERS_N:-8}" --dist load); fi
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rfE --tb=short)
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

step() {   # step NAME BOX_SECONDS COMMAND...: run in its box, print its pytest tally
    local name=$1 box=$2; shift 2
    local start; start=$(date +%s)
    timeout -k 5 "$box" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local tally; tally=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT_DIR/$name.log" | tail -1)
    [ "$rc" = 124 ] && tally="TIMED OUT at ${box}s; ${tally}"
    echo "$name: rc=$rc, $(( $(date +%s) - start )) s: ${tally:-no pytest tally (see $name.log)}" | tee -a "$SUMMARY"
}

step fp32-attention 120 "${PYTEST[@]}" "${WORKERS[@]}" tests/test_kernel_paged.py tests/test_kernel_sparse.py \
    -k "not dtype1 and not dtype2"
step bf16-mma 30 "${PYTEST[@]}" tests/test_attention_bf16_mma.py
step philox 45 "${PYTEST[@]}" tests/test_kernel_philox.py
step philox-timing 40 "${PYTEST[@]}" bench/test_philox.py --benchmark-columns=min,median,rounds \
    --benchmark-sort=name

echo "--- failures"; grep -h '^FAILED\|^ERROR' "$OUT_DIR"/*.log | head -40
echo "--- philox timings"
grep -E '^(Name|test_seeded_gumbel_noise)' "$OUT_DIR/philox-timing.log" | sed -E 's/ +/ /g' | cut -c1-120
echo "--- summary"; cat "$SUMMARY"
