#!/usr/bin/env bash
# Run 29 (af494cf): run 28 with the 8-warp ENCODED products kernels held to 64 registers (32 warps
# per SM) by their launch bounds. The products check (GPU = CPU on every request shape, timings)
# and the façade bench only (the device time left allowed no more). Carried: device_carry/.
export QEM_GIT_REVISION=af494cf
source "$(dirname "$0")/device_lib.sh"
cat /proc/loadavg > "$R/host.txt"
make_reference
step "products check" products_check.log timeout 120 $D/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products"
grep -E "^(encoded|dense) |ALL|FAIL" "$R/products_check.log" | head -16
step "facade bench" facade_products.log timeout 120 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10
grep -E "^(encoded|dense) " "$R/facade_products.log"
pack
exit $rc
