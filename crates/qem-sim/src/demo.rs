//! The demo acquisition written to files (feature `files`): [`write_demo`] simulates
//! [`SimParams`] and writes it as a Dectris-style master + bitshuffle/LZ4 shards, with a few
//! detector pixels marked bad in the `pixel_mask` and reading 65535 in the data (as on an ARINA).
//! The `demo` and `serve --demo` commands and the browse service's demo call it, so all three
//! show the same acquisition.

use crate::{simulate, SimOutput, SimParams};
use qem_core::{DType, Result};
use qem_io::writer::{self, WriteCompression, WriteLayout, WriteParams, Written};
use std::path::Path;

/// Bad pixels of the demo detector: `(row, col, pixel_mask bits)` — dead (2) inside the BF disk,
/// noisy (16) in the ADF annulus, hot (8) in a corner (all inside a 64×64 detector).
pub const DEMO_BAD_PIXELS: [(usize, usize, u32); 3] = [(28, 38, 2), (50, 13, 16), (3, 5, 8)];

/// Frames per data shard, so that the 1920-frame default demo spans two shards.
pub const DEMO_FRAMES_PER_FILE: u64 = 1000;

/// A written demo acquisition.
#[derive(Debug)]
pub struct DemoAcquisition {
    /// The simulation (counts before the bad pixels were set, ground truth, calibration).
    pub sim: SimOutput,
    /// The files (`written.master` is the master file).
    pub written: Written,
    /// The `pixel_mask` written (bits per detector pixel, 0 = good).
    pub pixel_mask: Vec<u32>,
}

/// Simulate `params` and write it under `dir` as `demo_master.h5` + shards ([`write_simulated`]).
pub fn write_demo(dir: &Path, params: &SimParams) -> Result<DemoAcquisition> {
    let sim = simulate(params)?;
    let (written, pixel_mask) = write_simulated(dir, &sim)?;
    Ok(DemoAcquisition {
        sim,
        written,
        pixel_mask,
    })
}

/// Write a simulation under `dir` as `demo_master.h5` + shards, the pixels of
/// [`DEMO_BAD_PIXELS`] (those inside the detector) marked in the `pixel_mask` and set to 65535
/// in the data. Returns the files and the `pixel_mask` written.
pub fn write_simulated(dir: &Path, sim: &SimOutput) -> Result<(Written, Vec<u32>)> {
    let params = &sim.params;
    let cal = sim.calibration;
    let (scan, det) = (params.scan_shape, params.detector_shape);
    let frame_len = det.len();
    let mut pixel_mask = vec![0u32; frame_len];
    for &(r, c, bits) in &DEMO_BAD_PIXELS {
        if r < det.rows && c < det.cols {
            pixel_mask[r * det.cols + c] = bits;
        }
    }
    let write_params = WriteParams {
        prefix: dir.join("demo"),
        scan_shape: scan,
        detector_shape: det,
        dtype: DType::U16,
        frames_per_file: DEMO_FRAMES_PER_FILE,
        frames_per_chunk: 1,
        block_elems: 0,
        compression: WriteCompression::Bslz4,
        layout: WriteLayout::Shards,
        pixel_mask: Some(pixel_mask.clone()),
        calibration: writer::Calibration {
            energy_ev: Some(params.voltage_kv * 1e3),
            semiangle_mrad: Some(params.semiangle_mrad),
            scan_step_a: Some((cal.scan_step_a, cal.scan_step_a)),
            angular_sampling_mrad: Some((cal.angular_sampling_mrad, cal.angular_sampling_mrad)),
            ..Default::default()
        },
        skip_frames: Vec::new(),
        write_scan_shape: true,
    };
    let written = writer::write_acquisition(&write_params, |n, buf| {
        let start = n as usize * frame_len;
        let src = &sim.counts[start..start + frame_len];
        for ((dst, &v), &m) in buf.chunks_exact_mut(2).zip(src).zip(&pixel_mask) {
            let v = if m != 0 { u16::MAX } else { v };
            dst.copy_from_slice(&v.to_le_bytes());
        }
    })?;
    Ok((written, pixel_mask))
}
