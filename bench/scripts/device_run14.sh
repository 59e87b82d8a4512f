#!/usr/bin/env bash
# Run 14: the dense products' packed path (dp2a masks and moments per 16-byte group, rows by
# umulhi) and the reduce's stage timings (host set-up, GPU events, wait, download), checked and
# timed on the r = 30 reference; then the checks not yet run on the card for c105e95 (Rust ssb
# tests, the rANS check, pytest test_cuda/test_products/test_dpc/test_ssb with this wheel), a
# Nsight Compute SpeedOfLight pass over the dense product launches, and CuPy on the same array.
# Builds nothing; carried: device_carry/ (binaries, site/ = the wheel and the CLI, tests/).
# Writes $OUT/results.tgz (res/). Steps are skipped once 500 s have passed.
source "$(dirname "$0")/device_lib.sh"
make_reference
step "products check" products_check.log timeout 120 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products"
grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check.log" | head -16
step "facade bench" facade_products.log timeout 120 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10
grep -E "^(encoded|dense) " "$R/facade_products.log"
step "rans check" rans_check.log timeout 110 $D/qem-cuda-rans-check --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref.qem --out "$R/rans"
grep -E "PASS|FAIL|decode all|encoded load:|every frame" "$R/rans_check.log" | head -8
step "ssb tests" ssb_tests.log timeout 100 $D/ssb_tests --nocapture --test-threads 1
grep -E "test result|FAILED|panicked" "$R/ssb_tests.log" | head -4
mkdir -p /tmp/q/repo/tests/python && cp $D/tests/*.py /tmp/q/repo/tests/python/ && cp -r $D/shared /tmp/q/shared
step "pytest" pytest_gpu.log bash -c "cd /tmp/q/repo/tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -rs test_cuda.py test_products.py test_dpc.py test_ssb.py"
tail -4 "$R/pytest_gpu.log"
step "ncu dense" ncu_dense.log timeout 90 /usr/local/cuda/bin/ncu -k regex:qem_products_dense_u16 -c 12 --section SpeedOfLight --section Occupancy --section LaunchStats $D/cuda_products_bench /tmp/ref/scan_master.h5 /tmp/ncu_bench.json 1
grep -E "qem_products_dense_u16|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Block Size|Grid Size" "$R/ncu_dense.log" | head -80
step "cupy" cupy.log timeout 90 python3 bench/scripts/cupy_products.py /tmp/ref/scan_master.h5 "$R/cupy_products.json" 10
tail -3 "$R/cupy.log"
pack
exit $rc
