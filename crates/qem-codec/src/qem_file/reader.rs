//! The `.qem` reader: [`QemFile::open`] / [`QemFile::open_lazy`] parse and verify header, table,
//! sections, metadata and stream index; [`QemFile::verify`] checks the Streams checksum later.
//! Called by the `qem` crate's loader and tests.

use std::fs;
use std::ops::Range;
use std::path::Path;

use super::{
    crc32c, io_err, le_u16, le_u32, le_u64, malformed, FormatVersion, Location, QemFileError,
    Result, SectionInfo, SectionKind, StreamEntry, FORMAT_MAJOR, HEADER_LEN, INDEX_ENTRY_LEN,
    MAGIC, REQUIRED_FLAGS_MASK, SECTION_ALIGN, STREAM_ALIGN, TABLE_ENTRY_LEN,
};

/// An opened, validated `.qem` file held in memory.
#[derive(Debug)]
pub struct QemFile {
    bytes: Vec<u8>,
    version: FormatVersion,
    flags: u32,
    sections: Vec<SectionInfo>,
    metadata: serde_json::Value,
    codec_tables: Range<usize>,
    index: Range<usize>,
    streams: Range<usize>,
    n_streams: usize,
    streams_verified: bool,
}

/// How much [`QemFile::parse`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    All,
    AllButStreams,
}

impl QemFile {
    /// Read and fully validate `path`: header, table, every section checksum, metadata, index.
    pub fn open(path: impl AsRef<Path>) -> Result<QemFile> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(|e| io_err("read", path, &e))?;
        Self::parse(bytes, Verify::All)
    }

    /// Like [`open`](Self::open) but without the Streams checksum; call [`verify`](Self::verify)
    /// to check it later. Every other check (including the index bounds) is made.
    pub fn open_lazy(path: impl AsRef<Path>) -> Result<QemFile> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(|e| io_err("read", path, &e))?;
        Self::parse(bytes, Verify::AllButStreams)
    }

    /// Validate a whole file already in memory (all checksums).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<QemFile> {
        Self::parse(bytes, Verify::All)
    }

    /// Check the Streams checksum if it has not been checked yet.
    pub fn verify(&mut self) -> Result<()> {
        if !self.streams_verified {
            if let Some(s) = self
                .sections
                .iter()
                .find(|s| s.kind == SectionKind::Streams)
            {
                check_crc(&self.bytes, self.streams.clone(), s)?;
            }
            self.streams_verified = true;
        }
        Ok(())
    }

    /// Whether the Streams checksum has been verified (always after [`open`](Self::open)).
    pub fn streams_verified(&self) -> bool {
        self.streams_verified
    }

    /// The format version of the file.
    pub fn version(&self) -> FormatVersion {
        self.version
    }

    /// The header flags.
    pub fn flags(&self) -> u32 {
        self.flags
    }

    /// Every section-table entry, unknown kinds included, in file order.
    pub fn sections(&self) -> &[SectionInfo] {
        &self.sections
    }

    /// The metadata JSON.
    pub fn metadata(&self) -> &serde_json::Value {
        &self.metadata
    }

    /// The codec tables' bytes.
    pub fn codec_tables(&self) -> &[u8] {
        self.bytes.get(self.codec_tables.clone()).unwrap_or(&[])
    }

    /// Number of streams.
    pub fn n_streams(&self) -> usize {
        self.n_streams
    }

    /// The index entry of stream `i`.
    pub fn stream_entry(&self, i: usize) -> Result<StreamEntry> {
        let start = i
            .checked_mul(INDEX_ENTRY_LEN)
            .filter(|_| i < self.n_streams)
            .ok_or(QemFileError::StreamOutOfRange {
                index: i,
                n_streams: self.n_streams,
            })?;
        let raw = self.index_raw();
        Ok(StreamEntry::from_bytes(
            raw.get(start..start + INDEX_ENTRY_LEN).unwrap_or(&[]),
        ))
    }

    /// The bytes of stream `i`.
    pub fn stream(&self, i: usize) -> Result<&[u8]> {
        let e = self.stream_entry(i)?;
        // Bounds were validated at open; the conversions cannot fail then, but stay checked.
        let start = usize::try_from(e.offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(e.length as usize);
        self.streams_bytes().get(start..end).ok_or_else(|| {
            malformed(
                Location::Section(SectionKind::StreamIndex),
                "stream out of bounds",
            )
        })
    }

    /// The whole Streams section (offsets in the index count from its first byte).
    pub fn streams_bytes(&self) -> &[u8] {
        self.bytes.get(self.streams.clone()).unwrap_or(&[])
    }

    /// The StreamIndex section as stored: `n_streams` little-endian 16-byte [`StreamEntry`]s,
    /// ready to upload to a GPU.
    pub fn index_raw(&self) -> &[u8] {
        self.bytes.get(self.index.clone()).unwrap_or(&[])
    }

    fn parse(bytes: Vec<u8>, verify: Verify) -> Result<QemFile> {
        let file_len = bytes.len() as u64;
        let header = bytes.get(..HEADER_LEN).ok_or(QemFileError::Truncated {
            what: "header",
            needed: HEADER_LEN as u64,
            available: file_len,
        })?;
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&header[..8]);
        if magic != MAGIC {
            return Err(QemFileError::BadMagic { found: magic });
        }
        let major = le_u16(header, 8);
        if major != FORMAT_MAJOR {
            return Err(QemFileError::Version {
                expected: FORMAT_MAJOR,
                found: major,
            });
        }
        let stored = le_u32(header, 60);
        let computed = crc32c(&header[..60]);
        if stored != computed {
            return Err(QemFileError::Checksum {
                location: Location::Header,
                expected: stored,
                found: computed,
            });
        }
        let minor = le_u16(header, 10);
        let flags = le_u32(header, 12);
        if flags & REQUIRED_FLAGS_MASK != 0 {
            return Err(malformed(
                Location::Header,
                format!(
                    "required feature flags {:#06x} are not known to this reader",
                    flags & REQUIRED_FLAGS_MASK
                ),
            ));
        }
        let section_count = le_u32(header, 16);
        let table_crc = le_u32(header, 20);
        let table_offset = le_u64(header, 24);
        let recorded_len = le_u64(header, 32);
        if recorded_len > file_len {
            return Err(QemFileError::Truncated {
                what: "file length in the header",
                needed: recorded_len,
                available: file_len,
            });
        }
        if recorded_len < file_len {
            return Err(malformed(
                Location::File,
                format!(
                    "{} trailing bytes after the recorded file length {recorded_len}",
                    file_len - recorded_len
                ),
            ));
        }
        if table_offset < HEADER_LEN as u64 || table_offset % SECTION_ALIGN != 0 {
            return Err(malformed(
                Location::Header,
                format!(
                    "section table offset {table_offset} is not a multiple of 64 after the header"
                ),
            ));
        }
        let table_end = u64::from(section_count)
            .checked_mul(TABLE_ENTRY_LEN as u64)
            .and_then(|n| n.checked_add(table_offset))
            .filter(|&end| end <= file_len)
            .ok_or_else(|| {
                malformed(
                    Location::SectionTable,
                    format!(
                        "{section_count} entries at byte {table_offset} do not fit in the {file_len}-byte file"
                    ),
                )
            })?;
        let table = &bytes[to_usize(table_offset)?..to_usize(table_end)?];
        let computed = crc32c(table);
        if computed != table_crc {
            return Err(QemFileError::Checksum {
                location: Location::SectionTable,
                expected: table_crc,
                found: computed,
            });
        }
        // Bytes between the header and the table must be zero.
        check_zero(&bytes, HEADER_LEN as u64, table_offset)?;

        let mut sections = Vec::with_capacity(section_count as usize);
        let mut prev_end = table_end;
        for entry in table.chunks_exact(TABLE_ENTRY_LEN) {
            let id = le_u32(entry, 0);
            let info = SectionInfo {
                kind: SectionKind::from_id(id),
                offset: le_u64(entry, 8),
                length: le_u64(entry, 16),
                crc32c: le_u32(entry, 24),
            };
            let loc = Location::Section(info.kind);
            if id == 0 {
                return Err(malformed(
                    Location::SectionTable,
                    "section kind 0 is invalid",
                ));
            }
            check_start(
                loc,
                None,
                info.offset,
                SECTION_ALIGN,
                prev_end,
                "the previous section or the table",
            )?;
            let end = info
                .offset
                .checked_add(info.length)
                .filter(|&e| e <= file_len)
                .ok_or_else(|| {
                    malformed(
                        loc,
                        format!(
                            "{} bytes at byte {} run past the {file_len}-byte file",
                            info.length, info.offset
                        ),
                    )
                })?;
            if info.kind != SectionKind::Unknown(id)
                && sections.iter().any(|s: &SectionInfo| s.kind == info.kind)
            {
                return Err(malformed(loc, "the section appears twice"));
            }
            check_zero(&bytes, prev_end, info.offset)?;
            prev_end = end;
            sections.push(info);
        }
        check_zero(&bytes, prev_end, file_len)?;

        let find = |kind: SectionKind| -> Result<(SectionInfo, Range<usize>)> {
            let s = sections
                .iter()
                .find(|s| s.kind == kind)
                .copied()
                .ok_or_else(|| malformed(Location::SectionTable, format!("no {kind} section")))?;
            Ok((s, to_usize(s.offset)?..to_usize(s.offset + s.length)?))
        };
        let (meta_info, meta_range) = find(SectionKind::Metadata)?;
        let (tables_info, tables_range) = find(SectionKind::CodecTables)?;
        let (index_info, index_range) = find(SectionKind::StreamIndex)?;
        let (streams_info, streams_range) = find(SectionKind::Streams)?;

        for s in &sections {
            if s.kind == SectionKind::Streams && verify == Verify::AllButStreams {
                continue;
            }
            check_crc(
                &bytes,
                to_usize(s.offset)?..to_usize(s.offset + s.length)?,
                s,
            )?;
        }
        let _ = (tables_info, index_info, streams_info);

        let metadata: serde_json::Value = serde_json::from_slice(&bytes[meta_range.clone()])
            .map_err(|e| {
                malformed(
                    Location::Section(meta_info.kind),
                    format!("not UTF-8 JSON: {e}"),
                )
            })?;

        let index = &bytes[index_range.clone()];
        let index_loc = Location::Section(SectionKind::StreamIndex);
        if index.len() % INDEX_ENTRY_LEN != 0 {
            return Err(malformed(
                index_loc,
                format!(
                    "length {} is not a multiple of the {INDEX_ENTRY_LEN}-byte entry",
                    index.len()
                ),
            ));
        }
        let streams_len = streams_range.len() as u64;
        let mut prev_end = 0u64;
        for (i, raw) in index.chunks_exact(INDEX_ENTRY_LEN).enumerate() {
            let e = StreamEntry::from_bytes(raw);
            check_start(
                index_loc,
                Some(i),
                e.offset,
                STREAM_ALIGN,
                prev_end,
                "the previous stream",
            )?;
            if e.end() > streams_len {
                return Err(malformed(
                    index_loc,
                    format!(
                        "stream {i}: {} bytes at offset {} run past the {streams_len}-byte Streams section",
                        e.length, e.offset
                    ),
                ));
            }
            prev_end = e.end();
        }
        let n_streams = index.len() / INDEX_ENTRY_LEN;

        Ok(QemFile {
            bytes,
            version: FormatVersion { major, minor },
            flags,
            sections,
            metadata,
            codec_tables: tables_range,
            index: index_range,
            streams: streams_range,
            n_streams,
            streams_verified: verify == Verify::All,
        })
    }
}

/// Check where a section (`stream` `None`) or stream `i` starts: `offset` is a multiple of
/// `align` and does not overlap what comes before it (`previous`, which ends at `prev_end`).
fn check_start(
    loc: Location,
    stream: Option<usize>,
    offset: u64,
    align: u64,
    prev_end: u64,
    previous: &str,
) -> Result<()> {
    let label = || stream.map_or(String::new(), |i| format!("stream {i}: "));
    if offset % align != 0 {
        return Err(malformed(
            loc,
            format!("{}offset {offset} is not a multiple of {align}", label()),
        ));
    }
    if offset < prev_end {
        return Err(malformed(
            loc,
            format!(
                "{}offset {offset} overlaps {previous} (ends at {prev_end})",
                label()
            ),
        ));
    }
    Ok(())
}

fn to_usize(x: u64) -> Result<usize> {
    usize::try_from(x).map_err(|_| {
        malformed(
            Location::File,
            format!("offset {x} does not fit this platform's address space"),
        )
    })
}

fn check_crc(bytes: &[u8], range: Range<usize>, s: &SectionInfo) -> Result<()> {
    let found = crc32c(bytes.get(range).unwrap_or(&[]));
    if found != s.crc32c {
        return Err(QemFileError::Checksum {
            location: Location::Section(s.kind),
            expected: s.crc32c,
            found,
        });
    }
    Ok(())
}

/// Require `bytes[start..end]` (alignment padding) to be zero.
fn check_zero(bytes: &[u8], start: u64, end: u64) -> Result<()> {
    let (s, e) = (to_usize(start)?, to_usize(end)?);
    if let Some(gap) = bytes.get(s..e) {
        if let Some(p) = gap.iter().position(|&b| b != 0) {
            return Err(malformed(
                Location::Padding {
                    offset: start + p as u64,
                },
                "padding between sections must be zero",
            ));
        }
    }
    Ok(())
}
