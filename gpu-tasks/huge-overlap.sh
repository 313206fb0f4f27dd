#!/bin/bash
# Issue 22, the H200 link bound (branch huge-overlap): Qwen3.5-397B-A17B
# synthetic, q4 experts tiered by the memory plan (VRAM, then pinned host
# memory), K = 10. Variants side by side on one model (bench --host-prefetch):
#   0   the zero-copy expert kernels (main), one CUDA graph per step
#   Na  N host-tier experts predicted from the layer's input copied by the
#       copy engine during the mixer, then every other chosen host-tier
#       expert copied after the router; the expert kernels read all host-tier
#       experts from VRAM staging, each slot's blocks waiting for its copy
#   Nn  as Na, but the N copies ahead predicted at the previous MoE layer's
#       router (its router applied to that layer's residual) and queued right
#       behind that layer's copies: no gap on the link between two layers
#   0a  no prediction: every chosen host-tier expert copied after the router
# Steps:
#   1. the tier tests (bitwise logits with the copies: predictions as made,
#      forced wrong, and every host-tier expert copied),
#   2. 10 layers with the 60-layer model's VRAM share (--gpu-expert-cache
#      53.5%: 273 of 512 experts per layer), tg64 per variant,
#   3. the 60-layer model, tg64 per variant, each with the fraction of the
#      link bound (cudaMemcpy from pinned memory, 1 GiB, best of 5); then the
#      per-kernel-class profile of the step (plain launches, events between
#      kernels) in the last variant (0): where the step's time goes.
# No build: build/ is ready (the lead's merged tree).
# usage (repository root, on the device): bash gpu-tasks/huge-overlap.sh [limit_s]
# Expected: "PASS tests"; at 60 layers 0 ~20.3 tokens/s (72%), 1a ~24
# (85%); at 10 layers 1a above 0.
set -o pipefail
LIMIT=${1:-150}
OUT=${OUT:-/tmp/out}; D="$OUT/huge-overlap"; mkdir -p "$D"
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
  grep -E "^\| (pp|tg)|choices served|copied|link|round trip|built in|per-kernel|^\| [^|]+ \| [0-9.]+ \| [0-9]+ \||^\| total" "$1"
}
table() {  # one line per variant: tokens/s and the fraction of the link bound
  awk '/copied ahead per MoE layer:/ { n = $8; if (/previous MoE layer/) n = n "n"; else if (/after the router/) n = n "a"; else if (/kernels wait/) n = n "k" }
       /^\| tg/ { split($0, f, "|"); split(f[3], v, " "); t = v[1] }
       /of the link bound/ { sub(/.*tg at /, ""); printf "  %s, N=%s: tg %s tokens/s, %s\n", L, n, t, $0 }' L="$2" "$1"
}
AB10=${AB10:-0,1a,1n,0a,0}
log "10 layers, 273 of 512 in VRAM, tg64, N = $AB10"
timeout 40 $B --layers 10 --gpu-expert-cache 53.5% -p 0 -n 64 -r 1 --host-prefetch "$AB10" > "$D/ab10.txt" 2>&1
rc=$?
summary "$D/ab10.txt"
table "$D/ab10.txt" "10 layers"
[ $rc = 0 ] && echo "PASS 10 layers" || { tail -5 "$D/ab10.txt"; echo "FAIL 10 layers (rc $rc)"; }
AB60=${AB60:-0,1a,1n,2n,0}
log "60 layers, K = 10, tg64, N = $AB60, then the profile (N = 0)"
timeout "$(left)" $B -p 0 -n 64 -r 1 --host-prefetch "$AB60" --profile 4 > "$D/bench60.txt" 2>&1
rc=$?
summary "$D/bench60.txt"
table "$D/bench60.txt" "60 layers"
[ $rc = 0 ] && echo "PASS 60 layers" || { tail -5 "$D/bench60.txt"; echo "FAIL 60 layers (rc $rc; 124: the time limit)"; }
log "done"
