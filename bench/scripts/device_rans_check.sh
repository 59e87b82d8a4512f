#!/usr/bin/env bash
# One device run for the rANS codec evidence (issue 4): builds nothing.
# Needs device_carry/{qem-cuda-rans-check,make_reference_acquisition.py} and .whl/hdf5plugin-*.whl
# (carried), writes under $OUT. Usage: bash bench/scripts/device_rans_check.sh [--skip-load]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-unknown}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ "${1:-}" != "--skip-load" ]; then
  pip install --quiet --no-deps --target /tmp/site .whl/hdf5plugin-*.whl
  ( PYTHONPATH=/tmp/site python3 device_carry/make_reference_acquisition.py /tmp/ref > "$OUT/make_reference.json" 2> "$OUT/make_reference.err" ) &
  GEN=$!
fi
./device_carry/qem-cuda-rans-check --out "$OUT/synthetic" 2>&1 | tee "$OUT/synthetic.log"
rc=${PIPESTATUS[0]}
if [ "${1:-}" != "--skip-load" ]; then
  wait $GEN; cat "$OUT/make_reference.json"; tail -3 "$OUT/make_reference.err"
  # Warm the page cache, then the full check.
  cat /tmp/ref/*.h5 > /dev/null
  ./device_carry/qem-cuda-rans-check --frames 256 --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref.qem --out "$OUT/load" 2>&1 | tee "$OUT/load.log"
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
exit $rc
