#!/bin/bash
# Issue 22, the H200 link bound (branch huge-overlap): Qwen3.5-397B-A17B
# synthetic, q4 experts tiered by the memory plan (VRAM, then pinned host
# memory), with and without the copy of a predicted host-tier expert to VRAM
# during each MoE layer's mixer (bench --copy-ahead-blocks N; 0, the
# default: no copy).
#   1. (build flashmoe and flashmoe_tests only if build/flashmoe is missing),
#   2. the tests of the copies (bitwise logits, counters; wait and no-wait),
#   3. A/B on 10 layers with the 60-layer model's VRAM share (273 of 512
#      experts per layer: --gpu-expert-cache 53.5%), tg64, in one call:
#      no copy, 32 blocks, 64 blocks (no wait: a copy not complete when the
#      layer's gate_up starts is cancelled),
#   4. the 60-layer model, K = 10, tg128 pp512 (the final numbers), with the
#      A/B's fastest setting when it beat no copy by > 1%, else with none.
# ROUND=1 (round 1 of this branch, 16 blocks waiting for the copy, and the
# 60-layer --moe-top-k 4 run) is in bench/NOTES-cuda.md.
# usage (repository root, on the device): bash gpu-tasks/huge-overlap.sh [limit_s]
# Expected: "PASS tests", three A/B tg lines, a 60-layer tg line with the
# fraction of the link bound.
set -o pipefail
LIMIT=${1:-178}
OUT=${OUT:-/tmp/out}; D="$OUT/huge-overlap"; mkdir -p "$D"
T0=$SECONDS
log() { echo "== $* (at $((SECONDS-T0)) s)"; }
left() { echo $((LIMIT - 3 - (SECONDS-T0))); }
if [ ! -x build/flashmoe ] || [ ! -x build/flashmoe_tests ]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release $CMAKE_EXTRA > "$D/cmake.log" 2>&1 || { tail -30 "$D/cmake.log"; echo "FAIL cmake"; exit 1; }
  cmake --build build -j 6 --target flashmoe flashmoe_tests > "$D/build.log" 2>&1 || { grep -E "error" "$D/build.log" | head -30; echo "FAIL build"; exit 1; }
  log "built"
fi
grep -E "MemAvailable" /proc/meminfo
log "tests"
timeout 25 ./build/flashmoe_tests --gtest_filter='CudaTiers.SyntheticExpertsGeneratedWhereTheyLive:CudaPacked.EveryExpertFormatMatchesTheCpu' > "$D/tests.txt" 2>&1
rc=$?
grep -E "^\[  (FAILED|PASSED|     OK) |\[cuda-(tiers|packed)\]|Failure|Expected|Which is" "$D/tests.txt" | head -30
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc; 124: the time limit)"
B="./build/flashmoe bench --device cuda --synthetic qwen3.5-397b-a17b --experts q4 --stats"
summary() {  # the lines that matter of a bench log
  grep -E "^\| (pp|tg)|choices served|copied ahead|link-bound|^  VRAM|^  host:|built in" "$1"
}
tg_of() { grep -E "^\| tg" "$1" | head -1 | awk -F'|' '{print $3}' | awk '{print $1}'; }
ab() {  # name extra-args
  local f="$D/ab-$1.txt"
  if [ "$(left)" -lt 120 ]; then echo "SKIP ab $1: $(left) s left (the 60-layer run needs ~100)"; return 1; fi
  log "10 layers, 273 of 512 in VRAM: $1"
  timeout 30 $B --layers 10 --gpu-expert-cache 53.5% -p 0 -n 64 -r 1 $2 > "$f" 2>&1
  local rc=$?
  summary "$f"
  [ $rc = 0 ] || { tail -5 "$f"; echo "FAIL ab $1 (rc $rc)"; return 1; }
}
ab base "--copy-ahead-blocks 0"
ab c32 "--copy-ahead-blocks 32"
ab c64 "--copy-ahead-blocks 64"
echo "A/B tg64, 10 layers, tokens/s:"
best=base; bt=$(tg_of "$D/ab-base.txt"); base_tg=$bt
for v in base c32 c64; do
  t=$(tg_of "$D/ab-$v.txt" 2>/dev/null); echo "  $v: ${t:-none}"
  if [ -n "$t" ] && [ -n "$bt" ] && awk -v t="$t" -v b="$base_tg" -v c="$bt" 'BEGIN { exit !(t > 1.01 * b && t > c) }'; then best=$v; bt=$t; fi
done
[ -n "$base_tg" ] && [ -n "$bt" ] && awk -v n="$bt" -v b="$base_tg" -v w="$best" 'BEGIN { printf "best: %s, %.3f x no copy\n", w, n / b }'
case $best in c32) opt="--copy-ahead-blocks 32";; c64) opt="--copy-ahead-blocks 64";; *) opt="";; esac
if [ "$(left)" -ge 90 ]; then
  log "60 layers, K = 10, tg128 pp512 ${opt:-(no copy)}"
  timeout $(left) $B $opt -p 512 -n 128 -r 1 > "$D/k10.txt" 2>&1 && echo "PASS 60 layers K=10" || echo "FAIL 60 layers K=10 (rc $?)"
  summary "$D/k10.txt"; grep -E "decode reads|link" "$D/k10.txt" | grep -v "choices served"
else echo "SKIP 60 layers: $(left) s left"; fi
log "done"
