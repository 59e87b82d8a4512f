//! `qem-bench`: measurement for quantem.gpu, in one place.
//!
//! The engines (`qem-cpu`, `qem-cuda`) depend only on the vocabulary, codec and IO crates; what
//! compares one engine with the other, generates test data or times a stage lives here, so no
//! engine has to depend on the other or on the simulator. It may depend on every crate of the
//! workspace except `qem-cli` and `qem-py`; nothing depends on it. (The CLI's `bench load` and
//! `generate-reference` still live in `qem-cli`, which alone may use `anyhow`.)
//!
//! * `src/bin/`: the GPU check binaries, each the CPU engine against the CUDA engine case by
//!   case, with timings, written as JSON (`bench/device.sh` runs them):
//!   `qem-cuda-check` (bitshuffle/LZ4 kernel), `qem-cuda-load-check` (dense load),
//!   `qem-cuda-products-check` (detector products, iDPC), `qem-cuda-rans-check` (rANS codec,
//!   ENCODED load, `.qem` round trip).
//! * `examples/`: benchmark and study programs: `cuda_products_bench`, `ssb_cuda_bench`,
//!   `ssb_validation`, `load_time` (through the `qem` façade), `plan_time` (the CUDA load
//!   plan), `decode_speed`, `pair_study`, `rans_ratio` (codec studies).
//!
//! Benchmarks print a table and write JSON; none asserts a time.
