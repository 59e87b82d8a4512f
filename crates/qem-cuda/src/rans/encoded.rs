//! [`DeviceEncoded`]: an acquisition held encoded on the GPU, and what runs over it (frame
//! decode to host or device, the fused per-frame reductions, the host form for `.qem`).

use super::*;

/// An acquisition held encoded on the GPU (one stream per frame).
#[derive(Debug)]
pub struct DeviceEncoded {
    model: DeviceModel,
    arena: DevBuf,
    arena_used: u64,
    index: DevBuf,
    n_frames: u64,
    frame_shape: Shape2,
    ordinal: usize,
}

impl DeviceEncoded {
    /// Assemble from parts the load pipeline produced (`index` holds `n_frames` entries that
    /// all point inside `arena[..arena_used]`).
    pub fn from_parts(
        model: DeviceModel,
        arena: DevBuf,
        arena_used: u64,
        index: DevBuf,
        n_frames: u64,
        frame_shape: Shape2,
        ordinal: usize,
    ) -> DeviceEncoded {
        DeviceEncoded {
            model,
            arena,
            arena_used,
            index,
            n_frames,
            frame_shape,
            ordinal,
        }
    }

    /// Upload a host-encoded acquisition as it is (no re-encode): the `.qem` reopen path.
    /// `index` entries must point inside `streams` at multiples of 16 (checked here).
    pub fn upload(
        gpu: &Gpu,
        model: CountsModel,
        index: &[StreamEntry],
        streams: &[u8],
        frame_shape: Shape2,
        counter: Option<&Arc<MemCounter>>,
    ) -> Result<DeviceEncoded> {
        let op = "upload encoded acquisition";
        if model.frame_len() != frame_shape.len() {
            return Err(Error::invalid(op, "model frame length != frame shape")
                .with_expected(frame_shape.len().to_string())
                .with_found(model.frame_len().to_string()));
        }
        for (i, e) in index.iter().enumerate() {
            if e.offset % STREAM_ALIGN != 0
                || e.offset.saturating_add(u64::from(e.length)) > streams.len() as u64
            {
                return Err(Error::decode(op, "stream index entry outside the streams")
                    .with_frame(i as u64)
                    .with_expected(format!("16-aligned range inside {} bytes", streams.len()))
                    .with_found(format!("offset {} length {}", e.offset, e.length)));
            }
        }
        let ctx = gpu.ctx();
        let dm = DeviceModel::upload(ctx, model, counter)?;
        let arena = DevBuf::alloc(ctx, streams.len(), counter, "encoded streams")?;
        arena.write(0, streams)?;
        let mut raw = Vec::with_capacity(index.len() * INDEX_ENTRY_BYTES);
        for e in index {
            raw.extend_from_slice(&e.offset.to_le_bytes());
            raw.extend_from_slice(&e.length.to_le_bytes());
            raw.extend_from_slice(&e.tag.to_le_bytes());
        }
        let d_index = DevBuf::alloc(ctx, raw.len(), counter, "stream index")?;
        d_index.write(0, &raw)?;
        Ok(DeviceEncoded {
            model: dm,
            arena,
            arena_used: streams.len() as u64,
            index: d_index,
            n_frames: index.len() as u64,
            frame_shape,
            ordinal: gpu.info().ordinal,
        })
    }

    /// Frames held.
    pub fn n_frames(&self) -> u64 {
        self.n_frames
    }

    /// What a fused decode kernel needs: arena address and used length, index address, the
    /// model argument and the shared memory its tables take.
    pub(crate) fn kernel_view(&self) -> (u64, u64, u64, ModelArg, u32) {
        (
            self.arena.ptr(),
            self.arena_used,
            self.index.ptr(),
            self.model.arg(),
            self.model.smem_tables(),
        )
    }

    /// Detector frame shape.
    pub fn frame_shape(&self) -> Shape2 {
        self.frame_shape
    }

    /// The model.
    pub fn model(&self) -> &CountsModel {
        self.model.model()
    }

    /// The model's context map in decoder order ([`DeviceModel::ctx4`]).
    pub fn ctx4(&self) -> &[u32] {
        self.model.ctx4()
    }

    /// CUDA device ordinal.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    /// Bytes of the streams (16-byte aligned, as laid out in the arena).
    pub fn stream_bytes(&self) -> u64 {
        self.arena_used
    }

    /// Device bytes the encoded form occupies: streams, index and model tables.
    pub fn nbytes(&self) -> u64 {
        self.arena_used + self.n_frames * INDEX_ENTRY_BYTES as u64 + self.model.nbytes()
    }

    fn check_range(&self, first: u64, count: u64) -> Result<()> {
        if first.checked_add(count).is_none_or(|e| e > self.n_frames) {
            return Err(
                Error::invalid("decode frames", "frame range outside the acquisition")
                    .with_expected(format!("<= {}", self.n_frames))
                    .with_found(format!("{first}..{}", first.saturating_add(count))),
            );
        }
        Ok(())
    }

    /// Queue the decode of frames `first..first + count` into `out` (u16, frame-contiguous) on
    /// `stream`; `err` receives the error record.
    ///
    /// # Safety
    /// `out` must hold `count × frame_len` u16 and `err` [`ERR_WORDS`] zeroed words, both alive
    /// until the stream has passed the launch.
    pub unsafe fn launch_decode_dense(
        &self,
        k: &RansKernels,
        stream: &CudaStream,
        first: u64,
        count: u64,
        out: u64,
        err: u64,
    ) -> Result<()> {
        self.check_range(first, count)?;
        if count == 0 {
            return Ok(());
        }
        let cfg = k.config(
            &k.decode_dense,
            DECODE_WARPS,
            self.model.smem_tables(),
            count,
        )?;
        let m = self.model.arg();
        let (arena, alen, index) = (self.arena.ptr(), self.arena_used, self.index.ptr());
        let mut b = stream.launch_builder(&k.decode_dense);
        b.arg(&arena)
            .arg(&alen)
            .arg(&index)
            .arg(&first)
            .arg(&count)
            .arg(&m)
            .arg(&out)
            .arg(&err);
        // SAFETY: matches `qem_rans_decode_dense(const u8*, u64, const u32*, u64, u64,
        // RansModel, u16*, u32*)`; the arena, index and tables are this object's live buffers,
        // every stream access is bounds-checked by the kernel; `out`/`err` per the contract.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch rANS decode", e))?;
        Ok(())
    }

    /// Decode frames `first..first + count` to the host (u16, frame-contiguous), in pieces of
    /// at most 256 MiB of device scratch.
    pub fn download_frames(
        &self,
        gpu: &Gpu,
        k: &RansKernels,
        first: u64,
        count: u64,
    ) -> Result<Vec<u16>> {
        self.check_range(first, count)?;
        let n = self.frame_shape.len() as u64;
        let mut host = vec![0u16; (count * n) as usize];
        if count == 0 {
            return Ok(host);
        }
        let per = ((256u64 << 20) / (2 * n).max(1)).clamp(1, count);
        let ctx = gpu.ctx();
        let scratch = DevBuf::alloc(ctx, (per * n * 2) as usize, None, "decoded frames")?;
        let err = new_err_record(ctx, None)?;
        let stream = gpu.stream();
        let mut done = 0u64;
        while done < count {
            let c = per.min(count - done);
            // SAFETY: scratch holds `per × n` u16 ≥ `c × n`; err is a zeroed record; both live
            // until the synchronize below.
            unsafe {
                self.launch_decode_dense(k, stream, first + done, c, scratch.ptr(), err.ptr())
            }?;
            stream
                .synchronize()
                .map_err(|e| driver_error("synchronize rANS decode", e))?;
            if let Some(f) = read_err(&err)? {
                return Err(fault_error(&f, f.frame));
            }
            let dst = &mut host[(done * n) as usize..((done + c) * n) as usize];
            scratch.read(0, bytemuck::cast_slice_mut(dst))?;
            done += c;
        }
        Ok(host)
    }

    /// Exact per-frame totals, computed by the fused decode→reduce template (no frame is
    /// written to memory). The smallest product; it also checks every stream.
    pub fn frame_sums(&self, gpu: &Gpu, k: &RansKernels) -> Result<Vec<u64>> {
        let (v, fault) = self.frame_reduce(gpu, k, FrameReduce::Sum)?;
        match fault {
            Some(f) => Err(fault_error(&f, f.frame)),
            None => Ok(v),
        }
    }

    /// Per-frame hashes ([`frame_hash`]) of the decoded frames, fused with decode.
    pub fn frame_hashes(&self, gpu: &Gpu, k: &RansKernels) -> Result<Vec<u64>> {
        let (v, fault) = self.frame_reduce(gpu, k, FrameReduce::Hash)?;
        match fault {
            Some(f) => Err(fault_error(&f, f.frame)),
            None => Ok(v),
        }
    }

    /// One u64 per frame from a fused reduction, `u64::MAX` for each stream that failed its
    /// checks, and the launch's first fault (a per-stream verdict for tests of corrupt data).
    pub fn frame_reduce(
        &self,
        gpu: &Gpu,
        k: &RansKernels,
        what: FrameReduce,
    ) -> Result<(Vec<u64>, Option<RansFaultRecord>)> {
        let ctx = gpu.ctx();
        let n = self.n_frames;
        let out = DevBuf::alloc(ctx, (n.max(1) * 8) as usize, None, "per-frame results")?;
        let err = new_err_record(ctx, None)?;
        if n > 0 {
            let f = match what {
                FrameReduce::Sum => &k.frame_sums,
                FrameReduce::Hash => &k.frame_hashes,
            };
            let cfg = k.config(f, DECODE_WARPS, self.model.smem_tables(), n)?;
            let m = self.model.arg();
            let (arena, alen, index, first) =
                (self.arena.ptr(), self.arena_used, self.index.ptr(), 0u64);
            let (o, e) = (out.ptr(), err.ptr());
            let stream = gpu.stream();
            let mut b = stream.launch_builder(f);
            b.arg(&arena)
                .arg(&alen)
                .arg(&index)
                .arg(&first)
                .arg(&n)
                .arg(&m)
                .arg(&o)
                .arg(&e);
            // SAFETY: matches `qem_rans_frame_sums`/`qem_rans_frame_hashes(const u8*, u64,
            // const u32*, u64, u64, RansModel, u64*, u32*)`; `out` holds n u64; all buffers
            // live until the synchronize below.
            unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch rANS reduction", e))?;
            stream
                .synchronize()
                .map_err(|e| driver_error("synchronize rANS reduction", e))?;
        }
        let fault = read_err(&err)?;
        let mut v = vec![0u64; n as usize];
        out.read(0, bytemuck::cast_slice_mut(&mut v))?;
        Ok((v, fault))
    }

    /// Time one decode of every frame into a device scratch of `frames_per_launch` frames
    /// (events on the default stream), returning seconds. For benchmarks.
    pub fn time_decode_all(
        &self,
        gpu: &Gpu,
        k: &RansKernels,
        frames_per_launch: u64,
    ) -> Result<f64> {
        let n = self.frame_shape.len() as u64;
        let per = frames_per_launch.clamp(1, self.n_frames.max(1));
        let scratch = DevBuf::alloc(gpu.ctx(), (per * n * 2) as usize, None, "decoded frames")?;
        let err = new_err_record(gpu.ctx(), None)?;
        let stream = gpu.stream();
        let ms = gpu.time_ms(|| {
            let mut done = 0u64;
            while done < self.n_frames {
                let c = per.min(self.n_frames - done);
                // SAFETY: scratch holds `per × n` u16; err is a zeroed record; both live until
                // time_ms has synchronized.
                unsafe { self.launch_decode_dense(k, stream, done, c, scratch.ptr(), err.ptr()) }?;
                done += c;
            }
            Ok(())
        })?;
        if let Some(f) = read_err(&err)? {
            return Err(fault_error(&f, f.frame));
        }
        Ok(f64::from(ms) / 1e3)
    }

    /// The index and streams on the host, streams in frame order, packed at 16-byte
    /// boundaries (the `.qem` writer's layout).
    pub fn to_host(&self) -> Result<(Vec<StreamEntry>, Vec<u8>)> {
        let mut raw = vec![0u8; self.n_frames as usize * INDEX_ENTRY_BYTES];
        self.index.read(0, &mut raw)?;
        let mut arena = vec![0u8; self.arena_used as usize];
        self.arena.read(0, &mut arena)?;
        let mut index = Vec::with_capacity(self.n_frames as usize);
        let mut streams = Vec::with_capacity(arena.len());
        for (i, e) in raw.chunks_exact(INDEX_ENTRY_BYTES).enumerate() {
            let off = u64::from_le_bytes(e[0..8].try_into().unwrap_or([0; 8]));
            let len = u32::from_le_bytes(e[8..12].try_into().unwrap_or([0; 4]));
            let tag = u32::from_le_bytes(e[12..16].try_into().unwrap_or([0; 4]));
            let end = off.saturating_add(u64::from(len));
            if end > arena.len() as u64 {
                return Err(Error::internal(
                    "download encoded acquisition",
                    "index entry outside the arena",
                )
                .with_frame(i as u64));
            }
            let at = streams.len() as u64;
            streams.extend_from_slice(&arena[off as usize..end as usize]);
            streams.resize(streams.len().next_multiple_of(STREAM_ALIGN as usize), 0);
            index.push(StreamEntry {
                offset: at,
                length: len,
                tag,
            });
        }
        Ok((index, streams))
    }
}

/// Which fused per-frame reduction [`DeviceEncoded::frame_reduce`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameReduce {
    /// Exact total count per frame.
    Sum,
    /// [`frame_hash`] per frame.
    Hash,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The position-weighted frame hash of rans.cu's `FrameHash`: `Σ v_p · splitmix64(p)`
/// (wrapping). Equal frames hash equal; a changed pixel changes the hash unless differences
/// cancel modulo 2^64.
pub fn frame_hash(frame: &[u16]) -> u64 {
    frame.iter().enumerate().fold(0u64, |h, (p, &v)| {
        h.wrapping_add(u64::from(v).wrapping_mul(splitmix64(p as u64)))
    })
}
