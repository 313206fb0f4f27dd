#!/usr/bin/env bash
# GGUF routed experts in the chunk layout (src/backend/cuda/gguf_chunks.cuh,
# gguf_chunk_experts.cuh: Q4_K / Q6_K rearranged at upload, read as the q4
# experts are) against the file's layout (gguf_staged.cuh), H200, the
# 35B-A3B-shaped Q4_K_M file of bench/gguf_random_35b.py at
# /tmp/gguf35b/q4_k_m.gguf (made by the lead's round). Needs build/flashmoe
# and build/flashmoe_tests built. About 48 s. Usage: bash gpu-tasks/gguf-repack.sh [budget_s]
# Prints PASS/FAIL lines and the numbers; logs under $OUT (or /tmp).
# Expected (bench/NOTES-cuda.md, "Session 8: the chunk layout"): the tests
# PASS; 35B tg128 chunks ~334 against stored ~274 side by side (round 1),
# llama.cpp ~249 in the same call; greedy ids of the two layouts equal; the
# profile's experts ~1.2 ms (stored 2.11).
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=${1:-48}
O=${OUT:-/tmp}
F=/tmp/gguf35b/q4_k_m.gguf
LB=/tmp/llama/b/bin/llama-bench
for b in build/flashmoe build/flashmoe_tests; do [ -x $b ] || { echo "FAIL: $b not built"; exit 1; }; done
T=$(timeout 20 ./build/flashmoe_tests --gtest_brief=1 \
  --gtest_filter='*GgufChunks*:*CudaGgufExperts*:*CudaGgufOps*:*CudaGgufModel*' 2>&1)
rc=$?
echo "$T" > $O/gguf-repack-tests.log
# Compactly: the chunk kernels' errors, then every failure / skip with its lines.
echo "$T" | grep -E "^\[cuda-gguf\] experts" | head -12
echo "$T" | grep -E -A4 "FAILED|Failure|SKIPPED|Skipped" | cut -c1-220 | head -30
echo "$T" | grep -E "^\[  (PASSED|FAILED|SKIPPED) " | head -5
if [ $rc -eq 0 ] && echo "$T" | grep -qE "PASSED.* [1-9][0-9]* test" && ! echo "$T" | grep -q "SKIPPED"; then
  echo "PASS: GgufChunks / CudaGgufExperts / CudaGgufOps / CudaGgufModel"
else
  echo "FAIL: GgufChunks / CudaGgufExperts / CudaGgufOps / CudaGgufModel (rc $rc; $O/gguf-repack-tests.log)"
fi
[ -f $F ] || { echo "FAIL: $F missing (the lead's round makes it with bench/gguf_random_35b.py)"; exit 1; }
left() { echo $((BUDGET - SECONDS)); }
tg() {  # tg128 (and pp512) of one layout
  timeout 14 ./build/flashmoe bench -m $F --device cuda -p 512 -n 128 -r 2 --gguf-experts $1 > $O/bench-$1-$2.log 2>&1
  echo "35B $1 (run $2): tg128 $(grep -E "tg128" $O/bench-$1-$2.log | tr -s ' ' | cut -d'|' -f3) pp512 $(grep -E "pp512" $O/bench-$1-$2.log | tr -s ' ' | cut -d'|' -f3) [${SECONDS} s]"
}
echo "== flashmoe bench -m $F --device cuda -p 512 -n 128 -r 2 --gguf-experts chunks|stored, interleaved"
tg chunks 1
tg stored 1
if [ -x $LB ]; then
  echo "== llama-bench -m $F -ngl 99 -p 0 -n 128 -r 2 (same call)"
  timeout 14 $LB -m $F -ngl 99 -p 0 -n 128 -r 2 2>&1 | grep -E "tg128"
fi
if [ $(left) -gt 10 ]; then
  echo "== flashmoe bench -m $F --device cuda -p 0 -n 32 -r 1 --profile 16 (chunks)"
  timeout 10 ./build/flashmoe bench -m $F --device cuda -p 0 -n 32 -r 1 --profile 16 2>&1 | grep -E "^\| (in-proj|out-proj|router|experts|lm_head|total)" 
fi
if [ $(left) -gt 19 ]; then
echo "== greedy ids: flashmoe generate -m $F --device cuda --ids 1,2,3,4 -n 24 --greedy --print-ids --gguf-experts chunks|stored"
for L in chunks stored; do
  timeout 9 ./build/flashmoe generate -m $F --device cuda --ids 1,2,3,4 -n 24 --greedy --print-ids --gguf-experts $L \
    > $O/gen-$L.log 2> $O/gen-$L.err
done
A=$(tail -1 $O/gen-chunks.log); B=$(tail -1 $O/gen-stored.log)
echo "chunks: $A"; echo "stored: $B"
if [ -n "$A" ] && [ "$A" = "$B" ]; then echo "PASS: greedy ids equal (chunks vs stored)"; else echo "FAIL: greedy ids differ (or a run failed: $O/gen-*.err)"; fi
fi
[ $(left) -gt 14 ] && tg chunks 2
echo "done in ${SECONDS} s"
