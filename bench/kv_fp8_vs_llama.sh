#!/usr/bin/env bash
# FP8 KV (ours) against llama.cpp's q8_0 KV, side by side on the same model
# file and the same positions: coder-mini-q8_0.gguf (both engines load it),
# the first CHUNKS windows of 2,048 tokens of eval/code_heldout.txt, each
# scored on its second half (llama-perplexity's KL mode scores tokens
# n_ctx/2 .. n_ctx-1 of each chunk; `flashmoe eval --score-from 1024` the
# same). Each engine's KL is against its own f32-KV run of the same weights.
#
#   bench/kv_fp8_vs_llama.sh [BUILD_DIR] [THREADS] [CHUNKS]   (defaults: build, 2, 4)
# Env: ONLY (run only the flashmoe rows whose name contains it), LLAMA_BIN (default /work/aside/llama.cpp/build/bin), GGUF (default
# /work/shared/fixtures/gguf/coder-mini-q8_0.gguf), OUT_DIR (default /tmp/kv_fp8_vs_llama).
# Prints one line per configuration: engine, KV format, mean KL, perplexity.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-build}/flashmoe"
T="${2:-2}"
CHUNKS="${3:-4}"
L="${LLAMA_BIN:-/work/aside/llama.cpp/build/bin}"
G="${GGUF:-/work/shared/fixtures/gguf/coder-mini-q8_0.gguf}"
TXT=models/coder-mini/eval/code_heldout.txt
OUT_DIR="${OUT_DIR:-/tmp/kv_fp8_vs_llama}"
mkdir -p "$OUT_DIR"
for f in "$L/llama-perplexity" "$G" "$BIN"; do
  [ -e "$f" ] || { echo "missing: $f" >&2; exit 1; }
done

# llama.cpp: f32 KV writes the base logits, then each KV type is compared to them.
"$L/llama-perplexity" -m "$G" -f "$TXT" -c 2048 --chunks "$CHUNKS" -t "$T" -fa on -ctk f32 -ctv f32 \
    --kl-divergence-base "$OUT_DIR/base.kld" > "$OUT_DIR/llama-f32.txt" 2>&1
for kv in f16 q8_0; do
  "$L/llama-perplexity" -m "$G" -f "$TXT" -c 2048 --chunks "$CHUNKS" -t "$T" -fa on -ctk $kv -ctv $kv \
      --kl-divergence-base "$OUT_DIR/base.kld" --kl-divergence > "$OUT_DIR/llama-$kv.txt" 2>&1
  kl=$(awk '/^Mean    KLD:/ {print $3, $4, $5}' "$OUT_DIR/llama-$kv.txt")
  ppl=$(awk '$1 == "Mean" && $2 == "PPL(Q)" {print $4}' "$OUT_DIR/llama-$kv.txt")
  echo "llama.cpp  KV $kv: mean KL $kl  ppl $ppl"
done

# ONLY=channel (a substring of the names) runs the matching flashmoe rows alone.
for cfg in "fp8 position|--kv-dtype fp8 --kv-fp8-scale position" "fp8 head|--kv-dtype fp8 --kv-fp8-scale head" \
           "fp8 rotated|--kv-dtype fp8 --kv-fp8-scale rotated" "fp8 channel|--kv-dtype fp8 --kv-fp8-scale channel" \
           "bf16|--kv-dtype bf16"; do
  name="${cfg%%|*}"; opts="${cfg#*|}"
  [[ -z "${ONLY:-}" || "$name" == *"$ONLY"* ]] || continue
  slug=$(echo "$name" | tr ' ' '_')
  # shellcheck disable=SC2086
  "$BIN" eval -q -m "$G" -t "$T" --device cpu $opts --perplexity "$TXT" --window-tokens 2048 --max-windows "$CHUNKS" \
      --score-from 1024 --json > "$OUT_DIR/flashmoe-$slug.json"
  python3 - "$name" "$OUT_DIR/flashmoe-$slug.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[2]))
print(f'flashmoe   KV {sys.argv[1]}: mean KL {j["mean_kl"]:.3e}  ppl {j["perplexity"]:.4f}  ({j["scored"]} positions)')
PY
done
