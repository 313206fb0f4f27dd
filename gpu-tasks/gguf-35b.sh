#!/usr/bin/env bash
# A Qwen3.5-35B-A3B-shaped Q4_K_M GGUF with random weights, written on the
# GPU machine (bench/gguf_random_35b.py: ~20 GB, the shapes and llama.cpp's
# Q4_K_M type mix, metadata from coder-mini's GGUF), then flashmoe on it on
# the H200: pp512 and tg128. llama.cpp (CUDA build) can bench the same file:
#   llama-bench -m /tmp/gguf35b/q4_k_m.gguf -ngl 99 -p 512 -n 128
#
#   bash gpu-tasks/gguf-35b.sh [TEMPLATE_GGUF]   (default gpu-gguf/coder-mini-q4_k_m.gguf, carried)
# Needs ~21 GB free under /tmp. Expected: the file written, then flashmoe's
# pp512 / tg128 table for it on cuda.
set -uo pipefail
cd "$(dirname "$0")/.."
T=${1:-gpu-gguf/coder-mini-q4_k_m.gguf}
[ -f "$T" ] || { echo "FAIL: template GGUF $T missing (carry gpu-gguf/)"; exit 1; }
( cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${CMAKE_EXTRA:-} >/dev/null &&
  cmake --build build -j 6 --target flashmoe 2>&1 | grep -E "error" | head -20 ) &
mkdir -p /tmp/gguf35b
F=/tmp/gguf35b/q4_k_m.gguf
[ -f $F ] || time python3 bench/gguf_random_35b.py "$T" $F || { echo "FAIL: writing $F"; exit 1; }
wait
[ -x build/flashmoe ] || { echo "FAIL build"; exit 1; }
ls -la $F
build/flashmoe bench -m $F --device cuda -p 512 -n 128 2>&1 | tail -8
