#!/usr/bin/env bash
# The server against `bench --batch` on the CPU, two binaries interleaved
# (issue 18's CPU criterion: 8 streaming clients >= 3x one client), for
# bench/NOTES.md's "serve-speed" entry. Each round, for each binary:
# `bench --batch 1,8 -t T -p 0 -n 128 -r 1`, then `serve -t T --parallel N`
# with N = 1 and 8 streaming clients (bench/server_bench.mjs streaming, 2
# requests of 128 tokens each, ignore_eos) at temperature 0.7 and 0 (greedy:
# the argmax path).
#   bench/serve_speed_cpu.sh BASE_BIN NEW_BIN [ROUNDS] [MODEL] [THREADS]
set -uo pipefail
cd "$(dirname "$0")/.."
base=$1 new=$2 rounds=${3:-2} model=${4:-models/coder-mini} threads=${5:-2}
port=$((20000 + RANDOM % 20000)); url=http://127.0.0.1:$port
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null || true' EXIT
for round in $(seq "$rounds"); do
  for which in base new; do
    bin=$base; [ $which = new ] && bin=$new
    $bin bench -m "$model" --device cpu -t "$threads" -p 0 -n 128 -r 1 --batch 1,8 2>/dev/null |
      grep -E "tg128( x8 \(aggregate\))? " | tr -s ' ' | sed "s/^/[$which r$round bench] /"
    for n in 1 8; do
      $bin serve -m "$model" --device cpu -t "$threads" --port "$port" --parallel "$n" --queue 64 2>/tmp/serve-speed-cpu.log &
      pid=$!
      for _ in $(seq 300); do curl -sf "$url/health" >/dev/null && break; sleep 0.1; done
      for temp in 0.7 0; do
        node bench/server_bench.mjs streaming "$url" "$n" 2 128 "$temp" | sed "s/^/[$which r$round serve] /"
      done
      kill $pid; wait $pid 2>/dev/null; pid=
    done
  done
done
