#!/usr/bin/env bash
# Engine speed on the embedded model at 1 and 2 threads, side by side in one
# run: prompt processing (pp), generation (tg), weight bytes read per decoded
# token and the bandwidth that implies next to a plain memcpy.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/flashmoe}
MODEL=${MODEL:-models/coder-mini/model}
for t in 1 2; do
  "$BIN" bench -m "$MODEL" -t "$t" -p 512 -n 128 -r 3
  echo
done
