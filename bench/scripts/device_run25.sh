#!/usr/bin/env bash
# Run 25 (37da410): the decoder's lookup by ((x & 0xff0) | class) into u16 tab indices, its
# branch-free renormalisation and dp2a statistic; the ENCODED products' sum-DP atomics with
# immediate offsets and rows from mask-byte flags; decode kernels in 16-warp CTAs. The final-code
# checks (products check, façade bench, Nsight Compute of the ENCODED kernels, ssb tests,
# pytest, rANS check with every frame hash and the mutated streams) and CuPy on the same data.
# Carried: device_carry/ (bench/scripts/prepare_carry.sh).
export QEM_GIT_REVISION=37da410 NCU=1
bash "$(dirname "$0")/device_checks.sh"; r=$?
source "$(dirname "$0")/device_lib.sh"
STEP_BUDGET=580
cupy_step
pack
exit $((r|rc))
