#!/bin/bash
# Batched decode step on CUDA (issue 18, branch batch-step), on the H200:
#   1. build flashmoe + flashmoe_tests,
#   2. the batched-decode tests (CudaBatch.*: greedy ids equal each sequence
#      alone, both expert products, argmax on the device) and CudaOps.*
#      (FewRowsExpertsMatchCpu: few_rows_kernel against the CPU's rows),
#      the batched-prefill test (its small chunks take the new kernel),
#   3. CudaBatchBench (35B synthetic, B = 1, 8, 32, 64, 128: the tiled
#      expert product = main's path against few_rows_kernel, logits to the
#      host / argmax on the device / none; then the default, with graphs),
#   4. `flashmoe bench --batch B` at B = 32 and the plain tg128 (B = 1).
# usage (repository root, on the device): bash gpu-tasks/batch-step.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/batch-step; mkdir -p $D
T0=$SECONDS
(cmake -S . -B build -DCMAKE_BUILD_TYPE=Release $CMAKE_EXTRA > $D/build.log 2>&1 &&
 cmake --build build -j 6 --target flashmoe flashmoe_tests >> $D/build.log 2>&1) || { echo "FAIL build"; tail -40 $D/build.log; exit 1; }
echo "== build ok at $((SECONDS-T0)) s"
F='CudaBatch.*:CudaOps.*:CudaCoderMini.BatchedPrefillMatchesTokenByToken'
[ -d tests/fixtures/tiny-qwen35moe ] || F="$F:-CudaBatch.GoldenFixturesMatchEachSequenceAlone"
timeout 100 ./build/flashmoe_tests --gtest_filter="$F" > $D/tests.log 2>&1
rc=$?
grep -E "^\[cuda-batch\]|^\[  (PASSED|FAILED)|FAILED  \]|Failure|tests ran|Expected|Which is|rel_err" $D/tests.log | head -50
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"
timeout 110 ./build/flashmoe_tests --gtest_also_run_disabled_tests \
  --gtest_filter='CudaBatchBench.DISABLED_DecodeThroughputAt35b' > $D/bench.log 2>&1
echo "== bench rc $? at $((SECONDS-T0)) s"
grep -E "^\[batch-bench\]|FAILED|rror" $D/bench.log | sed -E 's/; experts touched.*roofline/; roofline/'
timeout 40 ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b --batch 32 -n 64 -r 2 2>&1 | grep -vE "^\s*$" | tail -6 | tee $D/bench_b32.txt
echo "== at $((SECONDS-T0)) s"
timeout 40 ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 3 2>&1 | grep -E "^\| (tg)|rror" | tee $D/tg.txt
echo "== done at $((SECONDS-T0)) s"
