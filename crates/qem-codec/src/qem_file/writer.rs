//! The `.qem` writer: streams appended to a temporary file, small sections, header and table at
//! [`QemWriter::finish`], then `fsync`, rename and directory `fsync`. Called by the `qem`
//! crate's `qemfile` module (encode to `.qem`) and tests.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    align_up, crc32c, io_err, Crc32c, QemFileError, Result, SectionKind, StreamEntry, FORMAT_MAJOR,
    FORMAT_MINOR, HEADER_LEN, INDEX_ENTRY_LEN, MAGIC, SECTION_ALIGN, STREAM_ALIGN, TABLE_ENTRY_LEN,
};

/// What [`QemWriter::finish`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemWriteSummary {
    /// The final path.
    pub path: PathBuf,
    /// File length in bytes.
    pub file_bytes: u64,
    /// Streams stored.
    pub n_streams: usize,
    /// Length of the Streams section in bytes.
    pub streams_bytes: u64,
}

/// The 1.0 writer always writes these four sections.
const WRITER_SECTIONS: usize = 4;
/// Offset of the Streams section in files from this writer (header + table, 64-aligned).
const WRITER_STREAMS_OFFSET: u64 = (HEADER_LEN + WRITER_SECTIONS * TABLE_ENTRY_LEN) as u64;

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes a `.qem` file atomically.
///
/// Streams go to `<path>.tmp-<pid>-<n>` (same directory) as they are given, so the Streams
/// section is never held in memory; metadata, codec tables and the index are kept until
/// [`finish`](Self::finish), which appends them, writes the header and table, `fsync`s the file,
/// renames it onto `path` and `fsync`s the directory. If `finish` fails, or the writer is dropped
/// without it, the temporary file is removed and `path` is untouched.
#[derive(Debug)]
pub struct QemWriter {
    path: PathBuf,
    tmp_path: PathBuf,
    file: Option<io::BufWriter<File>>,
    metadata: serde_json::Value,
    codec_tables: Vec<u8>,
    index: Vec<StreamEntry>,
    streams_len: u64,
    streams_crc: Crc32c,
    /// Set after an IO error mid-write: the temporary file is inconsistent.
    poisoned: bool,
}

impl QemWriter {
    /// Start writing `path` (created or replaced only by a successful [`finish`](Self::finish)).
    pub fn create(path: impl AsRef<Path>) -> Result<QemWriter> {
        let path = path.as_ref().to_path_buf();
        let name = path.file_name().ok_or_else(|| QemFileError::Write {
            reason: format!("{} has no file name", path.display()),
        })?;
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut tmp_name = name.to_os_string();
        tmp_name.push(format!(".tmp-{}-{n}", std::process::id()));
        let tmp_path = path.with_file_name(tmp_name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp_path)
            .map_err(|e| io_err("create", &tmp_path, &e))?;
        let mut w = QemWriter {
            path,
            tmp_path,
            file: Some(io::BufWriter::with_capacity(1 << 20, file)),
            metadata: serde_json::Value::Object(serde_json::Map::new()),
            codec_tables: Vec::new(),
            index: Vec::new(),
            streams_len: 0,
            streams_crc: Crc32c::new(),
            poisoned: false,
        };
        // Placeholder header and table, patched by `finish`.
        w.write_raw(&[0u8; WRITER_STREAMS_OFFSET as usize])?;
        Ok(w)
    }

    /// The metadata JSON (metadata and provenance); `{}` if never set.
    pub fn metadata(&mut self, json: serde_json::Value) -> &mut Self {
        self.metadata = json;
        self
    }

    /// The codec's tables, stored as given.
    pub fn codec_tables(&mut self, bytes: impl Into<Vec<u8>>) -> &mut Self {
        self.codec_tables = bytes.into();
        self
    }

    /// Append one stream with tag 0; returns its index.
    pub fn stream(&mut self, bytes: &[u8]) -> Result<usize> {
        self.stream_tagged(bytes, 0)
    }

    /// Append one stream with the codec's `tag` (see [`StreamEntry::tag`]); returns its index.
    pub fn stream_tagged(&mut self, bytes: &[u8], tag: u32) -> Result<usize> {
        self.check_usable()?;
        let length = u32::try_from(bytes.len()).map_err(|_| QemFileError::Write {
            reason: format!(
                "stream {} is {} bytes; a stream holds at most {} bytes",
                self.index.len(),
                bytes.len(),
                u32::MAX
            ),
        })?;
        let offset = align_up(self.streams_len, STREAM_ALIGN);
        let pad = (offset - self.streams_len) as usize;
        let zeros = [0u8; STREAM_ALIGN as usize];
        let pad_bytes = zeros.get(..pad).unwrap_or(&[]);
        self.write_raw(pad_bytes)?;
        self.streams_crc.update(pad_bytes);
        self.write_raw(bytes)?;
        self.streams_crc.update(bytes);
        self.streams_len = offset + u64::from(length);
        self.index.push(StreamEntry {
            offset,
            length,
            tag,
        });
        Ok(self.index.len() - 1)
    }

    /// Append every stream of `streams` (tag 0); returns how many were appended.
    pub fn streams_from<I, B>(&mut self, streams: I) -> Result<usize>
    where
        I: IntoIterator<Item = B>,
        B: AsRef<[u8]>,
    {
        let mut n = 0;
        for s in streams {
            self.stream(s.as_ref())?;
            n += 1;
        }
        Ok(n)
    }

    /// Streams appended so far.
    pub fn n_streams(&self) -> usize {
        self.index.len()
    }

    fn check_usable(&self) -> Result<()> {
        if self.poisoned {
            return Err(QemFileError::Write {
                reason: "an earlier write failed; the writer cannot continue".into(),
            });
        }
        Ok(())
    }

    fn write_raw(&mut self, bytes: &[u8]) -> Result<()> {
        let res = match self.file.as_mut() {
            Some(f) => f.write_all(bytes),
            None => Err(io::Error::other("file already closed")),
        };
        res.map_err(|e| {
            self.poisoned = true;
            io_err("write", &self.tmp_path, &e)
        })
    }

    /// Append the small sections, write header and table, `fsync`, rename onto the final path,
    /// `fsync` the directory.
    ///
    /// If only the final directory `fsync` fails, the file is already in place under its name
    /// (but its directory entry may not survive a power loss); the error says so via its `op`.
    pub fn finish(mut self) -> Result<QemWriteSummary> {
        self.check_usable()?;
        let metadata = serde_json::to_vec(&self.metadata).map_err(|e| QemFileError::Write {
            reason: format!("metadata JSON: {e}"),
        })?;
        let mut index_bytes = Vec::with_capacity(self.index.len() * INDEX_ENTRY_LEN);
        for e in &self.index {
            index_bytes.extend_from_slice(&e.to_bytes());
        }
        let codec_tables = std::mem::take(&mut self.codec_tables);

        let mut table = Vec::with_capacity(WRITER_SECTIONS * TABLE_ENTRY_LEN);
        let mut push_entry = |kind: SectionKind, offset: u64, length: u64, crc: u32| {
            table.extend_from_slice(&kind.id().to_le_bytes());
            table.extend_from_slice(&0u32.to_le_bytes());
            table.extend_from_slice(&offset.to_le_bytes());
            table.extend_from_slice(&length.to_le_bytes());
            table.extend_from_slice(&crc.to_le_bytes());
            table.extend_from_slice(&0u32.to_le_bytes());
        };
        push_entry(
            SectionKind::Streams,
            WRITER_STREAMS_OFFSET,
            self.streams_len,
            self.streams_crc.finish(),
        );
        let mut pos = WRITER_STREAMS_OFFSET + self.streams_len;
        let mut small: Vec<(SectionKind, &[u8])> = vec![
            (SectionKind::StreamIndex, &index_bytes),
            (SectionKind::CodecTables, &codec_tables),
            (SectionKind::Metadata, &metadata),
        ];
        let zeros = [0u8; SECTION_ALIGN as usize];
        let mut pending: Vec<u8> = Vec::new();
        for (kind, bytes) in small.drain(..) {
            let start = align_up(pos, SECTION_ALIGN);
            pending.extend_from_slice(zeros.get(..(start - pos) as usize).unwrap_or(&[]));
            pending.extend_from_slice(bytes);
            push_entry(kind, start, bytes.len() as u64, crc32c(bytes));
            pos = start + bytes.len() as u64;
        }
        let file_len = align_up(pos, SECTION_ALIGN);
        pending.extend_from_slice(zeros.get(..(file_len - pos) as usize).unwrap_or(&[]));
        self.write_raw(&pending)?;

        let mut header = [0u8; HEADER_LEN];
        header[0..8].copy_from_slice(&MAGIC);
        header[8..10].copy_from_slice(&FORMAT_MAJOR.to_le_bytes());
        header[10..12].copy_from_slice(&FORMAT_MINOR.to_le_bytes());
        header[12..16].copy_from_slice(&0u32.to_le_bytes());
        header[16..20].copy_from_slice(&(WRITER_SECTIONS as u32).to_le_bytes());
        header[20..24].copy_from_slice(&crc32c(&table).to_le_bytes());
        header[24..32].copy_from_slice(&(HEADER_LEN as u64).to_le_bytes());
        header[32..40].copy_from_slice(&file_len.to_le_bytes());
        let hcrc = crc32c(&header[..60]);
        header[60..64].copy_from_slice(&hcrc.to_le_bytes());

        let tmp = self.tmp_path.clone();
        let buffered = self.file.take().ok_or_else(|| QemFileError::Write {
            reason: "file already closed".into(),
        })?;
        let mut file = buffered
            .into_inner()
            .map_err(|e| io_err("write", &tmp, e.error()))?;
        let patch = (|| -> io::Result<()> {
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&header)?;
            file.write_all(&table)?;
            Ok(())
        })();
        patch.map_err(|e| io_err("write header of", &tmp, &e))?;
        file.sync_all().map_err(|e| io_err("fsync", &tmp, &e))?;
        drop(file);
        fs::rename(&tmp, &self.path).map_err(|e| io_err("rename onto final path", &tmp, &e))?;
        // The temporary name is gone: nothing for Drop to remove.
        self.tmp_path = PathBuf::new();
        let dir = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err("fsync directory (file already renamed)", &dir, &e))?;
        Ok(QemWriteSummary {
            path: self.path.clone(),
            file_bytes: file_len,
            n_streams: self.index.len(),
            streams_bytes: self.streams_len,
        })
    }
}

impl Drop for QemWriter {
    fn drop(&mut self) {
        drop(self.file.take());
        if !self.tmp_path.as_os_str().is_empty() {
            // Best effort: an unfinished or failed write leaves nothing behind.
            let _ = fs::remove_file(&self.tmp_path);
        }
    }
}
