//! Loading sources into a [`Dataset`], and reporting on them.

use crate::backend::{cpu_description, cuda_description, resolve_backend, Backend, BackendRequest};
use crate::dataset::{Dataset, Representation, Storage};
use qem_core::{
    checked_product, CodecInfo, DType, DenseArray, DetectorPlan, DtypeRequest, Error, ErrorKind,
    FileIdentity, MaskPolicy, Metadata, NoProgress, Progress, Provenance, Region, Result,
    ScanShapeOrigin, Shape2, StageTiming, PACKAGE_VERSION,
};
use qem_cpu::{FramePlan, LoadHooks};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

pub use qem_io::{Format, Inspection, RawLayout};

/// The git revision this library was built from.
pub const GIT_REVISION: &str = env!("QEM_GIT_REVISION");

/// What to load.
#[derive(Debug)]
pub enum SourceArg {
    /// A Dectris master file, or a plain HDF5 file with a 3-D/4-D dataset.
    Path(PathBuf),
    /// An in-memory array of shape `(R_r, R_c, k_r, k_c)` or `(N, k_r, k_c)` (then the scan
    /// shape comes from [`LoadParams::scan_shape`] or a perfect square).
    Array {
        /// The counts, row-major.
        data: DenseArray,
        /// 3 or 4 dimensions.
        shape: Vec<usize>,
    },
}

/// Options of [`load`]; `Default` is "everything, native dtype, auto backend".
#[derive(Clone, Debug)]
pub struct LoadParams {
    /// Which engine.
    pub backend: BackendRequest,
    /// Scan shape override (checked against the frames present).
    pub scan_shape: Option<Shape2>,
    /// Half-open scan region; only these frames are read.
    pub scan_region: Option<Region>,
    /// Half-open detector region in source pixels (applied before binning).
    pub detector_region: Option<Region>,
    /// Count-preserving detector binning factor (1 = none).
    pub det_bin: usize,
    /// Result dtype policy.
    pub dtype: DtypeRequest,
    /// Dense or encoded; `None` = the backend's default ([`default_representation`]).
    pub representation: Option<Representation>,
    /// Zero bad pixels (from `pixel_mask`) before narrowing and binning.
    pub apply_mask: bool,
    /// Upper bound on bytes the result may occupy.
    pub memory_budget: Option<u64>,
    /// HDF5 dataset path inside a plain HDF5 file.
    pub dataset_path: Option<String>,
    /// The file format; `None` recognises it by content (docs/formats.md).
    pub format: Option<qem_io::Format>,
    /// Layout of a generic raw binary file (`format = raw`).
    pub raw: Option<qem_io::RawLayout>,
    /// Consent to read float32 frames as counts `round(value / float_scale)` (negatives read
    /// 0); a float32 source without it is refused.
    pub float_scale: Option<f64>,
    /// Progress receiver.
    pub progress: Option<Arc<dyn Progress>>,
}

impl Default for LoadParams {
    fn default() -> Self {
        LoadParams {
            backend: BackendRequest::Auto,
            scan_shape: None,
            scan_region: None,
            detector_region: None,
            det_bin: 1,
            dtype: DtypeRequest::Native,
            representation: None,
            apply_mask: true,
            memory_budget: None,
            dataset_path: None,
            format: None,
            raw: None,
            float_scale: None,
            progress: None,
        }
    }
}

/// Load `source` with `params`.
///
/// Nothing is cropped, binned, masked or narrowed unless asked; the result's provenance records
/// every choice. Over budget is a typed `MemoryBudget` error, never a silent reduction.
pub fn load(source: SourceArg, params: &LoadParams) -> Result<Dataset> {
    let starts_engine = params.backend != BackendRequest::Cpu && !qem_cuda::engine::started();
    let t = Instant::now();
    let backend = match &source {
        SourceArg::Path(path) if params.backend != BackendRequest::Cpu => {
            resolve_backend_opening(path, params)?
        }
        _ => resolve_backend(params.backend)?,
    };
    let engine_start = match (starts_engine, backend) {
        (true, Backend::Cuda) => engine_start_stages(t.elapsed().as_secs_f64())?,
        _ => Vec::new(),
    };
    let representation = params
        .representation
        .unwrap_or_else(|| default_representation(backend));
    let progress: &dyn Progress = match &params.progress {
        Some(p) => p.as_ref(),
        None => &NoProgress,
    };
    let request = Request {
        params,
        backend,
        representation,
        progress,
        engine_start: &engine_start,
    };
    match source {
        SourceArg::Path(path) => load_path(&path, request),
        SourceArg::Array { data, shape } => load_in_memory(data, &shape, request),
    }
}

/// The first stages of the load that started the CUDA engine: the wall time of the start
/// (beside the source's open), then what it was made of.
fn engine_start_stages(wall: f64) -> Result<Vec<StageTiming>> {
    let mut v = vec![StageTiming::new(
        "CUDA engine start (first use in this process, beside the source's open; \
                with QEM_WARM_START the wait for its thread)",
        wall,
    )];
    v.extend(qem_cuda::engine()?.startup_stages());
    Ok(v)
}

/// [`resolve_backend`] (which creates the CUDA engine on first use: context, pinned pool,
/// kernel modules, a few hundred ms in a fresh process) while another thread opens the source
/// (HDF5 index and metadata, ~80 ms for the 512² reference): the open fills `Source::open`'s
/// in-process index cache, so the loader's own open is then answered from it. Its result is
/// dropped: the loader opens again and reports any error itself.
fn resolve_backend_opening(path: &Path, params: &LoadParams) -> Result<Backend> {
    std::thread::scope(|s| {
        let is_qem = match params.format {
            Some(f) => f == qem_io::Format::Qem,
            None => crate::qemfile::is_qem_file(path).unwrap_or(true),
        };
        if !is_qem && qem_io::index_cache_enabled() {
            s.spawn(|| drop(qem_io::Source::open(path, &open_options(params))));
        }
        resolve_backend(params.backend)
    })
}

/// The source-opening options of `params`.
fn open_options(params: &LoadParams) -> qem_io::OpenOptions {
    qem_io::OpenOptions {
        dataset_path: params.dataset_path.clone(),
        scan_shape: params.scan_shape,
        format: params.format,
        raw: params.raw.clone(),
        float_scale: params.float_scale.map(qem_io::FloatScale),
    }
}

/// What each loader gets besides the source: the caller's parameters and the engine,
/// representation and progress that [`load`] resolved from them.
#[derive(Clone, Copy)]
pub(crate) struct Request<'a> {
    pub(crate) params: &'a LoadParams,
    pub(crate) backend: Backend,
    pub(crate) representation: Representation,
    pub(crate) progress: &'a dyn Progress,
    /// The CUDA engine's start, when this load started it (its provenance's first stages).
    pub(crate) engine_start: &'a [StageTiming],
}

/// The representation a load gets when the caller does not say: DENSE on the CPU engine,
/// ENCODED on CUDA (docs/concepts.md §2, "representation") — except where the result dtype is
/// not `u16` (ENCODED holds `u16` counts on the GPU), where CUDA loads stay DENSE; provenance
/// records the choice.
pub fn default_representation(backend: Backend) -> Representation {
    match backend {
        Backend::Cpu => Representation::Dense,
        Backend::Cuda => Representation::Encoded,
    }
}

/// The representation a load actually gets for `result_dtype` (see [`default_representation`]);
/// an explicit request is kept (and refused later if it cannot be honoured).
pub(crate) fn effective_representation(
    requested: Option<Representation>,
    backend: Backend,
    result_dtype: DType,
) -> Representation {
    match requested {
        Some(r) => r,
        None if backend == Backend::Cuda && result_dtype != DType::U16 => Representation::Dense,
        None => default_representation(backend),
    }
}

/// Bytes of memory the OS says are available (Linux `MemAvailable`), if known.
fn host_memory_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Admit a result of `bytes` against the caller's budget and the host's available memory.
pub(crate) fn admit(bytes: u64, budget: Option<u64>) -> Result<()> {
    let host = host_memory_available();
    let available = match (budget, host) {
        (Some(b), Some(h)) => b.min(h),
        (Some(b), None) => b,
        (None, Some(h)) => h,
        (None, None) => return Ok(()),
    };
    if bytes > available {
        let why = match budget {
            Some(b) if b <= host.unwrap_or(u64::MAX) => "the memory_budget",
            _ => "the host's available memory",
        };
        return Err(
            Error::memory_budget("load", bytes, available).with_op(format!(
            "load (limit: {why}; crop with scan_region, bin with det_bin, or raise memory_budget)"
        )),
        );
    }
    Ok(())
}

pub(crate) struct Planned {
    pub(crate) plan: FramePlan,
    pub(crate) scan_region: Region,
    pub(crate) result_dtype: DType,
    /// The representation the load gets ([`effective_representation`]).
    pub(crate) representation: Representation,
}

/// Plan a load; a dense result is admitted against the memory budget here, an ENCODED one
/// (whose size is known only once encoded) by the encoder.
pub(crate) fn plan_load(
    source_dtype: DType,
    scan: Shape2,
    detector: Shape2,
    bad: Option<&[bool]>,
    params: &LoadParams,
    backend: Backend,
    representation: Representation,
) -> Result<Planned> {
    let scan_region = params.scan_region.unwrap_or(scan.full());
    scan_region.validate(scan, "scan_region")?;
    // Region and bin are validated here, once, for both engines (DetectorPlan).
    let geometry = DetectorPlan::new(detector, params.detector_region, params.det_bin)?;
    // bin ≤ the detector's larger extent, so bin² cannot overflow.
    let bin2 = (geometry.bin as u64).saturating_mul(geometry.bin as u64);
    let result_dtype = params
        .dtype
        .result_dtype(source_dtype, source_dtype.max_value().saturating_mul(bin2));
    let saturate = params.dtype == DtypeRequest::U8Saturating;
    let plan = FramePlan::with_geometry(geometry, result_dtype, saturate, bad)?;
    // Checked: every factor comes from a file or a caller. A plan larger than this machine
    // could address is refused here, for every backend, before anything is allocated.
    let bytes = checked_product(
        ErrorKind::MemoryBudget,
        "load",
        "the planned result size in bytes",
        &[
            ("scan positions", scan_region.shape().len() as u64),
            ("pixels per frame", plan.output_len() as u64),
            ("bytes per pixel", result_dtype.size() as u64),
        ],
    )?;
    if bytes > isize::MAX as u64 {
        return Err(Error::memory_budget("load", bytes, isize::MAX as u64).with_op(
            "load (the planned result is larger than addressable memory; crop with scan_region or bin with det_bin)",
        ));
    }
    let representation = match params.representation {
        Some(_) => representation,
        None => effective_representation(None, backend, result_dtype),
    };
    if representation == Representation::Encoded && result_dtype == DType::U32 {
        return Err(crate::encode::u32_refusal("load"));
    }
    // The CUDA engine admits every device buffer itself (against the GPU's free memory).
    if backend == Backend::Cpu && representation == Representation::Dense {
        admit(bytes, params.memory_budget)?;
    }
    Ok(Planned {
        plan,
        scan_region,
        result_dtype,
        representation,
    })
}

/// What a load knows about its source, for the dataset and its provenance.
pub(crate) struct SourceFacts {
    pub(crate) kind: &'static str,
    pub(crate) files: Vec<FileIdentity>,
    pub(crate) dataset_path: Option<String>,
    pub(crate) chunk_index_digest: Option<String>,
    pub(crate) scan: Shape2,
    pub(crate) detector: Shape2,
    pub(crate) dtype: DType,
    pub(crate) bad_pixels: usize,
    pub(crate) metadata: Metadata,
}

/// What an engine produced.
pub(crate) struct Loaded {
    pub(crate) storage: Storage,
    pub(crate) saturated: u64,
    pub(crate) memory: Option<qem_core::MemoryReport>,
    pub(crate) timings: Vec<StageTiming>,
    /// The codec of ENCODED storage.
    pub(crate) codec: Option<CodecInfo>,
    /// The sum DP where the load took it on the way (CUDA ENCODED loads), for the dataset's
    /// detector cache.
    pub(crate) sum_dp: Option<Vec<u64>>,
}

impl Loaded {
    /// The CPU engine's dense load as it is: host memory, no codec.
    fn cpu_dense(l: qem_cpu::DenseLoad) -> Loaded {
        Loaded {
            storage: Storage::CpuDense(l.data),
            saturated: l.saturated,
            memory: None,
            timings: l.timings,
            codec: None,
            sum_dp: None,
        }
    }

    /// The CUDA engine's dense load as it is: device memory, no codec.
    fn cuda_dense(g: qem_cuda::GpuLoad) -> Loaded {
        Loaded {
            storage: Storage::CudaDense(g.array),
            saturated: g.saturated,
            memory: Some(g.memory),
            timings: g.timings,
            codec: None,
            sum_dp: None,
        }
    }
}

/// Assemble the dataset and its provenance (written once for every source kind and engine).
pub(crate) fn finish(
    facts: SourceFacts,
    planned: &Planned,
    params: &LoadParams,
    backend: Backend,
    loaded: Loaded,
) -> Dataset {
    let device = device_of(backend);
    let bad_pixels = facts.bad_pixels;
    let provenance = Provenance {
        source_kind: facts.kind.to_string(),
        files: facts.files,
        dataset_path: facts.dataset_path,
        chunk_index_digest: facts.chunk_index_digest,
        source_scan_shape: facts.scan,
        source_detector_shape: facts.detector,
        scan_region: (!planned.scan_region.is_full(facts.scan)).then_some(planned.scan_region),
        detector_region: params
            .detector_region
            .filter(|r| !r.is_full(facts.detector)),
        det_bin: params.det_bin,
        source_dtype: facts.dtype,
        working_dtype: facts.dtype,
        accumulation_dtype: "u64".into(),
        result_dtype: planned.result_dtype,
        saturated_values: loaded.saturated,
        mask_policy: MaskPolicy {
            applied: params.apply_mask && bad_pixels > 0,
            rule: if params.apply_mask {
                MaskPolicy::DECTRIS_RULE.to_string()
            } else {
                "not applied (apply_mask=False)".to_string()
            },
            bad_pixels,
        },
        backend: backend.name().to_string(),
        device: device.clone(),
        package_version: PACKAGE_VERSION.to_string(),
        git_revision: GIT_REVISION.to_string(),
        timings: loaded.timings,
        memory: loaded.memory,
        representation: loaded
            .storage
            .representation()
            .map(|r| r.name().to_string()),
        codec: loaded.codec,
        converted_from: None,
    };
    Dataset {
        scan_shape: planned.scan_region.shape(),
        detector_shape: planned.plan.output_shape(),
        dtype: planned.result_dtype,
        backend,
        device,
        metadata: facts.metadata.for_loaded_grid(
            planned.scan_region.shape(),
            planned.plan.output_shape(),
            params.detector_region,
            params.det_bin,
        ),
        provenance,
        storage: loaded.storage,
        detector_cache: crate::detector::DetectorCache::with_sum_dp(loaded.sum_dp),
    }
}

pub(crate) fn gpu_params<'a>(
    planned: &Planned,
    params: &LoadParams,
    bad: Option<&'a [bool]>,
    progress: &'a dyn Progress,
) -> qem_cuda::GpuLoadParams<'a> {
    qem_cuda::GpuLoadParams {
        scan_region: planned.scan_region,
        detector: planned.plan.detector(),
        result_dtype: planned.result_dtype,
        saturate: params.dtype == DtypeRequest::U8Saturating,
        bad_mask: bad,
        memory_budget: params.memory_budget,
        options: qem_cuda::PipelineOptions::default(),
        progress: Some(progress),
    }
}

fn load_path(path: &Path, request: Request<'_>) -> Result<Dataset> {
    let t_total = Instant::now();
    let qem = match request.params.format {
        Some(f) => f == qem_io::Format::Qem,
        None => crate::qemfile::is_qem_file(path)?,
    };
    if qem {
        return crate::qemfile::load_qem(path, request);
    }
    let t = Instant::now();
    let src = qem_io::Source::open(path, &open_options(request.params))?;
    let t_open = t.elapsed().as_secs_f64();
    // Frames never written fail here, naming the first one in the requested region, before
    // any plan or buffer is sized (a file may declare billions of frames and hold one).
    let region = request.params.scan_region.unwrap_or(src.scan_shape.full());
    region.validate(src.scan_shape, "scan_region")?;
    src.check_region_complete(region, "load")?;
    let mask = src.bad_pixel_mask();
    let bad_count = mask
        .as_ref()
        .map_or(0, |m| m.iter().filter(|&&b| b).count());
    let bad = if request.params.apply_mask {
        mask
    } else {
        None
    };
    let planned = plan_load(
        src.dtype,
        src.scan_shape,
        src.detector_shape,
        bad.as_deref(),
        request.params,
        request.backend,
        request.representation,
    )?;
    let mut timings = request.engine_start.to_vec();
    timings.push(StageTiming::new(
        if src.index_from_cache {
            "open (index from the in-process cache; files unchanged)"
        } else {
            "open (HDF5: index, metadata)"
        },
        t_open,
    ));
    // The CPU engine's dense load of the planned region: the CPU result itself, or the frames
    // the CUDA engine is handed when they need host decoding.
    let load_on_host = || {
        qem_cpu::load_dense(
            &src,
            planned.scan_region,
            &planned.plan,
            LoadHooks {
                progress: request.progress,
            },
        )
    };
    let loaded = match (request.backend, planned.representation) {
        (Backend::Cuda, representation) if src.needs_host_decode() => {
            // The CUDA reader takes file bytes as they are; these need host decoding (a filter
            // we decode on the CPU, byte order, float32, packed pixels): the CPU engine reads
            // and plans the frames, and the result is uploaded.
            admit(
                (planned.scan_region.shape().len() * planned.plan.output_len()) as u64
                    * planned.result_dtype.size() as u64,
                request.params.memory_budget,
            )?;
            let l = load_on_host()?;
            let mut up = upload_host_frames(l.data, &planned, request, representation)?;
            let mut t = l.timings;
            t.push(StageTiming::new(
                "frames decoded on the host, then uploaded",
                0.0,
            ));
            t.extend(up.timings);
            up.timings = t;
            up.saturated = l.saturated;
            up
        }
        (Backend::Cpu, Representation::Dense) => Loaded::cpu_dense(load_on_host()?),
        (Backend::Cpu, Representation::Encoded) => {
            let e = crate::encode::encode_source(
                &src,
                planned.scan_region,
                &planned.plan,
                request.params.memory_budget,
                request.progress,
            )?;
            let dense_bytes = (planned.scan_region.shape().len()
                * planned.plan.output_len()
                * planned.result_dtype.size()) as u64;
            let codec = crate::encode::codec_info(
                e.frames.model(),
                e.frames.nbytes(),
                e.fit_frames,
                dense_bytes,
                Some(e.bytes_read),
            );
            Loaded {
                storage: Storage::CpuEncoded(e.frames),
                saturated: e.saturated,
                memory: None,
                timings: e.timings,
                codec: Some(codec),
                sum_dp: None,
            }
        }
        (Backend::Cuda, Representation::Encoded) => {
            // The result dtype's bytes (u8 counts are coded widened, but sampled as the CPU
            // engine samples them, so both engines fit the same model).
            let frame_bytes = planned.plan.output_len() * planned.result_dtype.size();
            let opts = qem_cuda::EncodeOptions {
                model: qem_cpu::model_params(),
                // The CPU engine's sample rule, so both engines fit the same model.
                sample_frames: crate::encode::sample_count(frame_bytes) as u64,
                ..qem_cuda::EncodeOptions::default()
            };
            let g = qem_cuda::load_source_encoded(
                &src,
                &gpu_params(&planned, request.params, bad.as_deref(), request.progress),
                &opts,
            )?;
            let dense_bytes = (planned.scan_region.shape().len() * frame_bytes) as u64;
            let codec = crate::encode::codec_info(
                g.encoded.model(),
                g.encoded.nbytes(),
                opts.sample_frames.min(g.frames),
                dense_bytes,
                Some(g.bytes_read),
            );
            Loaded {
                storage: Storage::CudaEncoded(g.encoded),
                saturated: g.saturated,
                memory: Some(g.memory),
                timings: g.timings,
                codec: Some(codec),
                sum_dp: g.sum_dp,
            }
        }
        (Backend::Cuda, Representation::Dense) => Loaded::cuda_dense(qem_cuda::load_source(
            &src,
            &gpu_params(&planned, request.params, bad.as_deref(), request.progress),
        )?),
    };
    timings.extend(loaded.timings);
    timings.push(StageTiming::new(
        "total (wall)",
        t_total.elapsed().as_secs_f64(),
    ));
    let mut metadata = src.metadata.clone();
    if let Some(h) = src.host_decode() {
        metadata.extra.insert(
            "host_decode".into(),
            serde_json::Value::String(h.describe()),
        );
        if h.is_float() {
            metadata.extra.insert(
                "float_values_read_as_0".into(),
                serde_json::Value::from(h.negatives_clamped()),
            );
        }
    }
    let facts = SourceFacts {
        kind: src.kind.as_str(),
        chunk_index_digest: Some(src.chunk_index_digest()),
        dataset_path: Some(src.dataset_path.clone()),
        scan: src.scan_shape,
        detector: src.detector_shape,
        dtype: src.dtype,
        bad_pixels: bad_count,
        metadata,
        files: src.files.clone(),
    };
    Ok(finish(
        facts,
        &planned,
        request.params,
        request.backend,
        Loaded { timings, ..loaded },
    ))
}

/// Upload frames decoded on the host (already cropped, binned and typed by `planned`) to the
/// CUDA engine, and encode them there when `representation` is ENCODED.
fn upload_host_frames(
    data: DenseArray,
    planned: &Planned,
    request: Request<'_>,
    representation: Representation,
) -> Result<Loaded> {
    let scan = planned.scan_region.shape();
    let detector = planned.plan.output_shape();
    let params = qem_cuda::GpuLoadParams {
        scan_region: scan.full(),
        detector: DetectorPlan::new(detector, None, 1)?,
        result_dtype: planned.result_dtype,
        saturate: false,
        bad_mask: None,
        memory_budget: request.params.memory_budget,
        options: qem_cuda::PipelineOptions::default(),
        progress: Some(request.progress),
    };
    let g = qem_cuda::load_array(&data, scan, detector, &params)?;
    drop(data);
    cuda_loaded(g, planned, representation)
}

/// A dense array loaded onto the card, kept DENSE or encoded there to ENCODED (the rANS
/// model and sample count of the CPU engine's encoder).
fn cuda_loaded(
    g: qem_cuda::GpuLoad,
    planned: &Planned,
    representation: Representation,
) -> Result<Loaded> {
    if representation == Representation::Dense {
        return Ok(Loaded::cuda_dense(g));
    }
    let frame_bytes = planned.plan.output_len() * planned.result_dtype.size();
    let opts = qem_cuda::EncodeOptions {
        model: qem_cpu::model_params(),
        sample_frames: crate::encode::sample_count(frame_bytes) as u64,
        ..qem_cuda::EncodeOptions::default()
    };
    let en = qem_cuda::encode_device_array(&g.array, &opts)?;
    let dense_bytes = (planned.scan_region.shape().len() * frame_bytes) as u64;
    drop(g.array);
    let codec = crate::encode::codec_info(
        en.encoded.model(),
        en.encoded.nbytes(),
        opts.sample_frames.min(en.frames),
        dense_bytes,
        None,
    );
    let mut timings = g.timings;
    timings.extend(en.timings);
    Ok(Loaded {
        storage: Storage::CudaEncoded(en.encoded),
        saturated: g.saturated,
        memory: Some(en.memory),
        timings,
        codec: Some(codec),
        sum_dp: None,
    })
}

pub(crate) fn device_of(backend: Backend) -> String {
    match backend {
        Backend::Cpu => cpu_description(),
        Backend::Cuda => cuda_description(),
    }
}

fn isqrt_exact(n: usize) -> Option<usize> {
    let r = (n as f64).sqrt().round() as usize;
    (r.checked_mul(r) == Some(n)).then_some(r)
}

fn load_in_memory(data: DenseArray, shape: &[usize], request: Request<'_>) -> Result<Dataset> {
    let t_total = Instant::now();
    let (n_frames, detector, array_scan) = match *shape {
        [r, c, kr, kc] => {
            let scan = Shape2::new(r, c);
            let n = scan.try_len(ErrorKind::InvalidArgument, "load", "array scan shape")?;
            (n, Shape2::new(kr, kc), Some(scan))
        }
        [n, kr, kc] => (n, Shape2::new(kr, kc), None),
        _ => {
            return Err(
                Error::invalid("load", "an array source must have 3 or 4 dimensions")
                    .with_expected("(N, k_r, k_c) or (R_r, R_c, k_r, k_c)")
                    .with_found(format!("{shape:?}")),
            )
        }
    };
    let (scan, origin) = match (request.params.scan_shape, array_scan) {
        (Some(s), Some(a)) if s != a => {
            return Err(Error::invalid("load", "scan_shape does not match the array's scan axes")
                .with_expected(a.to_string())
                .with_found(s.to_string()))
        }
        (_, Some(a)) => (a, ScanShapeOrigin::ArrayShape),
        (Some(s), None) => (s, ScanShapeOrigin::Argument),
        (None, None) => match isqrt_exact(n_frames) {
            Some(r) => (Shape2::new(r, r), ScanShapeOrigin::PerfectSquare),
            None => {
                return Err(Error::invalid(
                    "load",
                    format!("cannot infer the scan shape of {n_frames} frames: pass scan_shape=(rows, cols)"),
                ))
            }
        },
    };
    scan.try_len(ErrorKind::InvalidArgument, "load", "scan_shape")?;
    if scan.len() != n_frames {
        return Err(
            Error::source("load", "scan shape does not match the number of frames")
                .with_expected(format!("{n_frames} frames"))
                .with_found(format!("{scan} = {} frames", scan.len())),
        );
    }
    let elements = checked_product(
        ErrorKind::InvalidArgument,
        "load",
        "the array's element count",
        &[
            ("frames", n_frames as u64),
            ("k_r", detector.rows as u64),
            ("k_c", detector.cols as u64),
        ],
    )?;
    if data.len() as u64 != elements {
        return Err(
            Error::invalid("load", "array size does not match its shape")
                .with_expected(format!("{elements} elements"))
                .with_found(format!("{} elements", data.len())),
        );
    }
    let source_dtype = data.dtype();
    let planned = plan_load(
        source_dtype,
        scan,
        detector,
        None,
        request.params,
        request.backend,
        request.representation,
    )?;
    let mut loaded = match request.backend {
        Backend::Cpu => {
            let l = qem_cpu::load_array(
                &data,
                scan,
                planned.scan_region,
                &planned.plan,
                LoadHooks {
                    progress: request.progress,
                },
            )?;
            if planned.representation == Representation::Encoded {
                drop(data);
                let t = Instant::now();
                let dense_bytes = l.data.nbytes() as u64;
                let (frames, fit_frames) = crate::encode::encode_dense(
                    &l.data,
                    planned.plan.output_shape(),
                    request.progress,
                )?;
                drop(l.data);
                if let Some(b) = request.params.memory_budget {
                    if frames.nbytes() > b {
                        return Err(Error::memory_budget("load (ENCODED)", frames.nbytes(), b));
                    }
                }
                let codec = crate::encode::codec_info(
                    frames.model(),
                    frames.nbytes(),
                    fit_frames,
                    dense_bytes,
                    None,
                );
                let mut timings = l.timings;
                timings.push(StageTiming::new(
                    "fit+encode (wall)",
                    t.elapsed().as_secs_f64(),
                ));
                Loaded {
                    storage: Storage::CpuEncoded(frames),
                    saturated: l.saturated,
                    memory: None,
                    timings,
                    codec: Some(codec),
                    sum_dp: None,
                }
            } else {
                Loaded::cpu_dense(l)
            }
        }
        Backend::Cuda => {
            let g = qem_cuda::load_array(
                &data,
                scan,
                detector,
                &gpu_params(&planned, request.params, None, request.progress),
            )?;
            cuda_loaded(g, &planned, planned.representation)?
        }
    };
    loaded.timings.push(StageTiming::new(
        "total (wall)",
        t_total.elapsed().as_secs_f64(),
    ));
    let facts = SourceFacts {
        kind: "array",
        files: Vec::new(),
        dataset_path: None,
        chunk_index_digest: None,
        scan,
        detector,
        dtype: source_dtype,
        bad_pixels: 0,
        metadata: Metadata {
            detector_shape: Some(detector),
            dtype: Some(source_dtype),
            n_frames: Some(n_frames as u64),
            scan_shape: Some(scan),
            scan_shape_origin: Some(origin),
            ..Metadata::default()
        },
    };
    Ok(finish(
        facts,
        &planned,
        request.params,
        request.backend,
        loaded,
    ))
}

/// Report on a source's readiness without decoding pixels.
pub fn inspect(path: &Path, scan_shape: Option<Shape2>) -> Result<Inspection> {
    qem_io::inspect(path, scan_shape)
}

/// Every Dectris master file (`*_master.h5`) under `folder`, recursively, sorted.
pub fn discover(folder: &Path) -> Result<Vec<PathBuf>> {
    qem_io::discover(folder)
}
