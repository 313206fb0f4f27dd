#!/bin/bash
# Issue 20 on the H200 (branch mtp-verify): the verify pass on the batched
# decode step (verify.cu), build/ already built. Most important first:
#   1. `bench --mtp` on the 35B synthetic: plain decoding and speculative at
#      N = 1, 2, 3 with forced acceptance 0.8, side by side per repetition
#      (their ratios; target >= 1.6x at 0.8); then N = 1, 3 at 0.8 and 0.9,
#      each also rolled back by restore + re-feed (--mtp-refeed) beside
#      take_back;
#   2. the CUDA MTP tests (CudaMtp.*: the verify pass against the prefill and
#      the CPU, take_back to every row, greedy --mtp = plain for N = 1..4 with
#      f32, fp8 and windowed KV, the head against the CPU and torch);
#      needs models/coder-mini (the round's second call; the torch check
#      also tests/fixtures/mtp, and skips without it).
# The plain tg in 1. is main's decode step: against ~420 tokens/s (not
# slower with --mtp off). 50 s in all.
# usage (repository root, on the device): bash gpu-tasks/mtp-verify.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/mtp-verify; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe, build/flashmoe_tests"; exit 1; }
B=build/flashmoe
# The main figures first (N = 1, 2, 3 at 0.8), then 0.9 and the re-feed
# roll-back beside take_back, in a second process (partial results survive).
bench() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t $B bench --synthetic qwen3.5-35b-a3b --device cuda -p 0 -n 64 -d 256 -r 2 --mtp "$@" > $D/$name.txt 2>&1
  local rc=$?
  echo "--- 35B synthetic bench --mtp $* (rc $rc, at $((SECONDS-T0)) s)"
  grep -E "^\| tg|^mtp:|speculative / plain|rror" $D/$name.txt
  [ $rc = 0 ] && echo "PASS $name" || echo "FAIL $name (rc $rc)"
}
bench bench-35b-a08 16 --spec-drafts 1,2,3 --mtp-accept 0.8
bench bench-35b-a09-refeed 18 --spec-drafts 1,3 --mtp-accept 0.8,0.9 --mtp-refeed
timeout 14 stdbuf -oL ./build/flashmoe_tests --gtest_filter='CudaMtp.*' > $D/tests.log 2>&1
rc=$?
grep -E "^\[cuda-mtp\]|^\[ +(OK|FAILED) +\]|^\[  (PASSED|FAILED)|Failure|Expected|Which is|what\(\)|rror" $D/tests.log | head -60
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"
echo "== done at $((SECONDS-T0)) s"
