//! Concurrency and memory: the LRU releasing the older acquisition within a budget; stop;
//! clients that left. (1,000 concurrent requests and bounded resident memory live in their own
//! test binary, `serve_memory.rs`: resident memory is per process.)

use crate::common::*;
use qem_serve::{ServeOptions, ServeRoot};
use std::sync::Arc;

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

/// A shared dataset whose first use waits at a gate, and which counts its uses.
#[derive(Debug)]
struct Gated {
    ds: qem::Dataset,
    calls: std::sync::atomic::AtomicUsize,
    open: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl qem_serve::SharedDataset for Gated {
    fn with_dataset(&self, f: &mut dyn FnMut(&qem::Dataset)) -> qem::Result<()> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
        drop(open);
        f(&self.ds);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_of_clients_that_left_never_compute() {
    let dir = tempfile::tempdir().expect("tmp");
    write_acquisition(dir.path(), "scan", SCAN, DET);
    let ds = load_cpu(&dir.path().join("scan_master.h5"));
    let gated = Arc::new(Gated {
        ds,
        calls: Default::default(),
        open: std::sync::Mutex::new(true),
        cv: Default::default(),
    });
    let root = ServeRoot::Dataset {
        name: "gated".into(),
        handle: gated.clone(),
    };
    let s = Arc::new(TestServer::start(root, cpu_opts()));
    let id = s.first_id().await;
    let calls = || gated.calls.load(std::sync::atomic::Ordering::SeqCst);
    let base = calls(); // start() and the listing read the dataset too
    *gated.open.lock().unwrap() = false;
    // One request takes the device and waits at the gate.
    let first = {
        let (s, id) = (Arc::clone(&s), id.clone());
        tokio::spawn(async move {
            s.get(&format!("/api/v1/acquisitions/{id}/frame?r=0&c=0"))
                .await
        })
    };
    while calls() == base {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Twenty more queue behind it; their clients give up after 300 ms.
    let mut set = tokio::task::JoinSet::new();
    for i in 0..20 {
        let (s, id) = (Arc::clone(&s), id.clone());
        set.spawn(async move {
            let url = format!(
                "{}/api/v1/acquisitions/{id}/frame?r={}&c=0",
                s.base,
                i % SCAN.0
            );
            let rb = s
                .client
                .get(url)
                .bearer_auth(s.token.clone().unwrap_or_default());
            rb.timeout(std::time::Duration::from_millis(300))
                .send()
                .await
                .is_err()
        });
    }
    let mut timed_out = 0;
    while let Some(j) = set.join_next().await {
        timed_out += usize::from(j.expect("task"));
    }
    assert_eq!(timed_out, 20);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    *gated.open.lock().unwrap() = true;
    gated.cv.notify_all();
    assert_eq!(first.await.expect("first").status, 200);
    // One more request computes; the twenty abandoned ones never reached the dataset.
    assert_eq!(
        s.get(&format!("/api/v1/acquisitions/{id}/frame?r=1&c=1"))
            .await
            .status,
        200
    );
    assert_eq!(calls(), base + 2, "abandoned requests were computed");
}
