//! Fitting a model on the GPU from a dense sample ([`fit_on_device`]) and the sample rule
//! both engines use ([`sample_frames`]).

use super::*;

/// Fit a model from `n_frames` dense, already-masked u16 frames at `frames` (device) with the
/// staged fit of `qem_codec::rans`: per-pixel sums, frame statistics and the histogram on the
/// GPU, the rest on the host. Synchronizes the device's default stream.
pub fn fit_on_device(
    gpu: &Gpu,
    k: &RansKernels,
    frames: u64,
    n_frames: u64,
    frame_len: usize,
    params: &ModelParams,
) -> Result<CountsModel> {
    let op = "fit rANS model (GPU)";
    let codec = |e: rans::RansError| Error::invalid(op, e.to_string());
    params.validate().map_err(codec)?;
    if n_frames == 0 || frame_len == 0 || frame_len > u32::MAX as usize {
        return Err(Error::invalid(op, "no frames to fit"));
    }
    let ctx = gpu.ctx();
    let stream = gpu.stream();
    let sync = || {
        stream
            .synchronize()
            .map_err(|e| driver_error("synchronize fit", e))
    };
    let n = frame_len as u32;
    // Pass 1: per-pixel sums -> context map and split.
    let sums = DevBuf::alloc(ctx, frame_len * 8, None, "pixel sums")?;
    sums.zero()?;
    {
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256), n_frames.min(64) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = sums.ptr();
        let mut b = stream.launch_builder(&k.pixel_sums);
        b.arg(&frames).arg(&n_frames).arg(&n).arg(&s);
        // SAFETY: matches `qem_rans_pixel_sums(const u16*, u64, u32, u64*)`; frames holds
        // n_frames × n u16 (caller), sums n u64; synchronized below.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch pixel sums", e))?;
    }
    sync()?;
    let mut h_sums = vec![0u64; frame_len];
    sums.read(0, bytemuck::cast_slice_mut(&mut h_sums))?;
    let cf = rans::fit_contexts(&h_sums, n_frames, params).map_err(codec)?;
    let d_ctx = DevBuf::alloc(ctx, frame_len, None, "context map")?;
    d_ctx.write(0, &cf.ctx_map)?;
    // Pass 2: frame statistics -> thresholds and each frame's table set.
    let t_sets = params.table_sets.max(1);
    let mut sets = vec![0u8; n_frames as usize];
    let mut thresholds = Vec::new();
    if t_sets > 1 {
        let stats = DevBuf::alloc(ctx, (n_frames * 8) as usize, None, "frame statistics")?;
        let cfg = LaunchConfig {
            grid_dim: (n_frames.div_ceil(8).min(65535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (c, sp, st) = (d_ctx.ptr(), u32::from(cf.split), stats.ptr());
        let mut b = stream.launch_builder(&k.frame_stats);
        b.arg(&frames)
            .arg(&n_frames)
            .arg(&n)
            .arg(&c)
            .arg(&sp)
            .arg(&st);
        // SAFETY: matches `qem_rans_frame_stats(const u16*, u64, u32, const u8*, u32, u64*)`;
        // frames n_frames × n u16, ctx n bytes, stats n_frames u64; synchronized below.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch frame statistics", e))?;
        sync()?;
        let mut h = vec![0u64; n_frames as usize];
        stats.read(0, bytemuck::cast_slice_mut(&mut h))?;
        thresholds = rans::fit_thresholds(&h, t_sets);
        for (s, &v) in sets.iter_mut().zip(&h) {
            *s = rans::table_set_of(&thresholds, v);
        }
    }
    // Pass 3: the [set][ctx][symbol] histogram -> frequencies.
    let s = params.literals as usize + rans::BUCKETS;
    let entries = t_sets as usize * params.contexts as usize * s;
    let d_sets = DevBuf::alloc(ctx, sets.len(), None, "frame table sets")?;
    d_sets.write(0, &sets)?;
    let hist = DevBuf::alloc(ctx, entries * 8, None, "histogram")?;
    hist.zero()?;
    let smem = (entries * 4) as u32;
    if smem > k.max_smem_optin {
        return Err(Error::invalid(op, "histogram does not fit shared memory"));
    }
    k.histogram
        .set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| driver_error("set kernel shared memory", e))?;
    let total = n_frames * frame_len as u64;
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256).clamp(1, k.sms as u64 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem,
    };
    let (c, st, h) = (d_ctx.ptr(), d_sets.ptr(), hist.ptr());
    let (kk, ss, cc, ee) = (
        u32::from(params.literals),
        s as u32,
        u32::from(params.contexts),
        entries as u32,
    );
    let mut b = stream.launch_builder(&k.histogram);
    b.arg(&frames)
        .arg(&n_frames)
        .arg(&n)
        .arg(&c)
        .arg(&st)
        .arg(&kk)
        .arg(&ss)
        .arg(&cc)
        .arg(&ee)
        .arg(&h);
    // SAFETY: matches `qem_rans_histogram(const u16*, u64, u32, const u8*, const u8*, u32, u32,
    // u32, u32, u64*)`; frames n_frames × n u16, ctx n bytes (< C), sets n_frames bytes
    // (< T), hist `entries` u64 = T·C·S; synchronized below.
    unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch histogram", e))?;
    sync()?;
    let mut h_hist = vec![0u64; entries];
    hist.read(0, bytemuck::cast_slice_mut(&mut h_hist))?;
    let freq = rans::fit_freq(
        &h_hist,
        t_sets,
        params.contexts,
        params.literals,
        params.floor,
    )
    .map_err(codec)?;
    CountsModel::from_parts(
        params.literals,
        params.contexts,
        t_sets,
        cf.split,
        cf.ctx_map,
        thresholds,
        freq,
    )
    .map_err(codec)
}

/// Frames `0..n` spread evenly over `total` frames for fitting a model: all of them when
/// `total <= target`, else `target` frames at `⌊i·total/target⌋`. The CPU and CUDA engines
/// use this same rule, so they fit the same model.
pub fn sample_frames(total: u64, target: u64) -> Vec<u64> {
    if total <= target {
        return (0..total).collect();
    }
    (0..target)
        .map(|i| (u128::from(i) * u128::from(total) / u128::from(target)) as u64)
        .collect()
}
