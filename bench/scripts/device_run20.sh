#!/usr/bin/env bash
# Run 20: the two-frame ENCODED products kernel (PROD_PAIR, 958f52a) against the one-frame
# kernel (QUANTEM_GPU_PAIR_DECODE=0) in the same run: the product checks (GPU = CPU, corrupt
# streams) and their ENCODED/dense timings on the r = 30 reference, the façade bench, a warps
# sweep of the pair kernel, Nsight Compute on the fused pair kernel, and the rANS check.
# Builds nothing; carried: device_carry/. Writes $OUT/results.tgz (res/). Steps are skipped
# once 540 s have passed. The pair kernel and its QUANTEM_GPU_PAIR_* knobs were removed after
# this run (20d49a8): this script records what ran.
STEP_BUDGET=540
source "$(dirname "$0")/device_lib.sh"
export QEM_GIT_REVISION=958f52a
cat /proc/loadavg > "$R/host.txt"
make_reference
step "products check (pair)" products_check_pair.log timeout 150 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products_pair"
grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check_pair.log" | head -16
step "products check (one frame)" products_check_single.log env QUANTEM_GPU_PAIR_DECODE=0 timeout 150 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products_single"
grep -E "^encoded |ALL|FAIL" "$R/products_check_single.log" | head -8
step "facade bench (pair)" facade_pair.log timeout 90 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_pair.json" 10
grep -E "^(encoded|dense) " "$R/facade_pair.log"
for w in 24 8; do
  step "facade bench (pair, $w warps)" facade_pair_w$w.log env QUANTEM_GPU_PAIR_WARPS=$w timeout 60 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_pair_w$w.json" 5
  grep -E "^encoded " "$R/facade_pair_w$w.log"
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats"
step "ncu pair" ncu_pair.log timeout 120 "$NCU" -k regex:qem_products_encoded --launch-skip 1 -c 2 $S $D/cuda_products_bench /tmp/ref/scan_master.h5 /tmp/ncu.json 1
grep -E "qem_products_encoded|Duration|Registers Per|Block Size|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Instructions  |Warp Cycles Per Issued" "$R/ncu_pair.log" | head -40
step "rans check" rans_check.log timeout 110 $D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref.qem --out "$R/rans"
grep -E "PASS|FAIL|encoded load:|decode all" "$R/rans_check.log" | head -8
pack
exit $rc
