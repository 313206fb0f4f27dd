#!/usr/bin/env bash
# Dense GGUF matrices (in-/out-projections, lm_head) repacked at upload for
# the decode matvec (src/backend/cuda/gguf_dense_layout.cuh,
# gguf_dense_matvec.cuh), checked and timed on the H200 at the
# Qwen3.5-35B-A3B shape (round 2: the default only; round 1 measured it
# against the file's blocks and a 3-blocks-an-SM cut, both removed since).
# Needs build/flashmoe and
# build/flashmoe_tests built, the 35B-shaped Q4_K_M file at
# /tmp/gguf35b/q4_k_m.gguf (bench/gguf_random_35b.py; the lead's round makes
# it). About 35 s. Prediction: bench/NOTES-cuda.md "Session 8: dense GGUF
# matrices repacked".
set -uo pipefail
cd "$(dirname "$0")/.."
F=/tmp/gguf35b/q4_k_m.gguf
OUT=${OUT:-/tmp/gguf-dense-out}
mkdir -p "$OUT"
for b in build/flashmoe build/flashmoe_tests; do [ -x $b ] || { echo "FAIL: $b not built"; exit 1; }; done
bench() {  # $1: label, $2: prompt tokens, then extra flags
  local label=$1 pp=$2
  shift 2
  echo "== $label: flashmoe bench -m $F --device cuda -p $pp -n 128 -r 2 --profile 16 $*"
  local t0=$SECONDS
  timeout 16 ./build/flashmoe bench -m $F --device cuda -p $pp -n 128 -r 2 --profile 16 "$@" >"$OUT/bench-$label.txt" 2>&1
  echo "rc $? [$((SECONDS - t0)) s]"
  grep -E "pp512|tg128|^\| (in-proj|out-proj|lm_head|experts|router|total)" "$OUT/bench-$label.txt"
}
if [ -f $F ]; then
  bench repacked 512
else
  echo "FAIL: $F missing"
fi
T=$(timeout 10 ./build/flashmoe_tests --gtest_brief=1 \
  --gtest_filter='*CudaGgufOps*:*CudaGgufDense*:*CudaGgufModel*:*DenseRepack*' 2>&1)
rc=$?
echo "$T" >"$OUT/tests.txt"
echo "$T" | grep -E "FAILED|\[cuda-gguf\].*repacked|tests? ran|PASSED" | tail -20
if [ $rc -eq 0 ] && echo "$T" | grep -qE "PASSED.* [1-9][0-9]* test"; then
  echo "PASS: CudaGgufOps / CudaGgufDense / CudaGgufModel / DenseRepack"
else
  echo "FAIL: CudaGgufOps / CudaGgufDense / CudaGgufModel / DenseRepack (rc $rc; $OUT/tests.txt)"
fi
[ -f $F ] && bench repacked-again 0
