//! Frame transforms of the load pipeline: the wrapper of `kernels/region_bin.cu` (the only
//! place that knows its kernel names and launch shapes).
//!
//! [`DetectorPlan`] (qem-core, validated once for both engines) is the host-side geometry, shared
//! by the planner, the kernel arguments and
//! the tests: mask first, then the half-open detector region (source pixels), then
//! count-preserving binning with partial edge blocks kept (`ceil`), then the result dtype — the
//! CPU engine's `FramePlan` order.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use qem_core::{DType, DetectorPlan, Error, Result};

use crate::device::{driver_error, Gpu};
use crate::nvrtc::{load_module, ModuleInfo};

/// The kernel source, embedded.
pub const KERNEL_SOURCE: &str = include_str!("kernels/region_bin.cu");
const KERNEL_FILE: &str = "region_bin.cu";
const THREADS: u32 = 256;
/// Words of the overflow record.
pub const ERR_WORDS: usize = 8;

fn dtype_tag(d: DType) -> &'static str {
    match d {
        DType::U8 => "u8",
        DType::U16 => "u16",
        DType::U32 => "u32",
    }
}

/// The transform kernels loaded into one context.
#[derive(Debug, Clone)]
pub struct TransformKernels {
    region_bin: Vec<((DType, DType), CudaFunction)>,
    zero: Vec<(DType, CudaFunction)>,
    frame_sums: CudaFunction,
    /// How the module was obtained.
    pub module: ModuleInfo,
    sms: u32,
}

const DTYPES: [DType; 3] = [DType::U8, DType::U16, DType::U32];

impl TransformKernels {
    /// Compile (or fetch from the cache) and load the transform kernels.
    pub fn load(gpu: &Gpu) -> Result<TransformKernels> {
        let m = load_module(gpu, KERNEL_FILE, KERNEL_SOURCE, &[])?;
        let mut region_bin = Vec::new();
        let mut zero = Vec::new();
        let function = |name: String| {
            m.module
                .load_function(&name)
                .map_err(|e| driver_error(&format!("load kernel {name}"), e))
        };
        for s in DTYPES {
            for t in DTYPES {
                let f = function(format!("qem_region_bin_{}_{}", dtype_tag(s), dtype_tag(t)))?;
                region_bin.push(((s, t), f));
            }
            zero.push((s, function(format!("qem_zero_pixels_{}", dtype_tag(s)))?));
        }
        Ok(TransformKernels {
            region_bin,
            zero,
            frame_sums: function("qem_frame_sums_u16".into())?,
            module: m.info,
            sms: gpu.info().multiprocessors.max(1) as u32,
        })
    }

    /// A one-dimensional launch of `THREADS`-thread blocks over `total` items, the grid capped
    /// at 32 blocks per SM (the kernels stride over what is left).
    fn config(&self, total: u64) -> LaunchConfig {
        let grid = total
            .div_ceil(THREADS as u64)
            .clamp(1, self.sms as u64 * 32) as u32;
        LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The function loaded for `key` in `list` (every key is loaded by
/// [`TransformKernels::load`], so a miss is an internal error of `op`).
fn pick<'k, K: PartialEq>(
    list: &'k [(K, CudaFunction)],
    key: K,
    op: &str,
    what: &str,
) -> Result<&'k CudaFunction> {
    list.iter()
        .find(|(d, _)| *d == key)
        .map(|(_, f)| f)
        .ok_or_else(|| Error::internal(op, what))
}

/// Arguments of one region/bin launch (device addresses are raw `u64`).
#[derive(Debug, Clone, Copy)]
pub struct RegionBinArgs {
    /// Decoded source frames, frame-contiguous, `source.len()` elements each.
    pub src: u64,
    /// Source dtype.
    pub src_dtype: DType,
    /// Number of source frames at `src`.
    pub n_frames: u32,
    /// Per source frame: result frame index, or `u32::MAX` to skip (`n_frames` words).
    pub dst_frame: u64,
    /// Result array base.
    pub dst: u64,
    /// Result dtype.
    pub dst_dtype: DType,
    /// The dtype whose range the values must fit: `dst_dtype`, or `u8` when `u8` counts are
    /// written widened to `u16` (the encoder's symbols). Larger values overflow (an error) or
    /// are clipped (`saturate`) at its maximum.
    pub value_dtype: DType,
    /// Source-sized `u8` bad-pixel lookup (1 = bad), or 0 for none.
    pub bad: u64,
    /// Clip to the result dtype instead of recording an overflow.
    pub saturate: bool,
    /// Overflow record ([`ERR_WORDS`] words).
    pub err: u64,
    /// Saturated-value counter (one u64).
    pub saturated: u64,
}

/// Queue one region/bin launch on `stream`.
///
/// # Safety
/// Every address must be a live device allocation of the size described in [`RegionBinArgs`]
/// (the result must hold every result frame index named in `dst_frame` × `plan.output.len()`
/// elements), and must stay allocated until the stream has passed this launch.
pub unsafe fn launch_region_bin(
    k: &TransformKernels,
    stream: &cudarc::driver::CudaStream,
    plan: &DetectorPlan,
    a: &RegionBinArgs,
) -> Result<()> {
    if plan.source.len() > u32::MAX as usize {
        return Err(
            Error::invalid("load (cuda)", "detector too large for the GPU kernels")
                .with_expected(format!("at most {} pixels", u32::MAX))
                .with_found(plan.source.to_string()),
        );
    }
    let total = plan.output.len() as u64 * a.n_frames as u64;
    if total == 0 {
        return Ok(());
    }
    let f = pick(
        &k.region_bin,
        (a.src_dtype, a.dst_dtype),
        "region/bin",
        "no kernel for this dtype pair",
    )?;
    let cfg = k.config(total);
    let src_frame_elems = plan.source.len() as u64;
    let src_cols = plan.source.cols as u32;
    let (r0, r1) = (plan.region.row_start as u32, plan.region.row_stop as u32);
    let (c0, c1) = (plan.region.col_start as u32, plan.region.col_stop as u32);
    let bin = plan.bin as u32;
    let (orows, ocols) = (plan.output.rows as u32, plan.output.cols as u32);
    let has_bad = u32::from(a.bad != 0);
    if a.value_dtype.size() > a.dst_dtype.size() {
        return Err(Error::internal(
            "load (cuda)",
            "region/bin values wider than the result dtype",
        ));
    }
    let t_max = a.value_dtype.max_value();
    let saturate = u32::from(a.saturate);
    let mut b = stream.launch_builder(f);
    b.arg(&a.src)
        .arg(&src_frame_elems)
        .arg(&src_cols)
        .arg(&r0)
        .arg(&r1)
        .arg(&c0)
        .arg(&c1)
        .arg(&bin)
        .arg(&orows)
        .arg(&ocols)
        .arg(&a.bad)
        .arg(&has_bad)
        .arg(&a.dst_frame)
        .arg(&a.n_frames)
        .arg(&a.dst)
        .arg(&t_max)
        .arg(&saturate)
        .arg(&a.err)
        .arg(&a.saturated);
    // SAFETY: the argument list matches `qem_region_bin_<S>_<T>` in region_bin.cu (pointers as
    // 64-bit addresses, u64, 9 × u32, ptr, u32, ptr, u32, ptr, u64, u32, ptr, ptr); the
    // caller guarantees the buffers (see the function's contract); the region lies inside the
    // source frame (validated by `DetectorPlan::new`).
    unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch region/bin", e))?;
    Ok(())
}

/// Queue a launch that zeroes pixels `idx` (`n_idx` u32 frame offsets) of `n_frames` result
/// frames of `frame_elems` elements at `dst`.
///
/// # Safety
/// `dst` must hold `n_frames × frame_elems` elements of `dtype`, `idx` `n_idx` words each
/// `< frame_elems`, both alive until the stream has passed this launch.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_zero_pixels(
    k: &TransformKernels,
    stream: &cudarc::driver::CudaStream,
    dtype: DType,
    dst: u64,
    n_frames: u64,
    frame_elems: u64,
    idx: u64,
    n_idx: u32,
) -> Result<()> {
    let total = n_frames * n_idx as u64;
    if total == 0 {
        return Ok(());
    }
    let f = pick(&k.zero, dtype, "mask", "no kernel for this dtype")?;
    let cfg = k.config(total);
    let mut b = stream.launch_builder(f);
    b.arg(&dst)
        .arg(&n_frames)
        .arg(&frame_elems)
        .arg(&idx)
        .arg(&n_idx);
    // SAFETY: matches `qem_zero_pixels_<T>(T*, u64, u64, const u32*, u32)`; buffers per the
    // function's contract.
    unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch mask", e))?;
    Ok(())
}

/// Frames one block of `qem_frame_sums_u16` sums (kernels/region_bin.cu `FRAME_SUM_SPAN`).
const FRAME_SUM_SPAN: u64 = 128;

/// Queue `sums[p] += Σ_f frames[f][p]` over the `n_frames` u16 frames at `frames` whose entry
/// in the frame map at `map` is not `u32::MAX` (the frames an encoded load encodes): its sum DP
/// on the way, exact in u64.
///
/// # Safety
/// `frames` must hold `n_frames × frame_elems` u16, `map` `n_frames` words and `sums`
/// `frame_elems` u64, all alive until the stream has passed this launch.
pub unsafe fn launch_frame_sums(
    k: &TransformKernels,
    stream: &cudarc::driver::CudaStream,
    frames: u64,
    n_frames: u64,
    frame_elems: u64,
    map: u64,
    sums: u64,
) -> Result<()> {
    if n_frames == 0 || frame_elems == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (
            frame_elems.div_ceil(4 * THREADS as u64) as u32,
            n_frames.div_ceil(FRAME_SUM_SPAN) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&k.frame_sums);
    b.arg(&frames)
        .arg(&n_frames)
        .arg(&frame_elems)
        .arg(&map)
        .arg(&sums);
    // SAFETY: matches `qem_frame_sums_u16(const u16*, u64, u64, const u32*, unsigned long
    // long*)`; buffers per the function's contract; the grid covers every pixel (4 per thread)
    // and every frame (FRAME_SUM_SPAN per block row).
    unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch frame sums", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use qem_core::{Region, Shape2};

    #[test]
    fn region_plan_matches_the_cpu_frame_plan() {
        let det = Shape2::new(7, 5);
        for &(region, bin) in &[
            (Region::new(0, 7, 0, 5), 1),
            (Region::new(0, 7, 0, 5), 2),
            (Region::new(1, 6, 1, 5), 3),
            (Region::new(2, 3, 0, 5), 4),
        ] {
            let g = DetectorPlan::new(det, Some(region), bin).unwrap();
            let c =
                qem_cpu::FramePlan::new(det, Some(region), bin, DType::U32, false, None).unwrap();
            assert_eq!(g.output, c.output_shape());
            // Every source pixel of the region is summed into exactly one result pixel.
            let mut hits = vec![0u32; det.len()];
            for orow in 0..g.output.rows {
                for ocol in 0..g.output.cols {
                    let ((r0, r1), (c0, c1)) = g.source_block(orow, ocol);
                    for r in r0..r1 {
                        for c in c0..c1 {
                            hits[r * det.cols + c] += 1;
                        }
                    }
                }
            }
            for r in 0..det.rows {
                for c in 0..det.cols {
                    let inside = r >= region.row_start
                        && r < region.row_stop
                        && c >= region.col_start
                        && c < region.col_stop;
                    assert_eq!(hits[r * det.cols + c], u32::from(inside));
                }
            }
        }
        assert!(DetectorPlan::new(det, None, 0).is_err());
        assert!(DetectorPlan::new(det, None, 8).is_err());
        assert!(DetectorPlan::new(det, Some(Region::new(0, 8, 0, 5)), 1).is_err());
        let id = DetectorPlan::new(det, None, 1).unwrap();
        assert!(id.is_identity(DType::U16, DType::U16));
        assert!(!id.is_identity(DType::U16, DType::U32));
    }

    /// Where NVRTC is installed (no driver needed), the kernels must compile for sm_90.
    #[test]
    fn kernels_compile_with_nvrtc_when_present() {
        match crate::nvrtc::compile_cubin(KERNEL_FILE, KERNEL_SOURCE, "sm_90", &[]) {
            Ok((cubin, _log)) => assert!(!cubin.is_empty()),
            Err(e) => assert_eq!(e.kind, qem_core::ErrorKind::BackendUnavailable, "{e}"),
        }
    }

    #[test]
    fn kernel_source_has_every_name() {
        for s in DTYPES {
            for t in DTYPES {
                let name = format!("qem_region_bin_{}_{}", dtype_tag(s), dtype_tag(t));
                assert!(KERNEL_SOURCE.contains(&format!("QEM_REGION_BIN({name},")));
            }
            assert!(KERNEL_SOURCE.contains(&format!(
                "QEM_ZERO_PIXELS(qem_zero_pixels_{},",
                dtype_tag(s)
            )));
        }
    }
}
