#!/usr/bin/env bash
# Run 29 (af494cf): run 28 with the 8-warp ENCODED products kernels held to 64 registers (32 warps
# per SM) by their launch bounds. The products check (GPU = CPU on every request shape, timings)
# and the façade bench only (the device time left allowed no more). Carried: device_carry/.
export QEM_GIT_REVISION=af494cf
source "$(dirname "$0")/device_lib.sh"
cat /proc/loadavg > "$R/host.txt"
make_reference
products_check
facade_bench
pack
exit $rc
