#!/usr/bin/env bash
# Issue 26 (multi-GPU over NCCL), on ONE H200 (no build here: build/ is ready).
#   bash gpu-tasks/multi-gpu.sh            (limit: 60 s)
# 1. Where NCCL is on this machine and what the build found (round 2 may
#    need -DNCCL_ROOT=<dir> from here).
# 2. The CudaMultiGpu tests: OneRankEqualsSingleGpu must PASS (one rank
#    through the NCCL path = the single GPU bit for bit); TwoRanksMatchSingleGpu
#    SKIPs with fewer than 2 GPUs.
# 3. Two ranks on one GPU (--devices 0,0): whether NCCL takes it (recent
#    versions refuse a device twice in one communicator: expected FAIL with
#    NCCL's message, no hang).
# 4. bench --synthetic qwen3.5-35b-a3b, decode 64 tokens, plain vs --gpus 1,
#    interleaved: the N=1 path must cost <= 2%.
set -uo pipefail
cd "$(dirname "$0")/.."
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/flashmoe(_tests) missing"; exit 1; }
OUT_DIR="${OUT:-/tmp}/multi-gpu"
mkdir -p "$OUT_DIR"
echo "== 1. NCCL"
grep -E "^(FLASHMOE_NCCL|NCCL_INCLUDE_DIR|NCCL_LIBRARY|NCCL_ROOT)[:=]" build/CMakeCache.txt || echo "no NCCL entries in CMakeCache"
python3 -c "import nvidia.nccl, os; print('python nvidia.nccl:', os.path.dirname(nvidia.nccl.__file__))" 2>&1 | tail -1
timeout 10 find / -xdev \( -name nccl.h -o -name 'libnccl.so*' \) -not -path '/proc/*' 2>/dev/null | head -20
echo "== 2. tests"
timeout 25 ./build/flashmoe_tests --gtest_filter='CudaMultiGpu.*:MultiGpuCli.*:ExpertPartition.*' 2>&1 | tail -25
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] && echo "PASS: CudaMultiGpu/MultiGpuCli/ExpertPartition tests" || echo "FAIL: tests rc=$rc"
echo "== 3. two ranks on one GPU"
M=tests/fixtures/tiny-qwen35moe/model
one=$(timeout 15 ./build/flashmoe generate --device cuda -m $M --ids 1,2,3,4,5 -n 12 --greedy --print-ids 2>&1 | tail -1)
g1=$(timeout 15 ./build/flashmoe generate -m $M --ids 1,2,3,4,5 -n 12 --greedy --print-ids --gpus 1 2>&1 | tail -1)
echo "plain: $one"; echo "--gpus 1: $g1"
[ "$one" = "$g1" ] && echo "PASS: generate --gpus 1 = plain" || echo "FAIL: generate --gpus 1 differs"
dup=$(timeout 15 ./build/flashmoe generate -m $M --ids 1,2,3,4,5 -n 12 --greedy --print-ids --devices 0,0 2>&1 | tail -2)
echo "rc=$? --devices 0,0: $dup"
echo "== 4. bench 35B synthetic, tg64, plain vs --gpus 1 (interleaved)"
B="./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 64 -r 3"
for i in 1 2 3; do
  [ "$i" -gt 1 ] && [ "$SECONDS" -gt 42 ] && break  # a second pair only where the 60 s allow it
  timeout 20 $B 2>&1 | grep -E "^\| tg|roofline|error" | sed "s/^/plain  : /"
  timeout 20 $B --gpus 1 2>&1 | grep -E "^\| tg|roofline|error" | sed "s/^/gpus 1 : /"
  echo "(after pair $i: ${SECONDS} s)"
done
