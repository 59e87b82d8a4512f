#!/usr/bin/env bash
# Run 14: the Python suite's GPU-facing tests (test_cuda, test_products, test_dpc, test_ssb) on
# the card with the wheel of the final code of this stop. Builds nothing; carried: device_carry/
# (site/ = the wheel installed with --target and the CLI, tests/, shared/tools, h5p).
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
mkdir -p /tmp/q/repo/tests/python && cp device_carry/tests/*.py /tmp/q/repo/tests/python/ && cp -r device_carry/shared /tmp/q/shared
( cd /tmp/q/repo/tests/python && timeout 170 python3 -m pytest -q -p no:cacheprovider -rs test_cuda.py test_products.py test_dpc.py test_ssb.py > "$R/pytest_gpu.log" 2>&1 ); rc=$?
echo "pytest rc=$rc"; tail -12 "$R/pytest_gpu.log"
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
