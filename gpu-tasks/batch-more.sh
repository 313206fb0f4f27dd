#!/bin/bash
# Batched decode on CUDA at B = 32, and the server with streaming clients on
# the GPU (issue 18, branch batch-more), on the H200 with build/ already
# built (no build here), within 70 s, each part skipped when time is short:
#   1. CudaBatchBench (35B synthetic, B = 1, 8, 32, 64 on one model): the
#      skinny product with 1 and 2 warp groups along K, the shared expert in
#      line and beside, the in-proj through the skinny product, side by side;
#   2. the server bench on the GPU: coder-mini, `flashmoe serve --device
#      cuda` with 1, 8, 32 streaming clients (bench/server_stream_bench.py,
#      python stdlib; greedy, as the bench) against `flashmoe bench --batch
#      B` at the same B;
#   3. the tests of what changed: CudaOps.SkinnyProductMatchesCpu (the
#      skinny product with 2 warp groups along K against a double product),
#      the batched-decode tests (CudaBatch.*: each sequence against the same
#      sequence alone, through the shared expert's second stream and graphs),
#      the prefill against token by token;
#   4. ncu --section SpeedOfLight over one B = 32 step of the 35B's shapes
#      (4 layers): each kernel's time and DRAM / SM throughput;
#   5. the CPU server (2 threads on 2 cores) with 1 and 8 streaming clients.
# usage (repository root, on the device): bash gpu-tasks/batch-more.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/batch-more; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe, build/flashmoe_tests"; exit 1; }
echo "node: $(command -v node || echo absent) $(node --version 2>/dev/null); ncu: $(command -v ncu || echo absent)"

timeout 24 stdbuf -oL ./build/flashmoe_tests --gtest_also_run_disabled_tests \
  --gtest_filter='CudaBatchBench.DISABLED_DecodeThroughputAt35b' > $D/bench.log 2>&1
echo "== bench rc $? at $((SECONDS-T0)) s"
grep -E "^\[batch-bench\]|FAILED|rror" $D/bench.log | sed -E 's/; experts touched.*roofline/; roofline/'


port=$((20000 + RANDOM % 20000)); url=http://127.0.0.1:$port
for n in 1 8 32; do
  [ $((SECONDS-T0)) -lt 40 ] || break
  ./build/flashmoe serve -m models/coder-mini --device cuda --port $port --parallel $n --queue 64 2> $D/serve$n.log &
  pid=$!
  for _ in $(seq 150); do python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=1)" 2>/dev/null && break; sleep 0.1; done
  timeout 8 python3 bench/server_stream_bench.py $url $n 1 128 0 2>&1 | sed "s/^/[server] /"
  kill $pid; wait $pid 2>/dev/null
  timeout 8 ./build/flashmoe bench -m models/coder-mini --device cuda -p 0 -n 128 -r 1 --batch $n 2>/dev/null |
    grep -E "tg128" | sed "s/^/[bench --batch $n] /"
done
echo "== GPU server done at $((SECONDS-T0)) s"

if [ $((SECONDS-T0)) -lt 45 ]; then
F='CudaOps.SkinnyProductMatchesCpu:CudaBatch.*:CudaCoderMini.BatchedPrefillMatchesTokenByToken:CudaSynthetic.BatchedPrefillMatchesTokenByTokenAt35bShapes:-CudaBatch.GoldenFixturesMatchEachSequenceAlone'
timeout 18 stdbuf -oL ./build/flashmoe_tests --gtest_filter="$F" > $D/tests.log 2>&1
rc=$?
grep -E "^\[ +(OK|FAILED) +\]|^\[  (PASSED|FAILED)|Failure|Expected|Which is|want|what\(\)" $D/tests.log | head -30
grep -E "^\[cuda-batch\]" $D/tests.log | sort -k6 -g | tail -3
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"
else echo "SKIPPED tests (time)"; fi

if command -v ncu >/dev/null && [ $((SECONDS-T0)) -lt 55 ]; then
  K='regex:skinny|gemm|delta|combine|norm_|topk|route_lists|conv_batch|attn|split_rows|embed_rows|argmax_rows'
  timeout $((66-(SECONDS-T0))) ncu --section SpeedOfLight --csv --page details -k "$K" --launch-count 64 \
    ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b --layers 4 --batch 32 -p 0 -n 2 -r 1 \
    > $D/ncu.csv 2> $D/ncu.err
  echo "== ncu rc $? at $((SECONDS-T0)) s"
  python3 - $D/ncu.csv <<'EOF'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("ncu: no rows"); sys.exit()
h = rows[0]; ix = {k: i for i, k in enumerate(h)}
k = collections.OrderedDict()
for r in rows[1:]:
    try: kid = r[ix["ID"]]
    except (KeyError, IndexError): continue
    e = k.setdefault(kid, {"name": r[ix["Kernel Name"]], "grid": r[ix["Grid Size"]], "block": r[ix["Block Size"]]})
    e[r[ix["Metric Name"]] + " (" + r[ix["Metric Unit"]] + ")"] = r[ix["Metric Value"]]
def f(e, key):
    for kk, v in e.items():
        if kk.startswith(key):
            try: return float(v.replace(",", "")), kk
            except ValueError: return 0.0, kk
    return 0.0, ""
g = collections.OrderedDict()
for e in k.values():
    d, unit = f(e, "Duration")
    u = unit[unit.rfind("(") + 1:-1]
    us = d / 1000 if u in ("ns", "nsecond") else d * 1000 if u in ("ms", "msecond") else d
    key = (e["name"].split("(")[0].replace("void ", "").replace("flashmoe::cuda::", "")[:58], e["grid"], e["block"])
    s = g.setdefault(key, [0, 0.0, 0.0, 0.0])
    s[0] += 1; s[1] += us; s[2] += f(e, "DRAM Throughput")[0]; s[3] += f(e, "Compute (SM) Throughput")[0]
print("ncu, one B=32 step of 4 layers (3 delta + 1 attention): kernel, grid, block, launches, us total, DRAM %, SM %")
for (n, gr, bl), (c, us, dr, sm) in sorted(g.items(), key=lambda x: -x[1][1]):
    print(f"[ncu] {n:58s} {gr:>16s} {bl:>12s} x{c:<3d} {us:8.1f} us  dram {dr/c:5.1f}%  sm {sm/c:5.1f}%")
EOF
  tail -3 $D/ncu.err
else
  echo "ncu: absent or no time left, skipped"
fi
echo "== ncu done at $((SECONDS-T0)) s"

# The CPU's 8 clients against 1 (2 threads, as bench/server_bench.sh
# models/coder-mini 2 1 8) on 2 of this quiet machine's cores (taskset: the
# sessions' sampling shares them, as on the 2-core development machine).
for n in 1 8; do
  [ $((SECONDS-T0)) -lt 62 ] || break
  taskset -c 0,1 ./build/flashmoe serve -m models/coder-mini --device cpu -t 2 --port $port --parallel $n --queue 64 \
    2> $D/cpu$n.log &
  pid=$!
  for _ in $(seq 100); do python3 -c "import urllib.request as u; u.urlopen('$url/health', timeout=1)" 2>/dev/null && break; sleep 0.1; done
  timeout 4 python3 bench/server_stream_bench.py $url $n 2 128 2>&1 | sed "s/^/[cpu server -t 2] /"
  kill $pid; wait $pid 2>/dev/null
done
echo "== done at $((SECONDS-T0)) s"
