//! Times `qem::load` of a source on the CPU:
//! `cargo run --release -p qem-bench --example load_time -- PATH [REPEATS]`.
//! Prints each run's wall time and stage timings, and a checksum of the loaded counts.
use qem::{load, LoadParams, SourceArg};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: load_time PATH [REPEATS]")?;
    let repeats: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(3);
    for _ in 0..repeats {
        let t = Instant::now();
        let ds = load(SourceArg::Path(path.clone().into()), &LoadParams::default())?;
        let secs = t.elapsed().as_secs_f64();
        let dense = ds.dense()?;
        let sum: u64 = (0..dense.len()).map(|i| dense.get(i).unwrap_or(0)).sum();
        println!(
            "load {secs:.3} s  {:.2} GB/s  sum {sum}  {:?}",
            dense.nbytes() as f64 / secs / 1e9,
            ds.provenance()
                .timings
                .iter()
                .map(|t| format!("{}={:.3}", t.stage, t.seconds))
                .collect::<Vec<_>>()
        );
    }
    Ok(())
}
