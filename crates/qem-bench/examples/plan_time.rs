//! Times the host-side planning of a GPU load on a 512×512-frame index (no GPU needed):
//! `cargo run --release -p qem-bench --example plan_time`.
use qem_core::{DType, Shape2};
use qem_io::writer::{write_acquisition, WriteParams};
use qem_io::{OpenOptions, Source};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join("qem_plan_time");
    std::fs::create_dir_all(&dir)?;
    let params = WriteParams {
        prefix: dir.join("p"),
        scan_shape: Shape2::new(512, 512),
        detector_shape: Shape2::new(4, 4),
        dtype: DType::U16,
        frames_per_file: 10_000,
        ..WriteParams::default()
    };
    let written = write_acquisition(&params, |f, out: &mut [u8]| out.fill(f as u8))?;
    let mut plans = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let src = Source::open(&written.master, &OpenOptions::default())?;
        let t_open = t.elapsed().as_secs_f64();
        let frames: Vec<u64> = (0..src.n_frames).collect();
        let t = Instant::now();
        let locate = |n: u64| -> qem_core::Result<usize> {
            Ok(src.chunks.partition_point(|c| c.first_frame <= n) - 1)
        };
        let plan = qem_cuda::load::plan_chunks(&src.chunks, &frames, 32, locate, 128 << 20, None)?;
        let t_plan = t.elapsed().as_secs_f64();
        plans.push(t_plan);
        let t = Instant::now();
        let contiguous = plan.chunks_map_contiguously();
        let t_contig = t.elapsed().as_secs_f64();
        println!(
            "open {t_open:.4} s (cached index: {}), plan_chunks {t_plan:.4} s, contiguous {contiguous} {t_contig:.4} s, {} batches",
            src.index_from_cache,
            plan.batches.len()
        );
    }
    plans.sort_by(f64::total_cmp);
    println!(
        "plan_chunks p50 of {}: {:.4} s",
        plans.len(),
        plans[plans.len() / 2]
    );
    Ok(())
}
