#!/usr/bin/env bash
# Device run: fused products + iDPC + corrupt ENCODED data checks, then the same under
# compute-sanitizer memcheck, then the whole Python suite. Builds nothing; carried: device_carry/.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-unknown}
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
./device_carry/qem-cuda-products-check --out "$R/products_synth" > "$R/products_synth.log" 2>&1
rc=$?; echo "products synthetic rc=$rc"; grep -E 'DIFFERS|corrupt|ALL|SOME|error' "$R/products_synth.log"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
timeout 300 "$SAN" --tool memcheck --leak-check no ./device_carry/qem-cuda-products-check --out "$R/memcheck" > "$R/memcheck.log" 2>&1
r=$?; rc=$((rc|r)); echo "memcheck rc=$r"; grep -E 'ERROR SUMMARY|ALL|SOME|corrupt' "$R/memcheck.log"
mkdir -p /tmp/q/repo && cp -r tests /tmp/q/repo/ && cp -r device_carry/shared /tmp/q/shared
( cd /tmp/q/repo/tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider -rs . > "$R/pytest.log" 2>&1 ); echo "pytest rc=$?"; tail -6 "$R/pytest.log"
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
