#!/usr/bin/env bash
# Fill device_carry/ (git-ignored) with what device_checks.sh runs on the GPU machine, built
# here: the check binaries, the façade bench, the Rust ssb test binary (stripped), the wheel
# installed into site/, hdf5plugin for the device's Python 3.12 unpacked into h5p/, the
# reference-acquisition tool, the GPU-facing Python tests and ../shared (≈ 38 MB). Needs a release build
# (`cargo build --release --workspace --all-targets`) and maturin. Run from the repository root.
set -euo pipefail
D=device_carry
rm -rf "$D" && mkdir -p "$D/tests" "$D/site" "$D/h5p"
cargo build --release -q -p qem-cuda --bins
cargo build --release -q -p qem --example cuda_products_bench
cp target/release/qem-cuda-products-check target/release/qem-cuda-rans-check "$D/"
cp target/release/examples/cuda_products_bench "$D/"
ssb=$(cargo test --release -q -p qem --test ssb --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "ssb" and m.get("executable"):
        print(m["executable"])')
cp "$ssb" "$D/ssb_tests"
strip "$D"/qem-cuda-products-check "$D"/qem-cuda-rans-check "$D"/cuda_products_bench "$D"/ssb_tests
rm -rf dist && python3 -m maturin build --release --quiet -o dist
python3 -m pip install --quiet --no-deps --no-compile --target "$D/site" dist/quantem_gpu-*.whl
# The console script's interpreter as the device has it (pip wrote this machine's).
sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$D/site/bin/quantem-gpu"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d /tmp/h5p_whl hdf5plugin
python3 -m zipfile -e /tmp/h5p_whl/hdf5plugin-*.whl "$D/h5p"
# Only the bitshuffle filter is used (the carry must stay under 64 MiB): 186 MB → 0.9 MB.
find "$D/h5p/hdf5plugin/plugins" -type f ! -name 'libh5bshuf.so' -delete
strip "$D/h5p/hdf5plugin/plugins/libh5bshuf.so" "$D"/site/quantem/gpu/_native*.so
cp ../shared/tools/make_reference_acquisition.py "$D/"
cp tests/python/*.py "$D/tests/"
cp -r ../shared "$D/shared" && chmod -R u+w "$D/shared"
du -sh "$D"
