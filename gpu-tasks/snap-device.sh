#!/bin/bash
# Branch snap-device on the H200 (conversation snapshots kept in VRAM),
# build/ already built (bench/cuda_device_run.sh build), within ~8 minutes:
#   0. the device tests of what changed: a VRAM snapshot restores bit for
#      bit (against the plain continuation and a host snapshot, every KV
#      format), the VRAM budget moves the least recently used to host
#      memory, the existing snapshot tests (h2o/tova and snapkv cuts, quest
#      bounds, the MTP head) and the GPU server's answers against the CPU
#      server's; CudaMtp.RestorePoint* prints host snapshot / VRAM snapshot /
#      restore point costs;
#   1. gpu-tasks/serve-speed.sh N: the 35B synthetic server with the default
#      state cache against --state-cache 0 at 1, 8 and 32 streaming clients,
#      and bench --batch. Criterion: the default cache within a few % of
#      --state-cache 0 (before: 310/512/779 against 359/788/1,332 tokens/s).
# usage (repository root, on the device): bash gpu-tasks/snap-device.sh [N]
set -o pipefail
N=${1:-160}
OUT=${OUT:-/tmp/out}; D=$OUT/snap-device; mkdir -p $D
test -x build/flashmoe_tests || { echo "FAIL no build/flashmoe_tests"; exit 1; }
timeout 240 ./build/flashmoe_tests \
  --gtest_filter='CudaCoderMini.Snapshot*:CudaKvPolicies*:CudaMtp.*Snapshot*:CudaMtp.RestorePoint*:CudaServe.*' \
  > $D/tests.log 2>&1
echo "[tests] rc $?: $(grep -E '^\[  (PASSED|FAILED) |^\[  FAILED  \] [A-Z]' $D/tests.log | tr '\n' ' ')"
grep -E '^\[cuda-mtp\]' $D/tests.log
OUT=$OUT bash gpu-tasks/serve-speed.sh "$N"
