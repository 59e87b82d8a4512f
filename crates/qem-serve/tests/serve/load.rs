//! Concurrency and memory: 1,000 concurrent requests with no error and bounded growth of the
//! process's resident memory; the LRU releasing the older acquisition within a budget; stop.

use crate::common::*;
use qem_serve::{ServeOptions, ServeRoot};
use std::sync::Arc;

/// `VmRSS` of this process, bytes.
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .expect("status")
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_requests_no_error_bounded_memory() {
    let dir = tempfile::tempdir().expect("tmp");
    let (s, data) = TestServer::fixture(dir.path());
    let id = s.first_id().await;
    // Warm up: load, caches, a first connection.
    assert_eq!(
        s.get(&format!("/api/v1/acquisitions/{id}/virtual?mode=bf"))
            .await
            .status,
        200
    );
    let before = rss();
    let s = Arc::new(s);
    let mut set = tokio::task::JoinSet::new();
    for i in 0..1000usize {
        let s = Arc::clone(&s);
        let id = id.clone();
        set.spawn(async move {
            let (r, c) = (i % SCAN.0, (i / SCAN.0) % SCAN.1);
            let q = match i % 4 {
                0 => format!("frame?r={r}&c={c}"),
                1 => format!("frame?r={r}&c={c}&det_bin=2"),
                2 => format!("virtual?mode=disk&cr={}&cc=8&radius=4&det_bin=1", 6 + i % 8),
                _ => format!(
                    "virtual?mode=annulus&cr=5&cc=4&inner=1&outer={}&det_bin=2",
                    2 + i % 4
                ),
            };
            let a = s.get(&format!("/api/v1/acquisitions/{id}/{q}")).await;
            (i, r, c, a)
        });
    }
    let mut errors = 0;
    while let Some(j) = set.join_next().await {
        let (i, r, c, a) = j.expect("task");
        if a.status != 200 {
            errors += 1;
        } else if i % 4 == 0 {
            assert_eq!(le_u16(&a.body), frame(&data, DET, r * SCAN.1 + c));
        }
    }
    assert_eq!(errors, 0);
    let growth = rss().saturating_sub(before);
    // 1,000 answers of at most 1.5 KiB each and their connections: far below 64 MiB unless
    // something keeps per-request state.
    assert!(growth < 64 << 20, "resident memory grew by {growth} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lru_releases_the_older_acquisition_within_the_budget() {
    let dir = tempfile::tempdir().expect("tmp");
    write_acquisition(dir.path(), "a", SCAN, DET);
    write_acquisition(dir.path(), "b", SCAN, DET);
    let one = (SCAN.0 * SCAN.1 * DET.0 * DET.1 * 2) as u64;
    let opts = ServeOptions {
        memory_budget: Some(one + one / 2),
        representation: Some(qem::Representation::Dense),
        ..cpu_opts()
    };
    let s = TestServer::start(ServeRoot::Path(dir.path().to_path_buf()), opts);
    let list = || async { s.get("/api/v1/acquisitions").await.json() };
    let l = list().await;
    let ids: Vec<String> = (0..2)
        .map(|i| l[i]["id"].as_str().expect("id").to_string())
        .collect();
    let loaded = |l: &serde_json::Value| -> Vec<bool> {
        (0..2)
            .map(|i| l[i]["loaded"].as_bool().expect("loaded"))
            .collect()
    };
    assert_eq!(loaded(&l), vec![false, false]);
    assert_eq!(
        s.get(&format!("/api/v1/acquisitions/{}/dp", ids[0]))
            .await
            .status,
        200
    );
    let l = list().await;
    assert_eq!(loaded(&l), vec![true, false]);
    assert_eq!(l[0]["nbytes_resident"].as_u64(), Some(one));
    assert_eq!(
        s.get(&format!("/api/v1/acquisitions/{}/dp", ids[1]))
            .await
            .status,
        200
    );
    assert_eq!(loaded(&list().await), vec![false, true]);
    let c = s.get("/api/v1/capabilities").await.json();
    assert_eq!(c["memory"]["resident_bytes"].as_u64(), Some(one));
    // Larger than the whole budget: refused with memory_budget.
    let small = ServeOptions {
        memory_budget: Some(one / 2),
        representation: Some(qem::Representation::Dense),
        ..cpu_opts()
    };
    let t = TestServer::start(ServeRoot::Path(dir.path().join("a_master.h5")), small);
    let id = t.first_id().await;
    t.get(&format!("/api/v1/acquisitions/{id}/dp"))
        .await
        .assert_error(507, "memory_budget");
}

#[test]
fn stop_frees_the_port_and_wait_returns() {
    let dir = tempfile::tempdir().expect("tmp");
    write_acquisition(dir.path(), "scan", (2, 2), (4, 4));
    let s = Arc::new(
        qem_serve::start(ServeRoot::Path(dir.path().to_path_buf()), cpu_opts()).expect("start"),
    );
    let addr = s.addr();
    let waiter = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || s.wait())
    };
    s.stop();
    waiter.join().expect("wait returned");
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "still listening after stop"
    );
}
