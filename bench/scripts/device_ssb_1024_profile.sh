#!/usr/bin/env bash
# Second device run of a session: the parts of device_ssb.sh that SKIP1024 leaves out (the CLI
# fit on the r = 30 reference, the 1024² scan) and the rANS decoder profile of
# device_rans_profile.sh, on one machine start. Builds nothing; carried: device_carry/.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
D=device_carry
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2> "$R/make_ref30.err"
( SCAN=1024 python3 $D/make_reference_acquisition.py /tmp/ref1024 > "$R/make_ref1024.json" 2> "$R/make_ref1024.err" ) &
GEN=$!
cat /tmp/ref/*.h5 > /dev/null
( time timeout 120 quantem-gpu ssb /tmp/ref/scan_master.h5 --voltage-kv 300 --semiangle-mrad 25 --scan-step-a 0.4 --fit --objective coherence --out "$R/cli_ssb" ) > "$R/cli_ssb.log" 2>&1
rc=$?; echo "cli ssb rc=$rc"; tail -5 "$R/cli_ssb.log"; rm -f "$R"/cli_ssb/*.npy
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
if [ -n "$NCU" ]; then
  timeout 240 "$NCU" -k regex:qem_rans_frame_sums -c 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SourceCounters \
    ./$D/qem-cuda-rans-check --frames 256 --load /tmp/ref/scan_master.h5 --repeats 1 \
    --qem /tmp/ref.qem --out "$R/check" > "$R/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Executed Ipc A|Warp Cycles Per Issued" "$R/ncu.txt" | head -30
fi
rm -rf /tmp/ref
wait $GEN; cat "$R/make_ref1024.json"
timeout 150 ./$D/ssb_cuda_bench /tmp/ref1024/scan_master.h5 "$R/ssb_1024.json" s1024_r30 --repeats 5 > "$R/ssb_1024.log" 2>&1
r=$?; rc=$((rc|r)); echo "1024 rc=$r"; tail -12 "$R/ssb_1024.log"
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
