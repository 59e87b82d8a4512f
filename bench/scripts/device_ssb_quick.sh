#!/usr/bin/env bash
# Short device run for one SSB kernel change: the r = 30 and r = 53 reference acquisitions,
# ssb_cuda_bench without budget runs (the r = 30 one with the CPU check of a 64² region).
# Carried: device_carry/ as for device_ssb.sh.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/h5p
D=device_carry
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null &
RADIUS=53 python3 $D/make_reference_acquisition.py /tmp/ref53 > "$R/make_ref53.json" 2>/dev/null
wait
timeout 90 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53.json" r53 > "$R/ssb_r53.log" 2>&1
rc=$?; echo "r53 rc=$rc"; tail -4 "$R/ssb_r53.log"
timeout 90 ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 "$R/ssb_r30.json" r30 --cpu-check 64 > "$R/ssb_r30.log" 2>&1
r=$?; rc=$((rc|r)); echo "r30 rc=$r"; tail -4 "$R/ssb_r30.log"
python3 -c "import json;d=json.load(open('$R/ssb_r30.json'));print(json.dumps({k:{'re':v['object_rel_l2_re'],'im':v['object_rel_l2_im'],'loss':{a:b['rel'] for a,b in v['losses'].items()}} for k,v in d['cpu_check']['cases'].items()}))"
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
