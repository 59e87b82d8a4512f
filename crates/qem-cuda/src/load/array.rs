//! [`DeviceArray`], a dense acquisition in device memory, and [`load_array`], which uploads an
//! in-memory array and runs the region/bin path on it.

use std::sync::Arc;
use std::time::Instant;

use qem_core::{DType, DenseArray, Error, MemoryReport, Result, Shape2, StageTiming};

use super::plan::{admit, region_frames};
use super::queue::{region_bin_batch, RegionBinBatch};
use super::records::ErrorRecords;
use super::timings::{elapsed_s, event, record};
use super::{GpuLoad, GpuLoadParams};
use crate::device::driver_error;
use crate::engine::engine;
use crate::mem::{DevBuf, MemCounter};

/// A dense `[R_r, R_c, k_r, k_c]` array in device memory (freed on drop).
#[derive(Debug)]
pub struct DeviceArray {
    pub(super) buf: DevBuf,
    pub(super) shape: [usize; 4],
    pub(super) dtype: DType,
    pub(super) ordinal: usize,
}

impl DeviceArray {
    /// `[R_r, R_c, k_r, k_c]`.
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of data (the allocation may be slightly larger).
    pub fn nbytes(&self) -> u64 {
        (self.len() * self.dtype.size()) as u64
    }
    /// Device address of element 0.
    pub fn device_ptr(&self) -> u64 {
        self.buf.ptr()
    }
    /// Device ordinal.
    pub fn device_ordinal(&self) -> usize {
        self.ordinal
    }

    fn download_range(&self, start: usize, len: usize) -> Result<DenseArray> {
        let es = self.dtype.size();
        match self.dtype {
            DType::U8 => {
                let mut v = vec![0u8; len];
                self.buf.read(start * es, &mut v)?;
                Ok(DenseArray::U8(v))
            }
            DType::U16 => {
                let mut v = vec![0u16; len];
                self.buf
                    .read(start * es, bytemuck::cast_slice_mut(&mut v))?;
                Ok(DenseArray::U16(v))
            }
            DType::U32 => {
                let mut v = vec![0u32; len];
                self.buf
                    .read(start * es, bytemuck::cast_slice_mut(&mut v))?;
                Ok(DenseArray::U32(v))
            }
        }
    }

    /// Copy the whole array to the host.
    pub fn download(&self) -> Result<DenseArray> {
        self.download_range(0, self.len())
    }

    /// Copy result frame `index` (row-major over the scan) to the host.
    pub fn download_frame(&self, index: usize) -> Result<DenseArray> {
        let frame = self.shape[2] * self.shape[3];
        if index >= self.shape[0] * self.shape[1] {
            return Err(Error::invalid("frame", "frame index outside the array"));
        }
        self.download_range(index * frame, frame)
    }
}

/// Upload an in-memory array `[scan, detector]` and run the same region/bin path.
pub fn load_array(
    data: &DenseArray,
    scan: Shape2,
    detector: Shape2,
    params: &GpuLoadParams<'_>,
) -> Result<GpuLoad> {
    let t_total = Instant::now();
    let e = engine()?;
    params.scan_region.validate(scan, "scan_region")?;
    let rplan = params.detector;
    if rplan.source != detector {
        return Err(
            Error::internal("load (cuda)", "detector plan made for another detector")
                .with_expected(detector.to_string())
                .with_found(rplan.source.to_string()),
        );
    }
    let n_src = scan.len();
    if data.len() != n_src * detector.len() || n_src > u32::MAX as usize - 1 {
        return Err(Error::invalid(
            "load (cuda)",
            "array size does not match its shape",
        ));
    }
    let frames = region_frames(scan, params.scan_region);
    let mut dst_frame = vec![u32::MAX; n_src];
    for (ri, &n) in frames.iter().enumerate() {
        dst_frame[n as usize] = ri as u32;
    }
    let src_bytes = data.nbytes() as u64;
    let dest_bytes = (frames.len() * rplan.output.len() * params.result_dtype.size()) as u64;
    let bad_lut: Option<Vec<u8>> = params
        .bad_mask
        .filter(|m| m.iter().any(|&b| b))
        .map(|m| m.iter().map(|&b| u8::from(b)).collect());
    let planned = src_bytes + dest_bytes + 4 * n_src as u64 + 256 + detector.len() as u64;
    e.gpu
        .ctx()
        .bind_to_thread()
        .map_err(|err| driver_error("bind CUDA context", err))?;
    let (free0, card_total) = e.gpu.mem_info()?;
    let budget = admit(
        planned,
        params.memory_budget,
        free0,
        params.options.reserve_bytes,
    )?;
    let ctx = e.gpu.ctx().clone();
    let counter = Arc::new(MemCounter::default());
    let c = Some(&counter);
    let t = Instant::now();
    let dst = DevBuf::alloc(&ctx, dest_bytes as usize, c, "result")?;
    let sbuf = DevBuf::alloc(&ctx, src_bytes as usize, c, "source array")?;
    match data {
        DenseArray::U8(v) => sbuf.write(0, v)?,
        DenseArray::U16(v) => sbuf.write(0, bytemuck::cast_slice(v))?,
        DenseArray::U32(v) => sbuf.write(0, bytemuck::cast_slice(v))?,
    }
    let map = DevBuf::alloc(&ctx, 4 * n_src, c, "frame map")?;
    map.write(0, bytemuck::cast_slice(&dst_frame))?;
    let errs = ErrorRecords::new(&ctx, c)?;
    let bad = match &bad_lut {
        Some(l) => {
            let b = DevBuf::alloc(&ctx, l.len(), c, "bad-pixel lookup")?;
            b.write(0, l)?;
            Some(b)
        }
        None => None,
    };
    let t_upload = t.elapsed().as_secs_f64();
    let (free_peak, _) = e.gpu.mem_info()?;
    let stream = ctx
        .new_stream()
        .map_err(|err| driver_error("create stream", err))?;
    let (a, z) = (event(e)?, event(e)?);
    record(&a, &stream)?;
    // SAFETY: the source holds n_src frames, the map n_src words naming result frames <
    // frames.len(), the result frames.len() frames; all alive until the synchronize below.
    unsafe {
        region_bin_batch(
            e,
            &stream,
            &rplan,
            &RegionBinBatch {
                src: sbuf.ptr(),
                src_dtype: data.dtype(),
                n_frames: n_src as u64,
                dst_frame: map.ptr(),
                dst: dst.ptr(),
            },
            params.result_dtype,
            params.result_dtype,
            params.saturate,
            bad.as_ref(),
            &errs,
        )
    }?;
    record(&z, &stream)?;
    stream
        .synchronize()
        .map_err(|err| driver_error("synchronize", err))?;
    let rec = errs.read()?;
    rec.overflow(&frames, params.result_dtype)?;
    let saturated = rec.saturated;
    let timings = vec![
        StageTiming::new("upload (host, synchronous)", t_upload),
        StageTiming::new("region/bin (events)", elapsed_s(&a, &z)),
        StageTiming::new("gpu load (wall)", t_total.elapsed().as_secs_f64()),
    ];
    let memory = MemoryReport {
        planned_device_bytes: planned,
        budget_bytes: budget,
        process_peak_device_bytes: counter.peak(),
        card_used_before_bytes: card_total.saturating_sub(free0),
        card_used_peak_bytes: card_total.saturating_sub(free_peak),
        card_total_bytes: card_total,
    };
    drop((sbuf, map, errs, bad));
    let rs = params.scan_region.shape();
    Ok(GpuLoad {
        array: DeviceArray {
            buf: dst,
            shape: [rs.rows, rs.cols, rplan.output.rows, rplan.output.cols],
            dtype: params.result_dtype,
            ordinal: e.gpu.info().ordinal,
        },
        saturated,
        frames: frames.len() as u64,
        bytes_read: 0,
        batches: 1,
        direct: false,
        timings,
        memory,
    })
}
