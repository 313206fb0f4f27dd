#!/usr/bin/env bash
# Issue 24 on the H200 (branch kv-cuda): SnapKV (--kv-snapkv B) and fp8
# `rotated` on CUDA. No build: build/flashmoe and build/flashmoe_tests must
# be there. Each stage stops at what is left of LIMIT seconds.
#   LIMIT=58 bash gpu-tasks/kv-cuda.sh tests     (needs models/coder-mini)
#   LIMIT=78 bash gpu-tasks/kv-cuda.sh speed [ROUNDS] [ONLY]   (synthetic only: no models/;
#   ONLY as bench/kv_policy_speed.sh takes it, e.g. full,streaming,snapkv,rotated)
# tests, most important first:
#  1. CudaKvPolicies.SnapKvKeepsTheCpusPositions: every full-attention layer
#     of coder-mini holds the CPU's positions after the cut and after 24
#     decoded tokens (f32, bf16, fp8 head, fp8 rotated; one prefill chunk
#     and chunks of 7; a prompt shorter than B), logits within 2e-3 (f32) /
#     1e-2 (bf16) / 5e-2 (fp8), snapshots before and after the cut restore
#     bitwise. Expected: PASS.
#  2. kv_cases() gained fp8-rotated and fp8-rotated-window64:
#     MatchesCpuForEveryKvConfig (expected: "[cuda-vs-cpu] fp8-rotated mean KL
#     ~1e-9..1e-5", limit 1e-3) and BatchedPrefillMatchesTokenByToken.
#  3. The tests of code it touched (kv_slot / kv_valid gained a shift, state
#     images, split attention): H2o positions, snapshots, split attention.
# speed: decode speed of each policy, 35B synthetic, fp8 KV, budget 2,048,
#   tg128 at depth 4,096, interleaved rounds (bench/kv_policy_speed.sh), with
#   snapkv 2048 and "rotated full" new. Predictions (bench/NOTES-cuda.md k1,
#   k2): snapkv within 3% of streaming 2048 (~404 tok/s); rotated full 1-2%
#   below full (~365-370).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-tests}"; ROUNDS="${2:-1}"; LIMIT="${LIMIT:-58}"
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/ not ready"; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/kv-cuda"
T0=$SECONDS
left() { echo $(( LIMIT - (SECONDS - T0) )); }
stage() {  # name filter [grep pattern for lines to show]
  local L; L=$(left)
  if [ "$L" -lt 5 ]; then echo "SKIP: $1 (no time left)"; return; fi
  timeout "$L" ./build/flashmoe_tests --gtest_filter="$2" > "$OUT/kv-cuda/$1.log" 2>&1
  local rc=$?
  grep -E "${3:-^$}|Failure|FAILED  \]|Which is|Expected|^\[  (PASSED|FAILED)" "$OUT/kv-cuda/$1.log" | cut -c1-400 | head -40
  if [ $rc -eq 0 ]; then echo "PASS: $1 ($((SECONDS-T0)) s)"; elif [ $rc -eq 124 ]; then echo "TIMEOUT: $1"; else echo "FAIL: $1 rc=$rc ($((SECONDS-T0)) s)"; fi
}
if [ "$MODE" = tests ]; then
  stage snapkv 'CudaKvPolicies.*'
  stage rotated 'CudaCoderMini.MatchesCpuForEveryKvConfig:CudaCoderMini.BatchedPrefillMatchesTokenByToken' 'rotated'
  stage touched 'CudaCoderMini.H2oKeepsTheCpusPositions:CudaCoderMini.SnapshotsRestoreExactly:CudaCoderMini.SplitAttentionMatchesCpuForEveryKvConfig' 'rotated'
else
  L=$(left)
  timeout "$L" bench/kv_policy_speed.sh build "--device cuda --synthetic qwen3.5-35b-a3b --kv-dtype fp8" 4096 2048 128 "$ROUNDS" "${3:-}" |
    tee "$OUT/kv-cuda/kv-policies-h200-35b.txt"
fi
echo "kv-cuda $MODE done at $((SECONDS-T0)) s"
