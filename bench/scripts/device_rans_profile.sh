#!/usr/bin/env bash
# Where the rANS decoder's time goes (issue 5: the ENCODED fused products are decode-bound):
# Nsight Compute on qem_rans_frame_sums (the decoder with the smallest fused reduction) over the
# reference acquisition. Builds nothing; carried: device_carry/{qem-cuda-rans-check,
# make_reference_acquisition.py,h5p}. Writes $OUT/results.tgz (ncu text report + the check log).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/h5p
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
python3 device_carry/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2> "$R/make_ref30.err"
cat /tmp/ref/*.h5 > /dev/null
# -c 2: the first two frame-sum launches of the check (its full-acquisition decode passes).
timeout 400 "$NCU" -k regex:qem_rans_frame_sums -c 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
  --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section SourceCounters \
  ./device_carry/qem-cuda-rans-check --frames 256 --load /tmp/ref/scan_master.h5 --repeats 1 \
  --qem /tmp/ref.qem --out "$R/check" > "$R/ncu.txt" 2>&1
rc=$?; echo "ncu rc=$rc"; grep -E "Duration|Registers|Achieved Occupancy|Issue Slots Busy|No Eligible|Stall|Executed Ipc|Warp Cycles Per Issued" "$R/ncu.txt" | head -60
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
