#!/usr/bin/env bash
# Issue 6 device run: CUDA SSB correctness (the Rust test binary of crates/qem/tests/ssb.rs,
# CPU reference vs CUDA dense/ENCODED, f32/f16 G) and timings (ssb_cuda_bench) on the anchor's
# reference acquisition (512², disk r = 30 px), the same with r = 53 px, and a 1024² scan.
# Also the Python SSB tests (CUDA vs NumPy float64) and `quantem-gpu ssb --fit` on the r = 30
# acquisition; r = 53 from host-held data under 6 GiB (--host-data). QUICK=1 stops before the
# CLI run, SKIP1024=1 before the 1024² scan. Builds nothing; carried: device_carry/ (ssb test binary, ssb_cuda_bench, the
# generator, hdf5plugin's bitshuffle filter, site/ = the wheel installed with --target and the
# stripped CLI in site/bin, tests/ = test_ssb.py with conftest.py and helpers.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
D=device_carry
GIB6=6442450944
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpu.csv" 2>&1
( python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2> "$R/make_ref30.err";
  RADIUS=53 python3 $D/make_reference_acquisition.py /tmp/ref53 > "$R/make_ref53.json" 2> "$R/make_ref53.err" ) &
GEN=$!
timeout 200 ./$D/ssb_tests --nocapture --test-threads 1 > "$R/ssb_tests.log" 2>&1
rc=$?; echo "ssb tests rc=$rc"; grep -E "^test |test result|rel L2|cuda fit|skipped" "$R/ssb_tests.log" | head -60
# The Python tests find shared/ (the independent Dectris writer) next to the checkout.
mkdir -p /tmp/q/repo/tests/python && cp device_carry/tests/*.py /tmp/q/repo/tests/python/ && cp -r device_carry/shared /tmp/q/shared
( cd /tmp/q/repo/tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -rs test_ssb.py > "$R/pytest_ssb.log" 2>&1 ); echo "pytest rc=$?"; tail -4 "$R/pytest_ssb.log"
wait $GEN; cat "$R/make_ref30.json" "$R/make_ref53.json"; cat /tmp/ref/*.h5 /tmp/ref53/*.h5 > /dev/null
timeout 170 ./$D/ssb_cuda_bench /tmp/ref/scan_master.h5 "$R/ssb_r30.json" r30 --card-budget $GIB6 --cpu-check 64 --fit-pv > "$R/ssb_r30.log" 2>&1
r=$?; rc=$((rc|r)); echo "r30 rc=$r"; cat "$R/ssb_r30.log" | tail -20
# Issue 5 on the same r = 30 data: products and dpc.run through the façade, ENCODED and dense.
if [ -x $D/cuda_products_bench ]; then
  timeout 150 ./$D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
  r=$?; rc=$((rc|r)); echo "facade products rc=$r"; tail -3 "$R/facade_products.log"
fi
timeout 170 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53.json" r53 --card-budget $GIB6 --fit-pv > "$R/ssb_r53.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 rc=$r"; cat "$R/ssb_r53.log" | tail -20
# The route the 6 GiB refusal names: the same r = 53 data with the detector binned 2×2.
timeout 120 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53_bin2.json" r53_bin2 --det-bin 2 --card-budget $GIB6 > "$R/ssb_r53_bin2.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 bin2 rc=$r"; cat "$R/ssb_r53_bin2.log" | tail -8
# r = 53 under a 6 GiB card with the data on the host (CPU engine, dense) and SSB on the card.
timeout 240 ./$D/ssb_cuda_bench /tmp/ref53/scan_master.h5 "$R/ssb_r53_host.json" r53_host --host-data --card-budget $GIB6 > "$R/ssb_r53_host.log" 2>&1
r=$?; rc=$((rc|r)); echo "r53 host rc=$r"; cat "$R/ssb_r53_host.log" | tail -12
rm -rf /tmp/ref53
if [ -n "${QUICK:-}" ]; then tar czf "$OUT/results.tgz" -C "$OUT" res; exit $rc; fi
( time timeout 120 quantem-gpu ssb /tmp/ref/scan_master.h5 --voltage-kv 300 --semiangle-mrad 25 --scan-step-a 0.4 --fit --objective coherence --out "$R/cli_ssb" ) > "$R/cli_ssb.log" 2>&1
r=$?; rc=$((rc|r)); echo "cli ssb rc=$r"; tail -5 "$R/cli_ssb.log"; rm -f "$R"/cli_ssb/*.npy
if [ -n "${SKIP1024:-}" ]; then tar czf "$OUT/results.tgz" -C "$OUT" res; exit $rc; fi
( SCAN=1024 timeout 120 python3 $D/make_reference_acquisition.py /tmp/ref1024 > "$R/make_ref1024.json" 2> "$R/make_ref1024.err" ); cat "$R/make_ref1024.json"
timeout 150 ./$D/ssb_cuda_bench /tmp/ref1024/scan_master.h5 "$R/ssb_1024.json" s1024_r30 --repeats 5 > "$R/ssb_1024.log" 2>&1
r=$?; rc=$((rc|r)); echo "1024 rc=$r"; cat "$R/ssb_1024.log" | tail -12
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
