#!/usr/bin/env bash
# The bounded abuse run of docs/server.md ("Hostile clients"): a well-behaved
# client's latency alone and while a slowloris (200 connections), header
# floods (10,000 lines), a chunked 100 MB upload and 500-connection bursts
# hit the same server. Needs a build (build/flashmoe) and node.
#   bench/server_abuse.sh [MODEL_DIR] [THREADS] [SECONDS per phase] [BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/coder-mini}
threads=${2:-2}
seconds=${3:-20}
bin=${4:-build/flashmoe}
port=$((20000 + RANDOM % 20000))
ulimit -n 4096 2>/dev/null || true
log=$(mktemp)
"$bin" serve -m "$model" --port "$port" -t "$threads" --parallel 1 --queue 32 --read-timeout 10 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
node bench/server_abuse.mjs "$port" "$seconds"
echo "server RSS at the end: $(ps -o rss= -p $pid) KiB; fds: $(ls /proc/$pid/fd | wc -l)"
kill $pid; wait $pid || true
