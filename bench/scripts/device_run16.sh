#!/usr/bin/env bash
# Run 16: is the host time of dpc.run / products page faults on fresh result vectors? The façade
# bench as shipped, then again with glibc told to keep freed memory (MALLOC_MMAP_THRESHOLD_ /
# MALLOC_TRIM_THRESHOLD_: no fresh mappings per call). Builds nothing; carried: device_carry/.
source "$(dirname "$0")/device_lib.sh"
make_reference
timeout 120 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_default.json" 10 > "$R/facade_default.log" 2>&1; echo "default rc=$?"
grep -E "^(encoded|dense) " "$R/facade_default.log"; pack
MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824 timeout 120 $D/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_keep.json" 10 > "$R/facade_keep.log" 2>&1; echo "keep rc=$?"
grep -E "^(encoded|dense) " "$R/facade_keep.log"; pack
