#!/usr/bin/env bash
# Run 24 (d8eda9f): the review mends on the card — the shared device_lib.sh / device_checks.sh
# and the checks' frames from qem_sim's loaded_frame (behaviour unchanged); the other carried
# binaries and the wheel as in run 23 (ab21d5e, the same kernels).
QEM_GIT_REVISION=d8eda9f NCU=0 exec bash "$(dirname "$0")/device_checks.sh"
