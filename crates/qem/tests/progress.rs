//! Detector passes with a progress observer ([`qem::progress::with_progress`]) run in blocks of
//! frames: every block is reported, a cancellation stops the pass, and the products equal
//! those of the one-call pass value for value (dense and ENCODED, a scan that the blocks do
//! not divide).
#![allow(clippy::expect_used, clippy::unwrap_used)] // tests may panic on setup failures

mod common;

use common::{load_array, mix};
use qem::detector::{self, DetectorParams, Product};
use qem::{BackendRequest, DenseArray, LoadParams, Progress, Representation, Shape2};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Recorder {
    stages: Mutex<Vec<(String, u64)>>,
    done: AtomicU64,
    advances: AtomicU64,
    cancel: AtomicBool,
}

impl Progress for Recorder {
    fn begin(&self, what: &str, total: u64) {
        self.stages.lock().unwrap().push((what.to_string(), total));
    }
    fn advance(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
        self.advances.fetch_add(1, Ordering::Relaxed);
    }
    fn end(&self) {}
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// A 47 × 61 scan (2,867 frames: three blocks of 1,024, the last partial) of 9 × 11 frames.
fn dataset(repr: Representation) -> qem::Dataset {
    let scan = Shape2::new(47, 61);
    let det = Shape2::new(9, 11);
    let data: Vec<u16> = (0..scan.len() as u64)
        .flat_map(|f| (0..det.len()).map(move |p| (mix(f, p) % 900) as u16))
        .collect();
    let params = LoadParams {
        backend: BackendRequest::Cpu,
        representation: Some(repr),
        ..LoadParams::default()
    };
    load_array(DenseArray::U16(data), scan, det, &params)
}

fn all_products() -> Vec<Product> {
    ["bf", "adf", "sum_dp", "max_dp", "moments", "com"]
        .iter()
        .map(|n| n.parse::<Product>().unwrap())
        .collect()
}

#[test]
fn blocked_pass_equals_one_pass_and_reports_every_frame() {
    for repr in [Representation::Dense, Representation::Encoded] {
        let which = all_products();
        let p = DetectorParams::default();
        let plain = detector::products(&dataset(repr), &which, &p).unwrap();
        let rec = Arc::new(Recorder::default());
        let ds = dataset(repr);
        let watched = qem::progress::with_progress(rec.clone(), "detector.products", || {
            detector::products(&ds, &which, &p)
        })
        .unwrap();
        assert_eq!(plain.images.len(), watched.images.len());
        for (a, b) in plain.images.iter().zip(&watched.images) {
            assert_eq!(a.image, b.image, "{repr:?} {:?}", a.kind);
        }
        assert_eq!(plain.sum_dp, watched.sum_dp);
        assert_eq!(plain.max_dp, watched.max_dp);
        assert_eq!(plain.moments, watched.moments);
        let (pc, wc) = (plain.com.unwrap(), watched.com.unwrap());
        assert_eq!(pc.com_row, wc.com_row);
        assert_eq!(pc.com_col, wc.com_col);
        // The disk fit's sum-DP pass and the products pass, each over every frame.
        let stages = rec.stages.lock().unwrap().clone();
        assert_eq!(
            stages,
            vec![
                ("detector.products".to_string(), 2867),
                ("detector.products".to_string(), 2867)
            ],
            "{repr:?}"
        );
        assert_eq!(rec.done.load(Ordering::Relaxed), 2 * 2867);
        assert_eq!(rec.advances.load(Ordering::Relaxed), 2 * 3);
    }
}

#[test]
fn cancelled_pass_stops_with_an_error() {
    let rec = Arc::new(Recorder::default());
    rec.cancel.store(true, Ordering::Relaxed);
    let ds = dataset(Representation::Dense);
    let err =
        qem::progress::with_progress(rec.clone(), "detector.sum_dp", || detector::sum_dp(&ds))
            .unwrap_err();
    assert!(err.to_string().contains("cancelled"), "{err}");
    assert_eq!(rec.done.load(Ordering::Relaxed), 0);
}
