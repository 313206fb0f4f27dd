#!/bin/bash
# Issue 20 on the GPU machine: train coder-mini's MTP head (main model
# frozen, <= 3 min), write the golden head logits, print the acceptance on
# held-out code; then, if a flashmoe build is at hand (build/flashmoe, e.g.
# from `bash bench/cuda_device_run.sh build`), speculative against plain
# greedy decoding on its CPU backend at 2 threads.
#
# usage (repository root, on the device): OUT=... bash gpu-tasks/mtp.sh
# Comes back under $OUT:
#   coder-mini-mtp/model/mtp.safetensors   the head: copy to models/coder-mini/model/
#   mtp_reference.safetensors              golden logits: copy to tests/fixtures/mtp/coder-mini-reference.safetensors
#   train_mtp_log.txt, speculative.txt
# Expect: "ce" falling from ~4-5 to ~2.5-3.5; "first-draft greedy acceptance"
# well above 0.3 (a random head: ~0.00); with a build, identical ids with and
# without --mtp for every draft length, and the mtp: stats line.
set -eo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 scripts/train_mtp_head.py models/coder-mini $OUT 150 2>&1 | tee $OUT/train_stdout.txt
B=build/flashmoe
if [ -x $B ]; then
  M=$OUT/coder-mini-mtp
  P=$(python3 -c "
from tokenizers import Tokenizer
t = Tokenizer.from_file('$M/tokenizer.json')
s = open('$M/eval/code_heldout.txt').read()
print(','.join(str(i) for i in t.encode(s[20000:22000]).ids[:200]))")
  {
    $B generate -m $M --device cpu -t 2 --ids $P -n 128 --greedy --stats 2>&1 | tail -4
    for d in 1 2 3 4; do
      echo "--- --mtp --spec-draft $d"
      $B generate -m $M --device cpu -t 2 --ids $P -n 128 --greedy --mtp --spec-draft $d --stats 2>&1 | grep -v "^  "
    done
  } | tee $OUT/speculative.txt
else
  echo "no build/flashmoe: speculative decoding not measured here" | tee $OUT/speculative.txt
fi
