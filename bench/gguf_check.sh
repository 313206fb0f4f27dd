#!/usr/bin/env bash
# flashmoe on llama.cpp's GGUFs of coder-mini against llama.cpp's own logits
# for them (the fixtures' README says how those were made): one row per file
# with mean / max KL(llama.cpp || flashmoe), max |dlogit|, the median
# per-position max |dlogit| and top-1 agreement over the 256 reference ids,
# then flashmoe's greedy continuation of the first 16 ids against llama.cpp's.
#
#   bench/gguf_check.sh [FIXTURES_DIR]     (default /work/shared/fixtures/gguf)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/work/shared/fixtures/gguf}
BIN=${BIN:-build/flashmoe}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
ids() {  # the I64 tensor $2 of safetensors file $1 as comma-separated ids
  python3 - "$1" "$2" <<'PY'
import json, struct, sys
from array import array
raw = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', raw[:8])[0]; e = json.loads(raw[8:8 + n])[sys.argv[2]]
a = array('q'); a.frombytes(raw[8 + n + e['data_offsets'][0]:8 + n + e['data_offsets'][1]]); print(','.join(map(str, a)))
PY
}
echo "| file | KL mean | KL max | max abs dlogit | p50 per-pos max abs dlogit | top-1 |"
echo "|---|---|---|---|---|---|"
for g in "$DIR"/coder-mini-*.gguf; do
  ref="$g.llama-logits.safetensors"
  [ -f "$ref" ] || continue
  "$BIN" logits -m "$g" --device cpu --ids "$(ids "$ref" ids)" -o "$out/l.safetensors" 2>/dev/null
  python3 bench/gguf_check.py "$ref" "$out/l.safetensors" "$(basename "$g")"
done
echo
for g in "$DIR"/coder-mini-*.gguf; do
  ref="$g.llama-logits.safetensors"
  [ -f "$ref" ] || continue
  want=$(ids "$ref" greedy)
  got=$("$BIN" generate -m "$g" --device cpu --ids "$(ids "$ref" greedy_prompt)" -n 24 --greedy --print-ids 2>/dev/null |
        tail -n1 | tr -s ' ' ',')
  same=$(python3 -c "import sys; a=sys.argv[1].split(','); b=sys.argv[2].split(','); print(sum(x==y for x,y in zip(a,b)))" "$want" "$got")
  echo "$(basename "$g"): greedy 24 tokens, $same/24 equal to llama.cpp's"
done
