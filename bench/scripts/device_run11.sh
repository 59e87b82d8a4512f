#!/usr/bin/env bash
# Run 11: the rANS decoder v3 (renormalisation words from a 64-word register window) and SSB
# v11 (Nyquist-line pairs in their own blocks, branch-free soft aperture, pointer-stepped G
# loads, one 16-byte table load per pixel): rANS and products checks and timings, the façade
# products/dpc bench, the Rust ssb tests, r30/r53 (6 GiB budgets), r53 from host data, the
# 1024² scan, and one ncu profile of the quadratic kernel. Builds nothing; carried:
# device_carry/. Writes $OUT/results.tgz (res/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/h5p
D=device_carry
GIB6=6442450944
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
pack() { tar czf "$OUT/results.tgz" -C "$OUT" res; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$R/gpu.csv" 2>&1
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null &
RADIUS=53 python3 $D/make_reference_acquisition.py /tmp/ref53 > "$R/make_ref53.json" 2>/dev/null
wait; cat /tmp/ref/*.h5 /tmp/ref53/*.h5 > /dev/null
timeout 150 ./$D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 7 --qem /tmp/ref.qem --out "$R/rans" > "$R/rans_check.log" 2>&1
rc=$?; echo "rans check rc=$rc"; grep -E "PASS|FAIL|decode all|encoded load:|every frame|mutations" "$R/rans_check.log" | head -14; pack
timeout 120 ./$D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products" > "$R/products_check.log" 2>&1
r=$?; rc=$((rc|r)); echo "products check rc=$r"; grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check.log" | head -14; pack
timeout 120 ./$D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
r=$?; rc=$((rc|r)); echo "facade rc=$r"; grep -E "^(encoded|dense) " "$R/facade_products.log"; pack
timeout 120 ./$D/ssb_tests --nocapture --test-threads 1 > "$R/ssb_tests.log" 2>&1
r=$?; rc=$((rc|r)); echo "ssb tests rc=$r"; grep -E "test result|rel L2|cuda fit|FAILED|panicked" "$R/ssb_tests.log" | head -24
timeout 120 ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 "$R/ssb_r30.json" r30 --card-budget $GIB6 --cpu-check 64 --fit-pv > "$R/ssb_r30.log" 2>&1
r=$?; rc=$((rc|r)); echo "r30 rc=$r"; tail -12 "$R/ssb_r30.log"; pack
timeout 150 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53.json" r53 --card-budget $GIB6 --fit-pv > "$R/ssb_r53.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 rc=$r"; tail -12 "$R/ssb_r53.log"; pack
timeout 100 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53_host.json" r53_host --host-data --card-budget $GIB6 > "$R/ssb_r53_host.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 host rc=$r"; tail -8 "$R/ssb_r53_host.log"; pack
rm -rf /tmp/ref53
( SCAN=1024 timeout 100 python3 $D/make_reference_acquisition.py /tmp/ref1024 > "$R/make_ref1024.json" 2>/dev/null )
timeout 100 ./$D/ssb_cuda_bench /tmp/ref1024/scan_master.h5 "$R/ssb_1024.json" s1024_r30 --repeats 5 > "$R/ssb_1024.log" 2>&1
r=$?; rc=$((rc|r)); echo "1024 rc=$r"; tail -8 "$R/ssb_1024.log"; pack
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
timeout 60 "$NCU" -k regex:qem_ssb_accumulate_quad_g32 -c 1 $S \
  ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 /tmp/x.json prof --repeats 1 > "$R/ncu_ssb_v11.txt" 2>&1
echo "ncu ssb rc=$?"; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Executed Instructions  |DRAM Throughput|barrier" "$R/ncu_ssb_v11.txt" | head -10; pack
exit $rc
