//! Detector products (`qem::detector`) against independent naive loops written here: sums, max,
//! moments, virtual images, the BF disk fit, named detectors, scan ROIs and frames, on dense and
//! ENCODED CPU datasets of every dtype, with rectangular scans, an odd detector, masks touching
//! the detector edge, all-zero frames, detector binning and frame selection.
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures
#![allow(clippy::needless_range_loop)] // the naive references index plainly, on purpose

mod common;

use common::{load_array, load_path, rel_l2};
use qem::detector::{
    self, DetectorKind, DetectorMask, DetectorParams, Product, ScanRoi, Unit, VirtualImage,
};
use qem::{
    BackendRequest, DType, Dataset, DenseArray, DtypeRequest, ErrorKind, LoadParams, Region,
    Representation, Shape2,
};
use qem_core::ReduceRequest;

const SCAN: Shape2 = Shape2::new(5, 7);
const DET: Shape2 = Shape2::new(13, 11);
/// The bright disk of the test patterns: centre and radius (pixels).
const DISK_C: (f64, f64) = (6.0, 4.0);
const DISK_R: f64 = 3.2;
/// All-zero frames of the test data.
const ZERO_FRAMES: [usize; 2] = [3, 20];

/// Deterministic counts: a bright disk, sparse background with a few large values, some
/// frames all zero. `top` is the dtype's maximum.
fn pattern(scan: Shape2, det: Shape2, top: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(scan.len() * det.len());
    for f in 0..scan.len() {
        for p in 0..det.len() {
            if ZERO_FRAMES.contains(&f) {
                out.push(0);
                continue;
            }
            let x = common::mix(f as u64, p);
            let (i, j) = ((p / det.cols) as f64, (p % det.cols) as f64);
            let inside = (i - DISK_C.0).powi(2) + (j - DISK_C.1).powi(2) <= DISK_R * DISK_R;
            let v = match x % 100 {
                _ if inside => top / 4 + (x % 17) as u32,
                0..=59 => 0,
                60..=96 => (x % 5) as u32,
                _ => top - (x % 50) as u32,
            };
            out.push(v);
        }
    }
    out
}

fn array(data: &[u32], dtype: DType) -> DenseArray {
    match dtype {
        DType::U8 => DenseArray::U8(data.iter().map(|&v| v as u8).collect()),
        DType::U16 => DenseArray::U16(data.iter().map(|&v| v as u16).collect()),
        DType::U32 => DenseArray::U32(data.to_vec()),
    }
}

fn cpu_params(repr: Representation) -> LoadParams {
    LoadParams {
        backend: BackendRequest::Cpu,
        representation: Some(repr),
        ..LoadParams::default()
    }
}

fn load_cpu(
    data: &[u32],
    scan: Shape2,
    det: Shape2,
    dtype: DType,
    repr: Representation,
    det_bin: usize,
) -> Dataset {
    let params = LoadParams {
        det_bin,
        ..cpu_params(repr)
    };
    load_array(array(data, dtype), scan, det, &params)
}

// ---- naive reference ---------------------------------------------------------------------

/// Frames after `bin × bin` binning (partial edge blocks kept), as u64.
fn binned(data: &[u32], n: usize, det: Shape2, bin: usize) -> (Shape2, Vec<u64>) {
    let out = Shape2::new(det.rows.div_ceil(bin), det.cols.div_ceil(bin));
    let mut v = vec![0u64; n * out.len()];
    for f in 0..n {
        for i in 0..det.rows {
            for j in 0..det.cols {
                v[f * out.len() + (i / bin) * out.cols + j / bin] +=
                    data[f * det.len() + i * det.cols + j] as u64;
            }
        }
    }
    (out, v)
}

struct Naive {
    det: Shape2,
    n: usize,
    frames: Vec<u64>,
}

impl Naive {
    fn frame(&self, f: usize) -> &[u64] {
        &self.frames[f * self.det.len()..(f + 1) * self.det.len()]
    }
    fn sum(&self, sel: &[usize]) -> Vec<u64> {
        let mut s = vec![0u64; self.det.len()];
        for &f in sel {
            for (k, v) in self.frame(f).iter().enumerate() {
                s[k] += v;
            }
        }
        s
    }
    fn max(&self, sel: &[usize]) -> Vec<u32> {
        let mut m = vec![0u32; self.det.len()];
        for &f in sel {
            for (k, &v) in self.frame(f).iter().enumerate() {
                if v as u32 > m[k] {
                    m[k] = v as u32;
                }
            }
        }
        m
    }
    fn image(&self, w: &[u32]) -> Vec<u64> {
        (0..self.n)
            .map(|f| {
                let mut s = 0u64;
                for k in 0..self.det.len() {
                    s += w[k] as u64 * self.frame(f)[k];
                }
                s
            })
            .collect()
    }
    fn image_f(&self, w: &[f64]) -> Vec<f64> {
        (0..self.n)
            .map(|f| {
                (0..self.det.len())
                    .map(|k| w[k] * self.frame(f)[k] as f64)
                    .sum()
            })
            .collect()
    }
    fn moments(&self) -> [Vec<u64>; 3] {
        let mut m = [vec![], vec![], vec![]];
        for f in 0..self.n {
            let (mut s, mut r, mut c) = (0u64, 0u64, 0u64);
            for i in 0..self.det.rows {
                for j in 0..self.det.cols {
                    let v = self.frame(f)[i * self.det.cols + j];
                    s += v;
                    r += i as u64 * v;
                    c += j as u64 * v;
                }
            }
            m[0].push(s);
            m[1].push(r);
            m[2].push(c);
        }
        m
    }
    /// (centre, radius, threshold, n) of the anchor's fit on the f32 mean DP.
    fn disk(&self) -> ((f64, f64), f64, f64, usize) {
        let all: Vec<usize> = (0..self.n).collect();
        let mean: Vec<f32> = self
            .sum(&all)
            .iter()
            .map(|&s| (s as f64 / self.n as f64) as f32)
            .collect();
        let len = mean.len() as f64;
        let mu: f64 = mean.iter().map(|&v| v as f64).sum::<f64>() / len;
        let sd = (mean.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / len).sqrt();
        let t = mu + sd;
        let sel: Vec<usize> = (0..mean.len()).filter(|&k| mean[k] as f64 > t).collect();
        if sel.is_empty() {
            let (r, c) = (self.det.rows as f64, self.det.cols as f64);
            return ((r / 2.0, c / 2.0), r.min(c) / 4.0, t, 0);
        }
        let cr = sel.iter().map(|&k| (k / self.det.cols) as f64).sum::<f64>() / sel.len() as f64;
        let cc = sel.iter().map(|&k| (k % self.det.cols) as f64).sum::<f64>() / sel.len() as f64;
        (
            (cr, cc),
            (sel.len() as f64 / std::f64::consts::PI).sqrt(),
            t,
            sel.len(),
        )
    }
    fn annulus(&self, c: (f64, f64), lo: f64, hi: f64) -> Vec<u32> {
        let mut m = vec![0u32; self.det.len()];
        for i in 0..self.det.rows {
            for j in 0..self.det.cols {
                let d2 = (i as f64 - c.0).powi(2) + (j as f64 - c.1).powi(2);
                if lo * lo <= d2 && d2 <= hi * hi {
                    m[i * self.det.cols + j] = 1;
                }
            }
        }
        m
    }
}

fn naive(data: &[u32], scan: Shape2, det: Shape2, bin: usize) -> Naive {
    let (det, frames) = binned(data, scan.len(), det, bin);
    Naive {
        det,
        n: scan.len(),
        frames,
    }
}

/// Integer mask with weights 0..=3 that touches every detector edge and corner.
fn edge_mask(det: Shape2) -> Vec<u32> {
    (0..det.len())
        .map(|k| {
            let (i, j) = (k / det.cols, k % det.cols);
            if i == 0 || j == 0 || i == det.rows - 1 || j == det.cols - 1 {
                1 + (k % 3) as u32
            } else {
                ((k * 7) % 4 == 0) as u32
            }
        })
        .collect()
}

fn float_mask(det: Shape2) -> Vec<f64> {
    (0..det.len())
        .map(|k| {
            if k % 4 == 1 {
                0.0
            } else {
                ((k as f64) * 0.37).cos() * 1.7
            }
        })
        .collect()
}

/// Every product of `ds` against the naive reference `nv`.
fn check_all(ds: &Dataset, nv: &Naive) {
    let all: Vec<usize> = (0..nv.n).collect();
    assert_eq!(detector::sum_dp(ds).unwrap(), nv.sum(&all));
    let mean = detector::mean_dp(ds).unwrap();
    let want_mean: Vec<f32> = nv
        .sum(&all)
        .iter()
        .map(|&s| (s as f64 / nv.n as f64) as f32)
        .collect();
    assert_eq!(mean, want_mean);
    assert_eq!(detector::max_dp(ds).unwrap(), nv.max(&all));
    let m = detector::moments(ds).unwrap();
    let [s, r, c] = nv.moments();
    assert_eq!((m.sum, m.m_row, m.m_col), (s, r, c));
    for &z in &ZERO_FRAMES {
        assert_eq!(detector::moments(ds).unwrap().sum[z], 0);
    }
    let w = edge_mask(nv.det);
    assert_eq!(
        detector::virtual_image(ds, &DetectorMask::Int(w.clone())).unwrap(),
        VirtualImage::U64(nv.image(&w))
    );
    let wf = float_mask(nv.det);
    let VirtualImage::F64(got) =
        detector::virtual_image(ds, &DetectorMask::Float(wf.clone())).unwrap()
    else {
        panic!("a float mask gives a float image")
    };
    let e = rel_l2(&got, &nv.image_f(&wf));
    assert!(e <= 1e-12, "float mask rel L2 {e}");

    // The disk fit and every named detector.
    let (c0, r0, t0, n0) = nv.disk();
    let fit = detector::fit_disk(ds).unwrap();
    assert_eq!(fit.center_px, c0);
    assert_eq!(fit.radius_px, r0);
    assert_eq!(fit.threshold, t0);
    assert_eq!(fit.n_pixels, n0);
    assert!(fit.fitted);
    for (kind, lo, hi) in [
        (DetectorKind::Bf, 0.0, r0),
        (DetectorKind::Abf, r0 / 2.0, r0),
        (DetectorKind::Adf, r0, 2.0 * r0),
        (DetectorKind::Haadf, 2.0 * r0, 4.0 * r0),
        (DetectorKind::Df, r0, f64::INFINITY),
    ] {
        let im = detector::detector_image(ds, kind, &DetectorParams::default()).unwrap();
        let mask = nv.annulus(c0, lo, hi);
        assert_eq!(im.image, nv.image(&mask), "{kind}");
        assert_eq!((im.inner_px, im.outer_px), (lo, hi), "{kind}");
        assert_eq!(im.mask_pixels, mask.iter().filter(|&&b| b == 1).count());
        assert_eq!(im.scan_shape, ds.scan_shape());
        assert_eq!(im.disk, fit);
        let p = &im.provenance.params;
        assert_eq!(p["detector"]["mask_pixels"], im.mask_pixels);
        assert_eq!(p["disk"]["radius_px"], r0);
    }
    let p = DetectorParams {
        inner: Some(1.5),
        outer: Some(40.0),
        ..DetectorParams::default()
    };
    let im = detector::detector_image(ds, DetectorKind::Annular, &p).unwrap();
    assert_eq!(im.image, nv.image(&nv.annulus(c0, 1.5, 40.0)));

    // One fused pass gives the same as the single products.
    let which: Vec<Product> = [
        "bf", "adf", "df", "sum_dp", "mean_dp", "max_dp", "moments", "com", "bf",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let out = detector::products(ds, &which, &DetectorParams::default()).unwrap();
    assert_eq!(out.images.len(), 3, "bf asked twice is computed once");
    assert_eq!(out.images[0].kind, DetectorKind::Bf);
    assert_eq!(out.images[0].image, nv.image(&nv.annulus(c0, 0.0, r0)));
    assert_eq!(out.images[1].image, nv.image(&nv.annulus(c0, r0, 2.0 * r0)));
    assert_eq!(
        out.images[2].image,
        nv.image(&nv.annulus(c0, r0, f64::INFINITY))
    );
    assert_eq!(out.sum_dp.as_ref(), Some(&nv.sum(&all)));
    assert_eq!(out.mean_dp.as_ref(), Some(&want_mean));
    assert_eq!(out.max_dp.as_ref(), Some(&nv.max(&all)));
    let m = out.moments.as_ref().unwrap();
    assert_eq!(m.sum, nv.moments()[0]);
    assert_eq!(out.disk, Some(fit));
    let com = out.com.as_ref().unwrap();
    let want = qem::dpc::center_of_mass(ds, true).unwrap();
    assert_eq!((&com.com_row, &com.com_col), (&want.com_row, &want.com_col));
    assert_eq!(
        (com.unit.as_str(), com.zero_frames),
        (want.unit.as_str(), want.zero_frames)
    );
    assert_eq!(com.zero_frames, ZERO_FRAMES.len() as u64);
    serde_json::to_string(&out).expect("products serialise");
}

#[test]
fn dense_and_encoded_match_naive_loops_rect_scan_odd_detector() {
    let data = pattern(SCAN, DET, 65535);
    let nv = naive(&data, SCAN, DET, 1);
    let dense = load_cpu(&data, SCAN, DET, DType::U16, Representation::Dense, 1);
    let enc = load_cpu(&data, SCAN, DET, DType::U16, Representation::Encoded, 1);
    assert_eq!(enc.representation(), Representation::Encoded);
    // The fit finds the disk the pattern was made with.
    let fit = detector::fit_disk(&dense).unwrap();
    let (dr, dc) = (fit.center_px.0 - DISK_C.0, fit.center_px.1 - DISK_C.1);
    assert!(
        dr.hypot(dc) < 0.25 && (fit.radius_px - DISK_R).abs() < 0.3,
        "{fit:?}"
    );
    check_all(&dense, &nv);
    check_all(&enc, &nv);
    // ENCODED and dense give identical integers for the same request, frames selected too.
    let req = ReduceRequest {
        masks: vec![
            DetectorMask::Int(edge_mask(DET)),
            DetectorMask::Float(float_mask(DET)),
        ],
        sum_dp: true,
        max_dp: true,
        moments: true,
        frames: Some(vec![0, 3, 4, 33, 34]),
    };
    let a = detector::reduce(&dense, &req).unwrap();
    let b = detector::reduce(&enc, &req).unwrap();
    assert_eq!(a, b);
    let sel = [0usize, 3, 4, 33, 34];
    assert_eq!(a.n_frames, 5);
    assert_eq!(a.sum_dp, Some(nv.sum(&sel)));
    assert_eq!(a.max_dp, Some(nv.max(&sel)));
    let want: Vec<u64> = sel.iter().map(|&f| nv.image(&edge_mask(DET))[f]).collect();
    assert_eq!(a.images[0], VirtualImage::U64(want));
    let mom = nv.moments();
    let m = a.moments.unwrap();
    assert_eq!(m.m_col, sel.iter().map(|&f| mom[2][f]).collect::<Vec<_>>());
}

#[test]
fn many_frames_over_several_threads() {
    // 17 x 9 = 153 frames: three blocks of the CPU engine, merged across four threads.
    let scan = Shape2::new(17, 9);
    let data = pattern(scan, DET, 65535);
    let nv = naive(&data, scan, DET, 1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    pool.install(|| {
        for repr in [Representation::Dense, Representation::Encoded] {
            check_all(&load_cpu(&data, scan, DET, DType::U16, repr, 1), &nv);
        }
    });
}

#[test]
fn every_dtype_and_det_binning() {
    for (dtype, top) in [
        (DType::U8, 255),
        (DType::U16, 65535),
        (DType::U32, u32::MAX),
    ] {
        let data = pattern(SCAN, DET, top);
        let nv = naive(&data, SCAN, DET, 1);
        check_all(
            &load_cpu(&data, SCAN, DET, dtype, Representation::Dense, 1),
            &nv,
        );
        if dtype == DType::U8 {
            let enc = load_cpu(&data, SCAN, DET, dtype, Representation::Encoded, 1);
            assert_eq!(enc.dtype(), DType::U8);
            check_all(&enc, &nv);
        }
    }
    // det_bin 2 on 13 x 11 -> 7 x 6 with partial edge blocks; u8 source widened by the load.
    let data = pattern(SCAN, DET, 65535);
    let nv = naive(&data, SCAN, DET, 2);
    let ds = load_cpu(&data, SCAN, DET, DType::U16, Representation::Dense, 2);
    assert_eq!(ds.detector_shape(), Shape2::new(7, 6));
    check_all(&ds, &nv);
    // ENCODED and binned: u8 counts binned by 3 (partial edge blocks), stored as u16.
    let small: Vec<u32> = data.iter().map(|&v| v.min(60)).collect();
    let nv = naive(&small, SCAN, DET, 3);
    let params = LoadParams {
        det_bin: 3,
        dtype: DtypeRequest::U16,
        ..cpu_params(Representation::Encoded)
    };
    let ds = load_array(array(&small, DType::U8), SCAN, DET, &params);
    assert_eq!(ds.detector_shape(), Shape2::new(5, 4));
    check_all(&ds, &nv);
}

#[test]
fn scan_roi_and_frames() {
    let data = pattern(SCAN, DET, 65535);
    let nv = naive(&data, SCAN, DET, 1);
    for repr in [Representation::Dense, Representation::Encoded] {
        let ds = load_cpu(&data, SCAN, DET, DType::U16, repr, 1);
        // Rect: half-open rows 1..3, cols 5..7 (touching the scan edge).
        let roi = detector::roi_dp(&ds, &ScanRoi::Rect(Region::new(1, 3, 5, 7))).unwrap();
        let sel = [12usize, 13, 19, 20];
        assert_eq!(
            (roi.sum.clone(), roi.max.clone(), roi.n_frames),
            (nv.sum(&sel), nv.max(&sel), 4)
        );
        let mean = roi.mean();
        assert_eq!(mean[0], (nv.sum(&sel)[0] as f64 / 4.0) as f32);
        // Circle: positions with (r - 2)^2 + (c - 0.5)^2 <= 1.6^2, naive over the whole scan.
        let (r0, c0, rad) = (2.0, 0.5, 1.6);
        let sel: Vec<usize> = (0..SCAN.len())
            .filter(|&f| {
                let (r, c) = ((f / SCAN.cols) as f64, (f % SCAN.cols) as f64);
                (r - r0).powi(2) + (c - c0).powi(2) <= rad * rad
            })
            .collect();
        let roi = detector::roi_dp(
            &ds,
            &ScanRoi::Circle {
                center: (r0, c0),
                radius: rad,
            },
        )
        .unwrap();
        assert_eq!(roi.n_frames, sel.len() as u64);
        assert_eq!(roi.sum, nv.sum(&sel));
        assert_eq!(roi.max, nv.max(&sel));
        // Explicit positions: repeats count once, order does not matter.
        let roi = detector::roi_dp(
            &ds,
            &ScanRoi::Positions(vec![(4, 6), (0, 0), (4, 6), (3, 0)]),
        )
        .unwrap();
        let sel = [0usize, 21, 34];
        assert_eq!((roi.sum, roi.n_frames), (nv.sum(&sel), 3));
        // Errors: empty ROIs, positions outside.
        let e = detector::roi_dp(&ds, &ScanRoi::Positions(vec![])).unwrap_err();
        assert!(e.to_string().contains("no scan position"), "{e}");
        let e = detector::roi_dp(
            &ds,
            &ScanRoi::Circle {
                center: (-5.0, -5.0),
                radius: 1.0,
            },
        )
        .unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        let e = detector::roi_dp(&ds, &ScanRoi::Rect(Region::new(2, 2, 0, 3))).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        let e = detector::roi_dp(&ds, &ScanRoi::Positions(vec![(5, 0)])).unwrap_err();
        assert_eq!(e.found.as_deref(), Some("(5, 0)"), "{e}");
        // frames(): in the order given, dataset dtype.
        let got = detector::frames(&ds, &[(4, 6), (0, 1), (4, 6)]).unwrap();
        let DenseArray::U16(v) = got else {
            panic!("u16 frames")
        };
        let mut want = Vec::new();
        for f in [34usize, 1, 34] {
            want.extend(nv.frame(f).iter().map(|&x| x as u16));
        }
        assert_eq!(v, want);
        assert!(detector::frames(&ds, &[(0, 7)]).is_err());
        assert!(detector::frames(&ds, &[]).is_err());
    }
}

#[test]
fn overrides_units_and_calibration() {
    let data = pattern(SCAN, DET, 65535);
    let nv = naive(&data, SCAN, DET, 1);
    let ds = load_cpu(&data, SCAN, DET, DType::U16, Representation::Dense, 1);
    let (c0, r0, ..) = nv.disk();
    // Explicit centre and radius: no fit, recorded as not fitted; a corner centre touches edges.
    let p = DetectorParams {
        center: Some((0.0, 0.0)),
        radius: Some(5.0),
        ..DetectorParams::default()
    };
    let im = detector::detector_image(&ds, DetectorKind::Adf, &p).unwrap();
    assert!(!im.disk.fitted && im.disk.threshold.is_nan());
    assert_eq!(im.image, nv.image(&nv.annulus((0.0, 0.0), 5.0, 10.0)));
    assert_eq!(im.provenance.params["disk"]["center_source"], "argument");
    // Only the radius given: the centre is still fitted.
    let p = DetectorParams {
        radius: Some(2.0),
        ..DetectorParams::default()
    };
    let im = detector::detector_image(&ds, DetectorKind::Bf, &p).unwrap();
    assert_eq!((im.disk.center_px, im.disk.fitted), (c0, false));
    assert_eq!(im.image, nv.image(&nv.annulus(c0, 0.0, 2.0)));
    // mrad with the sampling given: 1 mrad at 0.5 mrad/px is 2 px.
    let p = DetectorParams {
        inner: Some(1.0),
        unit: Unit::Mrad,
        det_sampling_mrad: Some(0.5),
        ..DetectorParams::default()
    };
    let im = detector::detector_image(&ds, DetectorKind::Adf, &p).unwrap();
    assert_eq!((im.inner_px, im.outer_px), (2.0, 2.0 * r0));
    assert_eq!(im.image, nv.image(&nv.annulus(c0, 2.0, 2.0 * r0)));
    assert_eq!(im.provenance.params["detector"]["inner_mrad"], 1.0);
    // mrad with the semi-angle: the disk edge is the aperture edge, by the one rule SSB uses
    // (the sub-pixel edge of qem::calibration, not the masks' threshold radius r0).
    let p = DetectorParams {
        inner: Some(10.0),
        outer: Some(20.0),
        unit: Unit::Mrad,
        semiangle_mrad: Some(10.0),
        ..DetectorParams::default()
    };
    let im = detector::detector_image(&ds, DetectorKind::Annular, &p).unwrap();
    let edge = qem::calibration::disk_edge(&ds).unwrap().radius_px;
    let ssb = qem::calibration::detector_sampling(&ds, None, Some(10.0)).unwrap();
    assert!((im.inner_px - edge).abs() < 1e-12 && (im.outer_px - 2.0 * edge).abs() < 1e-12);
    assert!((10.0 / im.inner_px - ssb.mrad_per_px).abs() < 1e-12);
    assert!(
        (edge - r0).abs() > 0.01,
        "the edge {edge} differs from the threshold {r0}"
    );
    let source = im.provenance.params["calibration"]["sampling_source"]
        .as_str()
        .unwrap();
    assert!(source.contains("BF disk edge radius"), "{source}");
    // A radius the user gives is the disk's: no edge fit.
    let given = DetectorParams {
        radius: Some(4.0),
        ..p
    };
    let im = detector::detector_image(&ds, DetectorKind::Annular, &given).unwrap();
    assert_eq!((im.inner_px, im.outer_px), (4.0, 8.0));
    // A pattern with no edge to fit (flat) falls back to the threshold radius, and says so.
    let flat = vec![7u32; SCAN.len() * DET.len()];
    let fds = load_cpu(&flat, SCAN, DET, DType::U16, Representation::Dense, 1);
    assert!(qem::calibration::disk_edge(&fds).is_err());
    let im = detector::detector_image(&fds, DetectorKind::Annular, &p).unwrap();
    let r_flat = DET.rows.min(DET.cols) as f64 / 4.0; // the threshold fit of a flat pattern
    assert!((im.inner_px - r_flat).abs() < 1e-12, "{}", im.inner_px);
    let source = im.provenance.params["calibration"]["sampling_source"]
        .as_str()
        .unwrap();
    assert!(
        source.contains("threshold disk radius") && source.contains("no disk edge"),
        "{source}"
    );
    // mrad without any calibration is an error naming what is missing.
    let p = DetectorParams {
        inner: Some(10.0),
        unit: Unit::Mrad,
        ..DetectorParams::default()
    };
    let e = detector::detector_image(&ds, DetectorKind::Adf, &p).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(
        e.expected.as_deref().unwrap().contains("det_sampling_mrad"),
        "{e}"
    );
    assert_eq!(e.found.as_deref(), Some("none of them"));
    // Annular needs both bounds; bad numbers are refused.
    let e = detector::detector_image(&ds, DetectorKind::Annular, &DetectorParams::default())
        .unwrap_err();
    assert_eq!(e.expected.as_deref(), Some("inner and outer"), "{e}");
    for p in [
        DetectorParams {
            inner: Some(3.0),
            outer: Some(2.0),
            ..DetectorParams::default()
        },
        DetectorParams {
            radius: Some(-1.0),
            ..DetectorParams::default()
        },
        DetectorParams {
            center: Some((f64::NAN, 1.0)),
            ..DetectorParams::default()
        },
    ] {
        assert!(
            detector::detector_image(&ds, DetectorKind::Adf, &p).is_err(),
            "{p:?}"
        );
    }
    // inner/outer with several detectors in one products() call is ambiguous.
    let p = DetectorParams {
        inner: Some(1.0),
        ..DetectorParams::default()
    };
    let which = [
        Product::Det(DetectorKind::Bf),
        Product::Det(DetectorKind::Adf),
    ];
    assert!(detector::products(&ds, &which, &p).is_err());
    let one = detector::products(&ds, &which[1..], &p).unwrap();
    assert_eq!(
        one.images[0].image,
        nv.image(&nv.annulus(c0, 1.0, 2.0 * r0))
    );
    // Names.
    assert!("ADF".parse::<DetectorKind>().is_ok());
    let e = "virtual".parse::<Product>().unwrap_err();
    assert!(e.expected.as_deref().unwrap().contains("sum_dp"), "{e}");
    assert!(detector::products(&ds, &[], &DetectorParams::default()).is_err());
}

#[test]
fn metadata_angular_sampling_scales_with_det_bin() {
    use qem_io::writer::{Calibration, WriteParams};
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(SCAN, DET, 65535);
    let params = WriteParams {
        frames_per_file: 16,
        calibration: Calibration {
            angular_sampling_mrad: Some((0.25, 0.25)),
            ..Calibration::default()
        },
        ..common::write_params(dir.path(), SCAN, DET, DType::U16)
    };
    let master = common::write_data(&params, &data);
    for bin in [1usize, 2] {
        let ds = load_path(
            &master,
            &LoadParams {
                backend: BackendRequest::Cpu,
                det_bin: bin,
                ..LoadParams::default()
            },
        )
        .unwrap();
        let nv = naive(&data, SCAN, DET, bin);
        let (c0, r0, ..) = nv.disk();
        // 1.0 mrad is 4 px at 0.25 mrad/px, 2 px at 0.5 mrad/px (binned by 2).
        let p = DetectorParams {
            inner: Some(1.0),
            unit: Unit::Mrad,
            ..DetectorParams::default()
        };
        let im = detector::detector_image(&ds, DetectorKind::Df, &p).unwrap();
        let px = 4.0 / bin as f64;
        assert_eq!(im.inner_px, px);
        assert_eq!(im.image, nv.image(&nv.annulus(c0, px, f64::INFINITY)));
        // Unit px still records the mrad bounds when the sampling is known.
        let im =
            detector::detector_image(&ds, DetectorKind::Bf, &DetectorParams::default()).unwrap();
        let want = r0 * 0.25 * bin as f64;
        let got = im.provenance.params["detector"]["outer_mrad"]
            .as_f64()
            .unwrap();
        assert!((got - want).abs() < 1e-12, "{got} {want}");
    }
    // Issue 18: the dataset's metadata describes the loaded grid, not the source's (a scan
    // region and det_bin = 2 used to leave the source's detector shape, beam centre and
    // sampling in `ds.metadata`, a 2x calibration error for anyone passing it on). The writer
    // puts the beam centre at ((13 - 1)/2, (11 - 1)/2) = (6, 5) source pixels.
    let ds = load_path(
        &master,
        &LoadParams {
            backend: BackendRequest::Cpu,
            scan_region: Some(qem::Region::new(1, 4, 2, 6)),
            det_bin: 2,
            ..LoadParams::default()
        },
    )
    .unwrap();
    let md = ds.metadata();
    assert_eq!(md.scan_shape, Some(Shape2::new(3, 4)));
    assert_eq!(md.n_frames, Some(12));
    assert_eq!(md.detector_shape, Some(ds.detector_shape()));
    assert_eq!(ds.detector_shape(), Shape2::new(7, 6)); // a partial last bin
    assert_eq!(md.angular_sampling_mrad, Some((0.5, 0.5)));
    assert_eq!(md.beam_center_px, Some((2.75, 2.25)));
    let px = md.pixel_size_m.unwrap();
    // The file stores the pixel pitch as f32.
    assert!(
        (px.0 / 150e-6 - 1.0).abs() < 1e-6 && (px.1 / 150e-6 - 1.0).abs() < 1e-6,
        "{px:?}"
    );
    // A detector region moves the centre; a .qem of it reopens with the same (loaded-grid)
    // metadata (binned u16 data widens to u32, which .qem does not hold, so bin 1 here).
    let ds = load_path(
        &master,
        &LoadParams {
            backend: BackendRequest::Cpu,
            detector_region: Some(qem::Region::new(2, 13, 1, 11)),
            ..LoadParams::default()
        },
    )
    .unwrap();
    assert_eq!(ds.metadata().beam_center_px, Some((4.0, 4.0)));
    let q = dir.path().join("region.qem");
    qem::save(&ds, &q, &qem::NoProgress).unwrap();
    let back = load_path(
        &q,
        &LoadParams {
            backend: BackendRequest::Cpu,
            ..LoadParams::default()
        },
    )
    .unwrap();
    assert_eq!(back.metadata().beam_center_px, Some((4.0, 4.0)));
    assert_eq!(back.metadata().angular_sampling_mrad, Some((0.25, 0.25)));
    assert_eq!(back.metadata().detector_shape, Some(Shape2::new(11, 10)));
}

#[test]
fn errors_name_what_was_expected_and_found() {
    let data = pattern(SCAN, DET, 65535);
    let mut ds = load_cpu(&data, SCAN, DET, DType::U16, Representation::Encoded, 1);
    let e = detector::virtual_image(&ds, &DetectorMask::Int(vec![1; 10])).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert_eq!(e.expected.as_deref(), Some("143 weights"), "{e}");
    assert_eq!(e.found.as_deref(), Some("10 weights"), "{e}");
    assert!(e.to_string().contains("virtual_image"), "{e}");
    let e = detector::reduce(
        &ds,
        &ReduceRequest {
            sum_dp: true,
            frames: Some(vec![2, 35]),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.found.as_deref(), Some("35"), "{e}");
    ds.close();
    assert!(detector::sum_dp(&ds).is_err());
    assert!(detector::products(&ds, &[Product::SumDp], &DetectorParams::default()).is_err());
}

#[test]
fn disk_fit_is_cached_and_reused_by_products() {
    let data = pattern(SCAN, DET, 65535);
    let ds = load_cpu(&data, SCAN, DET, DType::U16, Representation::Dense, 1);
    let a = detector::products(
        &ds,
        &[Product::Det(DetectorKind::Bf)],
        &DetectorParams::default(),
    )
    .unwrap();
    assert_eq!(
        a.images[0].provenance.params["disk"]["sum_dp_cached"],
        false
    );
    let b = detector::products(
        &ds,
        &[Product::Det(DetectorKind::Bf), Product::SumDp],
        &DetectorParams::default(),
    )
    .unwrap();
    assert_eq!(b.images[0].provenance.params["disk"]["sum_dp_cached"], true);
    assert_eq!(b.provenance.params["sum_dp_from_cache"], true);
    assert_eq!(a.images[0].image, b.images[0].image);
    let nv = naive(&data, SCAN, DET, 1);
    assert_eq!(b.sum_dp, Some(nv.sum(&(0..SCAN.len()).collect::<Vec<_>>())));
    // A flat pattern falls back to the detector centre (real division) and min/4.
    let flat = vec![3u32; SCAN.len() * DET.len()];
    let ds = load_cpu(&flat, SCAN, DET, DType::U16, Representation::Dense, 1);
    let fit = detector::fit_disk(&ds).unwrap();
    assert_eq!(
        (fit.center_px, fit.radius_px, fit.n_pixels),
        ((6.5, 5.5), 2.75, 0)
    );
}

/// With a GPU: the CUDA arms give the CPU's integers or a typed error (never a panic). Without
/// one, a CUDA dataset cannot be made, and this test has nothing to check.
#[test]
fn cuda_arms_match_the_cpu() {
    if qem::resolve_backend(BackendRequest::Cuda).is_err() {
        eprintln!("no usable CUDA device: CUDA arms not exercised");
        return;
    }
    let data = pattern(SCAN, DET, 65535);
    let cpu = load_cpu(&data, SCAN, DET, DType::U16, Representation::Dense, 1);
    let req = ReduceRequest {
        masks: vec![DetectorMask::Int(edge_mask(DET))],
        sum_dp: true,
        max_dp: true,
        moments: true,
        frames: None,
    };
    let want = detector::reduce(&cpu, &req).unwrap();
    for repr in [Representation::Dense, Representation::Encoded] {
        let params = LoadParams {
            backend: BackendRequest::Cuda,
            ..cpu_params(repr)
        };
        let gpu = load_array(array(&data, DType::U16), SCAN, DET, &params);
        // With a usable device every CUDA arm must compute the CPU's result: an error fails
        // (every_engine.rs runs the same on every engine present).
        let got = detector::reduce(&gpu, &req)
            .unwrap_or_else(|e| panic!("CUDA {repr:?} reduction failed: {e}"));
        assert_eq!(got, want, "{repr:?}");
    }
}
