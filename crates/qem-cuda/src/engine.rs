//! The process-wide CUDA engine: one context on device 0 and the compiled kernels, created on
//! first use and kept for the life of the process, so a second load pays no context creation
//! and no NVRTC compile.

use std::sync::{Arc, Mutex, OnceLock};

use qem_core::Result;

use crate::bslz4::Bslz4Kernels;
use crate::device::{DeviceInfo, Gpu};
use crate::mem::PinnedBuf;
use crate::products::ProductKernels;
use crate::rans::RansKernels;
use crate::transform::TransformKernels;

/// Device 0 with every kernel the load pipeline launches.
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
}

/// Most pinned buffers kept for reuse.
const PINNED_KEEP: usize = 16;

impl Engine {
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

/// The shared engine, created on the first call (a failure is remembered: CUDA that is not
/// usable now will not become usable later in the same process). After a sticky fault
/// ([`crate::device::check_alive`]) every call answers the `DeviceLost` error naming it.
pub fn engine() -> Result<&'static Engine> {
    crate::device::check_alive("cuda engine")?;
    ENGINE
        .get_or_init(|| {
            let gpu = Gpu::new(0)?;
            let decode = Bslz4Kernels::load(&gpu)?;
            let transform = TransformKernels::load(&gpu)?;
            Ok(Engine {
                gpu,
                decode,
                transform,
                pinned: Mutex::new(Vec::new()),
                rans: OnceLock::new(),
                products: OnceLock::new(),
                readers: Mutex::new(Vec::new()),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The shared engine's device description, or why CUDA is not usable.
pub fn engine_info() -> Result<DeviceInfo> {
    engine().map(|e| e.gpu.info().clone())
}
