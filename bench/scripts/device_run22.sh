#!/usr/bin/env bash
# Run 22 (819f975): ENCODED masks and moments per group of four steps (PROD_GROUP4) and
# unconditional shared sum-DP atomics; Nsight Compute on the ENCODED kernels. The product checks
# (with a forged-extra-bits corrupt case), the façade bench, the Rust ssb tests, the GPU-facing
# Python tests and the rANS check (with a forged stream), on the r = 30 reference.
# It ran with these steps inline; they are now device_checks.sh.
QEM_GIT_REVISION=819f975 NCU=1 exec bash "$(dirname "$0")/device_checks.sh"
