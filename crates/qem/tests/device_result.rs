//! Device results (`qem::detector::*_on_device`, issue 21 item 2): on a CUDA dataset the arrays
//! stay in GPU memory and hold exactly the host path's values; on a CPU dataset every call is an
//! `InvalidArgument` error naming the backend. The CPU cases run everywhere; the CUDA cases
//! return early (saying so) where no device is usable, and run on the GPU machine with
//! `cargo test --release -p qem --test device_result -- --nocapture`.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

mod common;

use qem::detector::{
    self, DetectorKind, DetectorMask, DetectorParams, Product, ReduceRequest, ResultDType,
    VirtualImage,
};
use qem::dpc;
use qem::{
    BackendRequest, DType, Dataset, DenseArray, DtypeRequest, ErrorKind, LoadParams, Region,
    Representation, Shape2,
};

/// A rectangular scan and an odd detector.
const SCAN: Shape2 = Shape2::new(7, 11);
const DET: Shape2 = Shape2::new(17, 19);

/// `SCAN × DET` frames of [`common::disk_counts`] (its bright disk at `(8, 9)`, a few values
/// near the top of the u16 range) on `backend`, held in `representation`.
fn load_on(backend: BackendRequest, representation: Representation) -> qem::Result<Dataset> {
    let params = LoadParams {
        backend,
        representation: Some(representation),
        ..LoadParams::default()
    };
    let data = DenseArray::U16(common::disk_counts(SCAN, DET));
    common::try_load_array(data, SCAN, DET, &params)
}

/// The CUDA datasets (DENSE, ENCODED), or `None` where CUDA is not usable here.
fn cuda_datasets() -> Option<Vec<(Representation, Dataset)>> {
    if qem::resolve_backend(BackendRequest::Cuda).is_err() {
        eprintln!("no usable CUDA device: device results not exercised");
        return None;
    }
    Some(
        [Representation::Dense, Representation::Encoded]
            .into_iter()
            .map(|r| {
                let ds = load_on(BackendRequest::Cuda, r)
                    .unwrap_or_else(|e| panic!("CUDA {r:?} load failed: {e}"));
                (r, ds)
            })
            .collect(),
    )
}

/// Binary masks (ten: two launches of eight), one integer-weighted and one float mask.
fn masks() -> Vec<DetectorMask> {
    let n = DET.len();
    let mut out: Vec<DetectorMask> = (0..10)
        .map(|k| DetectorMask::Int((0..n).map(|p| u32::from((p + k) % (k + 2) == 0)).collect()))
        .collect();
    out.push(DetectorMask::Int(
        (0..n).map(|p| (p as u32 * 37) % 65_536).collect(),
    ));
    out.push(DetectorMask::Float(
        (0..n).map(|p| (p as f64 * 0.37).sin()).collect(),
    ));
    out
}

fn full_request() -> ReduceRequest {
    ReduceRequest {
        masks: masks(),
        sum_dp: true,
        max_dp: true,
        moments: true,
        frames: None,
    }
}

fn assert_cpu_refusal(what: &str, e: qem::Error) {
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{what}: {e}");
    let text = e.to_string();
    assert!(
        text.contains("device_result=True needs a CUDA dataset; this dataset is on the CPU"),
        "{what}: {text}"
    );
    assert_eq!(
        e.found.as_deref(),
        Some("backend \"cpu\""),
        "{what}: {text}"
    );
}

#[test]
fn cpu_datasets_refuse_every_device_result() {
    for repr in [Representation::Dense, Representation::Encoded] {
        let ds = load_on(BackendRequest::Cpu, repr).unwrap();
        let p = DetectorParams::default();
        let mask = DetectorMask::Int(vec![1; DET.len()]);
        assert_cpu_refusal(
            "reduce",
            detector::reduce_on_device(&ds, &full_request()).unwrap_err(),
        );
        assert_cpu_refusal(
            "virtual_image",
            detector::virtual_image_on_device(&ds, &mask).unwrap_err(),
        );
        assert_cpu_refusal("sum_dp", detector::sum_dp_on_device(&ds).unwrap_err());
        assert_cpu_refusal("max_dp", detector::max_dp_on_device(&ds).unwrap_err());
        assert_cpu_refusal("mean_dp", detector::mean_dp_on_device(&ds).unwrap_err());
        assert_cpu_refusal(
            "center_of_mass",
            dpc::center_of_mass_on_device(&ds, true).unwrap_err(),
        );
        assert_cpu_refusal("moments", detector::moments_on_device(&ds).unwrap_err());
        for kind in DetectorKind::ALL {
            if kind == DetectorKind::Annular {
                continue; // needs bounds; the refusal comes first anyway, checked below
            }
            assert_cpu_refusal(
                kind.name(),
                detector::detector_image_on_device(&ds, kind, &p).unwrap_err(),
            );
        }
        let annular = DetectorParams {
            inner: Some(1.0),
            outer: Some(3.0),
            ..p
        };
        assert_cpu_refusal(
            "annular",
            detector::detector_image_on_device(&ds, DetectorKind::Annular, &annular).unwrap_err(),
        );
        assert_cpu_refusal(
            "products",
            detector::products_on_device(&ds, &[Product::Det(DetectorKind::Bf)], &p).unwrap_err(),
        );
        // The refusal comes before any pass: the sum DP was not computed and cached.
        assert!(
            format!("{ds:?}").contains("sum_dp_cached: false"),
            "{repr:?}: a refused call ran a pass"
        );
    }
}

#[test]
fn device_results_equal_the_host_path_bit_for_bit() {
    let Some(sets) = cuda_datasets() else { return };
    let cpu = load_on(BackendRequest::Cpu, Representation::Dense).unwrap();
    let req = full_request();
    let cpu_want = detector::reduce(&cpu, &req).unwrap();
    for (repr, ds) in &sets {
        let host = detector::reduce(ds, &req).unwrap();
        let dev = detector::reduce_on_device(ds, &req)
            .unwrap_or_else(|e| panic!("{repr:?} device reduction failed: {e}"));
        let ordinal = ds.cuda_ordinal().unwrap();
        for v in dev.images.iter().chain(&dev.sum_dp).chain(&dev.max_dp) {
            assert_eq!(v.device_ordinal(), ordinal, "{repr:?}");
            assert_eq!(v.device_ptr() % v.dtype().size() as u64, 0, "{repr:?}");
        }
        assert_eq!(dev.images[0].dtype(), ResultDType::U64);
        assert_eq!(dev.images[11].dtype(), ResultDType::F64);
        assert_eq!(dev.max_dp.as_ref().unwrap().dtype(), ResultDType::U32);
        assert_eq!(dev.images[0].len(), SCAN.len());
        assert_eq!(dev.sum_dp.as_ref().unwrap().len(), DET.len());
        // The images of one launch share its buffer; the second launch has its own.
        assert!(dev.images[0].shares_allocation(&dev.images[7]), "{repr:?}");
        assert!(!dev.images[0].shares_allocation(&dev.images[8]), "{repr:?}");
        let got = dev.to_host().unwrap();
        // Same kernels, same order: float images too are equal bit for bit.
        assert_eq!(
            got, host,
            "{repr:?}: device result differs from the host path"
        );
        // The integers against the CPU engine (float images only to rounding).
        assert_eq!(got.sum_dp, cpu_want.sum_dp, "{repr:?}");
        assert_eq!(got.max_dp, cpu_want.max_dp, "{repr:?}");
        assert_eq!(got.moments, cpu_want.moments, "{repr:?}");
        assert_eq!(got.images[..11], cpu_want.images[..11], "{repr:?}");
        // A scan ROI: one value per selected frame, in order.
        let roi = ReduceRequest {
            frames: Some(vec![0, 5, 6, 40, 76]),
            ..req.clone()
        };
        let got = detector::reduce_on_device(ds, &roi)
            .unwrap()
            .to_host()
            .unwrap();
        assert_eq!(got, detector::reduce(ds, &roi).unwrap(), "{repr:?} ROI");
        let cpu_roi = detector::reduce(&cpu, &roi).unwrap();
        assert_eq!(got.n_frames, 5);
        assert_eq!(
            (&got.sum_dp, &got.max_dp, &got.moments),
            (&cpu_roi.sum_dp, &cpu_roi.max_dp, &cpu_roi.moments),
            "{repr:?} ROI"
        );
    }
}

#[test]
fn named_detectors_and_patterns_on_the_device() {
    let Some(sets) = cuda_datasets() else { return };
    let p = DetectorParams::default();
    for (repr, ds) in &sets {
        let ordinal = ds.cuda_ordinal().unwrap();
        for kind in [DetectorKind::Bf, DetectorKind::Adf, DetectorKind::Haadf] {
            let host = detector::detector_image(ds, kind, &p).unwrap();
            let dev = detector::detector_image_on_device(ds, kind, &p).unwrap();
            assert_eq!(
                detector::download_image(&dev.image).unwrap(),
                VirtualImage::U64(host.image.clone()),
                "{repr:?} {kind}"
            );
            assert!(
                host.image.iter().any(|&v| v > 0),
                "{repr:?} {kind}: an empty image"
            );
            assert_eq!(
                (
                    dev.kind,
                    dev.inner_px,
                    dev.outer_px,
                    dev.mask_pixels,
                    dev.disk
                ),
                (
                    host.kind,
                    host.inner_px,
                    host.outer_px,
                    host.mask_pixels,
                    host.disk
                ),
                "{repr:?} {kind}"
            );
            assert_eq!(
                dev.provenance.params["result_device"],
                format!("cuda:{ordinal}"),
                "{repr:?} {kind}"
            );
            assert_eq!(
                dev.provenance.params["detector"],
                host.provenance.params["detector"]
            );
        }
        let mask = DetectorMask::Int((0..DET.len() as u32).map(|p| p % 3).collect());
        let VirtualImage::U64(want) = detector::virtual_image(ds, &mask).unwrap() else {
            panic!("an integer mask gave a float image")
        };
        let dev = detector::virtual_image_on_device(ds, &mask).unwrap();
        assert_eq!(
            detector::download_image(&dev).unwrap(),
            VirtualImage::U64(want)
        );
        let sum = detector::sum_dp_on_device(ds).unwrap();
        assert_eq!(
            sum.to_host().unwrap(),
            detector::HostVec::U64(detector::sum_dp(ds).unwrap()),
            "{repr:?}"
        );
        let max = detector::max_dp_on_device(ds).unwrap();
        assert_eq!(
            max.to_host().unwrap(),
            detector::HostVec::U32(detector::max_dp(ds).unwrap()),
            "{repr:?}"
        );
        let m = detector::moments_on_device(ds).unwrap();
        let want = detector::moments(ds).unwrap();
        assert_eq!(m.sum.to_host().unwrap(), detector::HostVec::U64(want.sum));
        assert_eq!(
            m.m_row.to_host().unwrap(),
            detector::HostVec::U64(want.m_row)
        );
        assert_eq!(
            m.m_col.to_host().unwrap(),
            detector::HostVec::U64(want.m_col)
        );
    }
}

#[test]
fn products_on_the_device_match_products() {
    let Some(sets) = cuda_datasets() else { return };
    let p = DetectorParams::default();
    let which = [
        Product::Det(DetectorKind::Bf),
        Product::Det(DetectorKind::Adf),
        Product::SumDp,
        Product::MaxDp,
        Product::Moments,
    ];
    for (repr, ds) in &sets {
        let host = detector::products(ds, &which, &p).unwrap();
        let dev = detector::products_on_device(ds, &which, &p).unwrap();
        assert_eq!(dev.images.len(), 2);
        for (d, h) in dev.images.iter().zip(&host.images) {
            assert_eq!(d.kind, h.kind);
            assert_eq!(
                detector::download_image(&d.image).unwrap(),
                VirtualImage::U64(h.image.clone()),
                "{repr:?} {}",
                h.kind
            );
        }
        assert_eq!(
            dev.sum_dp.unwrap().to_host().unwrap(),
            detector::HostVec::U64(host.sum_dp.unwrap())
        );
        assert_eq!(
            dev.max_dp.unwrap().to_host().unwrap(),
            detector::HostVec::U32(host.max_dp.unwrap())
        );
        let (dm, hm) = (dev.moments.unwrap(), host.moments.unwrap());
        assert_eq!(
            dm.m_col.to_host().unwrap(),
            detector::HostVec::U64(hm.m_col)
        );
        assert_eq!(dev.disk, host.disk);
        assert!(
            dev.mean_dp.is_none() && dev.com.is_none(),
            "{repr:?}: not asked for"
        );
        assert!(dev.provenance.params["result_device"]
            .as_str()
            .is_some_and(|s| s.starts_with("cuda:")));
    }
}

#[test]
fn device_results_outlive_their_dataset_and_each_other() {
    let Some(sets) = cuda_datasets() else { return };
    let p = DetectorParams::default();
    for (repr, mut ds) in sets {
        let bf_host = detector::detector_image(&ds, DetectorKind::Bf, &p)
            .unwrap()
            .image;
        let adf_host = detector::detector_image(&ds, DetectorKind::Adf, &p)
            .unwrap()
            .image;
        assert_ne!(
            bf_host, adf_host,
            "{repr:?}: the test needs two different images"
        );
        // Two results in flight at once: separate allocations, each with its own values.
        let bf = detector::detector_image_on_device(&ds, DetectorKind::Bf, &p).unwrap();
        let adf = detector::detector_image_on_device(&ds, DetectorKind::Adf, &p).unwrap();
        assert_ne!(bf.image.device_ptr(), adf.image.device_ptr(), "{repr:?}");
        assert!(!bf.image.shares_allocation(&adf.image), "{repr:?}");
        // A clone (what a DLPack export holds) keeps the memory after the result is dropped
        // and after the dataset is closed.
        let kept = bf.image.clone();
        drop(bf);
        ds.close();
        drop(ds);
        // Churn the allocator: new device buffers must not land on the kept one.
        let churn = load_on(BackendRequest::Cuda, repr).unwrap();
        let _more = detector::sum_dp_on_device(&churn).unwrap();
        assert_eq!(
            detector::download_image(&kept).unwrap(),
            VirtualImage::U64(bf_host),
            "{repr:?}: the kept BF image changed"
        );
        assert_eq!(
            detector::download_image(&adf.image).unwrap(),
            VirtualImage::U64(adf_host),
            "{repr:?}: the ADF image changed"
        );
    }
}

/// The bits of `f64` values (equal bits: equal values, signed zeros and NaNs included).
fn bits64(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn f64s(v: &detector::DeviceVec) -> Vec<f64> {
    match v.to_host().unwrap() {
        detector::HostVec::F64(x) => x,
        other => panic!("expected float64 values, found {other:?}"),
    }
}

fn f32_bits(v: &detector::DeviceVec) -> Vec<u32> {
    match v.to_host().unwrap() {
        detector::HostVec::F32(x) => x.iter().map(|x| x.to_bits()).collect(),
        other => panic!("expected float32 values, found {other:?}"),
    }
}

/// A device CoM against the host's: the same bits, counts, unit and calibration.
fn assert_same_com(
    what: &str,
    dev: &dpc::CenterOfMass<detector::DeviceVec>,
    host: &dpc::CenterOfMass,
) {
    assert_eq!(dev.com_row.dtype(), ResultDType::F64, "{what}");
    assert_eq!(
        bits64(&f64s(&dev.com_row)),
        bits64(&host.com_row),
        "{what}: com_row"
    );
    assert_eq!(
        bits64(&f64s(&dev.com_col)),
        bits64(&host.com_col),
        "{what}: com_col"
    );
    assert_eq!(
        (dev.zero_frames, &dev.unit, dev.centered, dev.scan_shape),
        (host.zero_frames, &host.unit, host.centered, host.scan_shape),
        "{what}"
    );
    for key in [
        "calibration",
        "detector_angular_sampling_mrad",
        "zero_frames",
        "unit",
    ] {
        assert_eq!(
            dev.provenance.params.get(key),
            host.provenance.params.get(key),
            "{what}: {key}"
        );
    }
    assert!(
        dev.provenance.params["result_device"]
            .as_str()
            .is_some_and(|s| s.starts_with("cuda:")),
        "{what}"
    );
}

#[test]
fn mean_dp_and_com_on_the_device_are_the_host_values_bit_for_bit() {
    let Some(sets) = cuda_datasets() else { return };
    for (repr, ds) in &sets {
        let mean = detector::mean_dp_on_device(ds).unwrap();
        assert_eq!((mean.dtype(), mean.len()), (ResultDType::F32, DET.len()));
        let want: Vec<u32> = detector::mean_dp(ds)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(f32_bits(&mean), want, "{repr:?}: mean DP");
        for centered in [true, false] {
            let host = dpc::center_of_mass(ds, centered).unwrap();
            let dev = dpc::center_of_mass_on_device(ds, centered).unwrap();
            assert_same_com(&format!("{repr:?} centered={centered}"), &dev, &host);
        }
    }
}

/// A scan of more than one ordered chunk (8192 frames) with empty frames and a detector
/// sampling that differs along rows and columns (the CoM in mrad): the device CoM must add its
/// chunk sums as the CPU does, and scale each component by its own factor.
#[test]
fn com_on_the_device_matches_over_several_chunks_with_a_calibration() {
    use qem_io::writer::{Calibration, WriteParams};
    if qem::resolve_backend(BackendRequest::Cuda).is_err() {
        eprintln!("no usable CUDA device: device CoM not exercised");
        return;
    }
    let (scan, det) = (Shape2::new(96, 97), Shape2::new(6, 7));
    let mut data: Vec<u32> = common::disk_counts(scan, det)
        .into_iter()
        .map(u32::from)
        .collect();
    for f in (0..scan.len()).step_by(37) {
        data[f * det.len()..(f + 1) * det.len()].fill(0);
    }
    let dir = tempfile::tempdir().unwrap();
    let params = WriteParams {
        calibration: Calibration {
            angular_sampling_mrad: Some((0.25, 0.3)),
            ..Calibration::default()
        },
        ..common::write_params(dir.path(), scan, det, DType::U16)
    };
    let master = common::write_data(&params, &data);
    for repr in [Representation::Dense, Representation::Encoded] {
        let load = LoadParams {
            backend: BackendRequest::Cuda,
            representation: Some(repr),
            ..LoadParams::default()
        };
        let ds = common::load_path(&master, &load).unwrap();
        for centered in [true, false] {
            let host = dpc::center_of_mass(&ds, centered).unwrap();
            assert_eq!(host.unit, "mrad");
            assert_eq!(host.zero_frames, scan.len().div_ceil(37) as u64);
            let dev = dpc::center_of_mass_on_device(&ds, centered).unwrap();
            assert_same_com(&format!("{repr:?} centered={centered}"), &dev, &host);
        }
        let which = [Product::MeanDp, Product::Com, Product::SumDp];
        let p = DetectorParams::default();
        let host = detector::products(&ds, &which, &p).unwrap();
        let dev = detector::products_on_device(&ds, &which, &p).unwrap();
        let want: Vec<u32> = host.mean_dp.unwrap().iter().map(|x| x.to_bits()).collect();
        assert_eq!(
            f32_bits(&dev.mean_dp.unwrap()),
            want,
            "{repr:?}: products mean_dp"
        );
        assert_same_com(
            &format!("{repr:?} products"),
            &dev.com.unwrap(),
            &host.com.unwrap(),
        );
        assert!(dev.moments.is_none(), "moments were not asked for");
        assert_eq!(
            dev.provenance.params["com_centered"],
            host.provenance.params["com_centered"]
        );
    }
}

/// `dpc.run` of a CUDA dataset (every stage on the card) against the host stages on the same
/// dataset's host-reduced moments (`run_on_moments`, whose integration is cuFFT too): the CoM,
/// the aligned field and the phase with the same bits, the same rotation, transpose, sign and
/// provenance decisions; and the phase of a CPU dataset (rustfft) to rounding.
fn assert_dpc_on_the_card_equals_the_host(what: &str, ds: &Dataset, cpu: &Dataset) {
    use qem::dpc::{AdfImage, DpcParams, EdgeMode};
    let which = [Product::Det(DetectorKind::Adf), Product::Moments];
    let prods = detector::products(ds, &which, &DetectorParams::default()).unwrap();
    let moments = prods.moments.as_ref().unwrap();
    let params = [
        DpcParams::default(),
        DpcParams {
            edge: EdgeMode::Mirror,
            ..DpcParams::default()
        },
        DpcParams {
            rotation_deg: Some(23.0),
            transpose: Some(true),
            edge: EdgeMode::Periodic,
        },
        DpcParams {
            rotation_deg: Some(-131.0),
            transpose: None,
            edge: EdgeMode::Mirror,
        },
    ];
    for p in params {
        let what = format!("{what} {p:?}");
        let card = dpc::run(ds, &p).unwrap();
        let adf = prods.images.first().map(|im| AdfImage {
            image: &im.image,
            info: card.provenance.params["adf"].clone(),
        });
        let host = dpc::run_on_moments(ds, moments, adf, ds.scan_shape(), &p).unwrap();
        for (name, a, b) in [
            ("com_row", &card.com_row, &host.com_row),
            ("com_col", &card.com_col, &host.com_col),
            ("dpc_row", &card.dpc_row, &host.dpc_row),
            ("dpc_col", &card.dpc_col, &host.dpc_col),
            ("phase", &card.phase, &host.phase),
        ] {
            assert_eq!(bits64(a), bits64(b), "{what}: {name}");
        }
        let decisions = |r: &dpc::DpcResult| {
            (
                r.rotation_deg.to_bits(),
                r.transpose,
                r.curl_score.to_bits(),
                r.sign_confidence.to_bits(),
                r.sign_criterion.clone(),
                r.confident,
                r.zero_frames,
            )
        };
        assert_eq!(decisions(&card), decisions(&host), "{what}");
        for key in ["rotation", "sign", "adf", "unit", "phase_unit", "edge"] {
            assert_eq!(
                card.provenance.params[key], host.provenance.params[key],
                "{what}: {key}"
            );
        }
        assert_eq!(card.provenance.params["stages_on"], "cuda", "{what}");
        // The CPU engine (rustfft): the same decisions, the phase to rounding.
        let reference = dpc::run(cpu, &p).unwrap();
        assert_eq!(
            (reference.rotation_deg.to_bits(), reference.transpose),
            (card.rotation_deg.to_bits(), card.transpose),
            "{what}: CPU engine"
        );
        assert_eq!(bits64(&reference.dpc_row), bits64(&card.dpc_row), "{what}");
        let scale = reference.phase.iter().fold(0f64, |m, v| m.max(v.abs()));
        for (a, b) in reference.phase.iter().zip(&card.phase) {
            assert!((a - b).abs() <= 1e-12 * scale, "{what}: phase {a} vs {b}");
        }
    }
}

#[test]
fn dpc_run_on_the_card_equals_the_host_stages() {
    let Some(sets) = cuda_datasets() else { return };
    let cpu = load_on(BackendRequest::Cpu, Representation::Dense).unwrap();
    for (repr, ds) in &sets {
        assert_dpc_on_the_card_equals_the_host(&format!("{repr:?} {SCAN}"), ds, &cpu);
    }
    // Two ordered chunks (96 × 97 > 8192 positions) for the sign sums and the mirror's mean,
    // and a scan with no interior (2 × 5: no curl, rotation not determined).
    for scan in [Shape2::new(96, 97), Shape2::new(2, 5)] {
        let det = Shape2::new(9, 8);
        let load = |backend, representation| {
            let params = LoadParams {
                backend,
                representation: Some(representation),
                ..LoadParams::default()
            };
            let data = DenseArray::U16(common::disk_counts(scan, det));
            common::try_load_array(data, scan, det, &params).unwrap()
        };
        let cpu = load(BackendRequest::Cpu, Representation::Dense);
        for repr in [Representation::Dense, Representation::Encoded] {
            let ds = load(BackendRequest::Cuda, repr);
            assert_dpc_on_the_card_equals_the_host(&format!("{repr:?} {scan}"), &ds, &cpu);
        }
    }
}

/// A CUDA ENCODED load from a file takes the sum DP on the way, from the frames it encodes (bad
/// pixels masked, the scan region's frames, the detector region binned, u8 values capped): the
/// dataset holds it before any product ran, equal to the naive reference's sum, and the first
/// `products` call reads it from the cache. Frames of 195 pixels take the kernel's 2-byte path,
/// binned ones of 36 its 8-byte path.
#[test]
fn encoded_file_load_takes_the_sum_dp_on_the_way() {
    if qem::resolve_backend(BackendRequest::Cuda).is_err() {
        eprintln!("no usable CUDA device: the load's sum DP not exercised");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let w = common::write(dir.path(), (9, 7), (15, 13), DType::U16, |f, p| {
        (common::mix(f, p) % 3000) as u32
    });
    let (scan, det) = (w.scan.full(), w.det.full());
    let cases = [
        (scan, det, 1, DtypeRequest::U16),
        (
            Region::new(1, 8, 2, 7),
            Region::new(2, 14, 1, 12),
            2,
            DtypeRequest::U16,
        ),
        (scan, det, 1, DtypeRequest::U8Saturating),
    ];
    for (scan_region, det_region, bin, dtype) in cases {
        let what = format!("{scan_region:?} {det_region:?} bin {bin} {dtype:?}");
        let params = LoadParams {
            backend: BackendRequest::Cuda,
            representation: Some(Representation::Encoded),
            scan_region: Some(scan_region),
            detector_region: Some(det_region),
            det_bin: bin,
            dtype,
            ..LoadParams::default()
        };
        let ds = common::load_path(&w.master, &params).unwrap();
        assert!(
            format!("{ds:?}").contains("sum_dp_cached: true"),
            "{what}: no sum DP from the load"
        );
        let cap = if dtype == DtypeRequest::U8Saturating {
            255
        } else {
            u64::MAX
        };
        let frames = common::reference(&w, scan_region, det_region, bin);
        let n = ds.detector_shape().len();
        let mut want = vec![0u64; n];
        for (i, v) in frames.iter().enumerate() {
            want[i % n] += (*v).min(cap);
        }
        assert!(want.iter().any(|&v| v > 0), "{what}");
        assert_eq!(detector::sum_dp(&ds).unwrap(), want, "{what}");
        let p = detector::products(
            &ds,
            &[Product::SumDp, Product::Det(DetectorKind::Bf)],
            &DetectorParams::default(),
        )
        .unwrap();
        assert_eq!(p.provenance.params["sum_dp_from_cache"], true, "{what}");
        assert_eq!(p.sum_dp.as_deref(), Some(&want[..]), "{what}");
    }
}
