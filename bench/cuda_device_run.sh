#!/bin/bash
# One device call: build, all tests (CPU + CUDA), benches. Run from the
# staged tree (gpu/) on the GPU machine; logs go to $OUT.
# usage: bench/cuda_device_run.sh [build|test|bench]...   (default: all)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
steps=${*:-build test bench}
export NCCL_NVLS_ENABLE=0
if [ -d debs ]; then
  mkdir -p /tmp/deps; for f in debs/*.deb; do dpkg -x $f /tmp/deps; done
  sed -i "s|^prefix=.*|prefix=/tmp/deps/usr|" /tmp/deps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
  export PKG_CONFIG_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu/pkgconfig LD_LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
for s in $steps; do case $s in
build)
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=/tmp/deps/usr \
    -DCMAKE_LIBRARY_PATH=/tmp/deps/usr/lib/x86_64-linux-gnu > $OUT/build.log 2>&1 &&
  cmake --build build -j16 >> $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
  echo "build ok";;
test)
  (cd build && ctest -j8 --timeout 300 --output-on-failure > $OUT/ctest.log 2>&1); tail -5 $OUT/ctest.log
  grep -E "Failed|\*\*\*" $OUT/ctest.log | head -20
  ./build/flashmoe_tests --gtest_filter='Cuda*:*CudaGolden*' > $OUT/cuda_tests.log 2>&1
  grep -E "cuda-vs-cpu|PASSED|FAILED|OK \]" $OUT/cuda_tests.log | head -40;;
bench)
  B=./build/flashmoe
  $B bench --device cuda -m models/coder-mini/model -p 128 -n 128 -r 3 --profile 8 2>&1 | tee $OUT/bench_coder.txt
  $B bench --device cuda --synthetic qwen3.5-35b-a3b -p 512 -n 128 -r 3 --profile 8 2>&1 | tee $OUT/bench_35b.txt
  echo "--- no CUDA graph" | tee -a $OUT/bench_35b.txt
  $B bench --device cuda --synthetic qwen3.5-35b-a3b -p 0 -n 128 -r 2 --no-graph 2>&1 | tail -2 | tee -a $OUT/bench_35b.txt
  echo "--- fp8 KV, 4096-token window" | tee -a $OUT/bench_35b.txt
  $B bench --device cuda --synthetic qwen3.5-35b-a3b -p 512 -n 128 -r 2 --kv-dtype fp8 --kv-window 4096 2>&1 | tail -4 | tee -a $OUT/bench_35b.txt;;
esac; done
