#!/usr/bin/env bash
# Where the time goes, by Nsight Compute: the SSB accumulate kernel (quadratic χ, f32 G) on the
# r = 30 reference and the rANS frame-sum decoder on the same acquisition. Builds nothing;
# carried: device_carry/. Writes $OUT/res/ncu_*.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/h5p
D=device_carry
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2> "$R/make_ref30.err"
cat /tmp/ref/*.h5 > /dev/null
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters"
timeout 200 "$NCU" -k regex:qem_ssb_accumulate_quad_g32 -c 1 $S \
  ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 /tmp/x.json prof --repeats 1 > "$R/ncu_ssb.txt" 2>&1
echo "ncu ssb rc=$?"
timeout 200 "$NCU" -k regex:qem_rans_frame_sums -c 2 $S \
  ./$D/qem-cuda-rans-check --frames 256 --load /tmp/ref/scan_master.h5 --repeats 1 \
  --qem /tmp/ref.qem --out "$R/check" > "$R/ncu_rans.txt" 2>&1
echo "ncu rans rc=$?"
for f in ncu_ssb ncu_rans; do echo "== $f"; grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Executed Ipc A|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Stall|Block Limit" "$R/$f.txt" | head -40; done
