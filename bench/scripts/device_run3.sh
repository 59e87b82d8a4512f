#!/usr/bin/env bash
# Device run for issue 5 after the per-shape kernel specialisation: builds nothing. Carried:
# device_carry/ (qem-cuda-products-check, cuda_products_bench, make_reference_acquisition.py,
# site/ = stripped quantem wheel + bin/quantem-gpu, h5p/ = slim hdf5plugin, shared/ for the
# Python tests). Everything goes under $OUT/res, packed as $OUT/results.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-unknown}
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$R/gpu.txt"
( python3 device_carry/make_reference_acquisition.py /tmp/ref > "$R/make_reference.json" 2> "$R/make_reference.err" ) &
GEN=$!
./device_carry/qem-cuda-products-check --out "$R/products_synth" > "$R/products_synth.log" 2>&1
rc=$?; echo "products synthetic rc=$rc"; grep -c ' = encoded' "$R/products_synth.log"; grep -E 'DIFFERS|iDPC 512|ALL|SOME|error' "$R/products_synth.log"
mkdir -p /tmp/q/repo && cp -r tests /tmp/q/repo/ && cp -r device_carry/shared /tmp/q/shared
( cd /tmp/q/repo/tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -rs test_cuda.py test_products.py test_dpc.py > "$R/pytest.log" 2>&1 ); echo "pytest rc=$?"; tail -4 "$R/pytest.log"
wait $GEN; cat "$R/make_reference.json"; cat /tmp/ref/*.h5 > /dev/null
./device_carry/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products_load" > "$R/products_load.log" 2>&1
r=$?; rc=$((rc|r)); echo "products load rc=$r"; grep -E '^(encoded|dense)|fused =|ALL|SOME|error' "$R/products_load.log"
./device_carry/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
r=$?; rc=$((rc|r)); echo "facade products rc=$r"; tail -4 "$R/facade_products.log"
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
