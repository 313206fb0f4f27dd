#!/bin/bash
# Issue 20 on the H200 (branch mtp-cuda), build/ already built (no build
# here); the most important numbers first:
#   1. `bench --mtp` on the 35B synthetic with forced acceptance 0.6/0.8/0.9
#      at N = 1 and 3 (plain and speculative decoding interleaved per
#      repetition, their ratio), then pp2/pp4 beside tg (what a verify pass
#      of 2 or 4 tokens costs against a decode step);
#   2. the CUDA MTP tests (CudaMtp.*: the head's logits against the CPU's and
#      against the torch reference, greedy --mtp = plain for N = 1..4 with
#      full, fp8 and windowed KV, snapshots, the device restore point);
#      the torch reference needs `fixtures: mtp`;
#   3. coder-mini: `bench --mtp`, and `generate --mtp` on code ids (the
#      reference text) against plain: real acceptance, tokens/s, same ids.
# usage (repository root, on the device): bash gpu-tasks/mtp-cuda.sh [r1]
#   r1: the set for a 70 s slot (N = 3 at 0.8 on the 35B, N = 2 on coder-mini).
set -o pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/mtp-cuda; mkdir -p $D
T0=$SECONDS
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe, build/flashmoe_tests"; exit 1; }
B=build/flashmoe
RUNS="3:0.8 1:0.8 3:0.6 3:0.9 1:0.9 2:0.8"; CM="1 2 3"
[ "$1" = r1 ] && RUNS="3:0.8" && CM=2
for r in $RUNS; do
  n=${r%:*}; a=${r#*:}
  timeout 12 $B bench --synthetic qwen3.5-35b-a3b --device cuda -p 0 -n 64 -d 256 -r 2 --mtp --spec-draft $n \
    --mtp-accept $a > $D/bench-35b-$n-$a.txt 2>&1
  echo "--- 35B synthetic bench --mtp --spec-draft $n --mtp-accept $a (rc $?, at $((SECONDS-T0)) s)"
  grep -E "^\| tg|^mtp:|speculative /|rror" $D/bench-35b-$n-$a.txt
done
if [ "$1" != r1 ]; then
  for p in 2 4; do
    timeout 10 $B bench --synthetic qwen3.5-35b-a3b --device cuda -p $p -n 32 -r 5 > $D/pp-35b-$p.txt 2>&1
    echo "--- 35B synthetic pp$p beside tg32 (rc $?)"; grep -E "^\| (pp|tg)" $D/pp-35b-$p.txt
  done
fi
timeout 22 stdbuf -oL ./build/flashmoe_tests --gtest_filter='CudaMtp.*' > $D/tests.log 2>&1
rc=$?
grep -E "^\[cuda-mtp\]|^\[ +(OK|FAILED) +\]|^\[  (PASSED|FAILED)|Failure|Expected|Which is|what\(\)|rror" $D/tests.log | head -50
[ $rc = 0 ] && echo "PASS tests" || echo "FAIL tests (rc $rc)"
echo "== tests at $((SECONDS-T0)) s"
for n in $CM; do
  timeout 8 $B bench -m models/coder-mini --device cuda -p 0 -n 128 -r 2 --mtp --spec-draft $n > $D/bench-cm-$n.txt 2>&1
  echo "--- coder-mini bench --mtp --spec-draft $n (rc $?)"; grep -E "^\| tg|^mtp:|speculative /|rror" $D/bench-cm-$n.txt
done
# 200 ids of the reference text (code) as the prompt.
P=$(python3 -c "
import json,struct,array
f=open('models/coder-mini/reference.safetensors','rb'); n=struct.unpack('<Q',f.read(8))[0]; h=json.loads(f.read(n)); t=h['ids']
f.seek(8+n+t['data_offsets'][0]); b=f.read(t['data_offsets'][1]-t['data_offsets'][0]); a=array.array('q'); a.frombytes(b)
print(','.join(str(x) for x in a[:200]))" 2>/dev/null)
for a in "" "--mtp --spec-draft 2" "--mtp --spec-draft 1" "--mtp --spec-draft 3"; do
  [ "$1" = r1 ] && [ "$a" = "--mtp --spec-draft 1" ] && break
  timeout 5 $B generate -m models/coder-mini --device cuda --ids $P -n 128 --greedy --stats $a > $D/gen.txt 2>&1
  echo "--- coder-mini generate --device cuda $a: rc $? ids $(head -1 $D/gen.txt | md5sum | cut -c1-8)"
  grep -E "^decode: [0-9]|^mtp:" $D/gen.txt
done
echo "== done at $((SECONDS-T0)) s"
