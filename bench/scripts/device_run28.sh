#!/usr/bin/env bash
# Run 28 (4f7d4a5): run 27 plus the renormalisation words from a per-warp window loaded a step
# ahead (A/B: the products check again with QEM_GPU_RANS_WINDOW=0), the lookup address in one
# LOP3 and the class's table row off the state's path. The final-code checks with Nsight
# Compute (warp states) and CuPy on the same data. Carried: device_carry/ (prepare_carry.sh).
# (The steps are now device_lib.sh functions; when it ran, the A/B log was products_check_no*.log.)
# (The A/B switches QEM_GPU_RANS_PREFETCH / QEM_GPU_RANS_WINDOW were removed after run 29: the
# window and the prefetch are always on in the final code.)
export QEM_GIT_REVISION=4f7d4a5 NCU=1 NCU_EXTRA="--section WarpStateStats --print-details all"
bash "$(dirname "$0")/device_checks.sh"; r=$?
source "$(dirname "$0")/device_lib.sh"
STEP_BUDGET=580
products_check products_nowin QEM_GPU_RANS_WINDOW
cupy_step
pack
exit $((r|rc))
