#!/bin/bash
# Branch serve-speed on the H200, build/ already built (bench/cuda_device_run.sh
# build), within ~4 minutes:
#   0. CudaBatch.ScheduledGreedyGenerateEqualsTheLogitsPath and CudaServe.*;
#   1. the GPU: `flashmoe serve --synthetic qwen3.5-35b-a3b --tokenizer
#      models/coder-mini --device cuda --parallel 32` with 1, 8 and 32
#      streaming python clients (bench/server_stream_bench.py, greedy, one
#      request of N tokens each, ignore_eos; warmed by one short request),
#      each case twice: with the default --state-cache (every request copies
#      its state to the host twice: after the prompt's last message, and
#      after the answer, now after its [DONE]) and with --state-cache 0 (no
#      copies: what the snapshots cost); then `flashmoe bench --synthetic
#      qwen3.5-35b-a3b --device cuda -p 0 -n N -r 1 --batch 1,8,32`.
#      Criterion (issue 18): server aggregate within 15% of bench at each B.
#   2. the CPU on 2 pinned cores: bench --batch 1,8 -t 2, then coder-mini
#      `serve -t 2` with 1 and 8 streaming clients (temperature 0.7, 2
#      requests of 128 tokens), two rounds. Criterion: 8 clients >= 3x one.
# BASE=path/to/flashmoe (optional, e.g. /tmp/base/build/flashmoe from
# cuda_device_run.sh's build step): part 1's server cases run with it too,
# interleaved, labelled [base].
# usage (repository root, on the device): bash gpu-tasks/serve-speed.sh [N]
set -o pipefail
N=${1:-160}
OUT=${OUT:-/tmp/out}; D=$OUT/serve-speed; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe || { echo "FAIL no build/flashmoe"; exit 1; }
port=$((20000 + RANDOM % 20000)); url=http://127.0.0.1:$port
elapsed() { echo $((SECONDS - T0)); }
wait_health() {  # LOG TRIES
  for _ in $(seq $2); do
    kill -0 $pid 2>/dev/null || break
    python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=1)" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "FAIL the server did not come up; its log:"; tail -5 $1; return 1
}
metrics() {  # LABEL: steps, sequence-steps, snapshots so far
  python3 -c "
import urllib.request as u
m = dict(l.rsplit(' ', 1) for l in u.urlopen('$url/metrics', timeout=2).read().decode().splitlines() if l.startswith('flashmoe_') and ' ' in l and not l.startswith('#'))
g = lambda k: float(m.get(k, 0))
print(f'[$1] {g(\"flashmoe_batch_steps_total\"):.0f} steps, {g(\"flashmoe_batch_step_sequences_total\"):.0f} sequence-steps, {g(\"flashmoe_state_cache_entries\"):.0f} snapshots ({g(\"flashmoe_state_cache_bytes\") / 1e6:.0f} MB) so far')" 2>&1 | tail -1
}

# 0. The device tests of what changed: the scheduled greedy path (argmax on
#    the device, prompt included) against forward() with host logits, and
#    the GPU server's answers against the CPU server's.
if [ -x build/flashmoe_tests ]; then
  timeout 150 ./build/flashmoe_tests --gtest_filter='CudaBatch.ScheduledGreedy*:CudaServe.*' > $D/tests.log 2>&1
  echo "[tests] rc $?: $(grep -E '^\[  (PASSED|FAILED) |^\[  FAILED  \] [A-Z]' $D/tests.log | tr '\n' ' ')"
else
  echo "SKIPPED tests (no build/flashmoe_tests)"
fi

# 1. The GPU server on the 35B synthetic (default cache and --state-cache 0), then bench --batch.
bins="new"; [ -n "$BASE" ] && [ -x "$BASE" ] && bins="base new"
for bin in $bins; do
  B=./build/flashmoe; [ $bin = base ] && B=$BASE
  for cache in default 0; do
    extra=""; [ $cache = 0 ] && extra="--state-cache 0"
    [ $(elapsed) -lt 330 ] || { echo "SKIPPED $bin cache $cache (time)"; continue; }
    timeout 40 $B serve --synthetic qwen3.5-35b-a3b --tokenizer models/coder-mini --device cuda --port $port \
      --parallel 32 --queue 64 $extra 2> $D/serve35b-$bin-$cache.log &
    pid=$!
    if wait_health $D/serve35b-$bin-$cache.log 300; then
      timeout 5 python3 bench/server_stream_bench.py $url 1 1 16 0 > /dev/null 2>&1  # warm-up
      for n in 1 8 32; do
        timeout 12 python3 bench/server_stream_bench.py $url $n 1 $N 0 2>&1 | sed "s/^/[$bin server 35b, state-cache $cache] /"
      done
      metrics "$bin server 35b, state-cache $cache"
    fi
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
  done
done
echo "== GPU server done at $(elapsed) s"
timeout 25 ./build/flashmoe bench --synthetic qwen3.5-35b-a3b --device cuda -p 0 -n $N -r 1 --batch 1,8,32 \
  > $D/bench35b.log 2>&1
echo "[bench 35b] rc $?: $(grep -E 'tg[0-9]+( x[0-9]+ \(aggregate\))? ' $D/bench35b.log | tr -s ' ' | tr '\n' ' ')"
echo "== GPU bench done at $(elapsed) s"

# 2. The CPU on 2 pinned cores.
timeout 10 taskset -c 0,1 ./build/flashmoe bench -m models/coder-mini --device cpu -t 2 -p 0 -n 128 -r 1 \
  --batch 1,8 2>/dev/null | grep -E "tg128" | sed "s/^/[cpu bench -t 2] /"
for round in 1 2; do
  for n in 1 8; do
    taskset -c 0,1 ./build/flashmoe serve -m models/coder-mini --device cpu -t 2 --port $port --parallel $n --queue 64 \
      2> $D/cpu$n-$round.log &
    pid=$!
    wait_health $D/cpu$n-$round.log 100 &&
      for temp in 0.7 0; do
        timeout 8 python3 bench/server_stream_bench.py $url $n 2 128 $temp 2>&1 | sed "s/^/[cpu server -t 2, round $round] /"
      done
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
  done
done
echo "== done at $(elapsed) s"
