#!/usr/bin/env bash
# Installs what oscar needs to build and test, from Debian's packages. The CUDA toolkit
# (nvcc, CCCL) is expected to be present already (it is not a Debian package here).
set -euo pipefail
packages=(cmake ninja-build g++ libeigen3-dev doctest-dev libbenchmark-dev nlohmann-json3-dev
  # scripts/fidelity-report.sh: the KJV texts (bible-kjv reads bible-kjv-text) and the plots
  bible-kjv bible-kjv-text python3-matplotlib
  # python/oscar_plan.py (the plan reader for Python engines) and its test
  python3-numpy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "note: nvcc is not on PATH; CMake finds it through CUDAToolkit_ROOT=/usr/local/cuda" >&2
fi
