#!/bin/bash
# Side-by-side decode runs in one device call (bench/NOTES-cuda.md): builds
# of two commits, or bench options, interleaved as listed.
# usage: bench/cuda_ab.sh [-a "bench args"] "name:BINARY [extra bench args]" ...
#   each spec runs `BINARY bench --device cuda <bench args> <extra>` and
#   prints one line: name | tg128 tokens/s | seconds the run took.
#   default bench args: --synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 2
#   e.g. bench/cuda_ab.sh "base:./base/flashmoe" "new:./build/flashmoe" "base:./base/flashmoe" "new:./build/flashmoe"
# (The decode variants once switched by FLASHMOE_CUDA_* variables were
# removed with the variables; the measurements that chose them are in
# bench/NOTES-cuda.md.)
set -o pipefail
args="--synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 2"
if [ "$1" = "-a" ]; then args=$2; shift 2; fi
for spec in "$@"; do
  name=${spec%%:*}
  run=${spec#*:}
  bin=${run%% *}
  extra=""
  [ "$run" != "$bin" ] && extra=${run#* }
  t0=$SECONDS
  line=$($bin bench --device cuda $args $extra 2>&1 | grep -E "^\| tg|error" | tail -1)
  printf '%-28s %s  (%ds)\n' "$name" "$line" $((SECONDS - t0))
done
