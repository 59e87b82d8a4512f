#!/usr/bin/env bash
# Fill device_carry/ (git-ignored) with what bench/device.sh runs on the GPU machine, built
# here: the four check binaries of crates/qem-bench (qem-cuda-check, -load-check,
# -products-check, -rans-check) and its serve-latency bench, the façade and SSB benches
# (qem-bench's examples cuda_products_bench, ssb_cuda_bench), the Rust ssb, every_engine and
# device_result test binaries, the wheel installed into site/ (the quantem-gpu console script
# in site/bin, the CLI binary in the package), hdf5plugin for the device's Python 3.12 (bitshuffle, zstd and blosc
# filters) in h5p/, Dask's wheels, the bslz4 test vectors and the reference-acquisition
# generator; the tests run from the working tree the tool copies. Needs cargo and maturin; run
# from the repository root, then carry `device_carry` (64 MiB at most: PACK=1 packs it).
#
# The generator (make_reference_acquisition.py) is the anchor's recipe for the reference
# acquisition; our copy lives in tests/tools (the default of $ANCHOR_TOOLS; point it elsewhere to
# use another copy). Only that one file is copied into the carry.
set -euo pipefail
ANCHOR_TOOLS=${ANCHOR_TOOLS:-tests/tools}
GEN="$ANCHOR_TOOLS/make_reference_acquisition.py"
[ -f "$GEN" ] || { echo "no $GEN: set ANCHOR_TOOLS to the folder holding it" >&2; exit 2; }
D=device_carry
rm -rf "$D" && mkdir -p "$D/site" "$D/h5p"
# BASE_REV=REV: also the load checks (qem-cuda-rans-check, qem-cuda-load-check) built at REV into
# device_carry/base/, for an A/B of two builds on one card in one call (device.sh lz4 runs them
# beside this build's). Built from a worktree into its own target folder, target/base: cargo
# names a workspace crate's artifacts by its path inside the workspace, so two checkouts sharing
# one target folder take each other's crates for fresh.
if [ -n "${BASE_REV:-}" ]; then
  wt=$(mktemp -d /tmp/qem_base.XXXX)
  git worktree add --detach -q "$wt" "$BASE_REV"
  (cd "$wt" && CARGO_TARGET_DIR="$OLDPWD/target/base" cargo build --release -q -p qem-bench --bin qem-cuda-rans-check --bin qem-cuda-load-check)
  mkdir -p "$D/base"
  cp target/base/release/qem-cuda-rans-check target/base/release/qem-cuda-load-check "$D/base/"
  strip "$D"/base/*
  git rev-parse --short=12 "$BASE_REV" > "$D/base/REVISION"
  git worktree remove --force "$wt"
fi
cargo build --release -q -p qem-bench --bins
cargo build --release -q -p qem-bench --example cuda_products_bench --example ssb_cuda_bench --example read_probe --example pair_probe
for b in qem-bench qem-cuda-check qem-cuda-load-check qem-cuda-products-check qem-cuda-rans-check serve-latency; do
  cp "target/release/$b" "$D/"
done
cp target/release/examples/cuda_products_bench target/release/examples/ssb_cuda_bench target/release/examples/read_probe target/release/examples/pair_probe "$D/"
test_binary() { # NAME: the path of crates/qem's integration-test binary NAME
  cargo test --release -q -p qem --test "$1" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$1"
}
cp "$(test_binary ssb)" "$D/ssb_tests"
cp "$(test_binary every_engine)" "$D/every_engine_tests"
cp "$(test_binary device_result)" "$D/device_result_tests"
strip "$D"/qem-bench "$D"/qem-cuda-* "$D"/serve-latency "$D"/cuda_products_bench "$D"/ssb_cuda_bench "$D"/read_probe "$D"/pair_probe "$D"/ssb_tests "$D"/every_engine_tests "$D"/device_result_tests
# The wheel ships compiled kernels (crates/qem-cuda/build.rs; NVRTC from PyPI, no GPU needed).
QEM_NVRTC=${QEM_NVRTC:-$(scripts/fetch_nvrtc.sh)}
./scripts/stage_cli.sh
rm -rf dist && QEM_NVRTC=$QEM_NVRTC QEM_SHIP_KERNELS=require python3 -m maturin build --release --quiet -o dist
python3 -m pip install --quiet --no-deps --no-compile --target "$D/site" dist/quantem_gpu-*.whl
# The console script's interpreter as the device has it (pip wrote this machine's).
sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$D/site/bin/quantem-gpu"
rm -rf /tmp/h5p_whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d /tmp/h5p_whl hdf5plugin
python3 -m zipfile -e /tmp/h5p_whl/hdf5plugin-*.whl "$D/h5p"
# Only the bitshuffle filter (the reference acquisition) and the zstd and blosc filters (the
# format tests write with them) are kept, stripped: 186 MB → 2.8 MB.
find "$D/h5p/hdf5plugin/plugins" -type f ! -name 'libh5bshuf.so' ! -name 'libh5zstd.so' ! -name 'libh5blosc.so' -delete
strip "$D"/h5p/hdf5plugin/plugins/*.so
# Dask for the distributed mode (the device's Python has none; it has no internet).
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$D/wheels" "dask[distributed]"
cp "$GEN" "$D/"
cp -r crates/qem-codec/tests/vectors "$D/vectors"
echo "$(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD -- crates python || echo -dirty)" > "$D/REVISION"
du -sh "$D"
# PACK=1: also pack it as device_carry_xz/carry.tar.xz (xz, about a third of the size; device.sh
# unpacks it when device_carry/ is absent), carried instead of device_carry when that is too big.
if [ -n "${PACK:-}" ]; then
  mkdir -p device_carry_xz && tar cf - "$D" | xz -6 -T2 > device_carry_xz/carry.tar.xz && du -sh device_carry_xz
fi
