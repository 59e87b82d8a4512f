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

/// Read one batch's chunks into `slot` (packed in plan order) with the reader pool and build
/// its descriptor table (chunk indices global to the plan; output offsets = result positions
/// when `direct`, else packed decode-scratch offsets). Returns the table and the read and
/// table-building thread seconds.
pub(super) fn read_batch(
    inp: &BatchInput<'_>,
    slot: &mut [u8],
    pool: &rayon::ThreadPool,
) -> Result<(BlockTable, f64, f64)> {
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
    let results: Vec<Result<(BlockTable, f64, f64)>> = pool.install(|| {
        groups
            .par_iter_mut()
            .map(|(g0, g_off, buf)| {
                let mut table = BlockTable::default();
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
                Ok((table, rs, ts))
            })
            .collect()
    });
    let mut table = BlockTable::default();
    let (mut rs_sum, mut ts_sum) = (0.0, 0.0);
    for r in results {
        let (tb, rs, ts) = r?;
        table.append(&tb);
        rs_sum += rs;
        ts_sum += ts;
    }
    Ok((table, rs_sum, ts_sum))
}
