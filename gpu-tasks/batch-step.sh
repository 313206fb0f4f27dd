#!/bin/bash
# The batched decode step at B = 32 (issue 18, branch batch-step, session 8),
# on the H200 with build/ already built, within 50 s; each part skipped when
# time is short:
#   1. CudaBatchBench (35B synthetic, graphs, one model): in session 8's
#      rounds session 7's kernels against the delta rule staged through
#      shared memory, programmatic dependent launch, both; both won, the
#      others were removed after round 2, so it now measures the default
#      alone (round 1 also measured the experts' weights prefetched into
#      L2: it lost, removed);
#   2. the tests of what changed (CudaBatch.* at the 35B's shapes, the
#      prefill against token by token there);
#   3. the phases of a B = 32 step with the defaults (bench --profile: plain
#      launches, the shared expert in line).
# usage (repository root, on the device): bash gpu-tasks/batch-step.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/batch-step; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe, build/flashmoe_tests"; exit 1; }

timeout 20 stdbuf -oL ./build/flashmoe_tests --gtest_also_run_disabled_tests \
  --gtest_filter='CudaBatchBench.DISABLED_DecodeThroughputAt35b' > $D/bench.log 2>&1
echo "== bench rc $? at $((SECONDS-T0)) s"
grep -E "^\[batch-bench\]|FAILED|rror" $D/bench.log | sed -E 's/; experts touched.*roofline/; roofline/'

# The first device call: no models/ (the coder-mini tests need its reference.safetensors).
F='CudaBatch.*:CudaSynthetic.BatchedPrefillMatchesTokenByTokenAt35bShapes'
F="$F:-CudaBatch.GoldenFixturesMatchEachSequenceAlone:CudaBatch.CoderMini*:CudaBatch.OneStateTwiceIsAnError"
timeout 16 stdbuf -oL ./build/flashmoe_tests --gtest_filter="$F" > $D/tests.log 2>&1
rc=$?
grep -E "^\[ +(OK|FAILED) +\]|^\[  (PASSED|FAILED)|Failure|Expected|Which is|what\(\)" $D/tests.log | head -30
grep -E "^\[cuda-batch\] 35b-shapes" $D/tests.log
grep -E "^\[cuda-batch\]" $D/tests.log | sort -k6 -g | tail -2
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"

if [ $((SECONDS-T0)) -lt 40 ]; then
  timeout $((48 - (SECONDS-T0))) ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b --batch 32 -p 0 -n 8 \
    -r 1 --profile 2 > $D/profile.log 2>&1
  echo "== profile rc $? at $((SECONDS-T0)) s"
  grep -E "tg8" $D/profile.log | head -2
  sed -n '/batched decode profile/,$p' $D/profile.log | head -18
else echo "SKIPPED profile (time)"; fi
echo "== done at $((SECONDS-T0)) s"
