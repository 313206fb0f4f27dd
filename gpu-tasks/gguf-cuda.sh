#!/usr/bin/env bash
# Branch gguf-cuda on an H200: GGUF block types run on CUDA as stored.
#   1. build flashmoe + flashmoe_tests
#   2. the CUDA GGUF tests: every block kind's matvec and prefill product
#      against the CPU's block kernels; the tiny GGUF fixtures' logits on the
#      GPU against the CPU (prefill, decode, greedy on the device)
#   3. per GGUF in tests/fixtures/gguf and gpu-gguf/ (coder-mini Q8_0 and
#      Q4_K_M, carried): `flashmoe logits` on cuda vs cpu, one PASS/FAIL line
#      each (tiny fixtures: max |dlogit| <= 1e-3; coder-mini: mean KL <= 1e-4)
#   4. flashmoe bench -p 512 -n 128 on the coder-mini GGUFs, --device cuda
#
#   bash gpu-tasks/gguf-cuda.sh
# Expected: "PASS" on every line of 2 and 3; step 4 prints pp512 / tg128.
set -uo pipefail
cd "$(dirname "$0")/.."
B=build
echo "== 1. build"
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release ${CMAKE_EXTRA:-} >/dev/null &&
  cmake --build $B -j 6 --target flashmoe flashmoe_tests 2>&1 | grep -E "error|warning: unused" | head -30
[ -x $B/flashmoe ] && [ -x $B/flashmoe_tests ] || { echo "FAIL build"; exit 1; }
echo "== 2. CUDA GGUF tests"
$B/flashmoe_tests --gtest_filter='*CudaGguf*:GgufDevice.*:*DeviceReader*' 2>&1 |
  grep -E "^\[cuda-gguf\]|OK \]|FAILED|Failure|error|Expected|Which is|actual|dlogit" | head -80
echo "== 3. flashmoe logits, cuda vs cpu"
out=$(mktemp -d)
ids() {  # the I64 tensor $2 of safetensors file $1 as comma-separated ids
  python3 - "$1" "$2" <<'PY'
import json, struct, sys
from array import array
raw = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', raw[:8])[0]; e = json.loads(raw[8:8 + n])[sys.argv[2]]
a = array('q'); a.frombytes(raw[8 + n + e['data_offsets'][0]:8 + n + e['data_offsets'][1]]); print(','.join(map(str, a)))
PY
}
for g in tests/fixtures/gguf/tiny-*.gguf gpu-gguf/*.gguf; do
  [ -f "$g" ] || continue
  if [ -f "$g.llama-logits-deq-f32.safetensors" ]; then I=$(ids "$g.llama-logits-deq-f32.safetensors" ids)
  elif [ -f "$g.llama-logits.safetensors" ]; then I=$(ids "$g.llama-logits.safetensors" ids)
  else I=$(ids models/coder-mini/reference.safetensors ids); fi
  t0=$(date +%s.%N)
  $B/flashmoe logits -m "$g" --device cpu --ids "$I" -o $out/cpu.safetensors 2>$out/cpu.err || { echo "FAIL $g cpu: $(tail -1 $out/cpu.err)"; continue; }
  $B/flashmoe logits -m "$g" --device cuda --ids "$I" -o $out/cuda.safetensors 2>$out/cuda.err || { echo "FAIL $g cuda: $(tail -1 $out/cuda.err)"; continue; }
  python3 - "$g" $out/cpu.safetensors $out/cuda.safetensors <<'PY'
import json, struct, sys
import numpy as np
def load(p):
    raw = open(p, 'rb').read(); n = struct.unpack('<Q', raw[:8])[0]; h = json.loads(raw[8:8 + n])['logits']
    a, b = h['data_offsets']; return np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32).reshape(h['shape']).astype(np.float64)
name, c, g = sys.argv[1], load(sys.argv[2]), load(sys.argv[3])
def lsm(x): x = x - x.max(1, keepdims=True); return x - np.log(np.exp(x).sum(1, keepdims=True))
lc, lg = lsm(c), lsm(g)
kl = (np.exp(lc) * (lc - lg)).sum(1)
mad = np.abs(c - g).max(); top1 = (c.argmax(1) == g.argmax(1)).mean()
ok = mad <= 1e-3 if 'tiny-' in name else kl.mean() <= 1e-4
print(f"{'PASS' if ok else 'FAIL'} {name}: cuda vs cpu over {c.shape[0]} positions: max |dlogit| {mad:.3g}, mean KL {kl.mean():.3g}, max KL {kl.max():.3g}, top-1 {top1:.3f}")
PY
done
echo "== 3b. greedy ids, cuda vs cpu (24 tokens after the first 16 reference ids)"
P=$(ids models/coder-mini/reference.safetensors ids | cut -d, -f1-16)
for g in gpu-gguf/*.gguf; do
  [ -f "$g" ] || continue
  a=$($B/flashmoe generate -m "$g" --device cpu --ids "$P" -n 24 --greedy --print-ids 2>/dev/null | tail -n1)
  b=$($B/flashmoe generate -m "$g" --device cuda --ids "$P" -n 24 --greedy --print-ids 2>/dev/null | tail -n1)
  if [ -n "$a" ] && [ "$a" = "$b" ]; then echo "PASS $g greedy: cuda = cpu ($b)"; else echo "FAIL $g greedy: cpu [$a] cuda [$b]"; fi
done
rm -rf $out
echo "== 4. bench (cuda); the safetensors coder-mini (bf16) first, as the in-run reference"
$B/flashmoe bench -m models/coder-mini/model --device cuda -p 512 -n 128 2>&1 | grep -E "pp512|tg128"
for g in gpu-gguf/*.gguf; do
  [ -f "$g" ] || continue
  echo "-- $g"
  $B/flashmoe bench -m "$g" --device cuda -p 512 -n 128 2>&1 | grep -E "pp512|tg128|decode reads"
done
