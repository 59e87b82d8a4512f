#!/usr/bin/env bash
# Device run for issue 4 (encoder after the f32-division change) and issue 5 (fused products):
# builds nothing. Carried: device_carry/ (qem-cuda-rans-check, qem-cuda-products-check,
# cuda_products_bench, make_reference_acquisition.py, site/ = stripped quantem wheel + bin/quantem-gpu, h5p/ = slim
# hdf5plugin). Everything goes under $OUT/res, packed as $OUT/results.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=$OUT/res; mkdir -p "$R"
export QEM_GIT_REVISION=${QEM_GIT_REVISION:-unknown}
export PYTHONPATH=$PWD/device_carry/site:$PWD/device_carry/h5p PATH=$PWD/device_carry/site/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$R/gpu.txt"
( python3 device_carry/make_reference_acquisition.py /tmp/ref > "$R/make_reference.json" 2> "$R/make_reference.err" ) &
GEN=$!
./device_carry/qem-cuda-products-check --out "$R/products_synth" > "$R/products_synth.log" 2>&1
rc=$?; echo "products synthetic rc=$rc"; tail -22 "$R/products_synth.log"
wait $GEN; cat "$R/make_reference.json"; cat /tmp/ref/*.h5 > /dev/null
./device_carry/qem-cuda-rans-check --frames 64 --load /tmp/ref/scan_master.h5 --repeats 7 --qem /tmp/ref.qem --out "$R/load" > "$R/load.log" 2>&1
r=$?; rc=$((rc|r)); echo "rans load rc=$r"; grep -E 'encoded load:|encode \(|decode \(|gpu load|decode all|every frame|\.qem' "$R/load.log"; rm -f /tmp/ref.qem
./device_carry/qem-cuda-products-check --load /tmp/ref/scan_master.h5 --repeats 10 --out "$R/products_load" > "$R/products_load.log" 2>&1
r=$?; rc=$((rc|r)); echo "products load rc=$r"; tail -16 "$R/products_load.log"
./device_carry/cuda_products_bench /tmp/ref/scan_master.h5 "$R/facade_products.json" 10 > "$R/facade_products.log" 2>&1
r=$?; rc=$((rc|r)); echo "facade products rc=$r"; tail -5 "$R/facade_products.log"
timeout 200 python3 bench/scripts/cupy_products.py /tmp/ref/scan_master.h5 "$R/cupy_products.json" 10 > "$R/cupy.log" 2>&1
echo "cupy rc=$?"; tail -8 "$R/cupy.log"
quantem-gpu bench load --backend cuda --source /tmp/ref/scan_master.h5 --repeats 7 --out "$R/bench" > "$R/bench.log" 2>&1
echo "bench rc=$?"; grep -E 'quantem-gpu \(cuda\)|encode|memory|result' "$R/bench.log"
mkdir -p /tmp/q/repo && cp -r tests /tmp/q/repo/ && cp -r device_carry/shared /tmp/q/shared
( cd /tmp/q/repo/tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider -rs test_cuda.py > "$R/pytest_cuda.log" 2>&1 ); echo "pytest test_cuda rc=$?"; tail -3 "$R/pytest_cuda.log"
tar czf "$OUT/results.tgz" -C "$OUT" res
exit $rc
