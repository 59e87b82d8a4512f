//! Element types and the dtype policy of a load.
//!
//! Four stages stay distinct: the *source* dtype (what the file stores), the *working* dtype
//! (what decode produces, always the source dtype), the *accumulation* dtype (u64 for every
//! integer sum) and the *result* dtype (what the caller gets). Narrowing never happens silently:
//! `u32 -> u16` only when every value fits, `u8` only on explicit saturating request.

use std::fmt;

/// An unsigned integer element type of detector counts.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 8-bit unsigned.
    U8,
    /// 16-bit unsigned.
    U16,
    /// 32-bit unsigned.
    U32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::U16 => 2,
            DType::U32 => 4,
        }
    }
    /// Largest representable value.
    pub fn max_value(self) -> u64 {
        match self {
            DType::U8 => u8::MAX as u64,
            DType::U16 => u16::MAX as u64,
            DType::U32 => u32::MAX as u64,
        }
    }
    /// The dtype with `size` bytes per element, if any.
    pub fn from_size(size: usize) -> Option<DType> {
        match size {
            1 => Some(DType::U8),
            2 => Some(DType::U16),
            4 => Some(DType::U32),
            _ => None,
        }
    }
    /// NumPy-style name (`"uint16"`).
    pub fn numpy_name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
        })
    }
}

/// What result dtype the caller asked for.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum DtypeRequest {
    /// The source dtype, widened to u32 only when detector binning can overflow it.
    #[default]
    Native,
    /// u16: exact; from u32 sources only when every value fits (else an Overflow error).
    U16,
    /// u32: always exact.
    U32,
    /// u8 saturating at 255; the number of saturated values is recorded in provenance.
    U8Saturating,
}

crate::named_choice! {
    /// Lower-case name (`"native"`, `"u16"`, `"u32"`, `"u8"`), what `from_str` reads back (which
    /// also takes `"none"`, `"uint16"`, `"uint32"`, `"uint8"` and `"u8_saturating"`).
    DtypeRequest, "parse dtype", "dtype", {
        Native => "native" | "none",
        U16 => "u16" | "uint16",
        U32 => "u32" | "uint32",
        U8Saturating => "u8" | "uint8" | "u8_saturating",
    }
}

impl fmt::Display for DtypeRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl DtypeRequest {
    /// The result dtype for a source of `source` dtype whose values can reach `max_possible`
    /// after binning (`max_possible = source max × pixels per bin`).
    ///
    /// `Native` keeps the source dtype unless binned sums can exceed it, then widens to u32.
    /// Whether an explicit `U16` actually fits is checked on the data, not here.
    pub fn result_dtype(self, source: DType, max_possible: u64) -> DType {
        match self {
            DtypeRequest::Native => {
                if max_possible <= source.max_value() {
                    source
                } else {
                    DType::U32
                }
            }
            DtypeRequest::U16 => DType::U16,
            DtypeRequest::U32 => DType::U32,
            DtypeRequest::U8Saturating => DType::U8,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_widens_only_when_bins_can_overflow() {
        assert_eq!(
            DtypeRequest::Native.result_dtype(DType::U16, 65535),
            DType::U16
        );
        assert_eq!(
            DtypeRequest::Native.result_dtype(DType::U16, 4 * 65535),
            DType::U32
        );
        assert_eq!(
            DtypeRequest::Native.result_dtype(DType::U32, 4 * 65535),
            DType::U32
        );
        assert_eq!(
            DtypeRequest::U8Saturating.result_dtype(DType::U16, 1),
            DType::U8
        );
    }

    #[test]
    fn parse_rejects_unknown_names() {
        assert_eq!("u16".parse::<DtypeRequest>().ok(), Some(DtypeRequest::U16));
        let err = "f32".parse::<DtypeRequest>().err();
        assert!(err.is_some_and(|e| e.to_string().contains("f32")));
    }
}
