#!/bin/bash
# Issue 23, FP8 decode speed on the H200 (session 8; flashmoe and
# flashmoe_tests already built in build/; this script builds nothing):
#  1. the FP8 CUDA tests: op checks against the CPU's FP8 rows with both
#     streaming policies (fp8_staged.cuh), the tiny FP8 checkpoints against
#     the CPU (prefill, and decode token by token with both policies);
#  2. the 35B synthetic: fp8 with both policies in one process
#     (`--fp8-decode staged,regs`), then bf16 and q4 (tg128 + pp512, -r 2),
#     and the ratios;
#  3. `--profile 16` (ms per token by kernel class) of fp8 staged, fp8 regs
#     and bf16;
#  4. with `ncu`: Nsight Compute on one launch of each staged FP8 decode
#     kernel (duration, DRAM throughput, occupancy, stalls);
#  5. with `hf`: the FP8 checkpoints against HF (hf-reference.sh fp8, ~20 s
#     a fixture; fixture names limit it to those).
# Each part runs only while the budget (default 58 s) leaves it time.
# usage (repository root, on the device):
#   bash gpu-tasks/fp8-speed.sh [ncu] [hf] [FIXTURE...] [budget seconds]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/fp8-speed"; exec > >(tee "$OUT/fp8-speed/log.txt") 2>&1
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HF=0; NCU=0; HF_FIXTURES=""
while [ $# -gt 0 ]; do
  case $1 in hf) HF=1;; ncu) NCU=1;; coder-mini|tiny-qwen35moe|tiny-qwen3next) HF_FIXTURES+="$1 ";; *) break;; esac
  shift
done
BUDGET=${1:-58}
left() { echo $(( BUDGET - $(el) )); }
test -x build/flashmoe && test -x build/flashmoe_tests || { echo "FAIL: build/flashmoe or build/flashmoe_tests missing"; exit 1; }

timeout 25 ./build/flashmoe_tests --gtest_brief=1 \
  --gtest_filter='CudaOps.Fp8*:*CudaFp8.*/tiny*' 2>&1 |
  grep -E "^\[cuda-fp8\].*(max|bytes)|FAILED|Failure|Expected|Which is|actual|PASSED|error|tests ran" | head -40
echo "CUDA tests done at $(el) s"

SYN="--synthetic qwen3.5-35b-a3b"
num() { awk -F'|' -v t="$1" '$2 ~ "^ *"t" *$" {gsub(/ /,"",$3); split($3,v,"±"); print v[1]}'; }
o=$(timeout 30 ./build/flashmoe bench $SYN --weights fp8 --fp8-decode staged,regs -p 512 -n 128 -r 2 --device cuda 2>&1)
echo "$o" > "$OUT/fp8-speed/bench-fp8.txt"
TS=$(echo "$o" | num tg128 | sed -n 1p); TR=$(echo "$o" | num tg128 | sed -n 2p); PF=$(echo "$o" | num pp512)
echo "bench fp8: tg128 staged ${TS:-?} / regs ${TR:-?} t/s, pp512 ${PF:-?} t/s ($(el) s)"
echo "$o" | grep -E "decode reads" | sed 's/^/   /'
[ -z "$TS" ] && echo "$o" | tail -4
bench_one() {  # label, args
  local label=$1; shift
  local o; o=$(timeout 15 ./build/flashmoe bench $SYN "$@" -p 512 -n 128 -r 2 --device cuda 2>&1)
  local tg pp; tg=$(echo "$o" | num tg128); pp=$(echo "$o" | num pp512)
  echo "bench $label: tg128 ${tg:-?} t/s, pp512 ${pp:-?} t/s ($(el) s)"
  [ -z "$tg" ] && echo "$o" | tail -3
  eval "TG_$label=\${tg:-nan}; PP_$label=\${pp:-nan}"
}
TG_bf16=nan; PP_bf16=nan; TG_q4=nan
[ "$(left)" -gt 10 ] && bench_one bf16
[ "$(left)" -gt 10 ] && bench_one q4 --experts q4
python3 - "${TS:-nan}" "${TR:-nan}" "$TG_bf16" "$TG_q4" "${PF:-nan}" "$PP_bf16" <<'PY'
import sys
ts, tr, tb, tq, pf, pb = (float(x) if x not in ("", "?") else float("nan") for x in sys.argv[1:7])
print("35B synthetic tg128: fp8 staged %.1f, fp8 regs %.1f, bf16 %.1f, q4 %.1f t/s; staged/bf16 %.2fx (target >= 1.7x), "
      "regs/bf16 %.2fx, staged/regs %.2fx; pp512 fp8 %.0f, bf16 %.0f (%.2fx)"
      % (ts, tr, tb, tq, ts / tb, tr / tb, ts / tr, pf, pb, pf / pb))
PY

profile() {  # label, args
  local label=$1; shift
  echo "profile $label (ms per token by kernel class, 16 decode steps; plain launches):"
  timeout 15 ./build/flashmoe bench $SYN "$@" -p 0 -n 16 -r 1 --profile 16 --device cuda 2>&1 |
    grep -E "^\| " | grep -v "tg16\|test\|---\|kernel class" | awk -F'|' '{printf "  %s:%s", $2, $3} END {print ""}'
}
[ "$(left)" -gt 8 ] && profile "fp8 staged" --weights fp8 --fp8-decode staged
[ "$(left)" -gt 8 ] && profile "fp8 regs" --weights fp8 --fp8-decode regs
[ "$(left)" -gt 8 ] && profile bf16

if [ $NCU = 1 ] && [ "$(left)" -gt 15 ]; then
  command -v ncu >/dev/null || echo "ncu: not found"
  echo "ncu fp8 staged ($(el) s):"
  timeout $(( $(left) - 3 < 25 ? $(left) - 3 : 25 )) ncu --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum' \
    -k "regex:^(matvec_fp8|outproj_router_fp8|gate_up_fp8|down_fp8)" -c 4 ./build/flashmoe bench $SYN --weights fp8 \
    --fp8-decode staged -p 0 -n 2 -r 1 --device cuda 2>&1 |
    grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per Thread|Grid Size|Block Size|Dynamic Shared|Warp Cycles Per Issued|dram__bytes_read|stalled_" |
    awk '/stalled_/ { v = $NF + 0; if (v < 0.5) next } { print "   " $0 }' | sed 's/smsp__average_warps_issue_stalled_/stall /; s/_per_issue_active.ratio//; s/(const .*) (/(/' | head -70
fi

if [ $HF = 1 ]; then  # ~20 s a fixture
  if [ "$(left)" -gt 20 ]; then
    timeout $(( $(left) - 2 )) bash gpu-tasks/hf-reference.sh fp8 $HF_FIXTURES 2>&1 | grep -E "PASS|FAIL"
    echo "HF check done at $(el) s"
  else echo "HF check: skipped (time, $(el) s)"; fi
fi
echo "all done at $(el) s"
