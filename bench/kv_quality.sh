#!/usr/bin/env bash
# KV-cache quality on coder-mini: one markdown row per configuration with
# KV bytes at 2,048 tokens (kv-calc), mean KL vs f32 full and perplexity over
# the first 4 windows of 2,048 tokens of eval/code_heldout.txt, recall per
# filler distance on all 40 prompts of eval/recall_dev.jsonl, and decode
# tokens/s (flashmoe bench -p 0 -n 128, mean of 3, empty cache) plus decode
# tokens/s measured during recall (after prompts of 100-1,800 tokens).
#
#   bench/kv_quality.sh [BUILD_DIR] [THREADS]      (defaults: build, 2)
# Raw JSON of each run is kept in $OUT_DIR (default /tmp/kv_quality).
# SCORE_FROM=1024: the decode protocol instead (each window's first 1,024
# tokens a prompt, the rest decoded one at a time and scored: `eval
# --score-from`), without recall and bench (prompt-compression policies
# such as snapkv only act once decoding starts).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-build}/flashmoe"
T="${2:-2}"
M=models/coder-mini
OUT_DIR="${OUT_DIR:-/tmp/kv_quality}"
mkdir -p "$OUT_DIR"

CONFIGS=(
  "f32|"
  "bf16|--kv-dtype bf16"
  "fp8 (position)|--kv-dtype fp8 --kv-fp8-scale position"
  "fp8 (head)|--kv-dtype fp8 --kv-fp8-scale head"
  "fp8 (rotated)|--kv-dtype fp8 --kv-fp8-scale rotated"
  "window 64|--kv-window 64"
  "window 256|--kv-window 256"
  "window 1024|--kv-window 1024"
  "h2o 64|--kv-h2o 64"
  "h2o 256|--kv-h2o 256"
  "h2o 1024|--kv-h2o 1024"
  "streaming 256|--kv-streaming 256"
  "tova 64|--kv-tova 64"
  "tova 256|--kv-tova 256"
  "tova 1024|--kv-tova 1024"
  "tova 256, 0 sinks|--kv-tova 256 --kv-sinks 0"
  "tova 256, recent 0.75|--kv-tova 256 --kv-recent 0.75"
  "tova 1024, recent 0.75|--kv-tova 1024 --kv-recent 0.75"
  "quest 256|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 16"
  "quest 1024|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 1024 --kv-page 16"
  "quest 256, recent 0.5|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 16 --kv-recent 0.5"
  "quest 1024, recent 0.5|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 1024 --kv-page 16 --kv-recent 0.5"
  "quest 256, page 8|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 8"
  "quest 256, page 8, recent 0.25|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 8 --kv-recent 0.25"
  "quest 256, page 8, recent 0.5|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 8 --kv-recent 0.5"
  "quest 256, page 4, recent 0.25|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 4 --kv-recent 0.25"
  "quest 1024, page 8, recent 0.25|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 1024 --kv-page 8 --kv-recent 0.25"
  "quest 256, page 2, recent 0.25|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 2 --kv-recent 0.25"
  "quest 256, page 4, recent 0.125|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 4 --kv-recent 0.125"
  "quest 1024, page 4, recent 0.25|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 1024 --kv-page 4 --kv-recent 0.25"
  "quest 256, layer|--kv-dtype fp8 --kv-fp8-scale head --kv-resident 256 --kv-page 16 --kv-page-select layer"
  "quest 256, f32|--kv-resident 256 --kv-page 16"
  "snapkv 256|--kv-snapkv 256"
  "snapkv 1024|--kv-snapkv 1024"
  "snapkv 256, recent 0.5|--kv-snapkv 256 --kv-recent 0.5"
)
# ONLY=N: just the N-th configuration (0-based); NAMES="tova 256|window 256": just those.
[ -n "${ONLY:-}" ] && CONFIGS=("${CONFIGS[@]:$ONLY:1}")
if [ -n "${NAMES:-}" ]; then
  sel=(); IFS='|' read -ra want <<< "$NAMES"
  for c in "${CONFIGS[@]}"; do for w in "${want[@]}"; do [ "${c%%|*}" = "$w" ] && sel+=("$c"); done; done
  CONFIGS=("${sel[@]}")
fi

if [ -n "${SCORE_FROM:-}" ]; then
  echo "| config (prompt $SCORE_FROM, then decode) | mean KL vs f32 | perplexity | positions |"
  echo "|---|---:|---:|---:|"
  for c in "${CONFIGS[@]}"; do
    name="${c%%|*}"; opts="${c#*|}"
    slug=$(echo "$name" | tr -c 'a-z0-9' '_')
    # shellcheck disable=SC2086
    "$BIN" eval -q -m $M -t "$T" $opts --perplexity $M/eval/code_heldout.txt --window-tokens 2048 --max-windows 4 \
        --score-from "$SCORE_FROM" --json > "$OUT_DIR/$slug.decode.json"
    python3 -c "import json,sys; j=json.load(open(sys.argv[2])); print(f'| {sys.argv[1]} | {j[\"mean_kl\"]:.3g} | {j[\"perplexity\"]:.3f} | {j[\"scored\"]} |')" \
        "$name" "$OUT_DIR/$slug.decode.json"
  done
  exit 0
fi
echo "| config | KV bytes @2048 | mean KL vs f32 | perplexity | recall 64 | recall 256 | recall 1024 | recall 1700 | recall all | decode tok/s (bench tg128) | decode tok/s (recall) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for c in "${CONFIGS[@]}"; do
  name="${c%%|*}"; opts="${c#*|}"
  slug=$(echo "$name" | tr -c 'a-z0-9' '_')
  # shellcheck disable=SC2086
  "$BIN" kv-calc -m $M/model --context 2048 $opts > "$OUT_DIR/$slug.kvcalc.txt"
  # shellcheck disable=SC2086
  "$BIN" eval -q -m $M -t "$T" $opts --perplexity $M/eval/code_heldout.txt --window-tokens 2048 --max-windows 4 \
      --recall $M/eval/recall_dev.jsonl --json > "$OUT_DIR/$slug.json"
  # shellcheck disable=SC2086
  "$BIN" bench -m $M/model -t "$T" -p 0 -n 128 $opts > "$OUT_DIR/$slug.bench.txt"
  tg=$(awk -F'|' '/tg128/ {gsub(/ /,"",$3); split($3,a,"±"); print a[1]}' "$OUT_DIR/$slug.bench.txt")
  python3 - "$name" "$OUT_DIR/$slug.json" "$OUT_DIR/$slug.kvcalc.txt" "$tg" <<'PY'
import json, re, sys
name, jf, kf, tg = sys.argv[1:5]
j = json.load(open(jf))
kv = open(kf).read()
# kv-calc: "KV per position: N B" and the 2048 row's retained positions.
per = int(re.search(r"KV per position: (\d+) B", kv).group(1))
pos = int(re.search(r"^\s*2048\s+(\d+)\s", kv, re.M).group(1))
kvb = f"{per * pos:,} ({pos} pos)"
r = j["recall"]
def acc(k):
    c = r.get(k)
    return f'{c["correct"]}/{c["total"]}' if c else "-"
tot = sum(v["correct"] for v in r.values()), sum(v["total"] for v in r.values())
print(f'| {name} | {kvb} | {j["mean_kl"]:.3g} | {j["perplexity"]:.3f} | {acc("64")} | {acc("256")} | {acc("1024")} | {acc("1700")} | {tot[0]}/{tot[1]} | {tg} | {j["decode_tokens_per_s"]:.0f} |')
PY
done
