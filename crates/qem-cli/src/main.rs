//! The `quantem-gpu` binary: everything lives in the library so that Python can run it too.

fn main() {
    std::process::exit(qem_cli::run(std::env::args_os().collect()));
}
