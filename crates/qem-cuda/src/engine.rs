//! The process-wide CUDA engine: one context on one device (ordinal 0 unless
//! [`select_device`] chose another before first use) and the compiled kernels, created on
//! first use and kept for the life of the process, so a second load pays no context creation
//! and no NVRTC compile. One device per process: several GPUs are used by several processes
//! (e.g. one Dask worker per GPU, each with its own `CUDA_VISIBLE_DEVICES`).

use std::sync::{Arc, Mutex, OnceLock};

use qem_core::{Result, StageTiming};

use crate::bslz4::Bslz4Kernels;
use crate::device::{DeviceInfo, Gpu};
use crate::mem::PinnedBuf;
use crate::products::ProductKernels;
use crate::rans::RansKernels;
use crate::transform::TransformKernels;

/// The process's device with every kernel the load pipeline launches.
#[derive(Debug)]
pub struct Engine {
    /// The device (context and its default stream).
    pub gpu: Gpu,
    /// Bitshuffle/LZ4 decode kernels.
    pub decode: Bslz4Kernels,
    /// Region/bin and mask kernels.
    pub transform: TransformKernels,
    /// Pinned host buffers kept between loads (page-locking hundreds of MB costs tens of
    /// milliseconds, so a second load reuses the first one's slots).
    pinned: Mutex<Vec<PinnedBuf>>,
    /// rANS kernels, compiled on first use (a dense-only process never pays for them).
    rans: OnceLock<Result<RansKernels>>,
    /// Detector-reduction kernels, compiled on first use.
    products: OnceLock<Result<ProductKernels>>,
    /// Reader thread pools by thread count, kept between loads: a pool built per load spawned
    /// fresh threads each time, and each new thread's allocator arena kept its pages (host RSS
    /// grew ~140 KB per DENSE load on the H200, issue 17).
    readers: Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>>,
    /// Milliseconds the decode and transform modules took to load at the engine's start.
    modules_ms: f64,
}

/// Most pinned buffers kept for reuse.
const PINNED_KEEP: usize = 16;

impl Engine {
    /// What the engine's start cost, stage by stage (libraries, NVRTC, context, device
    /// queries, kernel modules), for the provenance of the load that started it.
    pub fn startup_stages(&self) -> Vec<StageTiming> {
        let i = self.gpu.info();
        let nvrtc = match i.nvrtc_version {
            Some(_) => format!("{} loaded", i.nvrtc()),
            None => i.nvrtc(),
        };
        [
            ("driver library found".to_string(), i.libraries_ms),
            (nvrtc, i.nvrtc_ms),
            ("driver initialised (cuInit)".to_string(), i.init_ms),
            ("primary context created".to_string(), i.context_ms),
            ("device queries and stream".to_string(), i.query_ms),
            ("decode and transform modules".to_string(), self.modules_ms),
        ]
        .into_iter()
        .map(|(what, ms)| StageTiming::new(format!("CUDA engine start: {what}"), ms * 1e-3))
        .collect()
    }

    /// The rANS codec kernels (compiled or fetched from the cache on the first call).
    pub fn rans(&self) -> Result<&RansKernels> {
        self.rans
            .get_or_init(|| RansKernels::load(&self.gpu))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The fused detector-reduction kernels (compiled or fetched from the cache on the first
    /// call).
    pub fn products(&self) -> Result<&ProductKernels> {
        self.products
            .get_or_init(|| ProductKernels::load(&self.gpu))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The reader pool of `threads` threads (made on first use, then shared by every load).
    pub fn reader_pool(&self, threads: usize) -> Result<Arc<rayon::ThreadPool>> {
        let threads = threads.max(1);
        let mut pools = self
            .readers
            .lock()
            .map_err(|_| qem_core::Error::internal("reader threads", "pool lock poisoned"))?;
        if let Some((_, p)) = pools.iter().find(|(n, _)| *n == threads) {
            return Ok(p.clone());
        }
        let pool = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("qem-reader-{i}"))
                .build()
                .map_err(|e| qem_core::Error::internal("reader threads", e.to_string()))?,
        );
        pools.push((threads, pool.clone()));
        Ok(pool)
    }

    /// A pinned buffer of at least `bytes` bytes: a kept one when one is large enough, else a
    /// new allocation.
    pub fn take_pinned(&self, bytes: usize, what: &str) -> Result<PinnedBuf> {
        if let Ok(mut pool) = self.pinned.lock() {
            // The smallest kept buffer that is large enough.
            let best = pool
                .iter()
                .enumerate()
                .filter(|(_, b)| b.bytes() >= bytes)
                .min_by_key(|(_, b)| b.bytes())
                .map(|(i, _)| i);
            if let Some(i) = best {
                return Ok(pool.swap_remove(i));
            }
        }
        PinnedBuf::alloc(self.gpu.ctx(), bytes, what)
    }

    /// Keep `buf` for a later load (its queued copies must be over).
    pub fn give_pinned(&self, buf: PinnedBuf) {
        if let Ok(mut pool) = self.pinned.lock() {
            pool.push(buf);
            if pool.len() > PINNED_KEEP {
                // Drop the smallest.
                if let Some(i) = pool
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, b)| b.bytes())
                    .map(|(i, _)| i)
                {
                    pool.swap_remove(i);
                }
            }
        }
    }
}

static ENGINE: OnceLock<Result<Engine>> = OnceLock::new();

/// The device ordinal the engine is (or will be) created on; `None` = 0, not chosen.
static ORDINAL: Mutex<Option<usize>> = Mutex::new(None);

/// How many CUDA devices this process sees (after `CUDA_VISIBLE_DEVICES`), or why CUDA is not
/// usable.
pub fn device_count() -> Result<usize> {
    crate::device::libraries_present()?;
    crate::device::guard("count devices", || {
        let n = cudarc::driver::CudaContext::device_count().map_err(|e| {
            qem_core::Error::backend_unavailable("cuda", format!("cuDeviceGetCount failed: {e}"))
        })?;
        Ok(usize::try_from(n).unwrap_or(0))
    })
}

/// Put this process's CUDA engine on device `ordinal` (a CUDA ordinal as this process sees
/// it). Must come before the engine's first use, or name the device it already uses: a
/// process holds one device. Errors: `BackendUnavailable` when CUDA is not usable here,
/// `InvalidArgument` for an ordinal past the device count or another device than the one the
/// engine already uses.
pub fn select_device(ordinal: usize) -> Result<()> {
    const OP: &str = "select CUDA device";
    let mut chosen = ORDINAL
        .lock()
        .map_err(|_| qem_core::Error::internal(OP, "device lock poisoned"))?;
    let current = match ENGINE.get() {
        Some(Ok(e)) => Some(e.gpu.info().ordinal),
        _ => *chosen,
    };
    if current == Some(ordinal) {
        return Ok(());
    }
    // The range first: an index no device has is the more useful thing to say.
    let count = device_count()?;
    if ordinal >= count {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES")
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
            .unwrap_or_default();
        return Err(qem_core::Error::invalid(
            OP,
            format!("device index {ordinal} is out of range{visible}"),
        )
        .with_expected(format!("0 <= device < {count}"))
        .with_found(ordinal.to_string()));
    }
    if let (Some(cur), Some(Ok(_))) = (current, ENGINE.get()) {
        return Err(qem_core::Error::invalid(
            OP,
            format!(
                "this process's CUDA engine is already on device {cur}; a process uses one \
                 device (run one process, e.g. one Dask worker, per GPU)"
            ),
        )
        .with_expected(format!("device={cur}"))
        .with_found(format!("device={ordinal}")));
    }
    *chosen = Some(ordinal);
    Ok(())
}

/// The ordinal the engine is created on: the selected one, else 0.
fn chosen_ordinal() -> usize {
    ORDINAL.lock().map(|g| g.unwrap_or(0)).unwrap_or(0)
}

/// The shared engine, created on the first call (a failure is remembered: CUDA that is not
/// usable now will not become usable later in the same process). After a sticky fault
/// ([`crate::device::check_alive`]) every call answers the `DeviceLost` error naming it.
pub fn engine() -> Result<&'static Engine> {
    crate::device::check_alive("cuda engine")?;
    ENGINE
        .get_or_init(|| {
            let gpu = Gpu::new(chosen_ordinal())?;
            let t = std::time::Instant::now();
            let decode = Bslz4Kernels::load(&gpu)?;
            let transform = TransformKernels::load(&gpu)?;
            let modules_ms = t.elapsed().as_secs_f64() * 1e3;
            Ok(Engine {
                gpu,
                decode,
                transform,
                pinned: Mutex::new(Vec::new()),
                rans: OnceLock::new(),
                products: OnceLock::new(),
                readers: Mutex::new(Vec::new()),
                modules_ms,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Start the engine on a background thread (context, the load's kernel modules, the rANS
/// and product modules) and return at once; a later [`engine`] call waits for it. For
/// processes that know they will use CUDA and have other start-up work to overlap it with
/// (`QEM_WARM_START`, read as the Python extension loads, overlaps it with numpy's import).
/// It fixes the device to the selected one (0 unless [`select_device`] ran before). A failure
/// is remembered as [`engine`] remembers it.
pub fn warm_start() {
    let spawned = std::thread::Builder::new()
        .name("qem-warm-start".into())
        .spawn(|| {
            if let Ok(e) = engine() {
                let _ = e.rans();
                let _ = e.products();
            }
        });
    // A thread that could not be spawned leaves the start to the first use.
    if let (Ok(handle), Ok(mut slot)) = (spawned, WARM_START.lock()) {
        *slot = Some(handle);
    }
}

/// The thread [`warm_start`] spawned, until [`finish_warm_start`] joins it.
static WARM_START: Mutex<Option<std::thread::JoinHandle<()>>> = Mutex::new(None);

/// Wait for the thread of [`warm_start`], if one runs: a process that exits must not leave it
/// inside the driver while the driver's own exit handlers run (the Python package registers
/// this with `atexit`).
pub fn finish_warm_start() {
    let handle = WARM_START.lock().ok().and_then(|mut h| h.take());
    if let Some(h) = handle {
        let _ = h.join();
    }
}

/// Whether this process's engine has been started (successfully or not).
pub fn started() -> bool {
    ENGINE.get().is_some()
}

/// The shared engine's device description, or why CUDA is not usable.
pub fn engine_info() -> Result<DeviceInfo> {
    engine().map(|e| e.gpu.info().clone())
}
