#!/usr/bin/env bash
# Run 9: SSB v10 (one barrier per block) timed on r = 30 / r = 53 with the Rust ssb tests, then
# Nsight Compute: the v10 quadratic kernel (r = 53), the rANS frame-sum decoder with per-SASS
# stall samples, and the ENCODED products kernels (launch list with durations). Builds nothing;
# carried: device_carry/. Writes $OUT/res/.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/h5p
D=device_carry
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null &
RADIUS=53 python3 $D/make_reference_acquisition.py /tmp/ref53 > "$R/make_ref53.json" 2>/dev/null
wait
timeout 150 ./$D/ssb_tests --nocapture --test-threads 1 > "$R/ssb_tests.log" 2>&1
echo "ssb tests rc=$?"; grep -E "test result|rel L2" "$R/ssb_tests.log" | head -20
timeout 90 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53.json" r53 > "$R/ssb_r53.log" 2>&1
echo "r53 rc=$?"; tail -4 "$R/ssb_r53.log"
timeout 90 ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 "$R/ssb_r30.json" r30 --cpu-check 64 > "$R/ssb_r30.log" 2>&1
echo "r30 rc=$?"; tail -4 "$R/ssb_r30.log"
"$NCU" --help > "$R/ncu_help.txt" 2>&1
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters"
timeout 120 "$NCU" -k regex:qem_ssb_accumulate_quad_g32 -c 1 $S \
  ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 /tmp/x.json prof --repeats 1 > "$R/ncu_ssb_v10_r53.txt" 2>&1
echo "ncu ssb rc=$?"
timeout 200 "$NCU" -k regex:qem_rans_frame_sums --launch-skip 6 -c 1 $S -o "$R/ncu_rans" \
  ./$D/qem-cuda-rans-check --frames 256 --load /tmp/ref/scan_master.h5 --repeats 1 \
  --qem /tmp/ref.qem --out "$R/check" > "$R/ncu_rans_run.txt" 2>&1
echo "ncu rans rc=$?"
"$NCU" -i "$R/ncu_rans.ncu-rep" --page details > "$R/ncu_rans.txt" 2>&1
"$NCU" -i "$R/ncu_rans.ncu-rep" --page source --print-source sass > "$R/ncu_rans_sass.txt" 2>&1
echo "sass rc=$? $(wc -l < "$R/ncu_rans_sass.txt") lines"
timeout 150 "$NCU" -k regex:qem_products_encoded -c 40 --section SpeedOfLight --section LaunchStats --section WarpStateStats --section InstructionStats \
  ./$D/cuda_products_bench /tmp/ref/scan_master.h5 /tmp/p.json 1 > "$R/ncu_products.txt" 2>&1
echo "ncu products rc=$?"
for f in ncu_ssb_v10_r53 ncu_rans; do echo "== $f"; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|DRAM Throughput|Stall" "$R/$f.txt" | head -24; done
grep -E "qem_products_encoded|Duration|Grid Size" "$R/ncu_products.txt" | head -60
