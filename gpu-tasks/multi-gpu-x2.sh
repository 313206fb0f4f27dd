#!/usr/bin/env bash
# Issue 26 on nvidia-h200-x2 (two GPUs), for the session that gets one; no
# build here (build/ ready, configured with NCCL: configure prints
# "flashmoe: NCCL ON"). Needs models/coder-mini.
#   bash gpu-tasks/multi-gpu-x2.sh 2>&1 | tee bench/results/multi-gpu-x2.txt
# Expected: both CudaMultiGpu tests PASS (TwoRanks no longer skips); coder-mini
# greedy ids with --gpus 2 equal to one GPU's; the 35B table (docs/multi-gpu.md
# predicts --gpus 2 at 0.85-1.0x one GPU at batch 1: expert parallelism alone
# leaves the 3.9 GB of replicated weights on every GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/flashmoe(_tests) missing"; exit 1; }
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -4
grep -E "^(NCCL_INCLUDE_DIR|NCCL_LIBRARY)[:=]" build/CMakeCache.txt
echo "== tests"
./build/flashmoe_tests --gtest_filter='CudaMultiGpu.*:MultiGpuCli.*:ExpertPartition.*:RankThreads.*' 2>&1 | tail -6
echo "== coder-mini greedy ids: one GPU vs --gpus 2"
G="./build/flashmoe generate -m models/coder-mini --ids 1,2,3,4,5,6,7,8 -n 48 --greedy --print-ids"
a=$($G --device cuda 2>&1 | tail -1); b=$($G --gpus 2 2>&1 | tail -1)
echo "1 GPU : $a"; echo "2 GPUs: $b"
[ -n "$a" ] && [ "$a" = "$b" ] && echo "PASS: coder-mini --gpus 2 = one GPU" || echo "FAIL: coder-mini ids differ"
echo "== 35B synthetic: plain, --gpus 1, --gpus 2 (interleaved, 2 rounds)"
B="./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b -p 2048 -n 128 -r 3"
for i in 1 2; do
  $B 2>&1 | grep -E "^\| (tg|pp)|of that roofline" | sed "s/^/plain   : /"
  $B --gpus 1 2>&1 | grep -E "^\| (tg|pp)|of that roofline" | sed "s/^/gpus 1  : /"
  $B --gpus 2 2>&1 | grep -E "^\| (tg|pp)|of that roofline" | sed "s/^/gpus 2  : /"
done
echo "== 35B synthetic, batch 32: plain vs --gpus 2 (sequences one after another on --gpus: no batched step yet)"
./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 64 -r 1 --batch 32 2>&1 | grep -E "aggregate|roofline" | sed "s/^/plain   : /"
./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 64 -r 1 --batch 32 --gpus 2 2>&1 | grep -E "aggregate|roofline" | sed "s/^/gpus 2  : /"
