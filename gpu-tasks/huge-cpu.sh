#!/bin/bash
# --moe-top-k (issue 22, branch huge-cpu) on the H200, about 3 minutes:
#   1. build flashmoe + flashmoe_tests,
#   2. HF transformers with num_experts_per_tok lowered to K (the independent
#      reference) against `flashmoe logits --moe-top-k K`, CPU and CUDA, on
#      coder-mini (own K 4, and K = 2, 1) and tiny-qwen35moe (K = 2):
#      expected PASS, max |dlogit| <= 1e-3 on the CPU, <= 2e-3 on CUDA, and
#      the change from K = 4 to K the same in both within 1e-3. Rounds 1-2:
#      FAIL at 5.5e-3 / 8e-3 for K = 2 / 1 because this HF set-up already
#      differs from flashmoe by 8.4e-3 at the model's own K = 4 (unexplained;
#      the committed coder-mini reference matches flashmoe to 1e-3);
#   3. CudaMoeTopK.* (the CUDA routers at K < config vs the CPU, bf16 and q4
#      experts) and MoeTopK.*: expected all OK;
#   4. the 397B synthetic, q4 experts, 15 layers, tg32 at K = 10 and 4 (info).
# usage (repository root): bash gpu-tasks/huge-cpu.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/huge-cpu
T0=$SECONDS
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release $CMAKE_EXTRA > $OUT/huge-cpu/build.log 2>&1 &&
  cmake --build build -j 6 --target flashmoe flashmoe_tests >> $OUT/huge-cpu/build.log 2>&1 ||
  { tail -40 $OUT/huge-cpu/build.log; echo "FAIL build"; exit 1; }
echo "== build ok at $((SECONDS-T0)) s"

IDS=$(python3 -c "from safetensors.numpy import load_file; print(','.join(str(int(i)) for i in load_file('models/coder-mini/reference.safetensors')['ids'][:48]))")
compare() {  # HF.safetensors FLASHMOE.safetensors TOL LABEL
  python3 - "$@" <<'PY'
import sys
from safetensors.numpy import load_file
import numpy as np
a, b = load_file(sys.argv[1])["logits"], load_file(sys.argv[2])["logits"]
tol, label = float(sys.argv[3]), sys.argv[4]
d = float(np.abs(a.astype(np.float64) - b).max()) if a.shape == b.shape else float("inf")
print(f"{'PASS' if d <= tol else 'FAIL'} {label}: max |dlogit| vs HF {d:.3g} (tol {tol:g}, shape {a.shape} vs {b.shape})")
PY
}
for case in "models/coder-mini/model 4" "models/coder-mini/model 2" "models/coder-mini/model 1" "tests/fixtures/tiny-qwen35moe/model 2"; do
  set -- $case; M=$1; K=$2; N=$(echo $M | tr / _)
  [ -d "$M" ] || { echo "SKIP $M: not in the tree"; continue; }
  ids=$IDS; [ "$M" != models/coder-mini/model ] && ids=$(echo $IDS | tr ',' '\n' | awk '{print $1 % 512}' | paste -sd,)
  python3 scripts/fixtures/top_k_reference.py $M $K $ids $OUT/huge-cpu/hf_${N}_k$K.safetensors 2>&1 | tail -3
  for dev in cpu cuda; do
    tol=1e-3; [ $dev = cuda ] && tol=2e-3
    ./build/flashmoe logits -m $M --device $dev --moe-top-k $K --ids $ids -o $OUT/huge-cpu/fm_${N}_k${K}_$dev.safetensors 2>&1 | tail -2
    compare $OUT/huge-cpu/hf_${N}_k$K.safetensors $OUT/huge-cpu/fm_${N}_k${K}_$dev.safetensors $tol "$M --moe-top-k $K --device $dev"
  done
done
# The reference itself must differ from the model at its own K (else the
# comparison proves nothing), and what lowering K changes must be the same in
# both: (HF K - HF 4) against (flashmoe K - flashmoe 4).
for K in 2 1; do
  python3 - $OUT/huge-cpu/hf_models_coder-mini_model_k4.safetensors $OUT/huge-cpu/hf_models_coder-mini_model_k$K.safetensors \
      $OUT/huge-cpu/fm_models_coder-mini_model_k4_cpu.safetensors $OUT/huge-cpu/fm_models_coder-mini_model_k${K}_cpu.safetensors $K <<'PY'
import sys
from safetensors.numpy import load_file
import numpy as np
ho, hk, fo, fk = (load_file(p)["logits"].astype(np.float64) for p in sys.argv[1:5])
m = float(np.abs(hk - ho).max()); d = float(np.abs((fk - fo) - (hk - ho)).max())
print(f"{'PASS' if m > 1e-2 else 'FAIL'} HF K=4 vs HF K={sys.argv[5]} differ: max |dlogit| {m:.3g}")
print(f"{'PASS' if d <= 1e-3 else 'FAIL'} the change K=4 -> {sys.argv[5]}: flashmoe's minus HF's, max {d:.3g} (tol 1e-3)")
PY
done
echo "== HF comparisons done at $((SECONDS-T0)) s"
timeout 120 ./build/flashmoe_tests --gtest_filter='CudaMoeTopK.*:MoeTopK.*' > $OUT/huge-cpu/tests.log 2>&1
echo "== tests rc $? at $((SECONDS-T0)) s"
grep -E "^\[cuda-moe-top-k\]|^\[  (PASSED|FAILED)|FAILED  \]|Failure|tests ran" $OUT/huge-cpu/tests.log | head -30
for K in 10 4; do
  timeout 60 ./build/flashmoe bench --device cuda --synthetic qwen3.5-397b-a17b --layers 15 --experts q4 -p 0 -n 32 -r 1 --moe-top-k $K 2>&1 | tail -4
done
echo "== done at $((SECONDS-T0)) s"
