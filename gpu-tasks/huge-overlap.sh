#!/bin/bash
# Issue 22, the H200 link bound (branch huge-overlap): Qwen3.5-397B-A17B
# synthetic, q4 experts tiered by the memory plan (VRAM, then pinned host
# memory), K = 10. Variants side by side on one model (bench --host-copies):
#   off  the zero-copy expert kernels (main before this branch), the graph
#   1    the default: every chosen host-tier expert copied to VRAM by the
#        copy engine, one per MoE layer ahead of the router (predicted at
#        the previous MoE layer's router), the rest after it; the expert
#        kernels read the copies, each slot's blocks waiting for its own
#   Na   the same with N ahead, each predicted from the layer's input
# Round 1 (limit 80 s; the 60-layer model alone takes ~70 s to build):
#   1. 20 layers with the 60-layer model's VRAM share (--gpu-expert-cache
#      53.5%: 273 of 512 experts per layer in VRAM, the rest in pinned
#      memory), tg32 per variant: the same per-layer work as 60 layers,
#   2. 10 layers, the same share,
#   3. the tier tests (bitwise logits: the copies on and off, predictions as
#      made and forced wrong; every host-tier choice read from a copy).
# Round 2 (limit 90 s): the 60-layer model, tg32, off, 1 and 2 side by side
# (2 last: the one the limit may cut).
# Each tg line comes with the fraction of the link bound (cudaMemcpy from
# pinned memory, 1 GiB, best of 5).
# No build: build/ is ready (the lead's merged tree). Synthetic models and
# tests only (no models/).
# usage (repository root, on the device): bash gpu-tasks/huge-overlap.sh [limit_s] [round]
# Expected: "PASS" lines; bench/NOTES-cuda.md, "Every host-tier expert by
# the copy engine", has the predictions.
set -o pipefail
LIMIT=${1:-80}
ROUND=${2:-1}
OUT=${OUT:-/tmp/out}; D="$OUT/huge-overlap"; mkdir -p "$D"
T0=$SECONDS
log() { echo "== $* (at $((SECONDS-T0)) s)"; }
left() { echo $((LIMIT - 3 - (SECONDS-T0))); }
test -x build/flashmoe || { echo "FAIL no build/flashmoe"; exit 1; }
test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe_tests"; exit 1; }
B="./build/flashmoe bench --device cuda --synthetic qwen3.5-397b-a17b --experts q4 --stats"
summary() {  # the lines that matter of a bench log
  grep -E "^\| (pp|tg)|choices served|copied|link|round trip|built in|per-kernel|^\| [^|]+ \| [0-9.]+ \| [0-9]+ \||^\| total" "$1"
}
table() {  # one line per variant: tokens/s and the fraction of the link bound
  awk '/^host-tier experts: zero-copy/ { n = "off" } /^host-tier experts: copy engine/ { n = $5; if (/from the layer.s input/) n = n "a" }
       /^\| tg/ { split($0, f, "|"); split(f[3], v, " "); t = v[1] }
       /of the link bound/ { sub(/.*tg at /, ""); printf "  %s, %s: tg %s tokens/s, %s\n", L, n, t, $0 }' L="$2" "$1"
}
ab() {  # ab NAME TIMEOUT ARGS...: one bench call, its table first, then its summary
  local name=$1 t=$2; shift 2
  log "$name: $*"
  timeout "$t" stdbuf -oL $B "$@" > "$D/$name.txt" 2>&1  # line-buffered: a run cut by the limit keeps its lines
  local rc=$?
  table "$D/$name.txt" "$name"
  summary "$D/$name.txt"
  [ $rc = 0 ] && echo "PASS $name" || { tail -5 "$D/$name.txt"; echo "FAIL $name (rc $rc; 124: the time limit)"; }
}
if [ "$ROUND" = 1 ]; then
  ab layers20 42 --layers 20 --gpu-expert-cache 53.5% -p 0 -n 32 -r 1 --host-copies off,1,2,1a
  ab layers10 20 --layers 10 --gpu-expert-cache 53.5% -p 0 -n 32 -r 1 --host-copies off,1,off
  log "tests"
  timeout "$(left)" ./build/flashmoe_tests --gtest_filter='CudaTiers.ExpertsCopiedAheadGiveTheSameLogits:CudaTiers.SyntheticExpertsGeneratedWhereTheyLive' > "$D/tests.txt" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|PASSED|     OK) |\[cuda-tiers\]|Failure|Expected|Which is" "$D/tests.txt" | head -30
  [ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc; 124: the time limit)"
else
  ab layers60 "$(left)" -p 0 -n 32 -r 1 --host-copies off,1,2
fi
grep -E "MemAvailable" /proc/meminfo
log "done"
