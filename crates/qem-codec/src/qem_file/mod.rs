//! The `.qem` container: an acquisition's entropy-coded form on disk, reopened straight onto the
//! GPU without re-encoding.
//!
//! The container stores opaque byte sections; it does not know the codec. It gives each section a
//! checksum, writes atomically (temporary file, `fsync`, rename, directory `fsync`) and rejects
//! truncated, bit-flipped and wrong-version files with a typed [`QemFileError`], never a panic.
//!
//! # Byte layout, format 1.0
//!
//! All integers are little-endian. Every section starts at a file offset that is a multiple of
//! [`SECTION_ALIGN`] (64), so a reader can map the file or DMA a section directly.
//!
//! ```text
//! Fixed header, 64 bytes at offset 0
//!   0  u8[8]  magic "QEM4DSTM"
//!   8  u16    format major version (1). A reader rejects any other major version.
//!  10  u16    format minor version (0). Newer minors only add section kinds, which older readers skip.
//!  12  u32    flags. Bits 0-15: required features, a reader rejects bits it does not know;
//!             bits 16-31: optional, ignored. Format 1.0 defines none (all written 0).
//!  16  u32    section_count
//!  20  u32    CRC-32C of the section table (section_count * 32 bytes)
//!  24  u64    section table offset (64 in 1.0 files; any multiple of 64 >= 64 is accepted)
//!  32  u64    file length in bytes (the whole file; a shorter file is truncated)
//!  40  u8[20] reserved, written 0 (covered by the header checksum, otherwise ignored)
//!  60  u32    CRC-32C of header bytes 0..60
//! Section table: section_count entries of 32 bytes, in ascending offset order
//!   0  u32    kind: 1 Metadata, 2 CodecTables, 3 StreamIndex, 4 Streams; 0 is invalid;
//!             other kinds (from a newer minor version) are checksum-verified and skipped
//!   4  u32    reserved, written 0
//!   8  u64    offset of the section in the file (multiple of 64)
//!  16  u64    length of the section in bytes (padding not included)
//!  24  u32    CRC-32C of the section's `length` bytes
//!  28  u32    reserved, written 0
//! Sections (each known kind exactly once), in any order, not overlapping each other nor the
//! header/table. Every byte between sections and after the last one (alignment padding) must be 0.
//!   Metadata     UTF-8 JSON (one value: the caller's metadata and provenance)
//!   CodecTables  opaque bytes for the codec (e.g. the rANS dataset header, ctx_map, frequencies)
//!   StreamIndex  n_streams entries of 16 bytes, uploadable to a GPU as is:
//!                  u64 offset of the stream inside the Streams section (multiple of 16)
//!                  u32 length of the stream in bytes
//!                  u32 tag: defined by the codec (e.g. frames in the stream, or flags)
//!                entries in stream order; offset[i] >= offset[i-1] + length[i-1] (monotonic, no
//!                overlap; empty streams allowed); offset + length <= Streams length
//!   Streams      the streams' bytes; each starts at a multiple of [`STREAM_ALIGN`] (16) inside
//!                the section, so at a 16-byte-aligned file offset; the gaps are written 0
//! ```
//!
//! The 1.0 writer lays the file out as header, table, Streams, StreamIndex, CodecTables, Metadata,
//! so streams can be written as they come and the small sections (known only at the end) follow.
//!
//! # Checksums: CRC-32C, every bit covered
//!
//! CRC-32C (Castagnoli, reflected polynomial `0x82F63B78`, init and xor-out `0xFFFFFFFF`; the
//! iSCSI/ext4 checksum, `crc32c` in Python) over: the header (its own field), the section table
//! (a header field), and each section (its table entry). Alignment gaps must be zero and the file
//! length is recorded in the header, so a single flipped bit anywhere in a valid file is detected
//! by a checksum or a structure check. The CRC comes from the `crc32c` crate (the CPU's CRC
//! instruction where it has one).
//!
//! # Reading: one plain read, checksums at open
//!
//! [`QemFile::open`] reads the whole file into memory with one `read` and verifies the header, the
//! table, every section's checksum, the metadata JSON and the stream index.
//! [`QemFile::open_lazy`] skips only the Streams checksum (the large one; the rANS decoder's own
//! end-state check detects corrupt streams at almost no cost); [`QemFile::verify`] checks it later.
//! Trade-off: a plain read costs one heap copy of the file, but needs no `unsafe` and cannot fault
//! (a memory map raises SIGBUS if another process truncates the file under it). A map would share the
//! page cache between concurrent readers and touch only what is used; the layout allows one
//! (64-byte-aligned sections), and it can be added behind the same accessors.
//!
//! Structure errors carry no path (like every [`crate::CodecError`]: callers add the file); IO
//! errors carry the path.
//!
//! Files: this module holds the layout constants, errors, section kinds and field readers;
//! `crc` the CRC-32C, `writer` the atomic [`QemWriter`], `reader` [`QemFile`] (parse and
//! verification), `tests` the CRC unit tests.

mod crc;
mod reader;
#[cfg(test)]
mod tests;
mod writer;

pub use crc::{crc32c, Crc32c};
pub use reader::QemFile;
pub use writer::{QemWriteSummary, QemWriter};

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// The 8 magic bytes at the start of every `.qem` file.
pub const MAGIC: [u8; 8] = *b"QEM4DSTM";
/// The format major version this code reads and writes.
pub const FORMAT_MAJOR: u16 = 1;
/// The format minor version this code writes.
pub const FORMAT_MINOR: u16 = 0;
/// Size of the fixed header in bytes.
pub const HEADER_LEN: usize = 64;
/// Size of one section-table entry in bytes.
pub const TABLE_ENTRY_LEN: usize = 32;
/// Size of one stream-index entry in bytes.
pub const INDEX_ENTRY_LEN: usize = 16;
/// Every section starts at a multiple of this many bytes.
pub const SECTION_ALIGN: u64 = 64;
/// Every stream starts at a multiple of this many bytes inside the Streams section.
pub const STREAM_ALIGN: u64 = 16;

/// Header flag bits a reader must understand (none are defined in format 1.0).
const REQUIRED_FLAGS_MASK: u32 = 0x0000_ffff;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Where in a `.qem` file a problem was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Location {
    /// The whole file (its length).
    File,
    /// The 64-byte fixed header.
    Header,
    /// The section table.
    SectionTable,
    /// A section of this kind.
    Section(SectionKind),
    /// The zero padding after the section at this file offset (or after the table).
    Padding {
        /// File offset of the first non-zero padding byte.
        offset: u64,
    },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::File => write!(f, "file"),
            Location::Header => write!(f, "header"),
            Location::SectionTable => write!(f, "section table"),
            Location::Section(kind) => write!(f, "{kind} section"),
            Location::Padding { offset } => write!(f, "padding at byte {offset}"),
        }
    }
}

/// Why a `.qem` file could not be written, opened or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QemFileError {
    /// An operating-system call failed.
    #[error("{op} {}: {message}", path.display())]
    Io {
        /// What was being done, e.g. `"open"`, `"fsync"`, `"rename onto"`.
        op: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The IO error kind.
        kind: io::ErrorKind,
        /// The IO error's message.
        message: String,
    },
    /// The file does not start with [`MAGIC`].
    #[error("not a .qem file: magic {found:02x?}, expected {MAGIC:02x?}")]
    BadMagic {
        /// The first 8 bytes found.
        found: [u8; 8],
    },
    /// The format major version is not the one this reader understands.
    #[error(".qem format major version {found} is not supported: this reader reads version {expected}.x")]
    Version {
        /// [`FORMAT_MAJOR`].
        expected: u16,
        /// The major version in the file.
        found: u16,
    },
    /// The file ends before something it describes.
    #[error("truncated .qem file: the {what} needs {needed} bytes, the file has {available}")]
    Truncated {
        /// What needed the bytes, e.g. `"header"` or `"file length in the header"`.
        what: &'static str,
        /// Bytes needed from the start of the file.
        needed: u64,
        /// Bytes the file has.
        available: u64,
    },
    /// A stored checksum does not match the bytes.
    #[error(
        "{location} checksum mismatch: stored CRC-32C {expected:#010x}, computed {found:#010x}"
    )]
    Checksum {
        /// Which part of the file.
        location: Location,
        /// The checksum stored in the file.
        expected: u32,
        /// The checksum of the bytes as found.
        found: u32,
    },
    /// The bytes are internally inconsistent (bad offsets, lengths, kinds, JSON, index).
    #[error("malformed .qem {location}: {reason}")]
    Malformed {
        /// Which part of the file.
        location: Location,
        /// The rule that was broken, with the values found.
        reason: String,
    },
    /// A stream number past the end of the index was asked for.
    #[error("stream {index} out of range: the file has {n_streams} streams")]
    StreamOutOfRange {
        /// The stream asked for.
        index: usize,
        /// Streams in the file.
        n_streams: usize,
    },
    /// The writer cannot store what it was given, or an earlier error left it unusable.
    #[error("cannot write .qem file: {reason}")]
    Write {
        /// Why.
        reason: String,
    },
}

/// Result alias for the container.
pub type Result<T> = std::result::Result<T, QemFileError>;

fn io_err(op: &'static str, path: &Path, e: &io::Error) -> QemFileError {
    QemFileError::Io {
        op,
        path: path.to_path_buf(),
        kind: e.kind(),
        message: e.to_string(),
    }
}

fn malformed(location: Location, reason: impl Into<String>) -> QemFileError {
    QemFileError::Malformed {
        location,
        reason: reason.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Section kinds and entries
// ---------------------------------------------------------------------------------------------

/// The kind of a section, from its table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SectionKind {
    /// UTF-8 JSON metadata and provenance (kind 1).
    Metadata,
    /// Opaque codec tables (kind 2).
    CodecTables,
    /// The stream index, 16 bytes per stream (kind 3).
    StreamIndex,
    /// The streams' bytes (kind 4).
    Streams,
    /// A kind this reader does not know (from a newer minor version): verified and skipped.
    Unknown(u32),
}

impl SectionKind {
    /// The kind's id in the section table.
    pub fn id(self) -> u32 {
        match self {
            SectionKind::Metadata => 1,
            SectionKind::CodecTables => 2,
            SectionKind::StreamIndex => 3,
            SectionKind::Streams => 4,
            SectionKind::Unknown(id) => id,
        }
    }

    /// The kind for a table id.
    pub fn from_id(id: u32) -> Self {
        match id {
            1 => SectionKind::Metadata,
            2 => SectionKind::CodecTables,
            3 => SectionKind::StreamIndex,
            4 => SectionKind::Streams,
            other => SectionKind::Unknown(other),
        }
    }
}

impl fmt::Display for SectionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SectionKind::Metadata => write!(f, "Metadata"),
            SectionKind::CodecTables => write!(f, "CodecTables"),
            SectionKind::StreamIndex => write!(f, "StreamIndex"),
            SectionKind::Streams => write!(f, "Streams"),
            SectionKind::Unknown(id) => write!(f, "unknown (kind {id})"),
        }
    }
}

/// One section-table entry as read from the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectionInfo {
    /// The section's kind.
    pub kind: SectionKind,
    /// File offset of its first byte.
    pub offset: u64,
    /// Its length in bytes.
    pub length: u64,
    /// Its stored CRC-32C.
    pub crc32c: u32,
}

/// One stream-index entry (16 bytes in the file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamEntry {
    /// Offset of the stream inside the Streams section (a multiple of [`STREAM_ALIGN`]).
    pub offset: u64,
    /// Length of the stream in bytes.
    pub length: u32,
    /// The codec's tag for this stream (e.g. frames in it, or flags); not interpreted here.
    pub tag: u32,
}

impl StreamEntry {
    fn to_bytes(self) -> [u8; INDEX_ENTRY_LEN] {
        let mut b = [0u8; INDEX_ENTRY_LEN];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.length.to_le_bytes());
        b[12..16].copy_from_slice(&self.tag.to_le_bytes());
        b
    }

    fn from_bytes(b: &[u8]) -> Self {
        StreamEntry {
            offset: le_u64(b, 0),
            length: le_u32(b, 8),
            tag: le_u32(b, 12),
        }
    }

    /// One past the stream's last byte inside the Streams section.
    fn end(self) -> u64 {
        self.offset.saturating_add(u64::from(self.length))
    }
}

/// The format version found in a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FormatVersion {
    /// Major version (always [`FORMAT_MAJOR`] for an opened file).
    pub major: u16,
    /// Minor version.
    pub minor: u16,
}

// Little-endian field readers. Callers pass slices whose length they have checked; a short slice
// reads as zeros instead of panicking (never reached, but keeps the parser panic-free).
fn le_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        a.copy_from_slice(s);
    }
    u16::from_le_bytes(a)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    u64::from_le_bytes(a)
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align).saturating_mul(align)
}
