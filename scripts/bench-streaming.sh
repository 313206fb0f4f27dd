#!/usr/bin/env bash
# Measures expert streaming on coder-mini: decode tokens/s (median of 5),
# reads and bytes per token against the cache size, with cold reads (O_DIRECT:
# the page cache never serves an expert), and peak RSS. Prints markdown rows.
# Usage: scripts/bench-streaming.sh [BUILD_DIR]
set -euo pipefail
B=${1:-build}/flashmoe
HF=models/coder-mini/model
OUT=$(mktemp -d /tmp/flashmoe-bench-XXXXXX)
trap 'rm -rf "$OUT"' EXIT
IDS=1,2,3,4,5,6,7,8,9,10,100,200,300,400,500,600
for fmt in bf16 q4; do "$B" pack -m "$HF" -o "$OUT/$fmt" --experts "$fmt" 2>/dev/null; done

# One markdown row: label | tok/s (median of 5) | hit rate | reads/token | MiB/token | I/O wait | peak RSS
row() {
  local label=$1; shift
  local toks=() line="" rss=""
  for i in 1 2 3 4 5; do
    local o
    o=$(/usr/bin/time -f "RSS %M" "$B" generate --ids "$IDS" -n 64 --greedy --stats -t 2 "$@" 2>&1 >/dev/null)
    toks+=("$(echo "$o" | sed -n 's/^decode: 63 tokens in .* s, \([0-9.]*\) tokens\/s/\1/p')")
    line=$(echo "$o" | grep '^decode:  experts')
    rss=$(echo "$o" | sed -n 's/^RSS //p')
  done
  local med; med=$(printf '%s\n' "${toks[@]}" | sort -n | sed -n 3p)
  local hit reads mibt wait
  hit=$(echo "$line" | sed -n 's/.*hit rate \([0-9.]*%\).*/\1/p')
  reads=$(echo "$line" | sed -n 's/.*reads (\([0-9.]*\) per token).*/\1/p')
  mibt=$(echo "$line" | sed -n 's/.*(\([0-9.]*\) MiB per token.*/\1/p')
  wait=$(echo "$line" | sed -n 's/.*I\/O wait \([0-9.]*\) s.*/\1/p')
  echo "| $label | $med | $hit | $reads | $mibt | ${wait}s | $((rss / 1024)) MiB |"
}

echo "| run | decode tok/s | hit rate | reads/token | MiB read/token | I/O wait (63 tok) | peak RSS |"
echo "|---|---|---|---|---|---|---|"
row "HF checkpoint, in memory (mmap)" -m "$HF"
for fmt in bf16 q4; do
  total=$(du -sk --apparent-size "$OUT/$fmt/experts" | cut -f1)
  for pct in 0 10 50 100; do
    mb=$(( (total * pct / 100 + 1023) / 1024 ))
    for pol in lru lfu; do
      [ "$pct" = 0 ] && [ "$pol" = lfu ] && continue
      row "$fmt, cache $mb MiB ($pct%), $pol, O_DIRECT" -m "$OUT/$fmt" --expert-cache "$mb" --expert-cache-policy "$pol" --direct-io
    done
  done
done
row "bf16, --max-memory 0.05 (51.2 MiB), cache auto, O_DIRECT" -m "$OUT/bf16" --max-memory 0.05 --direct-io
row "bf16, cache 0, page cache warm (buffered reads)" -m "$OUT/bf16" --expert-cache 0
"$B" generate -m "$OUT/bf16" --ids "$IDS" -n 4 --max-memory 0.04 2>&1 >/dev/null | sed 's/^/    /' || true
