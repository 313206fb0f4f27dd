#!/usr/bin/env bash
# GGUF decode kernels a block per warp iteration (Q4_K / Q6_K,
# src/backend/cuda/gguf_warp_dot.cuh), checked and timed on the H200.
# Needs build/flashmoe and build/flashmoe_tests already built (no build
# here) and the 35B-A3B-shaped Q4_K_M file of gpu-tasks/gguf-35b.sh at
# /tmp/gguf35b/q4_k_m.gguf. Runs in under 90 s.
# Expected: the CUDA GGUF tests PASS (every kind's matvec / experts / prefill
# against the CPU's block kernels; the tiny GGUF models' greedy tokens), then
# pp512 / tg128 of the 35B file (tg128 before: 113 tok/s; llama.cpp CUDA
# 240; predicted here 300-400, bench/NOTES-cuda.md), then the per-kernel-class
# decode profile (the GGUF kernels' share of the step).
set -uo pipefail
cd "$(dirname "$0")/.."
F=/tmp/gguf35b/q4_k_m.gguf
for b in build/flashmoe build/flashmoe_tests; do [ -x $b ] || { echo "FAIL: $b not built"; exit 1; }; done
# The suites are parameterised (Kinds/CudaGgufOps.*): match them with *...*.
T=$(timeout 40 ./build/flashmoe_tests --gtest_brief=1 --gtest_filter='*CudaGgufOps*:*CudaGgufModel*:*BlockQuant*' 2>&1)
rc=$?
echo "$T" | tail -25
if [ $rc -eq 0 ] && echo "$T" | grep -qE "PASSED.* [1-9][0-9]* test" && ! echo "$T" | grep -q "SKIPPED"; then
  echo "PASS: CudaGgufOps / CudaGgufModel / BlockQuant"
else
  echo "FAIL: CudaGgufOps / CudaGgufModel / BlockQuant (rc $rc, see above; skipped = no GPU or fixtures)"
fi
[ -f $F ] || { echo "FAIL: $F missing (gpu-tasks/gguf-35b.sh writes it)"; exit 1; }
echo "== flashmoe bench -m $F --device cuda -p 512 -n 128 -r 2"
timeout 30 ./build/flashmoe bench -m $F --device cuda -p 512 -n 128 -r 2 2>&1 | tail -6
echo "== flashmoe bench -m $F --device cuda -p 0 -n 32 -r 1 --profile 16"
timeout 20 ./build/flashmoe bench -m $F --device cuda -p 0 -n 32 -r 1 --profile 16 2>&1 | tail -40
