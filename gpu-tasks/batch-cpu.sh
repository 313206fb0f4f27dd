#!/usr/bin/env bash
# For the lead, on an H200 after a CUDA build (build/flashmoe, build/flashmoe_tests),
# ideally with branch batch-cuda merged (its CudaBackend::forward_batch).
# Branch batch-cpu adds the serve batch scheduler and `bench --batch`; it
# changes no CUDA code, so on its own the GPU runs forward_batch's default
# (the items one after another).
#   bash gpu-tasks/batch-cpu.sh 2>&1 | tee bench/results/batch-h200.txt
set -euo pipefail
cd "$(dirname "$0")/.."
# 1. The CUDA serve tests still pass with the scheduler in front of the GPU
#    (expected: all OK; ConcurrentRequestsShareTheGpu gives each answer alone).
./build/flashmoe_tests --gtest_filter='CudaServe.*:CudaDevice*:BatchScheduler.*:*BatchForward*'
# 2. bench --batch on the 35B synthetic (expected: 4 tables; B=1 tg within 2%
#    of `bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 128`; with
#    batch-cuda merged, B=32 >= 5x B=1 and >= 50% of the printed roofline).
for B in 1 8 32 64; do
  ./build/flashmoe bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 2 --batch "$B"
done
# The same for the model the server bench serves (its step-3 comparison).
for B in 1 8 32; do ./build/flashmoe bench --device cuda -m models/coder-mini -p 0 -n 128 -r 2 --batch "$B"; done
# 3. The server with 1/8/32 streaming clients on the GPU (expected: aggregate
#    tok/s within 15% of coder-mini's step-2 figure at the same B once batch-cuda is merged;
#    without it, roughly the B=1 figure at every client count).
SERVE_ARGS="--device cuda" bench/server_bench.sh models/coder-mini 16 1 8 32
