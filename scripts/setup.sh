#!/usr/bin/env bash
# Installs what building and testing quantem.gpu needs on a fresh machine that has Rust,
# Python 3 with pip, and gcc: CMake >= 3.26 (the static HDF5 build needs it), maturin,
# the Python packages the tests compare against (numpy, h5py, hdf5plugin, pytest; tqdm and
# matplotlib for progress bars and plots), and for the
# browse page's browser test Playwright with Debian's Chromium (apt, only when chromium is
# missing and we are root or have sudo; Playwright's own browser download is not used).
set -euo pipefail
PY=${PYTHON:-python3}
need=()
if ! command -v cmake >/dev/null 2>&1 || ! cmake --version | awk 'NR==1{split($3,v,"."); exit !(v[1]>3 || (v[1]==3 && v[2]>=26))}'; then
  need+=("cmake>=3.26")
fi
for mod in numpy h5py hdf5plugin pytest maturin playwright tqdm matplotlib; do
  if ! "$PY" -c "import $mod" >/dev/null 2>&1; then
    need+=("$mod")
  fi
done
# quantem.gpu.distributed and its tests (tests/python/test_distributed.py): Dask's distributed
# scheduler and pandas (the acquisition-batch table).
"$PY" -c "import distributed" >/dev/null 2>&1 || need+=("dask[distributed]")
"$PY" -c "import pandas" >/dev/null 2>&1 || need+=("pandas")
# JAX on the CPU (tests/python/test_jax.py: jax.dlpack.from_dlpack of datasets and results);
# the package does not need it.
"$PY" -c "import jax" >/dev/null 2>&1 || need+=("jax")
# Result files and the documentation site (tests/python/test_outputs.py, test_docs.py): TIFF
# writing, the EMD readers of py4DSTEM (emdfile) and hyperspy (rosettasciio), mypy for the
# type stubs, mkdocs + mkdocstrings for `mkdocs build --strict`, ruff for `make lint`'s Python
# half (the rules in pyproject.toml).
for pair in tifffile:tifffile emdfile:emdfile rsciio:rosettasciio mypy:mypy ruff:ruff==0.17.6 mkdocs:mkdocs \
  mkdocstrings_handlers.python:"mkdocstrings[python]"; do
  "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  "$PY" -m pip install --quiet --disable-pip-version-check "${need[@]}"
fi
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
  && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    as_root=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
  else
    as_root=(none)
  fi
  if [ "${as_root[0]:-}" = none ]; then
    echo "setup: chromium is missing and neither root nor sudo: tests/python/test_browse_page.py will skip"
  else
    echo "setup: installing chromium (apt)"
    if ! { "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
      "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium fonts-liberation >/dev/null; }; then
      echo "setup: could not install chromium"
      [ -z "${CI:-}" ] || exit 1
    fi
  fi
fi
hash -r
cmake --version | head -n 1
