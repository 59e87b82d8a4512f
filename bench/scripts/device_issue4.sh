#!/usr/bin/env bash
# One device run for issue 4's evidence with the final code: builds nothing.
# Carried: device_carry/ = qem-cuda-rans-check, make_reference_acquisition.py, site/ (the quantem
# wheel installed and stripped, bin/quantem-gpu = the CLI) and h5p/ (hdf5plugin with only its
# bitshuffle filter, 1 MB instead of 45). Writes everything under $OUT/res, packed as $OUT/results.tgz.
# Steps: reference acquisition (anchor's generator) -> rANS check (synthetic + full encoded
# load + .qem) -> façade `bench load` (CUDA default = ENCODED) with --cpu-check -> pytest.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-unknown}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$R/gpu.txt"
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
( python3 device_carry/make_reference_acquisition.py /tmp/ref > "$R/make_reference.json" 2> "$R/make_reference.err" ) &
GEN=$!
./device_carry/qem-cuda-rans-check --out "$R/synthetic" > "$R/synthetic.log" 2>&1
rc=$?; echo "synthetic rc=$rc"; tail -25 "$R/synthetic.log"
wait $GEN; cat "$R/make_reference.json"; tail -3 "$R/make_reference.err"
cat /tmp/ref/*.h5 > /dev/null
./device_carry/qem-cuda-rans-check --frames 256 --load /tmp/ref/scan_master.h5 --repeats 7 --qem /tmp/ref.qem --out "$R/load" > "$R/load.log" 2>&1
r2=$?; rc=$(( rc | r2 )); echo "load rc=$r2"; tail -40 "$R/load.log"
rm -f /tmp/ref.qem
if [ -n "${ALT:-}" ]; then  # A/B: the same load with other model parameters, e.g. ALT="--contexts 8 --literals 32 --rule quantiles"
  ./device_carry/qem-cuda-rans-check --frames 64 --load /tmp/ref/scan_master.h5 --repeats 5 --qem /tmp/ref_alt.qem $ALT --out "$R/load_alt" > "$R/load_alt.log" 2>&1
  echo "alt rc=$?"; grep -E 'p50|ratio|encode|decode' "$R/load_alt.log" | head -20; rm -f /tmp/ref_alt.qem
fi
quantem-gpu bench load --backend cuda --source /tmp/ref/scan_master.h5 --repeats 7 --cpu-check --out "$R/bench" > "$R/bench.log" 2>&1
r3=$?; rc=$(( rc | r3 )); echo "bench rc=$r3"; tail -30 "$R/bench.log"
if [ "${PYTEST:-1}" = 1 ]; then
  # The tests find shared/ next to the checkout: lay out /tmp/q/{repo/tests,shared}.
  mkdir -p /tmp/q/repo && cp -r tests /tmp/q/repo/ && cp -r device_carry/shared /tmp/q/shared
  files=${PYTEST_FILES:-test_cuda.py test_encoded.py test_load_dectris.py test_load_variants.py test_malformed.py test_surface.py}
  ( cd /tmp/q/repo/tests/python && timeout 300 python3 -m pytest -q -p no:cacheprovider -rs $files > "$R/pytest.log" 2>&1 ); echo "pytest rc=$?"; tail -15 "$R/pytest.log"
fi
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
