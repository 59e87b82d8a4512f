#!/usr/bin/env bash
# Run 13: dense products read each 8-pixel group's mask bits with one 8-byte load (was one
# byte load per value): qem-cuda-products-check (exactness and timings), the façade
# products/dpc bench, and the rANS check of the decoder after the warp-sum refactor, on the
# r = 30 reference. Builds nothing; carried: device_carry/.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/h5p
D=device_carry
pack() { tar czf "$OUT/results.tgz" -C "$OUT" res; }
python3 $D/make_reference_acquisition.py /tmp/ref > "$R/make_ref30.json" 2>/dev/null; cat /tmp/ref/*.h5 > /dev/null
timeout 120 ./$D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products" > "$R/products_check.log" 2>&1
rc=$?; echo "products check rc=$rc"; grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check.log" | head -14; pack
timeout 120 ./$D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
r=$?; rc=$((rc|r)); echo "facade rc=$r"; grep -E "^(encoded|dense) " "$R/facade_products.log"; pack
timeout 120 ./$D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref.qem --out "$R/rans" > "$R/rans_check.log" 2>&1
r=$?; rc=$((rc|r)); echo "rans check rc=$r"; grep -E "PASS|FAIL|decode all|encoded load:|every frame" "$R/rans_check.log" | head -10; pack
exit $rc
