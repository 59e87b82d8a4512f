# Sourced by the device_run*.sh scripts (bash, run from the repository root on the device
# machine): results go to $OUT/res and are packed into $OUT/results.tgz after every step (the
# run tool returns only a few loose files). Sets R, D (the carried device_carry/), PYTHONPATH
# (the wheel and hdf5plugin) and PATH (the CLI); `step NAME LOG CMD...` runs CMD into $R/LOG,
# ORs its status into rc and skips it once STEP_BUDGET seconds (default 500) have passed;
# `make_reference` writes the r = 30 reference acquisition to /tmp/ref and warms the page cache;
# `products_check [NAME [VAR]]` runs the products check into $R/NAME (default products), with
# the environment variable VAR=0 when given (an A/B of a decoder option); `facade_bench` and
# `cupy_step` run the façade bench and CuPy on the same data.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
D=$PWD/device_carry
STEP_BUDGET=${STEP_BUDGET:-500}
pack() { tar czf "$OUT/results.tgz" -C "$OUT" res; }
rc=0
step() { # name, log, command...
  local name=$1 log=$2; shift 2
  if [ $SECONDS -ge "$STEP_BUDGET" ]; then echo "$name skipped (time)"; return; fi
  "$@" > "$R/$log" 2>&1; local r=$?; rc=$((rc|r)); echo "$name rc=$r (${SECONDS}s)"; pack
}
make_reference() {
  python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null
  cat /tmp/ref/*.h5 > /dev/null
}
products_check() { # [name [VAR]]
  local name=${1:-products} var=${2:-}
  step "products check${var:+, $var=0}" "${name}_check.log" env ${var:+$var=0} timeout 120 \
    $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/$name"
  grep -E "^(encoded|dense) |ALL|FAIL" "$R/${name}_check.log" | head -16
}
facade_bench() {
  step "facade bench" facade_products.log timeout 120 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10
  grep -E "^(encoded|dense) " "$R/facade_products.log"
}
cupy_step() {
  step "cupy" cupy.log timeout 90 python3 bench/scripts/cupy_products.py /tmp/ref/scan_master.h5 "$R/cupy_products.json" 10
  tail -1 "$R/cupy.log"
}
