#!/usr/bin/env bash
# Run 27 (d8f2870): a group's classes and mask bits in one load, no statistic flush in the
# products, the group loop unrolled by two, split4/stride from the host, an L2 prefetch of the
# words (A/B: the products check again with QEM_GPU_RANS_PREFETCH=0). The final-code checks with
# Nsight Compute (warp states with details) and CuPy on the same data. Carried: device_carry/.
export QEM_GIT_REVISION=d8f2870 NCU=1 NCU_EXTRA="--section WarpStateStats --print-details all"
bash "$(dirname "$0")/device_checks.sh"; r=$?
source "$(dirname "$0")/device_lib.sh"
STEP_BUDGET=580 step "products check, prefetch off" products_check_nopf.log env QEM_GPU_RANS_PREFETCH=0 timeout 100 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products_nopf"
grep -E "^encoded |ALL|FAIL" "$R/products_check_nopf.log" | head -8
STEP_BUDGET=580 step "cupy" cupy.log timeout 90 python3 bench/scripts/cupy_products.py /tmp/ref/scan_master.h5 "$R/cupy_products.json" 10
tail -1 "$R/cupy.log"
pack
exit $((r|rc))
