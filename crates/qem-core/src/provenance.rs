//! Provenance: what a result was made from and how.

use crate::dtype::DType;
use crate::geometry::{Region, Shape2};
use crate::metadata::MaskPolicy;
use std::path::{Path, PathBuf};

/// Identity of one source file at the time it was read.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileIdentity {
    /// Absolute path.
    pub path: PathBuf,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i128,
}

impl FileIdentity {
    /// Stat `path`.
    pub fn of(path: &Path) -> crate::Result<FileIdentity> {
        let abs = std::fs::canonicalize(path).map_err(|e| crate::Error::io("stat", path, &e))?;
        let md = std::fs::metadata(&abs).map_err(|e| crate::Error::io("stat", path, &e))?;
        let mtime_ns = md
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as i128)
            .unwrap_or(0);
        Ok(FileIdentity {
            path: abs,
            size: md.len(),
            mtime_ns,
        })
    }
}

/// Wall time of one stage of an operation. Stages may overlap; they are never summed.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StageTiming {
    /// Stage name (`"plan"`, `"read+decode"`, ...).
    pub stage: String,
    /// Seconds.
    pub seconds: f64,
}

impl StageTiming {
    /// Stage `stage` took `seconds`.
    pub fn new(stage: impl Into<String>, seconds: f64) -> StageTiming {
        StageTiming {
            stage: stage.into(),
            seconds,
        }
    }
}

/// The record attached to every dataset and result.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Provenance {
    /// What kind of source (`"dectris_master"`, `"hdf5_dataset"`, `"array"` for in-memory arrays).
    pub source_kind: String,
    /// Identity of every file read.
    pub files: Vec<FileIdentity>,
    /// HDF5 dataset path, where applicable.
    pub dataset_path: Option<String>,
    /// FNV-1a 64 digest (hex) of the chunk index `(file, offset, size, filter_mask)` list.
    pub chunk_index_digest: Option<String>,
    /// Scan shape of the source.
    pub source_scan_shape: Shape2,
    /// Detector shape of the source.
    pub source_detector_shape: Shape2,
    /// Scan region loaded (half-open); `None` = all.
    pub scan_region: Option<Region>,
    /// Detector region loaded (half-open, in source pixels, before binning); `None` = all.
    pub detector_region: Option<Region>,
    /// Detector bin factor (1 = none).
    pub det_bin: usize,
    /// Source element type.
    pub source_dtype: DType,
    /// Working (decode) element type.
    pub working_dtype: DType,
    /// Accumulation type of integer sums (`"u64"`).
    pub accumulation_dtype: String,
    /// Result element type.
    pub result_dtype: DType,
    /// Number of values clipped by a saturating u8 request (0 otherwise).
    pub saturated_values: u64,
    /// Bad-pixel policy.
    pub mask_policy: MaskPolicy,
    /// Backend that produced the data (`"cpu"`, `"cuda"`).
    pub backend: String,
    /// Device description (CPU model and threads, or GPU model/driver/CUDA version).
    pub device: String,
    /// Package version.
    pub package_version: String,
    /// Git revision of the build (or `"unknown"`).
    pub git_revision: String,
    /// Stage timings of the operation that produced this.
    pub timings: Vec<StageTiming>,
    /// Device-memory accounting of a GPU load (`None` on the CPU).
    #[serde(default)]
    pub memory: Option<MemoryReport>,
    /// How the counts are held: `"dense"` or `"encoded"` (`None` in records made before the
    /// field existed).
    #[serde(default)]
    pub representation: Option<String>,
    /// The entropy codec of an ENCODED dataset (`None` for dense data).
    #[serde(default)]
    pub codec: Option<CodecInfo>,
    /// The provenance of the dataset a `.qem` file was written from (its original source
    /// files, regions, bins and mask policy), when this one was read from a `.qem` file.
    #[serde(default)]
    pub converted_from: Option<Box<Provenance>>,
}

/// The entropy codec of an ENCODED dataset and what it achieved.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CodecInfo {
    /// Codec name (`"rans-counts v2"`).
    pub name: String,
    /// Version of the codec's stream and table format.
    pub version: u32,
    /// The model's parameters (contexts, literals, probability bits, floor policy, ...).
    pub model: serde_json::Value,
    /// Frames the model was fitted on.
    pub fit_frames: u64,
    /// Bytes of the encoded form (streams + index + model).
    pub encoded_bytes: u64,
    /// Bytes of the same data dense, in the result dtype.
    pub dense_bytes: u64,
    /// `dense_bytes / encoded_bytes`.
    pub ratio_to_dense: f64,
    /// Compressed bytes the source stored for the same frames, when known.
    pub source_compressed_bytes: Option<u64>,
    /// `source_compressed_bytes / encoded_bytes`, when known.
    pub ratio_to_source: Option<f64>,
}

/// Device-memory accounting of a GPU operation, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct MemoryReport {
    /// Sum of every device buffer the operation planned (and admitted) before allocating.
    pub planned_device_bytes: u64,
    /// The limit it was admitted against: `min(memory_budget, free - reserve)`.
    pub budget_bytes: u64,
    /// Peak of the sum of this operation's own device allocations.
    pub process_peak_device_bytes: u64,
    /// Card memory in use (total - free) before the operation allocated anything.
    pub card_used_before_bytes: u64,
    /// Card memory in use sampled at the operation's allocation peak.
    pub card_used_peak_bytes: u64,
    /// Total card memory.
    pub card_total_bytes: u64,
}

/// 64-bit FNV-1a over `bytes`, continuing from `state` (start with [`FNV_OFFSET`]).
pub fn fnv1a64(state: u64, bytes: &[u8]) -> u64 {
    let mut h = state;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Initial state of [`fnv1a64`].
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_known_value() {
        // FNV-1a 64 of "a" is 0xaf63dc4c8601ec8c (published test value).
        assert_eq!(fnv1a64(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
