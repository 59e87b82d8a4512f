//! The host side of a batch: `pread` of its chunks into a pinned slot by the reader pool and the
//! block table the decode kernel reads (built by the CPU parser, which validates the framing).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use qem_core::{Error, Result};
use qem_io::{ChunkCodec, Source};
use rayon::prelude::*;

use super::plan::{BatchPlan, LoadPlan};
use crate::bslz4::BlockTable;

/// What [`read_batch`] needs.
pub(super) struct BatchInput<'a> {
    pub(super) src: &'a Source,
    pub(super) files: &'a [File],
    pub(super) plan: &'a LoadPlan<'a>,
    pub(super) batch: &'a BatchPlan,
    pub(super) direct: bool,
    pub(super) frame_bytes: u64,
    pub(super) out_frame_bytes: u64,
    pub(super) threads: usize,
}

/// A batch's descriptor tables as the reader pool built them: one table per group of chunks,
/// in plan order. The tables are kept from batch to batch (their pages mapped once) and the
/// same groups pack them into the pinned slot in parallel ([`BatchTables::pack`]), so no
/// thread copies the whole table alone (a 128 MiB batch of u16 192² frames has ~99k blocks,
/// 3.2 MB of descriptors).
#[derive(Debug, Default)]
pub(super) struct BatchTables {
    groups: Vec<BlockTable>,
    used: usize,
}

impl BatchTables {
    fn live(&self) -> &[BlockTable] {
        &self.groups[..self.used]
    }

    /// Block descriptors of the batch.
    pub(super) fn n_blocks(&self) -> usize {
        self.live().iter().map(BlockTable::n_blocks).sum()
    }

    /// Copy descriptors of the batch.
    pub(super) fn n_copies(&self) -> usize {
        self.live().iter().map(BlockTable::n_copies).sum()
    }

    /// Words of the block descriptors (the copy descriptors follow them).
    pub(super) fn block_words(&self) -> usize {
        self.live().iter().map(|t| t.blocks.len()).sum()
    }

    /// Words of the block and copy descriptors.
    pub(super) fn words(&self) -> usize {
        self.live()
            .iter()
            .map(|t| t.blocks.len() + t.copies.len())
            .sum()
    }

    /// Largest decoded block in bytes.
    pub(super) fn max_block_bytes(&self) -> usize {
        self.live()
            .iter()
            .map(|t| t.max_block_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Write every group's block words, then every group's copy words, into the front of
    /// `words` (at least [`BatchTables::words`] long), each group into its own part in parallel:
    /// the layout of the groups' tables appended in order.
    pub(super) fn pack(&self, words: &mut [u32], pool: &rayon::ThreadPool) {
        let groups = self.live();
        let (mut blk, rest) = words.split_at_mut(self.block_words());
        let mut cpy = rest;
        let mut parts = Vec::with_capacity(groups.len());
        for t in groups {
            let (a, b) = std::mem::take(&mut blk).split_at_mut(t.blocks.len());
            let (c, d) = std::mem::take(&mut cpy).split_at_mut(t.copies.len());
            parts.push((t, a, c));
            blk = b;
            cpy = d;
        }
        pool.install(|| {
            parts.par_iter_mut().for_each(|(t, a, c)| {
                a.copy_from_slice(&t.blocks);
                c.copy_from_slice(&t.copies);
            })
        });
    }
}

/// Read one batch's chunks into `slot` (packed in plan order) with the reader pool and build
/// its descriptor tables in `tables` (chunk indices global to the plan; output offsets = result
/// positions when `direct`, else packed decode-scratch offsets). Returns the read and
/// table-building thread seconds.
pub(super) fn read_batch(
    inp: &BatchInput<'_>,
    slot: &mut [u8],
    pool: &rayon::ThreadPool,
    tables: &mut BatchTables,
) -> Result<(f64, f64)> {
    let BatchInput {
        src,
        files,
        plan,
        batch,
        direct,
        frame_bytes,
        out_frame_bytes,
        ..
    } = *inp;
    let es = src.dtype.size();
    let pcs = &plan.chunks[batch.chunks.clone()];
    if slot.len() < batch.in_bytes as usize {
        return Err(Error::internal(
            "read batch",
            "pinned slot smaller than the batch",
        ));
    }
    // Groups of consecutive chunks, each with its contiguous part of the slot; a group's
    // chunks that are also contiguous in their file are read with one pread.
    let n_groups = (inp.threads.max(1) * 4).min(pcs.len()).max(1);
    let per = pcs.len().div_ceil(n_groups).max(1);
    let mut groups: Vec<(usize, u64, &mut [u8])> = Vec::with_capacity(n_groups);
    let mut rest: &mut [u8] = slot;
    let mut off = 0u64;
    for (g, run) in pcs.chunks(per).enumerate() {
        let bytes: u64 = run.iter().map(|p| p.rec.size).sum();
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(bytes as usize);
        groups.push((g * per, off, head));
        off += bytes;
        rest = tail;
    }
    let mut dec_off_of = Vec::with_capacity(pcs.len());
    let mut acc = 0u64;
    for pc in pcs {
        dec_off_of.push(acc);
        acc += pc.rec.frames_in_chunk as u64 * frame_bytes;
    }
    let dec_off_of = &dec_off_of;
    let first = batch.chunks.start;
    if tables.groups.len() < groups.len() {
        tables.groups.resize_with(groups.len(), BlockTable::default);
    }
    let n_used = groups.len();
    tables.used = n_used;
    let results: Vec<Result<(f64, f64)>> = pool.install(|| {
        groups
            .par_iter_mut()
            .zip(tables.groups[..n_used].par_iter_mut())
            .map(|((g0, g_off, buf), table)| {
                table.clear();
                let (mut rs, mut ts) = (0.0, 0.0);
                let run = &pcs[*g0..(*g0 + per).min(pcs.len())];
                // Read: coalesce chunks that follow each other in the same file.
                let t = Instant::now();
                let mut k = 0;
                let mut pos = 0usize;
                while k < run.len() {
                    let (f, start) = (run[k].rec.file, run[k].rec.offset);
                    let mut end = k + 1;
                    let mut len = run[k].rec.size;
                    while end < run.len()
                        && run[end].rec.file == f
                        && run[end].rec.offset == start + len
                    {
                        len += run[end].rec.size;
                        end += 1;
                    }
                    let path = &src.files[f as usize].path;
                    let file = files.get(f as usize).ok_or_else(|| {
                        Error::internal("read chunk", "chunk names a file this source lacks")
                    })?;
                    file.read_exact_at(&mut buf[pos..pos + len as usize], start)
                        .map_err(|err| {
                            Error::io("read chunk", path, &err).with_frame(run[k].rec.first_frame)
                        })?;
                    pos += len as usize;
                    k = end;
                }
                rs += t.elapsed().as_secs_f64();
                // Describe every chunk's blocks (the CPU parser validates the framing).
                let t = Instant::now();
                let mut pos = 0usize;
                for (k, pc) in run.iter().enumerate() {
                    let gi = first + *g0 + k;
                    let bytes = &buf[pos..pos + pc.rec.size as usize];
                    let in_off = *g_off + pos as u64;
                    pos += pc.rec.size as usize;
                    let out_len = pc.rec.frames_in_chunk as usize * frame_bytes as usize;
                    let out_off = if direct {
                        plan.dst_frames[pc.dst_start] as u64 * out_frame_bytes
                    } else {
                        dec_off_of[gi - first]
                    };
                    let fm = if src.codec == ChunkCodec::Raw {
                        1
                    } else {
                        pc.rec.filter_mask
                    };
                    table
                        .push_chunk(
                            bytes,
                            es,
                            fm,
                            pc.rec.first_frame,
                            gi as u32,
                            in_off,
                            out_off,
                            out_len,
                        )
                        .map_err(|err| err.with_file(&src.files[pc.rec.file as usize].path))?;
                }
                ts += t.elapsed().as_secs_f64();
                Ok((rs, ts))
            })
            .collect()
    });
    let (mut rs_sum, mut ts_sum) = (0.0, 0.0);
    for r in results {
        let (rs, ts) = r?;
        rs_sum += rs;
        ts_sum += ts;
    }
    Ok((rs_sum, ts_sum))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(id: u32, n_blocks: usize, n_copies: usize, max_block: usize) -> BlockTable {
        let mut t = BlockTable::default();
        for i in 0..n_blocks {
            t.blocks
                .extend((0..8).map(|w| id << 24 | (i as u32) << 8 | w));
        }
        for i in 0..n_copies {
            t.copies
                .extend((0..8).map(|w| id << 24 | 1 << 20 | (i as u32) << 8 | w));
        }
        t.max_block_bytes = max_block;
        t
    }

    #[test]
    fn pack_lays_out_every_groups_blocks_then_every_groups_copies() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let mut tables = BatchTables {
            groups: vec![
                group(1, 3, 0, 8192),
                group(2, 0, 2, 0),
                group(3, 5, 1, 4096),
                group(4, 7, 7, 1 << 20), // a stale group past `used`: not packed
            ],
            used: 3,
        };
        assert_eq!(
            (tables.n_blocks(), tables.n_copies(), tables.block_words()),
            (8, 3, 64)
        );
        assert_eq!(tables.words(), 88);
        assert_eq!(tables.max_block_bytes(), 8192);
        let mut words = vec![u32::MAX; tables.words() + 5];
        tables.pack(&mut words, &pool);
        let mut want = Vec::new();
        for t in &tables.groups[..3] {
            want.extend_from_slice(&t.blocks);
        }
        for t in &tables.groups[..3] {
            want.extend_from_slice(&t.copies);
        }
        assert_eq!(&words[..88], &want[..]);
        assert!(
            words[88..].iter().all(|&w| w == u32::MAX),
            "nothing past the tables"
        );
        tables.used = 0;
        assert_eq!((tables.words(), tables.max_block_bytes()), (0, 0));
    }
}
