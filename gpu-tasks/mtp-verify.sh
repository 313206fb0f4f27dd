#!/bin/bash
# Issue 20 on the H200 (branch mtp-verify): the verify pass on the batched
# decode step (verify.cu), build/ already built. Most important first:
#   1. `bench --mtp` on the 35B synthetic, one process: plain decoding and
#      speculative at N = 1, 2, 3 with forced acceptance 0.8 and 0.9, side by
#      side per repetition (their ratios; target >= 1.6x at 0.8), each also
#      rolled back by restore + re-feed (--mtp-refeed) beside take_back;
#   2. the CUDA MTP tests (CudaMtp.*: the verify pass against the prefill and
#      the CPU, take_back to every row, greedy --mtp = plain for N = 1..4 with
#      f32, fp8 and windowed KV, the head against the CPU and torch);
#      needs `fixtures: models/coder-mini tests/fixtures/mtp`;
#   3. (r2) coder-mini `bench --mtp` at its real acceptance, and plain decode
#      beside main's figure (not slower with --mtp off).
# usage (repository root, on the device): bash gpu-tasks/mtp-verify.sh [r2]
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/mtp-verify; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe, build/flashmoe_tests"; exit 1; }
B=build/flashmoe
timeout 38 $B bench --synthetic qwen3.5-35b-a3b --device cuda -p 0 -n 64 -d 256 -r 2 --mtp --spec-drafts 1,2,3 \
  --mtp-accept 0.8,0.9 --mtp-refeed > $D/bench-35b.txt 2>&1
rc=$?
echo "--- 35B synthetic bench --mtp --spec-drafts 1,2,3 --mtp-accept 0.8,0.9 --mtp-refeed (rc $rc, at $((SECONDS-T0)) s)"
grep -E "^\| tg|^mtp:|speculative / plain|rror" $D/bench-35b.txt
[ $rc = 0 ] && echo "PASS bench-35b" || echo "FAIL bench-35b (rc $rc)"
timeout 18 stdbuf -oL ./build/flashmoe_tests --gtest_filter='CudaMtp.*' > $D/tests.log 2>&1
rc=$?
grep -E "^\[cuda-mtp\]|^\[ +(OK|FAILED) +\]|^\[  (PASSED|FAILED)|Failure|Expected|Which is|what\(\)|rror" $D/tests.log | head -60
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"
if [ "$1" = r2 ]; then
  timeout 8 $B bench -m models/coder-mini --device cuda -p 0 -n 128 -r 2 --mtp --spec-drafts 1,2,3 \
    > $D/bench-cm.txt 2>&1
  echo "--- coder-mini bench --mtp --spec-drafts 1,2,3 (rc $?)"; grep -E "^\| tg|^mtp:|speculative / plain|rror" $D/bench-cm.txt
fi
echo "== done at $((SECONDS-T0)) s"
