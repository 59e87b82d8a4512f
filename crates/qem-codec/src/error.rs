//! Codec errors (no file or frame: callers add those).

/// Why a compressed buffer was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// Placeholder until the codec lands.
    #[error("{0}")]
    Other(String),
}
