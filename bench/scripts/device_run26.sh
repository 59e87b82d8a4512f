#!/usr/bin/env bash
# Run 26 (8374059): run 25's decoder with its tables laid out without bank conflicts (tab rows
# [set][class] of odd stride S|1, u8 lookup [set][bucket][16]), ctx4/bits4 one group ahead and
# an L2 prefetch hint on the word loads. The final-code checks with Nsight Compute (+ warp
# state statistics) and CuPy on the same data. Carried: device_carry/ (prepare_carry.sh).
export QEM_GIT_REVISION=8374059 NCU=1 NCU_EXTRA="--section WarpStateStats --section MemoryWorkloadAnalysis"
bash "$(dirname "$0")/device_checks.sh"; r=$?
source "$(dirname "$0")/device_lib.sh"
STEP_BUDGET=580
cupy_step
pack
exit $((r|rc))
