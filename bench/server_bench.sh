#!/usr/bin/env bash
# Server numbers for docs/server.md: turn-2 time to first token with and
# without conversation-state reuse, total generation throughput with 1, 4
# and 8 concurrent clients, and N concurrent streaming clients (continuous
# batching: aggregate tokens/s, TTFT and inter-token latency percentiles).
# Needs a build (build/flashmoe) and node.
#   bench/server_bench.sh [MODEL_DIR] [THREADS] [STREAMING_CLIENTS...]
#   (extra serve options, e.g. --device cuda: SERVE_ARGS="--device cuda")
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/coder-mini}
threads=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
streaming=${*:-1 8 32}
bin=build/flashmoe
port=$((20000 + RANDOM % 20000))
url=http://127.0.0.1:$port
pid=

serve() {  # serve ARGS...: starts the server, waits for /health
  # shellcheck disable=SC2086
  $bin serve -m "$model" --port "$port" -t "$threads" ${SERVE_ARGS:-} "$@" 2>/tmp/flashmoe-bench-serve.log &
  pid=$!
  for _ in $(seq 300); do curl -sf "$url/health" >/dev/null && return; sleep 0.1; done
  cat /tmp/flashmoe-bench-serve.log; exit 1
}
stop() { kill "$pid"; wait "$pid" || true; }
trap '[ -n "$pid" ] && kill $pid 2>/dev/null || true' EXIT

# ~2,700 tokens of history: the engine's own generate loop and session code.
history=$(mktemp)
cat src/engine/generator.cpp src/engine/session.cpp src/engine/generator.h > "$history"

for cache in 32 0; do
  echo "== turn-2 TTFT, --state-cache $cache"
  serve --state-cache "$cache"
  node bench/server_bench.mjs ttft "$url" "$history"
  stop
done

for n in 1 4 8; do
  echo "== throughput, $n concurrent clients (--parallel $n)"
  serve --parallel "$n" --queue 16
  node bench/server_bench.mjs throughput "$url" "$n" 2 128
  stop
done

for n in $streaming; do
  echo "== streaming, $n concurrent clients (--parallel $n)"
  serve --parallel "$n" --queue 64
  node bench/server_bench.mjs streaming "$url" "$n" 2 128
  stop
done
rm -f "$history"
