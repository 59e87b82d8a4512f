#!/usr/bin/env bash
# Run 23 (ab21d5e), the final code of this stop: run 22 plus one bucket vote per group of four
# decode steps; Nsight Compute on the ENCODED kernels. The product checks
# (with a forged-extra-bits corrupt case), the façade bench, the Rust ssb tests, the GPU-facing
# Python tests and the rANS check (with a forged stream), on the r = 30 reference.
# Builds nothing; carried: device_carry/. Writes $OUT/results.tgz (res/). Steps are skipped once
# 500 s have passed.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
D=$PWD/device_carry
export QEM_GIT_REVISION=ab21d5e
pack() { tar czf "$OUT/results.tgz" -C "$OUT" res; }
rc=0
step() { # name, log, command...
  local name=$1 log=$2; shift 2
  if [ $SECONDS -ge 500 ]; then echo "$name skipped (time)"; return; fi
  "$@" > "$R/$log" 2>&1; local r=$?; rc=$((rc|r)); echo "$name rc=$r (${SECONDS}s)"; pack
}
cat /proc/loadavg > "$R/host.txt"
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null; cat /tmp/ref/*.h5 > /dev/null
step "products check" products_check.log timeout 120 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products"
grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check.log" | head -16
step "facade bench" facade_products.log timeout 120 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10
grep -E "^(encoded|dense) " "$R/facade_products.log"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
S="--section SpeedOfLight --section LaunchStats --section SchedulerStats --section InstructionStats --section Occupancy"
step "ncu encoded" ncu_encoded.log timeout 100 "$NCU" -k regex:qem_products_encoded -c 4 $S $D/cuda_products_bench /tmp/ref/scan_master.h5 /tmp/ncu.json 1
grep -E "qem_products_encoded|Duration|Registers Per|Block Size|Achieved Occupancy|Issue Slots Busy|Executed Instructions  |Issued Warp Per" "$R/ncu_encoded.log" | head -40
step "ssb tests" ssb_tests.log timeout 100 $D/ssb_tests --nocapture --test-threads 1
grep -E "test result|FAILED|panicked" "$R/ssb_tests.log" | head -4
mkdir -p /tmp/q/repo/tests/python && cp $D/tests/*.py /tmp/q/repo/tests/python/ && cp -r $D/shared /tmp/q/shared
step "pytest" pytest_gpu.log bash -c "cd /tmp/q/repo/tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -rs test_cuda.py test_products.py test_dpc.py test_ssb.py test_encoded.py"
tail -2 "$R/pytest_gpu.log"
step "rans check" rans_check.log timeout 110 $D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref.qem --out "$R/rans"
grep -E "PASS|FAIL|encoded load:|decode all" "$R/rans_check.log" | head -9
grep -E "corrupt ENCODED" "$R/products_check.log"
pack
exit $rc
