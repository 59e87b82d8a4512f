#!/usr/bin/env bash
# Run 18, the final code of this stop: run 17 after single synchronous transfers went direct
# again (the staging buffer serves only fetch_all and the iDPC): the product checks, the façade
# bench, the Rust ssb tests, the GPU-facing
# Python tests and the rANS check, on the r = 30 reference.
# Builds nothing; carried: device_carry/. Writes $OUT/results.tgz (res/). Steps are skipped once
# 500 s have passed.
source "$(dirname "$0")/device_lib.sh"
make_reference
step "products check" products_check.log timeout 120 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products"
grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check.log" | head -16
step "facade bench" facade_products.log timeout 120 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10
grep -E "^(encoded|dense) " "$R/facade_products.log"
step "ssb tests" ssb_tests.log timeout 100 $D/ssb_tests --nocapture --test-threads 1
grep -E "test result|FAILED|panicked" "$R/ssb_tests.log" | head -4
mkdir -p /tmp/q/repo/tests/python && cp $D/tests/*.py /tmp/q/repo/tests/python/ && cp -r $D/shared /tmp/q/shared
step "pytest" pytest_gpu.log bash -c "cd /tmp/q/repo/tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -rs test_cuda.py test_products.py test_dpc.py test_ssb.py test_encoded.py"
tail -2 "$R/pytest_gpu.log"
step "rans check" rans_check.log timeout 110 $D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref.qem --out "$R/rans"
grep -E "PASS|FAIL|encoded load:|decode all" "$R/rans_check.log" | head -8
pack
exit $rc
