#!/usr/bin/env bash
# Branch gguf on an H200: GGUF models are CPU-only for now. Checks that
# --device cuda refuses a GGUF with block-quantised weights (WeightType
# obstacle naming the type) and that --device auto falls back to the CPU with
# one note, and that the CUDA test suite still passes (the Matrix type
# gained the GGUF block kinds).
#
#   gpu-tasks/gguf.sh [BUILD_DIR]      (default build)
#
# Expected:
#   1. exit 1 and one error line naming "weights stored as GGUF Q8_0" (the
#      embedding, the first block-quantised matrix the check meets, is Q8_0)
#   2. exit 0, 4 ids printed, and a note on stderr that the run went to the CPU
#   3. BF16 GGUF (qwen35, tiled value heads): refused on cuda with "value heads in
#      llama.cpp's tiled order"
#   4. ctest -R 'cuda|Cuda|Gpu|gpu': all pass
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-build}
F=tests/fixtures/gguf
echo "== 1. --device cuda on a Q4_K_M GGUF"
"$B/flashmoe" generate -m $F/tiny-qwen35moe-text-q4_k_m.gguf --device cuda --ids 1,2,3 -n 4 --greedy --print-ids; echo "exit $?"
echo "== 2. --device auto on the same file"
"$B/flashmoe" generate -m $F/tiny-qwen35moe-text-q4_k_m.gguf --ids 1,2,3 -n 4 --greedy --print-ids; echo "exit $?"
echo "== 3. --device cuda on a BF16 GGUF"
"$B/flashmoe" generate -m $F/tiny-qwen35-dense-bf16.gguf --device cuda --ids 1,2,3 -n 4 --greedy --print-ids; echo "exit $?"
echo "== 4. CUDA tests"
(cd "$B" && ctest --output-on-failure -R 'cuda|Cuda|Gpu|gpu|Device|device')
