#!/usr/bin/env bash
# Run 28 (4f7d4a5): run 27 plus the renormalisation words from a per-warp window loaded a step
# ahead (A/B: the products check again with QEM_GPU_RANS_WINDOW=0), the lookup address in one
# LOP3 and the class's table row off the state's path. The final-code checks with Nsight
# Compute (warp states) and CuPy on the same data. Carried: device_carry/ (prepare_carry.sh).
export QEM_GIT_REVISION=4f7d4a5 NCU=1 NCU_EXTRA="--section WarpStateStats --print-details all"
bash "$(dirname "$0")/device_checks.sh"; r=$?
source "$(dirname "$0")/device_lib.sh"
STEP_BUDGET=580 step "products check, no window" products_check_nowin.log env QEM_GPU_RANS_WINDOW=0 timeout 100 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products_nowin"
grep -E "^encoded |ALL|FAIL" "$R/products_check_nowin.log" | head -8
STEP_BUDGET=580 step "cupy" cupy.log timeout 90 python3 bench/scripts/cupy_products.py /tmp/ref/scan_master.h5 "$R/cupy_products.json" 10
tail -1 "$R/cupy.log"
pack
exit $((r|rc))
