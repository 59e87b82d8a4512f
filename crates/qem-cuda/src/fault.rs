//! A deliberate device fault (test hook): launches `kernels/fault.cu`, which stores to an
//! address no allocation holds, so the context takes a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`.
//! Tests use it to check that a lost context is reported as one typed
//! [`ErrorKind::DeviceLost`](qem_core::ErrorKind) error by every later call. Never called by
//! the engine itself.

use cudarc::driver::{LaunchConfig, PushKernelArg};
use qem_core::Result;

use crate::device::driver_error;
use crate::engine::engine;
use crate::nvrtc::load_module;

const KERNEL_SOURCE: &str = include_str!("kernels/fault.cu");

/// Make the process's CUDA context lost on purpose. Returns the `DeviceLost` error the fault
/// produced (an `Ok` would mean the store did not fault, which the caller should treat as a
/// failed injection).
pub fn inject_fault() -> Result<()> {
    let e = engine()?;
    let gpu = &e.gpu;
    let m = load_module(gpu, "fault.cu", KERNEL_SOURCE, &[])?;
    let f = m
        .module
        .load_function("qem_inject_fault")
        .map_err(|er| driver_error("load kernel qem_inject_fault", er))?;
    // An address in the first page, which the driver never maps.
    let bad: u64 = 0x10;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&bad);
    // SAFETY: deliberately unsound for the device (the store faults); the host side is sound:
    // the argument is one u64 matching `qem_inject_fault(unsigned int*)`.
    unsafe { b.launch(LaunchConfig::for_num_elems(1)) }
        .map_err(|er| driver_error("inject a device fault (launch)", er))?;
    gpu.stream()
        .synchronize()
        .map_err(|er| driver_error("inject a device fault", er))
}
