#!/usr/bin/env bash
# NVRTC from PyPI for building the shipped kernels (crates/qem-cuda/build.rs, feature
# shipped-kernels): installs nvidia-cuda-nvrtc (CUDA 13.0, the oldest CUDA 13 driver's level, so
# its CUBINs load on every CUDA 13 driver) into target/nvrtc once and prints the folder holding
# libnvrtc.so.13; use it as QEM_NVRTC:
#
#   export QEM_NVRTC=$(scripts/fetch_nvrtc.sh)
#   python -m maturin build --release -o dist     # the wheel now carries compiled kernels
#
# No GPU is needed: NVRTC only compiles.
set -euo pipefail
VERSION=${NVRTC_VERSION:-13.0.88}
DIR=${NVRTC_DIR:-target/nvrtc-$VERSION}
LIB=$DIR/nvidia/cu13/lib
if [ ! -f "$LIB/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --no-deps --target "$DIR" "nvidia-cuda-nvrtc==$VERSION" >&2
fi
cd "$LIB" && pwd
