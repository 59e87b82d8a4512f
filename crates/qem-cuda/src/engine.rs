//! The process-wide CUDA engine: one context on device 0 and the compiled kernels, created on
//! first use and kept for the life of the process, so a second load pays no context creation
//! and no NVRTC compile.

use std::sync::OnceLock;

use qem_core::Result;

use crate::bslz4::Bslz4Kernels;
use crate::device::{DeviceInfo, Gpu};
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
}

static ENGINE: OnceLock<Result<Engine>> = OnceLock::new();

/// The shared engine, created on the first call (a failure is remembered: CUDA that is not
/// usable now will not become usable later in the same process).
pub fn engine() -> Result<&'static Engine> {
    ENGINE
        .get_or_init(|| {
            let gpu = Gpu::new(0)?;
            let decode = Bslz4Kernels::load(&gpu)?;
            let transform = TransformKernels::load(&gpu)?;
            Ok(Engine {
                gpu,
                decode,
                transform,
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The shared engine's device description, or why CUDA is not usable.
pub fn engine_info() -> Result<DeviceInfo> {
    engine().map(|e| e.gpu.info().clone())
}
