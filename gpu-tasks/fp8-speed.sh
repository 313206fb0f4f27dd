#!/bin/bash
# Issue 23, FP8 decode speed on the H200 (flashmoe and flashmoe_tests
# already built in build/; this script builds nothing):
#  1. the FP8 CUDA tests (op checks against the CPU's FP8 rows, FP8
#     checkpoints against the CPU), with their max differences;
#  2. with `hf` as first argument: the FP8 checkpoints against HF
#     (bash gpu-tasks/hf-reference.sh fp8, ~60 s);
#  3. the 35B synthetic, fp8 / bf16 / q4 interleaved (tg128 + pp512, -r 2),
#     `--profile 16` of the fp8 and bf16 decode, and the ratios.
# usage (repository root, on the device): bash gpu-tasks/fp8-speed.sh [hf] [budget seconds]
# Parts are skipped once the budget (default 135 s) would be overrun.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/fp8-speed"; exec > >(tee "$OUT/fp8-speed/log.txt") 2>&1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HF=0; [ "${1:-}" = hf ] && { HF=1; shift; }
BUDGET=${1:-135}
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/flashmoe or build/flashmoe_tests missing"; exit 1; }

./build/flashmoe_tests --gtest_brief=1 \
  --gtest_filter='CudaOps.Fp8*:CudaOps.QuantExpertsMatchCpu:*CudaFp8.*' \
  2>&1 | grep -E "^\[cuda-fp8|^\[cuda-packed\]|^\[fp8-op|FAILED|Failure|Expected|Which is|actual|PASSED|error" | head -60
echo "CUDA tests done at $(el) s"

if [ $HF = 1 ]; then
  bash gpu-tasks/hf-reference.sh fp8 2>&1 | grep -E "PASS|FAIL|done"
  echo "HF check done at $(el) s"
fi

declare -A TG PP
bench_one() {  # weights kind, round
  local w=$1 round=$2 a o tg pp
  case $w in fp8) a="--weights fp8";; bf16) a="";; q4) a="--experts q4";; esac
  o=$(./build/flashmoe bench --synthetic qwen3.5-35b-a3b $a -p 512 -n 128 -r 2 --device cuda 2>&1)
  tg=$(echo "$o" | awk -F'|' '/\| tg128 /{gsub(/ /,"",$3); split($3,v,"±"); print v[1]}')
  pp=$(echo "$o" | awk -F'|' '/\| pp512 /{gsub(/ /,"",$3); split($3,v,"±"); print v[1]}')
  echo "bench round $round $w: tg128 ${tg:-?} t/s, pp512 ${pp:-?} t/s ($(el) s)"
  echo "$o" | grep -E "decode reads" | sed 's/^/   /'
  [ -z "$tg" ] && echo "$o" | tail -5
  TG[$w]="${TG[$w]:-} $tg"; PP[$w]="${PP[$w]:-} $pp"
}
profile() {  # weights kind
  local a=""; [ $1 = fp8 ] && a="--weights fp8"
  echo "profile $1 (ms per token by kernel class, 16 decode steps):"
  ./build/flashmoe bench --synthetic qwen3.5-35b-a3b $a -p 0 -n 16 -r 1 --profile 16 --device cuda 2>&1 |
    grep -E "^\| " | grep -v "tg16\|test" | sed 's/^/   /'
  echo "profile $1 done at $(el) s"
}
for w in fp8 bf16 q4; do bench_one $w 1; done
[ "$(el)" -lt $((BUDGET - 15)) ] && profile fp8
[ "$(el)" -lt $((BUDGET - 15)) ] && profile bf16
if [ "$(el)" -lt $((BUDGET - 45)) ]; then for w in fp8 bf16 q4; do bench_one $w 2; done; else echo "bench round 2: skipped (time, $(el) s)"; fi
python3 - "${TG[fp8]:-}" "${TG[bf16]:-}" "${TG[q4]:-}" "${PP[fp8]:-}" "${PP[bf16]:-}" "${PP[q4]:-}" <<'PY'
import sys
def mean(s):
    v = [float(x) for x in s.split() if x not in ("", "?")]
    return sum(v) / len(v) if v else float("nan")
tf, tb, tq, pf, pb, pq = map(mean, sys.argv[1:7])
print("35B synthetic (mean of the rounds): tg128 fp8 %.1f, bf16 %.1f, q4 %.1f t/s; pp512 fp8 %.0f, bf16 %.0f, q4 %.0f t/s" % (tf, tb, tq, pf, pb, pq))
print("tg128 fp8/bf16 %.2fx (target >= 1.7x) -> %s; fp8/q4 %.2fx; pp512 fp8/bf16 %.2fx"
      % (tf / tb, "PASS" if tf / tb >= 1.7 else "FAIL", tf / tq, pf / pb))
PY
echo "all done at $(el) s"
