#!/bin/bash
# Batched decode on CUDA at B = 32, and the server with streaming clients on
# the GPU and the CPU (issue 18, branch batch-more), on the H200 with build/
# already built (no build here), within 80 s, each part skipped when time
# is short (round 1 also ran ncu over a B = 32 step: bench/NOTES-cuda.md):
#   1. CudaBatchBench (35B synthetic, B = 1, 8, 32, 64 on one model, graphs):
#      session 6's kernels and paths against the default (the skinny product
#      with 2 warp groups along K, the shared expert beside the routed
#      experts, the in-proj at 17-32 rows on the skinny product);
#   2. the server bench on the GPU: coder-mini, `flashmoe serve --device
#      cuda` with 1, 8, 32 streaming clients (bench/server_stream_bench.py,
#      python stdlib; greedy, as the bench) against `flashmoe bench --batch
#      B` at the same B, and the server's steps (/metrics: sequences per
#      step); at 8 and 32 clients also with --batch-gather 300 (us);
#   3. the tests of what changed (CudaOps.SkinnyProductMatchesCpu, CudaBatch.*,
#      the prefill against token by token);
#   4. the CPU server (2 threads pinned to 2 cores) with 1 and 8 streaming
#      clients (temperature 0.7, as bench/server_bench.sh), and `bench
#      --batch 1 / 8` there.
# usage (repository root, on the device): bash gpu-tasks/batch-more.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/batch-more; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe, build/flashmoe_tests"; exit 1; }
echo "node: $(command -v node || echo absent) $(node --version 2>/dev/null); ncu: $(command -v ncu || echo absent)"

timeout 20 stdbuf -oL ./build/flashmoe_tests --gtest_also_run_disabled_tests \
  --gtest_filter='CudaBatchBench.DISABLED_DecodeThroughputAt35b' > $D/bench.log 2>&1
echo "== bench rc $? at $((SECONDS-T0)) s"
grep -E "^\[batch-bench\]|FAILED|rror" $D/bench.log | sed -E 's/; experts touched.*roofline/; roofline/'


port=$((20000 + RANDOM % 20000)); url=http://127.0.0.1:$port
for run in 1:3000 8:3000 8:300 32:3000 32:300; do
  n=${run%:*}; gather=${run#*:}
  [ $((SECONDS-T0)) -lt 38 ] || break
  ./build/flashmoe serve -m models/coder-mini --device cuda --port $port --parallel $n --queue 64 \
    --batch-gather $gather 2> $D/serve$n.log &
  pid=$!
  for _ in $(seq 150); do python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=1)" 2>/dev/null && break; sleep 0.1; done
  timeout 8 python3 bench/server_stream_bench.py $url $n 1 128 0 2>&1 | sed "s/^/[server] /"
  python3 -c "
import urllib.request as u
m = dict(l.rsplit(' ', 1) for l in u.urlopen('$url/metrics', timeout=2).read().decode().splitlines() if l.startswith('flashmoe_batch_step'))
st, sq = float(m.get('flashmoe_batch_steps_total', 0)), float(m.get('flashmoe_batch_step_sequences_total', 0))
print(f'[server] $n clients, --batch-gather $gather: {st:.0f} batched steps, {sq / max(st, 1):.1f} sequences per step')" 2>&1 | head -2
  kill $pid; wait $pid 2>/dev/null
  [ $gather = 3000 ] || continue
  timeout 8 ./build/flashmoe bench -m models/coder-mini --device cuda -p 0 -n 128 -r 1 --batch $n 2>/dev/null |
    grep -E "tg128" | sed "s/^/[bench --batch $n] /"
done
echo "== GPU server done at $((SECONDS-T0)) s"

if [ $((SECONDS-T0)) -lt 50 ]; then
F='CudaOps.SkinnyProductMatchesCpu:CudaBatch.*:CudaCoderMini.BatchedPrefillMatchesTokenByToken:CudaSynthetic.BatchedPrefillMatchesTokenByTokenAt35bShapes:-CudaBatch.GoldenFixturesMatchEachSequenceAlone'
timeout 18 stdbuf -oL ./build/flashmoe_tests --gtest_filter="$F" > $D/tests.log 2>&1
rc=$?
grep -E "^\[ +(OK|FAILED) +\]|^\[  (PASSED|FAILED)|Failure|Expected|Which is|want|what\(\)" $D/tests.log | head -30
grep -E "^\[cuda-batch\]" $D/tests.log | sort -k6 -g | tail -3
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"
else echo "SKIPPED tests (time)"; fi


# The CPU's 8 clients against 1 (2 threads, as bench/server_bench.sh
# models/coder-mini 2 1 8) on 2 of this quiet machine's cores (taskset: the
# sessions' sampling shares them, as on the 2-core development machine).
for n in 1 8; do
  [ $((SECONDS-T0)) -lt 66 ] || break
  taskset -c 0,1 ./build/flashmoe serve -m models/coder-mini --device cpu -t 2 --port $port --parallel $n --queue 64 \
    2> $D/cpu$n.log &
  pid=$!
  for _ in $(seq 100); do python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=1)" 2>/dev/null && break; sleep 0.1; done
  timeout 6 python3 bench/server_stream_bench.py $url $n 2 128 2>&1 | sed "s/^/[cpu server -t 2] /"
  kill $pid; wait $pid 2>/dev/null
done
for n in 1 8; do
  [ $((SECONDS-T0)) -lt 72 ] || break
  timeout 4 taskset -c 0,1 ./build/flashmoe bench -m models/coder-mini --device cpu -t 2 -p 0 -n 128 -r 1 --batch $n 2>/dev/null |
    grep -E "tg128" | sed "s/^/[cpu bench -t 2 --batch $n] /"
done
echo "== CPU done at $((SECONDS-T0)) s"

echo "== done at $((SECONDS-T0)) s"
