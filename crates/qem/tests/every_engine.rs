//! Engine-level cases run on every engine present (issue 18, item 6): the CPU engine always,
//! the CUDA engine wherever a device is usable, each in both representations. The CPU engine's
//! DENSE result is the reference, computed independently of the engine under test. An engine
//! that is not present answers `BackendUnavailable` at load; any other error — on any engine —
//! fails the test (a CUDA arm can no longer pass by failing).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

mod common;

use qem::detector::{self, DetectorMask};
use qem::dpc;
use qem::{
    BackendRequest, DType, Dataset, DenseArray, ErrorKind, LoadParams, Region, Representation,
    Shape2,
};
use qem_core::ReduceRequest;

/// A rectangular scan and an odd detector (partial bitshuffle blocks, rows ≠ columns); the
/// counts are [`common::disk_counts`], its disk centred on `(7, 6)`.
const SCAN: Shape2 = Shape2::new(6, 9);
const DET: Shape2 = Shape2::new(15, 13);

/// One engine arm: a backend and a representation.
#[derive(Debug, Clone, Copy)]
struct Arm {
    backend: BackendRequest,
    representation: Representation,
}

impl Arm {
    const ALL: [Arm; 4] = [
        Arm {
            backend: BackendRequest::Cpu,
            representation: Representation::Dense,
        },
        Arm {
            backend: BackendRequest::Cpu,
            representation: Representation::Encoded,
        },
        Arm {
            backend: BackendRequest::Cuda,
            representation: Representation::Dense,
        },
        Arm {
            backend: BackendRequest::Cuda,
            representation: Representation::Encoded,
        },
    ];

    fn load(&self, scan_region: Option<Region>) -> qem::Result<Dataset> {
        let params = LoadParams {
            backend: self.backend,
            representation: Some(self.representation),
            scan_region,
            ..LoadParams::default()
        };
        let data = DenseArray::U16(common::disk_counts(SCAN, DET));
        common::try_load_array(data, SCAN, DET, &params)
    }
}

/// Run `case` on every arm whose engine is present and compare with the CPU DENSE arm's
/// result. Returns how many arms ran. Only a `BackendUnavailable` error at load skips an arm.
fn on_every_engine<T: PartialEq + std::fmt::Debug>(
    what: &str,
    scan_region: Option<Region>,
    case: impl Fn(&Dataset) -> qem::Result<T>,
) -> usize {
    let reference = Arm::ALL[0]
        .load(scan_region)
        .and_then(|ds| case(&ds))
        .unwrap_or_else(|e| panic!("{what}: the CPU reference failed: {e}"));
    let mut ran = 0;
    for arm in Arm::ALL {
        let ds = match arm.load(scan_region) {
            Ok(ds) => ds,
            Err(e) if e.kind == ErrorKind::BackendUnavailable => continue,
            Err(e) => panic!("{what} on {arm:?}: load failed: {e}"),
        };
        assert_eq!(ds.dtype(), DType::U16, "{what} on {arm:?}");
        let got = case(&ds).unwrap_or_else(|e| panic!("{what} on {arm:?}: {e}"));
        assert_eq!(
            got, reference,
            "{what} on {arm:?} differs from the CPU engine"
        );
        ran += 1;
    }
    ran
}

/// The CPU arms always run; CUDA ones exactly when the CUDA backend resolves.
fn expected_arms() -> usize {
    match qem::resolve_backend(BackendRequest::Cuda) {
        Ok(_) => 4,
        Err(e) if e.kind == ErrorKind::BackendUnavailable => 2,
        Err(e) => panic!("resolving CUDA gave an error other than 'unavailable': {e}"),
    }
}

fn ring_mask() -> Vec<u32> {
    (0..DET.len())
        .map(|k| {
            let (i, j) = ((k / DET.cols) as f64, (k % DET.cols) as f64);
            let r2 = (i - 7.0).powi(2) + (j - 6.0).powi(2);
            u32::from((9.0..=30.0).contains(&r2)) * (1 + (k % 3) as u32)
        })
        .collect()
}

#[test]
fn reductions_match_the_cpu_engine_on_every_engine() {
    let req = ReduceRequest {
        masks: vec![
            DetectorMask::Int(ring_mask()),
            DetectorMask::Int((0..DET.len()).map(|k| u32::from(k % 2 == 0)).collect()),
        ],
        sum_dp: true,
        max_dp: true,
        moments: true,
        frames: None,
    };
    let region = Some(Region::new(1, 5, 2, 9));
    for r in [None, region] {
        let ran = on_every_engine("reduce", r, |ds| detector::reduce(ds, &req));
        assert_eq!(ran, expected_arms());
    }
}

#[test]
fn frames_match_the_cpu_engine_on_every_engine() {
    let positions = [(0, 0), (5, 8), (2, 3), (3, 7)];
    let ran = on_every_engine("frames", None, |ds| {
        detector::frames(ds, &positions).map(|a| match a {
            DenseArray::U16(v) => v,
            other => panic!("frames came back as {:?}", other.dtype()),
        })
    });
    assert_eq!(ran, expected_arms());
}

#[test]
fn center_of_mass_matches_the_cpu_engine_on_every_engine() {
    // Built from the exact integer moments, so equal to the last bit on every engine.
    let ran = on_every_engine("center of mass", None, |ds| {
        dpc::center_of_mass(ds, true).map(|c| {
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&c.com_row), bits(&c.com_col), c.zero_frames)
        })
    });
    assert_eq!(ran, expected_arms());
}

#[test]
fn a_bad_request_is_the_same_typed_error_on_every_engine() {
    // A mask of the wrong size: every engine refuses it with InvalidArgument, none panics or
    // computes something.
    let req = ReduceRequest {
        masks: vec![DetectorMask::Int(vec![1; DET.len() - 1])],
        sum_dp: false,
        max_dp: false,
        moments: false,
        frames: None,
    };
    let ran = on_every_engine("bad mask", None, |ds| {
        Ok(detector::reduce(ds, &req).map_err(|e| e.kind).err())
    });
    assert_eq!(ran, expected_arms());
    let ds = Arm::ALL[0].load(None).unwrap();
    assert_eq!(
        detector::reduce(&ds, &req).unwrap_err().kind,
        ErrorKind::InvalidArgument
    );
}
