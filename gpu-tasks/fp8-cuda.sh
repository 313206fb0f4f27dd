#!/bin/bash
# Issue 23's CUDA half on the H200, correctness (flashmoe and flashmoe_tests
# already built in build/; this script builds nothing):
#  1. the CUDA tests of the FP8 kernels (op checks against the CPU; FP8
#     checkpoints of coder-mini, tiny-qwen3next and tiny-qwen35moe against
#     the CPU, with the max differences per phase);
#  2. the FP8 checkpoints against HF (gpu-tasks/hf-reference.sh fp8: the
#     references made as the golden fixtures' were; flashmoe CPU and CUDA
#     within 1e-3, KL vs the bf16 model).
# The speed side (35B synthetic fp8 / bf16 / q4, profiles) is
# gpu-tasks/fp8-speed.sh.
# usage (repository root, on the device): bash gpu-tasks/fp8-cuda.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/fp8-cuda"; exec > >(tee "$OUT/fp8-cuda/log.txt") 2>&1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/flashmoe or build/flashmoe_tests missing"; exit 1; }

./build/flashmoe_tests --gtest_brief=1 \
  --gtest_filter='CudaOps.Fp8*:CudaOps.QuantExpertsMatchCpu:*CudaFp8.*' \
  2>&1 | grep -E "^\[cuda-fp8\]|^\[cuda-packed\]|FAILED|Failure|Expected|Which is|actual|PASSED|error" | head -60
echo "CUDA tests done at $(el) s"

bash gpu-tasks/hf-reference.sh fp8
echo "all done at $(el) s"
