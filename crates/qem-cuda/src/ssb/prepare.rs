//! [`GpuSsb::prepare`]: gather the BF pixels' images where the data lies on the card, FFT them
//! and keep `G_b(ν)` (see the module doc of [`super`]).

use super::*;

impl GpuSsb {
    /// Gather, FFT and keep `G_b(ν)` for every BF pixel (module docs).
    pub fn prepare(src: Source<'_>, s: &Setup<'_>) -> Result<GpuSsb> {
        require_cufft(OP)?;
        let b = s.pixels.len();
        let scan = s.scan;
        let n = scan.len();
        let (frames, frame_len, det_cols) = check_setup(&src, s)?;
        let t0 = Instant::now();
        let e = engine()?;
        let gpu = &e.gpu;
        gpu.ctx()
            .bind_to_thread()
            .map_err(|er| driver_error("bind CUDA context", er))?;
        let half = scan.cols / 2 + 1;
        let nh = (scan.rows * half) as u64;
        let n64 = n as u64;
        let budget = match s.budget {
            Some(v) => v,
            None => gpu.mem_info()?.0.saturating_sub(FREE_MARGIN),
        };
        // Launch shape of the accumulate kernel: enough slices of BF pixels for ~16 blocks/SM.
        let blocks_x = nh.div_ceil(u64::from(THREADS)) as u32;
        let sms = gpu.info().multiprocessors.max(1) as u32;
        // A slice's per-pixel tables live in the block's shared memory (ACC_TABLE_BYTES each,
        // ≤ 48 KB): at least ⌈b / MAX_SLICE_PIXELS⌉ slices.
        let slices = (16 * sms)
            .div_ceil(blocks_x)
            .max((b as u32).div_ceil(MAX_SLICE_PIXELS))
            .clamp(1, 32)
            .min(b as u32);
        if (b as u32).div_ceil(slices) > MAX_SLICE_PIXELS {
            return Err(
                Error::invalid(OP, "too many BF pixels for the accumulate kernel")
                    .with_expected(format!("at most {} BF pixels", 32 * MAX_SLICE_PIXELS))
                    .with_found(format!("{b} (bin the detector)")),
            );
        }
        // The quadratic kernel's list blocks: at most the two Nyquist lines' pairs.
        let list_max = (scan.rows + scan.cols + 2) as u64;
        let gen_max = list_max.div_ceil(u64::from(THREADS));
        let fixed = (b as u64) * (8 + 8 + 8 + 4)
            + (scan.rows + scan.cols) as u64 * 4
            + list_max * 4
            + u64::from(slices) * n64 * (8 + 4)
            + n64 * 8
            + (u64::from(slices) * (u64::from(blocks_x) + gen_max) + 4096) * 8
            + plan_work_bytes(scan, cufft_sys::cufftType::CUFFT_C2C, 1)?;
        let scratch = match src {
            Source::Dense(_) | Source::Host { .. } => 0,
            Source::Encoded(_) => DECODE_SCRATCH.min(frames as u64 * frame_len as u64 * 2) + 64,
        };
        let sz = Sizes {
            b: b as u64,
            n: n64,
            nh,
            fixed,
            scratch,
            frame_bytes: frame_len as u64 * 2,
        };
        let (storage, mut batch) = choose_plan(&sz, budget, s.storage)?;
        let f = load_funcs(gpu, storage)?;
        // The R2C work area is asked of cuFFT; shrink the batch until everything fits.
        loop {
            let w = plan_work_bytes(scan, cufft_sys::cufftType::CUFFT_R2C, batch)?;
            let used = sz.resident(storage) + sz.scratch + batch as u64 * sz.batch_px() + w;
            if used <= budget {
                break;
            }
            if batch == 1 {
                return Err(Error::memory_budget(OP, used, budget).with_op(format!(
                    "{OP} prepare (G for {b} BF pixels as {} and the FFT work area of one \
                     pixel; raise memory_budget, bin the detector or crop the scan)",
                    storage.name()
                )));
            }
            batch = (batch / 2).max(1);
        }
        // Batches of equal size (8,653 pixels as 3 × 2,885, not 2 × 4,096 + 461): the one R2C
        // plan of a whole batch then transforms at most a few stale images in the last one.
        let batch = b.div_ceil(b.div_ceil(batch));
        // ENCODED data: stage the pixels as u16 images where G leaves room for few per pass.
        let passes = match src {
            Source::Encoded(_) => encoded_passes(&sz, storage, batch, budget, |k| {
                plan_work_bytes(scan, cufft_sys::cufftType::CUFFT_R2C, k)
            })?,
            Source::Dense(_) | Source::Host { .. } => EncodedPasses::direct(batch, scratch),
        };
        let batch = passes.batch;
        let counter = Arc::new(MemCounter::default());
        let ctx = gpu.ctx();
        let c = Some(&counter);
        let pix32: Vec<u32> = s.pixels.iter().map(|&p| p as u32).collect();
        let gscale: Vec<f32> =
            s.g0.iter()
                .map(|&v| {
                    if v > 0.0 {
                        (v / G16_FULL_SCALE) as f32
                    } else {
                        1.0
                    }
                })
                .collect();
        let d_pix = upload(ctx, &pix32, c, "BF pixel list")?;
        let d_gscale = upload(ctx, &gscale, c, "G16 scales")?;
        let kb = upload(ctx, &to_f32_pairs(s.k), c, "BF k vectors")?;
        // A(k_b) (aberration-free) and the detector-row continuations for the quadratic kernel.
        let ak32: Vec<f32> =
            s.k.iter()
                .map(|&(x, y)| s.optics.aperture(x, y) as f32)
                .collect();
        let cont: Vec<u8> = (0..b)
            .map(|i| {
                u8::from(i > 0 && s.pixels[i] == s.pixels[i - 1] + 1 && s.pixels[i] % det_cols != 0)
            })
            .collect();
        let k_step = (1..b).find(|&i| cont[i] == 1).map_or((0.0, 0.0), |i| {
            (s.k[i].0 - s.k[i - 1].0, s.k[i].1 - s.k[i - 1].1)
        });
        let ak = upload(ctx, &ak32, c, "A(k_b)")?;
        let d_cont = upload(ctx, &cont, c, "detector-row continuations")?;
        let fr32: Vec<f32> = s.nu_r.iter().map(|&v| v as f32).collect();
        let fc32: Vec<f32> = s.nu_c.iter().map(|&v| v as f32).collect();
        let fr = upload(ctx, &fr32, c, "scan frequencies (rows)")?;
        let list = general_pairs(scan.rows, scan.cols, &fr32, &fc32);
        let hlist = upload(
            ctx,
            if list.is_empty() { &[0u32][..] } else { &list },
            c,
            "Nyquist-line pairs",
        )?;
        let fc = upload(ctx, &fc32, c, "scan frequencies (cols)")?;
        let g = DevBuf::alloc(
            ctx,
            (b as u64 * padded_half(nh) * storage.bytes_per_value()) as usize,
            c,
            "G (BF pixel spectra)",
        )?;
        let batches = passes.passes(b);
        fill_g(&FillG {
            e,
            src: &src,
            counter: &counter,
            f: &f,
            scan,
            b,
            n,
            nh,
            frames,
            frame_len,
            batch,
            stage: passes.stage,
            scratch: passes.scratch,
            storage,
            pixels: &d_pix,
            gscale: &d_gscale,
            g: &g,
        })?;
        let seconds = t0.elapsed().as_secs_f64();
        let peak_prepare = counter.peak();
        let dc = s.g0.iter().sum::<f64>() / b as f64;
        let work = Work {
            pk: DevBuf::alloc(ctx, b * 8, c, "P(k_b)")?,
            s_part: DevBuf::alloc(ctx, slices as usize * n * 8, c, "slice spectra")?,
            d_part: DevBuf::alloc(ctx, slices as usize * n * 4, c, "slice transfer powers")?,
            s: DevBuf::alloc(ctx, n * 8, c, "mean spectrum")?,
            pow_part: DevBuf::alloc(
                ctx,
                (slices as usize * (blocks_x as usize + list.len().div_ceil(THREADS as usize))) * 8,
                c,
                "power partials",
            )?,
            fin_part: DevBuf::alloc(ctx, 4096 * 8, c, "coherence partials")?,
            object_plan: make_plan(gpu, scan, cufft_sys::cufftType::CUFFT_C2C, 1, &counter)?,
            pv: None,
        };
        let dt = s.optics.dtheta_rad;
        let optics = OpticsArg {
            lambda: s.optics.lambda_a as f32,
            alpha: s.optics.alpha_rad as f32,
            dr2: (dt.0 * dt.0) as f32,
            dc2: (dt.1 * dt.1) as f32,
        };
        let stats = PrepareStats {
            storage,
            g_bytes: g.bytes() as u64,
            batch_pixels: batch,
            staged_pixels: passes.stage,
            batches,
            seconds,
            peak_bytes: peak_prepare.max(counter.peak()),
            budget,
        };
        drop(d_pix);
        Ok(GpuSsb {
            gpu,
            f,
            g,
            gscale: d_gscale,
            kb,
            ak,
            cont: d_cont,
            k_step,
            aperture_radii: aperture_radii(&s.optics),
            aperture_soft: aperture_soft(&s.optics),
            quad_enabled: AtomicBool::new(true),
            fr,
            fc,
            hlist,
            n_list: list.len() as u32,
            b,
            scan,
            half,
            optics,
            lambda: s.optics.lambda_a,
            dc,
            slices,
            blocks_x,
            budget,
            counter,
            work: Mutex::new(work),
            stats,
        })
    }
}

/// The source's frame count, frame length and detector columns, after checking that the BF
/// pixels, their k vectors and sums, the scan and its frequencies agree.
fn check_setup(src: &Source<'_>, s: &Setup<'_>) -> Result<(usize, usize, usize)> {
    let b = s.pixels.len();
    let scan = s.scan;
    let n = scan.len();
    let (frames, frame_len, det_cols) = match src {
        Source::Dense(a) => {
            let [r, c, kr, kc] = a.shape();
            (r * c, kr * kc, kc)
        }
        Source::Encoded(e) => (
            e.n_frames() as usize,
            e.frame_shape().len(),
            e.frame_shape().cols,
        ),
        Source::Host { frame, .. } => (n, frame.len(), frame.cols),
    };
    if b == 0 || s.k.len() != b || s.g0.len() != b || n == 0 || frames != n {
        return Err(
            Error::invalid(OP, "BF pixels, k vectors, sums and scan disagree")
                .with_expected(format!("{b} k vectors and sums, {n} frames"))
                .with_found(format!(
                    "{} k vectors, {} sums, {frames} frames",
                    s.k.len(),
                    s.g0.len()
                )),
        );
    }
    if s.nu_r.len() != scan.rows || s.nu_c.len() != scan.cols {
        return Err(Error::invalid(OP, "scan frequencies do not match the scan")
            .with_expected(format!("{} and {}", scan.rows, scan.cols))
            .with_found(format!("{} and {}", s.nu_r.len(), s.nu_c.len())));
    }
    if let Some(&p) = s.pixels.iter().find(|&&p| p >= frame_len) {
        return Err(Error::invalid(OP, "pixel index outside the frame")
            .with_expected(format!("< {frame_len}"))
            .with_found(p.to_string()));
    }
    Ok((frames, frame_len, det_cols))
}

/// What [`fill_g`] reads and writes.
struct FillG<'a> {
    e: &'static Engine,
    src: &'a Source<'a>,
    counter: &'a Arc<MemCounter>,
    f: &'a Funcs,
    scan: Shape2,
    /// BF pixels.
    b: usize,
    /// Scan positions.
    n: usize,
    /// Half-spectrum values per image.
    nh: u64,
    frames: usize,
    frame_len: usize,
    /// BF pixels per FFT batch.
    batch: usize,
    /// ENCODED sources: BF pixels per decode pass staged as u16 images (0 = not staged).
    stage: usize,
    /// Bytes of the ENCODED route's decode scratch.
    scratch: u64,
    storage: GStorage,
    pixels: &'a DevBuf,
    gscale: &'a DevBuf,
    g: &'a DevBuf,
}

/// The buffers of [`fill_g`]'s batches.
struct Batch {
    /// f32 images of one FFT batch, `[pixel][scan position]`.
    images: DevBuf,
    /// cuFFT's half spectra of one batch, `[pixel][h]`, before the store into G's tiles.
    temp: DevBuf,
    /// The R2C plan of a whole batch (a shorter last batch transforms the earlier batch's
    /// images behind its own too, unstored), so one cuFFT work area exists, as budgeted.
    plan: SizedPlan,
    /// ENCODED sources: the decode scratch and the decoder's error record.
    dec: Option<(DevBuf, DevBuf)>,
}

/// Fill G batch by batch: gather the batch's BF-pixel images (dense data in place, host data
/// through two pinned buffers, ENCODED data decoded frame chunk by frame chunk, or staged as
/// u16 images [`FillG::stage`] pixels per decode pass), R2C them with cuFFT and store the half
/// spectra into G's tiles; one synchronize and record check at the end.
fn fill_g(x: &FillG<'_>) -> Result<()> {
    let ctx = x.e.gpu.ctx();
    let c = Some(x.counter);
    let bt = Batch {
        images: DevBuf::alloc(ctx, x.batch * x.n * 4, c, "BF pixel images")?,
        temp: DevBuf::alloc(
            ctx,
            (x.batch as u64 * x.nh * 8) as usize,
            c,
            "batch spectra",
        )?,
        plan: make_plan(
            &x.e.gpu,
            x.scan,
            cufft_sys::cufftType::CUFFT_R2C,
            x.batch,
            x.counter,
        )?,
        dec: match x.src {
            Source::Encoded(_) => Some((
                DevBuf::alloc(ctx, x.scratch as usize, c, "decoded frames")?,
                new_err_record(ctx, c)?,
            )),
            Source::Dense(_) | Source::Host { .. } => None,
        },
    };
    match x.src {
        Source::Encoded(_) if x.stage > 0 => fill_staged(x, &bt)?,
        Source::Host { images, .. } => fill_from_host(x, &bt, *images)?,
        Source::Dense(_) | Source::Encoded(_) => {
            for p0 in (0..x.b).step_by(x.batch) {
                let np = x.batch.min(x.b - p0);
                let (pix, out) = (x.pixels.ptr() + (p0 * 4) as u64, bt.images.ptr());
                match x.src {
                    Source::Dense(a) => launch_gather(
                        x.e.gpu.stream(),
                        x.f.gather(a.dtype()),
                        a.device_ptr(),
                        x.frame_len,
                        x.frames,
                        0,
                        x.n,
                        pix,
                        np,
                        out,
                    )?,
                    _ => decode_gather(x, &bt, &x.f.gather_u16, pix, np, out)?,
                }
                fft_store(x, &bt, p0, np)?;
            }
        }
    }
    x.e.gpu
        .stream()
        .synchronize()
        .map_err(|er| driver_error("synchronize ssb prepare", er))?;
    if let Some((_, err)) = &bt.dec {
        if let Some(fault) = read_err(err)? {
            return Err(fault_error(&fault, fault.frame).with_op("ssb gather_pixels"));
        }
    }
    Ok(())
}

/// Queue one decode pass over every frame of the ENCODED source, chunk by chunk through the
/// decode scratch, with `gather` taking BF pixels `pix[0..np)` of each chunk into `out`
/// (`[pixel][scan position]`, of the gather's output type).
fn decode_gather(
    x: &FillG<'_>,
    bt: &Batch,
    gather: &CudaFunction,
    pix: u64,
    np: usize,
    out: u64,
) -> Result<()> {
    let (Source::Encoded(enc), Some((dec, err))) = (x.src, bt.dec.as_ref()) else {
        return Err(Error::internal(OP, "decode scratch missing"));
    };
    let stream = x.e.gpu.stream();
    let rk = x.e.rans()?;
    let per = (x.scratch / (x.frame_len as u64 * 2)).max(1) as usize;
    for f0 in (0..x.frames).step_by(per) {
        let nf = per.min(x.frames - f0);
        // SAFETY: `dec` holds `per × frame_len` u16 ≥ nf frames; `err` is a zeroed record;
        // both live until fill_g's synchronize, and the gather below reads `dec` in stream
        // order before the next decode.
        unsafe { enc.launch_decode_dense(rk, stream, f0 as u64, nf as u64, dec.ptr(), err.ptr()) }?;
        launch_gather(
            stream,
            gather,
            dec.ptr(),
            x.frame_len,
            nf,
            f0,
            x.n,
            pix,
            np,
            out,
        )?;
    }
    Ok(())
}

/// The ENCODED route under a tight budget: per decode pass, [`FillG::stage`] BF pixels staged
/// as u16 images, then converted and transformed [`FillG::batch`] at a time.
fn fill_staged(x: &FillG<'_>, bt: &Batch) -> Result<()> {
    let c = Some(x.counter);
    let staged = DevBuf::alloc(x.e.gpu.ctx(), x.stage * x.n * 2, c, "staged u16 images")?;
    let stream = x.e.gpu.stream();
    for s0 in (0..x.b).step_by(x.stage) {
        let ns = x.stage.min(x.b - s0);
        let pix = x.pixels.ptr() + (s0 * 4) as u64;
        decode_gather(x, bt, &x.f.gather_u16_to_u16, pix, ns, staged.ptr())?;
        for p0 in (s0..s0 + ns).step_by(x.batch) {
            let np = x.batch.min(s0 + ns - p0);
            let src = staged.ptr() + ((p0 - s0) * x.n * 2) as u64;
            let (dst, len) = (bt.images.ptr(), (np * x.n) as u64);
            let mut lb = stream.launch_builder(&x.f.u16_to_f32);
            lb.arg(&src).arg(&len).arg(&dst);
            // SAFETY: matches `qem_ssb_u16_to_f32(const u16*, u64, float*)`; `staged` holds
            // stage·n ≥ (p0 − s0 + np)·n u16 and `images` batch·n ≥ np·n f32; grid-stride loop.
            unsafe { lb.launch(grid_1d(len)) }
                .map_err(|er| driver_error("launch ssb u16_to_f32", er))?;
            fft_store(x, bt, p0, np)?;
        }
    }
    // `staged` is freed on return: the work that reads it must be done first.
    stream
        .synchronize()
        .map_err(|er| driver_error("synchronize ssb staged gather", er))
}

/// The host route: each batch's images filled by the host into two pinned buffers of at most
/// [`HOST_CHUNK_BYTES`] in turn and uploaded asynchronously (the host fills the next while the
/// card copies and transforms the last).
fn fill_from_host(x: &FillG<'_>, bt: &Batch, host: &dyn HostImages) -> Result<()> {
    let stream = x.e.gpu.stream();
    let ctx = x.e.gpu.ctx();
    let chunk_px = (HOST_CHUNK_BYTES / (x.n * 4)).clamp(1, x.batch);
    // Each pinned buffer with the event of its last upload.
    let mut staging = Staging {
        bufs: Vec::new(),
        stream,
        engine: x.e,
    };
    for _ in 0..2 {
        let buf = x.e.take_pinned(chunk_px * x.n * 4, "SSB host images")?;
        let ev = ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|er| driver_error("create event", er))?;
        staging.bufs.push((buf, ev, false));
    }
    let mut turn = 0usize;
    for p0 in (0..x.b).step_by(x.batch) {
        let np = x.batch.min(x.b - p0);
        // The copies queue behind the last batch's R2C (which reads `images`) in stream
        // order; the host waits only for a buffer's previous copy.
        for c0 in (p0..p0 + np).step_by(chunk_px) {
            let cn = chunk_px.min(p0 + np - c0);
            let (buf, ev, used) = &mut staging.bufs[turn % 2];
            turn += 1;
            if *used {
                ev.synchronize()
                    .map_err(|er| driver_error("wait for an SSB upload", er))?;
            }
            let bytes = cn * x.n * 4;
            let out: &mut [u32] = bytemuck::try_cast_slice_mut(&mut buf.as_mut_slice()[..bytes])
                .map_err(|_| Error::internal(OP, "pinned buffer not 4-byte aligned"))?;
            host.fill(c0, cn, out)?;
            buf.copy_to_device_async(&bt.images, (c0 - p0) * x.n * 4, bytes, stream)?;
            ev.record(stream)
                .map_err(|er| driver_error("record an SSB upload", er))?;
            *used = true;
        }
        let (buf, len) = (bt.images.ptr(), (np * x.n) as u64);
        let mut lb = stream.launch_builder(&x.f.u32_to_f32);
        lb.arg(&buf).arg(&len);
        // SAFETY: matches `qem_ssb_u32_to_f32(unsigned int*, u64)`; `images` holds
        // batch·n ≥ np·n 4-byte values; grid-stride loop.
        unsafe { lb.launch(grid_1d(len)) }
            .map_err(|er| driver_error("launch ssb u32_to_f32", er))?;
        fft_store(x, bt, p0, np)?;
    }
    Ok(())
}

/// R2C the batch's `np` images (pixels `p0..p0 + np`) with the whole batch's plan and store
/// the half spectra into G.
fn fft_store(x: &FillG<'_>, bt: &Batch, p0: usize, np: usize) -> Result<()> {
    let gpu = &x.e.gpu;
    // SAFETY: the plan is `batch` R2C transforms of the scan; `images` holds batch·n f32 and
    // `temp` batch·nh complex f32; stream order.
    unsafe {
        cufft::exec_r2c(
            bt.plan.plan.0,
            bt.images.ptr() as *mut f32,
            bt.temp.ptr() as *mut cufft_sys::cufftComplex,
        )
    }
    .map_err(|er| cufft_error(OP, "R2C of the BF images", er))?;
    let (tp, gs, gp) = (bt.temp.ptr(), x.gscale.ptr(), x.g.ptr());
    let (np32, p032, nb32) = (np as u32, p0 as u32, x.b as u32);
    let mut lb = gpu.stream().launch_builder(&x.f.store);
    lb.arg(&tp).arg(&x.nh).arg(&np32).arg(&p032).arg(&nb32);
    if x.storage != GStorage::C32 {
        lb.arg(&gs);
    }
    lb.arg(&gp);
    // SAFETY: matches `qem_ssb_store_g32(const float2*, u64, u32, u32, u32, float2*)`,
    // `qem_ssb_store_g16(const float2*, u64, u32, u32, u32, const float*, ushort2*)` or
    // `qem_ssb_store_g12(…, const float*, unsigned char*)`; temp holds np·nh float2, G
    // b·padded_half(nh) values of the storage's bytes (whole tiles) with p0 + np ≤ b, gscale b
    // floats; grid-stride loop.
    unsafe { lb.launch(grid_1d(x.nh * np as u64)) }
        .map_err(|er| driver_error("launch ssb store", er))?;
    Ok(())
}
