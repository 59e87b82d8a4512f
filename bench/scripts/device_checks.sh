#!/usr/bin/env bash
# The checks of a final code on the card (runs 21–23): the product checks (GPU = CPU, ENCODED
# = dense, corrupt and forged streams typed) with their ENCODED/dense timings, the façade bench,
# Nsight Compute on the ENCODED product kernels when NCU=1 (NCU_EXTRA: more sections), the Rust
# ssb tests, the GPU-facing
# Python tests and the rANS check, on the r = 30 reference. QEM_GIT_REVISION names the code.
# Builds nothing; carried: device_carry/. Writes $OUT/results.tgz (res/).
source "$(dirname "$0")/device_lib.sh"
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-unknown}
cat /proc/loadavg > "$R/host.txt"
make_reference
products_check
facade_bench
if [ "${NCU:-0}" = 1 ]; then
  NCU_BIN=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  S="--section SpeedOfLight --section LaunchStats --section SchedulerStats --section InstructionStats --section Occupancy ${NCU_EXTRA:-}"
  step "ncu encoded" ncu_encoded.log timeout 100 "$NCU_BIN" -k regex:qem_products_encoded -c 4 $S $D/cuda_products_bench /tmp/ref/scan_master.h5 /tmp/ncu.json 1
  grep -E "qem_products_encoded|Duration|Registers Per|Block Size|Achieved Occupancy|Issue Slots Busy|Executed Instructions  |Issued Warp Per" "$R/ncu_encoded.log" | head -40
fi
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
