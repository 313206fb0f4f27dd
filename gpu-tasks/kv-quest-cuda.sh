#!/usr/bin/env bash
# Issue 24 on the H200 (branch kv-quest-cuda): the Quest store
# (--kv-resident N --kv-page P --kv-recent F) on CUDA. No build:
# build/flashmoe and build/flashmoe_tests must be there. Each stage stops at
# what is left of LIMIT seconds.
#   LIMIT=50 bash gpu-tasks/kv-quest-cuda.sh [ROUNDS]   (needs models/coder-mini for the test)
# 1. CudaKvPolicies.QuestReadsTheCpusPages: coder-mini, 6 configurations
#    (f32, bf16 per layer, f16, fp8 position / head / rotated, with and
#    without --kv-recent), the 200-token prompt token by token, in one chunk
#    and in chunks of 7, then 24 decoded tokens: every layer and KV head
#    reads the CPU's slots (one-page near-tie swaps counted, <= 1%), logits
#    within 2e-3 / 1e-2 / 5e-2, a snapshot restores bitwise. The rest of
#    the CUDA suite (attn_kernel changed for every policy) runs in the
#    lead's merged-tree tests. Expected: PASS,
#    "[quest-vs-cpu] N choices compared, 0 one-page swaps" (or a few).
# 2. Speed: 35B synthetic, fp8 KV, tg128 at depth 4,096, budget 2,048:
#    full, streaming 2048, quest 2048 (pages of 4), quest16 2048 (pages of
#    16), interleaved over ROUNDS rounds (bench/kv_policy_speed.sh).
#    Prediction in bench/NOTES-cuda.md ("The Quest store on the GPU").
# 3. pp4096, full and quest 2048 (the prompt past the budget in order).
# Needs the device call that carries models/coder-mini (model/, tokenizer,
# eval/: the test's prompt is the held-out code, tokenized); no tests/fixtures.
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-2}"; LIMIT="${LIMIT:-50}"
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/ not ready"; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/kv-quest"
T0=$SECONDS
left() { echo $(( LIMIT - (SECONDS - T0) )); }
stage() {  # name filter [grep pattern for lines to show] [seconds at most]
  local L; L=$(left)
  [ -n "${4:-}" ] && [ "$4" -lt "$L" ] && L=$4
  if [ "$L" -lt 5 ]; then echo "SKIP: $1 (no time left)"; return; fi
  timeout "$L" ./build/flashmoe_tests --gtest_filter="$2" > "$OUT/kv-quest/$1.log" 2>&1
  local rc=$?
  grep -E "${3:-^$}|Failure|FAILED  \]|Which is|Expected|^\[  (PASSED|FAILED)" "$OUT/kv-quest/$1.log" | cut -c1-400 | head -30
  if [ $rc -eq 0 ]; then echo "PASS: $1 ($((SECONDS-T0)) s)"; elif [ $rc -eq 124 ]; then echo "TIMEOUT: $1"; else echo "FAIL: $1 rc=$rc ($((SECONDS-T0)) s)"; fi
}
if [ -d models/coder-mini ]; then
  stage quest 'CudaKvPolicies.QuestReadsTheCpusPages' 'quest-vs-cpu' 20
else
  echo "SKIP: quest test (no models/coder-mini)"
fi
L=$(left)
if [ "$L" -ge 12 ]; then
  timeout "$L" bench/kv_policy_speed.sh build "--device cuda --synthetic qwen3.5-35b-a3b --kv-dtype fp8" 4096 2048 128 \
    "$ROUNDS" full,streaming,quest,quest16 | tee "$OUT/kv-quest/kv-quest-h200-35b.txt"
else
  echo "SKIP: speed (no time left)"
fi
# 3. Prefill of 4,096 tokens (pp4096): full vs quest 2048, whose tokens past
#    the budget attend token by token (each chooses its pages).
for p in "full|" "quest 2048|--kv-resident 2048 --kv-page 4 --kv-recent 0.25"; do
  L=$(left)
  if [ "$L" -lt 6 ]; then echo "SKIP: pp4096 ${p%%|*} (no time left)"; continue; fi
  # shellcheck disable=SC2086
  pp=$(timeout "$L" ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b --kv-dtype fp8 ${p#*|} -p 4096 -n 0 -r 1 2>/dev/null |
       awk -F'|' '/pp[0-9]/ {gsub(/ /,"",$3); split($3,a,"±"); print a[1]}')
  echo "pp4096 ${p%%|*}: $pp tok/s"
done
echo "kv-quest-cuda done at $((SECONDS-T0)) s"
