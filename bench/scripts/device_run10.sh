#!/usr/bin/env bash
# Run 10: the rANS decoder v2 (ctx4, 32-bit shared addressing, full-group steps) checked and
# timed (qem-cuda-rans-check, qem-cuda-products-check, façade products/dpc), each under Nsight
# Compute for one kernel's per-SASS profile (the fused frame sums, the fused products); then SSB
# v10 with the staged Nelder–Mead (Rust ssb tests, r30/r53 benches with 6 GiB budgets, r53 from
# host data, and one ncu SASS profile of the quadratic kernel). Builds nothing; carried:
# device_carry/. Writes $OUT/results.tgz (res/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/h5p
D=device_carry
GIB6=6442450944
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters"
pack() { tar czf "$OUT/results.tgz" -C "$OUT" res; }
prof() { # name: the report's details and per-SASS pages
  "$NCU" -i "$R/$1.ncu-rep" --page details > "$R/$1.txt" 2>&1
  "$NCU" -i "$R/$1.ncu-rep" --page source --print-source sass > "$R/$1_sass.txt" 2>&1
  rm -f "$R/$1.ncu-rep"
  grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Executed Instructions  " "$R/$1.txt" | head -8
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$R/gpu.csv" 2>&1
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null &
RADIUS=53 python3 $D/make_reference_acquisition.py /tmp/ref53 > "$R/make_ref53.json" 2>/dev/null
wait; cat /tmp/ref/*.h5 /tmp/ref53/*.h5 > /dev/null
timeout 200 "$NCU" -k regex:qem_rans_frame_sums --launch-skip 6 -c 1 $S -o "$R/ncu_rans_v2" \
  ./$D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref.qem --out "$R/rans" > "$R/rans_check.log" 2>&1
rc=$?; echo "rans check rc=$rc"; grep -E "decode all|encoded load|pass|FAIL|mismatch|error" "$R/rans_check.log" | head -12; prof ncu_rans_v2; pack
timeout 150 ./$D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products" > "$R/products_check.log" 2>&1
r=$?; rc=$((rc|r)); echo "products check rc=$r"; tail -16 "$R/products_check.log"; pack
timeout 200 "$NCU" -k regex:qem_products_encoded -c 1 $S -o "$R/ncu_products_v2" \
  ./$D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
r=$?; rc=$((rc|r)); echo "facade products rc=$r"; tail -4 "$R/facade_products.log"; prof ncu_products_v2; pack
timeout 120 ./$D/ssb_tests --nocapture --test-threads 1 > "$R/ssb_tests.log" 2>&1
r=$?; rc=$((rc|r)); echo "ssb tests rc=$r"; grep -E "test result|rel L2|cuda fit" "$R/ssb_tests.log" | head -20
timeout 120 ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 "$R/ssb_r30.json" r30 --card-budget $GIB6 --cpu-check 64 --fit-pv > "$R/ssb_r30.log" 2>&1
r=$?; rc=$((rc|r)); echo "r30 rc=$r"; tail -12 "$R/ssb_r30.log"; pack
timeout 150 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53.json" r53 --card-budget $GIB6 --fit-pv > "$R/ssb_r53.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 rc=$r"; tail -12 "$R/ssb_r53.log"; pack
timeout 150 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53_host.json" r53_host --host-data --card-budget $GIB6 > "$R/ssb_r53_host.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 host rc=$r"; tail -8 "$R/ssb_r53_host.log"; pack
timeout 100 "$NCU" -k regex:qem_ssb_accumulate_quad_g32 -c 1 $S -o "$R/ncu_ssb_v10" \
  ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 /tmp/x.json prof --repeats 1 > "$R/ncu_ssb_run.log" 2>&1
echo "ncu ssb rc=$?"; prof ncu_ssb_v10; pack
exit $rc
