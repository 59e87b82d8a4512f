#!/usr/bin/env bash
# Final device run of 2026-12-03: products/iDPC/corrupt-stream checks, reference-acquisition
# timings (products check + façade bench), and the whole Python suite. Builds nothing; carried:
# device_carry/ (see device_run3.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-unknown}
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
( python3 device_carry/make_reference_acquisition.py /tmp/ref > "$R/make_reference.json" 2> "$R/make_reference.err" ) &
GEN=$!
./device_carry/qem-cuda-products-check --out "$R/products_synth" > "$R/products_synth.log" 2>&1
rc=$?; echo "products synthetic rc=$rc"; grep -E 'DIFFERS|corrupt|ALL|SOME|error' "$R/products_synth.log"
mkdir -p /tmp/q/repo && cp -r tests /tmp/q/repo/ && cp -r device_carry/shared /tmp/q/shared
( cd /tmp/q/repo/tests/python && timeout 240 python3 -m pytest -q -p no:cacheprovider -rs . > "$R/pytest.log" 2>&1 ); echo "pytest rc=$?"; tail -8 "$R/pytest.log"
wait $GEN; cat "$R/make_reference.json"; cat /tmp/ref/*.h5 > /dev/null
./device_carry/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products_load" > "$R/products_load.log" 2>&1
r=$?; rc=$((rc|r)); echo "products load rc=$r"; grep -E '^(encoded|dense)|fused =|ALL|SOME|error' "$R/products_load.log"
./device_carry/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
r=$?; rc=$((rc|r)); echo "facade products rc=$r"; tail -3 "$R/facade_products.log"
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
