//! Set-up shared by the integration tests of `qem-io`.

use qem_core::{DType, Shape2};
use qem_io::writer::{write_acquisition, WriteCompression, WriteParams};
use std::path::{Path, PathBuf};

/// Write a small uncompressed `u16` Dectris-style acquisition `dir/name`: `scan` frames of
/// 4 × 4 pixels, `frames_per_file` per data shard, each frame filled with its index (mod 256).
/// Returns the master file.
pub fn small_acquisition(dir: &Path, name: &str, scan: Shape2, frames_per_file: u64) -> PathBuf {
    let p = WriteParams {
        prefix: dir.join(name),
        scan_shape: scan,
        detector_shape: Shape2::new(4, 4),
        dtype: DType::U16,
        frames_per_file,
        compression: WriteCompression::None,
        ..WriteParams::default()
    };
    write_acquisition(&p, |n, buf| buf.fill(n as u8))
        .unwrap()
        .master
}
