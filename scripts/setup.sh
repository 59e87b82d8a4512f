#!/usr/bin/env bash
# Installs what building and testing quantem.gpu needs on a fresh machine that has Rust,
# Python 3 with pip, and gcc: CMake >= 3.26 (the static HDF5 build needs it), maturin,
# and the Python packages the tests compare against (numpy, h5py, hdf5plugin, pytest).
set -euo pipefail
PY=${PYTHON:-python3}
need=()
if ! command -v cmake >/dev/null 2>&1 || ! cmake --version | awk 'NR==1{split($3,v,"."); exit !(v[1]>3 || (v[1]==3 && v[2]>=26))}'; then
  need+=("cmake>=3.26")
fi
for mod in numpy h5py hdf5plugin pytest maturin; do
  if ! "$PY" -c "import $mod" >/dev/null 2>&1; then
    need+=("$mod")
  fi
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  "$PY" -m pip install --quiet --disable-pip-version-check "${need[@]}"
fi
hash -r
cmake --version | head -n 1
