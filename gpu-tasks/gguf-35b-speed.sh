#!/usr/bin/env bash
# GGUF decode kernels staged through shared memory (src/backend/cuda/gguf_staged.cuh:
# runs of rows copied with cp.async, decoded from shared memory; the top-k
# inside the GGUF gate_up), checked and timed on the H200 at the
# Qwen3.5-35B-A3B shape. Needs build/flashmoe and build/flashmoe_tests
# already built (no build here), the 35B-shaped Q4_K_M file of
# gpu-tasks/gguf-35b.sh at /tmp/gguf35b/q4_k_m.gguf, and coder-mini's GGUFs
# in gpu-gguf/. With /tmp/llama/b/bin/llama-bench present, llama.cpp (CUDA)
# on the same files in the same call. Runs in about 100 s (with llama-bench ~200 s).
# Expected: the CUDA GGUF tests PASS; 35B tg128 above round 1's 232.0
# (predicted 260-300: Q4_K rows a quarter-warp a block, the down kernel 4
# rows a warp instead of 8;
# bench/NOTES-cuda.md "GGUF decode kernels at the 35B shape", "Session 6");
# coder-mini tg128 back near session 5's (Q8_0 4,961, Q4_K_M 4,718; round
# 1 had Q4_K_M at 2,729).
set -uo pipefail
cd "$(dirname "$0")/.."
F=/tmp/gguf35b/q4_k_m.gguf
LB=/tmp/llama/b/bin/llama-bench
for b in build/flashmoe build/flashmoe_tests; do [ -x $b ] || { echo "FAIL: $b not built"; exit 1; }; done
# The suites are parameterised (Kinds/CudaGgufOps.*): match them with *...*.
T=$(timeout 40 ./build/flashmoe_tests --gtest_brief=1 \
  --gtest_filter='*CudaGgufOps*:*CudaGgufExperts*:*CudaGgufModel*:*BlockQuant*' 2>&1)
rc=$?
echo "$T" | tail -25
if [ $rc -eq 0 ] && echo "$T" | grep -qE "PASSED.* [1-9][0-9]* test" && ! echo "$T" | grep -q "SKIPPED"; then
  echo "PASS: CudaGgufOps / CudaGgufExperts / CudaGgufModel / BlockQuant"
else
  echo "FAIL: CudaGgufOps / CudaGgufExperts / CudaGgufModel / BlockQuant (rc $rc, see above; skipped = no GPU or fixtures)"
fi
if [ -f $F ]; then
  echo "== flashmoe bench -m $F --device cuda -p 512 -n 128 -r 2"
  timeout 40 ./build/flashmoe bench -m $F --device cuda -p 512 -n 128 -r 2 2>&1 | tail -5
  echo "== flashmoe bench -m $F --device cuda -p 0 -n 32 -r 1 --profile 16"
  timeout 25 ./build/flashmoe bench -m $F --device cuda -p 0 -n 32 -r 1 --profile 16 2>&1 | grep -E "^\|" | tail -14
  [ -x $LB ] && { echo "== llama-bench -m $F -ngl 99 -p 512 -n 128 -r 2"; timeout 90 $LB -m $F -ngl 99 -p 512 -n 128 -r 2 2>&1 | grep -E "^\|"; }
else
  echo "FAIL: $F missing (gpu-tasks/gguf-35b.sh writes it)"
fi
for q in q4_k_m q8_0; do
  G=gpu-gguf/coder-mini-$q.gguf
  if [ -f $G ]; then
    echo "== flashmoe bench -m $G --device cuda -p 0 -n 128 -r 2"
    timeout 20 ./build/flashmoe bench -m $G --device cuda -p 0 -n 128 -r 2 2>&1 | grep -E "tg128"
  else
    echo "FAIL: $G missing (staged by the lead)"
  fi
done
