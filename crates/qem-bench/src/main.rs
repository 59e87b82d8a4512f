//! The `qem-bench` binary: `qem-bench load ...` and `qem-bench generate-reference DIR`
//! (the work is in [`qem_bench::cli`]).

fn main() {
    std::process::exit(qem_bench::cli::run(std::env::args_os().collect()));
}
