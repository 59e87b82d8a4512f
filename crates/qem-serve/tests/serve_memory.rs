//! 1,000 concurrent requests with no error and bounded growth of resident memory. Its own test
//! binary: `VmRSS` is per process, and the other serve tests running beside it in one binary
//! would count their own allocations as this test's growth.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

#[path = "serve/common.rs"]
mod common;

use common::*;
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
