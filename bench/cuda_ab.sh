#!/bin/bash
# Side-by-side decode variants in one device call (bench/NOTES-cuda.md).
# usage: bench/cuda_ab.sh [-a "bench args"] "name:VAR=value VAR=value" ...
#   each spec runs `flashmoe bench --device cuda` with those FLASHMOE_CUDA_*
#   variables (documented in src/backend/cuda/cuda_model.cu) and prints one
#   line: name | tg128 tokens/s | seconds the run took.
#   default bench args: --synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 2
set -o pipefail
B=${FLASHMOE:-./build/flashmoe}
args="--synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 2"
if [ "$1" = "-a" ]; then args=$2; shift 2; fi
for spec in "$@"; do
  name=${spec%%:*}
  vars=${spec#*:}
  t0=$SECONDS
  line=$(env $vars $B bench --device cuda $args 2>&1 | grep -E "^\| tg|error" | tail -1)
  printf '%-28s %s  (%ds)\n' "$name" "$line" $((SECONDS - t0))
done
