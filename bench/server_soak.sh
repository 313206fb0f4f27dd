#!/usr/bin/env bash
# Server soak: starts `flashmoe serve --parallel P` on a model, runs REQUESTS
# requests from CLIENTS concurrent clients (bench/server_soak.mjs: chat and
# completions, streaming and not, conversations extended turn by turn, aborted
# streams, bad requests that must get their 4xx, cheap GETs) and samples the
# server's VmRSS, threads and open fds from /proc every second. Fails when a
# valid request failed, a bad one got the wrong status, or the server did not
# shut down cleanly on SIGTERM.
#
#   bench/server_soak.sh [-r REQUESTS] [-c CLIENTS] [-p PARALLEL] [-n MAX_TOKENS] [-b BINARY] [-m MODEL] [-o CSV] [-s "SERVE FLAGS"]
#   defaults: -r 3000 -c 8 -p 2 -n 24 -b build/flashmoe -m models/coder-mini
set -euo pipefail
cd "$(dirname "$0")/.."
requests=3000 clients=8 parallel=2 maxtok=24 bin=build/flashmoe model=models/coder-mini csv="" extra=""
while getopts "r:c:p:n:b:m:o:s:" o; do
  case $o in
    r) requests=$OPTARG ;; c) clients=$OPTARG ;; p) parallel=$OPTARG ;; n) maxtok=$OPTARG ;;
    b) bin=$OPTARG ;; m) model=$OPTARG ;; o) csv=$OPTARG ;; s) extra=$OPTARG ;; *) exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "server_soak: $bin not built (make build)" >&2; exit 1; }
command -v node >/dev/null || { echo "server_soak: node is not installed" >&2; exit 1; }
tmp=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$tmp"' EXIT
csv=${csv:-$tmp/rss.csv}

# -c 2048 and --max-body 256 KiB make the "prompt over the context" and "body
# over --max-body" bad requests cheap to send; the queue holds every client.
# shellcheck disable=SC2086
"$bin" serve -m "$model" --port 0 --parallel "$parallel" --queue "$clients" -c 2048 --max-body 262144 $extra \
  2>"$tmp/serve.log" &
pid=$!
port=
for _ in $(seq 600); do
  port=$(sed -n 's/.* on http:\/\/[^:]*:\([0-9]*\) .*/\1/p' "$tmp/serve.log")
  [ -n "$port" ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
[ -n "$port" ] || { echo "server_soak: the server did not start" >&2; cat "$tmp/serve.log" >&2; exit 1; }
url=http://127.0.0.1:$port
head -1 "$tmp/serve.log" | sed 's/^/server_soak: /'

start=$(date +%s)
echo "t_s,vmrss_kb,threads,fds" >"$csv"
(
  while kill -0 "$pid" 2>/dev/null; do
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    thr=$(awk '/^Threads:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
    fds=$(ls "/proc/$pid/fd" 2>/dev/null | wc -l)
    [ -n "$rss" ] && echo "$(( $(date +%s) - start )),$rss,$thr,$fds" >>"$csv"
    sleep 1
  done
) &
sampler=$!

rc=0
node bench/server_bench.mjs soak "$url" "$clients" "$requests" "$maxtok" | tee "$tmp/client.log" || rc=1
curl -sf "$url/metrics" | grep -E '^flashmoe_(requests_total|generations|generated_tokens_total|prompt_tokens|state_cache|slots_busy|queue)' \
  | sed 's/^/server_soak: metrics: /' || true
sleep 2  # one more sample at rest
kill -TERM "$pid"
src=0; wait "$pid" || src=$?
pid=
wait "$sampler" 2>/dev/null || true
secs=$(( $(date +%s) - start ))
grep -q "stopped" "$tmp/serve.log" || src=${src/#0/1}
echo "server_soak: server exit status $src after SIGTERM ($secs s in all)"
[ "$src" = 0 ] || { rc=1; tail -5 "$tmp/serve.log" | sed 's/^/server_soak: serve.log: /'; }
awk -F, 'NR > 1 {
    if (first == "") { first = $2; fd0 = $4; th0 = $3 } last = $2; fdl = $4; thl = $3
    if ($2 > max) max = $2; if ($4 > fdmax) fdmax = $4; samples++; rows[samples] = $2 }
  END { half = int(samples / 2); for (k = 1; k <= samples; k++) { if (k <= half && rows[k] > m1) m1 = rows[k]; if (k > half && rows[k] > m2) m2 = rows[k] }
        printf "server_soak: VmRSS start %.1f MiB, end %.1f MiB, max %.1f MiB (max first half %.1f, second half %.1f), %d samples\n",
               first/1024, last/1024, max/1024, m1/1024, m2/1024, samples
        printf "server_soak: threads start %d end %d; open fds start %d end %d max %d\n", th0, thl, fd0, fdl, fdmax }' "$csv"
exit "$rc"
