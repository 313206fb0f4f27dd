#!/usr/bin/env bash
# Two flashmoe binaries (or one under two environments) side by side: interleaved
# rounds of `flashmoe bench ARGS -t THREADS`, the order alternating each round; prints
# the tokens/s columns of each (pp, tg, and with --batch each B's aggregate), then per
# column the medians, the median of B / A - 1 over the rounds (paired: each round's two
# runs met the same load) and how many rounds B won. The machine is shared, so the load
# average is printed too; on a noisy box take 10 rounds or more.
#   bench/cpu_ab.sh ROUNDS THREADS "ARGS" BIN_A BIN_B [ENV_A] [ENV_B]
#   e.g. bench/cpu_ab.sh 6 2 "-m models/coder-mini --device cpu -p 512 -n 0 -r 3" /tmp/old/flashmoe build/flashmoe
#        bench/cpu_ab.sh 10 2 "-m models/coder-mini --device cpu -p 0 -n 384 -r 1 --batch 1,8" A B FLASHMOE_CPU_LEVEL=avx2 FLASHMOE_CPU_LEVEL=avx2
set -euo pipefail
if [ $# -lt 5 ]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
R=$1; T=$2; ARGS=$3; A=$4; B=$5; EA=${6:-}; EB=${7:-}
for bin in "$A" "$B"; do
  [ -x "$bin" ] || { echo "cpu_ab.sh: $bin is not an executable" >&2; exit 2; }
done
cd "$(dirname "$0")/.."
# One run: "name=tokens/s" per row of bench's table (tg384, tg384x8; the per-sequence rows skipped).
run() {
  # shellcheck disable=SC2086
  env $2 "$1" bench $ARGS -t "$T" 2>/dev/null | awk -F'|' '
    /^\| (pp|tg)[0-9]/ && !/per sequence/ {
      name = $2; gsub(/\(aggregate\)/, "", name); gsub(/ /, "", name)
      split($3, v, " "); printf "%s=%s ", name, v[1] }'
}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for r in $(seq 1 "$R"); do
  if [ $((r % 2)) = 1 ]; then
    a=$(run "$A" "$EA" || true); b=$(run "$B" "$EB" || true)
  else
    b=$(run "$B" "$EB" || true); a=$(run "$A" "$EA" || true)
  fi
  if [ -z "$a" ] || [ -z "$b" ]; then
    echo "cpu_ab.sh: round $r: a run printed no tokens/s (try the command by hand)" >&2
    exit 1
  fi
  echo "round $r load $(cut -d' ' -f1 /proc/loadavg): A $a| B $b"
  echo "$a| $b" >> "$log"
done
awk -F'|' '
  function median(arr, n,    i, j, t) {
    for (i = 2; i <= n; ++i) for (j = i; j > 1 && arr[j - 1] > arr[j]; --j) { t = arr[j]; arr[j] = arr[j - 1]; arr[j - 1] = t }
    return n % 2 ? arr[(n + 1) / 2] : (arr[n / 2] + arr[n / 2 + 1]) / 2
  }
  {
    na = split($1, fa, " "); split($2, fb, " ")
    for (i = 1; i <= na; ++i) {
      split(fa[i], pa, "="); split(fb[i], pb, "=")
      k = pa[1]; if (!(k in n)) order[++cols] = k
      c = ++n[k]; va[k, c] = pa[2]; vb[k, c] = pb[2]; d[k, c] = pb[2] / pa[2] - 1; won[k] += pb[2] > pa[2]
    }
  }
  END {
    print "column      median A   median B   paired B/A-1   B won"
    for (o = 1; o <= cols; ++o) {
      k = order[o]
      for (c = 1; c <= n[k]; ++c) { xa[c] = va[k, c]; xb[c] = vb[k, c]; xd[c] = d[k, c] }
      printf "%-10s %9.1f  %9.1f   %+11.1f%%   %d/%d\n", k, median(xa, n[k]), median(xb, n[k]), 100 * median(xd, n[k]), won[k], n[k]
    }
  }' "$log"
