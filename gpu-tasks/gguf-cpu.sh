#!/usr/bin/env bash
# Branch gguf-cpu on an H200: the CPU's GGUF decode now multiplies Q4_K /
# Q6_K / Q8_0 / Q5_0 rows against activations rounded to two int16 codes
# (core/block_quant_i16.cpp); the GPU keeps fp32. Checks that the CPU and
# the GPU still agree step by step and in greedy ids:
#   1. build flashmoe + flashmoe_tests (only if build/ lacks them)
#   2. CudaGgufModel.* (tiny GGUF fixtures: prefill, 12 decode steps and 8
#      greedy ids, GPU against CPU), GgufLogits.* and BlockQuant.* (CPU)
#   3. if gpu-gguf/coder-mini-{q8_0,q4_k_m}.gguf are present: 24 greedy ids
#      on cpu and on cuda from coder-mini's reference prompt, PASS if equal
#
#   bash gpu-tasks/gguf-cpu.sh
# Expected: step 2 "[  PASSED  ]" with the [cuda-gguf] decode lines at
# max |dlogit| <= 1e-3 (decode steps <= 1.6e-5 before this branch); step 3
# PASS lines (or SKIP). Takes ~20 s with build/ ready.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${B:-build}
echo "== 1. build (skipped when build/ is ready)"
if ! [ -x $B/flashmoe ] || ! [ -x $B/flashmoe_tests ]; then
  cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CMAKE_EXTRA:-} >/dev/null &&
    cmake --build $B -j 6 --target flashmoe flashmoe_tests 2>&1 | grep -E "error" | head -30
fi
[ -x $B/flashmoe ] && [ -x $B/flashmoe_tests ] || { echo "FAIL build"; exit 1; }
echo "== 2. GGUF tests, CPU int16 decode against the GPU"
log=$(mktemp)
$B/flashmoe_tests --gtest_filter='*CudaGgufModel*:*GgufLogits*:*BlockQuant*' >"$log" 2>&1
rc=$?
grep -E "^\[cuda-gguf\]|token by token|FAILED|Failure|Expected|Which is|actual|PASSED|SKIPPED \]" "$log" | head -60
if [ $rc -eq 0 ]; then echo "PASS GGUF tests (CudaGgufModel, GgufLogits, BlockQuant)"
else echo "FAIL GGUF tests (CudaGgufModel, GgufLogits, BlockQuant): exit $rc"; fi
ran=$(grep -c "OK \] Fixtures/CudaGgufModel" "$log")
if [ "$ran" -ge 4 ]; then echo "PASS CudaGgufModel ran on the GPU ($ran fixtures)"
else echo "FAIL CudaGgufModel ran for $ran of 4 fixtures (skipped: no GPU?)"; fi
echo "== 3. greedy 24 ids, cpu vs cuda"
P=$(python3 - <<'PY'
import json, struct
from array import array
raw = open('models/coder-mini/reference.safetensors', 'rb').read(); n = struct.unpack('<Q', raw[:8])[0]
e = json.loads(raw[8:8 + n])['ids']; a = array('q'); a.frombytes(raw[8 + n + e['data_offsets'][0]:8 + n + e['data_offsets'][1]])
print(','.join(map(str, a[:16])))
PY
)
for g in gpu-gguf/coder-mini-q8_0.gguf gpu-gguf/coder-mini-q4_k_m.gguf; do
  [ -f "$g" ] || { echo "SKIP $g (not carried)"; continue; }
  c=$($B/flashmoe generate -m "$g" --device cpu --ids "$P" -n 24 --greedy --print-ids 2>/dev/null | tail -n1)
  d=$($B/flashmoe generate -m "$g" --device cuda --ids "$P" -n 24 --greedy --print-ids 2>/dev/null | tail -n1)
  if [ -n "$c" ] && [ "$c" = "$d" ]; then echo "PASS $g greedy cpu = cuda: $c"; else echo "FAIL $g greedy cpu: $c cuda: $d"; fi
done
