#!/bin/bash
# Issue 23, FP8 decode speed on the H200 (session 8, round 2; flashmoe and
# flashmoe_tests already built in build/; this script builds nothing):
#  1. the FP8 CUDA tests: op checks against the CPU's FP8 rows (the staged
#     kernels, fp8_staged.cuh), the tiny FP8 checkpoints against the CPU
#     (prefill, and decode token by token);
#  2. the 35B synthetic: fp8, bf16, q4 (tg128 + pp512, -r 1) and the ratios;
#  3. with `ncu`: Nsight Compute on one launch of each FP8 decode kernel
#     and of the bf16 in-proj and gate_up (duration, DRAM throughput,
#     occupancy, stalls);
#  4. `--profile 16` of fp8 where the budget leaves time.
# Each part runs only while the budget (default 38 s) leaves it time.
# usage (repository root, on the device): bash gpu-tasks/fp8-speed.sh [ncu] [budget seconds]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/fp8-speed"; exec > >(tee "$OUT/fp8-speed/log.txt") 2>&1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
NCU=0; [ "${1:-}" = ncu ] && { NCU=1; shift; }
BUDGET=${1:-38}
left() { echo $(( BUDGET - $(el) )); }
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/flashmoe or build/flashmoe_tests missing"; exit 1; }

timeout 15 ./build/flashmoe_tests --gtest_brief=1 \
  --gtest_filter='CudaOps.Fp8*:*CudaFp8.*/tiny*' 2>&1 |
  grep -E "^\[cuda-fp8\].*(max|bytes)|FAILED|Failure|Expected|Which is|actual|PASSED|error|tests ran" | head -40
echo "CUDA tests done at $(el) s"

SYN="--synthetic qwen3.5-35b-a3b"
num() { awk -F'|' -v t="$1" '$2 ~ "^ *"t" *$" {gsub(/ /,"",$3); split($3,v,"±"); print v[1]}'; }
bench_one() {  # label, args
  local label=$1; shift
  local o; o=$(timeout 15 ./build/flashmoe bench $SYN "$@" -p 512 -n 128 -r 1 --device cuda 2>&1)
  echo "$o" > "$OUT/fp8-speed/bench-$label.txt"
  local tg pp; tg=$(echo "$o" | num tg128); pp=$(echo "$o" | num pp512)
  echo "bench $label: tg128 ${tg:-?} t/s, pp512 ${pp:-?} t/s ($(el) s)"
  echo "$o" | grep -E "decode reads" | sed 's/^/   /'
  [ -z "$tg" ] && echo "$o" | tail -3
  eval "TG_$label=\${tg:-nan}; PP_$label=\${pp:-nan}"
}
TG_fp8=nan; PP_fp8=nan; TG_bf16=nan; PP_bf16=nan; TG_q4=nan
bench_one fp8 --weights fp8
[ "$(left)" -gt 8 ] && bench_one bf16
[ "$(left)" -gt 8 ] && bench_one q4 --experts q4
python3 - "$TG_fp8" "$TG_bf16" "$TG_q4" "$PP_fp8" "$PP_bf16" <<'PY'
import sys
tf, tb, tq, pf, pb = (float(x) if x not in ("", "?") else float("nan") for x in sys.argv[1:6])
print("35B synthetic tg128: fp8 %.1f, bf16 %.1f, q4 %.1f t/s; fp8/bf16 %.2fx (target >= 1.7x), fp8/q4 %.2fx; "
      "pp512 fp8 %.0f, bf16 %.0f (%.2fx)" % (tf, tb, tq, tf / tb, tf / tq, pf, pb, pf / pb))
PY

ncu_one() {  # label, kernel regex, launches, args
  local label=$1 re=$2 n=$3; shift 3
  echo "ncu $label ($(el) s):"
  timeout $(( $(left) - 2 < 14 ? $(left) - 2 : 14 )) ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum' \
    -k "regex:$re" -c "$n" ./build/flashmoe bench $SYN "$@" -p 0 -n 2 -r 1 --device cuda > "$OUT/fp8-speed/ncu-$label.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Dynamic Shared|Warp Cycles Per Issued|dram__bytes_read|stalled_" "$OUT/fp8-speed/ncu-$label.txt" |
    awk '/stalled_/ { v = $NF + 0; if (v < 0.5) next } { print "   " $0 }' | sed 's/smsp__average_warps_issue_stalled_/stall /; s/_per_issue_active.ratio//; s/(const .*) (/(/; s/(unsigned char const.*) (/(/' | head -70
}
if [ $NCU = 1 ]; then
  command -v ncu >/dev/null || echo "ncu: not found"
  [ "$(left)" -gt 10 ] && ncu_one fp8 '^(matvec_fp8|outproj_router_fp8|gate_up_fp8|down_fp8)' 4 --weights fp8
  [ "$(left)" -gt 8 ] && ncu_one bf16 '^(matvec_kernel|gate_up_kernel)' 2
fi
if [ "$(left)" -gt 6 ]; then
  echo "profile fp8 (ms per token by kernel class, 16 decode steps; plain launches):"
  timeout $(( $(left) - 1 )) ./build/flashmoe bench $SYN --weights fp8 -p 0 -n 16 -r 1 --profile 16 --device cuda 2>&1 |
    grep -E "^\| " | grep -v "tg16\|test\|---\|kernel class" | awk -F'|' '{printf "  %s:%s", $2, $3} END {print ""}'
fi
echo "all done at $(el) s"
