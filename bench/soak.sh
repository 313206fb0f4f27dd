#!/usr/bin/env bash
# Generation soak: a long `flashmoe run --ignore-eos` with a bounded KV cache,
# sampling the process's VmRSS from /proc/<pid>/status every second. A
# window/H2O cache must keep RSS flat; growth over the run points at a leak.
# Fails unless exactly -n tokens were generated (EOS is ignored and the context
# limit -c is set above -n, so nothing else may end the run early).
#
#   bench/soak.sh [-n TOKENS] [-k "KV FLAGS"] [-b BINARY] [-m MODEL] [-o CSV]
#   defaults: -n 100000 -k "--kv-window 256" -b build/flashmoe -m models/coder-mini
#   e.g.      bench/soak.sh -n 20000 -k "--kv-h2o 256"
set -euo pipefail
cd "$(dirname "$0")/.."
n=100000 kv="--kv-window 256" bin=build/flashmoe model=models/coder-mini csv=""
while getopts "n:k:b:m:o:" o; do
  case $o in n) n=$OPTARG ;; k) kv=$OPTARG ;; b) bin=$OPTARG ;; m) model=$OPTARG ;; o) csv=$OPTARG ;; *) exit 2 ;; esac
done
[ -x "$bin" ] || { echo "soak: $bin not built (make build)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
csv=${csv:-$tmp/rss.csv}
start=$(date +%s)
# shellcheck disable=SC2086
"$bin" run -m "$model" -p "def main():" -n "$n" -c $((n + 1024)) --temp 1.0 --seed 1 --ignore-eos $kv \
  >"$tmp/out.txt" 2>"$tmp/err.txt" &
pid=$!
echo "t_s,vmrss_kb" >"$csv"
while kill -0 "$pid" 2>/dev/null; do
  rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
  [ -n "$rss" ] && echo "$(( $(date +%s) - start )),$rss" >>"$csv"
  sleep 1
done
rc=0; wait "$pid" || rc=$?
secs=$(( $(date +%s) - start ))
bytes=$(wc -c <"$tmp/out.txt")
awk -F, -v n="$n" -v kv="$kv" -v secs="$secs" -v bytes="$bytes" -v rc="$rc" 'NR > 1 {
    if (first == "") first = $2; last = $2; if ($2 > max) max = $2; samples++; rows[samples] = $2
    if (NR == 12) ten = $2 }
  END { printf "soak: -n %s %s: rc=%s %ss, %s output bytes, %d samples\n", n, kv, rc, secs, bytes, samples
        printf "soak: VmRSS start %.1f MiB, after 10 s %.1f MiB, end %.1f MiB, max %.1f MiB\n",
               first/1024, (ten == "" ? last : ten)/1024, last/1024, max/1024
        if (samples >= 4)
          printf "soak: VmRSS at 25%% / 50%% / 75%% of the run %.1f / %.1f / %.1f MiB\n",
                 rows[int(samples / 4)]/1024, rows[int(samples / 2)]/1024, rows[int(3 * samples / 4)]/1024 }' "$csv"
tail -3 "$tmp/err.txt" | sed 's/^/soak: stderr: /'
got=$(sed -n 's/^generation: \([0-9]*\) tokens.*/\1/p' "$tmp/err.txt")
echo "soak: tokens generated ${got:-?} of $n"
[ "$rc" = 0 ] && [ "${got:-}" = "$n" ] || exit 1
