#!/usr/bin/env bash
# Run 12 (the final code of this stop): SSB's host route streamed through two pinned buffers
# (r53 from host-held data under 6 GiB), the Rust ssb tests and the Python SSB tests on the
# card, the CLI fit, the rANS check and façade products/dpc on the decoder as shipped (v2).
# Builds nothing; carried: device_carry/ (binaries, site/ = the wheel and the CLI, tests/).
# Writes $OUT/results.tgz (res/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
D=device_carry
GIB6=6442450944
pack() { tar czf "$OUT/results.tgz" -C "$OUT" res; }
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null &
RADIUS=53 python3 $D/make_reference_acquisition.py /tmp/ref53 > "$R/make_ref53.json" 2>/dev/null
wait; cat /tmp/ref/*.h5 /tmp/ref53/*.h5 > /dev/null
timeout 120 ./$D/ssb_tests --nocapture --test-threads 1 > "$R/ssb_tests.log" 2>&1
rc=$?; echo "ssb tests rc=$rc"; grep -E "test result|host data|cuda fit|FAILED|panicked" "$R/ssb_tests.log" | head -8
mkdir -p /tmp/q/repo/tests/python && cp $D/tests/*.py /tmp/q/repo/tests/python/ && cp -r $D/shared /tmp/q/shared
( cd /tmp/q/repo/tests/python && timeout 150 python3 -m pytest -q -p no:cacheprovider -rs test_ssb.py > "$R/pytest_ssb.log" 2>&1 ); r=$?; rc=$((rc|r)); echo "pytest rc=$r"; tail -3 "$R/pytest_ssb.log"; pack
timeout 120 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53_host.json" r53_host --host-data --card-budget $GIB6 > "$R/ssb_r53_host.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 host rc=$r"; tail -9 "$R/ssb_r53_host.log"; pack
rm -rf /tmp/ref53
( time timeout 100 quantem-gpu ssb /tmp/ref/scan_master.h5 --voltage-kv 300 --semiangle-mrad 25 --scan-step-a 0.4 --fit --objective coherence --out "$R/cli_ssb" ) > "$R/cli_ssb.log" 2>&1
r=$?; rc=$((rc|r)); echo "cli ssb rc=$r"; tail -5 "$R/cli_ssb.log"; rm -f "$R"/cli_ssb/*.npy "$R"/cli_ssb/*.png; pack
timeout 120 ./$D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 7 --qem /tmp/ref.qem --out "$R/rans" > "$R/rans_check.log" 2>&1
r=$?; rc=$((rc|r)); echo "rans check rc=$r"; grep -E "PASS|FAIL|decode all|encoded load:|every frame" "$R/rans_check.log" | head -10; pack
timeout 120 ./$D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
r=$?; rc=$((rc|r)); echo "facade rc=$r"; grep -E "^(encoded|dense) " "$R/facade_products.log"; pack
exit $rc
