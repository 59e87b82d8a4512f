//! `qem-cuda`: the CUDA engine of quantem.gpu.
//!
//! This is the **only crate that knows cudarc**: everything above it (the `qem` façade, the CLI,
//! Python) sees plain Rust types and [`qem_core::Error`]s. It owns
//!
//! * [`device`]: finding the driver, NVRTC and a device without ever panicking
//!   ([`device::probe`], [`device::Gpu`]), with provenance strings;
//! * [`nvrtc`]: compiling the embedded `kernels/*.cu` sources to CUBIN for the present device,
//!   cached in memory and on disk per (source, arch, defines, NVRTC version), after the
//!   [`shipped`] kernels compiled at build time (no NVRTC, no compile on first use);
//! * [`bslz4`]: the batched bitshuffle/LZ4 (HDF5 filter 32008) decoder: host-side planning
//!   from the CPU parser's block table ([`bslz4::Bslz4Batch`]), upload, launch and typed
//!   error reporting ([`bslz4::DeviceBatch`]);
//! * [`load`]: the overlapped load pipeline (reader threads → pinned slots → H2D on a copy
//!   stream → decode/region/bin on a compute stream) producing a [`DeviceArray`];
//! * [`products`]: the fused detector reductions, their results on the host or left on the
//!   device ([`device_result`]), and the steps that finish a device result on the card
//!   ([`device_forms`]: the mean DP, the centre of mass);
//! * [`transform`]: region/bin/dtype and mask kernels; [`mem`]: raw device and pinned buffers;
//!   [`mod@engine`]: the process-wide context with its compiled kernels.
//!
//! Kernel names, launch shapes and `unsafe` launches live only in the kernel wrapper modules
//! (here [`bslz4`] and [`transform`]). On a machine without CUDA everything builds (cudarc's dynamic loading) and
//! every entry point returns [`qem_core::ErrorKind::BackendUnavailable`] instead of panicking.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod bslz4;
pub mod device;
pub mod device_forms;
pub mod device_result;
pub mod dpc;
pub mod engine;
pub mod fault;
pub mod fft;
pub mod load;
pub mod mem;
pub mod nvrtc;
pub mod products;
pub mod rans;
pub mod shipped;
pub mod ssb;
pub mod transform;

pub use bslz4::{Bslz4Batch, Bslz4Kernels, DeviceBatch, LaunchShape};
pub use device::{check_alive, describe, probe, DeviceInfo, Gpu};
pub use device_forms::DeviceCom;
pub use device_result::{DeviceMoments, DeviceReduceResult, DeviceVec, HostVec, ResultDType};
pub use engine::{engine, engine_info, Engine};
pub use load::{
    encode_device_array, load_array, load_source, load_source_encoded, DeviceArray, EncodeOptions,
    GpuEncodedLoad, GpuLoad, GpuLoadParams, LoadPlan, PipelineOptions,
};
pub use products::{
    reduce_dense, reduce_dense_on_device, reduce_encoded, reduce_encoded_on_device,
};
pub use rans::{DeviceEncoded, DeviceModel, RansKernels};
