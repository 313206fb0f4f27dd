#!/bin/bash
# Issue 22, the H200 link bound (branch huge-prefetch): Qwen3.5-397B-A17B
# synthetic, q4 experts tiered by the memory plan (VRAM, then pinned host
# memory), with and without the host-tier experts each MoE layer's input
# predicts copied to VRAM by the copy engine during its mixer
# (bench --host-prefetch N,...: the tg test once per N on one model).
#   1. the tier tests (bitwise logits with the copies, predictions as made
#      and forced wrong),
#   2. (ROUND=1 only) 10 layers with the 60-layer model's VRAM share
#      (--gpu-expert-cache 53.5%: 273 of 512 experts per layer), tg64 for
#      N = 0,1,2,1k,2k,3k,0 in one call (Nk: the expert kernels wait for the
#      copies they read),
#   3. the 60-layer model, K = 10, pp512, tg128 with N = 0,1,1k (round 1:
#      0,1), each with the fraction of the link bound; --stats also prints
#      the link rates (cudaMemcpyAsync against a zero-copy read kernel, same
#      bytes) and a host round trip.
# No build: build/ is ready (the lead's merged tree).
# usage (repository root, on the device): bash gpu-tasks/huge-prefetch.sh [limit_s]
# Expected: "PASS tests", the link rates, a 60-layer tg line per N with
# "tg at X% of the link bound" (round 1: N = 1 21.3 against 20.4 off).
set -o pipefail
LIMIT=${1:-160}
OUT=${OUT:-/tmp/out}; D="$OUT/huge-prefetch"; mkdir -p "$D"
T0=$SECONDS
log() { echo "== $* (at $((SECONDS-T0)) s)"; }
left() { echo $((LIMIT - 3 - (SECONDS-T0))); }
test -x build/flashmoe || { echo "FAIL no build/flashmoe"; exit 1; }
test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe_tests"; exit 1; }
grep -E "MemAvailable" /proc/meminfo
log "tests"
timeout 30 ./build/flashmoe_tests --gtest_filter='CudaTiers.ExpertsCopiedAheadGiveTheSameLogits:CudaTiers.SyntheticExpertsGeneratedWhereTheyLive' > "$D/tests.txt" 2>&1
rc=$?
grep -E "^\[  (FAILED|PASSED|     OK) |\[cuda-tiers\]|Failure|Expected|Which is" "$D/tests.txt" | head -30
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc; 124: the time limit)"
B="./build/flashmoe bench --device cuda --synthetic qwen3.5-397b-a17b --experts q4 --stats"
summary() {  # the lines that matter of a bench log
  grep -E "^\| (pp|tg)|choices served|copied ahead|link|expert|round trip|built in" "$1"
}
# Round 1 (bench/NOTES-cuda.md) measured the 10-layer A/B (N = 0,1,2,1k,2k,3k)
# and the 60-layer run with N = 0,1; round 2 measures the 60-layer model with
# N = 0,1,1k side by side (ROUND=1: round 1's steps).
if [ "${ROUND:-2}" = 1 ]; then
  AB=${AB:-0,1,2,1k,2k,3k,0}
  log "10 layers, 273 of 512 in VRAM, tg64, N = $AB"
  timeout 50 $B --layers 10 --gpu-expert-cache 53.5% -p 0 -n 64 -r 1 --host-prefetch "$AB" > "$D/ab10.txt" 2>&1
  rc=$?
  summary "$D/ab10.txt"
  [ $rc = 0 ] || { tail -5 "$D/ab10.txt"; echo "FAIL 10-layer A/B (rc $rc)"; }
  VARIANTS=0,1
else
  VARIANTS=${VARIANTS:-0,1,1k}
fi
log "60 layers, K = 10, pp512 tg128, N = $VARIANTS"
timeout "$(left)" $B -p 512 -n 128 -r 1 --host-prefetch "$VARIANTS" > "$D/bench60.txt" 2>&1
rc=$?
summary "$D/bench60.txt"
awk '/copied ahead per MoE layer:/ { n = $8; if (/kernels wait/) n = n "k" } /^\| tg/ { split($0, f, "|"); split(f[3], v, " "); printf "  60 layers, N=%s: tg128 %s tokens/s\n", n, v[1] }
     /of the link bound/ { sub(/.*tg at /, ""); printf "    %s\n", $0 }' "$D/bench60.txt"
[ $rc = 0 ] && echo "PASS 60 layers" || { tail -5 "$D/bench60.txt"; echo "FAIL 60 layers (rc $rc; 124: the time limit)"; }
log "done"
