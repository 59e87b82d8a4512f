#!/usr/bin/env bash
# Run 27 (d8f2870): a group's classes and mask bits in one load, no statistic flush in the
# products, the group loop unrolled by two, split4/stride from the host, an L2 prefetch of the
# words (A/B: the products check again with QEM_GPU_RANS_PREFETCH=0). The final-code checks with
# Nsight Compute (warp states with details) and CuPy on the same data. Carried: device_carry/.
# (The steps are now device_lib.sh functions; when it ran, the A/B log was products_check_no*.log.)
# (The A/B switches QEM_GPU_RANS_PREFETCH / QEM_GPU_RANS_WINDOW were removed after run 29: the
# window and the prefetch are always on in the final code.)
export QEM_GIT_REVISION=d8f2870 NCU=1 NCU_EXTRA="--section WarpStateStats --print-details all"
bash "$(dirname "$0")/device_checks.sh"; r=$?
source "$(dirname "$0")/device_lib.sh"
STEP_BUDGET=580
products_check products_nopf QEM_GPU_RANS_PREFETCH
cupy_step
pack
exit $((r|rc))
