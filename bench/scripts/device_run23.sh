#!/usr/bin/env bash
# Run 23 (ab21d5e), the final code of this stop: run 22 plus one bucket vote per group of four
# decode steps; Nsight Compute on the ENCODED kernels. The product checks
# (with a forged-extra-bits corrupt case), the façade bench, the Rust ssb tests, the GPU-facing
# Python tests and the rANS check (with a forged stream), on the r = 30 reference.
# It ran with these steps inline; they are now device_checks.sh.
QEM_GIT_REVISION=ab21d5e NCU=1 exec bash "$(dirname "$0")/device_checks.sh"
