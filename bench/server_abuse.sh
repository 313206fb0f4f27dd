#!/usr/bin/env bash
# The bounded abuse run of docs/server.md ("Hostile clients"): a well-behaved
# client's latency alone and while a slowloris (200 connections), header
# floods (10,000 lines), a chunked 100 MB upload and 500-connection bursts
# hit the same server. Needs a build (build/flashmoe), node and 2 cores.
#   bench/server_abuse.sh [MODEL_DIR] [THREADS] [SECONDS per phase] [BINARY]
# Placement, to model clients on other hosts on one 2-core machine: the
# server (all its threads, compute pool of THREADS=1) on core 0; the clients
# on core 1, the attackers at nice 19 under the well-behaved client, so the
# attackers' own CPU use does not delay the well-behaved client's process
# (on another host it would not), while every byte they send still costs
# the server its share of core 0.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/coder-mini}
threads=${2:-1}
seconds=${3:-20}
bin=${4:-build/flashmoe}
port=$((20000 + RANDOM % 20000))
ulimit -n 4096 2>/dev/null || true
log=$(mktemp)
taskset -c 0 "$bin" serve -m "$model" --port "$port" -t "$threads" --parallel 1 --queue 32 --read-timeout 10 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
idle=$(taskset -c 1 node bench/server_abuse.mjs client "$port" "$seconds" idle)
echo "$idle" | grep -v '^p99 ms'
taskset -c 1 nice -n 19 node bench/server_abuse.mjs attack "$port" "$((seconds + 2))" >"$log.attack" &
attackers=$!
sleep 1.5  # the slowloris is in place
loaded=$(taskset -c 1 node bench/server_abuse.mjs client "$port" "$seconds" "under abuse")
echo "$loaded" | grep -v '^p99 ms'
wait $attackers
cat "$log.attack"
read -r _ _ _ ic _ ih <<<"$(echo "$idle" | grep '^p99 ms')"
read -r _ _ _ lc _ lh <<<"$(echo "$loaded" | grep '^p99 ms')"
awk -v ic="$ic" -v ih="$ih" -v lc="$lc" -v lh="$lh" \
  'BEGIN { printf "ratio p99 under abuse / idle: completions %.2fx, /health %.2fx\n", lc / ic, lh / ih }'
echo "server RSS at the end: $(ps -o rss= -p $pid) KiB; fds: $(ls /proc/$pid/fd | wc -l)"
kill $pid; wait $pid || true
rm -f "$log" "$log.attack"
