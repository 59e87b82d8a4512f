//! What the façade benchmarks (`cuda_products_bench`, `ssb_cuda_bench`) share through
//! `#[path]`: loading a master file through `qem::load`, and the relative L2 difference they
//! compare results with.

use qem::{BackendRequest, Dataset, LoadParams, Region, Representation, SourceArg};

/// Load `master` on `backend` as `representation`, cropped to `region`, with the detector
/// binned by `det_bin`.
pub fn load(
    master: &str,
    backend: BackendRequest,
    region: Option<Region>,
    det_bin: usize,
    representation: Representation,
) -> qem::Result<Dataset> {
    qem::load(
        SourceArg::Path(master.into()),
        &LoadParams {
            backend,
            representation: Some(representation),
            scan_region: region,
            det_bin,
            // Binned u16 sums widen to u32, which ENCODED does not hold; u16 is exact when
            // every binned value fits (else the load fails with an Overflow error).
            dtype: if det_bin > 1 {
                qem::DtypeRequest::U16
            } else {
                qem::DtypeRequest::Native
            },
            ..LoadParams::default()
        },
    )
}

/// ‖a − b‖ / ‖b‖ (with ‖b‖ kept above the smallest positive f64).
pub fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}
