#!/usr/bin/env bash
# Decode speed of each KV retention policy at a given context: `flashmoe
# bench -p 0 -n N -d DEPTH` per policy, the policies interleaved over ROUNDS
# rounds (so load that drifts over the run hits every policy alike), one
# line per run, then the mean tg per policy.
#
#   bench/kv_policy_speed.sh BUILD_DIR "MODEL_ARGS" [DEPTH] [BUDGET] [N] [ROUNDS] [ONLY]
# ONLY: the policies to run, by their first word, comma-separated (e.g.
# full,streaming,snapkv,rotated,quest,quest16); default all.
#   CPU:  bench/kv_policy_speed.sh build "-m models/coder-mini/model -t 2" 4096 1024 32 2
#   H200: bench/kv_policy_speed.sh build "--device cuda --synthetic qwen3.5-35b-a3b --kv-dtype fp8" 4096 2048 128 2
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$1/flashmoe"
MODEL_ARGS="$2"
D="${3:-4096}"; B="${4:-1024}"; N="${5:-32}"; ROUNDS="${6:-2}"; ONLY="${7:-}"
POLICIES=("full|" "window $B|--kv-window $B" "streaming $B|--kv-streaming $B" "h2o $B|--kv-h2o $B"
          "tova $B|--kv-tova $B")
# SnapKV (the prompt cut to B at the first decoded token, inside the timed
# tg run).
POLICIES+=("snapkv $B|--kv-snapkv $B")
# fp8 with Hadamard-rotated K and V (the query rotated, the output rotated back).
case "$MODEL_ARGS" in
  *"--kv-dtype fp8"*) POLICIES+=("rotated full|--kv-fp8-scale rotated") ;;
esac
# The Quest store: pages of 4, B read per query, a quarter of them the
# recent positions (fp8 head scales on the CPU, the model args' KV dtype on
# the GPU); quest16: pages of 16 (a quarter of the pages to score).
QUEST="--kv-resident $B --kv-recent 0.25"
case "$MODEL_ARGS" in
  *"--device cuda"*) POLICIES+=("quest $B|$QUEST --kv-page 4" "quest16 $B|$QUEST --kv-page 16") ;;
  *) POLICIES+=("quest $B|--kv-dtype fp8 --kv-fp8-scale head $QUEST --kv-page 4") ;;
esac
if [ -n "$ONLY" ]; then
  KEEP=()
  for p in "${POLICIES[@]}"; do
    first="${p%% *}"; first="${first%%|*}"
    case ",$ONLY," in *",$first,"*) KEEP+=("$p") ;; esac
  done
  POLICIES=("${KEEP[@]}")
fi
declare -A sum cnt
for r in $(seq 1 "$ROUNDS"); do
  for p in "${POLICIES[@]}"; do
    name="${p%%|*}"; opts="${p#*|}"
    # shellcheck disable=SC2086
    tg=$("$BIN" bench $MODEL_ARGS $opts -p 0 -n "$N" -d "$D" -r 1 2>/dev/null |
         awk -F'|' '/tg[0-9]/ {gsub(/ /,"",$3); split($3,a,"±"); print a[1]}')
    echo "round $r  $name: tg$N @ d$D = $tg tok/s"
    sum[$name]=$(python3 -c "print(${sum[$name]:-0} + $tg)"); cnt[$name]=$(( ${cnt[$name]:-0} + 1 ))
  done
done
for p in "${POLICIES[@]}"; do
  name="${p%%|*}"
  python3 -c "print(f'mean  {\"$name\":<14} {${sum[$name]} / ${cnt[$name]}:.1f} tok/s')"
done
