#!/usr/bin/env bash
# Installs the Debian packages flashmoe builds against, only those missing.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config nlohmann-json3-dev libcli11-dev libpcre2-dev
      libutf8proc-dev libgtest-dev libgmock-dev libbenchmark-dev libboost-dev libreadline-dev
      python3-numpy)  # python3-numpy: the fixture scripts the MlxLayout / Fp8Checkpoint tests run
# `scripts/install-deps.sh fuzz` (make test-asan, make fuzz) adds clang and its libFuzzer runtime.
if [ "${1:-}" = fuzz ]; then pkgs+=(clang libclang-rt-14-dev); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
