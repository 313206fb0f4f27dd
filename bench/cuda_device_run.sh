#!/bin/bash
# One device call (the H200 lent to a session): build, the CUDA tests, the
# fixtures rebuilt and the tests that read them, and an A/B bench against a
# base commit. Logs go to $OUT.
#
# usage (on the device, from the repository root):
#   bash bench/cuda_device_run.sh STEP...
#   steps: build   flashmoe + flashmoe_tests (and gpu/base.tar.gz, if present, into /tmp/base)
#          tests   every CUDA test but the golden ones (they read tests/fixtures)
#          fixtures  scripts/fixtures/make_fixtures.py into /tmp/fx, then the tests that read tests/fixtures
#          bench   35B synthetic, base against new, two interleaved rounds
#
# Staging, here (gpu/ is listed in .git/info/exclude and named in `carry`):
#   mkdir -p gpu/debs && (cd gpu/debs && apt-get download nlohmann-json3-dev libcli11-dev libpcre2-dev \
#     libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libutf8proc-dev libutf8proc2 libgtest-dev \
#     libgmock-dev libboost1.74-dev libboost-dev libreadline-dev libreadline8 libncurses-dev python3-numpy)
#   git archive BASE -- CMakeLists.txt src bench fuzz tests/*.cpp tests/*.h scripts Makefile | gzip > gpu/base.tar.gz
# A call sends at most 64 MiB: models/ (49 MB) and tests/fixtures (66 MB)
# do not fit together, so move tests/fixtures out of the tree for the call
# (the `fixtures` step rebuilds it there, byte for byte) and put it back after.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export NCCL_NVLS_ENABLE=0
D=/tmp/deps
if [ -d gpu/debs ] && [ ! -f $D/.done ]; then
  mkdir -p $D; for f in gpu/debs/*.deb; do dpkg -x $f $D; done
  sed -i "s|^prefix=.*|prefix=$D/usr|" $D/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
  touch $D/.done
fi
export PKG_CONFIG_PATH=$D/usr/lib/x86_64-linux-gnu/pkgconfig LD_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu
CM="-DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$D/usr -DCMAKE_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu -DCMAKE_DISABLE_FIND_PACKAGE_benchmark=ON"
T0=$SECONDS
summary() { grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests ran" "$1" | head -40; }
for s in "$@"; do case $s in
build)
  if [ -f gpu/base.tar.gz ] && [ ! -x /tmp/base/build/flashmoe ]; then
    mkdir -p /tmp/base && tar xzf gpu/base.tar.gz -C /tmp/base
    (cmake -S /tmp/base -B /tmp/base/build $CM > $OUT/base-build.log 2>&1 &&
     cmake --build /tmp/base/build -j8 --target flashmoe >> $OUT/base-build.log 2>&1; echo "base rc $?" >> $OUT/base-build.log) &
  fi
  (cmake -S . -B build $CM > $OUT/build.log 2>&1 && cmake --build build -j10 --target flashmoe flashmoe_tests >> $OUT/build.log 2>&1) ||
    { tail -40 $OUT/build.log; wait; exit 1; }
  wait; tail -1 $OUT/base-build.log 2>/dev/null
  echo "build ok at $((SECONDS-T0)) s";;
tests)
  ./build/flashmoe_tests --gtest_filter='Cuda*:DeviceCli*:ExpertsPack.Mlx*:-*CudaGolden*' > $OUT/cuda_tests.log 2>&1
  summary $OUT/cuda_tests.log;;
fixtures)
  timeout 300 python3 scripts/fixtures/make_fixtures.py /tmp/fx > $OUT/fixtures.log 2>&1; echo "make_fixtures rc $?"
  (cd /tmp/fx && find . -type f | sort | xargs sha256sum) > $OUT/fixtures.sha256  # compare with the committed files
  [ -e tests/fixtures ] || ln -s /tmp/fx tests/fixtures
  ./build/flashmoe_tests --gtest_filter='*CudaGolden*:DeviceCli*:ExpertsPack.Mlx*:*Golden*' > $OUT/fixture_tests.log 2>&1
  summary $OUT/fixture_tests.log;;
bench)
  S="--device cuda --synthetic qwen3.5-35b-a3b"
  for round in 1 2; do for bin in base new; do
    B=./build/flashmoe; [ $bin = base ] && B=/tmp/base/build/flashmoe
    [ -x $B ] || continue
    for args in "-p 512 -n 128 -r 3" "-p 2048 -n 0 -r 3" "--experts q4 -p 0 -n 128 -r 3" "--gpu-expert-cache 20% -p 0 -n 128 -r 2"; do
      r=$($B bench $S $args 2>&1 | grep -E "^\| (pp|tg)|error" | tr '\n' ' ')
      echo "round $round $bin [$args] $r" | tee -a $OUT/bench_ab.txt
    done
  done; done;;
esac; done
echo "done at $((SECONDS-T0)) s"
