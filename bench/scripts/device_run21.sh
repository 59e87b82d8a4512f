#!/usr/bin/env bash
# Run 21, the final code of this stop (87ce748): the decoder split into rans_open / rans_symbol /
# rans_run / rans_close and its u16 range check (R_VALUE, forged extra bits). The product checks
# (with a forged-extra-bits corrupt case), the façade bench, the Rust ssb tests, the GPU-facing
# Python tests and the rANS check (with a forged stream), on the r = 30 reference.
# It ran with these steps inline; they are now device_checks.sh.
QEM_GIT_REVISION=87ce748 NCU=0 exec bash "$(dirname "$0")/device_checks.sh"
