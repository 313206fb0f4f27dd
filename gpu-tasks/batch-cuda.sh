#!/bin/bash
# Batched decode on CUDA (issue 18, branch batch-cuda), on the H200:
#   1. build (unless build/ was built by `bash bench/cuda_device_run.sh build`),
#   2. the batched-decode tests (CudaBatch.*) and the CUDA tests that share
#      the kernels this branch touched (decode step, batched prefill),
#   3. the batched-decode bench on the 35B synthetic at B = 1, 8, 32, 64,
#      and today's single-stream decode bench for B = 1.
# usage (repository root, on the device): bash gpu-tasks/batch-cuda.sh
# Logs under $OUT (default /tmp/out). About 4-5 minutes with build/ present.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
T0=$SECONDS
if [ ! -x build/flashmoe_tests ] || [ ! -x build/flashmoe ]; then
  bash bench/cuda_device_run.sh build || exit 1
else
  # build/ present: bring it up to date with this tree (incremental).
  cmake --build build -j16 --target flashmoe flashmoe_tests > $OUT/batch-build.log 2>&1 || { tail -40 $OUT/batch-build.log; exit 1; }
fi
echo "== build ok at $((SECONDS-T0)) s"
# CudaBatch.*: this branch's tests. The others run the kernels whose bodies
# moved into inline functions (decode step, single ops) and the prefill
# whose feed-forward became a method (Prefill::feed_forward).
F='CudaBatch.*:CudaOps.*:CudaCoderMini.DecodeStepKernelsMatchCpu:CudaCoderMini.BatchedPrefillMatchesTokenByToken:CudaCoderMini.H2oKeepsTheCpusPositions:CudaSynthetic.*'
if [ ! -d tests/fixtures/tiny-qwen35moe ]; then
  if [ -d /tmp/fx/tiny-qwen35moe ]; then ln -sfn /tmp/fx tests/fixtures
  else
    echo "tests/fixtures is not in the tree: CudaBatch.GoldenFixturesMatchEachSequenceAlone skipped (run bench/cuda_device_run.sh fixtures first)"
    F="$F:-CudaBatch.GoldenFixturesMatchEachSequenceAlone"
  fi
fi
timeout 240 ./build/flashmoe_tests --gtest_filter="$F" > $OUT/batch_tests.log 2>&1
echo "== tests rc $? at $((SECONDS-T0)) s"
grep -E "^\[cuda-batch\]|^\[  (PASSED|FAILED)|FAILED  \]|tests ran" $OUT/batch_tests.log | head -60
timeout 150 ./build/flashmoe_tests --gtest_also_run_disabled_tests \
  --gtest_filter='CudaBatchBench.DISABLED_DecodeThroughputAt35b' > $OUT/batch_bench.log 2>&1
echo "== bench rc $? at $((SECONDS-T0)) s"
grep -E "^\[batch-bench\]|FAILED|error" $OUT/batch_bench.log
# Today's single-stream decode (on-device greedy), for B = 1 against main.
timeout 90 ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 3 2>&1 | grep -E "^\| (tg)|error" | tee $OUT/batch_tg.txt
echo "== done at $((SECONDS-T0)) s"
