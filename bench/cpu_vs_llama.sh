#!/usr/bin/env bash
# flashmoe against llama.cpp on the CPU, side by side in one run: interleaved
# rounds (flashmoe, llama.cpp, flashmoe at FLASHMOE_CPU_LEVEL=avx2, ...) at
# each thread count, pp512 and tg128, then the median of the rounds and the
# ratios. The machine is shared, so the load average is printed with every
# round.
#
#   LLAMA_BENCH=/path/to/llama-bench GGUF=/path/to/coder-mini-bf16.gguf bench/cpu_vs_llama.sh [rounds]
#
# GGUF: llama.cpp's model, the same weights type as flashmoe's (bf16 here:
# bench/gguf_q8_to_bf16.py writes one). MODEL: flashmoe's (models/coder-mini).
# BEFORE: another flashmoe binary (e.g. the branch point) run in the same
# rounds, a column of its own (the before / after comparison in one run).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
BIN=${BIN:-build/flashmoe}
MODEL=${MODEL:-models/coder-mini}
LLAMA_BENCH=${LLAMA_BENCH:?set LLAMA_BENCH to llama.cpp\'s llama-bench}
GGUF=${GGUF:?set GGUF to llama.cpp\'s model file}
THREADS=${THREADS:-"1 2"}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

BEFORE=${BEFORE:-}
fm() {  # prints "pp tg" tokens/s (means of -r 3); $2: FLASHMOE_CPU_LEVEL or ""; $3: binary
  FLASHMOE_CPU_LEVEL=$2 "${3:-$BIN}" bench -m "$MODEL" --device cpu -t "$1" -p 512 -n 128 -r 3 |
    awk '/^\| pp512/ {pp=$4} /^\| tg128/ {tg=$4} END {print pp, tg}'
}
ll() {
  "$LLAMA_BENCH" -m "$GGUF" -t "$1" -p 512 -n 128 -r 3 -o csv 2>/dev/null |
    awk -F, 'NR==1 {for (i=1;i<=NF;i++) {gsub(/"/,"",$i); col[$i]=i}; next}
             {gsub(/"/,""); if ($col["n_prompt"]>0) pp=$col["avg_ts"]; else tg=$col["avg_ts"]} END {print pp, tg}'
}

for r in $(seq 1 "$ROUNDS"); do
  for t in $THREADS; do
    echo "round $r t=$t load: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "$t $(fm "$t" "")" >>"$out/flashmoe"
    echo "$t $(ll "$t")" >>"$out/llama"
    echo "$t $(fm "$t" avx2)" >>"$out/avx2"
    [ -z "$BEFORE" ] || echo "$t $(fm "$t" "" "$BEFORE")" >>"$out/before"
    tail -n1 "$out/flashmoe" | sed 's/^/  flashmoe       t pp tg: /'
    tail -n1 "$out/llama" | sed 's/^/  llama.cpp      t pp tg: /'
    tail -n1 "$out/avx2" | sed 's/^/  flashmoe avx2  t pp tg: /'
    [ -z "$BEFORE" ] || tail -n1 "$out/before" | sed 's/^/  before         t pp tg: /'
  done
done

median() { sort -g | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
echo
if [ -n "$BEFORE" ]; then
  echo "| test | threads | llama.cpp | flashmoe (widest level) | ratio | flashmoe at avx2 | ratio | before | ratio |"
  echo "|---|---|---|---|---|---|---|---|---|"
else
  echo "| test | threads | llama.cpp | flashmoe (widest level) | ratio | flashmoe at avx2 | ratio |"
  echo "|---|---|---|---|---|---|---|"
fi
for t in $THREADS; do
  for test in pp512 tg128; do
    col=$([ "$test" = pp512 ] && echo 2 || echo 3)
    l=$(awk -v t="$t" -v c="$col" '$1==t {print $c}' "$out/llama" | median)
    f=$(awk -v t="$t" -v c="$col" '$1==t {print $c}' "$out/flashmoe" | median)
    a=$(awk -v t="$t" -v c="$col" '$1==t {print $c}' "$out/avx2" | median)
    printf "| %s | %s | %.0f | %.0f | %.2f | %.0f | %.2f |" "$test" "$t" "$l" "$f" "$(echo "$f / $l" | bc -l)" \
      "$a" "$(echo "$a / $l" | bc -l)"
    if [ -n "$BEFORE" ]; then
      b=$(awk -v t="$t" -v c="$col" '$1==t {print $c}' "$out/before" | median)
      printf " %.0f | %.2f |" "$b" "$(echo "$b / $l" | bc -l)"
    fi
    echo
  done
done
