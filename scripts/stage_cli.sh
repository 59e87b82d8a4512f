#!/usr/bin/env bash
# Build the `quantem-gpu` command line (crates/qem-cli) and stage it, stripped, into
# python/quantem/gpu/_bin (git-ignored) so the wheel carries it; `quantem.gpu._cli` execs it.
# The extension module itself does not link the CLI. Run from the repository root.
set -euo pipefail
cargo build --release -q -p qem-cli
mkdir -p python/quantem/gpu/_bin
cp "${CARGO_TARGET_DIR:-target}/release/quantem-gpu" python/quantem/gpu/_bin/quantem-gpu
strip python/quantem/gpu/_bin/quantem-gpu
chmod 755 python/quantem/gpu/_bin/quantem-gpu
