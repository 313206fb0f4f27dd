#!/bin/bash
# Batched decode step on CUDA, its fixed per-layer cost (issue 18, branch
# batch-fixed), on the H200 with build/ already built (no build here):
#   1. CudaOps.SkinnyProductMatchesCpu (skinny_gemm_kernel against a double
#      product: every token-tile count, K split over clusters, the three
#      modes), the batched-decode tests (CudaBatch.*: each sequence's
#      logits against the same sequence alone, every expert product) and
#      the prefill against token by token (chunks of 7, 30, 64 take the
#      skinny products),
#   2. CudaBatchBench (35B synthetic, B = 1, 8, 32, 64 on one model: the
#      expert products side by side, then the default with graphs; the
#      roofline fraction of each),
#   3. `flashmoe bench --batch 32 --profile 2`: the step's phases.
# usage (repository root, on the device): bash gpu-tasks/batch-fixed.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/batch-fixed; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe, build/flashmoe_tests"; exit 1; }
F='CudaOps.SkinnyProductMatchesCpu:CudaBatch.*:CudaCoderMini.BatchedPrefillMatchesTokenByToken:CudaSynthetic.BatchedPrefillMatchesTokenByTokenAt35bShapes:-CudaBatch.GoldenFixturesMatchEachSequenceAlone'
timeout 35 stdbuf -oL ./build/flashmoe_tests --gtest_filter="$F" > $D/tests.log 2>&1
rc=$?
grep -E "^\[cuda-batch\]|^\[ +(OK|FAILED) +\]|^\[  (PASSED|FAILED)|Failure|Expected|Which is|want|what\(\)" $D/tests.log | head -40
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"
timeout 36 stdbuf -oL ./build/flashmoe_tests --gtest_also_run_disabled_tests \
  --gtest_filter='CudaBatchBench.DISABLED_DecodeThroughputAt35b' > $D/bench.log 2>&1
echo "== bench rc $? at $((SECONDS-T0)) s"
grep -E "^\[batch-bench\]|FAILED|rror" $D/bench.log | sed -E 's/; experts touched.*roofline/; roofline/'
timeout 14 stdbuf -oL ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b --batch 32 -p 0 -n 8 -r 1 --profile 2 > $D/profile.txt 2>&1
grep -A17 "batched decode profile" $D/profile.txt; grep -E "x32 \(aggregate\)" $D/profile.txt
echo "== done at $((SECONDS-T0)) s"
