#!/bin/bash
# The KV retention policies on one H200 (issue 24): the CUDA tests and the
# decode speed of each policy; from the repository root (same staging as
# bench/cuda_device_run.sh: gpu/debs,
# models/ carried, tests/fixtures moved out):
#   bash bench/cuda_kv_retention.sh          # logs into $OUT
#
# 1. build, then the CUDA tests. New in them:
#    - kv_cases() gains "tova64" (f32, 4 sinks) and "fp8-tova48" (0 sinks), so
#      CudaCoderMini.MatchesCpuForEveryKvConfig, SplitAttentionMatchesCpu...,
#      BatchedPrefillMatchesTokenByToken, SnapshotsRestoreExactly and
#      CudaSynthetic.BatchedPrefillMatchesTokenByTokenAt35bShapes run TOVA.
#      Expect lines like
#        [cuda-vs-cpu] tova64             mean KL ~1e-11, max |dlogit| ~1e-4
#        [cuda-vs-cpu] fp8-tova48         mean KL ~1e-9 (limit 1e-3)
#      (the same orders as h2o64 / fp8-h2o48 in bench/results/*-tests.txt).
#    - CudaCoderMini.H2oKeepsTheCpusPositions now also runs tova 64 and
#      tova 40 (bf16, 0 sinks, --kv-recent 0.5): the GPU must hold exactly the CPU's positions
#      after the prompt and after 32 greedy steps, split off and forced.
#    Expected: [  PASSED  ] for all; any FAILED names the config.
# 2. decode speed of each policy at a 4,096-token context, 35B synthetic, fp8
#    KV, budget 2,048 for every bounded policy, two interleaved rounds
#    (bench/kv_policy_speed.sh: one line per run, then "mean <policy> N tok/s")
#    (docs/performance.md had full / window 2048 / h2o 2048 = 365.6 / 396.6 /
#    392.0 tok/s). Prediction: tova within ~2% of h2o (the same kernels; the
#    score kernel writes instead of adding), streaming = window.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
bash bench/cuda_device_run.sh build || exit 1
./build/flashmoe_tests --gtest_filter='Cuda*:-*CudaGolden*' > $OUT/kv_retention_cuda_tests.log 2>&1
grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tova|h2o" $OUT/kv_retention_cuda_tests.log | head -60
bench/kv_policy_speed.sh build "--device cuda --synthetic qwen3.5-35b-a3b --kv-dtype fp8" 4096 2048 128 2 |
  tee $OUT/kv_retention_bench_35b.txt
