#!/usr/bin/env bash
# What --moe-top-k costs on coder-mini (16 experts, num_experts_per_tok 4):
# one markdown row per K with mean KL against the model at its own top-k and
# perplexity over the first 4 windows of 2,048 tokens of eval/code_heldout.txt,
# recall per filler distance on the 40 prompts of eval/recall_dev.jsonl (the
# settings of docs/kv-quality.md, f32 full KV cache), and decode tokens/s
# (flashmoe bench -p 0 -n 128, mean of 3).
#
#   bench/moe_top_k_quality.sh [BUILD_DIR] [THREADS] [K...]   (defaults: build, 2, own 3 2 1)
# K "own": no --moe-top-k (the model's 4; its KL is 0 by definition, and it
# skips loading the reference a second time).
# Raw JSON of each run is kept in $OUT_DIR (default /tmp/moe_top_k_quality).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-build}/flashmoe"
T="${2:-2}"
shift $(( $# < 2 ? $# : 2 ))
KS=("$@")
[ ${#KS[@]} -eq 0 ] && KS=(own 3 2 1)
M=models/coder-mini
OUT_DIR="${OUT_DIR:-/tmp/moe_top_k_quality}"
mkdir -p "$OUT_DIR"

echo "| experts per token | mean KL vs K=4 | perplexity | recall 64 | recall 256 | recall 1024 | recall 1700 | recall all | decode tok/s (bench tg128) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for K in "${KS[@]}"; do
  opt=(--moe-top-k "$K"); [ "$K" = own ] && opt=()
  "$BIN" eval -q -m $M -t "$T" "${opt[@]}" --perplexity $M/eval/code_heldout.txt --window-tokens 2048 \
      --max-windows 4 --recall $M/eval/recall_dev.jsonl --json > "$OUT_DIR/k$K.json"
  "$BIN" bench -m $M/model -t "$T" -p 0 -n 128 "${opt[@]}" > "$OUT_DIR/k$K.bench.txt"
  tg=$(awk -F'|' '/tg128/ {gsub(/ /,"",$3); split($3,a,"±"); print a[1]}' "$OUT_DIR/k$K.bench.txt")
  python3 - "$K" "$OUT_DIR/k$K.json" "$tg" <<'PY'
import json, sys
k, jf, tg = sys.argv[1:4]
j = json.load(open(jf))
r = j["recall"]
def acc(n):
    c = r.get(n)
    return f'{c["correct"]}/{c["total"]}' if c else "-"
tot = sum(v["correct"] for v in r.values()), sum(v["total"] for v in r.values())
print(f'| {k} | {j["mean_kl"]:.3g} | {j["perplexity"]:.3f} | {acc("64")} | {acc("256")} | {acc("1024")} | {acc("1700")} | {tot[0]}/{tot[1]} | {tg} |')
PY
done
