#!/bin/bash
# Issue 23 on the GPU machine (python3 there has torch + transformers): the
# FP8 fixtures with HF's reference logits, flashmoe's CPU logits against them,
# KL against the bf16 model, and what the CUDA backend does with an FP8 model.
# usage (repository root, on the device): bash gpu-tasks/fp8-mlx.sh   (~2-3 min: mostly the build)
# Logs to ${OUT:-/tmp/out}/fp8-mlx.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG="$OUT/fp8-mlx.txt"; exec > >(tee "$LOG") 2>&1
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build -j 16 --target flashmoe flashmoe_tests >/dev/null || { echo BUILD FAILED; exit 1; }
for fx in tiny-qwen35moe tiny-qwen3next coder-mini; do
  d=/tmp/fp8/$fx
  src=tests/fixtures/$fx; [ $fx = coder-mini ] && src=models/coder-mini
  rm -rf "$d"
  python3 scripts/fixtures/make_fp8_fixtures.py $src/model "$d" \
    --hf-reference $src/reference.safetensors || { echo "$fx: fixture FAILED"; continue; }
  ids=$(python3 -c "import sys; sys.path.insert(0,'scripts/fixtures'); import safetensors_np as s; print(','.join(map(str, s.read('$d/fp8/reference.safetensors')['ids_long'][1])))")
  ./build/flashmoe logits -m "$d/fp8" --device cpu --ids "$ids" -o "$d/cpu.safetensors" || echo "$fx: cpu logits FAILED"
  ./build/flashmoe logits -m "$d/fp8" --device cuda --ids "$ids" -o "$d/cuda.safetensors" 2>&1 | tail -1
  python3 - "$d" "$fx" "$src" <<'PY'
import sys, numpy as np
sys.path.insert(0, "scripts/fixtures")
import safetensors_np as s
d, fx, src = sys.argv[1:4]
hf = s.read(d + "/fp8/reference.safetensors")["logits_long"][1]
r = s.read(src + "/reference.safetensors")
bf16 = (r["logits_long"] if "logits_long" in r else r["logits"])[1][: hf.shape[0]]
def kl(p_logits, q_logits):
    p = np.exp(p_logits - p_logits.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    lq = q_logits - q_logits.max(-1, keepdims=True); lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    lp = np.log(p)
    return float((p * (lp - lq)).sum(-1).mean())
cpu = s.read(d + "/cpu.safetensors")["logits"][1]
print("%s: CPU fp8 vs HF (dequantised fp8 weights): max |dlogit| %.3g (want <= 1e-3) -> %s"
      % (fx, np.abs(cpu - hf).max(), "PASS" if np.abs(cpu - hf).max() <= 1e-3 else "FAIL"))
print("%s: KL(bf16 HF || fp8 HF) %.3g, KL(bf16 HF || fp8 flashmoe) %.3g" % (fx, kl(bf16, hf), kl(bf16, cpu)))
try:
    cu = s.read(d + "/cuda.safetensors")["logits"][1]
    print("%s: CUDA fp8 vs HF: max |dlogit| %.3g" % (fx, np.abs(cu - hf).max()))
except FileNotFoundError:
    print("%s: CUDA: no logits (expected: FP8 experts are refused on the GPU, see the line above)" % fx)
PY
done
# Expected output (3 fixtures):
#   <fx>: CPU fp8 vs HF (dequantised fp8 weights): max |dlogit| ~1e-5 (want <= 1e-3) -> PASS
#   (HF's logits are fp32 math on the dequantised weights, activations not
#   rounded to FP8: what flashmoe computes; transformers' own FP8 kernels
#   would also quantise the activations, which is not this check)
#   <fx>: KL(bf16 HF || fp8 HF) ~= KL(bf16 HF || fp8 flashmoe): coder-mini
#   ~3.6e-4 (measured on the CPU here); the tiny random fixtures larger
#   (near-flat routers flip their top-k under any rounding)
#   the --device cuda lines: superseded by gpu-tasks/fp8-cuda.sh (the CUDA
#   backend runs FP8 checkpoints since branch fp8-cuda).
